// The CUDA policy of rotated Lloyd-Max values (cuda/value_policy.cuh says what a value policy
// provides).
#pragma once
#include "../../../cuda/value_policy.cuh"

namespace qjlkv::cuda {

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

}  // namespace qjlkv::cuda
