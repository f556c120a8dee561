// The CUDA policy of mixed-bit keys (cuda/key_policy.cuh says what a key policy provides; the
// format and the per-element rules are mixed_keys.hpp's and mixed_math.hpp's).
#pragma once
#include "../../../cuda/key_policy.cuh"
#include "mixed_math.hpp"

namespace qjlkv::cuda {

// Mixed-bit keys: per block and channel an fp16 range and a width of 0 to 4 bits; a token's row
// holds the channels' codes back to back. Scores in integers like KIVI's: dp4a of the codes,
// spread into bytes per field group (layout.hpp, mixed_group), with the query's two int8 digits.
struct MixedKeys : KeyPolicyDefaults {
  // mixed_keys.hpp's quantize_block: the ranges per channel, the widths (the key_token_bits
  // candidates taken first), then each byte of each row from the fields that cover it.
  template <bool, class Source>
  __device__ static void quantize(const KernelShape &s, const Source &src, uint8_t *block) {
    using Scan = cub::BlockScan<uint32_t, kQuantizeThreads>;
    constexpr uint32_t kWidth = mixed::kMaxWidth;
    __shared__ typename Scan::TempStorage scan_storage;
    __shared__ float low[kQuantizeThreads], range[kQuantizeThreads], cell[kQuantizeThreads];
    __shared__ float sorted_range[kQuantizeThreads];
    __shared__ uint32_t sorted_channel[kQuantizeThreads], width[kQuantizeThreads], first_bit[kQuantizeThreads];
    __shared__ uint8_t byte_channel[kWidth * kQuantizeThreads / 8];  // the channel holding bit 0 of each row byte
    const uint32_t tid = threadIdx.x, d = s.d, B = s.B;
    if (tid < d) {
      float lo = src.key(0, tid), hi = lo;
      for (uint32_t t = 1; t < B; ++t) kivi_minmax_step(src.key(t, tid), lo, hi);  // std::min / std::max
      const uint16_t lo16 = float_to_half_down(lo), hi16 = float_to_half_up(hi);
      reinterpret_cast<uint16_t *>(block + s.layout.key_min)[tid] = lo16;
      reinterpret_cast<uint16_t *>(block + s.layout.key_max)[tid] = hi16;
      low[tid] = half_to_float(lo16);
      range[tid] = half_to_float(hi16) - low[tid];
    }
    __syncthreads();
    // The channels by range, larger first, then the lower channel. Scaling by 2^-c is exact
    // (ranges are differences of fp16 numbers: no underflow), so for each bit c the candidates
    // (channel, c) taken before a given one are a prefix of this order: a binary search counts them.
    if (tid < d) {
      const float r = range[tid];
      uint32_t place = 0;
      for (uint32_t k = 0; k < d; ++k) place += range[k] > r || (range[k] == r && k < tid);
      sorted_range[place] = r;
      sorted_channel[place] = tid;
    }
    __syncthreads();
    uint32_t w = 0;
    if (tid < d) {
      for (uint32_t b = 0; b < kWidth; ++b) {
        const float priority = mixed::bit_priority(range[tid], b);
        const uint32_t index = kWidth * tid + b;
        uint32_t rank = 0;
        for (uint32_t c = 0; c < kWidth; ++c) {
          uint32_t first = 0, last = d;
          while (first < last) {
            const uint32_t mid = (first + last) / 2;
            if (mixed::taken_before(mixed::bit_priority(sorted_range[mid], c), kWidth * sorted_channel[mid] + c,
                                    priority, index))
              first = mid + 1;
            else
              last = mid;
          }
          rank += first;
        }
        w += rank < s.key_token_bits;
      }
      width[tid] = w;
      cell[tid] = mixed::cell(range[tid], w);
    }
    uint32_t bit = 0;
    Scan(scan_storage).ExclusiveSum(tid < d ? w : 0u, bit);
    if (tid < d) first_bit[tid] = bit;
    __syncthreads();
    if (tid < d / 8) {  // 8 widths fill 3 bytes of their own
      uint64_t packed = 0;
      for (uint32_t k = 0; k < 8; ++k) packed |= uint64_t(width[8 * tid + k]) << (mixed::kWidthBits * k);
      store_codes8(block + s.layout.key_widths, tid, mixed::kWidthBits, packed);
    }
    if (tid < d)  // the widths sum to the row's bits: every bit belongs to one channel
      for (uint32_t byte = div_up(bit, 8); 8 * byte < bit + w; ++byte) byte_channel[byte] = uint8_t(tid);
    __syncthreads();
    // One thread per row byte: no two threads write a byte; a field across a byte boundary is
    // coded by both of its bytes' threads.
    const uint32_t row_bytes = uint32_t(s.layout.key_bytes_per_token_codes);
    uint8_t *codes = block + s.layout.key_codes;
    for (uint32_t i = tid; i < B * row_bytes; i += kQuantizeThreads) {
      const uint32_t t = i / row_bytes, byte = i % row_bytes;
      uint32_t value = 0;
      for (uint32_t j = byte_channel[byte]; j < d && first_bit[j] < 8 * byte + 8; ++j) {
        if (width[j] == 0) continue;
        const uint32_t code = mixed::code_of(src.key(t, j), low[j], cell[j], width[j]);
        const int shift = int(first_bit[j]) - int(8 * byte);
        value |= shift >= 0 ? code << shift : code >> -shift;
      }
      codes[i] = uint8_t(value);
    }
  }

