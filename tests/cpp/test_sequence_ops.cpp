// Sequence operations (qjlkv.h, "Sequence operations"): rollback, fork, the memory budget. Every
// contract is held to the exported stream (the stored bytes, bit for bit) and to attention.
#include <map>
#include <tuple>

#include "testing.hpp"

namespace {

constexpr uint32_t kLayers = 2, kHq = 4, kHkv = 2;

// The tokens one sequence was fed: keys and values [n][Hkv][d] in the cache's dtype.
struct Tokens {
  std::vector<uint8_t> keys, values;
  size_t count(size_t token_bytes) const { return keys.size() / token_bytes; }
};

class Fixture {
 public:
  Fixture(const char *preset, qjlkv_dtype dtype, uint32_t d, uint64_t seed = 7) : rng_(seed) {
    cfg_ = qt::make_config(preset, kLayers, kHq, kHkv, d);
    cfg_.dtype = dtype;
    cfg_.outlier_skip_layers = std::min(cfg_.outlier_skip_layers, 1u);  // OTT: layer 1 traced
    token_bytes_ = size_t(kHkv) * d * qt::dtype_bytes(dtype);
  }
  const qjlkv_config &cfg() const { return cfg_; }
  qjlkv_config &cfg() { return cfg_; }
  size_t token_bytes() const { return token_bytes_; }

  // n fresh random tokens; OTT's tracing sees a few small-norm tokens.
  Tokens make(uint32_t n) {
    std::vector<float> k = rng_.normals(size_t(n) * kHkv * cfg_.head_dim), v = rng_.normals(k.size());
    for (size_t t = 0; t < n; ++t)
      if (rng_.below(9) == 0)
        for (size_t j = 0; j < size_t(kHkv) * cfg_.head_dim; ++j) k[t * kHkv * cfg_.head_dim + j] *= 0.05f;
    return {qt::encode(k, qt::dtype_of(cfg_)), qt::encode(v, qt::dtype_of(cfg_))};
  }
  static Tokens slice(const Tokens &t, size_t first, size_t n, size_t token_bytes) {
    const auto at = [&](const std::vector<uint8_t> &x, size_t i) { return x.begin() + ptrdiff_t(i * token_bytes); };
    return {{at(t.keys, first), at(t.keys, first + n)}, {at(t.values, first), at(t.values, first + n)}};
  }
  static void extend(Tokens &into, const Tokens &more) {
    into.keys.insert(into.keys.end(), more.keys.begin(), more.keys.end());
    into.values.insert(into.values.end(), more.values.begin(), more.values.end());
  }
  std::vector<uint8_t> query() { return qt::encode(rng_.normals(size_t(kHq) * cfg_.head_dim), qt::dtype_of(cfg_)); }

