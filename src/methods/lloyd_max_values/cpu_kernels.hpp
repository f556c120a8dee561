// The CPU row of rotated Lloyd-Max values (lloyd_max_values.hpp): the kernel table's
// `lloyd_max_values` group, whose avx512vnni entries cpu_avx512_vnni.cpp builds.
#pragma once

#include "../../cpu/method_kernel_defaults.hpp"
#include "lloyd_max_values.hpp"

namespace qjlkv::cpu {

template <>
struct MethodKernels<LloydMaxValues> : ValueKernelsOf<&KernelTable::lloyd_max_values> {};

// The avx512vnni group: the AVX-512 one with integer value sums.
ValueKernels lloyd_max_value_kernels_avx512_vnni(const ValueKernels &avx512);

}  // namespace qjlkv::cpu
