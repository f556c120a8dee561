// What a value policy of the CUDA backend provides (each method's policy lives in its home,
// src/methods/<method>/cuda_values.cuh; cuda/values.cuh lists them and maps a layer to its type
// once per launch on the host, so no kernel branches on the value method), and the device helpers
// they share.
//
// quantize(s, src, block)   all threads of a quantize CTA: the values of the block's B tokens of one
//                           kv head into its zeroed block (src.value(t, j) reads them as floats),
//                           bit-identical to the CPU backend (values_quantize_block).
// Decoder(s, L, smem, slice) one per thread of an attention CTA, which owns the 8 channels of
//                           `slice`; init() runs once per CTA before the first block (all threads,
//                           followed by a barrier), stage() copies a tile of n tokens from t0 of a
//                           block to shared memory (all threads), decode() reads token t's 8
//                           channels back as floats.
// kRotated                  the decoded values are rotated (Lloyd-Max): the kernel rotates its
//                           weighted sum back (rotate_inverse) before exact tokens join it.
#pragma once
#include "device.cuh"
#include "lloyd_max.hpp"

namespace qjlkv::cuda {

// Eight consecutive 16-bit numbers (one 16-byte load) as floats.
template <bool BF16>
__device__ __forceinline__ void unpack8_16bit(const uint8_t *p, float (&v)[kSliceChannels]) {
  const uint4 x = *reinterpret_cast<const uint4 *>(p);
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (uint32_t k = 0; k < 4; ++k) {
    v[2 * k] = stored16_to_float<BF16>(w[k] & 0xffffu);
    v[2 * k + 1] = stored16_to_float<BF16>(w[k] >> 16);
  }
}

// The 8 codes of `bits` bits (2, 3, 4 or 8) that start at byte p (8 codes take `bits` bytes), as
// one 64-bit stream: code c is bits [c·bits, (c + 1)·bits).
__device__ __forceinline__ uint64_t load_codes8(const uint8_t *p, uint32_t bits) {
  switch (bits) {
    case 2: return *reinterpret_cast<const uint16_t *>(p);
    case 4: return *reinterpret_cast<const uint32_t *>(p);
    case 8: {
      const uint2 x = *reinterpret_cast<const uint2 *>(p);
      return uint64_t(x.x) | uint64_t(x.y) << 32;
    }
    default: return uint64_t(p[0]) | uint64_t(p[1]) << 8 | uint64_t(p[2]) << 16;  // 3 bits: not 4-aligned
  }
}

}  // namespace qjlkv::cuda
