// The key and value methods of a configuration, as their policy types (method.hpp says what each
// provides). Adding a method: its folder here, one line in the visitor here, its enum value in
// qjlkv.h, and its CUDA policy in its folder, listed by cuda/keys.cuh or cuda/values.cuh
// (docs/DESIGN.md).
#pragma once
#include "exact/exact_keys.hpp"
#include "kivi/kivi_keys.hpp"
#include "lloyd_max_values/lloyd_max_values.hpp"
#include "mixed/mixed_keys.hpp"
#include "qjl/qjl_keys.hpp"
#include "uniform_values/uniform_values.hpp"

namespace qjlkv {

// fn(Keys{}) with the key method's policy type; `method` is a validated qjlkv_key_method.
template <class Fn>
decltype(auto) with_key_method(uint32_t method, Fn &&fn) {
  switch (static_cast<qjlkv_key_method>(method)) {
    case QJLKV_KEYS_QJL: return fn(QjlKeys{});
    case QJLKV_KEYS_KIVI: return fn(KiviKeys{});
    case QJLKV_KEYS_OTT: return fn(OttKeys{});
    case QJLKV_KEYS_EXACT: return fn(ExactKeys{});
    case QJLKV_KEYS_MIXED: return fn(MixedKeys{});
  }
  unreachable();
}

// fn(Values{}) with the value method's policy type; `method` is a validated qjlkv_value_method.
template <class Fn>
decltype(auto) with_value_method(uint32_t method, Fn &&fn) {
  switch (static_cast<qjlkv_value_method>(method)) {
    case QJLKV_VALUES_UNIFORM: return fn(UniformValues{});
    case QJLKV_VALUES_ROTATED_LLOYD_MAX: return fn(LloydMaxValues{});
  }
  unreachable();
}

// Both methods of a validated configuration at once: fn(Keys{}, Values{}).
template <class Fn>
decltype(auto) with_methods(const qjlkv_config &cfg, Fn &&fn) {
  return with_key_method(cfg.key_method,
                         [&](auto keys) { return with_value_method(cfg.value_method, [&](auto values) {
                                            return fn(keys, values);
                                          }); });
}

// The largest L2 norm of one key (value) vector that the configuration can store, 0 when any
// finite vector within the element limits can; and the INVALID_ARGUMENT for vector `vector`
// (token vector / Hkv, kv head vector % Hkv) whose norm exceeds it. Both backends' appends and
// the import's checks use these.
inline double key_norm_limit(const qjlkv_config &cfg) {
  return with_key_method(cfg.key_method, [&](auto keys) { return keys.norm_limit(cfg); });
}
inline double value_norm_limit(const qjlkv_config &cfg) {
  return with_value_method(cfg.value_method, [&](auto values) { return values.norm_limit(cfg); });
}
[[noreturn]] inline void fail_key_norm(const qjlkv_config &cfg, size_t vector, double norm) {
  with_key_method(cfg.key_method, [&](auto keys) { keys.fail_norm(cfg, vector, norm); });
  unreachable();
}
[[noreturn]] inline void fail_value_norm(const qjlkv_config &cfg, size_t vector, double norm) {
  with_value_method(cfg.value_method, [&](auto values) { values.fail_norm(cfg, vector, norm); });
  unreachable();
}

}  // namespace qjlkv