 private:
  qjlkv_config cfg_;
  size_t token_bytes_ = 0;
  qt::Rng rng_;
};

qjlkv_status append_all_layers(qjlkv_cache *c, uint32_t seq, const Tokens &t, size_t token_bytes) {
  const size_t n = t.count(token_bytes);
  for (uint32_t l = 0; l < kLayers; ++l) {
    const qjlkv_status s = qjlkv_cache_append(c, l, seq, uint32_t(n), t.keys.data(), t.values.data());
    if (s != QJLKV_OK) return s;
  }
  return QJLKV_OK;
}

// Appends in pieces of the given sizes (cycled), as a decoding engine would.
void feed(qjlkv_cache *c, uint32_t seq, const Tokens &t, size_t token_bytes, std::initializer_list<size_t> pieces) {
  const size_t n = t.count(token_bytes);
  size_t done = 0;
  for (auto it = pieces.begin(); done < n; it = std::next(it) == pieces.end() ? pieces.begin() : std::next(it)) {
    const size_t m = std::min(*it, n - done);
    QT_ASSERT_OK(append_all_layers(c, seq, Fixture::slice(t, done, m, token_bytes), token_bytes));
    done += m;
  }
}

std::vector<uint8_t> exported(const qjlkv_cache *c, uint32_t seq) { return qt::exported(c, seq, kLayers); }

std::vector<uint8_t> attended(qjlkv_cache *c, uint32_t layer, uint32_t seq, const std::vector<uint8_t> &query) {
  std::vector<uint8_t> out(query.size());
  EXPECT_EQ(qjlkv_cache_attend(c, layer, seq, 1, query.data(), 0.0f, out.data()), QJLKV_OK)
      << qjlkv_last_error_message();
  return out;
}

uint64_t used_bytes(const qjlkv_cache *c) { return qt::stats_of(c).bytes_used; }

using Case = std::tuple<const char *, qjlkv_dtype>;
class SequenceOps : public ::testing::TestWithParam<Case> {
 protected:
  const char *preset() const { return std::get<0>(GetParam()); }
  qjlkv_dtype dtype() const { return std::get<1>(GetParam()); }
};

// Speculative decoding's contract: append k draft tokens, truncate back to n, and the sequence is
// bit for bit the one that never saw them, for every k up to rollback_tokens, wherever n falls
// against the block boundaries (a draft that completes a block, OTT pools included).
TEST_P(SequenceOps, RollbackIsExact) {
  Fixture f(preset(), dtype(), 64);
  const size_t tb = f.token_bytes();
  const uint32_t D = f.cfg().rollback_tokens, B = f.cfg().block_tokens;
  ASSERT_GE(D, 32u);
  const Tokens all = f.make(uint32_t(3 * B + 2 * D + 64));
  const std::vector<uint8_t> q = f.query();
  for (size_t n : {size_t(1), size_t(B) - 3, size_t(2 * B) + 5, size_t(3 * B) + 1}) {
    qt::Cache fresh = qt::make_cache(f.cfg());
    feed(fresh.get(), 0, Fixture::slice(all, 0, n, tb), tb, {n});
    const std::vector<uint8_t> want = exported(fresh.get(), 0);
    for (uint32_t k : {1u, 7u, D / 2, D}) {
      qt::Cache c = qt::make_cache(f.cfg());
      feed(c.get(), 0, Fixture::slice(all, 0, n, tb), tb, {n});
      feed(c.get(), 0, Fixture::slice(all, n, k, tb), tb, {1, 3});  // drafts, in decode-sized appends
      QT_ASSERT_OK(qjlkv_cache_truncate(c.get(), 0, n));
      EXPECT_EQ(exported(c.get(), 0), want) << "n " << n << ", k " << k;
      for (uint32_t l = 0; l < kLayers; ++l) EXPECT_EQ(attended(c.get(), l, 0, q), attended(fresh.get(), l, 0, q));
      // Continuations agree too: the next tokens quantize the same blocks.
      const Tokens next = Fixture::slice(all, n, std::min<size_t>(2 * B, all.count(tb) - n), tb);
      qt::Cache again = qt::make_cache(f.cfg());
      feed(again.get(), 0, Fixture::slice(all, 0, n, tb), tb, {n});
      feed(again.get(), 0, next, tb, {5});
      feed(c.get(), 0, next, tb, {5});
      EXPECT_EQ(exported(c.get(), 0), exported(again.get(), 0)) << "continuation after n " << n << ", k " << k;
      EXPECT_EQ(used_bytes(c.get()), used_bytes(again.get()));
    }
  }
}

// Below the rollback floor, what a truncate keeps is the reconstruction of the kept positions:
// attention afterwards is attention over qjlkv_cache_reconstruct of [0, n).
TEST_P(SequenceOps, DeepTruncateKeepsTheReconstruction) {
  Fixture f(preset(), dtype(), 64);
  const size_t tb = f.token_bytes();
  const uint32_t B = f.cfg().block_tokens, d = f.cfg().head_dim;
  const size_t L = 6 * B + 40, n = 2 * B + 7;
  const Tokens all = f.make(uint32_t(L));
  qt::Cache c = qt::make_cache(f.cfg());
  feed(c.get(), 0, all, tb, {L});
  std::vector<float> k_before(n * kHkv * d), v_before(k_before.size());
  QT_ASSERT_OK(qjlkv_cache_reconstruct(c.get(), 0, 0, 0, n, k_before.data(), v_before.data()));
  QT_ASSERT_OK(qjlkv_cache_truncate(c.get(), 0, n));
  EXPECT_EQ(qt::length_of(c.get(), 0, 0), n);
  std::vector<float> k(n * kHkv * d), v(k.size());
  QT_ASSERT_OK(qjlkv_cache_reconstruct(c.get(), 0, 0, 0, n, k.data(), v.data()));
  // The kept rows are the old reconstruction, rounded to the dtype.
  for (size_t i = 0; i < k.size(); ++i) {
    EXPECT_NEAR(k[i], k_before[i], 1e-2 * (1 + std::fabs(k_before[i]))) << i;
    EXPECT_NEAR(v[i], v_before[i], 1e-2 * (1 + std::fabs(v_before[i]))) << i;
  }
  const std::vector<uint8_t> q = f.query();
  const std::vector<float> qf = qt::decode(q.data(), size_t(kHq) * d, dtype());
  const std::vector<float> got = qt::decode(attended(c.get(), 0, 0, q).data(), size_t(kHq) * d, dtype());
  std::vector<double> want(size_t(kHq) * d);
  for (uint32_t h = 0; h < kHq; ++h) {
    const uint32_t kv = h / (kHq / kHkv);
    std::vector<double> logits(n);
    double top = -INFINITY, sum = 0;
    for (size_t t = 0; t < n; ++t) {
      logits[t] = qt::dot(&qf[h * d], &k[(t * kHkv + kv) * d], d) / std::sqrt(double(d));
      top = std::max(top, logits[t]);
    }
    for (size_t t = 0; t < n; ++t) sum += std::exp(logits[t] - top);
    for (size_t t = 0; t < n; ++t)
      for (uint32_t j = 0; j < d; ++j) want[h * d + j] += std::exp(logits[t] - top) / sum * v[(t * kHkv + kv) * d + j];
  }
  if (dtype() == QJLKV_DTYPE_BF16) {  // the outputs' own rounding (8 bits) exceeds the budget
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-2 * (1 + std::fabs(want[i]))) << i;
  } else {
    qt::expect_within_output_budget(got, want, "deep truncate");
  }
  // It goes on like any sequence.
  feed(c.get(), 0, f.make(2 * B), tb, {1, 9});
  EXPECT_EQ(qt::length_of(c.get(), 1, 0), n + 2 * B);
}

