// Cache semantics (SPEC §6, DESIGN.md): the exact tail and block boundaries, bulk vs single and
// batched vs single calls, independence of sequences and layers, clearing, and statistics.
#include <map>

#include "testing.hpp"

namespace {

constexpr uint32_t kD = 64;

qjlkv_config qjl_config(uint32_t layers, uint32_t hq, uint32_t hkv, uint32_t block, uint32_t residual) {
  qjlkv_config cfg = qt::make_config("qjl", layers, hq, hkv, kD);
  cfg.seed = 11;
  cfg.block_tokens = block;
  cfg.residual_tokens = residual;
  return cfg;
}

// Exact <q_h, k_t> for every query head and position: [Hq][len].
std::vector<double> exact_scores(const qjlkv_config &cfg, const qt::ReferenceSequence &ref, const float *q) {
  const uint32_t hq = cfg.num_q_heads, group = hq / cfg.num_kv_heads, d = cfg.head_dim;
  const uint64_t len = ref.length();
  std::vector<double> s(size_t(hq) * len);
  for (uint32_t h = 0; h < hq; ++h)
    for (uint64_t t = 0; t < len; ++t) s[h * len + t] = qt::dot(q + size_t(h) * d, ref.key(t, h / group), d);
  return s;
}

// The first position from which every listed score is the exact product, for every head: the
// number of positions the cache holds quantized, as seen from outside.
uint64_t observed_quantized(const qjlkv_config &cfg, const qt::ReferenceSequence &ref, const std::vector<float> &q,
                            const std::vector<float> &lib) {
  const uint32_t hq = cfg.num_q_heads, group = hq / cfg.num_kv_heads, d = cfg.head_dim;
  const uint64_t len = ref.length();
  const std::vector<double> exact = exact_scores(cfg, ref, q.data());
  uint64_t first_exact_run = 0;
  for (uint32_t h = 0; h < hq; ++h) {
    uint64_t p = len;
    while (p > 0) {
      const double mag = qt::norm(&q[size_t(h) * d], d) * qt::norm(ref.key(p - 1, h / group), d);
      if (std::abs(lib[h * len + p - 1] - exact[h * len + p - 1]) > 1e-5 * mag) break;
      --p;
    }
    first_exact_run = std::max(first_exact_run, p);
  }
  return first_exact_run;
}

// After every append, the tail holds between min(len, R) and R + B - 1 exact tokens, and the
// positions before it are estimates following the formula.
TEST(Cache, TailHoldsTheNewestTokensExactly) {
  const std::vector<std::pair<uint32_t, uint32_t>> shapes = {{32, 32}, {8, 0}, {8, 5}, {16, 40}};
  for (auto [block, residual] : shapes) {
    SCOPED_TRACE("B=" + std::to_string(block) + " R=" + std::to_string(residual));
    const qjlkv_config cfg = qjl_config(1, 2, 2, block, residual);
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    qt::QjlLayer sketch;
    ASSERT_NO_FATAL_FAILURE(qt::load_qjl_layer(cache.get(), 0, &sketch));
    qt::ReferenceSequence ref(cfg, &sketch);
    qt::Rng rng(block + residual);
    const uint32_t total = 3 * (block + residual) + 7;
    for (uint32_t len = 1; len <= total; ++len) {
      const std::vector<float> k = rng.normals(2 * kD), v = rng.normals(2 * kD);
      QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 3, 1, k.data(), v.data()));
      ref.append(k, v);
      ASSERT_EQ(qt::length_of(cache.get(), 0, 3), len);
      const std::vector<float> q = rng.normals(2 * kD);
      std::vector<float> lib;
      ASSERT_NO_FATAL_FAILURE(qt::library_scores(cache.get(), 0, 3, qt::encode(q, QJLKV_DTYPE_F32), &lib));
      const uint64_t quantized = ref.quantized(), tail = len - quantized;
      ASSERT_GE(tail, std::min<uint64_t>(len, residual));
      ASSERT_LE(tail, uint64_t(residual) + block - 1);
      ASSERT_EQ(observed_quantized(cfg, ref, q, lib), quantized) << "len " << len;
      if ((len % 5 == 0 || len == total) && quantized > 0)
        qt::check_scores(lib, ref.scores(q.data()), qt::kScoreRelTol, "len " + std::to_string(len));
    }
  }
}

