// Worker threads shared by several caches (qjlkv_workers_create, qjlkv_cache_set_workers): the
// same stored bytes and outputs as a cache's own threads, from one thread or several at once;
// and the pool behind them (src/threads.hpp).
#include <atomic>
#include <filesystem>
#include <thread>

#include "testing.hpp"
#include "threads.hpp"

namespace {

struct WorkersDeleter {
  void operator()(qjlkv_workers *w) const noexcept { qjlkv_workers_destroy(w); }
};
using Workers = std::unique_ptr<qjlkv_workers, WorkersDeleter>;

Workers make_workers(uint32_t threads) {
  qjlkv_workers *w = nullptr;
  EXPECT_EQ(qjlkv_workers_create(threads, &w), QJLKV_OK) << qjlkv_last_error_message();
  return Workers(w);
}

constexpr uint32_t kLayers = 2, kQHeads = 8, kKvHeads = 4, kDim = 64, kTokens = 700, kSeq = 3;

qjlkv_config config_with_threads(uint32_t threads) {
  qjlkv_config cfg = qt::make_config("q3", kLayers, kQHeads, kKvHeads, kDim);
  cfg.num_threads = threads;
  return cfg;
}

// What a cache holds and computes after a fixed workload: its export stream and the outputs of
// attention over every layer (each token appended, then one query).
struct Result {
  std::vector<uint8_t> stream;
  std::vector<float> outputs;
  bool operator==(const Result &) const = default;
};

Result run_workload(qjlkv_cache *cache, uint64_t seed) {
  qt::Rng rng(seed);
  const std::vector<float> k = rng.normals(size_t(kTokens) * kKvHeads * kDim);
  const std::vector<float> v = rng.normals(k.size()), q = rng.normals(size_t(kQHeads) * kDim);
  Result r;
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_EQ(qjlkv_cache_append(cache, layer, kSeq, kTokens, k.data(), v.data()), QJLKV_OK)
        << qjlkv_last_error_message();
    std::vector<float> out(q.size());
    EXPECT_EQ(qjlkv_cache_attend(cache, layer, kSeq, 1, q.data(), 0.0f, out.data()), QJLKV_OK)
        << qjlkv_last_error_message();
    r.outputs.insert(r.outputs.end(), out.begin(), out.end());
  }
  uint64_t size = 0;
  EXPECT_EQ(qjlkv_cache_export_size(cache, kSeq, 0, kLayers, &size), QJLKV_OK);
  r.stream.resize(size);
  EXPECT_EQ(qjlkv_cache_export(cache, kSeq, 0, kLayers, r.stream.data(), size), QJLKV_OK);
  return r;
}

TEST(Workers, SharedWorkersStoreAndComputeWhatOwnThreadsDo) {
  qt::Cache own = qt::make_cache(config_with_threads(2));
  ASSERT_TRUE(own);
  const Result expected = run_workload(own.get(), 11);
  ASSERT_FALSE(expected.stream.empty());

  Workers workers = make_workers(3);
  ASSERT_TRUE(workers);
  qt::Cache a = qt::make_cache(config_with_threads(1)), b = qt::make_cache(config_with_threads(1));
  ASSERT_TRUE(a && b);
  QT_ASSERT_OK(qjlkv_cache_set_workers(a.get(), workers.get()));
  QT_ASSERT_OK(qjlkv_cache_set_workers(b.get(), workers.get()));
  EXPECT_TRUE(run_workload(a.get(), 11) == expected);
  workers.reset();  // the caches keep the threads alive
  EXPECT_TRUE(run_workload(b.get(), 11) == expected) << "after qjlkv_workers_destroy";
  QT_ASSERT_OK(qjlkv_cache_set_workers(b.get(), nullptr));  // back to its own (single) thread
  qjlkv_cache_clear_sequence(b.get(), kSeq);
  EXPECT_TRUE(run_workload(b.get(), 11) == expected) << "back on the cache's own threads";
}

