// Key policies: one type per key method (QJL, KIVI, OTT, exact), consumed by the quantize kernel
// of append.cu and by the attention kernel template (attend.cuh); with_key_policy at the end maps a
// method to its type, once per launch on the host, so no kernel branches on a method.
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

// QJL keys (src/methods/qjl/qjl_keys.hpp): per token the sign bits of the sketched inlier key, the
// fp16 norms of its inlier and outlier parts, and fp16 corrections τ on the block's c outlier
// channels. Raw score: c_d/m·n_in·⟨S·q, ±bits_in⟩ + (n_in + n_out)·Σ_j q[o_j]·τ_j.
struct QjlKeys : KeyPolicyDefaults {
  static constexpr bool kTwoSums = true;  // the sketch sum and the outlier corrections' sum

  // The CPU's qjl_quantize_block. Sums run sequentially in the CPU's order, without FMA.
  // Dynamic shared memory: the chunk's outlier sign bits (quantize_smem), which only the
  // corrections read: the block does not store them.
  template <bool, class Source>
  __device__ static void quantize(const KernelShape &s, const Source &src, uint8_t *block) {
    using Sort = cub::BlockRadixSort<unsigned long long, kQuantizeThreads, 1>;
    using Scan = cub::BlockScan<int, kQuantizeThreads>;
    __shared__ union {
      typename Sort::TempStorage sort;
      typename Scan::TempStorage scan;
    } cub_storage;
    __shared__ int is_outlier[kQuantizeThreads];
    __shared__ uint32_t outliers[kQuantizeThreads];
    __shared__ float inlier_keys[kQuantizeChunk][kQuantizeThreads];  // outlier channels zeroed
    __shared__ float raw_keys[kQuantizeChunk][kQuantizeThreads];
    QJLKV_DYNAMIC_SMEM(outlier_bits);  // [kQuantizeChunk][m_out / 8]: sign(S_out·k_out)
    const uint32_t tid = threadIdx.x, lane = tid & 31u, d = s.d, B = s.B, c = s.outlier_channels;

    is_outlier[tid] = 0;
    if (c > 0) {
      // Channel energies Σ_t k_tj², then the c largest (ties: lower channel) through a block sort.
      float energy = 0.0f;
      if (tid < d)
        for (uint32_t t = 0; t < B; ++t) {
          const float x = src.key(t, tid);
          energy = __fadd_rn(energy, __fmul_rn(x, x));
        }
      unsigned long long sort_key[1] = {tid < d ? outlier_sort_key(energy, tid) : 0ull};
      Sort(cub_storage.sort).SortDescending(sort_key);
      __syncthreads();
      if (tid < c) is_outlier[outlier_sort_channel(sort_key[0])] = 1;
      __syncthreads();
      // Stored ascending: each outlier channel's slot is the number of outlier channels below it.
      const int flag = is_outlier[tid];
      int slot = 0;
      Scan(cub_storage.scan).ExclusiveSum(flag, slot);
      if (flag) {
        outliers[slot] = tid;
        block[s.layout.key_outlier_idx + slot] = uint8_t(tid);
      }
    }
    __syncthreads();

    auto *norm_in = reinterpret_cast<uint16_t *>(block + s.layout.key_norm_in);
    auto *norm_out = reinterpret_cast<uint16_t *>(block + s.layout.key_norm_out);
    auto *corrections = reinterpret_cast<uint16_t *>(block + s.layout.key_corrections);
    const uint32_t outlier_bytes = s.m_out / 8;
    const float *sketch_t = s.sketch_t;
    const uint32_t rows = s.sketch_rows;
    for (uint32_t t0 = 0; t0 < B; t0 += kQuantizeChunk) {  // B is a multiple of 8
      for (uint32_t i = tid; i < kQuantizeChunk * d; i += kQuantizeThreads) {
        const uint32_t tt = i / d, j = i % d;
        const float x = src.key(t0 + tt, j);
        raw_keys[tt][j] = x;
        inlier_keys[tt][j] = is_outlier[j] ? 0.0f : x;
      }
      __syncthreads();
      if (tid < kQuantizeChunk) {
        float norm2 = 0.0f;
        for (uint32_t j = 0; j < d; ++j) norm2 = __fadd_rn(norm2, __fmul_rn(inlier_keys[tid][j], inlier_keys[tid][j]));
        norm_in[t0 + tid] = float_to_half(sqrtf(norm2));
      } else if (c > 0 && tid >= 32 && tid < 32 + kQuantizeChunk) {
        const uint32_t tt = tid - 32;
        float norm2 = 0.0f;
        for (uint32_t i = 0; i < c; ++i) {
          const float x = raw_keys[tt][outliers[i]];
          norm2 = __fadd_rn(norm2, __fmul_rn(x, x));
        }
        norm_out[t0 + tt] = float_to_half(sqrtf(norm2));
      }
      // Sign bits of n_rows sketch rows over the channels channel(0..n_channels-1) of keys: thread i
      // projects the chunk's tokens on sketch row i; a warp ballot packs 8 rows per byte (bit j of
      // byte b = row 8b + j) into the chunk's rows of bytes_per_token bytes at `bits`.
      const auto pack_signs = [&](uint32_t n_rows, uint32_t n_channels, auto channel,
                                  const float (&keys)[kQuantizeChunk][kQuantizeThreads], uint8_t *bits,
                                  uint32_t bytes_per_token) {
        for (uint32_t base = 0; base < n_rows; base += kQuantizeThreads) {
          const uint32_t i = base + tid;
          float projection[kQuantizeChunk] = {};
          if (i < n_rows)
            for (uint32_t k = 0; k < n_channels; ++k) {
              const uint32_t j = channel(k);
              const float w = sketch_t[size_t(j) * rows + i];
  #pragma unroll
              for (uint32_t tt = 0; tt < kQuantizeChunk; ++tt)
                projection[tt] = __fadd_rn(projection[tt], __fmul_rn(w, keys[tt][j]));
            }
  #pragma unroll
          for (uint32_t tt = 0; tt < kQuantizeChunk; ++tt) {
            const uint32_t positive = __ballot_sync(0xffffffffu, i < n_rows && projection[tt] > 0.0f);
            if (i < n_rows && (lane & 7u) == 0) bits[size_t(tt) * bytes_per_token + i / 8] = uint8_t(positive >> lane);
          }
        }
      };
      uint8_t *bits_in = block + s.layout.key_bits_in;
      const size_t bits_bpt = s.layout.key_bytes_per_token_bits_in;
      pack_signs(s.m, d, [](uint32_t k) { return k; }, inlier_keys, bits_in + t0 * bits_bpt, uint32_t(bits_bpt));
      if (c > 0) {
        pack_signs(s.m_out, c, [&](uint32_t k) { return outliers[k]; }, raw_keys, outlier_bits, outlier_bytes);
        __syncthreads();  // the chunk's norms and bits are written
        // The corrections (store_corrections of src/methods/qjl/qjl_keys.hpp), one thread per (outlier, token). Column o of
        // the sketch is row o of sketch_t: column_signed_sum reads it as a [rows][1] matrix.
        for (uint32_t pair = tid; pair < c * kQuantizeChunk; pair += kQuantizeThreads) {
          const uint32_t j = pair / kQuantizeChunk, tt = pair % kQuantizeChunk, t = t0 + tt;
          const float *column = sketch_t + size_t(outliers[j]) * rows;
          const int64_t inlier_sum = column_signed_sum(column, 1, 0, bits_in + t * bits_bpt, s.m);
          const int64_t outlier_sum = column_signed_sum(column, 1, 0, outlier_bits + tt * outlier_bytes, s.m_out);
          corrections[size_t(j) * B + t] = qjl_correction(s.qjl_constant, half_to_float(norm_in[t]),
                                                          half_to_float(norm_out[t]), inlier_sum, outlier_sum, s.m,
                                                          s.m_out);
        }
      }
      __syncthreads();
    }
  }
  static size_t quantize_smem(const KernelShape &s) { return size_t(kQuantizeChunk) * s.m_out / 8; }

