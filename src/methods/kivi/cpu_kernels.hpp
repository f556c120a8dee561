// The CPU row of KIVI and OTT keys (kivi_keys.hpp): the kernel table's `kivi` group, whose
// avx512vnni entries cpu_avx512_vnni.cpp builds.
#pragma once
#include <cstdint>

#include "../../cpu/method_kernel_defaults.hpp"
#include "kivi_keys.hpp"

namespace qjlkv::cpu {

template <bool OTT>
struct MethodKernels<PerChannelKeys<OTT>> : KeyKernelDefaults {
  using Keys = PerChannelKeys<OTT>;
  static void prepare(const CacheSpec &spec, const LayerSpec &layer, const KernelTable &, LayerKernels &args) {
    args.keys = CodesArgs{&layer.layout, spec.cfg.block_tokens, spec.cfg.head_dim, spec.cfg.key_bits, 0,
                          spec.stored_dtype};
  }
  static void quantize(const CpuLayer &c, const float *keys, uint8_t *block, float *) {
    c.kernels.kivi.quantize(c.args.keys, keys, block);
  }
  // OTT's moved slots score -inf: their tokens are counted once, from the pool.
  static void score(const CpuLayer &c, const uint8_t *block, const float *q, const float *, uint32_t rows, float *out,
                    size_t out_stride, float *scratch) {
    c.kernels.kivi.scores(c.args.keys, block, q, rows, out, out_stride, scratch);
    if constexpr (OTT)
      for (uint32_t t = 0; t < c.spec.cfg.block_tokens; ++t)
        if (Keys::moved(c.layer.layout, block, t))
          for (uint32_t r = 0; r < rows; ++r) out[size_t(r) * out_stride + t] = kNegInf;
  }
};

// The avx512vnni group: the AVX-512 one with integer scores.
KiviKernels kivi_kernels_avx512_vnni(const KiviKernels &avx512);

}  // namespace qjlkv::cpu
