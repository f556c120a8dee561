// Value policies: one type per way a block stores its values (uniform codes, 16-bit numbers,
// rotated Lloyd-Max codes), consumed by the append kernels (quantize) and the attention kernel
// (stage, decode); with_value_policy at the end maps a layer to its type, once per launch on the
// host, so no kernel branches on the value method.
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

// Per-token groups of value_group channels: code = clamp(rint((x − min16)/scale16)), fp16 scale
// and minimum per group; 2, 3, 4 or 8 bits.
struct UniformValues {
  static constexpr bool kRotated = false;

  template <bool BF16, class Source>
  __device__ static void quantize(const KernelShape &s, const Source &src, uint8_t *block) {
    const uint32_t tid = threadIdx.x, threads = blockDim.x, d = s.d, B = s.B, bits = s.value_bits;
    const uint32_t g = s.value_group, groups = d / g;
    auto *scales = reinterpret_cast<uint16_t *>(block + s.layout.value_scale);
    auto *mins = reinterpret_cast<uint16_t *>(block + s.layout.value_min);
    for (uint32_t i = tid; i < B * groups; i += threads) {
      const uint32_t t = i / groups, first = (i % groups) * g;
      float lo = src.value(t, first), hi = lo;
      for (uint32_t k = 1; k < g; ++k) group_minmax_step(src.value(t, first + k), lo, hi);
      const GroupQuant q = group_quant(lo, hi, bits);
      scales[i] = q.scale_bits;
      mins[i] = q.min_bits;
    }
    __syncthreads();  // the scales and minima written above are read back below (plain loads)
    const uint32_t eights = d / 8;
    for (uint32_t i = tid; i < B * eights; i += threads) {
      const uint32_t t = i / eights, g8 = i % eights;
      uint64_t packed = 0;
      for (uint32_t k = 0; k < 8; ++k) {
        const uint32_t j = 8 * g8 + k, group = t * groups + j / g;
        GroupQuant q{};
        q.scale = half_to_float(scales[group]);
        q.min = half_to_float(mins[group]);
        packed |= uint64_t(quant_code(src.value(t, j), q, bits)) << (k * bits);
      }
      store_codes8(block + s.layout.value_codes + t * s.layout.value_bytes_per_token_codes, g8, bits, packed);
    }
  }

  struct Decoder {
    const KernelShape &s;
    const AttendSmem &L;
    uint32_t slice, groups;
    uint32_t channel_group[kSliceChannels];
    bool one_group;
    __device__ Decoder(const KernelShape &shape, const AttendSmem &layout, uint8_t *, uint32_t slice_index)
        : s(shape), L(layout), slice(slice_index), groups(shape.d / shape.value_group) {
#pragma unroll
      for (uint32_t c = 0; c < kSliceChannels; ++c) channel_group[c] = (slice * kSliceChannels + c) / s.value_group;
      one_group = channel_group[0] == channel_group[kSliceChannels - 1];
    }
    __device__ void init() const {}
    __device__ void stage(uint8_t *stage_v, const uint8_t *block, uint32_t t0, uint32_t n) const {
      const uint32_t group_bytes = n * groups * 2;
      copy_words(stage_v + L.v_scale, block + s.layout.value_scale + t0 * groups * 2, group_bytes, kAttendThreads);
      copy_words(stage_v + L.v_min, block + s.layout.value_min + t0 * groups * 2, group_bytes, kAttendThreads);
      const uint32_t codes_bpt = uint32_t(s.layout.value_bytes_per_token_codes);
      copy_words(stage_v + L.v_codes, block + s.layout.value_codes + t0 * codes_bpt, n * codes_bpt, kAttendThreads);
    }
    template <bool BF16>
    __device__ void decode(const uint8_t *stage_v, uint32_t t, float (&v)[kSliceChannels]) const {
      const uint32_t bits = s.value_bits, mask = (1u << bits) - 1u;
      const uint32_t codes_bpt = uint32_t(s.layout.value_bytes_per_token_codes);
      const uint64_t codes = load_codes8(stage_v + L.v_codes + t * codes_bpt + slice * bits, bits);
      const auto *scale16 = reinterpret_cast<const uint16_t *>(stage_v + L.v_scale) + t * groups;
      const auto *min16 = reinterpret_cast<const uint16_t *>(stage_v + L.v_min) + t * groups;
      float scale = 0.0f, minimum = 0.0f;
      if (one_group) {
        scale = fp16_bits_to_float(scale16[channel_group[0]]);
        minimum = fp16_bits_to_float(min16[channel_group[0]]);
      }
#pragma unroll
      for (uint32_t c = 0; c < kSliceChannels; ++c) {
        const uint32_t code = uint32_t(codes >> (c * bits)) & mask;
        if (!one_group) {
          scale = fp16_bits_to_float(scale16[channel_group[c]]);
          minimum = fp16_bits_to_float(min16[channel_group[c]]);
        }
        v[c] = fmaf(code_to_float(code), scale, minimum);  // x̂ = code·scale + min
      }
    }
  };
};

