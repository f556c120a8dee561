// Rotated Lloyd-Max values (QJLKV_VALUES_ROTATED_LLOYD_MAX, docs/DESIGN.md): each token's value
// vector rotated by the layer's randomized Hadamard rotation, coded by the N(0,1) Lloyd-Max
// levels of value_bits bits with one fp16 scale per token (src/lloyd_max.hpp has the encoder).
// Attention sums the values rotated and rotates the sum back once (kRotated).
// Block: scale fp16[B], codes [B][d·value_bits/8].
#pragma once
#include <cmath>
#include <cstring>

#include "../../lloyd_max.hpp"
#include "../../rotation.hpp"
#include "../method.hpp"

namespace qjlkv {

struct LloydMaxValues : ValueMethodDefaults {
  static constexpr qjlkv_value_method kMethod = QJLKV_VALUES_ROTATED_LLOYD_MAX;
  static constexpr bool kRotated = true;
  static constexpr bool kSeeded = true;  // the rotation's signs

  static void validate(const qjlkv_config &cfg) {
    QJLKV_REQUIRE(cfg.value_bits >= 2 && cfg.value_bits <= 4,
                  "config.value_bits is %u, must be 2, 3 or 4 with config.value_method "
                  "QJLKV_VALUES_ROTATED_LLOYD_MAX",
                  cfg.value_bits);
  }
  // Every layer's rotation.
  // The reference quantizer of a block's B tokens: each token's rotated Lloyd-Max codes and scale.
  static void quantize_block(const qjlkv_config &cfg, qjlkv_dtype, const BlockLayout &layout, const float *value_signs,
                             const float *values, uint8_t *block) {
    const uint32_t B = cfg.block_tokens, d = cfg.head_dim;
    std::memset(block + layout.value_codes, 0, B * layout.value_bytes_per_token_codes);
    float y[256];
    for (uint32_t t = 0; t < B; ++t)
      lloyd_max_encode_token(value_signs, d, cfg.value_bits, values + size_t(t) * d, y,
                             block + layout.value_codes + t * layout.value_bytes_per_token_codes,
                             at<uint16_t>(block, layout.value_scale) + t);
  }
  // A decoded token is still rotated: back to the values' own channels.
  static void unrotate(const float *value_signs, uint32_t d, float *x) { rotate_inverse(value_signs, d, x, x); }
  static void init_layers(const qjlkv_config &cfg, std::vector<LayerSpec> &layers) {
    for (uint32_t l = 0; l < cfg.num_layers; ++l)
      layers[l].value_signs = value_rotation_signs(cfg.head_dim, cfg.seed, l);
  }
  static void layout(const qjlkv_config &cfg, LayoutCursor &at, BlockLayout &l) {
    const size_t B = cfg.block_tokens;
    l.value_bytes_per_token_codes = size_t(cfg.head_dim) * cfg.value_bits / 8;
    l.value_scale = at.take(2 * B);
    l.value_codes = at.take(B * l.value_bytes_per_token_codes);
  }
  // scale = ‖v‖ / ‖levels‖ with ‖levels‖ >= smallest |level|·sqrt(d): below this norm the fp16
  // scale stays finite.
  static double norm_limit(const qjlkv_config &cfg) {
    return double(kHalfMax) * lloyd_max_smallest_level(cfg.value_bits) * std::sqrt(double(cfg.head_dim));
  }
  [[noreturn]] static void fail_norm(const qjlkv_config &cfg, size_t vector, double norm) {
    fail(QJLKV_ERROR_INVALID_ARGUMENT,
         "values: the value vector of token %zu, kv head %zu has L2 norm %g > %g, which rotated Lloyd-Max values of "
         "%u bits cannot store (their per-token scale is fp16)",
         vector / cfg.num_kv_heads, vector % cfg.num_kv_heads, norm, norm_limit(cfg), cfg.value_bits);
  }
  // Any code is a level; the per-token scale is what the decoding multiplies by.
  template <class Check>
  static void check_stored(const CacheSpec &spec, const LayerSpec &layer, const uint8_t *, const Check &check) {
    check.halves(layer.layout.value_scale, spec.cfg.block_tokens, true, QJLKV_DTYPE_F16, "the rotated value scale");
  }
  // Token t's value as stored: still rotated.
  static void decode_token(const qjlkv_config &cfg, qjlkv_dtype, const BlockLayout &l, const uint8_t *block,
                           uint32_t t, float *out) {
    const uint32_t bits = cfg.value_bits;
    const float scale = half_to_float(at<uint16_t>(block, l.value_scale)[t]);
    const uint8_t *codes = block + l.value_codes + t * l.value_bytes_per_token_codes;
    for (uint32_t j = 0; j < cfg.head_dim; ++j) out[j] = lloyd_max_level(bits, unpack_code(codes, j, bits)) * scale;
  }
  // Decoded and rotated back.
  static void dequantize_token(const CacheSpec &spec, const LayerSpec &layer, const uint8_t *block, uint32_t t,
                               float *out) {
    decode_token(spec.cfg, spec.stored_dtype, layer.layout, block, t, out);
    rotate_inverse(layer.value_signs.data(), spec.cfg.head_dim, out, out);
  }
};

}  // namespace qjlkv
