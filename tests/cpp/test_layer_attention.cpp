// Attention variants of a layer (qjlkv_cache_set_layer_attention): soft-capped logits and learned
// sink logits, against a float64 reference over the stored numbers (qjlkv_cache_reconstruct),
// for every preset and dtype, decode and multi-query (causal) attends and attend_batch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "testing.hpp"

namespace {

struct Variant {
  float softcap;
  bool sinks;
};

qjlkv_layer_attention make_attention(float softcap, const float *sinks) {
  qjlkv_layer_attention a;
  std::memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.logit_softcap = softcap;
  a.sink_logits = sinks;
  return a;
}

// out[i][h][j] for the last n_queries positions of (layer, seq): softmax over the positions each
// query sees of cap(scale·q·k̂), plus exp(sink_h) in the denominator, times v̂ — in float64 over
// the cache's own reconstruction.
std::vector<double> reference(qjlkv_cache *c, const qjlkv_config &cfg, uint32_t layer, uint32_t seq,
                              const std::vector<float> &queries, uint32_t n_queries, float scale, float softcap,
                              const std::vector<float> &sinks, uint32_t window = 0) {
  const uint32_t Hq = cfg.num_q_heads, Hkv = cfg.num_kv_heads, d = cfg.head_dim, G = Hq / Hkv;
  const uint64_t length = qt::length_of(c, layer, seq);
  // The positions the first query sees on: those before may have been freed by the window.
  const uint64_t first = window > 0 && length - n_queries + 1 > window ? length - n_queries + 1 - window : 0;
  std::vector<float> stored_keys((length - first) * Hkv * d), stored_values(stored_keys.size());
  EXPECT_EQ(qjlkv_cache_reconstruct(c, layer, seq, first, length - first, stored_keys.data(), stored_values.data()),
            QJLKV_OK)
      << qjlkv_last_error_message();
  const auto key_of = [&](uint64_t t, uint32_t kv_head) { return &stored_keys[((t - first) * Hkv + kv_head) * d]; };
  const auto value_of = [&](uint64_t t, uint32_t kv_head) { return &stored_values[((t - first) * Hkv + kv_head) * d]; };
  std::vector<double> out(size_t(n_queries) * Hq * d, 0.0);
  for (uint32_t i = 0; i < n_queries; ++i) {
    const uint64_t position = length - n_queries + i;
    for (uint32_t h = 0; h < Hq; ++h) {
      const float *q = &queries[(size_t(i) * Hq + h) * d];
      std::vector<double> logits(position + 1, -INFINITY);
      double top = sinks.empty() ? -INFINITY : sinks[h];
      const uint64_t start = window > 0 && position + 1 > window ? position + 1 - window : 0;
      for (uint64_t t = start; t <= position; ++t) {
        double s = scale * qt::dot(q, key_of(t, h / G), d);
        if (softcap > 0.0f) s = softcap * std::tanh(s / softcap);
        logits[t] = s;
        top = std::max(top, s);
      }
      double sum = sinks.empty() ? 0.0 : std::exp(sinks[h] - top);
      for (double &s : logits) sum += (s = std::exp(s - top));
      double *o = &out[(size_t(i) * Hq + h) * d];
      for (uint64_t t = start; t <= position; ++t)
        for (uint32_t j = 0; j < d; ++j) o[j] += logits[t] / sum * value_of(t, h / G)[j];
    }
  }
  return out;
}

// Small shapes that reach every state in a few hundred tokens: 2 kv heads, a tail of 8, 4 sinks
// where the preset has sinks, OTT tracing every layer.
qjlkv_config small_config(const char *preset, qjlkv_dtype dtype, uint32_t layers, uint32_t hq, uint32_t d,
                          uint32_t block) {
  qjlkv_config cfg = qt::make_config(preset, layers, hq, 2, d);
  cfg.dtype = dtype;
  cfg.block_tokens = block;
  cfg.residual_tokens = 8;
  if (cfg.sink_tokens) cfg.sink_tokens = 4;
  if (cfg.key_method == QJLKV_KEYS_OTT) cfg.outlier_skip_layers = 0;
  return cfg;
}

class LayerAttention : public ::testing::TestWithParam<std::tuple<const char *, qjlkv_dtype>> {};

TEST_P(LayerAttention, SoftcapAndSinksMatchTheReference) {
  const auto [preset, dtype] = GetParam();
  const qjlkv_config cfg = small_config(preset, dtype, 2, 8, 64, 32);
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  const uint32_t n = 300, Hq = cfg.num_q_heads, d = cfg.head_dim;
  qt::Rng rng(17);
  std::vector<float> keys = rng.normals(size_t(n) * 2 * d), values = rng.normals(size_t(n) * 2 * d);
  for (float &x : keys) x *= 2.0f;  // logits of a few units: the cap bites
  qt::make_representable(keys, dtype);
  qt::make_representable(values, dtype);
  QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 1, 3, n, qt::encode(keys, dtype).data(), qt::encode(values, dtype).data()));
  std::vector<float> sinks(Hq);
  for (uint32_t h = 0; h < Hq; ++h) sinks[h] = -2.0f + 0.7f * float(h);  // from negligible to dominant

  for (const Variant v : {Variant{0.0f, true}, Variant{5.0f, false}, Variant{2.5f, true}, Variant{0.0f, false}}) {
    const qjlkv_layer_attention a = make_attention(v.softcap, v.sinks ? sinks.data() : nullptr);
    QT_ASSERT_OK(qjlkv_cache_set_layer_attention(cache.get(), 1, &a));
    const std::vector<float> no_sinks;
    for (uint32_t n_queries : {1u, 5u}) {
      const std::string what = std::string(preset) + " softcap " + std::to_string(v.softcap) +
                               (v.sinks ? " sinks" : "") + " queries " + std::to_string(n_queries);
      std::vector<float> q = rng.normals(size_t(n_queries) * Hq * d);
      qt::make_representable(q, dtype);
      const float scale = 0.3f;
      const std::vector<double> want =
          reference(cache.get(), cfg, 1, 3, q, n_queries, scale, v.softcap, v.sinks ? sinks : no_sinks);
      std::vector<uint8_t> out(want.size() * qt::dtype_bytes(dtype));
      QT_ASSERT_OK(qjlkv_cache_attend(cache.get(), 1, 3, n_queries, qt::encode(q, dtype).data(), scale, out.data()));
      const std::vector<float> got = qt::decode(out.data(), want.size(), dtype);
      if (dtype == QJLKV_DTYPE_F32) qt::expect_within_output_budget(got, want, what);
      else qt::expect_near_all(got, want, 1e-2, 1e-2, what);  // 16-bit outputs
      if (n_queries == 1) {  // attend_batch: the same variant
        const uint32_t seqs[] = {3, 3};
        std::vector<float> q2(q);
        q2.insert(q2.end(), q.begin(), q.end());
        std::vector<uint8_t> batch(2 * out.size());
        QT_ASSERT_OK(qjlkv_cache_attend_batch(cache.get(), 1, 2, seqs, qt::encode(q2, dtype).data(), scale,
                                              batch.data()));
        EXPECT_EQ(0, std::memcmp(batch.data(), out.data(), out.size())) << what << ": attend_batch";
        EXPECT_EQ(0, std::memcmp(batch.data() + out.size(), out.data(), out.size())) << what << ": attend_batch";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, LayerAttention,
                         ::testing::Combine(::testing::Values("q2", "q3", "q4", "qjl", "kivi", "ott", "exact"),
                                            ::testing::Values(QJLKV_DTYPE_F32, QJLKV_DTYPE_BF16)),
                         [](const auto &info) {
                           return std::string(std::get<0>(info.param)) + "_" + qt::dtype_name(std::get<1>(info.param));
                         });

// Sliding windows: each query sees the newest `window` positions up to its own, alone and with
// soft-capping and sinks; windows shorter than a block, spanning the sinks, longer than the sequence.
TEST_P(LayerAttention, WindowsMatchTheReference) {
  const auto [preset, dtype] = GetParam();
  qt::Rng rng(23);
  for (const uint32_t window : {1u, 7u, 45u, 130u, 1000u}) {
    const qjlkv_config cfg = small_config(preset, dtype, 1, 4, 32, 16);
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    const uint32_t Hq = cfg.num_q_heads, d = cfg.head_dim;
    const std::vector<float> sinks = {-1.0f, 0.5f, 1.0f, 2.0f};
    qjlkv_layer_attention a = make_attention(window % 2 ? 4.0f : 0.0f, window == 45 ? sinks.data() : nullptr);
    a.window_tokens = window;
    QT_ASSERT_OK(qjlkv_cache_set_layer_attention(cache.get(), 0, &a));
    for (const uint32_t n : {150u, 1u, 60u}) {
      std::vector<float> keys = rng.normals(size_t(n) * 2 * d), values = rng.normals(size_t(n) * 2 * d);
      qt::make_representable(keys, dtype);
      qt::make_representable(values, dtype);
      QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, n, qt::encode(keys, dtype).data(),
                                      qt::encode(values, dtype).data()));
      for (const uint32_t n_queries : {1u, std::min(n, 9u)}) {
        const std::string what = std::string(preset) + " window " + std::to_string(window) + " queries " +
                                 std::to_string(n_queries);
        std::vector<float> q = rng.normals(size_t(n_queries) * Hq * d);
        qt::make_representable(q, dtype);
        const std::vector<double> want = reference(cache.get(), cfg, 0, 0, q, n_queries, 0.25f, a.logit_softcap,
                                                   a.sink_logits ? sinks : std::vector<float>{}, window);
        std::vector<uint8_t> out(want.size() * qt::dtype_bytes(dtype));
        QT_ASSERT_OK(qjlkv_cache_attend(cache.get(), 0, 0, n_queries, qt::encode(q, dtype).data(), 0.25f, out.data()));
        const std::vector<float> got = qt::decode(out.data(), want.size(), dtype);
        if (dtype == QJLKV_DTYPE_F32) qt::expect_within_output_budget(got, want, what);
        else qt::expect_near_all(got, want, 1e-2, 1e-2, what);
      }
    }
  }
}

