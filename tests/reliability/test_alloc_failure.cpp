// Allocation-failure injection: for every call that allocates, make its 1st, 2nd, ... n-th
// allocation fail until the call no longer reaches the failing allocation. Each failure must
// return QJLKV_ERROR_OUT_OF_MEMORY, leave the cache observably unchanged (lengths, statistics,
// scores and attention outputs bit for bit), and leak nothing (live allocations and bytes return
// to their level before the cache was created once it is destroyed); the same call must then
// succeed and give exactly what a call that never saw a failure gives.
#include <algorithm>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "counting_allocator.hpp"
#include "reliability.hpp"

namespace qjlkv_test {
namespace {

// A call under test; `output` (output_bytes, allocated before the call) receives what it writes.
using Call = std::function<qjlkv_status(qjlkv_cache *, uint8_t *output)>;
using Setup = std::function<void(qjlkv_cache *)>;

struct Scenario {
  std::string name;
  Setup setup;  // brings a fresh cache to the state the call starts from
  size_t output_bytes;
  Call call;
};

// The streams every snapshot looks at: those the scenarios touch, plus one never used.
const std::vector<Stream> kStreams = {{0, 1}, {0, 2}, {0, 3}, {0, 7}, {1, 7}, {1, 9}, {0, 12345}};

int recorded_failures() {
  return ::testing::UnitTest::GetInstance()->current_test_info()->result()->total_part_count();
}

constexpr uint64_t kMaxAllocationsPerCall = 10000;  // a walk that goes further is a bug itself

void expect_setup_ok(qjlkv_status s, const char *what) { ASSERT_EQ(s, QJLKV_OK) << what << ": " << describe(s); }

Cache fresh_cache(const qjlkv_config &cfg, const Setup &setup) {
  qjlkv_cache *c = nullptr;
  const qjlkv_status s = qjlkv_cache_create(&cfg, &c);
  EXPECT_EQ(s, QJLKV_OK) << describe(s);
  Cache cache(c);
  if (cache && setup) setup(cache.get());
  return cache;
}

// Walks n over every allocation of scenario.call; see the file comment for what is checked.
void walk(const qjlkv_config &cfg, const Scenario &scenario) {
  SCOPED_TRACE("scenario " + scenario.name);
  // What the call gives when nothing fails.
  Snapshot expected_state;
  std::vector<uint8_t> expected_output(scenario.output_bytes);
  {
    Cache cache = fresh_cache(cfg, scenario.setup);
    ASSERT_TRUE(cache);
    const qjlkv_status s = scenario.call(cache.get(), expected_output.data());
    ASSERT_EQ(s, QJLKV_OK) << "without injected failures: " << describe(s);
    expected_state = snapshot(cache.get(), kStreams);
  }
  for (uint64_t n = 1;; ++n) {
    ASSERT_LT(n, kMaxAllocationsPerCall) << "the call never stops allocating";
    const int failures_before = recorded_failures();
    const AllocationCounts baseline = allocation_counts();
    bool reached_end = false;
    {
      Cache cache = fresh_cache(cfg, scenario.setup);
      ASSERT_TRUE(cache);
      const Snapshot before = snapshot(cache.get(), kStreams);
      std::vector<uint8_t> output(scenario.output_bytes);
      fail_nth_allocation(n);
      const qjlkv_status s = scenario.call(cache.get(), output.data());
      const bool injected = disarm_allocation_failure();
      if (s == QJLKV_OK) {
        // The failure was not reached, or the library recovered from it: either way the call
        // must have done exactly its job.
        EXPECT_EQ(output, expected_output) << "allocation " << n << " failed, the call returned OK";
        EXPECT_TRUE(snapshot(cache.get(), kStreams) == expected_state)
            << "allocation " << n << " failed, the call returned OK but left a different state";
        reached_end = !injected;
      } else {
        ASSERT_TRUE(injected) << "failed without an injected failure: " << describe(s);
        ASSERT_EQ(s, QJLKV_ERROR_OUT_OF_MEMORY) << "allocation " << n << ": " << describe(s);
        EXPECT_STRNE(qjlkv_last_error_message(), "");
        EXPECT_TRUE(snapshot(cache.get(), kStreams) == before)
            << "allocation " << n << " failed: the cache changed although the call failed";
        // The cache is still usable, and the retried call does exactly its job.
        std::fill(output.begin(), output.end(), 0);
        const qjlkv_status retry = scenario.call(cache.get(), output.data());
        ASSERT_EQ(retry, QJLKV_OK) << "retry after failing allocation " << n << ": " << describe(retry);
        EXPECT_EQ(output, expected_output) << "retry after failing allocation " << n;
        EXPECT_TRUE(snapshot(cache.get(), kStreams) == expected_state)
            << "retry after failing allocation " << n << " left a different state";
      }
    }
    // gtest keeps every failure it records in memory: count live blocks only after a clean round.
    const AllocationCounts after = allocation_counts();
    if (recorded_failures() == failures_before) {
      ASSERT_EQ(after.live_allocations, baseline.live_allocations) << "allocation " << n << ": leaked blocks";
      ASSERT_EQ(after.live_bytes, baseline.live_bytes) << "allocation " << n << ": leaked bytes";
    }
    if (reached_end) return;  // n - 1 allocations, each failed once (none: the call allocates nothing)
  }
}

// ---- the scenarios ---------------------------------------------------------------------------
// Every call's data is made when the scenario is built: while a failure is armed, only the
// library may allocate.
Setup fill(const qjlkv_config &cfg, std::vector<std::pair<Stream, uint32_t>> streams) {
  return [cfg, streams](qjlkv_cache *c) {
    uint64_t seed = 1;
    for (const auto &[s, n] : streams) expect_setup_ok(append_tokens(c, cfg, s.layer, s.seq, n, seed++), "setup");
  };
}

Scenario append_call(std::string name, Setup setup, const qjlkv_config &cfg, uint32_t layer, uint32_t seq,
                     uint32_t n) {
  auto k = std::make_shared<std::vector<uint8_t>>(tokens(cfg, n, 99));
  auto v = std::make_shared<std::vector<uint8_t>>(tokens(cfg, n, 98));
  return {std::move(name), std::move(setup), 0, [=](qjlkv_cache *c, uint8_t *) {
            return qjlkv_cache_append(c, layer, seq, n, k->data(), v->data());
          }};
}

Scenario append_batch_call(std::string name, Setup setup, const qjlkv_config &cfg, uint32_t layer,
                           std::vector<uint32_t> seqs) {
  const auto n = uint32_t(seqs.size());
  auto k = std::make_shared<std::vector<uint8_t>>(tokens(cfg, n, 77));
  auto v = std::make_shared<std::vector<uint8_t>>(tokens(cfg, n, 78));
  auto ids = std::make_shared<std::vector<uint32_t>>(std::move(seqs));
  return {std::move(name), std::move(setup), 0, [=](qjlkv_cache *c, uint8_t *) {
            return qjlkv_cache_append_batch(c, layer, n, ids->data(), k->data(), v->data());
          }};
}

Scenario attend_call(std::string name, Setup setup, const qjlkv_config &cfg, uint32_t layer, uint32_t seq,
                     uint32_t n_queries) {
  auto q = std::make_shared<std::vector<uint8_t>>(queries(cfg, n_queries, 55));
  return {std::move(name), std::move(setup), q->size(), [=](qjlkv_cache *c, uint8_t *out) {
            return qjlkv_cache_attend(c, layer, seq, n_queries, q->data(), 0.0f, out);
          }};
}

Scenario attend_batch_call(std::string name, Setup setup, const qjlkv_config &cfg, uint32_t layer,
                           std::vector<uint32_t> seqs) {
  const auto n = uint32_t(seqs.size());
  auto q = std::make_shared<std::vector<uint8_t>>(queries(cfg, n, 56));
  auto ids = std::make_shared<std::vector<uint32_t>>(std::move(seqs));
  return {std::move(name), std::move(setup), q->size(), [=](qjlkv_cache *c, uint8_t *out) {
            return qjlkv_cache_attend_batch(c, layer, n, ids->data(), q->data(), 0.5f, out);
          }};
}

Scenario scores_call(std::string name, Setup setup, const qjlkv_config &cfg, uint32_t layer, uint32_t seq,
                     size_t length) {
  auto q = std::make_shared<std::vector<uint8_t>>(queries(cfg, 1, 57));
  const size_t n = cfg.num_q_heads * length;
  return {std::move(name), std::move(setup), n * sizeof(float), [=](qjlkv_cache *c, uint8_t *out) {
            return qjlkv_cache_scores(c, layer, seq, q->data(), reinterpret_cast<float *>(out), n);
          }};
}

Scenario reconstruct_call(std::string name, Setup setup, const qjlkv_config &cfg, uint32_t layer, uint32_t seq,
                         uint64_t first, uint64_t count) {
  const size_t floats = count * cfg.num_kv_heads * cfg.head_dim;
  return {std::move(name), std::move(setup), 2 * floats * sizeof(float), [=](qjlkv_cache *c, uint8_t *out) {
            float *keys = reinterpret_cast<float *>(out);
            return qjlkv_cache_reconstruct(c, layer, seq, first, count, keys, keys + floats);
          }};
}

// The stream of seq 7 (both layers, blocks and tails) of a cache set up by `setup`.
std::shared_ptr<std::vector<uint8_t>> exported_stream(const qjlkv_config &cfg, const Setup &setup) {
  Cache source = fresh_cache(cfg, setup);
  uint64_t size = 0;
  EXPECT_EQ(qjlkv_cache_export_size(source.get(), 7, 0, cfg.num_layers, &size), QJLKV_OK);
  auto stream = std::make_shared<std::vector<uint8_t>>(size);
  EXPECT_EQ(qjlkv_cache_export(source.get(), 7, 0, cfg.num_layers, stream->data(), size), QJLKV_OK);
  return stream;
}

Scenario export_call(std::string name, Setup setup, const qjlkv_config &cfg) {
  const size_t size = exported_stream(cfg, setup)->size();
  return {std::move(name), setup, size, [=](qjlkv_cache *c, uint8_t *out) {
            return qjlkv_cache_export(c, 7, 0, cfg.num_layers, out, size);
          }};
}

// Imports into seq 12345, which the snapshots watch (layer 0), beside an existing sequence.
Scenario import_call(std::string name, const qjlkv_config &cfg, const Setup &source_setup, bool streamed) {
  auto stream = exported_stream(cfg, source_setup);
  struct Source {
    const std::vector<uint8_t> *bytes;
    size_t at;
  };
  return {std::move(name), fill(cfg, {{{0, 7}, 3}}), 0, [=](qjlkv_cache *c, uint8_t *) {
            if (!streamed) return qjlkv_cache_import(c, 12345, stream->data(), stream->size());
            Source source{stream.get(), 0};
            return qjlkv_cache_import_stream(
                c, 12345,
                [](void *user, void *data, size_t size) -> size_t {
                  auto *s = static_cast<Source *>(user);
                  const size_t n = std::min(size, s->bytes->size() - s->at);
                  std::memcpy(data, s->bytes->data() + s->at, n);
                  s->at += n;
                  return n;
                },
                &source);
          }};
}

// Truncates seq 7 (watched in layers 0 and 1) to `length`.
Scenario truncate_call(std::string name, Setup setup, uint64_t length) {
  return {std::move(name), std::move(setup), 0,
          [=](qjlkv_cache *c, uint8_t *) { return qjlkv_cache_truncate(c, 7, length); }};
}

// Forks seq 7 into the watched, empty seq 12345.
Scenario fork_call(std::string name, Setup setup, uint64_t length) {
  return {std::move(name), std::move(setup), 0,
          [=](qjlkv_cache *c, uint8_t *) { return qjlkv_cache_fork(c, 7, 12345, length); }};
}

// setup, then seq 7 forked into seq 3, which appends on its own; seq 7 then shares pages it no
// longer writes.
Setup forked(Setup setup, const qjlkv_config &cfg, uint64_t length) {
  return [setup, cfg, length](qjlkv_cache *c) {
    setup(c);
    expect_setup_ok(qjlkv_cache_fork(c, 7, 3, length), "setup fork");
    expect_setup_ok(append_tokens(c, cfg, 0, 3, cfg.block_tokens + 1, 99), "setup append to the fork");
  };
}

std::vector<Scenario> scenarios(const qjlkv_config &cfg) {
  const uint32_t B = cfg.block_tokens, R = cfg.residual_tokens;
  const Setup two_layers = fill(cfg, {{{0, 7}, R + 3 * B + 2}, {{1, 7}, R + B - 1}});
  std::vector<Scenario> all = {
      export_call("export of blocks and tails", two_layers, cfg),
      import_call("import of blocks and tails", cfg, two_layers, false),
      import_call("import_stream of blocks and tails", cfg, two_layers, true),
      append_call("prefill of a new sequence, two blocks", nullptr, cfg, 0, 7, R + 2 * B + 3),
      append_call("prefill onto a tail", fill(cfg, {{{0, 7}, 3}}), cfg, 0, 7, R + 2 * B),
      append_call("prefill of a second layer", fill(cfg, {{{0, 7}, R + B}}), cfg, 1, 7, R + B + 1),
      append_call("decode append, no block", fill(cfg, {{{0, 7}, 2}}), cfg, 0, 7, 1),
      append_call("decode append that quantizes the first block", fill(cfg, {{{0, 7}, R + B - 1}}), cfg, 0, 7, 1),
      append_call("decode append that quantizes a later block", fill(cfg, {{{0, 7}, R + 3 * B - 1}}), cfg, 0, 7, 1),
      append_batch_call("append_batch: new, flushing and tail sequences",
                        fill(cfg, {{{0, 1}, R + B - 1}, {{0, 2}, 2}}), cfg, 0, {3, 1, 2}),
      attend_call("attend, one query", fill(cfg, {{{0, 7}, R + 2 * B + 3}}), cfg, 0, 7, 1),
      attend_call("attend, causal queries", fill(cfg, {{{0, 7}, R + 2 * B + 3}}), cfg, 0, 7, 4),
      attend_batch_call("attend_batch", fill(cfg, {{{0, 1}, R + B + 2}, {{0, 2}, 3}}), cfg, 0, {1, 2, 1}),
      scores_call("scores", fill(cfg, {{{1, 9}, R + 2 * B + 1}}), cfg, 1, 9, R + 2 * B + 1),
      reconstruct_call("reconstruct", fill(cfg, {{{0, 7}, R + 2 * B + 3}}), cfg, 0, 7, 1, R + 2 * B + 1),
      truncate_call("truncate that reopens a block from its rollback copy", two_layers, R + 3 * B - 3),
      truncate_call("truncate below the rollback floor", two_layers, 5),
      fork_call("fork of a whole sequence", two_layers, R + 3 * B + 2),
      fork_call("fork of a prefix, reopening a block", two_layers, R + B + 4),
      fork_call("fork of a forked sequence's prefix", forked(two_layers, cfg, R + 3 * B + 2), B / 2),
  };
  return all;
}

// Calls that must never fail for lack of memory (the header lists no OUT_OF_MEMORY for them, or,
// for truncate, not in these cases):
// run them with each of their first allocations failing, so that an allocation added later is
// caught.
void walk_non_allocating(const qjlkv_config &cfg) {
  const Setup setup = fill(cfg, {{{0, 1}, cfg.residual_tokens + 2 * cfg.block_tokens}, {{0, 2}, 4}});
  const std::vector<Scenario> calls = {
      {"clear_sequence", setup, 0, [](qjlkv_cache *c, uint8_t *) { return qjlkv_cache_clear_sequence(c, 1); }},
      {"clear_sequence of an unknown id", setup, 0,
       [](qjlkv_cache *c, uint8_t *) { return qjlkv_cache_clear_sequence(c, 4242); }},
      {"stats", setup, sizeof(qjlkv_stats),
       [](qjlkv_cache *c, uint8_t *out) {
         qjlkv_stats st;
         std::memset(&st, 0, sizeof st);
         st.struct_size = sizeof st;
         const qjlkv_status s = qjlkv_cache_stats(c, &st);
         std::memcpy(out, &st, sizeof st);
         return s;
       }},
      {"bytes_needed", setup, sizeof(uint64_t),
       [](qjlkv_cache *c, uint8_t *out) {
         return qjlkv_cache_bytes_needed(c, 1, 300, reinterpret_cast<uint64_t *>(out));
       }},
      {"sequence_bytes", setup, 2 * sizeof(uint64_t),
       [](qjlkv_cache *c, uint8_t *out) {
         return qjlkv_cache_sequence_bytes(c, 1, reinterpret_cast<uint64_t *>(out),
                                           reinterpret_cast<uint64_t *>(out) + 1);
       }},
      {"truncate to the length", setup, 0, [](qjlkv_cache *c, uint8_t *) { return qjlkv_cache_truncate(c, 2, 4); }},
      {"truncate to 0", setup, 0, [](qjlkv_cache *c, uint8_t *) { return qjlkv_cache_truncate(c, 1, 0); }},
      {"length", setup, sizeof(uint64_t),
       [](qjlkv_cache *c, uint8_t *out) { return qjlkv_cache_length(c, 0, 1, reinterpret_cast<uint64_t *>(out)); }},
      {"config", setup, sizeof(qjlkv_config),
       [](qjlkv_cache *c, uint8_t *out) {
         auto *cfg = reinterpret_cast<qjlkv_config *>(out);
         cfg->struct_size = sizeof(qjlkv_config);
         return qjlkv_cache_config(c, cfg);
       }},
  };
  for (const Scenario &call : calls) {
    SCOPED_TRACE(call.name);
    std::vector<uint8_t> expected_output(call.output_bytes);
    Snapshot expected_state;
    {
      Cache cache = fresh_cache(cfg, setup);
      QT_ASSERT_OK(call.call(cache.get(), expected_output.data()));
      expected_state = snapshot(cache.get(), kStreams);
    }
    for (uint64_t n = 1; n <= 4; ++n) {
      Cache cache = fresh_cache(cfg, setup);
      std::vector<uint8_t> output(call.output_bytes);
      fail_nth_allocation(n);
      const qjlkv_status s = call.call(cache.get(), output.data());
      const bool injected = disarm_allocation_failure();
      EXPECT_FALSE(injected) << call.name << " allocated";
      ASSERT_EQ(s, QJLKV_OK) << describe(s);
      EXPECT_EQ(output, expected_output);
      EXPECT_TRUE(snapshot(cache.get(), kStreams) == expected_state);
    }
  }
}

// ---- the tests -------------------------------------------------------------------------------
struct Variant {
  const char *preset;
  uint32_t threads;
  friend void PrintTo(const Variant &v, std::ostream *os) { *os << v.preset << ", " << v.threads << " thread(s)"; }
};

class AllocationFailure : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override { cfg_ = small_config(GetParam().preset, QJLKV_DTYPE_F32, GetParam().threads); }
  qjlkv_config cfg_;
};

TEST_P(AllocationFailure, CacheCreate) {
  for (uint64_t n = 1;; ++n) {
    ASSERT_LT(n, kMaxAllocationsPerCall);
    const AllocationCounts baseline = allocation_counts();
    qjlkv_cache *c = reinterpret_cast<qjlkv_cache *>(&cfg_);  // must be overwritten
    fail_nth_allocation(n);
    const qjlkv_status s = qjlkv_cache_create(&cfg_, &c);
    const bool injected = disarm_allocation_failure();
    if (s == QJLKV_OK) {
      // A cache created despite a failed allocation must still be complete.
      EXPECT_TRUE(snapshot(c, kStreams) == snapshot(fresh_cache(cfg_, nullptr).get(), kStreams));
      qjlkv_cache_destroy(c);
      ASSERT_EQ(allocation_counts(), baseline) << "create then destroy leaked";
      if (!injected) {
        EXPECT_GT(n, 1u);
        return;
      }
      continue;
    }
    ASSERT_TRUE(injected) << describe(s);
    ASSERT_EQ(s, QJLKV_ERROR_OUT_OF_MEMORY) << "allocation " << n << ": " << describe(s);
    EXPECT_EQ(c, nullptr) << "*out must be NULL after a failed create";
    const AllocationCounts after = allocation_counts();
    ASSERT_EQ(after.live_allocations, baseline.live_allocations) << "allocation " << n << ": leaked blocks";
    ASSERT_EQ(after.live_bytes, baseline.live_bytes) << "allocation " << n << ": leaked bytes";
  }
}

TEST_P(AllocationFailure, EveryAllocatingCall) {
  for (const Scenario &s : scenarios(cfg_)) {
    walk(cfg_, s);
    if (HasFatalFailure()) return;
  }
}

TEST_P(AllocationFailure, ClearStatsLengthConfigNeverAllocate) { walk_non_allocating(cfg_); }

// The decode path allocates nothing once a cache has made a call of the same shape: its task
// list, per-head buffers and sequence list are kept, and the worker pool takes the tasks by
// reference.
TEST_P(AllocationFailure, AttendAllocatesNothingOnceWarm) {
  const uint32_t B = cfg_.block_tokens, R = cfg_.residual_tokens;
  Cache cache = fresh_cache(cfg_, fill(cfg_, {{{0, 7}, R + 3 * B + 5}, {{0, 8}, R + B + 1}}));
  ASSERT_TRUE(cache);
  const std::vector<uint8_t> q = queries(cfg_, 2, 41);
  std::vector<uint8_t> out(q.size());
  const uint32_t seqs[2] = {7, 8};
  const auto step = [&] {
    ASSERT_EQ(qjlkv_cache_attend(cache.get(), 0, 7, 2, q.data(), 0.0f, out.data()), QJLKV_OK);
    ASSERT_EQ(qjlkv_cache_attend_batch(cache.get(), 0, 2, seqs, q.data(), 0.0f, out.data()), QJLKV_OK);
  };
  step();
  const uint64_t before = allocations_made();
  step();
  step();
  EXPECT_EQ(allocations_made(), before) << "allocations in warm attend calls";
}

TEST_P(AllocationFailure, SketchCreate) {
  for (uint64_t n = 1;; ++n) {
    ASSERT_LT(n, kMaxAllocationsPerCall);
    const AllocationCounts baseline = allocation_counts();
    qjlkv_sketch *s = reinterpret_cast<qjlkv_sketch *>(&cfg_);
    fail_nth_allocation(n);
    const qjlkv_status status = qjlkv_sketch_create(16, 40, 3, QJLKV_SKETCH_ORTHOGONAL, &s);
    const bool injected = disarm_allocation_failure();
    if (status == QJLKV_OK) {
      qjlkv_sketch_destroy(s);
      ASSERT_EQ(allocation_counts(), baseline);
      if (!injected) return;
      continue;
    }
    ASSERT_TRUE(injected) << describe(status);
    ASSERT_EQ(status, QJLKV_ERROR_OUT_OF_MEMORY) << describe(status);
    EXPECT_EQ(s, nullptr);
    ASSERT_EQ(allocation_counts(), baseline) << "allocation " << n << ": leaked";
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, AllocationFailure,
                         ::testing::Values(Variant{"qjl", 1}, Variant{"kivi", 1}, Variant{"ott", 1},
                                           Variant{"exact", 1}, Variant{"qjl", 2}, Variant{"ott", 2},
                                           Variant{"q3", 1}, Variant{"q4", 2}, Variant{"q2", 1}),
                         [](const ::testing::TestParamInfo<Variant> &info) {
                           return std::string(info.param.preset) + "_threads" + std::to_string(info.param.threads);
                         });

// The counting allocator itself: a test of the test tool, so that a silent allocator (one that
// never fails or never counts) cannot make the walks above pass vacuously.
TEST(CountingAllocator, CountsAndFailsTheNthAllocation) {
  const AllocationCounts before = allocation_counts();
  auto *a = new int(1);
  EXPECT_EQ(allocation_counts().live_allocations, before.live_allocations + 1);
  fail_nth_allocation(2);
  auto *b = new int(2);  // the 1st: succeeds
  EXPECT_THROW((void)new int(3), std::bad_alloc);
  EXPECT_TRUE(disarm_allocation_failure());
  fail_nth_allocation(1);
  EXPECT_EQ(new (std::nothrow) double[4], nullptr);
  EXPECT_TRUE(disarm_allocation_failure());
  struct alignas(64) Wide {
    char bytes[64];
  };
  auto *w = new Wide;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w) % 64, 0u);
  delete w;
  delete a;
  delete b;
  EXPECT_EQ(allocation_counts(), before);
  EXPECT_FALSE(disarm_allocation_failure());
}

}  // namespace
}  // namespace qjlkv_test
