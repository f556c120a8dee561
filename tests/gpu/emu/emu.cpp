// The CPU emulator behind cuda_runtime.h: fake runtime calls (device memory is host memory, work
// runs when it is enqueued) and a fiber scheduler that runs each CTA's threads.
//
// Threads of a CTA are ucontext fibers run one at a time until they block: at __syncthreads()
// (released when every thread of the CTA waits there) or at a warp operation (released when all
// 32 lanes of the warp wait at one). A barrier that can never be released — a __syncthreads() or
// a warp operation in divergent code — is reported as an emulation error instead of hanging, and
// so are shared memory writes past the dynamic allocation (canaries), launches above the shared
// memory limit, frees of unknown pointers and memory pools destroyed with live allocations.
// Errors are printed once, make every later synchronization fail with cudaErrorLaunchFailure,
// and are available to tests through emu::first_error().
//
// QJLKV_EMU_ORDER=reverse runs the ready fibers in reverse order: a missing __syncthreads()
// between a write and another thread's read then changes the results, which the tests compare.
#undef _FORTIFY_SOURCE  // its longjmp check rejects the jumps between fiber stacks
#include <setjmp.h>
#include <ucontext.h>

// Sanitizers must be told about the stack switches (tools/sanitize.sh builds every test with them).
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#if __has_feature(thread_sanitizer)
#define EMU_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define EMU_TSAN 1
#endif
#if defined(EMU_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(EMU_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda_runtime.h"
#include "emu.hpp"

struct EmuStream {};
struct EmuEvent {};
struct EmuMemPool {
  size_t live = 0;
};

