// Per-token value quantization (SPEC §4, DESIGN.md rounding), observed through attention:
// with exact one-hot keys a query can select one position, so attend returns its stored value.
#include "testing.hpp"

namespace {

constexpr float kConstant = -2.75f;  // fp16-representable

// Values with every kind of group: random, constant, tiny, wide, and large but within fp16.
std::vector<float> make_values(qt::Rng &rng, uint32_t tokens, uint32_t hkv, uint32_t d, uint32_t group) {
  std::vector<float> v = rng.normals(size_t(tokens) * hkv * d);
  for (size_t row = 0; row < v.size() / d; ++row) {
    float *x = &v[row * d];
    const uint32_t groups = d / group;
    switch (row % 4) {
      case 0:  // one constant group
        std::fill(x, x + group, kConstant);
        break;
      case 1:  // a tiny-range group and a wide one
        for (uint32_t j = 0; j < group; ++j) x[j] = 1e-3f * x[j];
        if (groups > 1)
          for (uint32_t j = group; j < 2 * group; ++j) x[j] = 3000.0f * x[j];
        break;
      case 2:  // large magnitudes near the fp16 limit (60000 stays below it in bf16 too)
        for (uint32_t j = 0; j < group; ++j) x[j] = std::clamp(20000.0f * x[j], -60000.0f, 60000.0f);
        break;
      default:
        break;
    }
  }
  return v;
}

// Keys e_t (one-hot on channel t) for every kv head: exact in fp16 and bf16.
std::vector<float> one_hot_keys(uint32_t tokens, uint32_t hkv, uint32_t d) {
  std::vector<float> k(size_t(tokens) * hkv * d, 0.0f);
  for (uint32_t t = 0; t < tokens; ++t)
    for (uint32_t h = 0; h < hkv; ++h) k[(size_t(t) * hkv + h) * d + t] = 1.0f;
  return k;
}

// The value vectors the cache uses at positions 0..len-1: query i = 100·e_i with scale 1 gives
// position i weight 1 and every other visible position weight e^-100. Returns [len][Hq][d].
void read_back_values(qjlkv_cache *cache, const qjlkv_config &cfg, uint32_t len, std::vector<float> *out) {
  const uint32_t hq = cfg.num_q_heads, d = cfg.head_dim;
  std::vector<float> q(size_t(len) * hq * d, 0.0f);
  for (uint32_t i = 0; i < len; ++i)
    for (uint32_t h = 0; h < hq; ++h) q[(size_t(i) * hq + h) * d + i] = 100.0f;
  std::vector<uint8_t> o(q.size() * qt::dtype_bytes(qjlkv_dtype(cfg.dtype)));
  QT_ASSERT_OK(qjlkv_cache_attend(cache, 0, 0, len, qt::encode(q, qjlkv_dtype(cfg.dtype)).data(), 1.0f, o.data()));
  *out = qt::decode(o.data(), q.size(), qjlkv_dtype(cfg.dtype));
}

void check_quantized_values(uint32_t bits, uint32_t group, qjlkv_dtype dtype) {
  SCOPED_TRACE("bits=" + std::to_string(bits) + " group=" + std::to_string(group) + " " + qt::dtype_name(dtype));
  const uint32_t d = 64, hq = 2, hkv = 2, tokens = 40;
  qjlkv_config cfg = qt::make_config("exact", 1, hq, hkv, d);
  cfg.dtype = dtype;
  cfg.value_bits = bits;
  cfg.value_group_size = group;
  cfg.block_tokens = 8;
  cfg.residual_tokens = 0;
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  qt::Rng rng(bits * 100 + group);
  std::vector<float> values = make_values(rng, tokens, hkv, d, group);
  qt::make_representable(values, dtype);
  const std::vector<float> keys = one_hot_keys(tokens, hkv, d);
  QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, tokens, qt::encode(keys, dtype).data(),
                                  qt::encode(values, dtype).data()));
  std::vector<float> got;
  ASSERT_NO_FATAL_FAILURE(read_back_values(cache.get(), cfg, tokens, &got));
  size_t mismatches = 0, bound_violations = 0, constant_errors = 0;
  std::vector<float> expected(d), scales(d);
  for (uint32_t t = 0; t < tokens; ++t)
    for (uint32_t h = 0; h < hq; ++h) {
      const size_t row = size_t(t) * hkv + h;  // make_values' row kinds repeat every 4 rows
      const float *x = &values[row * d];
      qt::dequantize_values(x, d, group, bits, expected.data(), scales.data());
      const float *o = &got[(size_t(t) * hq + h) * d];
      for (uint32_t j = 0; j < d; ++j) {
        const float want = qt::representable(expected[j], dtype);
        if (std::abs(o[j] - want) > 1e-6f * std::abs(want) + 1e-30f && mismatches++ < 5)
          ADD_FAILURE() << "token " << t << " head " << h << " channel " << j << ": attend gives " << o[j]
                        << ", the dequantized value is " << want << " (input " << x[j] << ")";
        const double bound = 0.5 * scales[j] + 1e-6 * (std::abs(x[j]) + scales[j] * ((1u << bits) - 1));
        if (std::abs(double(x[j]) - double(expected[j])) > bound) ++bound_violations;
        if (row % 4 == 0 && j < group && o[j] != kConstant) ++constant_errors;
      }
    }
  EXPECT_EQ(mismatches, 0u);
  EXPECT_EQ(bound_violations, 0u) << "|x - x_hat| <= scale/2 (reference check of the test itself)";
  EXPECT_EQ(constant_errors, 0u) << "constant groups must come back exactly";
}

