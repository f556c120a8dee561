// Runtime choice of the CPU kernels: the best instruction set this CPU supports, or the one
// named by the environment variable QJLKV_CPU_ISA (scalar | avx2 | avx512 | avx512vnni), read when
// a cache is created. The float paths compute the same results within float tolerance;
// avx512vnni's integer kernels stay within SPEC §9's error budget (docs/DESIGN.md).
#pragma once
#include <cstdint>

namespace qjlkv::cpu {

enum class Isa : uint8_t { Scalar = 0, Avx2 = 1, Avx512 = 2, Avx512Vnni = 3 };

const char *isa_name(Isa isa);
// Whether this CPU (and this build) can run the kernels of `isa`.
bool isa_supported(Isa isa);
// The best supported ISA.
Isa best_isa();
// best_isa(), or QJLKV_CPU_ISA when set. Throws Error(INVALID_ARGUMENT) for an unknown name and
// Error(UNSUPPORTED) for an ISA this CPU lacks, naming the variable and its value.
Isa select_isa();

}  // namespace qjlkv::cpu
