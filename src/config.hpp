// Presets, validation and the quantities derived from a configuration.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "block_layout.hpp"
#include "qjlkv/qjlkv.h"
#include "rotation.hpp"
#include "sketch.hpp"

namespace qjlkv {

// The struct_size rule of qjlkv.h ("Growing structs") for qjlkv_config.
// A complete config from a caller's (possibly older, smaller) one: fields beyond its struct_size
// take their defaults; a 0.1-sized config's `device` becomes backend + device_ordinal. Throws on a
// struct_size no release shipped.
qjlkv_config complete_config(const qjlkv_config &cfg);
// Writes the first dst.struct_size bytes of the complete config src into dst (0.1-sized: with
// 0.1's `device`). Throws, writing nothing, on a struct_size no release shipped.
void write_caller_config(qjlkv_config &dst, const qjlkv_config &src);

// The enum fields of a validated config as their enums (validation checked their range, so the
// conversion is defined); switches use these, so that -Wswitch covers every enumerator.
inline qjlkv_dtype dtype_of(const qjlkv_config &validated) { return static_cast<qjlkv_dtype>(validated.dtype); }
inline qjlkv_key_method key_method_of(const qjlkv_config &validated) {
  return static_cast<qjlkv_key_method>(validated.key_method);
}
inline qjlkv_backend backend_of(const qjlkv_config &validated) {
  return static_cast<qjlkv_backend>(validated.backend);
}

void init_preset(qjlkv_config &cfg, const char *preset, uint32_t num_layers, uint32_t num_q_heads,
                 uint32_t num_kv_heads, uint32_t head_dim);
// Throws Error(INVALID_ARGUMENT) naming the first wrong field.
void validate_config(const qjlkv_config &cfg);

size_t dtype_size(qjlkv_dtype dtype);

// Everything a backend needs about one layer.
struct LayerSpec {
  uint32_t sketch_rows = 0;   // max(m, m_out)
  uint32_t m = 0, m_out = 0;  // m_out is 0 when there are no outlier channels
  bool traced = false;        // OTT tracing active in this layer
  std::unique_ptr<qjlkv_sketch> sketch;
  BlockLayout layout;
  std::vector<float> value_signs;  // rotated Lloyd-Max values: the rotation's s (rotation.hpp)
};

struct CacheSpec {
  qjlkv_config cfg{};             // with the fields of other key methods zeroed: backends never see them
  qjlkv_config created_with{};    // what the caller passed (qjlkv_cache_config returns it)
  uint32_t group_size = 1;        // Hq / Hkv
  size_t io_elem = 4;             // bytes of one input/output element
  qjlkv_dtype stored_dtype{};     // full-precision storage: tails, pools, EXACT blocks (16-bit)
  size_t tail_elem = 4;           // bytes of one tail element (input dtype)
  float qjl_constant = 0.0f;      // c_d
  // The largest |x| accepted in keys / values: kHalfMax where something derived from them
  // (norms, scales, minima, 16-bit copies) is stored as fp16, else kSummableMax for values
  // (attention sums up to 2^32 of them in float) and FLT_MAX for keys (logit overflow is
  // refused at attend).
  float key_limit = 65504.0f, value_limit = 65504.0f;
  std::vector<LayerSpec> layers;
};

// 2^95: a weighted sum of up to 2^32 values of at most this magnitude stays below FLT_MAX.
inline constexpr float kSummableMax = 0x1p95f;

// Throws INVALID_ARGUMENT for element `index` of keys/values/queries, whose value x is not finite
// or exceeds `limit`, with a message that names the tensor, the element and the rule broken.
[[noreturn]] void fail_bad_element(const char *name, size_t index, float x, float limit);

// Validates cfg and derives the spec; builds every layer's sketch.
CacheSpec make_cache_spec(const qjlkv_config &cfg);

}  // namespace qjlkv
