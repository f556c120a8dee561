// Attention-sink tokens (config.sink_tokens = S): the first S positions of every sequence stay
// exact, and the block/tail rule applies to the positions after them, as if the sequence started
// at position S. Checked against a cache without sinks fed the same tokens from position S on.
#include "testing.hpp"

namespace {

struct SinkCase {
  const char *preset;
  uint32_t value_method;
};

// keys/values of `tokens` positions [tokens][hkv][d], with a few outlier tokens for OTT to trace.
void make_tokens(qt::Rng &rng, uint32_t tokens, uint32_t hkv, uint32_t d, std::vector<float> *keys,
                 std::vector<float> *values) {
  *keys = rng.normals(size_t(tokens) * hkv * d);
  *values = rng.normals(keys->size());
  for (uint32_t t = 9; t < tokens; t += 23)
    for (uint32_t j = 0; j < hkv * d; ++j) (*keys)[size_t(t) * hkv * d + j] *= 0.01f;  // OTT's small-norm tokens
}

// Positions [S, L) of the cache with sinks hold exactly what a sink-free cache holds for those
// tokens: same reconstruction, same scores; positions [0, S) are the inputs; statistics differ by
// the sinks' exact bytes; attention equals softmax over the reconstruction.
TEST(Sinks, FollowTheBlockRuleAfterTheSinks) {
  for (const SinkCase k : {SinkCase{"kivi", QJLKV_VALUES_UNIFORM}, SinkCase{"qjl", QJLKV_VALUES_UNIFORM},
                           SinkCase{"ott", QJLKV_VALUES_UNIFORM}, SinkCase{"kivi", QJLKV_VALUES_ROTATED_LLOYD_MAX}}) {
    SCOPED_TRACE(std::string(k.preset) + " value_method " + std::to_string(k.value_method));
    const uint32_t d = 64, hq = 4, hkv = 2, S = 5, tokens = 150;
    qjlkv_config plain = qt::make_config(k.preset, 1, hq, hkv, d);
    plain.block_tokens = 32;
    plain.residual_tokens = 8;
    plain.value_method = k.value_method;
    qjlkv_config sinks = plain;
    sinks.sink_tokens = S;
    qt::Cache with = qt::make_cache(sinks), without = qt::make_cache(plain);
    ASSERT_TRUE(with && without);
    qt::Rng rng(7);
    std::vector<float> keys, values;
    make_tokens(rng, tokens, hkv, d, &keys, &values);
    const size_t row = size_t(hkv) * d;
    // Uneven appends: 3 tokens (sinks not yet full), then 40 (fills them and more), then the rest.
    for (auto [first, n] : {std::pair{0u, 3u}, std::pair{3u, 40u}, std::pair{43u, tokens - 43}})
      QT_ASSERT_OK(qjlkv_cache_append(with.get(), 0, 1, n, &keys[first * row], &values[first * row]));
    QT_ASSERT_OK(qjlkv_cache_append(without.get(), 0, 1, tokens - S, &keys[S * row], &values[S * row]));
    ASSERT_EQ(qt::length_of(with.get(), 0, 1), tokens);

    std::vector<float> k_with(tokens * row), v_with(tokens * row), k_without((tokens - S) * row),
        v_without((tokens - S) * row);
    QT_ASSERT_OK(qjlkv_cache_reconstruct(with.get(), 0, 1, 0, tokens, k_with.data(), v_with.data()));
    QT_ASSERT_OK(qjlkv_cache_reconstruct(without.get(), 0, 1, 0, tokens - S, k_without.data(), v_without.data()));
    EXPECT_TRUE(std::equal(keys.begin(), keys.begin() + S * row, k_with.begin())) << "sink keys are exact";
    EXPECT_TRUE(std::equal(values.begin(), values.begin() + S * row, v_with.begin())) << "sink values are exact";
    EXPECT_TRUE(std::equal(k_without.begin(), k_without.end(), k_with.begin() + S * row));
    EXPECT_TRUE(std::equal(v_without.begin(), v_without.end(), v_with.begin() + S * row));

    const std::vector<float> q = rng.normals(size_t(hq) * d);
    std::vector<float> s_with, s_without;
    ASSERT_NO_FATAL_FAILURE(qt::library_scores(with.get(), 0, 1, qt::encode(q, QJLKV_DTYPE_F32), &s_with));
    ASSERT_NO_FATAL_FAILURE(qt::library_scores(without.get(), 0, 1, qt::encode(q, QJLKV_DTYPE_F32), &s_without));
    for (uint32_t h = 0; h < hq; ++h) {
      for (uint32_t t = 0; t < S; ++t) {
        const double exact = qt::dot(&q[h * d], &keys[t * row + (h / 2) * d], d);
        EXPECT_NEAR(s_with[h * tokens + t], exact, 1e-5 * (1 + std::abs(exact))) << "head " << h << " sink " << t;
      }
      EXPECT_TRUE(std::equal(s_without.begin() + h * (tokens - S), s_without.begin() + (h + 1) * (tokens - S),
                             s_with.begin() + h * tokens + S))
          << "head " << h;
    }

    const qjlkv_stats a = qt::stats_of(with.get()), b = qt::stats_of(without.get());
    EXPECT_EQ(a.bytes_keys_quantized, b.bytes_keys_quantized);
    EXPECT_EQ(a.bytes_values_quantized, b.bytes_values_quantized);
    EXPECT_EQ(a.bytes_full_precision, b.bytes_full_precision + 2u * S * row * sizeof(float));

    std::vector<float> out(q.size());
    QT_ASSERT_OK(qjlkv_cache_attend(with.get(), 0, 1, 1, q.data(), 0.0f, out.data()));
    std::vector<double> want(q.size(), 0.0);
    for (uint32_t h = 0; h < hq; ++h) {
      const uint32_t kv = h / 2;
      std::vector<double> w(tokens);
      double top = -INFINITY, sum = 0.0;
      for (uint32_t t = 0; t < tokens; ++t)
        top = std::max(top, w[t] = qt::dot(&q[h * d], &k_with[t * row + kv * d], d) / 8.0);
      for (uint32_t t = 0; t < tokens; ++t) sum += (w[t] = std::exp(w[t] - top));
      // OTT: a slot whose token moved to the pool reconstructs that token and is counted once.
      for (uint32_t t = 0; t < tokens; ++t)
        for (uint32_t j = 0; j < d; ++j) want[h * d + j] += w[t] / sum * v_with[t * row + kv * d + j];
    }
    qt::expect_within_output_budget(out, want, "attention with sinks");
  }
}

// A sequence shorter than S is all sinks: exact, and counted as full precision.
TEST(Sinks, ShortSequencesAreExact) {
  const uint32_t d = 32, hkv = 1, tokens = 20;
  qjlkv_config cfg = qt::make_config("kivi", 1, 2, hkv, d);
  cfg.block_tokens = 8;
  cfg.residual_tokens = 0;
  cfg.sink_tokens = 64;
  cfg.dtype = QJLKV_DTYPE_F16;
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  qt::Rng rng(2);
  std::vector<float> keys = rng.normals(size_t(tokens) * d), values = rng.normals(keys.size());
  qt::make_representable(keys, QJLKV_DTYPE_F16);
  qt::make_representable(values, QJLKV_DTYPE_F16);
  QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, tokens, qt::encode(keys, QJLKV_DTYPE_F16).data(),
                                  qt::encode(values, QJLKV_DTYPE_F16).data()));
  std::vector<float> k_hat(keys.size()), v_hat(values.size());
  QT_ASSERT_OK(qjlkv_cache_reconstruct(cache.get(), 0, 0, 0, tokens, k_hat.data(), v_hat.data()));
  EXPECT_EQ(k_hat, keys);
  EXPECT_EQ(v_hat, values);
  const qjlkv_stats st = qt::stats_of(cache.get());
  EXPECT_EQ(st.bytes_keys_quantized + st.bytes_values_quantized, 0u);
  EXPECT_EQ(st.bytes_full_precision, 2u * tokens * d * 2);
}

TEST(Sinks, RejectsTooMany) {
  qjlkv_config cfg = qt::make_config("kivi", 1, 2, 1, 64);
  cfg.sink_tokens = 65537;
  QT_EXPECT_FAIL(qjlkv_config_validate(&cfg), QJLKV_ERROR_INVALID_ARGUMENT, "sink_tokens");
}

}  // namespace
