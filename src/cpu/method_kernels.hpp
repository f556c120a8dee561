// The CPU entries of the key and value methods, one row per method in its
// src/methods/<method>/cpu_kernels.hpp, kept out of the policy types so that those stay
// backend-neutral: per-layer kernel arguments, scratch sizes, and the group of the kernel table
// (simd.hpp) that each method's kernels fill. MethodKernels<M> for a method type M; the CPU
// backend reaches them through kernels_of(method) inside with_methods.
#pragma once
#include "../methods/exact/cpu_kernels.hpp"
#include "../methods/kivi/cpu_kernels.hpp"
#include "../methods/lloyd_max_values/cpu_kernels.hpp"
#include "../methods/methods.hpp"
#include "../methods/mixed/cpu_kernels.hpp"
#include "../methods/qjl/cpu_kernels.hpp"
#include "../methods/uniform_values/cpu_kernels.hpp"
