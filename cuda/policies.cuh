// The CUDA policy types of a layer's key and value methods, chosen once per launch on the host as
// with_methods (src/methods/methods.hpp) chooses the library's: the kernels are templates over
// them and never branch on a method.
#pragma once
#include "keys.cuh"
#include "values.cuh"

namespace qjlkv::cuda {

// f(Keys{}, Values{}) for the layer of `shape`.
template <class F>
auto with_policies(const KernelShape &shape, F &&f) {
  return with_key_policy(shape.key_method, [&](auto keys) {
    return with_value_policy(shape, [&](auto values) { return f(keys, values); });
  });
}

}  // namespace qjlkv::cuda