  template <uint32_t ROWS>
  struct Scorer {
    const KernelShape &s;
    const AttendSmem &L;
    const float *q;
    uint32_t d32, m32;
    float *sq;
    uint32_t *outliers;
    __device__ Scorer(const KernelShape &shape, const AttendSmem &layout, uint8_t *shared)
        : s(shape), L(layout), q(reinterpret_cast<const float *>(shared + layout.q)),
          d32(round_up(shape.d, 32)), m32(round_up(shape.m, 32)), sq(reinterpret_cast<float *>(shared + layout.sq)),
          outliers(reinterpret_cast<uint32_t *>(shared + layout.outlier)) {}

    // S·q once per CTA over the m inlier sketch rows (zero padding up to m32).
    __device__ void init() {
      for (uint32_t i = threadIdx.x; i < m32; i += kAttendThreads) {
        float acc[ROWS] = {};
        if (i < s.m)
          for (uint32_t j = 0; j < s.d; ++j) {
            const float w = __ldg(s.sketch_t + size_t(j) * s.sketch_rows + i);
#pragma unroll
            for (uint32_t r = 0; r < ROWS; ++r) acc[r] = fmaf(w, q[r * d32 + j], acc[r]);
          }
#pragma unroll
        for (uint32_t r = 0; r < ROWS; ++r) sq[r * m32 + i] = acc[r];
      }
      __syncthreads();
    }
    // The block's outlier channels.
    __device__ void setup_block(const uint8_t *block) {
      for (uint32_t i = threadIdx.x; i < s.outlier_channels; i += kAttendThreads)
        outliers[i] = block[s.layout.key_outlier_idx + i];
      __syncthreads();
    }
    __device__ void stage(uint8_t *stage_k, const uint8_t *block, uint32_t t0, uint32_t n) const {
      const uint32_t bits_bpt = uint32_t(s.layout.key_bytes_per_token_bits_in);
      copy_words(stage_k + L.k_norm_in, block + s.layout.key_norm_in + t0 * 2, n * 2, kAttendThreads);
      copy_words(stage_k + L.k_bits_in, block + s.layout.key_bits_in + t0 * bits_bpt, n * bits_bpt, kAttendThreads);
      if (s.outlier_channels) {
        copy_words(stage_k + L.k_norm_out, block + s.layout.key_norm_out + t0 * 2, n * 2, kAttendThreads);
        // Outlier j's corrections of tokens t0 .. t0 + n (n a multiple of 8: whole words).
        copy_rows(reinterpret_cast<uint32_t *>(stage_k + L.k_corrections), kTile / 2, n / 2, s.outlier_channels,
                  [&](uint32_t j) { return block + s.layout.key_corrections + (size_t(j) * s.B + t0) * 2; });
      }
    }
    template <bool BF16>
    __device__ void score(const uint8_t *stage_k, uint32_t lane, uint32_t warp, float (&acc_in)[ROWS],
                          float (&acc_out)[ROWS]) const {
      const uint32_t bits_bpt = uint32_t(s.layout.key_bytes_per_token_bits_in);
      const uint8_t *bits_in = stage_k + L.k_bits_in + lane * bits_bpt;
      const uint32_t words = div_up(s.m, 32);
      const bool aligned = bits_bpt % 4 == 0;
      for (uint32_t k = warp; k < words; k += kParts)
        accumulate_signs<ROWS>(load_word(bits_in + 4 * k, aligned), sq + 32 * k, m32, acc_in);
      const auto *corrections = reinterpret_cast<const uint16_t *>(stage_k + L.k_corrections) + lane;
      for (uint32_t j = warp; j < s.outlier_channels; j += kParts) {
        const float tau = fp16_bits_to_float(corrections[j * kTile]);
        const float *q_outlier = q + outliers[j];
#pragma unroll
        for (uint32_t r = 0; r < ROWS; ++r) acc_out[r] = fmaf(q_outlier[r * d32], tau, acc_out[r]);
      }
    }
    __device__ float token_score(const uint8_t *stage_k, const uint8_t *, uint32_t, uint32_t, uint32_t t, float sum_in,
                                 float sum_out) const {
      const float n_in = fp16_bits_to_float(reinterpret_cast<const uint16_t *>(stage_k + L.k_norm_in)[t]);
      float score = s.qjl_constant / float(s.m) * n_in * sum_in;
      if (s.outlier_channels) {
        const float n_out = fp16_bits_to_float(reinterpret_cast<const uint16_t *>(stage_k + L.k_norm_out)[t]);
        score += (n_in + n_out) * sum_out;
      }
      return score;
    }
  };
};

