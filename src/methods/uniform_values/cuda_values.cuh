// The CUDA policies of uniform values (cuda/value_policy.cuh says what a value policy provides).
#pragma once
#include "../../../cuda/value_policy.cuh"

namespace qjlkv::cuda {

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

}  // namespace qjlkv::cuda