// The uniform method's value_bits = 16: fp16 (bf16 for bf16 inputs) numbers, [B][d].
struct Stored16Values {
  static constexpr bool kRotated = false;

  template <bool BF16, class Source>
  __device__ static void quantize(const KernelShape &s, const Source &src, uint8_t *block) {
    auto *dst = reinterpret_cast<uint16_t *>(block + s.layout.value_codes);
    for (uint32_t i = threadIdx.x; i < s.B * s.d; i += blockDim.x)
      dst[i] = float_to_stored16<BF16>(src.value(i / s.d, i % s.d));
  }

  struct Decoder {
    const KernelShape &s;
    uint32_t slice;
    __device__ Decoder(const KernelShape &shape, const AttendSmem &, uint8_t *, uint32_t slice_index)
        : s(shape), slice(slice_index) {}
    __device__ void init() const {}
    __device__ void stage(uint8_t *stage_v, const uint8_t *block, uint32_t t0, uint32_t n) const {
      copy_words(stage_v, block + s.layout.value_codes + size_t(t0) * 2 * s.d, n * 2 * s.d, kAttendThreads);
    }
    template <bool BF16>
    __device__ void decode(const uint8_t *stage_v, uint32_t t, float (&v)[kSliceChannels]) const {
      unpack8_16bit<BF16>(stage_v + (size_t(t) * s.d + slice * kSliceChannels) * 2, v);
    }
  };
};

// Rotated Lloyd-Max values: per token, the codes of y = H·diag(s)·x (2, 3 or 4 bits) and one fp16
// scale; decoded as level(code)·scale, still rotated.
struct LloydMaxValues {
  static constexpr bool kRotated = true;

  // lloyd_max_encode_token (lloyd_max.hpp) with one warp per token: lane l holds channels
  // [8l, 8l + 8) (head_dim <= 256; d is a multiple of 8, so a lane's channels lie in one rotation
  // block), the butterflies of stride >= 8 pair lanes l and l ^ (stride/8) (shuffles), and the
  // two sums the CPU takes in channel order (‖y‖², Σ level²) pass their running value from lane to
  // lane in that order: the same fp32 operations, so the same bytes.
  template <bool BF16, class Source>
  __device__ static void quantize(const KernelShape &s, const Source &src, uint8_t *block) {
    const uint32_t d = s.d, bits = s.value_bits, lane = threadIdx.x & 31u, lanes = d / 8, first = 8 * lane;
    const bool active = lane < lanes;
    uint32_t start = 0, n = rotation_block(d, 0);  // this lane's rotation block [start, start + n)
    while (active && first >= start + n) {
      start += n;
      n = rotation_block(d, start);
    }
    const float block_norm = float(1.0 / sqrt(double(n)));
    const float sqrt_d = sqrtf(float(d));
    float sign[8];
#pragma unroll
    for (uint32_t c = 0; c < 8; ++c) sign[c] = active ? s.value_signs[first + c] : 0.0f;
    // The sum over the channels in order of f(c) (this lane's 8 terms), in every lane.
    const auto ordered_sum = [&](auto term) {
      float running = 0.0f;
      for (uint32_t from = 0; from < lanes; ++from) {
        float mine = running;
        if (lane == from)
#pragma unroll
          for (uint32_t c = 0; c < 8; ++c) mine += term(c);
        running = __shfl_sync(0xffffffffu, mine, from);
      }
      return running;
    };
    auto *scales = reinterpret_cast<uint16_t *>(block + s.layout.value_scale);
    for (uint32_t t = threadIdx.x / 32; t < s.B; t += blockDim.x / 32) {
      float y[8];
#pragma unroll
      for (uint32_t c = 0; c < 8; ++c) y[c] = active ? sign[c] * src.value(t, first + c) : 0.0f;
#pragma unroll
      for (uint32_t h = 1; h < 8; h *= 2)  // n >= 8
#pragma unroll
        for (uint32_t i = 0; i < 8; i += 2 * h)
#pragma unroll
          for (uint32_t j = i; j < i + h; ++j) {
            const float a = y[j], b = y[j + h];
            y[j] = a + b;
            y[j + h] = a - b;
          }
      for (uint32_t h = 8; h < d; h *= 2) {  // every lane shuffles; pairs inside a block of n > h combine
        const uint32_t partner = h / 8;
        const bool upper = (lane & partner) != 0;
#pragma unroll
        for (uint32_t c = 0; c < 8; ++c) {
          const float other = __shfl_xor_sync(0xffffffffu, y[c], int(partner));
          if (h < n) y[c] = upper ? other - y[c] : y[c] + other;
        }
      }
#pragma unroll
      for (uint32_t c = 0; c < 8; ++c) y[c] *= block_norm;
      const float norm = sqrtf(ordered_sum([&](uint32_t c) { return y[c] * y[c]; }));
      if (norm == 0.0f) {  // codes 0 (the block is zeroed), scale 0: decodes to zeros
        if (lane == 0) scales[t] = 0;
        continue;
      }
      uint32_t code[8];
      uint64_t packed = 0;
#pragma unroll
      for (uint32_t c = 0; c < 8; ++c) {
        code[c] = lloyd_max_code(y[c] / norm * sqrt_d, bits);
        packed |= uint64_t(code[c]) << (c * bits);
      }
      if (active) store_codes8(block + s.layout.value_codes + t * s.layout.value_bytes_per_token_codes, lane, bits, packed);
      const float level_norm2 = ordered_sum([&](uint32_t c) {
        const float level = lloyd_max_level(bits, code[c]);
        return level * level;
      });
      if (lane == 0) scales[t] = float_to_half(norm / sqrtf(level_norm2));
    }
  }

