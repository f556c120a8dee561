// Uniform per-token values (QJLKV_VALUES_UNIFORM, SPEC §4): groups of value_group_size channels
// of one token, each with an fp16 scale and minimum and value_bits codes; value_bits = 16 stores
// every value as a 16-bit number instead (fp16, or bf16 for bf16 inputs).
// Block: scale fp16[B][d/g], min fp16[B][d/g], codes [B][d·value_bits/8]; or 16-bit [B][d].
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../method.hpp"

namespace qjlkv {

struct UniformValues : ValueMethodDefaults {
  static constexpr qjlkv_value_method kMethod = QJLKV_VALUES_UNIFORM;
  static constexpr bool kRotated = false;

  static void validate(const qjlkv_config &cfg) {
    const uint32_t b = cfg.value_bits;
    QJLKV_REQUIRE(b == 2 || b == 3 || b == 4 || b == 8 || b == 16, "config.value_bits is %u, must be 2, 3, 4, 8 or 16",
                  b);
    QJLKV_REQUIRE(cfg.value_group_size >= 1 && cfg.head_dim % cfg.value_group_size == 0,
                  "config.value_group_size is %u, must divide head_dim (%u)", cfg.value_group_size, cfg.head_dim);
  }
  static void copy_fields(const qjlkv_config &from, qjlkv_config &to) { to.value_group_size = from.value_group_size; }
  static void layout(const qjlkv_config &cfg, LayoutCursor &at, BlockLayout &l) {
    const size_t B = cfg.block_tokens, d = cfg.head_dim;
    if (cfg.value_bits == 16) {
      l.value_bytes_per_token_codes = 2 * d;
    } else {
      const size_t groups = d / cfg.value_group_size;
      l.value_bytes_per_token_codes = d * cfg.value_bits / 8;
      l.value_scale = at.take(2 * B * groups);
      l.value_min = at.take(2 * B * groups);
    }
    l.value_codes = at.take(B * l.value_bytes_per_token_codes);
  }
  // 16-bit copies in bf16 hold any float whose sums stay finite; everything else is fp16.
  static float element_limit(const qjlkv_config &cfg, qjlkv_dtype stored) {
    return cfg.value_bits == 16 && stored == QJLKV_DTYPE_BF16 ? kSummableMax : kHalfMax;
  }
  // Any code is valid; 16-bit values in bf16 stay within the element limit.
  template <class Check>
  static void check_stored(const CacheSpec &spec, const LayerSpec &layer, const uint8_t *block, const Check &check) {
    const qjlkv_config &cfg = spec.cfg;
    const BlockLayout &l = layer.layout;
    const size_t B = cfg.block_tokens, d = cfg.head_dim;
    if (cfg.value_bits == 16) {
      check.halves(l.value_codes, B * d, false, spec.stored_dtype, "the exact value");
      if (spec.stored_dtype == QJLKV_DTYPE_BF16)
        for (size_t i = 0; i < B * d; ++i)
          if (std::fabs(bf16_to_float(at<uint16_t>(block, l.value_codes)[i])) > spec.value_limit)
            check.fail("an exact value exceeds 2^95");
      return;
    }
    const size_t groups = B * (d / cfg.value_group_size);
    check.halves(l.value_scale, groups, true, QJLKV_DTYPE_F16, "the value scale");
    check.halves(l.value_min, groups, false, QJLKV_DTYPE_F16, "the value minimum");
  }
  // Token t's value as stored (stored: the 16-bit form).
  // The reference quantizer of a block's B tokens (zeroed codes first): per-group codes with fp16
  // scale and minimum, or 16-bit numbers when value_bits == 16.
  static void quantize_block(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &layout, const float *,
                             const float *values, uint8_t *block) {
    const uint32_t B = cfg.block_tokens, d = cfg.head_dim, bits = cfg.value_bits;
    if (bits == 16) {
      uint16_t *dst = at<uint16_t>(block, layout.value_codes);
      for (size_t i = 0; i < size_t(B) * d; ++i) dst[i] = to_16bit(values[i], stored);
      return;
    }
    const uint32_t g = cfg.value_group_size, groups = d / g;
    uint16_t *scales = at<uint16_t>(block, layout.value_scale);
    uint16_t *mins = at<uint16_t>(block, layout.value_min);
    std::memset(block + layout.value_codes, 0, B * layout.value_bytes_per_token_codes);
    for (uint32_t t = 0; t < B; ++t) {
      const float *v = values + size_t(t) * d;
      uint8_t *codes = block + layout.value_codes + t * layout.value_bytes_per_token_codes;
      for (uint32_t gi = 0; gi < groups; ++gi) {
        const float *x = v + gi * g;
        const auto [lo, hi] = std::minmax_element(x, x + g);
        const GroupQuant q = group_quant(*lo, *hi, bits);
        scales[t * groups + gi] = q.scale_bits;
        mins[t * groups + gi] = q.min_bits;
        for (uint32_t j = 0; j < g; ++j) pack_code(codes, gi * g + j, bits, quant_code(x[j], q, bits));
      }
    }
  }
  static void decode_token(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &l, const uint8_t *block,
                           uint32_t t, float *out) {
    const uint32_t d = cfg.head_dim, bits = cfg.value_bits;
    if (bits == 16) {
      const uint16_t *v = at<uint16_t>(block, l.value_codes) + size_t(t) * d;
      for (uint32_t j = 0; j < d; ++j) out[j] = from_16bit(v[j], stored);
      return;
    }
    const uint32_t g = cfg.value_group_size, groups = d / g;
    const uint16_t *scales = at<uint16_t>(block, l.value_scale) + size_t(t) * groups;
    const uint16_t *mins = at<uint16_t>(block, l.value_min) + size_t(t) * groups;
    const uint8_t *codes = block + l.value_codes + t * l.value_bytes_per_token_codes;
    for (uint32_t j = 0; j < d; ++j)
      out[j] = dequant(unpack_code(codes, j, bits), half_to_float(scales[j / g]), half_to_float(mins[j / g]));
  }
  static void dequantize_token(const CacheSpec &spec, const LayerSpec &layer, const uint8_t *block, uint32_t t,
                               float *out) {
    decode_token(spec.cfg, spec.stored_dtype, layer.layout, block, t, out);
  }
};

}  // namespace qjlkv
