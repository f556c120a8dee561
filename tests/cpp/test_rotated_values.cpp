// Rotated Lloyd-Max values (config.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX, DESIGN.md
// "Rotated Lloyd-Max values") through the public C API, against a float64 reference written here
// from the definition: an explicit Sylvester-Hadamard matrix per power-of-two block, the signs of
// the documented Philox stream, nearest-level codes and the norm-correcting scale.
#include <bit>

#include "sketch.hpp"
#include "testing.hpp"

namespace {

// The Lloyd-Max levels for N(0,1) that DESIGN.md lists, as fp32 numbers.
std::vector<float> levels(uint32_t bits) {
  switch (bits) {
    case 2: return {-1.5104f, -0.4528f, 0.4528f, 1.5104f};
    case 3: return {-2.1520f, -1.3440f, -0.7560f, -0.2451f, 0.2451f, 0.7560f, 1.3440f, 2.1520f};
    default:
      return {-2.7326f, -2.0690f, -1.6180f, -1.2562f, -0.9424f, -0.6568f, -0.3881f, -0.1284f,
              0.1284f,  0.3881f,  0.6568f,  0.9424f,  1.2562f,  1.6180f,  2.0690f,  2.7326f};
  }
}

// The rotation R = H·diag(s) as a dense float64 matrix [d][d].
std::vector<double> rotation_matrix(uint32_t d, uint64_t seed, uint32_t layer) {
  std::vector<double> R(size_t(d) * d, 0.0);
  const qjlkv::Philox4x32 philox{{uint32_t(seed), uint32_t(seed >> 32)}};
  std::vector<double> s(d);
  for (uint32_t j = 0; j < d; ++j) {
    const uint32_t counter[4] = {j, 0, layer, 0x56524F54u};
    uint32_t r[4];
    philox(counter, r);
    s[j] = r[0] & 1u ? -1.0 : 1.0;
  }
  for (uint32_t start = 0; start < d;) {
    uint32_t n = 1;
    while (2 * n <= d - start) n *= 2;  // the largest power of two that fits
    for (uint32_t i = 0; i < n; ++i)
      for (uint32_t j = 0; j < n; ++j)
        R[size_t(start + i) * d + start + j] = (std::popcount(i & j) % 2 ? -1.0 : 1.0) / std::sqrt(double(n)) * s[start + j];
    start += n;
  }
  return R;
}

struct TokenRef {
  std::vector<double> value;  // R^T (level[c]·scale)
  bool ambiguous = false;     // a coordinate lies within rounding of a midpoint: codes may differ
};

TokenRef reference_token(const std::vector<double> &R, uint32_t d, uint32_t bits, const float *x) {
  const std::vector<float> lv = levels(bits);
  std::vector<double> y(d, 0.0);
  for (uint32_t i = 0; i < d; ++i)
    for (uint32_t j = 0; j < d; ++j) y[i] += R[size_t(i) * d + j] * x[j];
  double n2 = 0.0;
  for (double v : y) n2 += v * v;
  TokenRef ref;
  ref.value.assign(d, 0.0);
  if (n2 == 0.0) return ref;
  const double norm = std::sqrt(n2);
  std::vector<double> level(d);
  double level2 = 0.0;
  for (uint32_t i = 0; i < d; ++i) {
    const double u = y[i] / norm * std::sqrt(double(d));
    uint32_t code = 0;
    for (size_t c = 0; c + 1 < lv.size(); ++c) {
      const double mid = 0.5 * (double(lv[c]) + double(lv[c + 1]));
      if (std::abs(u - mid) < 1e-5) ref.ambiguous = true;  // fp32 rounding may pick either code
      code += u > mid;
    }
    level[i] = lv[code];
    level2 += level[i] * level[i];
  }
  const double exact_scale = norm / std::sqrt(level2);
  const double scale = qt::fp16_value(float(exact_scale));  // round to nearest
  // Within fp32 rounding of an fp16 rounding boundary the library may round the other way.
  if (qt::fp16_value(float(exact_scale * (1 + 1e-5))) != qt::fp16_value(float(exact_scale * (1 - 1e-5))))
    ref.ambiguous = true;
  for (uint32_t j = 0; j < d; ++j)
    for (uint32_t i = 0; i < d; ++i) ref.value[j] += R[size_t(i) * d + j] * level[i] * scale;
  return ref;
}

qjlkv_config rotated_config(uint32_t d, uint32_t bits, uint32_t hq, uint32_t hkv) {
  qjlkv_config cfg = qt::make_config("exact", 2, hq, hkv, d);
  cfg.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
  cfg.value_bits = bits;
  cfg.block_tokens = 16;
  cfg.residual_tokens = 4;
  cfg.seed = 0x1234567890abcdefull;
  return cfg;
}

// reconstruct == the reference for every quantized token, in every head dimension kind (one
// power-of-two block, several blocks) and bit width; the tail stays exact.
TEST(RotatedValues, ReconstructEqualsReference) {
  for (uint32_t d : {64u, 40u, 96u}) {
    for (uint32_t bits : {2u, 3u, 4u}) {
      SCOPED_TRACE("d=" + std::to_string(d) + " bits=" + std::to_string(bits));
      const uint32_t hkv = 2, tokens = 53, layer = 1;
      const qjlkv_config cfg = rotated_config(d, bits, 2, hkv);
      qt::Cache cache = qt::make_cache(cfg);
      ASSERT_TRUE(cache);
      qt::Rng rng(d * 10 + bits);
      std::vector<float> keys = rng.normals(size_t(tokens) * hkv * d), values = rng.normals(keys.size(), 3.0f);
      for (uint32_t j = 0; j < d; ++j) values[j] = 0.0f;  // a zero vector: scale 0, decodes to 0
      QT_ASSERT_OK(qjlkv_cache_append(cache.get(), layer, 0, tokens, keys.data(), values.data()));
      std::vector<float> v_hat(values.size());
      QT_ASSERT_OK(qjlkv_cache_reconstruct(cache.get(), layer, 0, 0, tokens, nullptr, v_hat.data()));
      const std::vector<double> R = rotation_matrix(d, cfg.seed, layer);
      const uint64_t quantized = qt::quantized_positions(tokens, cfg.block_tokens, cfg.residual_tokens);
      ASSERT_EQ(quantized, 48u);
      size_t bad = 0, ambiguous = 0;
      double norm_error = 0.0;
      for (uint64_t t = 0; t < tokens; ++t)
        for (uint32_t h = 0; h < hkv; ++h) {
          const float *x = &values[(t * hkv + h) * d], *got = &v_hat[(t * hkv + h) * d];
          if (t >= quantized) {
            for (uint32_t j = 0; j < d; ++j) bad += got[j] != x[j];
            continue;
          }
          const TokenRef ref = reference_token(R, d, bits, x);
          if (ref.ambiguous) {
            ++ambiguous;
            continue;
          }
          const double scale = qt::norm(x, d) + 1e-30;
          for (uint32_t j = 0; j < d; ++j) bad += std::abs(got[j] - ref.value[j]) > 1e-5 * scale;
          // Norm correction: ‖x̂‖ = ‖x‖ up to the fp16 rounding of the scale (2^-11).
          if (qt::norm(x, d) > 0) norm_error = std::max(norm_error, std::abs(qt::norm(got, d) / qt::norm(x, d) - 1.0));
        }
      EXPECT_EQ(bad, 0u);
      EXPECT_LT(ambiguous, 10u) << "the reference check must cover nearly every one of the 96 tokens";
      EXPECT_LT(norm_error, 0x1p-11 + 1e-5);
    }
  }
}

// Attention accumulates rotated values and rotates the sum back once: it must equal softmax
// attention over the reconstructed (unrotated) values, for every query head of a GQA group.
TEST(RotatedValues, AttendEqualsSoftmaxOverReconstruction) {
  for (uint32_t bits : {2u, 3u}) {
    SCOPED_TRACE("bits=" + std::to_string(bits));
    const uint32_t d = 96, hq = 4, hkv = 2, tokens = 70;
    qjlkv_config cfg = rotated_config(d, bits, hq, hkv);
    cfg.key_method = QJLKV_KEYS_KIVI;
    cfg.key_bits = 3;
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    qt::Rng rng(bits);
    const std::vector<float> keys = rng.normals(size_t(tokens) * hkv * d), values = rng.normals(keys.size());
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 5, tokens, keys.data(), values.data()));
    std::vector<float> k_hat(keys.size()), v_hat(values.size());
    QT_ASSERT_OK(qjlkv_cache_reconstruct(cache.get(), 0, 5, 0, tokens, k_hat.data(), v_hat.data()));
    const std::vector<float> q = rng.normals(size_t(2) * hq * d);  // two queries: the last two positions
    std::vector<float> out(q.size());
    QT_ASSERT_OK(qjlkv_cache_attend(cache.get(), 0, 5, 2, q.data(), 0.0f, out.data()));
    const double scale = 1.0 / std::sqrt(double(d));
    std::vector<double> want(q.size(), 0.0);
    for (uint32_t i = 0; i < 2; ++i)
      for (uint32_t h = 0; h < hq; ++h) {
        const uint32_t kv = h / (hq / hkv), visible = tokens - 1 + i;
        const float *qh = &q[(size_t(i) * hq + h) * d];
        std::vector<double> w(visible);
        double top = -INFINITY, sum = 0.0;
        for (uint32_t t = 0; t < visible; ++t) top = std::max(top, w[t] = scale * qt::dot(qh, &k_hat[(t * hkv + kv) * d], d));
        for (uint32_t t = 0; t < visible; ++t) sum += (w[t] = std::exp(w[t] - top));
        for (uint32_t t = 0; t < visible; ++t)
          for (uint32_t j = 0; j < d; ++j) want[(size_t(i) * hq + h) * d + j] += w[t] / sum * v_hat[(t * hkv + kv) * d + j];
      }
    qt::expect_within_output_budget(out, want, "attention over rotated values");
  }
}