namespace emu {
namespace {

constexpr size_t kStackBytes = 256 << 10;
constexpr size_t kCanary = 64;
constexpr size_t kDefaultDynamicSmem = 48 << 10;

enum class Wait { none, block, warp, done };

// A fiber starts through its ucontext; afterwards _setjmp/_longjmp switch (no signal-mask syscalls).
struct Fiber {
  ucontext_t start;
  jmp_buf resume;
  bool started = false;
  dim3 tid;
  Wait wait = Wait::none;
  void *stack = nullptr;
  void *asan_fake_stack = nullptr;
  void *tsan_fiber = nullptr;
};

struct Cta {
  std::vector<Fiber> fibers;
  unsigned current = 0;
  jmp_buf scheduler;
  // The scheduler's stack, for the sanitizers' fiber annotations.
  const void *scheduler_stack = nullptr;
  size_t scheduler_stack_size = 0;
  void *scheduler_fake_stack = nullptr;
  void *scheduler_tsan_fiber = nullptr;
  void (*body)(void *) = nullptr;
  void *body_context = nullptr;
  std::vector<uint64_t> slots[2];  // [warp * 32 + lane], double-buffered by warp generation
  std::vector<unsigned> warp_generation;
};

Cta *g_cta = nullptr;
dim3 g_block_index{0, 0, 0}, g_block_dim, g_grid_dim;
const dim3 kZero{0, 0, 0};
std::string g_first_error;
cudaError_t g_last_error = cudaSuccess;
std::vector<std::unique_ptr<uint8_t[]>> g_stacks;
std::vector<uint8_t> g_smem;
size_t g_smem_bytes = 0;
std::map<const void *, int> g_max_dynamic_smem;
struct Allocation {
  size_t bytes;
  EmuMemPool *pool;  // null: cudaMalloc
};
std::map<void *, Allocation> g_allocations;

void report(const std::string &what) {
  if (g_first_error.empty()) {
    g_first_error = what;
    std::fprintf(stderr, "[cuda emulator] %s\n", what.c_str());
  }
}

// A small GPU by default (2 SMs), so that attention CTAs walk several units and tiles; set
// QJLKV_EMU_SMS=132 to emulate an H200's split granularity.
int sm_count() {
  const char *env = std::getenv("QJLKV_EMU_SMS");
  return env ? std::atoi(env) : 2;
}

size_t smem_optin() {
  const char *env = std::getenv("QJLKV_EMU_SMEM_OPTIN");
  return env ? size_t(std::strtoull(env, nullptr, 10)) : size_t(232448);
}

Fiber &self() { return g_cta->fibers[g_cta->current]; }

bool reverse_order() {
  const char *env = std::getenv("QJLKV_EMU_ORDER");
  return env && std::string(env) == "reverse";
}

// Called on a fiber's stack right after switching to it.
void arrived_on_fiber(Fiber &f) {
#if defined(EMU_ASAN)
  __sanitizer_finish_switch_fiber(f.asan_fake_stack, &g_cta->scheduler_stack, &g_cta->scheduler_stack_size);
#endif
  (void)f;
}

void yield(Wait wait) {
  Fiber &f = self();
  f.wait = wait;
  if (_setjmp(f.resume) == 0) {
#if defined(EMU_ASAN)
    // A finished fiber is never resumed: its fake stack can go.
    __sanitizer_start_switch_fiber(wait == Wait::done ? nullptr : &f.asan_fake_stack, g_cta->scheduler_stack,
                                   g_cta->scheduler_stack_size);
#endif
#if defined(EMU_TSAN)
    __tsan_switch_to_fiber(g_cta->scheduler_tsan_fiber, 0);
#endif
    _longjmp(g_cta->scheduler, 1);
  }
  arrived_on_fiber(f);
}

void fiber_entry() {
  arrived_on_fiber(self());
  g_cta->body(g_cta->body_context);
  yield(Wait::done);  // never resumed
}

void resume(unsigned i) {
  Cta &cta = *g_cta;
  cta.current = i;
  Fiber &f = cta.fibers[i];
  if (_setjmp(cta.scheduler) != 0) {  // the fiber yielded
#if defined(EMU_ASAN)
    __sanitizer_finish_switch_fiber(cta.scheduler_fake_stack, nullptr, nullptr);
#endif
    return;
  }
#if defined(EMU_ASAN)
  __sanitizer_start_switch_fiber(&cta.scheduler_fake_stack, f.stack, kStackBytes);
#endif
#if defined(EMU_TSAN)
  __tsan_switch_to_fiber(f.tsan_fiber, 0);
#endif
  if (!f.started) {
    f.started = true;
    setcontext(&f.start);
  }
  _longjmp(f.resume, 1);
}

// Runs one CTA to completion; false (after reporting) when its threads cannot all finish.
bool run_cta(unsigned threads) {
  Cta &cta = *g_cta;
  for (unsigned i = 0; i < threads; ++i) {
    Fiber &f = cta.fibers[i];
    f.tid = dim3(i, 0, 0);
    f.wait = Wait::none;
    f.started = false;
    getcontext(&f.start);
    f.stack = g_stacks[i].get();
    f.start.uc_stack.ss_sp = f.stack;
    f.start.uc_stack.ss_size = kStackBytes;
    f.start.uc_link = nullptr;
    makecontext(&f.start, fiber_entry, 0);
  }
#if defined(EMU_TSAN)
  cta.scheduler_tsan_fiber = __tsan_get_current_fiber();
  for (unsigned i = 0; i < threads; ++i) cta.fibers[i].tsan_fiber = __tsan_create_fiber(0);
  struct DestroyFibers {
    Cta &cta;
    unsigned threads;
    ~DestroyFibers() {
      for (unsigned i = 0; i < threads; ++i) __tsan_destroy_fiber(cta.fibers[i].tsan_fiber);
    }
  } destroy_fibers{cta, threads};
#endif
  const unsigned warps = (threads + 31) / 32;
  const bool reverse = reverse_order();
  for (;;) {
    for (unsigned k = 0; k < threads; ++k) {
      const unsigned i = reverse ? threads - 1 - k : k;
      if (cta.fibers[i].wait == Wait::none) resume(i);
    }
    unsigned done = 0, at_block = 0;
    for (unsigned i = 0; i < threads; ++i) {
      done += cta.fibers[i].wait == Wait::done;
      at_block += cta.fibers[i].wait == Wait::block;
    }
    if (done == threads) return true;
    bool released = false;
    for (unsigned w = 0; w < warps; ++w) {
      const unsigned first = w * 32, lanes = std::min(32u, threads - first);
      unsigned at_warp = 0;
      for (unsigned l = 0; l < lanes; ++l) at_warp += cta.fibers[first + l].wait == Wait::warp;
      if (at_warp == 0) continue;
      if (at_warp != lanes) {
        report("a warp operation (shuffle/ballot) was not reached by every lane of warp " + std::to_string(w) +
               " of block (" + std::to_string(g_block_index.x) + "," + std::to_string(g_block_index.y) + ")");
        return false;
      }
      for (unsigned l = 0; l < lanes; ++l) cta.fibers[first + l].wait = Wait::none;
      ++cta.warp_generation[w];
      released = true;
    }
    if (released) continue;
    if (at_block + done == threads && done == 0) {
      for (unsigned i = 0; i < threads; ++i) cta.fibers[i].wait = Wait::none;
      continue;
    }
    report("__syncthreads() was not reached by every thread of block (" + std::to_string(g_block_index.x) + "," +
           std::to_string(g_block_index.y) + "): " + std::to_string(at_block) + " waiting, " + std::to_string(done) +
           " exited");
    return false;
  }
}

}  // namespace

const char *first_error() { return g_first_error.c_str(); }
void clear_error() {
  g_first_error.clear();
  g_last_error = cudaSuccess;
}
size_t live_allocations() { return g_allocations.size(); }
long g_allocations_left = -1;  // fail_allocations_after
void fail_allocations_after(long successes) { g_allocations_left = successes; }
// Whether an allocation may succeed (fail_allocations_after).
bool allocation_allowed() {
  if (g_allocations_left < 0) return true;
  if (g_allocations_left == 0) return false;
  --g_allocations_left;
  return true;
}

const dim3 &thread_index() { return g_cta ? self().tid : kZero; }
const dim3 &block_index() { return g_block_index; }
const dim3 &block_dim() { return g_block_dim; }
const dim3 &grid_dim() { return g_grid_dim; }
uint8_t *dynamic_smem() { return g_smem.data() + kCanary; }

void sync_block() { yield(Wait::block); }

uint64_t warp_exchange(uint64_t value, unsigned lane_xor) {
  const unsigned t = self().tid.x, warp = t / 32, lane = t % 32;
  const unsigned buffer = g_cta->warp_generation[warp] % 2;
  g_cta->slots[buffer][t] = value;
  yield(Wait::warp);
  const unsigned source = lane ^ lane_xor;
  if (warp * 32 + source >= g_block_dim.x) report("shuffle from a lane outside the block");
  return g_cta->slots[buffer][warp * 32 + source];
}

unsigned warp_ballot(bool predicate) {
  const unsigned t = self().tid.x, warp = t / 32;
  const unsigned buffer = g_cta->warp_generation[warp] % 2;
  g_cta->slots[buffer][t] = predicate;
  yield(Wait::warp);
  unsigned bits = 0;
  for (unsigned l = 0; l < 32 && warp * 32 + l < g_block_dim.x; ++l)
    if (g_cta->slots[buffer][warp * 32 + l]) bits |= 1u << l;
  return bits;
}

void run_grid(const void *kernel, dim3 grid, dim3 block, size_t smem, void (*body)(void *), void *context) {
  if (g_cta) {
    report("kernel launched from inside a kernel");
    return;
  }
  if (!g_first_error.empty()) return;  // the context is broken, as after a real kernel fault
  if (block.y != 1 || block.z != 1 || block.x == 0 || block.x > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535) {
    g_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  const auto limit = g_max_dynamic_smem.find(kernel);
  const size_t max_smem = limit == g_max_dynamic_smem.end() ? kDefaultDynamicSmem : size_t(limit->second);
  if (smem > max_smem) {
    std::fprintf(stderr, "[cuda emulator] launch with %zu bytes of dynamic shared memory, the kernel allows %zu\n",
                 smem, max_smem);
    g_last_error = cudaErrorInvalidValue;
    return;
  }
  while (g_stacks.size() < block.x) g_stacks.emplace_back(new uint8_t[kStackBytes]);
  Cta cta;
  cta.fibers.resize(block.x);
  cta.body = body;
  cta.body_context = context;
  cta.slots[0].assign(size_t(block.x + 31) / 32 * 32, 0);
  cta.slots[1].assign(size_t(block.x + 31) / 32 * 32, 0);
  cta.warp_generation.assign((block.x + 31) / 32, 0);
  g_smem.assign(smem + 2 * kCanary, 0xa5);
  g_smem_bytes = smem;
  g_block_dim = block;
  g_grid_dim = grid;
  g_cta = &cta;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        g_block_index = dim3(x, y, z);
        // Shared memory starts as garbage (all-ones: NaN as floats), as on the device.
        std::memset(g_smem.data() + kCanary, 0xff, smem);
        if (!run_cta(block.x)) {
          g_cta = nullptr;
          g_last_error = cudaErrorLaunchFailure;
          return;
        }
        for (size_t i = 0; i < kCanary; ++i)
          if (g_smem[i] != 0xa5 || g_smem[kCanary + smem + i] != 0xa5) {
            report("a kernel wrote outside its " + std::to_string(smem) + " bytes of dynamic shared memory");
            g_cta = nullptr;
            g_last_error = cudaErrorLaunchFailure;
            return;
          }
      }
  g_cta = nullptr;
  g_block_index = kZero;
}

cudaError_t func_get_attributes(cudaFuncAttributes *attributes, const void *) {
  attributes->sharedSizeBytes = 0;
  attributes->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}

cudaError_t func_set_attribute(const void *kernel, cudaFuncAttribute attribute, int value) {
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || size_t(value) > smem_optin())
    return cudaErrorInvalidValue;
  g_max_dynamic_smem[kernel] = value;
  return cudaSuccess;
}

}  // namespace emu