// fork(L) then appends equals a fresh sequence fed the same tokens; fork(p) equals fork(L) +
// truncate(p); neither sequence ever changes the other.
TEST_P(SequenceOps, ForkSharesAndStaysIndependent) {
  Fixture f(preset(), dtype(), 64);
  const size_t tb = f.token_bytes();
  const uint32_t B = f.cfg().block_tokens;
  const size_t L = 4 * B + 21;
  const Tokens prompt = f.make(uint32_t(L)), a = f.make(2 * B + 3), b = f.make(B + 9);
  qt::Cache c = qt::make_cache(f.cfg());
  feed(c.get(), 0, prompt, tb, {L});
  const std::vector<uint8_t> src_before = exported(c.get(), 0);
  const uint64_t used_before = used_bytes(c.get());
  QT_ASSERT_OK(qjlkv_cache_fork(c.get(), 0, 1, L));
  EXPECT_EQ(exported(c.get(), 1), src_before);
  EXPECT_GT(qt::stats_of(c.get()).bytes_shared, 0u);
  // A fork adds only what it does not share: its copies of the exact rows.
  uint64_t held = 0, shared = 0;
  QT_ASSERT_OK(qjlkv_cache_sequence_bytes(c.get(), 1, &held, &shared));
  EXPECT_GT(shared, 0u);
  EXPECT_EQ(used_bytes(c.get()) - used_before, held - shared);
  // Each side decodes on; the other is untouched.
  feed(c.get(), 1, a, tb, {1});
  EXPECT_EQ(exported(c.get(), 0), src_before);
  feed(c.get(), 0, b, tb, {3});
  qt::Cache fresh = qt::make_cache(f.cfg());
  Tokens dst_tokens = prompt, src_tokens = prompt;
  Fixture::extend(dst_tokens, a);
  Fixture::extend(src_tokens, b);
  feed(fresh.get(), 1, dst_tokens, tb, {L, 1});
  feed(fresh.get(), 0, src_tokens, tb, {L, 3});
  EXPECT_EQ(exported(c.get(), 1), exported(fresh.get(), 1));
  EXPECT_EQ(exported(c.get(), 0), exported(fresh.get(), 0));
  const std::vector<uint8_t> q = f.query();
  for (uint32_t s : {0u, 1u}) EXPECT_EQ(attended(c.get(), 1, s, q), attended(fresh.get(), 1, s, q));
  // fork(p) is fork(L) + truncate(p), for p inside the blocks, the tail and the sinks.
  for (uint64_t p : {uint64_t(1), uint64_t(B) + 2, uint64_t(3 * B), uint64_t(L) - 1}) {
    QT_ASSERT_OK(qjlkv_cache_fork(c.get(), 0, 7, p));
    QT_ASSERT_OK(qjlkv_cache_fork(c.get(), 0, 8, L + b.count(tb)));
    QT_ASSERT_OK(qjlkv_cache_truncate(c.get(), 8, p));
    EXPECT_EQ(exported(c.get(), 7), exported(c.get(), 8)) << "p " << p;
    QT_ASSERT_OK(qjlkv_cache_clear_sequence(c.get(), 7));
    QT_ASSERT_OK(qjlkv_cache_clear_sequence(c.get(), 8));
  }
  // Clearing the source leaves the fork whole, and clearing both frees everything.
  const std::vector<uint8_t> dst_now = exported(c.get(), 1);
  QT_ASSERT_OK(qjlkv_cache_clear_sequence(c.get(), 0));
  EXPECT_EQ(exported(c.get(), 1), dst_now);
  QT_ASSERT_OK(qjlkv_cache_clear_sequence(c.get(), 1));
  EXPECT_EQ(used_bytes(c.get()), 0u);
  EXPECT_EQ(qt::stats_of(c.get()).bytes_reserved, 0u);
}