// KIVI keys, and OTT's (MASKED): per-channel fp16 scale and minimum per block, 2/3/4/8-bit codes
// per token; OTT blocks also mask the slots whose token moved to the outlier pool. Scores in
// integers: dp4a of the unpacked codes with the query's two int8 digits (layout.hpp,
// kQueryCodeMax).
template <bool MASKED>
struct ChannelCodeKeys : KeyPolicyDefaults {
  // The CPU's kivi_quantize_block: per channel over the block's tokens (OTT's moved tokens come as
  // the block's mean, src.key).
  template <bool, class Source>
  __device__ static void quantize(const KernelShape &s, const Source &src, uint8_t *block) {
    __shared__ float channel_scale[kQuantizeThreads], channel_min[kQuantizeThreads];
    const uint32_t tid = threadIdx.x, d = s.d, B = s.B, bits = s.key_bits;
    if (tid < d) {
      float lo = src.key(0, tid), hi = lo;
      for (uint32_t t = 1; t < B; ++t) kivi_minmax_step(src.key(t, tid), lo, hi);
      const GroupQuant q = group_quant(lo, hi, bits);
      reinterpret_cast<uint16_t *>(block + s.layout.key_scale)[tid] = q.scale_bits;
      reinterpret_cast<uint16_t *>(block + s.layout.key_min)[tid] = q.min_bits;
      channel_scale[tid] = q.scale;
      channel_min[tid] = q.min;
    }
    __syncthreads();
    const uint32_t eights = d / 8;
    for (uint32_t i = tid; i < B * eights; i += kQuantizeThreads) {
      const uint32_t t = i / eights, g8 = i % eights;
      uint64_t packed = 0;
      for (uint32_t k = 0; k < 8; ++k) {
        const uint32_t j = 8 * g8 + k;
        GroupQuant q{};
        q.scale = channel_scale[j];
        q.min = channel_min[j];
        packed |= uint64_t(quant_code(src.key(t, j), q, bits)) << (k * bits);
      }
      store_codes8(block + s.layout.key_codes + t * s.layout.key_bytes_per_token_codes, g8, bits, packed);
    }
  }