// A window changes only while the layer holds no tokens; the other fields change any time.
TEST(LayerAttentionRules, WindowChangesOnlyWhileTheLayerIsEmpty) {
  qjlkv_config cfg = qt::make_config("q3", 2, 4, 1, 32);
  qt::Cache cache = qt::make_cache(cfg);
  qjlkv_layer_attention a = make_attention(0.0f, nullptr);
  a.window_tokens = 64;
  QT_ASSERT_OK(qjlkv_cache_set_layer_attention(cache.get(), 0, &a));
  const std::vector<float> k(10 * 32, 0.5f);
  QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 5, 10, k.data(), k.data()));
  a.window_tokens = 32;
  QT_EXPECT_FAIL(qjlkv_cache_set_layer_attention(cache.get(), 0, &a), QJLKV_ERROR_INVALID_ARGUMENT, "window_tokens");
  QT_EXPECT_OK(qjlkv_cache_set_layer_attention(cache.get(), 1, &a));  // layer 1 holds nothing
  a.window_tokens = 64;
  a.logit_softcap = 30.0f;
  QT_EXPECT_OK(qjlkv_cache_set_layer_attention(cache.get(), 0, &a));  // the same window, another cap
  QT_ASSERT_OK(qjlkv_cache_clear_sequence(cache.get(), 5));
  a.window_tokens = 0;
  QT_EXPECT_OK(qjlkv_cache_set_layer_attention(cache.get(), 0, &a));  // empty again
}