  template <uint32_t ROWS>
  struct Scorer {
    const KernelShape &s;
    const AttendSmem &L;
    uint8_t *smem;
    const float *q;
    uint32_t d32, groups, row_bytes, row_words, row_stride;
    uint2 *digits;  // {hi, lo} [ROWS][d32 / 4]: word w holds channels 4w .. 4w + 3
    float *key_offset, *key_step;
    uint32_t *group;  // [d / 8][kMixedGroupWords]: mixed_group's descriptors
    __device__ Scorer(const KernelShape &shape, const AttendSmem &layout, uint8_t *shared)
        : s(shape), L(layout), smem(shared), q(reinterpret_cast<const float *>(shared + layout.q)),
          d32(round_up(shape.d, 32)), groups(shape.d / 8), row_bytes(uint32_t(shape.layout.key_bytes_per_token_codes)),
          row_words(div_up(row_bytes, 4)), row_stride(padded_row_words(row_bytes)),
          digits(reinterpret_cast<uint2 *>(shared + layout.qdigits)),
          key_offset(reinterpret_cast<float *>(shared + layout.koff)), key_step(key_offset + ROWS),
          group(reinterpret_cast<uint32_t *>(shared + layout.kgroups)) {}

    __device__ void init() {}
    // The block's field groups, its query digits (layout.hpp, kQueryCodeMax) of q'_j = q_j·cell_j
    // (0 for channels of 0 bits, whose code is always 0), and per row the step and the offset
    // shared by the block's tokens: Σ_j q_j·(lo_j + cell_j/2) + Σ_j ρ_j·mid_j (ρ_j = q'_j − step·Q_j,
    // mid_j = (2^w_j − 1)/2: the error is Σ_j ρ_j·(code_j − mid_j), |ρ_j| ≤ step/2).
    __device__ void setup_block(const uint8_t *block) {
      const uint32_t tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5, d = s.d;
      int *Q = reinterpret_cast<int *>(smem + L.final_buf);  // layout.hpp, mixed_setup_floats
      float *low = reinterpret_cast<float *>(Q + ROWS * d32), *cell = low + d32;
      uint32_t *width = reinterpret_cast<uint32_t *>(cell + d32);
      const auto *min16 = reinterpret_cast<const uint16_t *>(block + s.layout.key_min);
      const auto *max16 = reinterpret_cast<const uint16_t *>(block + s.layout.key_max);
      for (uint32_t j = tid; j < d32; j += kAttendThreads) {
        uint32_t w = 0;
        float lo = 0.0f, c = 0.0f;
        if (j < d) {
          w = unpack_code(block + s.layout.key_widths, j, mixed::kWidthBits);
          lo = fp16_bits_to_float(min16[j]);
          c = mixed::cell(fp16_bits_to_float(max16[j]) - lo, w);
        }
        width[j] = w;
        low[j] = lo;
        cell[j] = c;
      }
      __syncthreads();
      if (warp == 0) {  // group `lane`: its first bit is the sum of the earlier groups' widths
        uint32_t widths8[8] = {}, bits = 0;
        if (lane < groups)
          for (uint32_t k = 0; k < 8; ++k) bits += widths8[k] = width[8 * lane + k];
        uint32_t end = bits;
        for (uint32_t o = 1; o < 32; o *= 2) {
          const uint32_t before = __shfl_sync(0xffffffffu, end, int(lane) - int(o));
          if (lane >= o) end += before;
        }
        if (lane < groups) mixed_group(widths8, end - bits, group + lane * kMixedGroupWords);
      }
      for (uint32_t r = warp; r < ROWS; r += kParts) {
        const float *qr = q + r * d32;
        const auto scaled = [&](uint32_t j) { return width[j] ? qr[j] * cell[j] : 0.0f; };
        float largest = 0.0f;
        for (uint32_t j = lane; j < d32; j += 32) largest = fmaxf(largest, fabsf(scaled(j)));
        largest = warp_max(largest);
        const float inverse = largest > 0.0f ? kQueryCodeMax / largest : 0.0f;
        const float step = largest > 0.0f ? largest / kQueryCodeMax : 0.0f;
        float base = 0.0f, residual = 0.0f;
        for (uint32_t j = lane; j < d32; j += 32) {
          const float x = scaled(j);
          const int code = __float2int_rn(x * inverse);
          Q[r * d32 + j] = code;
          residual += (x - float(code) * step) * (float((1u << width[j]) - 1u) * 0.5f);
          base += qr[j] * (low[j] + 0.5f * cell[j]);  // padding: q = 0
        }
        base = warp_sum(base);
        residual = warp_sum(residual);
        if (lane == 0) {
          key_offset[r] = base + residual;
          key_step[r] = step;
        }
      }
      __syncthreads();
      const uint32_t words = d32 / 4;
      for (uint32_t i = tid; i < ROWS * words; i += kAttendThreads) {
        const uint32_t r = i / words, w = i % words;
        digits[i] = query_digit_words([&](uint32_t b) { return Q[r * d32 + 4 * w + b]; });
      }
      __syncthreads();
    }
    // Rows of whole words at an odd word stride (no bank conflicts across lanes); a row need not
    // start on a 4-byte boundary in the block, so each word joins two aligned loads.
    __device__ void stage(uint8_t *stage_k, const uint8_t *block, uint32_t t0, uint32_t n) const {
      const size_t first = s.layout.key_codes + size_t(t0) * row_bytes;
      auto *dst = reinterpret_cast<uint32_t *>(stage_k);
      for (uint32_t i = threadIdx.x; i < n * row_words; i += kAttendThreads) {
        const uint32_t t = i / row_words, k = i % row_words;
        const size_t at = first + size_t(t) * row_bytes + 4 * k;  // the last word may run 3 bytes into the values
        const auto *word = reinterpret_cast<const uint32_t *>(block + (at & ~size_t(3)));
        const uint32_t shift = uint32_t(at & 3u) * 8u, lo = __ldg(word);
        dst[t * row_stride + k] = shift ? (lo >> shift | __ldg(word + 1) << (32u - shift)) : lo;
      }
    }
    // Σ_j Q_rj·code_j over this warp's field groups of one token, exactly (|Σ| < 2^31: at most 256
    // channels of |Q| <= 127·256 and code <= 15), as a float per row.
    template <bool BF16>
    __device__ void score(const uint8_t *stage_k, uint32_t lane, uint32_t warp, float (&acc)[ROWS],
                          float (&)[ROWS]) const {
      const uint32_t *row = reinterpret_cast<const uint32_t *>(stage_k) + lane * row_stride;
      const uint32_t words = d32 / 4;
      int hi[ROWS] = {}, lo[ROWS] = {};
      for (uint32_t g = warp; g < groups; g += kParts) {
        const auto *desc = reinterpret_cast<const uint4 *>(group + g * kMixedGroupWords);
        const uint4 head = desc[0], shifts = desc[1], more = desc[2];  // mixed_group's words 0-3, 4-7, 8-11
        const uint32_t at = head.x >> 5;  // the window may reach into the next word (the stage has slack)
        const uint32_t window = uint32_t((uint64_t(row[at]) | uint64_t(row[at + 1]) << 32) >> (head.x & 31u));
        const uint32_t u[2] = {mixed_spread(window, shifts.x, shifts.y, shifts.z, head.z),
                               mixed_spread(window >> head.y, shifts.w, more.x, more.y, head.w)};
#pragma unroll
        for (uint32_t r = 0; r < ROWS; ++r)
#pragma unroll
          for (uint32_t k = 0; k < 2; ++k) {
            const uint2 digit = digits[r * words + 2 * g + k];
            hi[r] = __dp4a(int(u[k]), int(digit.x), hi[r]);
            lo[r] = __dp4a(int(u[k]), int(digit.y), lo[r]);
          }
      }
#pragma unroll
      for (uint32_t r = 0; r < ROWS; ++r) acc[r] = float(hi[r] * 256 + lo[r]);
    }
    __device__ float token_score(const uint8_t *, const uint8_t *, uint32_t r, uint32_t, uint32_t, float sum,
                                 float) const {
      return fmaf(sum, key_step[r], key_offset[r]);
    }
  };
};

}  // namespace qjlkv::cuda
