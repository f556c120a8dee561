// The value policies of the CUDA backend, one per method in its home (src/methods/<method>/
// cuda_values.cuh; cuda/value_policy.cuh says what each provides), and with_value_policy, which maps
// a layer to its type once per launch on the host, so no kernel branches on the value method.
#pragma once
#include "../src/methods/lloyd_max_values/cuda_values.cuh"
#include "../src/methods/uniform_values/cuda_values.cuh"

namespace qjlkv::cuda {

// Calls f(Policy{}) with the policy of this layer's values (host dispatch of the launches): a
// method's registration on this backend.
template <class F>
auto with_value_policy(const KernelShape &s, F &&f) {
  switch (s.value_method) {
    case QJLKV_VALUES_ROTATED_LLOYD_MAX: return f(LloydMaxValues{});
    case QJLKV_VALUES_UNIFORM: break;
  }
  if (s.value_bits == 16) return f(Stored16Values{});
  return f(UniformValues{});
}

}  // namespace qjlkv::cuda

