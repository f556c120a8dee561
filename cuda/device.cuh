// Device helpers shared by the kernels: element types, 16-bit storage, warp reductions.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "half.hpp"
#include "kernels.hpp"
#include "quant_math.hpp"

// Kernel launches and dynamic shared memory are spelled through these two macros so that the
// CPU emulator of tests/gpu (which runs the kernels as plain C++) can supply its own.
#ifndef QJLKV_LAUNCH
#define QJLKV_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#endif
#ifndef QJLKV_DYNAMIC_SMEM
#define QJLKV_DYNAMIC_SMEM(name) extern __shared__ __align__(16) uint8_t name[]
#endif

namespace qjlkv::cuda {

// Input/output element types. Conversions to float are exact, and float -> fp16/bf16 rounds to
// nearest even exactly like half.hpp, so either implementation gives the same bits.
struct IoF32 {
  using type = float;
  static constexpr bool stored_bf16 = false;
  static __device__ __forceinline__ float load(const type *p, size_t i) { return p[i]; }
  static __device__ __forceinline__ void store(type *p, size_t i, float x) { p[i] = x; }
};
struct IoF16 {
  using type = uint16_t;
  static constexpr bool stored_bf16 = false;
  static __device__ __forceinline__ float load(const type *p, size_t i) {
    return __half2float(__ushort_as_half(p[i]));
  }
  static __device__ __forceinline__ void store(type *p, size_t i, float x) {
    p[i] = __half_as_ushort(__float2half_rn(x));
  }
};
struct IoBF16 {
  using type = uint16_t;
  static constexpr bool stored_bf16 = true;
  static __device__ __forceinline__ float load(const type *p, size_t i) { return __uint_as_float(uint32_t(p[i]) << 16); }
  static __device__ __forceinline__ void store(type *p, size_t i, float x) { p[i] = float_to_bf16(x); }
};

// 16-bit storage of EXACT keys and 16-bit values: bf16 for bf16 inputs, fp16 otherwise.
template <bool BF16>
__device__ __forceinline__ float stored16_to_float(uint32_t bits16) {
  if constexpr (BF16) {
    return __uint_as_float(bits16 << 16);
  } else {
    return __half2float(__ushort_as_half(uint16_t(bits16)));
  }
}
template <bool BF16>
__device__ __forceinline__ uint16_t float_to_stored16(float x) {
  if constexpr (BF16) {
    return float_to_bf16(x);
  } else {
    return float_to_half(x);
  }
}

__device__ __forceinline__ float fp16_bits_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// A 32-bit word at any byte address of shared memory (QJL bit rows need not be 4-aligned).
__device__ __forceinline__ uint32_t load_word(const uint8_t *p, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint32_t *>(p);
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

// The codes of channels [8g, 8g + 8) of one row, packed (quant_math.hpp's pack_code, 8 at a time:
// the bytes of one group of 8 codes belong to that group alone, so threads write whole bytes).
__device__ __forceinline__ void store_codes8(uint8_t *row, uint32_t g, uint32_t bits, uint64_t packed) {
  for (uint32_t b = 0; b < bits; ++b) row[g * bits + b] = uint8_t(packed >> (8 * b));
}

// All threads of a CTA copy `bytes` (a multiple of 4, both ends 4-aligned) from global memory.
__device__ __forceinline__ void copy_words(uint8_t *dst, const uint8_t *src, uint32_t bytes, uint32_t threads) {
  const auto *s = reinterpret_cast<const uint32_t *>(src);
  auto *t = reinterpret_cast<uint32_t *>(dst);
  for (uint32_t i = threadIdx.x; i < bytes / 4; i += threads) t[i] = __ldg(s + i);
}

}  // namespace qjlkv::cuda