TEST(Cache, FlushBoundariesWithChunkedAppends) {
  const qjlkv_config cfg = qjl_config(1, 4, 2, 32, 32);
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  qt::QjlLayer sketch;
  ASSERT_NO_FATAL_FAILURE(qt::load_qjl_layer(cache.get(), 0, &sketch));
  qt::ReferenceSequence ref(cfg, &sketch);
  qt::Rng rng(8);
  // Tail lengths reach R + B exactly (64 after the third append), stop one short, and overshoot
  // by several blocks.
  for (uint32_t n : {1u, 7u, 56u, 31u, 33u, 64u, 100u, 2u, 5u, 95u, 32u, 1u, 1u}) {
    const std::vector<float> k = rng.normals(size_t(n) * 2 * kD), v = rng.normals(k.size());
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, n, k.data(), v.data()));
    ref.append(k, v);
    ASSERT_EQ(qt::length_of(cache.get(), 0, 0), ref.length());
    const std::vector<float> q = rng.normals(4 * kD);
    std::vector<float> lib;
    ASSERT_NO_FATAL_FAILURE(qt::library_scores(cache.get(), 0, 0, qt::encode(q, QJLKV_DTYPE_F32), &lib));
    EXPECT_EQ(observed_quantized(cfg, ref, q, lib), ref.quantized()) << "after appending " << n;
    qt::check_scores(lib, ref.scores(q.data()), qt::kScoreRelTol, "after appending " + std::to_string(n));
  }
}

// Everything observable about (layer, seq): length, scores of fixed queries, attend outputs.
struct Observation {
  uint64_t length = 0;
  std::vector<std::vector<uint8_t>> scores, outputs;
};

void observe(qjlkv_cache *cache, const qjlkv_config &cfg, uint32_t layer, uint32_t seq, uint64_t salt,
             Observation *out) {
  *out = Observation{};
  QT_ASSERT_OK(qjlkv_cache_length(cache, layer, seq, &out->length));
  ASSERT_GT(out->length, 0u);
  qt::Rng rng(salt);
  const size_t q_elems = size_t(cfg.num_q_heads) * cfg.head_dim;
  for (int i = 0; i < 2; ++i) {
    std::vector<float> q = rng.normals(q_elems);
    std::vector<float> s(size_t(cfg.num_q_heads) * out->length);
    QT_ASSERT_OK(qjlkv_cache_scores(cache, layer, seq, qt::encode(q, qjlkv_dtype(cfg.dtype)).data(), s.data(), s.size()));
    out->scores.emplace_back(reinterpret_cast<uint8_t *>(s.data()), reinterpret_cast<uint8_t *>(s.data() + s.size()));
  }
  for (uint32_t n_queries : {1u, 3u}) {
    if (n_queries > out->length) continue;
    const std::vector<float> q = rng.normals(q_elems * n_queries);
    std::vector<uint8_t> o(q.size() * qt::dtype_bytes(qjlkv_dtype(cfg.dtype)));
    QT_ASSERT_OK(qjlkv_cache_attend(cache, layer, seq, n_queries, qt::encode(q, qjlkv_dtype(cfg.dtype)).data(), 0.0f, o.data()));
    out->outputs.push_back(std::move(o));
  }
}

void expect_same_observation(const Observation &a, const Observation &b, const std::string &what) {
  EXPECT_EQ(a.length, b.length) << what;
  EXPECT_TRUE(a.scores == b.scores) << what << ": scores differ (bitwise)";
  EXPECT_TRUE(a.outputs == b.outputs) << what << ": attend outputs differ (bitwise)";
}

