// The CUDA policy of exact keys (cuda/key_policy.cuh says what a key policy provides).
#pragma once
#include "../../../cuda/key_policy.cuh"

namespace qjlkv::cuda {

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

}  // namespace qjlkv::cuda
