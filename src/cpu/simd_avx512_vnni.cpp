// The AVX-512 table with integer decode paths (VNNI vpdpbusd/vpdpwssd, VBMI vpermb/vpmultishiftqb):
// QJL, KIVI/OTT and mixed-bit key scores and rotated Lloyd-Max and uniform value sums in integers, each
// method's kernels in its src/methods/<method>/cpu_avx512_vnni.cpp, within the error budget of
// SPEC §9 (docs/DESIGN.md, "Integer decode paths"). Every other kernel is the AVX-512 one.
#include "method_kernels.hpp"
#include "simd.hpp"

namespace qjlkv::cpu {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
const KernelTable &avx512_vnni_kernels() {
  static const KernelTable table = [] {
    KernelTable t = avx512_kernels();
    t.isa = Isa::Avx512Vnni;
    t.qjl = qjl_kernels_avx512_vnni(t.qjl);
    t.kivi = kivi_kernels_avx512_vnni(t.kivi);
    t.mixed = mixed_kernels_avx512_vnni(t.mixed);
    t.uniform_values = uniform_value_kernels_avx512_vnni(t.uniform_values);
    t.lloyd_max_values = lloyd_max_value_kernels_avx512_vnni(t.lloyd_max_values);
    return t;
  }();
  return table;
}
#else  // not x86-64: never selected (isa_supported is false)
const KernelTable &avx512_vnni_kernels() { return scalar_kernels(); }
#endif
}  // namespace qjlkv::cpu