// Several threads, each with its own cache, all on one set of workers at once: every call either
// gets the workers or runs alone on its thread, with the same results (ThreadSanitizer runs this).
TEST(Workers, CachesSharingWorkersRunConcurrently) {
  constexpr int kThreads = 3;
  std::vector<Result> expected;
  for (int i = 0; i < kThreads; ++i) {
    qt::Cache alone = qt::make_cache(config_with_threads(1));
    ASSERT_TRUE(alone);
    expected.push_back(run_workload(alone.get(), 100 + i));
  }
  Workers workers = make_workers(2);
  ASSERT_TRUE(workers);
  std::vector<Result> got(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] {
      qt::Cache cache = qt::make_cache(config_with_threads(1));
      ASSERT_TRUE(cache);
      ASSERT_EQ(qjlkv_cache_set_workers(cache.get(), workers.get()), QJLKV_OK);
      for (int round = 0; round < 3; ++round) {
        qjlkv_cache_clear_sequence(cache.get(), kSeq);
        got[i] = run_workload(cache.get(), 100 + i);
      }
    });
  for (std::thread &t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_TRUE(got[i] == expected[i]) << "thread " << i;
}

// Rounds of 0 to 6 tasks, every other one saying that another follows (the workers then wait
// for it awake), from two threads sharing the pool: every index of every round runs exactly
// once, on a worker number the pool has, and the pool stops while its workers wait awake.
TEST(Workers, PoolRunsEachIndexOnceWhetherWorkersSleepOrWaitAwake) {
  auto pool = std::make_unique<qjlkv::ThreadPool>(3, "test");
  const auto rounds = [&](int caller) {
    for (int round = 0; round < 300; ++round) {
      const size_t n = size_t(round + caller) % 7;
      std::vector<std::atomic<int>> runs(n);
      std::atomic<bool> worker_in_range{true};
      pool->parallel_for(
          n,
          [&](size_t index, unsigned worker) {
            runs[index].fetch_add(1);
            if (worker >= pool->size()) worker_in_range = false;
          },
          round % 2 == 0);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(runs[i].load(), 1) << "caller " << caller << " round " << round;
      ASSERT_TRUE(worker_in_range.load());
    }
  };
  std::thread other(rounds, 1);
  rounds(0);
  other.join();
  pool->parallel_for(
      4, [](size_t, unsigned) {}, true);
  pool.reset();  // right after a round that said another follows
}

// Threads of this process (Linux: /proc/self/task); -1 where that is not available.
int process_threads() {
  std::error_code error;
  int n = 0;
  for (std::filesystem::directory_iterator it("/proc/self/task", error), end; !error && it != end; it.increment(error))
    ++n;
  return error ? -1 : n;
}

// The threads start with qjlkv_workers_create and stop only when the handle and every cache
// using it are gone; a cache with num_threads = 1 starts none of its own.
TEST(Workers, ThreadsLiveAsLongAsTheirLastUser) {
  std::thread([] {}).join();  // a runtime that starts a helper thread with the first one (TSan) has done so
  const int before = process_threads();
  if (before < 0) GTEST_SKIP() << "/proc/self/task is not readable here: thread counts unavailable";
  Workers workers = make_workers(4);
  ASSERT_TRUE(workers);
  EXPECT_EQ(process_threads(), before + 3) << "4 threads: 3 workers and each call's own thread";
  qt::Cache cache = qt::make_cache(config_with_threads(1));
  ASSERT_TRUE(cache);
  EXPECT_EQ(process_threads(), before + 3) << "num_threads = 1 starts no thread";
  QT_ASSERT_OK(qjlkv_cache_set_workers(cache.get(), workers.get()));
  workers.reset();
  EXPECT_EQ(process_threads(), before + 3) << "the cache keeps the workers";
  run_workload(cache.get(), 5);
  QT_ASSERT_OK(qjlkv_cache_set_workers(cache.get(), nullptr));
  EXPECT_EQ(process_threads(), before) << "the last user let go: the threads have stopped";
}

TEST(Workers, BadArgumentsAreNamed) {
  qjlkv_workers *w = reinterpret_cast<qjlkv_workers *>(uintptr_t(0x10));
  QT_EXPECT_FAIL(qjlkv_workers_create(QJLKV_MAX_THREADS + 1, &w), QJLKV_ERROR_INVALID_ARGUMENT, "num_threads");
  EXPECT_EQ(w, nullptr) << "*out is set to NULL on failure";
  QT_EXPECT_FAIL(qjlkv_workers_create(1, nullptr), QJLKV_ERROR_INVALID_ARGUMENT, "out");
  Workers workers = make_workers(1);
  QT_EXPECT_FAIL(qjlkv_cache_set_workers(nullptr, workers.get()), QJLKV_ERROR_INVALID_ARGUMENT, "c");
  qjlkv_workers_destroy(nullptr);
}

}  // namespace
