// Decode attention (SPEC §6): exact where nothing is compressed; otherwise
// softmax(scale · scores) · V_hat with the cache's own scores and values dequantized here.
// GQA/MQA head mapping, causal multi-query attention, dtypes and head dims.
#include "testing.hpp"

namespace {

struct AttentionCase {
  std::string name;
  const char *preset = "qjl";
  uint32_t hq = 4, hkv = 2, d = 64;
  qjlkv_dtype dtype = QJLKV_DTYPE_F32;
  uint32_t tokens = 150;
  std::vector<uint32_t> n_queries = {1, 4};
  float scale = 0.0f;
  bool fp16_inputs = false;  // round inputs to fp16 so 16-bit storage is exact
};

// Tolerance of an output element stored in `dtype`: fp32 arithmetic, then one rounding.
double output_rtol(qjlkv_dtype t) { return t == QJLKV_DTYPE_F32 ? 1e-5 : t == QJLKV_DTYPE_F16 ? 1e-3 : 8e-3; }

void check_attention(const AttentionCase &k) {
  SCOPED_TRACE(k.name);
  qjlkv_config cfg = qt::make_config(k.preset, 1, k.hq, k.hkv, k.d);
  cfg.dtype = k.dtype;
  cfg.seed = 3;
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  qt::QjlLayer sketch;
  if (cfg.key_method == QJLKV_KEYS_QJL) {
    ASSERT_NO_FATAL_FAILURE(qt::load_qjl_layer(cache.get(), 0, &sketch));
  }
  qt::ReferenceSequence ref(cfg, cfg.key_method == QJLKV_KEYS_QJL ? &sketch : nullptr);
  qt::Rng rng(k.d * 1000 + k.hq * 10 + k.hkv);
  const size_t token_elems = size_t(k.hkv) * k.d, q_elems = size_t(k.hq) * k.d;
  for (uint32_t done = 0; done < k.tokens;) {
    const uint32_t n = std::min(k.tokens - done, 1 + rng.below(64));
    std::vector<float> keys = rng.normals(n * token_elems), values = rng.normals(n * token_elems);
    qt::amplify_channels(keys, k.d, {1, 6}, 5.0f);
    if (k.fp16_inputs) {
      qt::make_representable(keys, QJLKV_DTYPE_F16);
      qt::make_representable(values, QJLKV_DTYPE_F16);
    }
    qt::make_representable(keys, k.dtype);
    qt::make_representable(values, k.dtype);
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, n, qt::encode(keys, k.dtype).data(),
                                    qt::encode(values, k.dtype).data()));
    ref.append(keys, values);
    done += n;
  }
  // 16-bit storage is exact for fp16/bf16 inputs, and for fp32 inputs that fp16 holds.
  const bool lossless_16bit = k.dtype != QJLKV_DTYPE_F32 || k.fp16_inputs;
  const bool nothing_compressed =
      ref.quantized() == 0 || (cfg.key_method == QJLKV_KEYS_EXACT && cfg.value_bits == 16 && lossless_16bit);
  const float scale = k.scale > 0.0f ? k.scale : 1.0f / std::sqrt(float(k.d));
  double value_max = 0.0;
  for (uint64_t t = 0; t < ref.length(); ++t)
    for (uint32_t h = 0; h < k.hkv; ++h)
      for (uint32_t j = 0; j < k.d; ++j) value_max = std::max(value_max, double(std::abs(ref.value(t, h)[j])));

  for (uint32_t nq : k.n_queries) {
    SCOPED_TRACE("n_queries=" + std::to_string(nq));
    std::vector<float> q = rng.normals(nq * q_elems);
    qt::make_representable(q, k.dtype);
    std::vector<uint8_t> out_bytes(q.size() * qt::dtype_bytes(k.dtype));
    QT_ASSERT_OK(
        qjlkv_cache_attend(cache.get(), 0, 0, nq, qt::encode(q, k.dtype).data(), k.scale, out_bytes.data()));
    const std::vector<float> out = qt::decode(out_bytes.data(), q.size(), k.dtype);
    for (uint32_t i = 0; i < nq; ++i) {
      const uint64_t visible = ref.length() - nq + i + 1;  // causal: positions <= its own
      const std::vector<float> qi(q.begin() + i * q_elems, q.begin() + (i + 1) * q_elems);
      const std::vector<float> out_i(out.begin() + i * q_elems, out.begin() + (i + 1) * q_elems);
      std::vector<float> lib_scores;
      ASSERT_NO_FATAL_FAILURE(qt::library_scores(cache.get(), 0, 0, qt::encode(qi, k.dtype), &lib_scores));
      if (i == 0) qt::check_scores(lib_scores, ref.scores(qi.data()), qt::kScoreRelTol, "scores");
      const std::string what = "query " + std::to_string(i);
      qt::expect_near_all(out_i, ref.attend(lib_scores, visible, scale), 1e-5 * value_max, output_rtol(k.dtype),
                          what + " vs softmax(scale*scores)*V_hat");
      if (nothing_compressed)
        qt::expect_near_all(out_i, ref.exact_attend(qi.data(), visible, scale), 1e-5 * value_max,
                            output_rtol(k.dtype), what + " vs exact attention");
    }
  }
}

