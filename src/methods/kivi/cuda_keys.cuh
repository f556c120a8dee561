// The CUDA policies of KIVI and OTT keys (cuda/key_policy.cuh says what a key policy provides).
#pragma once
#include "../../../cuda/key_policy.cuh"

namespace qjlkv::cuda {

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
        digits[i] = query_digit_words([&](uint32_t b) { return Q[r * d32 + kivi_unpacked_channel(bits, w / per_group, w % per_group, b)]; });
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

}  // namespace qjlkv::cuda