using emu::g_allocations;
using emu::g_first_error;
using emu::g_last_error;

namespace {
cudaError_t sticky() { return g_first_error.empty() ? cudaSuccess : cudaErrorLaunchFailure; }

// Device allocations carry a guard zone after their end, checked when they are freed.
constexpr size_t kGuard = 256;
void *allocate(size_t bytes, EmuMemPool *pool) {
  if (!emu::allocation_allowed()) return nullptr;
  void *p = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256 + kGuard);
  if (!p) return nullptr;
  std::memset(p, 0xff, bytes);  // fresh device memory is garbage
  std::memset(static_cast<uint8_t *>(p) + bytes, 0x5a, kGuard);
  g_allocations[p] = {bytes, pool};
  if (pool) ++pool->live;
  return p;
}

cudaError_t release(void *p) {
  if (!p) return cudaSuccess;
  const auto it = g_allocations.find(p);
  if (it == g_allocations.end()) {
    emu::report("free of a pointer that is not a live device allocation");
    return cudaErrorInvalidValue;
  }
  if (it->second.pool) --it->second.pool->live;
  for (size_t i = 0; i < kGuard; ++i)
    if (static_cast<uint8_t *>(p)[it->second.bytes + i] != 0x5a) {
      emu::report("a write past the end of a " + std::to_string(it->second.bytes) + "-byte device allocation");
      break;
    }
  std::memset(p, 0xff, it->second.bytes);  // catch reads after free
  g_allocations.erase(it);
  std::free(p);
  return cudaSuccess;
}
}  // namespace

