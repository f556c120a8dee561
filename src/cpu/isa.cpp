#include "isa.hpp"

#include <cstdlib>
#include <cstring>

#include "../error.hpp"

namespace qjlkv::cpu {

const char *isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
    default: return "scalar";
  }
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return true;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    // The AVX2 kernels also use FMA and F16C; the AVX-512 ones F, BW, DQ and VL.
    case Isa::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::Avx512:
      return isa_supported(Isa::Avx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#endif
    default: return false;
  }
}

Isa best_isa() {
  for (Isa isa : {Isa::Avx512, Isa::Avx2})
    if (isa_supported(isa)) return isa;
  return Isa::Scalar;
}

Isa select_isa() {
  const char *forced = std::getenv("QJLKV_CPU_ISA");
  if (!forced || !*forced) return best_isa();
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512}) {
    if (std::strcmp(forced, isa_name(isa)) != 0) continue;
    if (!isa_supported(isa))
      fail(QJLKV_ERROR_UNSUPPORTED, "QJLKV_CPU_ISA is \"%s\", but this CPU (or build) cannot run the %s kernels",
           forced, isa_name(isa));
    return isa;
  }
  fail(QJLKV_ERROR_INVALID_ARGUMENT, "QJLKV_CPU_ISA is \"%.32s\", must be scalar, avx2 or avx512 (or unset)", forced);
}

}  // namespace qjlkv::cpu