TEST(Values, TwoBitGroupsOf32) { check_quantized_values(2, 32, QJLKV_DTYPE_F32); }
TEST(Values, FourBitGroupsOf16) { check_quantized_values(4, 16, QJLKV_DTYPE_F32); }
TEST(Values, EightBitGroupsOf8) { check_quantized_values(8, 8, QJLKV_DTYPE_F32); }
TEST(Values, TwoBitWholeVectorGroup) { check_quantized_values(2, 64, QJLKV_DTYPE_F32); }
TEST(Values, FourBitFp16Inputs) { check_quantized_values(4, 32, QJLKV_DTYPE_F16); }
TEST(Values, TwoBitBf16Inputs) { check_quantized_values(2, 16, QJLKV_DTYPE_BF16); }
TEST(Values, ThreeBitGroupsOf32) { check_quantized_values(3, 32, QJLKV_DTYPE_F32); }
TEST(Values, ThreeBitGroupsOf8) { check_quantized_values(3, 8, QJLKV_DTYPE_F32); }
TEST(Values, ThreeBitFp16Inputs) { check_quantized_values(3, 64, QJLKV_DTYPE_F16); }

// value_bits = 16 keeps fp16 copies (bf16 for bf16 inputs): an fp32 input comes back rounded once.
TEST(Values, SixteenBitValuesAreRoundedOnce) {
  for (qjlkv_dtype dtype : {QJLKV_DTYPE_F32, QJLKV_DTYPE_BF16}) {
    SCOPED_TRACE(qt::dtype_name(dtype));
    const uint32_t d = 32, tokens = 24;
    qjlkv_config cfg = qt::make_config("exact", 1, 1, 1, d);
    cfg.dtype = dtype;
    cfg.block_tokens = 8;
    cfg.residual_tokens = 0;
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    qt::Rng rng(3);
    std::vector<float> values = rng.normals(size_t(tokens) * d, 10.0f);
    qt::make_representable(values, dtype);
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, tokens, qt::encode(one_hot_keys(tokens, 1, d), dtype).data(),
                                    qt::encode(values, dtype).data()));
    std::vector<float> got;
    ASSERT_NO_FATAL_FAILURE(read_back_values(cache.get(), cfg, tokens, &got));
    size_t bad = 0;
    for (size_t i = 0; i < values.size(); ++i) bad += got[i] != qt::stored16(values[i], dtype);
    EXPECT_EQ(bad, 0u);
  }
}

