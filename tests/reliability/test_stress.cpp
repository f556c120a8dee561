// Stress: several threads, each with its own caches (every preset; some with two internal
// worker threads), all reading one shared sketch, run thousands of append / attend / scores /
// clear cycles. Checked:
//   - the shared sketch reads back identical in every thread and cycle (it is immutable);
//   - outputs are finite, lengths are as appended, and each thread's error message is its own;
//   - after every cycle's clear, a cache reports 0 tokens, 0 bytes used and 0 bytes reserved;
//   - at the checkpoints where every thread has cleared everything, the process holds exactly
//     as many allocations and bytes as at the first checkpoint (no growth: nothing leaks or
//     accumulates), and after destroying everything exactly as many as before the test.
// tools/sanitize.sh runs it under ThreadSanitizer. QJLKV_STRESS_CYCLES overrides the cycles.
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "counting_allocator.hpp"
#include "reliability.hpp"

namespace qjlkv_test {
namespace {

constexpr uint32_t kThreads = 4;
constexpr uint32_t kCheckpoints = 5;
constexpr uint32_t kSketchRows = 48, kSketchCols = 16;

uint32_t cycles_per_thread() {
  const char *env = std::getenv("QJLKV_STRESS_CYCLES");
  const long n = env ? std::strtol(env, nullptr, 10) : 0;
  return n >= int(kCheckpoints) ? uint32_t(n) : 1500;
}

struct ThreadResult {
  std::string failure;  // the first problem seen, or empty
  uint64_t cycles = 0;
};

// Everything a worker touches, allocated before the first checkpoint so that the checkpoints
// see only what the library holds.
struct OwnCache {
  qjlkv_config cfg;
  Cache cache;
  std::vector<uint8_t> keys, values, query, out;  // in the cache's dtype
  std::vector<float> scores;
};

struct Worker {
  uint32_t index;
  std::vector<OwnCache> caches;
  std::vector<float> sketch_copy;
  std::string message_expected;
  ThreadResult result;