  template <uint32_t ROWS>
  struct Scorer {
    const KernelShape &s;
    const AttendSmem &L;
    uint8_t *smem;
    const float *q;
    uint32_t d32;
    uint2 *digits;  // {hi, lo} [ROWS][d32 / 4]
    float *key_offset, *key_step;
    __device__ Scorer(const KernelShape &shape, const AttendSmem &layout, uint8_t *shared)
        : s(shape), L(layout), smem(shared), q(reinterpret_cast<const float *>(shared + layout.q)),
          d32(round_up(shape.d, 32)), digits(reinterpret_cast<uint2 *>(shared + layout.qdigits)),
          key_offset(reinterpret_cast<float *>(shared + layout.koff)), key_step(key_offset + ROWS) {}

    __device__ void init() {}
    // The query digits of this block (layout.hpp, kQueryCodeMax) and per row the step and the offset
    // shared by the block's tokens: Σ_c q_c·min_c + mid·Σ_c ρ_c (ρ_c = q'_c − step·Q_c, mid =
    // (2^bits − 1)/2: the error is Σ_c ρ_c·(code_c − mid), |ρ_c| ≤ step/2), + 128·step·Σ_c Q_c for
    // the bias of 8-bit codes.
    __device__ void setup_block(const uint8_t *block) {
      const uint32_t tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5, bits = s.key_bits;
      int *Q = reinterpret_cast<int *>(smem + L.final_buf);  // [ROWS][d32] scratch
      const auto *scale16 = reinterpret_cast<const uint16_t *>(block + s.layout.key_scale);
      const auto *min16 = reinterpret_cast<const uint16_t *>(block + s.layout.key_min);
      const auto scaled = [&](uint32_t r, uint32_t j) { return j < s.d ? q[r * d32 + j] * fp16_bits_to_float(scale16[j]) : 0.0f; };
      for (uint32_t r = warp; r < ROWS; r += kParts) {
        float largest = 0.0f;
        for (uint32_t j = lane; j < d32; j += 32) largest = fmaxf(largest, fabsf(scaled(r, j)));
        largest = warp_max(largest);
        const float inverse = largest > 0.0f ? kQueryCodeMax / largest : 0.0f;
        const float step = largest > 0.0f ? largest / kQueryCodeMax : 0.0f;
        float min_sum = 0.0f, residual = 0.0f, code_sum = 0.0f;  // |Σ Q| < 2^24: exact
        for (uint32_t j = lane; j < d32; j += 32) {
          const float x = scaled(r, j);
          const int code = __float2int_rn(x * inverse);
          Q[r * d32 + j] = code;
          residual += x - float(code) * step;
          code_sum += float(code);
          if (j < s.d) min_sum += q[r * d32 + j] * fp16_bits_to_float(min16[j]);
        }
        min_sum = warp_sum(min_sum);
        residual = warp_sum(residual);
        code_sum = warp_sum(code_sum);
        if (lane == 0) {
          const float mid = float((1u << bits) - 1u) * 0.5f;
          key_offset[r] = min_sum + residual * mid + (bits == 8 ? 128.0f * step * code_sum : 0.0f);
          key_step[r] = step;
        }
      }
      __syncthreads();
      const uint32_t words = d32 / 4, per_group = kivi_group_codes(bits) / 4;
      for (uint32_t i = tid; i < ROWS * words; i += kAttendThreads) {
        const uint32_t r = i / words, w = i % words;
        uint32_t hi = 0, lo = 0;
#pragma unroll
        for (uint32_t b = 0; b < 4; ++b) {
          const int code = Q[r * d32 + kivi_unpacked_channel(bits, w / per_group, w % per_group, b)];
          const int high = (code + 128) >> 8;  // |Q| <= 127·256: high in [-127, 127], code - 256·high in [-128, 127]
          hi |= uint32_t(high & 0xff) << (8 * b);
          lo |= uint32_t((code - 256 * high) & 0xff) << (8 * b);
        }
        digits[i] = make_uint2(hi, lo);
      }
      __syncthreads();
    }
    __device__ void stage(uint8_t *stage_k, const uint8_t *block, uint32_t t0, uint32_t n) const {
      const uint32_t codes_bpt = uint32_t(s.layout.key_bytes_per_token_codes);
      copy_words(stage_k, block + s.layout.key_codes + t0 * codes_bpt, n * codes_bpt, kAttendThreads);
    }
    template <bool BF16>
    __device__ void score(const uint8_t *stage_k, uint32_t lane, uint32_t warp, float (&acc)[ROWS],
                          float (&)[ROWS]) const {
      const uint8_t *codes = stage_k + lane * uint32_t(s.layout.key_bytes_per_token_codes);
      switch (s.key_bits) {
        case 2: score_bits<2>(codes, warp, acc); break;
        case 3: score_bits<3>(codes, warp, acc); break;
        case 4: score_bits<4>(codes, warp, acc); break;
        default: score_bits<8>(codes, warp, acc);
      }
    }
    // Σ_c Q_rc·code_c over this warp's groups of one token's codes, exactly (|Σ| < 2^31: at most
    // 256 channels of |Q| <= 127·256 and |code| <= 128), as a float per row.
    template <uint32_t BITS>
    __device__ void score_bits(const uint8_t *codes, uint32_t warp, float (&acc)[ROWS]) const {
      constexpr uint32_t kWords = kivi_group_codes(BITS) / 4;
      const uint32_t codes_bpt = uint32_t(s.layout.key_bytes_per_token_codes);
      const uint32_t groups = BITS == 3 ? div_up(s.d, 32) : div_up(codes_bpt, 4), words = d32 / 4;
      const bool aligned = codes_bpt % 4 == 0;
      int hi[ROWS] = {}, lo[ROWS] = {};
      for (uint32_t g = warp; g < groups; g += kParts) {
        uint32_t u[kWords];
        unpack_codes<BITS>(codes, g, aligned, u);
#pragma unroll
        for (uint32_t r = 0; r < ROWS; ++r)
#pragma unroll
          for (uint32_t k = 0; k < kWords; ++k) {
            const uint2 digit = digits[r * words + g * kWords + k];
            hi[r] = __dp4a(int(u[k]), int(digit.x), hi[r]);
            lo[r] = __dp4a(int(u[k]), int(digit.y), lo[r]);
          }
      }
#pragma unroll
      for (uint32_t r = 0; r < ROWS; ++r) acc[r] = float(hi[r] * 256 + lo[r]);
    }
    __device__ float token_score(const uint8_t *, const uint8_t *block, uint32_t r, uint32_t t0, uint32_t t,
                                 float sum, float) const {
      if constexpr (MASKED)
        if (ott::is_moved(block + s.layout.key_mask, t0 + t)) return kNegInf;
      return fmaf(sum, key_step[r], key_offset[r]);
    }
  };
};

