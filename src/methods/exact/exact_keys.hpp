// Exact keys (QJLKV_KEYS_EXACT): every key as a 16-bit number (fp16, or bf16 for bf16 inputs).
// Block: 16-bit [B][d] at key_codes.
#pragma once
#include <limits>

#include "../method.hpp"

namespace qjlkv {

struct ExactKeys : KeyMethodDefaults {
  static constexpr qjlkv_key_method kMethod = QJLKV_KEYS_EXACT;

  static void validate(const qjlkv_config &) {}
  static void layout(const qjlkv_config &cfg, const LayerSpec &, LayoutCursor &at, BlockLayout &l) {
    l.key_bytes_per_token_codes = 2 * size_t(cfg.head_dim);
    l.key_codes = at.take(cfg.block_tokens * l.key_bytes_per_token_codes);
  }
  // bf16 copies hold any finite float; fp16 ones |x| <= 65504.
  static float element_limit(const qjlkv_config &, qjlkv_dtype stored) {
    return stored == QJLKV_DTYPE_BF16 ? std::numeric_limits<float>::max() : kHalfMax;
  }
  template <class Check>
  static void check_stored(const CacheSpec &spec, const LayerSpec &layer, const uint8_t *, const Check &check) {
    check.halves(layer.layout.key_codes, size_t(spec.cfg.block_tokens) * spec.cfg.head_dim, false, spec.stored_dtype,
                 "the exact key");
  }
  static void dequantize_token(const CacheSpec &spec, const LayerSpec &layer, const uint8_t *block, uint32_t t,
                               float *out) {
    const uint32_t d = spec.cfg.head_dim;
    const uint16_t *keys = at<uint16_t>(block, layer.layout.key_codes) + size_t(t) * d;
    for (uint32_t j = 0; j < d; ++j) out[j] = from_16bit(keys[j], spec.stored_dtype);
  }
};

}  // namespace qjlkv