  void fail(const std::string &what) {
    if (result.failure.empty()) result.failure = what;
  }
};

const char *const kPresets[] = {"qjl", "kivi", "ott", "exact"};

void run_cycle(Worker &w, const qjlkv_sketch *sketch, const std::vector<float> &reference, std::mt19937 &rng) {
  // The shared sketch: read concurrently by every thread.
  if (qjlkv_sketch_matrix(sketch, w.sketch_copy.data(), w.sketch_copy.size()) != QJLKV_OK ||
      std::memcmp(w.sketch_copy.data(), reference.data(), reference.size() * sizeof(float)) != 0)
    w.fail("the shared sketch read back differently");
  for (OwnCache &own : w.caches) {
    qjlkv_cache *c = own.cache.get();
    const qjlkv_config &cfg = own.cfg;
    const size_t token_elems = size_t(cfg.num_kv_heads) * cfg.head_dim, io = dtype_bytes(qt::dtype_of(cfg));
    const uint32_t max_prefill = cfg.residual_tokens + 2 * cfg.block_tokens + 5;
    uint64_t expected_tokens = 0;
    for (uint32_t seq = 0; seq < 3; ++seq) {
      const uint32_t n = 1 + rng() % max_prefill;
      if (qjlkv_cache_append(c, 0, seq, n, own.keys.data() + (rng() % 7) * token_elems * io, own.values.data()) !=
          QJLKV_OK)
        w.fail(std::string("prefill: ") + qjlkv_last_error_message());
      expected_tokens += n;
    }
    const uint32_t seqs[3] = {0, 1, 2};
    for (uint32_t step = 0; step < 3; ++step) {
      if (qjlkv_cache_append_batch(c, 0, 3, seqs, own.keys.data() + step * token_elems * io, own.values.data()) !=
          QJLKV_OK)
        w.fail(std::string("append_batch: ") + qjlkv_last_error_message());
      expected_tokens += 3;
      if (qjlkv_cache_attend_batch(c, 0, 3, seqs, own.query.data(), 0.0f, own.out.data()) != QJLKV_OK)
        w.fail(std::string("attend_batch: ") + qjlkv_last_error_message());
      if (cfg.dtype == QJLKV_DTYPE_F32)
        for (size_t j = 0; j < own.out.size() / 4; ++j) {
          float x;
          std::memcpy(&x, &own.out[4 * j], 4);
          if (!std::isfinite(x)) w.fail("attend output not finite");
        }
    }
    uint64_t length = 0;
    if (qjlkv_cache_length(c, 0, 1, &length) != QJLKV_OK ||
        qjlkv_cache_scores(c, 0, 1, own.query.data(), own.scores.data(), own.scores.size()) != QJLKV_OK)
      w.fail(std::string("scores: ") + qjlkv_last_error_message());
    if (qjlkv_cache_attend(c, 0, 2, 2, own.query.data(), 0.5f, own.out.data()) != QJLKV_OK)
      w.fail(std::string("attend: ") + qjlkv_last_error_message());
    // A failure whose message must stay this thread's own while the others fail too.
    if (qjlkv_cache_attend(c, 0, 1000 + w.index, 1, own.query.data(), 0.0f, own.out.data()) == QJLKV_OK ||
        std::string(qjlkv_last_error_message()).find(w.message_expected) == std::string::npos)
      w.fail(std::string("the error message is not this thread's: ") + qjlkv_last_error_message());
    qjlkv_stats st;
    std::memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    if (qjlkv_cache_stats(c, &st) != QJLKV_OK || st.tokens != expected_tokens || st.bytes_used > st.bytes_reserved)
      w.fail("stats before clear");
    for (uint32_t seq = 0; seq < 3; ++seq) (void)qjlkv_cache_clear_sequence(c, seq);
    if (qjlkv_cache_stats(c, &st) != QJLKV_OK || st.tokens != 0 || st.bytes_used != 0 || st.bytes_reserved != 0)
      w.fail("after clearing every sequence: tokens " + std::to_string(st.tokens) + ", bytes_used " +
             std::to_string(st.bytes_used) + ", bytes_reserved " + std::to_string(st.bytes_reserved));
  }
  ++w.result.cycles;
}

TEST(Stress, ThreadsWithOwnCachesAndASharedSketch) {
  const uint32_t cycles = cycles_per_thread();
  const AllocationCounts baseline = allocation_counts();
  {
    qjlkv_sketch *sketch = nullptr;
    ASSERT_EQ(qjlkv_sketch_create(kSketchCols, kSketchRows, 99, QJLKV_SKETCH_ORTHOGONAL, &sketch), QJLKV_OK);
    std::vector<float> reference(size_t(kSketchRows) * kSketchCols);
    ASSERT_EQ(qjlkv_sketch_matrix(sketch, reference.data(), reference.size()), QJLKV_OK);

    std::vector<Worker> workers(kThreads);
    for (uint32_t t = 0; t < kThreads; ++t) {
      Worker &w = workers[t];
      w.index = t;
      w.message_expected = "seq " + std::to_string(1000 + t) + " ";
      for (uint32_t p = 0; p < 4; ++p) {
        // Every preset in every thread; the preset of the thread's index gets two workers.
        OwnCache &own = w.caches.emplace_back();
        own.cfg = small_config(kPresets[p], p == 3 ? QJLKV_DTYPE_BF16 : QJLKV_DTYPE_F32, p == t % 4 ? 2 : 1);
        own.cfg.seed = 99;
        qjlkv_cache *c = nullptr;
        QT_ASSERT_OK(qjlkv_cache_create(&own.cfg, &c));
        own.cache.reset(c);
        const uint32_t max_tokens = own.cfg.residual_tokens + 2 * own.cfg.block_tokens + 12;
        own.keys = tokens(own.cfg, max_tokens, 10 + t);
        own.values = tokens(own.cfg, max_tokens, 20 + t);
        own.query = queries(own.cfg, 3, 30 + t);
        own.out.resize(own.query.size());
        own.scores.resize(size_t(own.cfg.num_q_heads) * max_tokens);
      }
      w.sketch_copy.resize(reference.size());
      w.result.failure.reserve(256);
    }
    std::vector<AllocationCounts> at_checkpoint(kCheckpoints);
    std::atomic<uint32_t> checkpoint{0};
    std::barrier sync(kThreads, [&]() noexcept { at_checkpoint[checkpoint++] = allocation_counts(); });
    std::vector<std::thread> threads;
    for (uint32_t t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] {
        Worker &w = workers[t];
        std::mt19937 rng(t);
        for (uint32_t k = 0; k < kCheckpoints; ++k) {
          for (uint32_t i = 0; i < cycles / kCheckpoints; ++i) run_cycle(w, sketch, reference, rng);
          sync.arrive_and_wait();
        }
      });
    for (auto &th : threads) th.join();
    for (const Worker &w : workers) {
      EXPECT_EQ(w.result.failure, "") << "thread " << w.index;
      EXPECT_EQ(w.result.cycles, cycles / kCheckpoints * kCheckpoints);
    }
    for (uint32_t k = 1; k < kCheckpoints; ++k)
      EXPECT_EQ(at_checkpoint[k], at_checkpoint[0])
          << "checkpoint " << k << ": live allocations " << at_checkpoint[k].live_allocations << " (bytes "
          << at_checkpoint[k].live_bytes << "), first checkpoint " << at_checkpoint[0].live_allocations << " (bytes "
          << at_checkpoint[0].live_bytes << ")";
    workers.clear();
    qjlkv_sketch_destroy(sketch);
  }
  EXPECT_EQ(allocation_counts(), baseline) << "memory did not return to its level before the test";
}

}  // namespace
}  // namespace qjlkv_test
