// The CPU row of uniform values (uniform_values.hpp): the kernel table's `uniform_values` group,
// whose avx512vnni entries cpu_avx512_vnni.cpp builds.
#pragma once

#include "../../cpu/method_kernel_defaults.hpp"
#include "uniform_values.hpp"

namespace qjlkv::cpu {

template <>
struct MethodKernels<UniformValues> : ValueKernelsOf<&KernelTable::uniform_values> {};

// The avx512vnni group: the AVX-512 one with integer value sums.
ValueKernels uniform_value_kernels_avx512_vnni(const ValueKernels &avx512);

}  // namespace qjlkv::cpu