const char *cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoKernelImageForDevice: return "cudaErrorNoKernelImageForDevice";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotReady: return "cudaErrorNotReady";
  }
  return "cudaErrorUnknown";
}
const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated CUDA error"; }
cudaError_t cudaGetLastError() {
  const cudaError_t e = g_last_error;
  g_last_error = sticky();
  return e;
}
cudaError_t cudaPeekAtLastError() { return g_last_error; }
cudaError_t cudaGetDeviceCount(int *count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int *device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attribute, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  switch (attribute) {
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 49152; break;
    case cudaDevAttrMultiProcessorCount: *value = emu::sm_count(); break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = int(emu::smem_optin()); break;
    case cudaDevAttrMemoryPoolsSupported: *value = 1; break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() { return sticky(); }
cudaError_t cudaStreamCreate(cudaStream_t *stream) {
  *stream = new EmuStream;
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned) { return cudaStreamCreate(stream); }
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return sticky(); }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return cudaSuccess; }
cudaError_t cudaEventCreate(cudaEvent_t *event) {
  *event = new EmuEvent;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned) { return cudaEventCreate(event); }
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return sticky(); }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t, cudaEvent_t) {
  *ms = 0.0f;
  return cudaSuccess;
}
cudaError_t cudaMalloc(void **p, size_t bytes) {
  *p = allocate(bytes, nullptr);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void *p) { return release(p); }
cudaError_t cudaMemPoolCreate(cudaMemPool_t *pool, const cudaMemPoolProps *) {
  *pool = new EmuMemPool;
  return cudaSuccess;
}
cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool) {
  if (pool->live) emu::report("memory pool destroyed with " + std::to_string(pool->live) + " live allocations");
  delete pool;
  return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void *) { return cudaSuccess; }
cudaError_t cudaMallocFromPoolAsync(void **p, size_t bytes, cudaMemPool_t pool, cudaStream_t) {
  *p = allocate(bytes, pool);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeAsync(void *p, cudaStream_t) { return release(p); }
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned) {
  if (!emu::allocation_allowed()) return cudaErrorMemoryAllocation;
  *p = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void *p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind) {
  if (bytes) std::memmove(dst, src, bytes);
  return sticky();
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  return cudaMemcpy(dst, src, bytes, kind);
}
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width,
                              size_t height, cudaMemcpyKind, cudaStream_t) {
  for (size_t row = 0; row < height; ++row)
    std::memmove(static_cast<uint8_t *>(dst) + row * dst_pitch, static_cast<const uint8_t *>(src) + row * src_pitch,
                 width);
  return sticky();
}
cudaError_t cudaMemset(void *p, int value, size_t bytes) {
  std::memset(p, value, bytes);
  return sticky();
}
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t) { return cudaMemset(p, value, bytes); }