void expect_same_stats(const qjlkv_stats &a, const qjlkv_stats &b, const std::string &what) {
  EXPECT_EQ(a.tokens, b.tokens) << what;
  EXPECT_EQ(a.bytes_used, b.bytes_used) << what;
  EXPECT_EQ(a.bytes_fp16_equivalent, b.bytes_fp16_equivalent) << what;
  EXPECT_EQ(a.bytes_keys_quantized, b.bytes_keys_quantized) << what;
  EXPECT_EQ(a.bytes_values_quantized, b.bytes_values_quantized) << what;
  EXPECT_EQ(a.bytes_full_precision, b.bytes_full_precision) << what;
}

TEST(Cache, AppendingNTokensAtOnceEqualsNSingleAppends) {
  struct Case {
    const char *preset;
    qjlkv_dtype dtype;
  };
  for (const Case k : {Case{"qjl", QJLKV_DTYPE_F32}, Case{"qjl", QJLKV_DTYPE_F16}, Case{"exact", QJLKV_DTYPE_BF16}}) {
    SCOPED_TRACE(std::string(k.preset) + " " + qt::dtype_name(k.dtype));
    qjlkv_config cfg = qt::make_config(k.preset, 1, 4, 2, kD);
    cfg.dtype = k.dtype;
    const uint32_t n = 150;
    qt::Rng rng(5);
    const std::vector<float> keys = rng.normals(size_t(n) * 2 * kD), values = rng.normals(keys.size());
    const std::vector<uint8_t> kb = qt::encode(keys, k.dtype), vb = qt::encode(values, k.dtype);
    const size_t token_bytes = 2 * kD * qt::dtype_bytes(k.dtype);
    qt::Cache bulk = qt::make_cache(cfg), single = qt::make_cache(cfg), chunked = qt::make_cache(cfg);
    ASSERT_TRUE(bulk && single && chunked);
    QT_ASSERT_OK(qjlkv_cache_append(bulk.get(), 0, 0, n, kb.data(), vb.data()));
    for (uint32_t t = 0; t < n; ++t)
      QT_ASSERT_OK(qjlkv_cache_append(single.get(), 0, 0, 1, &kb[t * token_bytes], &vb[t * token_bytes]));
    for (uint32_t t = 0; t < n;) {
      const uint32_t c = std::min(n - t, 1 + rng.below(50));
      QT_ASSERT_OK(qjlkv_cache_append(chunked.get(), 0, 0, c, &kb[t * token_bytes], &vb[t * token_bytes]));
      t += c;
    }
    Observation a, b, c;
    ASSERT_NO_FATAL_FAILURE(observe(bulk.get(), cfg, 0, 0, 1, &a));
    ASSERT_NO_FATAL_FAILURE(observe(single.get(), cfg, 0, 0, 1, &b));
    ASSERT_NO_FATAL_FAILURE(observe(chunked.get(), cfg, 0, 0, 1, &c));
    expect_same_observation(a, b, "bulk vs single");
    expect_same_observation(a, c, "bulk vs chunked");
    expect_same_stats(qt::stats_of(bulk.get()), qt::stats_of(single.get()), "bulk vs single");
  }
}

