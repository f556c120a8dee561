// The CPU row of exact keys (exact_keys.hpp): the kernel table's dense kernels on the 16-bit keys.
#pragma once
#include <cstddef>

#include "../../cpu/method_kernel_defaults.hpp"
#include "exact_keys.hpp"

namespace qjlkv::cpu {

template <>
struct MethodKernels<ExactKeys> : KeyKernelDefaults {
  static void quantize(const CpuLayer &c, const float *keys, uint8_t *block, float *) {
    const qjlkv_config &cfg = c.spec.cfg;
    c.kernels.store_16bit(keys, size_t(cfg.block_tokens) * cfg.head_dim, c.spec.stored_dtype,
                          at<uint16_t>(block, c.layer.layout.key_codes));
  }
  static void score(const CpuLayer &c, const uint8_t *block, const float *q, const float *, uint32_t rows, float *out,
                    size_t out_stride, float *) {
    const qjlkv_config &cfg = c.spec.cfg;
    prefetch_next_block(c.layer.layout, block, c.layer.layout.key_bytes);  // dense_scores has no layout
    c.kernels.dense.scores(block + c.layer.layout.key_codes, c.spec.stored_dtype, cfg.head_dim, cfg.block_tokens,
                           cfg.head_dim, q, rows, out, out_stride);
  }
};

}  // namespace qjlkv::cpu