TEST(Attention, ExactPresetEqualsExactAttention) {
  AttentionCase k;
  k.name = "exact preset";
  k.preset = "exact";
  k.hq = 8;
  k.d = 128;
  k.tokens = 100;
  k.fp16_inputs = true;
  k.n_queries = {1, 3, 100};
  check_attention(k);
}

TEST(Attention, TailOnlyEqualsExactAttention) {
  AttentionCase k;
  k.name = "tail only";
  k.tokens = 63;  // < R + B = 64: nothing quantized yet
  k.n_queries = {1, 2, 63};
  check_attention(k);
}

TEST(Attention, QuantizedTokensUseScoresAndDequantizedValues) {
  AttentionCase k;
  k.name = "qjl 300 tokens";
  k.tokens = 300;
  k.n_queries = {1, 7};
  check_attention(k);
}

TEST(Attention, GqaRatios) {
  const std::vector<std::pair<uint32_t, uint32_t>> heads = {{4, 4}, {8, 2}, {7, 1}, {14, 2}, {8, 1}, {12, 4}};
  for (auto [hq, hkv] : heads) {
    AttentionCase k;
    k.name = "Hq=" + std::to_string(hq) + " Hkv=" + std::to_string(hkv);
    k.hq = hq;
    k.hkv = hkv;
    k.tokens = 110;
    check_attention(k);
  }
}

TEST(Attention, CausalMultiQuery) {
  AttentionCase k;
  k.name = "causal";
  k.tokens = 200;
  k.n_queries = {2, 9, 40, 200};
  check_attention(k);
}

TEST(Attention, Dtypes) {
  for (qjlkv_dtype dtype : {QJLKV_DTYPE_F32, QJLKV_DTYPE_F16, QJLKV_DTYPE_BF16}) {
    for (const char *preset : {"qjl", "exact"}) {
      AttentionCase k;
      k.name = std::string(preset) + " " + qt::dtype_name(dtype);
      k.preset = preset;
      k.dtype = dtype;
      k.fp16_inputs = std::string(preset) == "exact" && dtype != QJLKV_DTYPE_BF16;
      k.tokens = 140;
      check_attention(k);
    }
  }
}

TEST(Attention, HeadDims) {
  for (uint32_t d : {64u, 80u, 96u, 128u, 256u}) {
    for (const char *preset : {"qjl", "exact"}) {
      AttentionCase k;
      k.name = std::string(preset) + " d=" + std::to_string(d);
      k.preset = preset;
      k.d = d;
      k.tokens = 100;
      k.fp16_inputs = std::string(preset) == "exact";
      check_attention(k);
    }
  }
}

TEST(Attention, ExplicitScale) {
  AttentionCase k;
  k.name = "scale 0.05";
  k.scale = 0.05f;
  check_attention(k);
}

// scale <= 0 selects 1/sqrt(head_dim); 1/sqrt(64) = 0.125 exactly.
TEST(Attention, NonPositiveScaleMeansInverseSqrtD) {
  qjlkv_config cfg = qt::make_config("qjl", 1, 2, 1, 64);
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  qt::Rng rng(4);
  const std::vector<float> k = rng.normals(100 * 64), v = rng.normals(k.size()), q = rng.normals(2 * 64);
  QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, 100, k.data(), v.data()));
  std::vector<float> explicit_scale(q.size()), zero(q.size()), negative(q.size()), other(q.size());
  QT_ASSERT_OK(qjlkv_cache_attend(cache.get(), 0, 0, 1, q.data(), 0.125f, explicit_scale.data()));
  QT_ASSERT_OK(qjlkv_cache_attend(cache.get(), 0, 0, 1, q.data(), 0.0f, zero.data()));
  QT_ASSERT_OK(qjlkv_cache_attend(cache.get(), 0, 0, 1, q.data(), -3.0f, negative.data()));
  QT_ASSERT_OK(qjlkv_cache_attend(cache.get(), 0, 0, 1, q.data(), 0.5f, other.data()));
  EXPECT_EQ(explicit_scale, zero);
  EXPECT_EQ(explicit_scale, negative);
  EXPECT_NE(explicit_scale, other);
}

// Large logits must not overflow: the softmax subtracts the maximum.
TEST(Attention, LargeLogitsStayFinite) {
  for (const char *preset : {"qjl", "exact"}) {
    qjlkv_config cfg = qt::make_config(preset, 1, 1, 1, 64);
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    qt::Rng rng(6);
    std::vector<float> k = rng.normals(120 * 64, 100.0f), v = rng.normals(k.size());
    qt::make_representable(k, QJLKV_DTYPE_F16);
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, 120, k.data(), v.data()));
    const std::vector<float> q(k.begin(), k.begin() + 64);  // logit ~ |k_0|^2 / 8 ~ 8e4
    std::vector<float> out(64, NAN);
    QT_ASSERT_OK(qjlkv_cache_attend(cache.get(), 0, 0, 1, q.data(), 1.0f, out.data()));
    for (float x : out) EXPECT_TRUE(std::isfinite(x)) << preset;
  }
}

}  // namespace