TEST(Cache, BatchedCallsEqualSingleCalls) {
  qjlkv_config cfg = qjl_config(2, 4, 2, 8, 4);
  cfg.dtype = QJLKV_DTYPE_F16;
  qt::Cache batched = qt::make_cache(cfg), single = qt::make_cache(cfg);
  ASSERT_TRUE(batched && single);
  const std::vector<uint32_t> seqs = {4, 9, 1};
  const size_t token_elems = 2 * kD, token_bytes = token_elems * 2;
  qt::Rng rng(17);
  for (uint32_t layer = 0; layer < 2; ++layer)
    for (uint32_t step = 0; step < 40; ++step) {
      const std::vector<uint8_t> k = qt::encode(rng.normals(seqs.size() * token_elems), qjlkv_dtype(cfg.dtype)),
                                 v = qt::encode(rng.normals(seqs.size() * token_elems), qjlkv_dtype(cfg.dtype));
      QT_ASSERT_OK(qjlkv_cache_append_batch(batched.get(), layer, uint32_t(seqs.size()), seqs.data(), k.data(),
                                            v.data()));
      for (size_t i = 0; i < seqs.size(); ++i)
        QT_ASSERT_OK(qjlkv_cache_append(single.get(), layer, seqs[i], 1, &k[i * token_bytes], &v[i * token_bytes]));
    }
  for (uint32_t layer = 0; layer < 2; ++layer)
    for (uint32_t seq : seqs) {
      Observation a, b;
      ASSERT_NO_FATAL_FAILURE(observe(batched.get(), cfg, layer, seq, seq, &a));
      ASSERT_NO_FATAL_FAILURE(observe(single.get(), cfg, layer, seq, seq, &b));
      expect_same_observation(a, b, "layer " + std::to_string(layer) + " seq " + std::to_string(seq));
    }
  expect_same_stats(qt::stats_of(batched.get()), qt::stats_of(single.get()), "batched vs single");

  // attend_batch (sequences may repeat) == one attend per listed sequence.
  const std::vector<uint32_t> listed = {9, 4, 9, 1};
  const size_t q_elems = size_t(cfg.num_q_heads) * kD;
  const std::vector<uint8_t> q = qt::encode(rng.normals(listed.size() * q_elems), qjlkv_dtype(cfg.dtype));
  std::vector<uint8_t> out_batch(q.size()), out_single(q.size());
  QT_ASSERT_OK(qjlkv_cache_attend_batch(batched.get(), 1, uint32_t(listed.size()), listed.data(), q.data(), 0.0f,
                                        out_batch.data()));
  for (size_t i = 0; i < listed.size(); ++i)
    QT_ASSERT_OK(qjlkv_cache_attend(batched.get(), 1, listed[i], 1, &q[i * q_elems * 2], 0.0f,
                                    &out_single[i * q_elems * 2]));
  EXPECT_TRUE(out_batch == out_single) << "attend_batch differs from single attends (bitwise)";
}

TEST(Cache, SequencesAndLayersAreIndependent) {
  const qjlkv_config cfg = qjl_config(3, 2, 1, 16, 8);
  const std::vector<std::pair<uint32_t, uint32_t>> streams = {{0, 0}, {0, 1}, {2, 0}, {1, 0xffffffffu}, {2, 7}};
  qt::Cache shared = qt::make_cache(cfg);
  ASSERT_TRUE(shared);
  std::map<std::pair<uint32_t, uint32_t>, qt::Cache> alone;
  for (auto s : streams) {
    alone[s] = qt::make_cache(cfg);
    ASSERT_TRUE(alone[s]);
  }
  qt::Rng rng(23);
  for (int round = 0; round < 12; ++round)
    for (size_t i = 0; i < streams.size(); ++i) {
      if ((round + i) % 3 == 0) continue;  // uneven lengths
      const uint32_t n = 1 + rng.below(11);
      const std::vector<float> k = rng.normals(size_t(n) * kD), v = rng.normals(k.size());
      const auto [layer, seq] = streams[i];
      QT_ASSERT_OK(qjlkv_cache_append(shared.get(), layer, seq, n, k.data(), v.data()));
      QT_ASSERT_OK(qjlkv_cache_append(alone[streams[i]].get(), layer, seq, n, k.data(), v.data()));
    }
  for (auto s : streams) {
    Observation a, b;
    ASSERT_NO_FATAL_FAILURE(observe(shared.get(), cfg, s.first, s.second, 99, &a));
    ASSERT_NO_FATAL_FAILURE(observe(alone[s].get(), cfg, s.first, s.second, 99, &b));
    expect_same_observation(a, b, "layer " + std::to_string(s.first) + " seq " + std::to_string(s.second));
  }
  EXPECT_EQ(qt::length_of(shared.get(), 1, 0), 0u) << "a sequence exists only in the layers appended to";
  EXPECT_EQ(qt::length_of(shared.get(), 0, 7), 0u);
}