// The variant is per layer: the other layer stays plain, and a zeroed variant restores it.
TEST(LayerAttentionRules, PerLayerAndReversible) {
  qjlkv_config cfg = qt::make_config("kivi", 2, 4, 1, 32);  // no per-layer rotation: equal layers
  qt::Cache cache = qt::make_cache(cfg);
  qt::Rng rng(3);
  const std::vector<float> k = rng.normals(100 * 32), v = rng.normals(100 * 32), q = rng.normals(4 * 32);
  for (uint32_t l = 0; l < 2; ++l) QT_ASSERT_OK(qjlkv_cache_append(cache.get(), l, 0, 100, k.data(), v.data()));
  const auto attend = [&](uint32_t layer) {
    std::vector<float> out(4 * 32);
    EXPECT_EQ(qjlkv_cache_attend(cache.get(), layer, 0, 1, q.data(), 0.0f, out.data()), QJLKV_OK);
    return out;
  };
  const std::vector<float> plain = attend(0);
  ASSERT_EQ(plain, attend(1));
  const float sinks[4] = {3.0f, 3.0f, 3.0f, 3.0f};
  const qjlkv_layer_attention a = make_attention(1.0f, sinks);
  QT_ASSERT_OK(qjlkv_cache_set_layer_attention(cache.get(), 0, &a));
  EXPECT_NE(plain, attend(0));
  EXPECT_EQ(plain, attend(1)) << "layer 1 is untouched";
  const qjlkv_layer_attention zero = make_attention(0.0f, nullptr);
  QT_ASSERT_OK(qjlkv_cache_set_layer_attention(cache.get(), 0, &zero));
  EXPECT_EQ(plain, attend(0)) << "a zeroed variant is plain attention";
  // Raw scores do not change.
  std::vector<float> before(4 * 100), after(4 * 100);
  QT_ASSERT_OK(qjlkv_cache_scores(cache.get(), 0, 0, q.data(), before.data(), before.size()));
  QT_ASSERT_OK(qjlkv_cache_set_layer_attention(cache.get(), 0, &a));
  QT_ASSERT_OK(qjlkv_cache_scores(cache.get(), 0, 0, q.data(), after.data(), after.size()));
  EXPECT_EQ(before, after);
}

