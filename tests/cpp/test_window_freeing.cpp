// Sliding windows free the blocks their window leaves behind (qjlkv.h, "Attention variants of a
// layer"): bounded memory on long sequences, attention equal to a cache that freed nothing and
// to a float64 reference, exact truncates at or above the rollback floor, refusals that change
// nothing, forks, export/import (format version 5), bytes_needed and the memory budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "crc32c.hpp"
#include "testing.hpp"

namespace {

constexpr uint32_t kWindow = 100, kRollback = 32;

// 2 kv heads, blocks of 16, a tail of 8, 4 sinks where the preset has sinks, OTT tracing.
qjlkv_config window_config(const char *preset, qjlkv_dtype dtype, uint32_t rollback = kRollback) {
  qjlkv_config cfg = qt::make_config(preset, 1, 4, 2, 32);
  cfg.dtype = dtype;
  cfg.block_tokens = 16;
  cfg.residual_tokens = 8;
  cfg.rollback_tokens = rollback;
  if (cfg.sink_tokens) cfg.sink_tokens = 4;
  if (cfg.key_method == QJLKV_KEYS_OTT) cfg.outlier_skip_layers = 0;
  return cfg;
}

void set_window(qjlkv_cache *c, uint32_t window, uint32_t layer = 0) {
  qjlkv_layer_attention a;
  std::memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.window_tokens = window;
  QT_ASSERT_OK(qjlkv_cache_set_layer_attention(c, layer, &a));
}

// Random tokens in the cache's dtype, reproducible per (seed, first token).
struct Tokens {
  std::vector<uint8_t> keys, values;
};
Tokens tokens(const qjlkv_config &cfg, uint32_t n, uint64_t seed) {
  qt::Rng rng(seed);
  std::vector<float> k = rng.normals(size_t(n) * cfg.num_kv_heads * cfg.head_dim);
  std::vector<float> v = rng.normals(k.size());
  const qjlkv_dtype dtype = qt::dtype_of(cfg);
  qt::make_representable(k, dtype);
  qt::make_representable(v, dtype);
  return {qt::encode(k, dtype), qt::encode(v, dtype)};
}

qjlkv_status append(qjlkv_cache *c, const qjlkv_config &cfg, uint32_t seq, uint32_t n, uint64_t seed,
                    uint32_t layer = 0) {
  const Tokens t = tokens(cfg, n, seed);
  return qjlkv_cache_append(c, layer, seq, n, t.keys.data(), t.values.data());
}

std::vector<uint8_t> query(const qjlkv_config &cfg, uint32_t n_queries, uint64_t seed) {
  qt::Rng rng(seed);
  std::vector<float> q = rng.normals(size_t(n_queries) * cfg.num_q_heads * cfg.head_dim);
  qt::make_representable(q, qt::dtype_of(cfg));
  return qt::encode(q, qt::dtype_of(cfg));
}

std::vector<uint8_t> attend(qjlkv_cache *c, const qjlkv_config &cfg, uint32_t seq, uint32_t n_queries,
                            const std::vector<uint8_t> &q) {
  std::vector<uint8_t> out(size_t(n_queries) * cfg.num_q_heads * cfg.head_dim * qt::dtype_bytes(qt::dtype_of(cfg)));
  EXPECT_EQ(qjlkv_cache_attend(c, 0, seq, n_queries, q.data(), 0.25f, out.data()), QJLKV_OK)
      << qjlkv_last_error_message();
  return out;
}

// Decode attention of the last position in float64 over the stored numbers of its window
// (qjlkv_cache_reconstruct of the visible range).
std::vector<double> reference(qjlkv_cache *c, const qjlkv_config &cfg, uint32_t seq, const std::vector<float> &q,
                              uint32_t window) {
  const uint32_t Hq = cfg.num_q_heads, Hkv = cfg.num_kv_heads, d = cfg.head_dim, G = Hq / Hkv;
  const uint64_t length = qt::length_of(c, 0, seq), first = length > window ? length - window : 0;
  std::vector<float> keys((length - first) * Hkv * d), values(keys.size());
  EXPECT_EQ(qjlkv_cache_reconstruct(c, 0, seq, first, length - first, keys.data(), values.data()), QJLKV_OK)
      << qjlkv_last_error_message();
  std::vector<double> out(size_t(Hq) * d, 0.0);
  for (uint32_t h = 0; h < Hq; ++h) {
    std::vector<double> logits(length - first);
    double top = -INFINITY, sum = 0.0;
    for (uint64_t t = 0; t < logits.size(); ++t)
      top = std::max(top, logits[t] = 0.25 * qt::dot(&q[size_t(h) * d], &keys[(t * Hkv + h / G) * d], d));
    for (double &s : logits) sum += (s = std::exp(s - top));
    for (uint64_t t = 0; t < logits.size(); ++t)
      for (uint32_t j = 0; j < d; ++j) out[size_t(h) * d + j] += logits[t] / sum * values[(t * Hkv + h / G) * d + j];
  }
  return out;
}

class WindowFreeing : public ::testing::TestWithParam<std::tuple<const char *, qjlkv_dtype>> {};

// A long sequence, appended in chunks and then one token at a time: the positions held and the
// bytes stay bounded; decode attention is bit for bit that of a cache that frees nothing (a
// rollback floor that stays at 0 keeps every block) and matches the float64 reference.
TEST_P(WindowFreeing, BoundedMemoryAndExactAttention) {
  const auto [preset, dtype] = GetParam();
  const qjlkv_config cfg = window_config(preset, dtype);
  qjlkv_config keeping_cfg = window_config(preset, dtype, QJLKV_MAX_ROLLBACK_TOKENS);
  qt::Cache cache = qt::make_cache(cfg), keeping = qt::make_cache(keeping_cfg);
  ASSERT_TRUE(cache && keeping);
  set_window(cache.get(), kWindow);
  set_window(keeping.get(), kWindow);
  const uint64_t sinks = cfg.sink_tokens, B = cfg.block_tokens;
  uint64_t length = 0, step = 0, max_bytes_middle = 0, max_bytes_late = 0;
  const uint32_t total = 20000;
  while (length < total) {
    const uint32_t n = length < 8000 ? uint32_t(37 + 200 * (step % 3)) : 1;  // chunks, then decode
    const uint64_t seed = 1000 + step;
    QT_ASSERT_OK(append(cache.get(), cfg, 0, n, seed));
    QT_ASSERT_OK(append(keeping.get(), keeping_cfg, 0, n, seed));
    length += n;
    ++step;
    const qjlkv_stats st = qt::stats_of(cache.get());
    // Held: the window, the positions the floor keeps reopenable, a block, the tail, the chunk.
    EXPECT_LE(st.tokens, sinks + kWindow + kRollback + 2 * B + cfg.residual_tokens + n) << preset << " at " << length;
    if (length > 1000) {
      EXPECT_LT(st.tokens, length) << preset << ": nothing freed at " << length;
    }
    if (length > 8000 && length <= 14000) max_bytes_middle = std::max(max_bytes_middle, st.bytes_used);
    if (length > 14000) max_bytes_late = std::max(max_bytes_late, st.bytes_used);
    if (step % 397 != 0 && length < total) continue;
    const std::vector<uint8_t> q = query(cfg, 1, seed);
    const std::vector<uint8_t> got = attend(cache.get(), cfg, 0, 1, q);
    if (qt::stats_of(keeping.get()).tokens == length) {  // the keeping cache freed nothing
      EXPECT_EQ(got, attend(keeping.get(), keeping_cfg, 0, 1, q)) << preset << " at " << length;
    }
    const std::vector<double> want =
        reference(cache.get(), cfg, 0, qt::decode(q.data(), q.size() / qt::dtype_bytes(dtype), dtype), kWindow);
    const std::vector<float> out = qt::decode(got.data(), want.size(), dtype);
    const std::string what = std::string(preset) + " at " + std::to_string(length);
    if (dtype == QJLKV_DTYPE_F32) qt::expect_within_output_budget(out, want, what);
    else qt::expect_near_all(out, want, 1e-2, 1e-2, what);
  }
  EXPECT_LE(max_bytes_late, max_bytes_middle) << preset << ": bytes keep growing";
  const qjlkv_stats st = qt::stats_of(cache.get());
  EXPECT_DOUBLE_EQ(st.bits_per_number,
                   double(st.bytes_used) * 8.0 / double(st.tokens * cfg.num_kv_heads * cfg.head_dim * 2));
}

// Truncating to n >= the rollback floor always succeeds and is exact: appends and attention
// continue as in a cache that never held the positions beyond n.
TEST_P(WindowFreeing, TruncateAtOrAboveTheFloorIsExact) {
  const auto [preset, dtype] = GetParam();
  const qjlkv_config cfg = window_config(preset, dtype);
  qt::Cache cache = qt::make_cache(cfg), fresh = qt::make_cache(cfg);
  set_window(cache.get(), kWindow);
  set_window(fresh.get(), kWindow);
  uint64_t length = 0;
  for (uint32_t round = 0; round < 12; ++round) {
    const uint32_t accepted = 50 + 13 * round;
    QT_ASSERT_OK(append(cache.get(), cfg, 0, accepted, 7 * round));
    QT_ASSERT_OK(append(fresh.get(), cfg, 0, accepted, 7 * round));
    length += accepted;
    // Drafts, one at a time (each frees what it may), then back to every length >= the floor.
    for (uint32_t draft = 0; draft < kRollback; ++draft) QT_ASSERT_OK(append(cache.get(), cfg, 0, 1, 5000 + draft));
    QT_ASSERT_OK(qjlkv_cache_truncate(cache.get(), 0, length + kRollback / 2));
    QT_ASSERT_OK(qjlkv_cache_truncate(cache.get(), 0, length));
    const std::vector<uint8_t> q = query(cfg, 1, round);
    QT_ASSERT_OK(append(cache.get(), cfg, 0, 1, 9000 + round));
    QT_ASSERT_OK(append(fresh.get(), cfg, 0, 1, 9000 + round));
    ++length;
    EXPECT_EQ(attend(cache.get(), cfg, 0, 1, q), attend(fresh.get(), cfg, 0, 1, q)) << preset << " round " << round;
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, WindowFreeing,
                         ::testing::Combine(::testing::Values("exact", "q2", "q3", "q4", "qjl", "kivi", "ott"),
                                            ::testing::Values(QJLKV_DTYPE_F32, QJLKV_DTYPE_BF16, QJLKV_DTYPE_F16)),
                         [](const auto &info) {
                           return std::string(std::get<0>(info.param)) + "_" + qt::dtype_name(std::get<1>(info.param));
                         });

// A cache with freed blocks: q3, window 100, 1000 tokens.
struct Freed {
  qjlkv_config cfg;
  qt::Cache cache;
  uint64_t freed_end = 0;  // positions [sinks, freed_end) are freed
};
Freed make_freed(const char *preset = "q3") {
  Freed f{window_config(preset, QJLKV_DTYPE_F32), nullptr};
  f.cache = qt::make_cache(f.cfg);
  set_window(f.cache.get(), kWindow);
  EXPECT_EQ(append(f.cache.get(), f.cfg, 0, 1000, 1), QJLKV_OK);
  for (uint32_t i = 0; i < 40; ++i) EXPECT_EQ(append(f.cache.get(), f.cfg, 0, 1, 100 + i), QJLKV_OK);
  const qjlkv_stats st = qt::stats_of(f.cache.get());
  f.freed_end = 1040 - st.tokens + f.cfg.sink_tokens;
  EXPECT_GT(f.freed_end, 500u);
  return f;
}

// Calls that would reach freed positions are refused with INVALID_ARGUMENT naming the argument
// and change nothing; scores read -INFINITY there.
TEST(WindowFreeingRules, RefusalsChangeNothing) {
  Freed f = make_freed();
  qjlkv_cache *c = f.cache.get();
  const std::vector<uint8_t> q1 = query(f.cfg, 1, 3);
  qt::Snapshot before, after;
  ASSERT_NO_FATAL_FAILURE(qt::take_snapshot(c, {{0, 0}}, q1, &before));
  const std::vector<uint8_t> out_before = attend(c, f.cfg, 0, 1, q1);

  // The first query at freed_end + W - 1 sees from freed_end on; one more query sees freed_end - 1.
  const uint32_t fitting = uint32_t(1040 - (f.freed_end + kWindow - 1));
  const std::vector<uint8_t> q = query(f.cfg, fitting + 1, 4);
  std::vector<float> out(size_t(fitting + 1) * f.cfg.num_q_heads * f.cfg.head_dim);
  QT_EXPECT_FAIL(qjlkv_cache_attend(c, 0, 0, fitting + 1, q.data(), 0.0f, out.data()), QJLKV_ERROR_INVALID_ARGUMENT,
                 "n_queries");
  QT_EXPECT_OK(qjlkv_cache_attend(c, 0, 0, fitting, q.data(), 0.0f, out.data()));
  std::vector<float> k(4 * 2 * 32);
  QT_EXPECT_FAIL(qjlkv_cache_reconstruct(c, 0, 0, f.freed_end - 1, 2, k.data(), nullptr),
                 QJLKV_ERROR_INVALID_ARGUMENT, "first");
  QT_EXPECT_OK(qjlkv_cache_reconstruct(c, 0, 0, f.freed_end, 2, k.data(), nullptr));
  QT_EXPECT_FAIL(qjlkv_cache_truncate(c, 0, f.freed_end - 3), QJLKV_ERROR_INVALID_ARGUMENT, "length");
  QT_EXPECT_FAIL(qjlkv_cache_truncate(c, 0, f.freed_end + kWindow - 2), QJLKV_ERROR_INVALID_ARGUMENT, "length");
  QT_EXPECT_FAIL(qjlkv_cache_fork(c, 0, 1, f.freed_end + 10), QJLKV_ERROR_INVALID_ARGUMENT, "length");
  EXPECT_EQ(qt::length_of(c, 0, 1), 0u);
  ASSERT_NO_FATAL_FAILURE(qt::take_snapshot(c, {{0, 0}}, q1, &after));
  qt::expect_same_snapshot(before, after, "refused calls");
  EXPECT_EQ(out_before, attend(c, f.cfg, 0, 1, q1));

  // Scores: -INFINITY at freed positions, finite elsewhere (q3 moves no token to a pool).
  std::vector<float> scores;
  ASSERT_NO_FATAL_FAILURE(qt::library_scores(c, 0, 0, q1, &scores));
  for (uint32_t h = 0; h < f.cfg.num_q_heads; ++h)
    for (uint64_t p = 0; p < 1040; ++p) {
      const float s = scores[h * 1040 + p];
      if (p >= f.cfg.sink_tokens && p < f.freed_end) EXPECT_EQ(s, -INFINITY) << p;
      else EXPECT_TRUE(std::isfinite(s)) << p;
    }

  // Truncates to the lengths whose next query sees no freed position succeed; to 0 empties.
  QT_EXPECT_OK(qjlkv_cache_truncate(c, 0, f.freed_end + kWindow - 1));
  QT_EXPECT_OK(qjlkv_cache_truncate(c, 0, 0));
  EXPECT_EQ(qt::stats_of(c).bytes_used, 0u);
}

// A fork shares the freed state and the live blocks; freeing in one sequence releases a shared
// block only when its last holder frees or drops it.
TEST(WindowFreeingRules, ForkSharesTheFreedState) {
  Freed f = make_freed("kivi");
  qjlkv_cache *c = f.cache.get();
  QT_ASSERT_OK(qjlkv_cache_fork(c, 0, 1, 1040));
  EXPECT_EQ(qt::stats_of(c).tokens, 2 * (1040 - f.freed_end + f.cfg.sink_tokens));
  const std::vector<uint8_t> q = query(f.cfg, 1, 8);
  for (uint32_t i = 0; i < 300; ++i) {
    QT_ASSERT_OK(append(c, f.cfg, 0, 1, 40000 + i));
    QT_ASSERT_OK(append(c, f.cfg, 1, 1, 40000 + i));
  }
  EXPECT_EQ(attend(c, f.cfg, 0, 1, q), attend(c, f.cfg, 1, 1, q));
  uint64_t bytes0 = 0, shared0 = 0;
  QT_ASSERT_OK(qjlkv_cache_sequence_bytes(c, 0, &bytes0, &shared0));
  EXPECT_EQ(shared0, 0u) << "the blocks both held are freed by both";
  // Only one of them moves on: the blocks it frees stay held by the other.
  const qjlkv_stats before = qt::stats_of(c);
  for (uint32_t i = 0; i < 200; ++i) QT_ASSERT_OK(append(c, f.cfg, 0, 1, 50000 + i));
  QT_ASSERT_OK(qjlkv_cache_clear_sequence(c, 1));
  QT_ASSERT_OK(qjlkv_cache_sequence_bytes(c, 0, &bytes0, &shared0));
  EXPECT_EQ(qt::stats_of(c).bytes_used, bytes0);
  EXPECT_LE(bytes0, before.bytes_used / 2 + 32 * 1024);
}

// bytes_needed is the exact growth of every append of a windowed layer (negative growth reads
// 0), also when a fork shares the blocks being freed; a budget a windowed sequence fits in once
// holds it forever.
TEST(WindowFreeingRules, BytesNeededAndBudget) {
  for (const char *preset : {"q3", "ott", "exact"}) {
    Freed f = make_freed(preset);
    qjlkv_cache *c = f.cache.get();
    QT_ASSERT_OK(qjlkv_cache_fork(c, 0, 1, 1040));  // seq 0 frees blocks seq 1 still holds
    for (uint32_t i = 0; i < 400; ++i) {
      const uint32_t n = i % 50 == 0 ? 70 : 1;
      uint64_t needed = 0;
      QT_ASSERT_OK(qjlkv_cache_bytes_needed(c, 0, n, &needed));
      const uint64_t used = qt::stats_of(c).bytes_used;
      QT_ASSERT_OK(append(c, f.cfg, 0, n, 60000 + i));
      const uint64_t now = qt::stats_of(c).bytes_used;
      EXPECT_EQ(needed, now > used ? now - used : 0) << preset << " step " << i;
    }
    // A budget with room for a few blocks more than the window needs: decoding on never hits it.
    qjlkv_config budget_cfg = f.cfg;
    budget_cfg.memory_budget = qt::stats_of(make_freed(preset).cache.get()).bytes_used + 64 * 1024;
    qt::Cache limited = qt::make_cache(budget_cfg);
    set_window(limited.get(), kWindow);
    // A prefill in one append holds all its tokens until it commits (its queries see them all): chunks.
    for (uint32_t i = 0; i < 20; ++i) QT_ASSERT_OK(append(limited.get(), budget_cfg, 0, 50, 1 + i));
    for (uint32_t i = 0; i < 5000; ++i) QT_ASSERT_OK(append(limited.get(), budget_cfg, 0, 1, 70000 + i));
    EXPECT_LE(qt::stats_of(limited.get()).bytes_used, budget_cfg.memory_budget);
  }
}

// Export of a sequence with freed blocks: format version 5 with only the stored blocks; it
// imports into a layer whose window keeps the freed positions out of the next query, bit for bit.
TEST(WindowFreeingRules, ExportImportRoundTrip) {
  for (const char *preset : {"q3", "ott", "qjl", "exact"}) {
    Freed f = make_freed(preset);
    const std::vector<uint8_t> stream = qt::exported(f.cache.get(), 0, 1);
    uint32_t version = 0;
    std::memcpy(&version, stream.data() + 8, 4);
    EXPECT_EQ(version, 5u) << preset;
    qt::Cache copy = qt::make_cache(f.cfg);
    set_window(copy.get(), kWindow);
    QT_ASSERT_OK(qjlkv_cache_import(copy.get(), 4, stream.data(), stream.size()));
    const std::vector<uint8_t> q = query(f.cfg, 1, 2);
    EXPECT_EQ(attend(f.cache.get(), f.cfg, 0, 1, q), attend(copy.get(), f.cfg, 4, 1, q)) << preset;
    EXPECT_EQ(qt::exported(copy.get(), 4, 1), stream) << preset;
    EXPECT_EQ(qt::stats_of(copy.get()).tokens, qt::stats_of(f.cache.get()).tokens) << preset;
    for (uint32_t i = 0; i < 100; ++i) {
      QT_ASSERT_OK(append(f.cache.get(), f.cfg, 0, 1, 80000 + i));
      QT_ASSERT_OK(append(copy.get(), f.cfg, 4, 1, 80000 + i));
    }
    EXPECT_EQ(attend(f.cache.get(), f.cfg, 0, 1, q), attend(copy.get(), f.cfg, 4, 1, q)) << preset;

    // Layers without a window, or with one that would see freed positions, refuse it.
    for (const uint32_t window : {0u, uint32_t(1040 - f.freed_end + 2)}) {
      qt::Cache other = qt::make_cache(f.cfg);
      if (window) set_window(other.get(), window);
      QT_EXPECT_FAIL(qjlkv_cache_import(other.get(), 0, stream.data(), stream.size()), QJLKV_ERROR_INVALID_ARGUMENT,
                     "window_tokens");
      EXPECT_EQ(qt::stats_of(other.get()).bytes_used, 0u);
    }
    // A freed count above the blocks is corrupt data (the checksum made to match).
    const size_t freed_at = 140 + 16 + 32;  // header (v5), section header, freed_blocks
    std::vector<uint8_t> bad = stream;
    const uint32_t huge = 1u << 20;
    std::memcpy(bad.data() + freed_at, &huge, 4);
    const uint32_t crc = qjlkv::crc32c(bad.data(), bad.size() - 4);
    std::memcpy(bad.data() + bad.size() - 4, &crc, 4);
    qt::Cache target = qt::make_cache(f.cfg);
    set_window(target.get(), kWindow);
    QT_EXPECT_FAIL(qjlkv_cache_import(target.get(), 0, bad.data(), bad.size()), QJLKV_ERROR_CORRUPT_DATA,
                   "freed");
  }
  // Without freed blocks the stream stays at version 3 or 4.
  qjlkv_config cfg = window_config("q3", QJLKV_DTYPE_F32);
  qt::Cache plain = qt::make_cache(cfg);
  set_window(plain.get(), 4096);
  QT_ASSERT_OK(append(plain.get(), cfg, 0, 1000, 1));
  const std::vector<uint8_t> stream = qt::exported(plain.get(), 0, 1);
  uint32_t version = 0;
  std::memcpy(&version, stream.data() + 8, 4);
  EXPECT_LT(version, 5u);
}

}  // namespace