TEST(Cache, ClearReleasesTheSequenceAndItsMemory) {
  const qjlkv_config cfg = qjl_config(2, 2, 2, 32, 32);
  qt::Cache cache = qt::make_cache(cfg), only_two = qt::make_cache(cfg), fresh = qt::make_cache(cfg);
  ASSERT_TRUE(cache && only_two && fresh);
  qt::Rng rng(31);
  const uint32_t n1 = 300, n2 = 77;
  const std::vector<float> k1 = rng.normals(size_t(n1) * 2 * kD), v1 = rng.normals(k1.size());
  const std::vector<float> k2 = rng.normals(size_t(n2) * 2 * kD), v2 = rng.normals(k2.size());
  const qjlkv_stats empty = qt::stats_of(cache.get());
  for (uint32_t layer = 0; layer < 2; ++layer) {
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), layer, 1, n1, k1.data(), v1.data()));
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), layer, 2, n2, k2.data(), v2.data()));
    QT_ASSERT_OK(qjlkv_cache_append(only_two.get(), layer, 2, n2, k2.data(), v2.data()));
  }
  const qjlkv_stats before = qt::stats_of(cache.get());
  EXPECT_EQ(before.tokens, 2u * (n1 + n2));
  QT_ASSERT_OK(qjlkv_cache_clear_sequence(cache.get(), 1));
  const qjlkv_stats after = qt::stats_of(cache.get()), reference = qt::stats_of(only_two.get());
  for (uint32_t layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(qt::length_of(cache.get(), layer, 1), 0u);
    EXPECT_EQ(qt::length_of(cache.get(), layer, 2), n2);
  }
  expect_same_stats(after, reference, "after clearing seq 1 vs a cache that never held it");
  EXPECT_LT(after.bytes_reserved, before.bytes_reserved) << "clearing must release memory";
  EXPECT_GE(after.bytes_reserved, after.bytes_used);
  std::vector<float> q = rng.normals(2 * kD), out(2 * kD);
  QT_EXPECT_FAIL(qjlkv_cache_attend(cache.get(), 0, 1, 1, q.data(), 0.0f, out.data()), QJLKV_ERROR_INVALID_ARGUMENT,
                 "seq", "sequence");
  // Clearing an id that holds nothing is fine and changes nothing.
  QT_EXPECT_OK(qjlkv_cache_clear_sequence(cache.get(), 12345));
  expect_same_stats(qt::stats_of(cache.get()), after, "clearing an unknown id");
  // A cleared id starts over like a new sequence.
  QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 1, n2, k2.data(), v2.data()));
  QT_ASSERT_OK(qjlkv_cache_append(fresh.get(), 0, 1, n2, k2.data(), v2.data()));
  Observation a, b;
  ASSERT_NO_FATAL_FAILURE(observe(cache.get(), cfg, 0, 1, 4, &a));
  ASSERT_NO_FATAL_FAILURE(observe(fresh.get(), cfg, 0, 1, 4, &b));
  expect_same_observation(a, b, "reused id vs fresh cache");
  // Clearing everything returns to the empty cache's count.
  QT_ASSERT_OK(qjlkv_cache_clear_sequence(cache.get(), 1));
  QT_ASSERT_OK(qjlkv_cache_clear_sequence(cache.get(), 2));
  const qjlkv_stats cleared = qt::stats_of(cache.get());
  EXPECT_EQ(cleared.tokens, 0u);
  EXPECT_EQ(cleared.bytes_used, empty.bytes_used);
  EXPECT_EQ(cleared.bytes_full_precision, 0u);
  EXPECT_EQ(cleared.bytes_keys_quantized, 0u);
}

