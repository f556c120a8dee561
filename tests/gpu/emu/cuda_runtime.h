// A CPU stand-in for the part of the CUDA runtime that libqjlkv's CUDA backend and its tests use,
// plus the device built-ins its kernels use. With this directory first on the include path, the
// backend's host code (cuda/*.cpp) and kernel sources (cuda/*.cu, compiled as C++) build with a
// plain C++ compiler and run on the CPU: each CTA's threads are fibers that meet at
// __syncthreads() and at warp operations (see emu.cpp). One emulated device: an H200-like GPU
// (compute capability 9.0, 227 KiB of shared memory per block; QJLKV_EMU_SMEM_OPTIN sets another
// limit) with 2 SMs (QJLKV_EMU_SMS sets another count).
//
// The emulator is a test tool: work runs synchronously when it is enqueued, device memory is host
// memory, and every kernel launch checks its shared memory limit and its shared memory canaries.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- types ------------------------------------------------------------------------------------
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorInvalidDevice = 101,
  cudaErrorNoKernelImageForDevice = 209,
  cudaErrorLaunchFailure = 719,
  cudaErrorNotReady = 600,
};
using cudaStream_t = struct EmuStream *;
using cudaEvent_t = struct EmuEvent *;
using cudaMemPool_t = struct EmuMemPool *;

enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
enum cudaDeviceAttr {
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
  cudaDevAttrMemoryPoolsSupported = 115,
};
enum cudaMemAllocationType { cudaMemAllocationTypePinned = 1 };
enum cudaMemAllocationHandleType { cudaMemHandleTypeNone = 0 };
enum cudaMemLocationType { cudaMemLocationTypeDevice = 1 };
struct cudaMemLocation {
  cudaMemLocationType type;
  int id;
};
struct cudaMemPoolProps {
  cudaMemAllocationType allocType;
  cudaMemAllocationHandleType handleTypes;
  cudaMemLocation location;
};
enum cudaMemPoolAttr { cudaMemPoolAttrReleaseThreshold = 4 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct cudaFuncAttributes {
  size_t sharedSizeBytes;
  int maxThreadsPerBlock;
};
#define cudaEventDisableTiming 0x02u
#define cudaHostAllocDefault 0x00u
#define cudaStreamNonBlocking 0x01u

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }

// ---- runtime API ------------------------------------------------------------------------------
const char *cudaGetErrorName(cudaError_t e);
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attribute, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaStreamCreate(cudaStream_t *stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags);
cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMemPoolCreate(cudaMemPool_t *pool, const cudaMemPoolProps *props);
cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value);
cudaError_t cudaMallocFromPoolAsync(void **p, size_t bytes, cudaMemPool_t pool, cudaStream_t stream);
cudaError_t cudaFreeAsync(void *p, cudaStream_t stream);
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream = nullptr);
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width,
                              size_t height, cudaMemcpyKind kind, cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void *p, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t stream = nullptr);

namespace emu {
cudaError_t func_get_attributes(cudaFuncAttributes *attributes, const void *kernel);
cudaError_t func_set_attribute(const void *kernel, cudaFuncAttribute attribute, int value);
}  // namespace emu
template <class F>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *attributes, F *kernel) {
  return emu::func_get_attributes(attributes, reinterpret_cast<const void *>(kernel));
}
template <class F>
cudaError_t cudaFuncSetAttribute(F *kernel, cudaFuncAttribute attribute, int value) {
  return emu::func_set_attribute(reinterpret_cast<const void *>(kernel), attribute, value);
}

// ---- device side ------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// CTAs run one after the other, so a function-level static is exactly one CTA's shared memory.
#define __shared__ static

namespace emu {
const dim3 &thread_index();
const dim3 &block_index();
const dim3 &block_dim();
const dim3 &grid_dim();
void sync_block();                    // __syncthreads()
uint64_t warp_exchange(uint64_t value, unsigned source_lane_xor);  // __shfl_xor_sync
unsigned warp_ballot(bool predicate);  // __ballot_sync
uint8_t *dynamic_smem();
void run_grid(const void *kernel, dim3 grid, dim3 block, size_t smem, void (*body)(void *), void *context);

template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A &&...args) {
  // Like a real launch, the kernel receives copies of its arguments converted to its parameter types.
  std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
  struct Context {
    void (*kernel)(P...);
    std::tuple<std::decay_t<P>...> *params;
  } context{kernel, &params};
  run_grid(reinterpret_cast<const void *>(kernel), grid, block, smem,
           [](void *c) {
             auto *ctx = static_cast<Context *>(c);
             std::apply(ctx->kernel, *ctx->params);
           },
           &context);
}
}  // namespace emu

#define threadIdx (::emu::thread_index())
#define blockIdx (::emu::block_index())
#define blockDim (::emu::block_dim())
#define gridDim (::emu::grid_dim())
#define QJLKV_LAUNCH(kernel, grid, block, smem, stream, ...) \
  (static_cast<void>(stream), ::emu::launch(kernel, dim3(grid), dim3(block), size_t(smem), __VA_ARGS__))
#define QJLKV_DYNAMIC_SMEM(name) uint8_t *name = ::emu::dynamic_smem()

inline void __syncthreads() { emu::sync_block(); }
template <class T>
inline T __shfl_xor_sync(unsigned, T value, int lane_xor) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = emu::warp_exchange(bits, unsigned(lane_xor));
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}
// __shfl_sync reads lane `source`: an exchange with lane ^ (lane ^ source).
template <class T>
inline T __shfl_sync(unsigned mask, T value, int source) {
  return __shfl_xor_sync(mask, value, int(threadIdx.x % 32) ^ (source & 31));
}
inline unsigned __ballot_sync(unsigned, int predicate) { return emu::warp_ballot(predicate != 0); }
// Σ of the four products of the signed bytes of a and b, plus c.
inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 32; i += 8) c += int(int8_t(uint32_t(a) >> i)) * int(int8_t(uint32_t(b) >> i));
  return c;
}
// Nearest even (the default rounding mode), saturated, NaN to 0: as cvt.rni.s32.f32.
inline int __float2int_rn(float x) {
  if (!(x == x)) return 0;
  const float r = std::nearbyint(x);
  return r >= 2147483648.0f ? 2147483647 : r < -2147483648.0f ? -2147483647 - 1 : int(r);
}
template <class T>
inline T __ldg(const T *p) {
  return *p;
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __expf(float x) { return std::exp(x); }
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Fibers never preempt each other: a read-modify-write is atomic.
inline unsigned long long atomicMin(unsigned long long *p, unsigned long long v) {
  const unsigned long long old = *p;
  if (v < old) *p = v;
  return old;
}
inline unsigned atomicAdd(unsigned *p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
