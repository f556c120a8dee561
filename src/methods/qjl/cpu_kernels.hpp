// The CPU row of QJL keys (qjl_keys.hpp): the layer's transposed sketch, the quantizer
// (cpu_kernels.cpp) and the kernel table's `qjl` group, whose avx512vnni entries
// cpu_avx512_vnni.cpp builds.
#pragma once
#include <algorithm>
#include <cstddef>

#include "../../cpu/method_kernel_defaults.hpp"
#include "qjl_keys.hpp"

namespace qjlkv::cpu {

template <>
struct MethodKernels<QjlKeys> : KeyKernelDefaults {
  // The transposed sketch and the fast kernels' arguments.
  static void prepare(const CacheSpec &spec, const LayerSpec &layer, const KernelTable &kernels, LayerKernels &args);
  // Inlier keys [B][d], outlier keys [B][c], channel energies [d] and order [d], outlier bits
  // [B][m_out/8], nibble tables [sketch_rows/4][16] of 4 int64 and their alignment (the largest
  // m, m_out of any layer).
  static size_t quantize_scratch_floats(const qjlkv_config &cfg) {
    const size_t B = cfg.block_tokens, d = cfg.head_dim;
    const size_t m_out = std::max(cfg.outlier_sketch_dim, cfg.initial_layers ? cfg.initial_outlier_sketch_dim : 0u);
    const size_t m = std::max(cfg.key_sketch_dim, cfg.initial_layers ? cfg.initial_key_sketch_dim : 0u);
    const size_t table_floats = cfg.outlier_channels ? 32 * std::max(m, m_out) + 1 : 0;
    return B * d + B * cfg.outlier_channels + 2 * d + B * m_out / 32 + table_floats;
  }
  // qjl_quantize_block with the projections by the fast kernels (the same bits).
  static void quantize(const CpuLayer &c, const float *keys, uint8_t *block, float *scratch);
  static size_t projected_query_floats(const LayerKernels &args) { return args.qjl.projected_stride; }
  static void project_queries(const CpuLayer &c, const float *q, uint32_t rows, float *sq) {
    c.kernels.qjl.project(c.args.qjl, q, rows, sq);
  }
  static void score(const CpuLayer &c, const uint8_t *block, const float *q, const float *sq, uint32_t rows,
                    float *out, size_t out_stride, float *scratch) {
    c.kernels.qjl.scores(c.args.qjl, block, q, sq, rows, out, out_stride, scratch);
  }
};

// The avx512vnni group: the AVX-512 one with integer projections and scores.
QjlKernels qjl_kernels_avx512_vnni(const QjlKernels &avx512);

}  // namespace qjlkv::cpu