// Bytes of one quantized block of one kv head (DESIGN.md "Storage"), keys and values apart.
struct BlockBytes {
  uint64_t keys = 0, values = 0;
};
BlockBytes block_bytes(const qjlkv_config &cfg, uint32_t layer) {
  const uint64_t B = cfg.block_tokens, d = cfg.head_dim;
  BlockBytes b;
  if (cfg.key_method == QJLKV_KEYS_QJL) {
    const bool initial = layer < cfg.initial_layers;
    const uint64_t m = initial ? cfg.initial_key_sketch_dim : cfg.key_sketch_dim;
    const uint64_t m_out =
        cfg.outlier_channels == 0 ? 0 : initial ? cfg.initial_outlier_sketch_dim : cfg.outlier_sketch_dim;
    b.keys = 2 * B + B * m / 8;                                             // norm_in, bits_in
    if (m_out > 0) b.keys += 2 * B + 2 * cfg.outlier_channels * B + cfg.outlier_channels;  // norm_out, corrections, indices
  } else {
    b.keys = 2 * B * d;  // EXACT: 16-bit keys
  }
  b.values = cfg.value_bits == 16 ? 2 * B * d
                                  : 2 * 2 * B * (d / cfg.value_group_size) + B * d * cfg.value_bits / 8;
  return b;
}

void check_stats_by_hand(const qjlkv_config &cfg, const std::vector<std::tuple<uint32_t, uint32_t, uint32_t>> &fills) {
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  qt::Rng rng(41);
  uint64_t tokens = 0, keys_q = 0, values_q = 0, full = 0, rollback = 0;
  const uint64_t hkv = cfg.num_kv_heads, d = cfg.head_dim, elem = qt::dtype_bytes(qjlkv_dtype(cfg.dtype));
  for (auto [layer, seq, n] : fills) {
    const std::vector<float> k = rng.normals(size_t(n) * hkv * d), v = rng.normals(k.size());
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), layer, seq, n, qt::encode(k, qjlkv_dtype(cfg.dtype)).data(),
                                    qt::encode(v, qjlkv_dtype(cfg.dtype)).data()));
    const uint64_t quantized = qt::quantized_positions(n, cfg.block_tokens, cfg.residual_tokens);
    const BlockBytes b = block_bytes(cfg, layer);
    tokens += n;
    keys_q += quantized / cfg.block_tokens * hkv * b.keys;
    values_q += quantized / cfg.block_tokens * hkv * b.values;
    full += (n - quantized) * hkv * d * elem * 2;
    // Exact copies of the blocks that a truncate to n - rollback_tokens or later would reopen.
    // (16-bit blocks of 16-bit inputs reopen from themselves and need none.)
    const bool lossless = cfg.key_method == QJLKV_KEYS_EXACT && cfg.dtype != QJLKV_DTYPE_F32;
    const uint64_t depth = lossless ? 0 : cfg.rollback_tokens;
    const uint64_t floor = n > depth ? n - depth : 0;
    const uint64_t reopenable = quantized - qt::quantized_positions(floor, cfg.block_tokens, cfg.residual_tokens);
    rollback += reopenable * hkv * d * elem * 2;
  }
  const qjlkv_stats st = qt::stats_of(cache.get());
  EXPECT_EQ(st.tokens, tokens);
  EXPECT_EQ(st.bytes_fp16_equivalent, tokens * hkv * d * 4);
  EXPECT_EQ(st.bytes_keys_quantized, keys_q);
  EXPECT_EQ(st.bytes_values_quantized, values_q);
  EXPECT_EQ(st.bytes_full_precision, full);
  EXPECT_EQ(st.bytes_rollback, rollback);
  EXPECT_EQ(st.bytes_used, st.bytes_keys_quantized + st.bytes_values_quantized + st.bytes_full_precision +
                               st.bytes_metadata + st.bytes_rollback);
  EXPECT_GE(st.bytes_reserved, st.bytes_used);
  EXPECT_DOUBLE_EQ(st.bits_per_number, 8.0 * st.bytes_used / (double(tokens) * hkv * d * 2));
  // Per-sequence bookkeeping is small next to the data it describes.
  EXPECT_LE(st.bytes_metadata, 4096u * fills.size()) << "metadata";
  std::printf("[ stats    ] keys %llu + values %llu + full precision %llu + metadata %llu = %llu bytes "
              "(reserved %llu), %.3f bits/number\n",
              (unsigned long long)st.bytes_keys_quantized, (unsigned long long)st.bytes_values_quantized,
              (unsigned long long)st.bytes_full_precision, (unsigned long long)st.bytes_metadata,
              (unsigned long long)st.bytes_used, (unsigned long long)st.bytes_reserved, st.bits_per_number);
}