  struct Decoder {
    const KernelShape &s;
    const AttendSmem &L;
    float *levels;  // shared: [kMaxLevels]
    uint32_t slice;
    __device__ Decoder(const KernelShape &shape, const AttendSmem &layout, uint8_t *smem, uint32_t slice_index)
        : s(shape), L(layout), levels(reinterpret_cast<float *>(smem + layout.levels)), slice(slice_index) {}
    __device__ void init() const {
      if (threadIdx.x < kMaxLevels) levels[threadIdx.x] = lloyd_max_level(s.value_bits, threadIdx.x);
    }
    __device__ void stage(uint8_t *stage_v, const uint8_t *block, uint32_t t0, uint32_t n) const {
      // n is a multiple of 8: 2n scale bytes are whole words.
      copy_words(stage_v + L.v_scale, block + s.layout.value_scale + t0 * 2, n * 2, kAttendThreads);
      const uint32_t codes_bpt = uint32_t(s.layout.value_bytes_per_token_codes);
      copy_words(stage_v + L.v_codes, block + s.layout.value_codes + t0 * codes_bpt, n * codes_bpt, kAttendThreads);
    }
    template <bool BF16>
    __device__ void decode(const uint8_t *stage_v, uint32_t t, float (&v)[kSliceChannels]) const {
      const uint32_t bits = s.value_bits, mask = (1u << bits) - 1u;
      const uint32_t codes_bpt = uint32_t(s.layout.value_bytes_per_token_codes);
      const uint64_t codes = load_codes8(stage_v + L.v_codes + t * codes_bpt + slice * bits, bits);
      const float scale = fp16_bits_to_float(reinterpret_cast<const uint16_t *>(stage_v + L.v_scale)[t]);
#pragma unroll
      for (uint32_t c = 0; c < kSliceChannels; ++c) v[c] = levels[uint32_t(codes >> (c * bits)) & mask] * scale;
    }
  };
};

// Calls f(Policy{}) with the policy of this layer's values (host dispatch of the launches): a
// method's registration on this backend.
template <class F>
auto with_value_policy(const KernelShape &s, F &&f) {
  switch (s.value_method) {
    case QJLKV_VALUES_ROTATED_LLOYD_MAX: return f(LloydMaxValues{});
    case QJLKV_VALUES_UNIFORM: break;
  }
  if (s.value_bits == 16) return f(Stored16Values{});
  return f(UniformValues{});
}

}  // namespace qjlkv::cuda