// Stored bytes: one fp16 scale and d·b/8 code bytes per token; value_group_size is ignored.
TEST(RotatedValues, StatisticsCountScalesAndCodes) {
  const uint32_t d = 64, hkv = 2, tokens = 36;
  qjlkv_config cfg = rotated_config(d, 3, 2, hkv);
  cfg.value_group_size = 5;  // ignored: would not divide d
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  qt::Rng rng(1);
  const std::vector<float> keys = rng.normals(size_t(tokens) * hkv * d), values = rng.normals(keys.size());
  QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, tokens, keys.data(), values.data()));
  const qjlkv_stats st = qt::stats_of(cache.get());
  EXPECT_EQ(st.bytes_values_quantized, 2u * hkv * 16 * (2 + d * 3 / 8));  // 2 blocks of 16 tokens
}

// A value vector whose scale would overflow fp16 is refused, naming values; nothing changes.
TEST(RotatedValues, RefusesNormsBeyondTheFp16Scale) {
  const uint32_t d = 64, hkv = 1, tokens = 20;
  const qjlkv_config cfg = rotated_config(d, 2, 1, hkv);
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  std::vector<float> keys(size_t(tokens) * d, 0.5f), values(keys.size(), 1.0f);
  for (uint32_t j = 0; j < d; ++j) values[7 * d + j] = 60000.0f;  // ‖v‖ = 480000 > 65504·0.4528·8
  const std::string stale = qt::stale_error_message();
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_append(cache.get(), 0, 0, tokens, keys.data(), values.data()),
                               QJLKV_ERROR_INVALID_ARGUMENT, stale, {"values"}));
  EXPECT_EQ(qt::length_of(cache.get(), 0, 0), 0u);
  for (uint32_t j = 0; j < d; ++j) values[7 * d + j] = 2000.0f;  // ‖v‖ = 16000: fine
  QT_EXPECT_OK(qjlkv_cache_append(cache.get(), 0, 0, tokens, keys.data(), values.data()));
}

TEST(RotatedValues, RejectsBadFields) {
  struct Case {
    uint32_t value_method, value_bits;
    const char *field;
  };
  for (const Case k : {Case{QJLKV_VALUES_ROTATED_LLOYD_MAX, 8, "value_bits"},
                       Case{QJLKV_VALUES_ROTATED_LLOYD_MAX, 16, "value_bits"}, Case{2, 2, "value_method"},
                       Case{0xffffffffu, 2, "value_method"}}) {
    qjlkv_config cfg = qt::make_config("kivi", 1, 2, 1, 64);
    cfg.value_method = k.value_method;
    cfg.value_bits = k.value_bits;
    const std::string stale = qt::stale_error_message();
    EXPECT_TRUE(qt::fails_naming(qjlkv_config_validate(&cfg), QJLKV_ERROR_INVALID_ARGUMENT, stale, {k.field}))
        << k.field;
  }
}

}  // namespace
