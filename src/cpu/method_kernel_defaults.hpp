// What the CPU rows of the key and value methods (src/methods/<method>/cpu_kernels.hpp) build on:
// the MethodKernels template, the entries a key method without a feature takes, and a value
// method's entries as its group of the kernel table.
#pragma once
#include <cstddef>
#include <cstdint>

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

}  // namespace qjlkv::cpu
