// The CPU row of mixed-bit keys (mixed_keys.hpp): the kernel table's `mixed` group (cpu_simd.inc;
// integer scores in cpu_avx2.inc and cpu_avx512_vnni.cpp).
#pragma once
#include <cstddef>

#include "../../cpu/method_kernel_defaults.hpp"
#include "mixed_keys.hpp"

namespace qjlkv::cpu {

template <>
struct MethodKernels<MixedKeys> : KeyKernelDefaults {
  static void prepare(const CacheSpec &spec, const LayerSpec &layer, const KernelTable &, LayerKernels &args) {
    args.keys = CodesArgs{&layer.layout, spec.cfg.block_tokens, spec.cfg.head_dim, 0, 0, spec.stored_dtype};
  }
  static void quantize(const CpuLayer &c, const float *keys, uint8_t *block, float *) {
    c.kernels.mixed.quantize(c.args.keys, keys, block);
  }
  static void score(const CpuLayer &c, const uint8_t *block, const float *q, const float *, uint32_t rows, float *out,
                    size_t out_stride, float *scratch) {
    c.kernels.mixed.scores(c.args.keys, block, q, rows, out, out_stride, scratch);
  }
};

// The avx512vnni group: the AVX-512 one with integer scores.
MixedKernels mixed_kernels_avx512_vnni(const MixedKernels &avx512);

}  // namespace qjlkv::cpu
