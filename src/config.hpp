// Presets, validation and the quantities derived from a configuration.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

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

// Byte layout of one quantized block of one kv head: keys then values, each a few arrays.
// 16-bit arrays come first so every array stays 2-byte aligned; the stride is padded to 8.
struct BlockLayout {
  // keys
  size_t key_norm_in = 0, key_norm_out = 0;  // QJL: fp16[B] each
  size_t key_corrections = 0;                // QJL: fp16[c][B], the outlier corrections τ
  size_t key_bits_in = 0;                    // QJL: [B][m/8]
  size_t key_outlier_idx = 0;                // QJL: uint8[c]
  size_t key_scale = 0, key_min = 0;         // KIVI/OTT: fp16[d] each
  size_t key_codes = 0;                      // KIVI/OTT: [B][d*key_bits/8]; EXACT: 16-bit[B][d]
  size_t key_mask = 0;                       // OTT: [B/8] bit t set = slot t moved to the pool
  size_t key_bytes_per_token_bits_in = 0, key_bytes_per_token_codes = 0;
  // values
  size_t value_scale = 0, value_min = 0;     // fp16[B][d/g] each (b-bit values); rotated Lloyd-Max:
                                             // value_scale fp16[B], no minima
  size_t value_codes = 0;                    // [B][d*b/8], or 16-bit[B][d] when value_bits == 16
  size_t value_bytes_per_token_codes = 0;
  size_t key_bytes = 0, value_bytes = 0;     // unpadded sizes: statistics, export records, prefetching
  size_t values_offset = 0;                  // where the values' arrays start (keys start at 0)
  size_t stride = 0;                         // bytes of one block of one head
};

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
