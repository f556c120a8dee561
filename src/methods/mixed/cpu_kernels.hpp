// The CPU row of mixed-bit keys (mixed_keys.hpp).
#pragma once
#include <cstddef>

#include "../../cpu/method_kernel_defaults.hpp"
#include "mixed_keys.hpp"

namespace qjlkv::cpu {

template <>
struct MethodKernels<MixedKeys> : KeyKernelDefaults {
  static void quantize(const CpuLayer &c, const float *keys, uint8_t *block, float *) {
    MixedKeys::quantize_block(c.spec.cfg, c.layer.layout, keys, block);
  }
  static void score(const CpuLayer &c, const uint8_t *block, const float *q, const float *, uint32_t rows, float *out,
                    size_t out_stride, float *scratch) {
    MixedKeys::score_block(c.spec.cfg, c.layer.layout, block, q, padded_dim(c.spec.cfg.head_dim), rows, out,
                           out_stride, scratch);
  }
};

}  // namespace qjlkv::cpu