// Admission control: bytes_needed is the growth of bytes_used, and the budget refuses, changing
// nothing, what would exceed it.
TEST_P(SequenceOps, BudgetAndPrediction) {
  Fixture f(preset(), dtype(), 64);
  const size_t tb = f.token_bytes();
  const uint32_t B = f.cfg().block_tokens;
  qt::Cache c = qt::make_cache(f.cfg());
  qt::Rng pick(3);
  for (int step = 0; step < 60; ++step) {
    const uint32_t seq = pick.below(3);
    const uint32_t n = step % 7 == 0 ? 2 * B + pick.below(B) : 1 + pick.below(5);
    uint64_t predicted = 0;
    QT_ASSERT_OK(qjlkv_cache_bytes_needed(c.get(), seq, n, &predicted));
    const uint64_t before = used_bytes(c.get());
    feed(c.get(), seq, f.make(n), tb, {n});
    const uint64_t after = used_bytes(c.get());
    EXPECT_EQ(predicted, after > before ? after - before : 0) << "step " << step << ", n " << n;
    if (step % 11 == 5) QT_ASSERT_OK(qjlkv_cache_fork(c.get(), seq, 9 + step, qt::length_of(c.get(), 0, seq)));
  }
  // A budget a byte above one layer's prompt refuses the second layer and a fork, changing nothing.
  const Tokens prompt = f.make(3 * B + 5);
  const uint32_t n = uint32_t(prompt.count(tb));
  qjlkv_config cfg = f.cfg();
  qt::Cache unlimited = qt::make_cache(cfg);
  QT_ASSERT_OK(qjlkv_cache_append(unlimited.get(), 0, 0, n, prompt.keys.data(), prompt.values.data()));
  const uint64_t one_layer = used_bytes(unlimited.get());
  cfg.memory_budget = one_layer + 1;
  qt::Cache tight = qt::make_cache(cfg);
  QT_ASSERT_OK(qjlkv_cache_append(tight.get(), 0, 0, n, prompt.keys.data(), prompt.values.data()));
  const std::vector<uint8_t> before = exported(tight.get(), 0);
  EXPECT_EQ(used_bytes(tight.get()), one_layer);
  const std::string stale = qt::stale_error_message();
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_append(tight.get(), 1, 0, n, prompt.keys.data(), prompt.values.data()),
                               QJLKV_ERROR_MEMORY_BUDGET, stale, {"memory_budget"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_fork(tight.get(), 0, 1, 5), QJLKV_ERROR_MEMORY_BUDGET, stale,
                               {"memory_budget"}));
  EXPECT_EQ(exported(tight.get(), 0), before);
  EXPECT_EQ(used_bytes(tight.get()), one_layer);
  EXPECT_EQ(qt::length_of(tight.get(), 0, 1), 0u);
  // Freeing makes room again.
  QT_ASSERT_OK(qjlkv_cache_truncate(tight.get(), 0, 0));
  EXPECT_EQ(used_bytes(tight.get()), 0u);
  QT_ASSERT_OK(qjlkv_cache_append(tight.get(), 0, 0, n, prompt.keys.data(), prompt.values.data()));
  EXPECT_EQ(exported(tight.get(), 0), before);
  // The same tokens in small appends end with the same bytes (on the way, the exact tail and the
  // rollback copies can hold more: a budget must leave room for that).
  qt::Cache pieces = qt::make_cache(f.cfg());
  for (uint32_t done = 0; done < n; done += 7) {
    const Tokens piece = Fixture::slice(prompt, done, std::min(7u, n - done), tb);
    QT_ASSERT_OK(qjlkv_cache_append(pieces.get(), 0, 0, uint32_t(piece.count(tb)), piece.keys.data(),
                                    piece.values.data()));
  }
  EXPECT_EQ(used_bytes(pieces.get()), one_layer);
  EXPECT_EQ(exported(pieces.get(), 0), before);
}