TEST(LayerAttentionRules, BadArgumentsNameTheField) {
  qjlkv_config cfg = qt::make_config("q3", 2, 4, 1, 32);
  qt::Cache cache = qt::make_cache(cfg);
  const float sinks[4] = {0.0f, 1.0f, NAN, 0.0f};
  qjlkv_layer_attention a = make_attention(1.0f, nullptr);
  QT_EXPECT_FAIL(qjlkv_cache_set_layer_attention(nullptr, 0, &a), QJLKV_ERROR_INVALID_ARGUMENT, "c");
  QT_EXPECT_FAIL(qjlkv_cache_set_layer_attention(cache.get(), 0, nullptr), QJLKV_ERROR_INVALID_ARGUMENT, "attention");
  QT_EXPECT_FAIL(qjlkv_cache_set_layer_attention(cache.get(), 2, &a), QJLKV_ERROR_INVALID_ARGUMENT, "layer");
  for (float cap : {-1.0f, NAN, INFINITY}) {
    a = make_attention(cap, nullptr);
    QT_EXPECT_FAIL(qjlkv_cache_set_layer_attention(cache.get(), 0, &a), QJLKV_ERROR_INVALID_ARGUMENT,
                   "logit_softcap");
  }
  a = make_attention(1.0f, sinks);
  QT_EXPECT_FAIL(qjlkv_cache_set_layer_attention(cache.get(), 0, &a), QJLKV_ERROR_INVALID_ARGUMENT, "sink_logits");
  EXPECT_NE(std::string(qjlkv_last_error_message()).find("[2]"), std::string::npos) << qjlkv_last_error_message();
  a = make_attention(1.0f, nullptr);
  a.struct_size = 20;
  QT_EXPECT_FAIL(qjlkv_cache_set_layer_attention(cache.get(), 0, &a), QJLKV_ERROR_INVALID_ARGUMENT, "struct_size");
  // A refused variant leaves the layer as it was: still plain, as in a cache never given one.
  qt::Cache fresh = qt::make_cache(cfg);
  qt::Rng rng(5);
  const std::vector<float> k = rng.normals(40 * 32), v = rng.normals(40 * 32), q = rng.normals(4 * 32);
  QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, 40, k.data(), v.data()));
  QT_ASSERT_OK(qjlkv_cache_append(fresh.get(), 0, 0, 40, k.data(), v.data()));
  std::vector<float> out(4 * 32), plain(4 * 32);
  QT_ASSERT_OK(qjlkv_cache_attend(cache.get(), 0, 0, 1, q.data(), 0.0f, out.data()));
  QT_ASSERT_OK(qjlkv_cache_attend(fresh.get(), 0, 0, 1, q.data(), 0.0f, plain.data()));
  EXPECT_EQ(out, plain);
}

}  // namespace
