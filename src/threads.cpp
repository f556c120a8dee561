#include "threads.hpp"

#include <algorithm>
#include <chrono>
#include <system_error>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "error.hpp"

namespace qjlkv {
namespace {

void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// How long the caller of parallel_for waits for the workers' last tasks before sleeping, and
// the workers for the next call after one with another_follows.
constexpr auto kSpinWait = std::chrono::microseconds(200);

// Polls done() with pause instructions until it is true or kSpinWait has passed.
template <class Done>
void poll(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + kSpinWait;
  for (unsigned i = 1; !done(); ++i) {
    spin_pause();
    if (i % 64 == 0 && std::chrono::steady_clock::now() > deadline) return;
  }
}

}  // namespace

ThreadPool::ThreadPool(unsigned threads, const char *argument) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  try {
    workers_.reserve(threads - 1);
    for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  } catch (const std::system_error &e) {
    // The system is out of threads (or memory for their stacks): a resource the caller can
    // free, like memory, not a bug of the library.
    stop();
    fail(QJLKV_ERROR_OUT_OF_MEMORY, "starting worker thread %zu of %u failed (%s); lower %s",
         workers_.size() + 1, threads, e.what(), argument);
  } catch (...) {
    stop();
    throw;
  }
}

ThreadPool::~ThreadPool() { stop(); }

void ThreadPool::stop() noexcept {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto &w : workers_)
    if (w.joinable()) w.join();
}

void ThreadPool::run_tasks(unsigned worker) {
  for (size_t i = next_.fetch_add(1); i < task_count_; i = next_.fetch_add(1)) (*task_)(i, worker);
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  std::unique_lock lock(mutex_);
  const unsigned worker = next_worker_id_++;
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
    if (stopping_) return;
    seen = generation_;
    const bool another_follows = another_follows_;
    ++busy_;
    lock.unlock();
    run_tasks(worker);
    lock.lock();
    if (--busy_ == 0) done_.notify_all();
    if (another_follows) {
      lock.unlock();
      poll([&] { return stopping_.load() || generation_.load() != seen; });
      lock.lock();
    }
  }
}

void ThreadPool::parallel_for(size_t n, TaskRef task, bool another_follows) {
  std::unique_lock serving(serving_, std::defer_lock);
  if (workers_.empty() || n <= 1 || !serving.try_lock()) {
    for (size_t i = 0; i < n; ++i) task(i, 0);
    return;
  }
  {
    std::unique_lock lock(mutex_);
    // A worker that woke late for the previous round may still be leaving run_tasks().
    done_.wait(lock, [&] { return busy_ == 0; });
    task_ = &task;
    task_count_ = n;
    next_.store(0);
    another_follows_ = another_follows;
    ++generation_;
  }
  wake_.notify_all();
  run_tasks(0);
  // The workers are finishing their last tasks: wait for them awake for a while before sleeping,
  // since a wake-up from sleep costs tens of microseconds on a virtual machine (a decode step at
  // 1k tokens is about a hundred).
  const auto finished = [&] { return busy_.load(std::memory_order_acquire) == 0 && next_.load() >= task_count_; };
  poll(finished);
  std::unique_lock lock(mutex_);
  done_.wait(lock, finished);
}

}  // namespace qjlkv
