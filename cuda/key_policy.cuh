// What a key policy of the CUDA backend provides (each method's policy lives in its home,
// src/methods/<method>/cuda_keys.cuh; cuda/keys.cuh lists them and maps a method to its type once
// per launch on the host, so no kernel branches on a method), and the device helpers they share.
//
// quantize<BF16>(s, src, block)  all threads of a quantize CTA (kQuantizeThreads): the keys of the
//                           block's B tokens of one kv head into its zeroed block (src.key(t, j)
//                           reads them as floats), bit-identical to the CPU backend. Instantiated by
//                           append.cu alone, which is compiled without FMA contraction.
// quantize_smem(s)          (host) the dynamic shared memory quantize needs
// Scorer<ROWS>              belongs to one CTA of ROWS query rows (q: [ROWS][d32] in shared memory);
//                           all its functions but score() and token_score() are called by every
//                           thread and end synchronized:
//   init()                  once per CTA, after the queries are loaded
//   setup_block(block)      per quantized block: what its tokens' scores share
//   stage(stage_k, block, t0, n)  the keys of tokens [t0, t0 + n) of the block into shared memory
//   score<BF16>(stage_k, lane, warp, a, b)  lane < n: this warp's part of token `lane`'s dot
//                           products with every row, into a (and b for a second sum: kTwoSums)
//   token_score(stage_k, block, r, t0, t, sum_a, sum_b)  the raw score of row r and token t0 + t
//                           from the summed parts (-inf for OTT's moved slots)
#pragma once
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "device.cuh"
#include "methods/ott_tracing.hpp"

namespace qjlkv::cuda {

inline constexpr float kNegInf = -__builtin_huge_valf();

// What a key policy without the feature does.
struct KeyPolicyDefaults {
  static constexpr bool kTwoSums = false;  // token_score reads a second sum of partial products
  static size_t quantize_smem(const KernelShape &) { return 0; }
};

// Σ_i v_r[i]·(±1) over the 32 sketch rows of one word of sign bits, for every query row r.
template <uint32_t ROWS>
__device__ __forceinline__ void accumulate_signs(uint32_t word, const float *v, uint32_t stride, float (&acc)[ROWS]) {
#pragma unroll
  for (uint32_t i = 0; i < 32; i += 4) {
    const float f0 = sign_factor(word, i), f1 = sign_factor(word, i + 1), f2 = sign_factor(word, i + 2),
                f3 = sign_factor(word, i + 3);
#pragma unroll
    for (uint32_t r = 0; r < ROWS; ++r) {
      const float4 x = *reinterpret_cast<const float4 *>(v + r * stride + i);
      acc[r] = fmaf(x.x, f0, fmaf(x.y, f1, fmaf(x.z, f2, fmaf(x.w, f3, acc[r]))));
    }
  }
}

// Four query codes |Q| <= 127·256 (code_at(b), b < 4) as the dp4a words {hi, lo} of their two
// int8 digits, Q = 256·hi + lo: the per-channel keys' integer scores take Σ code·hi and Σ code·lo.
template <class CodeAt>
__device__ __forceinline__ uint2 query_digit_words(CodeAt code_at) {
  uint32_t hi = 0, lo = 0;
#pragma unroll
  for (uint32_t b = 0; b < 4; ++b) {
    const int code = code_at(b);
    const int high = (code + 128) >> 8;  // high in [-127, 127], code - 256·high in [-128, 127]
    hi |= uint32_t(high & 0xff) << (8 * b);
    lo |= uint32_t((code - 256 * high) & 0xff) << (8 * b);
  }
  return make_uint2(hi, lo);
}

// The codes of group g of a staged KIVI row (see kivi_unpacked_channel) as words of four 8-bit
// codes. 8-bit codes are biased by -128 (int8 for dp4a); the scorer adds 128·Σ Q back.
template <uint32_t BITS>
__device__ __forceinline__ void unpack_codes(const uint8_t *row, uint32_t g, bool aligned,
                                             uint32_t (&u)[kivi_group_codes(BITS) / 4]) {
  if constexpr (BITS == 3) {
    const uint8_t *p = row + 12 * g;  // the last group of a row reads into the next row or the stage's slack
    const uint32_t w0 = load_word(p, aligned), w1 = load_word(p + 4, aligned), w2 = load_word(p + 8, aligned);
    const uint32_t chunk[4] = {w0, w0 >> 24 | w1 << 8, w1 >> 16 | w2 << 16, w2 >> 8};  // 8 codes each
#pragma unroll
    for (uint32_t k = 0; k < 4; ++k) {
      u[2 * k] = spread3(chunk[k]);
      u[2 * k + 1] = spread3(chunk[k] >> 3);
    }
  } else {
    const uint32_t word = load_word(row + 4 * g, aligned);
    constexpr uint32_t kMask = 0x01010101u * ((1u << BITS) - 1u);
#pragma unroll
    for (uint32_t k = 0; k < 32 / BITS / 4; ++k) u[k] = BITS == 8 ? word ^ 0x80808080u : word >> (k * BITS) & kMask;
  }
}

// Σ q_r[e]·x_e over the two 16-bit numbers (fp16, or bf16 when BF16) of one word, for every
// query row r; q points at the word's first element of row 0.
template <bool BF16, uint32_t ROWS>
__device__ __forceinline__ void accumulate_16bit_pair(uint32_t word, const float *q, uint32_t stride,
                                                      float (&acc)[ROWS]) {
  const float x0 = stored16_to_float<BF16>(word & 0xffffu), x1 = stored16_to_float<BF16>(word >> 16);
#pragma unroll
  for (uint32_t r = 0; r < ROWS; ++r) {
    const float2 qq = *reinterpret_cast<const float2 *>(q + r * stride);
    acc[r] = fmaf(qq.x, x0, fmaf(qq.y, x1, acc[r]));
  }
}

// Rows of `words` 4-byte words from global memory into shared rows of dst_stride words:
// one warp per row, lanes along the row (coalesced).
template <class RowAddress>
__device__ __forceinline__ void copy_rows(uint32_t *dst, uint32_t dst_stride, uint32_t words, uint32_t n_rows,
                                          RowAddress row_address) {
  const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  for (uint32_t t = warp; t < n_rows; t += kAttendThreads / 32) {
    const auto *src = reinterpret_cast<const uint32_t *>(row_address(t));
    for (uint32_t k = lane; k < words; k += 32) dst[t * dst_stride + k] = __ldg(src + k);
  }
}

}  // namespace qjlkv::cuda