TEST(Cache, StatsMatchAHandCountQjl) {
  qjlkv_config cfg = qjl_config(2, 4, 2, 32, 32);
  cfg.initial_layers = 1;
  cfg.initial_key_sketch_dim = 256;
  cfg.initial_outlier_sketch_dim = 64;
  check_stats_by_hand(cfg, {{0, 1, 10}, {0, 2, 64}, {1, 2, 200}, {1, 3, 95}, {0, 4, 1000}});
}
TEST(Cache, StatsMatchAHandCountQjlNoOutliersBf16) {
  qjlkv_config cfg = qjl_config(1, 2, 1, 16, 8);
  cfg.dtype = QJLKV_DTYPE_BF16;
  cfg.outlier_channels = 0;
  cfg.outlier_sketch_dim = 0;
  cfg.value_bits = 4;
  cfg.value_group_size = 16;
  check_stats_by_hand(cfg, {{0, 0, 100}, {0, 1, 23}});
}
TEST(Cache, StatsMatchAHandCountExactFp16) {
  qjlkv_config cfg = qt::make_config("exact", 1, 2, 2, kD);
  cfg.dtype = QJLKV_DTYPE_F16;
  check_stats_by_hand(cfg, {{0, 0, 100}, {0, 5, 7}});
}

// SPEC §8: at >= 4k tokens the default preset stores >= 5x less than an fp16 cache.
TEST(Cache, DefaultPresetCompressesFiveTimesAt4kTokens) {
  for (qjlkv_dtype dtype : {QJLKV_DTYPE_F16, QJLKV_DTYPE_F32}) {
    qjlkv_config cfg = qt::make_config("qjl", 1, 2, 2, 128);
    cfg.dtype = dtype;
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    const uint32_t n = 4096;
    qt::Rng rng(1);
    const std::vector<uint8_t> k = qt::encode(rng.normals(size_t(n) * 2 * 128), dtype),
                               v = qt::encode(rng.normals(size_t(n) * 2 * 128), dtype);
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, n, k.data(), v.data()));
    const qjlkv_stats st = qt::stats_of(cache.get());
    const double ratio = double(st.bytes_fp16_equivalent) / double(st.bytes_used);
    std::printf("[ memory   ] qjl preset d=128, %u tokens, %s input: %.3f bits/number, %.2fx smaller than fp16\n", n,
                qt::dtype_name(dtype), st.bits_per_number, ratio);
    EXPECT_GE(ratio, 5.0) << qt::dtype_name(dtype);
  }
}

TEST(Cache, ResultsDoNotDependOnThreadCount) {
  std::vector<Observation> seen;
  for (uint32_t threads : {1u, 3u, 0u}) {
    qjlkv_config cfg = qt::make_config("qjl", 1, 8, 2, 128);
    cfg.num_threads = threads;
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    qt::Rng rng(2);
    const std::vector<float> k = rng.normals(size_t(500) * 2 * 128), v = rng.normals(k.size());
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, 500, k.data(), v.data()));
    seen.emplace_back();
    ASSERT_NO_FATAL_FAILURE(observe(cache.get(), cfg, 0, 0, 3, &seen.back()));
  }
  expect_same_observation(seen[0], seen[1], "1 vs 3 threads");
  expect_same_observation(seen[0], seen[2], "1 vs all cores");
}

}  // namespace
