// A small persistent worker pool, owned by one cache or shared by several through a
// qjlkv_workers handle (no global state). The calling thread works too, so a pool of size 1
// runs everything inline.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace qjlkv {

class ThreadPool {
 public:
  // threads = total workers including the caller; 0 = the cores available. `argument` names
  // where the count came from, for the error when the threads cannot be started.
  ThreadPool(unsigned threads, const char *argument);
  ~ThreadPool();
  ThreadPool(const ThreadPool &) = delete;
  ThreadPool &operator=(const ThreadPool &) = delete;

  unsigned size() const { return unsigned(workers_.size()) + 1; }

  using Task = std::function<void(size_t index, unsigned worker)>;
  // A non-owning reference to any callable task(index, worker) (a lambda, a Task): passing a
  // lambda straight to parallel_for allocates nothing, where building a std::function may.
  class TaskRef {
   public:
    template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, TaskRef>>>
    TaskRef(const F &task)  // implicit: parallel_for(n, [&](size_t, unsigned) {...})
        : object_(&task), call_([](const void *object, size_t index, unsigned worker) {
            (*static_cast<const F *>(object))(index, worker);
          }) {}
    void operator()(size_t index, unsigned worker) const { call_(object_, index, worker); }

   private:
    const void *object_;
    void (*call_)(const void *, size_t, unsigned);
  };

  // Calls task(i, worker) once for every i in [0, n), spread over the pool; returns when all
  // are done (the task it refers to must live until then). worker in [0, size()) names the
  // thread (0 = the caller), for per-thread scratch. task must not throw. Each index is handled
  // by exactly one thread, so results do not depend on the number of threads.
  // Several threads may call it at once (caches sharing the pool): the workers serve one call
  // at a time, and a call that finds them busy runs on its calling thread alone (worker 0).
  // Once its own share is done the caller waits for the workers' last tasks awake, for up to
  // 200 µs, before it sleeps. Idle workers sleep, except after a call with another_follows
  // (the caller's next step is another parallel_for, e.g. the next phase of one decode step):
  // then they wait for it awake, for up to 200 µs, since a wake-up from sleep costs tens of
  // microseconds on a virtual machine.
  void parallel_for(size_t n, TaskRef task, bool another_follows = false);

 private:
  void worker_loop();
  void stop() noexcept;
  void run_tasks(unsigned worker);

  std::vector<std::thread> workers_;
  std::mutex serving_;  // held by the parallel_for call the workers serve
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const TaskRef *task_ = nullptr;
  size_t task_count_ = 0;
  std::atomic<size_t> next_{0};
  std::atomic<unsigned> busy_{0};  // changed under mutex_; read without it while the caller waits
  unsigned next_worker_id_ = 1;
  // Changed under mutex_; read without it by workers waiting awake for the next call.
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stopping_{false};
  bool another_follows_ = false;  // of the call being served
};

}  // namespace qjlkv

// The C API's shared worker threads (qjlkv_workers_create): each cache that uses them, and the
// handle itself, holds a reference, so the threads stop when the last of them is gone.
struct qjlkv_workers {
  std::shared_ptr<qjlkv::ThreadPool> pool;
};
