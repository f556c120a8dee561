// The CPU entries of the key and value methods (src/methods/), kept out of their policy types so
// that those stay backend-neutral: per-layer kernel arguments, scratch sizes, and the fast kernels
// of the kernel table (simd.hpp) that each method names. MethodKernels<M> for a method type M;
// the CPU backend reaches them through kernels_of(method) inside with_methods.
#pragma once
#include <algorithm>

#include "../methods/methods.hpp"
#include "codec.hpp"
#include "kernels.hpp"

namespace qjlkv::cpu {

template <class Method>
struct MethodKernels;
template <class Method>
constexpr MethodKernels<Method> kernels_of(Method) {
  return {};
}

// What a key method without the feature does: no per-layer arguments, no quantize() scratch
// beyond the block's keys and values, no projected queries after the padded ones for score().
struct KeyKernelDefaults {
  static void prepare(const CacheSpec &, const LayerSpec &, const KernelTable &, LayerKernels &) {}
  static size_t quantize_scratch_floats(const qjlkv_config &) { return 0; }
  static size_t projected_query_floats(const LayerKernels &) { return 0; }
  static void project_queries(const CpuLayer &, const float *, uint32_t, float *) {}
};

// A value method's entries: its own column of the kernel table, chosen here once by the method's
// type, so that no kernel asks which method's block it reads.
template <ValueKernels KernelTable::*Column>
struct ValueKernelsOf {
  static const ValueKernels &entries(const KernelTable &kernels) { return kernels.*Column; }
  static void quantize(const CpuLayer &c, const float *values, uint8_t *block) {
    entries(c.kernels).quantize(c.args.values, values, block);
  }
  static void accumulate(const CpuLayer &c, const uint8_t *block, const float *w, size_t w_stride, uint32_t rows,
                         float *acc, float *scratch) {
    entries(c.kernels).accumulate(c.args.values, block, w, w_stride, rows, acc, scratch);
  }
  static void in_channel_order(const CpuLayer &c, uint32_t rows, float *acc) {
    entries(c.kernels).in_channel_order(c.args.values, rows, acc);
  }
};
template <>
struct MethodKernels<UniformValues> : ValueKernelsOf<&KernelTable::uniform_values> {};
template <>
struct MethodKernels<LloydMaxValues> : ValueKernelsOf<&KernelTable::lloyd_max_values> {};

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
    c.kernels.dense_scores(block + c.layer.layout.key_codes, c.spec.stored_dtype, cfg.head_dim, cfg.block_tokens,
                           cfg.head_dim, q, rows, out, out_stride);
  }
};

template <bool OTT>
struct MethodKernels<PerChannelKeys<OTT>> : KeyKernelDefaults {
  using Keys = PerChannelKeys<OTT>;
  static void prepare(const CacheSpec &spec, const LayerSpec &layer, const KernelTable &, LayerKernels &args) {
    args.keys = CodesArgs{&layer.layout, spec.cfg.block_tokens, spec.cfg.head_dim, spec.cfg.key_bits, 0,
                          spec.stored_dtype};
  }
  static void quantize(const CpuLayer &c, const float *keys, uint8_t *block, float *) {
    c.kernels.kivi_quantize(c.args.keys, keys, block);
  }
  // OTT's moved slots score -inf: their tokens are counted once, from the pool.
  static void score(const CpuLayer &c, const uint8_t *block, const float *q, const float *, uint32_t rows, float *out,
                    size_t out_stride, float *scratch) {
    c.kernels.kivi_scores(c.args.keys, block, q, rows, out, out_stride, scratch);
    if constexpr (OTT)
      for (uint32_t t = 0; t < c.spec.cfg.block_tokens; ++t)
        if (Keys::moved(c.layer.layout, block, t))
          for (uint32_t r = 0; r < rows; ++r) out[size_t(r) * out_stride + t] = kNegInf;
  }
};

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
    c.kernels.qjl_project(c.args.qjl, q, rows, sq);
  }
  static void score(const CpuLayer &c, const uint8_t *block, const float *q, const float *sq, uint32_t rows,
                    float *out, size_t out_stride, float *scratch) {
    c.kernels.qjl_scores(c.args.qjl, block, q, sq, rows, out, out_stride, scratch);
  }
};

}  // namespace qjlkv::cpu