using KiviKeys = ChannelCodeKeys<false>;
using OttKeys = ChannelCodeKeys<true>;  // tracing itself (append.cu) happens before quantize

// Exact keys: 16-bit numbers [B][d] (fp16, or bf16 for bf16 inputs).
struct ExactKeys : KeyPolicyDefaults {
  template <bool BF16, class Source>
  __device__ static void quantize(const KernelShape &s, const Source &src, uint8_t *block) {
    auto *dst = reinterpret_cast<uint16_t *>(block + s.layout.key_codes);
    for (uint32_t i = threadIdx.x; i < s.B * s.d; i += kQuantizeThreads)
      dst[i] = float_to_stored16<BF16>(src.key(i / s.d, i % s.d));
  }

  template <uint32_t ROWS>
  struct Scorer {
    const KernelShape &s;
    const float *q;
    uint32_t d32;
    __device__ Scorer(const KernelShape &shape, const AttendSmem &layout, uint8_t *shared)
        : s(shape), q(reinterpret_cast<const float *>(shared + layout.q)), d32(round_up(shape.d, 32)) {}
    __device__ void init() {}
    __device__ void setup_block(const uint8_t *) {}
    __device__ void stage(uint8_t *stage_k, const uint8_t *block, uint32_t t0, uint32_t n) const {
      copy_rows(reinterpret_cast<uint32_t *>(stage_k), padded_row_words(2 * s.d), s.d / 2, n,
                [&](uint32_t t) { return block + s.layout.key_codes + size_t(t0 + t) * 2 * s.d; });
    }
    template <bool BF16>
    __device__ void score(const uint8_t *stage_k, uint32_t lane, uint32_t warp, float (&acc)[ROWS],
                          float (&)[ROWS]) const {
      const uint32_t *row = reinterpret_cast<const uint32_t *>(stage_k) + lane * padded_row_words(2 * s.d);
      for (uint32_t k = warp; k < s.d / 2; k += kParts) accumulate_16bit_pair<BF16, ROWS>(row[k], q + 2 * k, d32, acc);
    }
    __device__ float token_score(const uint8_t *, const uint8_t *, uint32_t, uint32_t, uint32_t, float sum,
                                 float) const {
      return sum;
    }
  };
};

// Calls f(Policy{}) with the policy of this key method (host dispatch of the launches): a method's
// registration on this backend.
template <class F>
auto with_key_policy(qjlkv_key_method method, F &&f) {
  switch (method) {
    case QJLKV_KEYS_KIVI: return f(KiviKeys{});
    case QJLKV_KEYS_OTT: return f(OttKeys{});
    case QJLKV_KEYS_EXACT: return f(ExactKeys{});
    case QJLKV_KEYS_QJL: break;
  }
  return f(QjlKeys{});
}

}  // namespace qjlkv::cuda