// attend == softmax(scale · exact scores) · V_hat, with V_hat dequantized here: exact fp16 keys
// isolate the values' contribution.
TEST(Values, AttentionUsesDequantizedValues) {
  for (uint32_t bits : {2u, 3u, 4u, 8u}) {
    SCOPED_TRACE("bits=" + std::to_string(bits));
    const uint32_t d = 64, hq = 4, hkv = 2, tokens = 60;
    qjlkv_config cfg = qt::make_config("exact", 1, hq, hkv, d);
    cfg.value_bits = bits;
    cfg.value_group_size = 32;
    cfg.block_tokens = 16;
    cfg.residual_tokens = 8;
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    qt::ReferenceSequence ref(cfg, nullptr);
    qt::Rng rng(bits);
    std::vector<float> keys = rng.normals(size_t(tokens) * hkv * d, 0.5f), values = rng.normals(keys.size());
    qt::make_representable(keys, QJLKV_DTYPE_F16);  // 16-bit key blocks are then exact
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, tokens, keys.data(), values.data()));
    ref.append(keys, values);
    ASSERT_EQ(ref.quantized(), 48u);
    const std::vector<float> q = rng.normals(size_t(hq) * d);
    std::vector<float> out(q.size(), NAN);
    QT_ASSERT_OK(qjlkv_cache_attend(cache.get(), 0, 0, 1, q.data(), 0.0f, out.data()));
    // Exact scores, computed here: the keys are exact in every storage.
    std::vector<float> scores(size_t(hq) * tokens);
    const std::vector<qt::Estimate> est = ref.scores(q.data());
    for (size_t i = 0; i < est.size(); ++i) scores[i] = float(est[i].value);
    const std::vector<double> want = ref.attend(scores, tokens, 1.0f / std::sqrt(float(d)));
    qt::expect_near_all(out, want, 1e-5 * qt::max_abs(values), 1e-5, "attention output");
    // The quantization is visible: exact values give a different output.
    const std::vector<double> exact = ref.exact_attend(q.data(), tokens, 1.0f / std::sqrt(float(d)));
    double diff = 0.0;
    for (size_t i = 0; i < exact.size(); ++i) diff = std::max(diff, std::abs(exact[i] - want[i]));
    EXPECT_GT(diff, 1e-4) << "the reference must differ from exact attention, or the test shows nothing";
  }
}

// With 16-bit storage, reconstruct returns the stored copies: fp16 for fp32 inputs, bf16 for
// bf16 inputs; quantized values come back dequantized.
TEST(Values, ReconstructReturnsStoredCopies) {
  struct Case {
    qjlkv_dtype dtype;
    uint32_t value_bits;
  };
  for (const Case k : {Case{QJLKV_DTYPE_F32, 16}, Case{QJLKV_DTYPE_BF16, 16}, Case{QJLKV_DTYPE_F16, 4}}) {
    SCOPED_TRACE(std::string(qt::dtype_name(k.dtype)) + " value_bits " + std::to_string(k.value_bits));
    const uint32_t d = 32, hkv = 2, tokens = 45;
    qjlkv_config cfg = qt::make_config("exact", 1, 2, hkv, d);
    cfg.dtype = k.dtype;
    cfg.value_bits = k.value_bits;
    cfg.block_tokens = 16;
    cfg.residual_tokens = 4;
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    qt::ReferenceSequence ref(cfg, nullptr);
    qt::Rng rng(k.value_bits);
    std::vector<float> keys = rng.normals(size_t(tokens) * hkv * d, 3.0f), values = rng.normals(keys.size(), 3.0f);
    qt::make_representable(keys, k.dtype);
    qt::make_representable(values, k.dtype);
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, tokens, qt::encode(keys, k.dtype).data(),
                                    qt::encode(values, k.dtype).data()));
    ref.append(keys, values);
    ASSERT_EQ(ref.quantized(), 32u);
    std::vector<float> k_hat(keys.size()), v_hat(values.size());
    QT_ASSERT_OK(qjlkv_cache_reconstruct(cache.get(), 0, 0, 0, tokens, k_hat.data(), v_hat.data()));
    size_t bad_keys = 0, bad_values = 0;
    for (uint64_t t = 0; t < tokens; ++t)
      for (uint32_t kv = 0; kv < hkv; ++kv) {
        bool ambiguous = false;
        const std::vector<double> want = ref.key_hat(t, kv, &ambiguous);
        for (uint32_t j = 0; j < d; ++j) {
          bad_keys += k_hat[(t * hkv + kv) * d + j] != float(want[j]);
          bad_values += v_hat[(t * hkv + kv) * d + j] != ref.value_used(t, kv)[j];
        }
      }
    EXPECT_EQ(bad_keys, 0u);
    EXPECT_EQ(bad_values, 0u);
  }
}

}  // namespace
