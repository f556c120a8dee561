// The key policies of the CUDA backend, one per method in its home (src/methods/<method>/
// cuda_keys.cuh; cuda/key_policy.cuh says what each provides), and with_key_policy, which maps a
// method to its type once per launch on the host, so no kernel branches on a method.
#pragma once
#include "../src/methods/exact/cuda_keys.cuh"
#include "../src/methods/kivi/cuda_keys.cuh"
#include "../src/methods/mixed/cuda_keys.cuh"
#include "../src/methods/qjl/cuda_keys.cuh"

namespace qjlkv::cuda {

// Calls f(Policy{}) with the policy of this key method (host dispatch of the launches): a method's
// registration on this backend.
template <class F>
auto with_key_policy(qjlkv_key_method method, F &&f) {
  switch (method) {
    case QJLKV_KEYS_KIVI: return f(KiviKeys{});
    case QJLKV_KEYS_OTT: return f(OttKeys{});
    case QJLKV_KEYS_EXACT: return f(ExactKeys{});
    case QJLKV_KEYS_MIXED: return f(MixedKeys{});
    case QJLKV_KEYS_QJL: break;
  }
  return f(QjlKeys{});
}

}  // namespace qjlkv::cuda