// Refusals name the argument and change nothing.
TEST_P(SequenceOps, RefusalsChangeNothing) {
  Fixture f(preset(), dtype(), 64);
  const size_t tb = f.token_bytes();
  qt::Cache c = qt::make_cache(f.cfg());
  feed(c.get(), 0, f.make(150), tb, {150});
  feed(c.get(), 1, f.make(20), tb, {20});
  const std::vector<uint8_t> s0 = exported(c.get(), 0), s1 = exported(c.get(), 1);
  const std::string stale = qt::stale_error_message();
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_truncate(c.get(), 0, 151), QJLKV_ERROR_INVALID_ARGUMENT, stale, {"length"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_fork(c.get(), 0, 1, 10), QJLKV_ERROR_INVALID_ARGUMENT, stale, {"dst_seq"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_fork(c.get(), 0, 0, 10), QJLKV_ERROR_INVALID_ARGUMENT, stale,
                               {"src_seq", "dst_seq"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_fork(c.get(), 0, 2, 151), QJLKV_ERROR_INVALID_ARGUMENT, stale, {"length"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_fork(c.get(), 5, 2, 1), QJLKV_ERROR_INVALID_ARGUMENT, stale, {"length"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_truncate(nullptr, 0, 1), QJLKV_ERROR_INVALID_ARGUMENT, stale, {"c"}));
  uint64_t out = 0;
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_bytes_needed(c.get(), 0, 1, nullptr), QJLKV_ERROR_INVALID_ARGUMENT, stale,
                               {"out"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_bytes_needed(c.get(), 0, UINT32_MAX, &out), QJLKV_ERROR_INVALID_ARGUMENT,
                               stale, {"n_tokens"}));
  EXPECT_EQ(exported(c.get(), 0), s0);
  EXPECT_EQ(exported(c.get(), 1), s1);
  EXPECT_EQ(qt::length_of(c.get(), 0, 2), 0u);
  // Truncating to the length, or forking nothing, are no-ops.
  QT_ASSERT_OK(qjlkv_cache_truncate(c.get(), 0, 150));
  QT_ASSERT_OK(qjlkv_cache_fork(c.get(), 0, 3, 0));
  EXPECT_EQ(exported(c.get(), 0), s0);
  EXPECT_EQ(qt::length_of(c.get(), 0, 3), 0u);
}

INSTANTIATE_TEST_SUITE_P(Presets, SequenceOps,
                         ::testing::Combine(::testing::Values("q2", "q3", "q4", "qjl", "kivi", "ott", "exact"),
                                            ::testing::Values(QJLKV_DTYPE_F16, QJLKV_DTYPE_F32, QJLKV_DTYPE_BF16)),
                         [](const auto &info) {
                           return std::string(std::get<0>(info.param)) + "_" + qt::dtype_name(std::get<1>(info.param));
                         });

}  // namespace
