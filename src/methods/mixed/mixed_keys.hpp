// Mixed-bit per-channel keys (QJLKV_KEYS_MIXED; the rules are mixed_math.hpp's): the 2-bit tier's
// keys. Per block and kv head, each channel gets 0 to 4 bits from the block's ranges, so a
// token's config.key_token_bits go to the channels that vary (docs/ACCURACY.md, "2-bit
// candidates": at 2.125 bits a channel they beat the 3-bit per-channel keys).
// Block: min fp16[d], max fp16[d], widths [d·3/8] (3 bits a channel), then codes
// [B][key_token_bits/8]: a token's row holds channel j's w_j-bit code at bits Σ_{i<j} w_i.
#pragma once
#include <algorithm>
#include <cstring>

#include "../method.hpp"
#include "mixed_math.hpp"

namespace qjlkv {

struct MixedKeys : KeyMethodDefaults {
  static constexpr qjlkv_key_method kMethod = QJLKV_KEYS_MIXED;

  static void validate(const qjlkv_config &cfg) {
    const uint32_t bits = cfg.key_token_bits, most = mixed::kMaxWidth * cfg.head_dim;
    QJLKV_REQUIRE(bits >= 8 && bits <= most && bits % 8 == 0,
                  "config.key_token_bits is %u, must be a multiple of 8 in [8, %u] (4 bits a channel at head_dim %u)",
                  bits, most, cfg.head_dim);
  }
  static void copy_fields(const qjlkv_config &from, qjlkv_config &to) { to.key_token_bits = from.key_token_bits; }
  static void layout(const qjlkv_config &cfg, const LayerSpec &, LayoutCursor &at, BlockLayout &l) {
    const size_t B = cfg.block_tokens, d = cfg.head_dim;
    l.key_bytes_per_token_codes = cfg.key_token_bits / 8;
    l.key_min = at.take(2 * d);
    l.key_max = at.take(2 * d);
    l.key_widths = at.take(d * mixed::kWidthBits / 8);
    l.key_codes = at.take(B * l.key_bytes_per_token_codes);
  }
  // Finite fp16 ranges that do not run backwards, and widths of at most 4 bits that fill a row
  // exactly; any code is valid.
  template <class Check>
  static void check_stored(const CacheSpec &spec, const LayerSpec &layer, const uint8_t *block, const Check &check) {
    const BlockLayout &l = layer.layout;
    const uint32_t d = spec.cfg.head_dim;
    check.halves(l.key_min, d, false, QJLKV_DTYPE_F16, "the key minimum");
    check.halves(l.key_max, d, false, QJLKV_DTYPE_F16, "the key maximum");
    uint32_t bits = 0;
    for (uint32_t j = 0; j < d; ++j) {
      const float lo = half_to_float(at<uint16_t>(block, l.key_min)[j]);
      const float hi = half_to_float(at<uint16_t>(block, l.key_max)[j]);
      if (!(hi >= lo)) check.fail("channel %u's key maximum %g is below its minimum %g", j, double(hi), double(lo));
      const uint32_t width = width_of(l, block, j);
      if (width > mixed::kMaxWidth) check.fail("channel %u's key code width is %u bits, at most 4 are stored", j, width);
      bits += width;
    }
    if (bits != spec.cfg.key_token_bits)
      check.fail("the key codes' widths sum to %u bits a token, this config's rows hold %u", bits,
                 spec.cfg.key_token_bits);
  }
  static uint32_t width_of(const BlockLayout &l, const uint8_t *block, uint32_t j) {
    return unpack_code(block + l.key_widths, j, mixed::kWidthBits);
  }
  static float low_of(const BlockLayout &l, const uint8_t *block, uint32_t j) {
    return half_to_float(at<uint16_t>(block, l.key_min)[j]);
  }
  static float range_of(const BlockLayout &l, const uint8_t *block, uint32_t j) {
    return half_to_float(at<uint16_t>(block, l.key_max)[j]) - low_of(l, block, j);
  }
  static void dequantize_token(const CacheSpec &spec, const LayerSpec &layer, const uint8_t *block, uint32_t t,
                               float *out) {
    const BlockLayout &l = layer.layout;
    const uint8_t *row = block + l.key_codes + t * l.key_bytes_per_token_codes;
    for (uint32_t j = 0, bit = 0; j < spec.cfg.head_dim; ++j) {
      const uint32_t width = width_of(l, block, j);
      out[j] = mixed::decode(mixed::get_field(row, bit, width), low_of(l, block, j),
                             mixed::cell(range_of(l, block, j), width));
      bit += width;
    }
  }

  // ---- the reference kernels (both backends' fast paths store the same bytes) ----
  // The widths of d channels of these ranges: the token_bits (>= 1) candidates taken first
  // (mixed_math.hpp's order); width[] starts zeroed.
  static void choose_widths(uint32_t d, uint32_t token_bits, const float *range, uint32_t *width) {
    uint16_t order[mixed::kMaxWidth * QJLKV_MAX_HEAD_DIM];
    float priority[mixed::kMaxWidth * QJLKV_MAX_HEAD_DIM];  // once each: ldexpf is a library call
    const uint32_t candidates = mixed::kMaxWidth * d;
    for (uint32_t i = 0; i < candidates; ++i) {
      order[i] = uint16_t(i);
      priority[i] = mixed::bit_priority(range[i / mixed::kMaxWidth], i % mixed::kMaxWidth);
    }
    // The order is total (ties go by index), so the first token_bits after nth_element are the
    // same set a sort would take, in linear time.
    std::nth_element(order, order + (token_bits - 1), order + candidates, [&](uint32_t a, uint32_t b) {
      return mixed::taken_before(priority[a], a, priority[b], b);
    });
    for (uint32_t i = 0; i < token_bits; ++i) ++width[order[i] / mixed::kMaxWidth];
  }
  // The block's B tokens of keys [B][d] into its zeroed block.
  static void quantize_block(const qjlkv_config &cfg, const BlockLayout &l, const float *keys, uint8_t *block) {
    const uint32_t B = cfg.block_tokens, d = cfg.head_dim;
    float lo[QJLKV_MAX_HEAD_DIM], range[QJLKV_MAX_HEAD_DIM] = {};  // zeroed: GCC 12 cannot see the loop fill it
    uint32_t width[QJLKV_MAX_HEAD_DIM] = {};
    for (uint32_t j = 0; j < d; ++j) {
      float low = keys[j], high = keys[j];
      for (uint32_t t = 1; t < B; ++t) {
        low = std::min(low, keys[size_t(t) * d + j]);
        high = std::max(high, keys[size_t(t) * d + j]);
      }
      const uint16_t low16 = float_to_half_down(low), high16 = float_to_half_up(high);
      at<uint16_t>(block, l.key_min)[j] = low16;
      at<uint16_t>(block, l.key_max)[j] = high16;
      lo[j] = half_to_float(low16);
      range[j] = half_to_float(high16) - lo[j];
    }
    choose_widths(d, cfg.key_token_bits, range, width);
    std::memset(block + l.key_widths, 0, d * mixed::kWidthBits / 8);
    for (uint32_t j = 0; j < d; ++j) pack_code(block + l.key_widths, j, mixed::kWidthBits, width[j]);
    std::memset(block + l.key_codes, 0, B * l.key_bytes_per_token_codes);
    for (uint32_t t = 0; t < B; ++t) {
      uint8_t *row = block + l.key_codes + t * l.key_bytes_per_token_codes;
      for (uint32_t j = 0, bit = 0; j < d; ++j) {
        const float cell = mixed::cell(range[j], width[j]);
        mixed::put_field(row, bit, width[j], mixed::code_of(keys[size_t(t) * d + j], lo[j], cell, width[j]));
        bit += width[j];
      }
    }
  }
  // Raw scores of the block's tokens for `rows` queries [rows][d], out[r·out_stride + t]:
  // Σ_j (q_j·cell_j)·code_j + Σ_j q_j·(lo_j + cell_j/2). Scratch: d floats.
  static void score_block(const qjlkv_config &cfg, const BlockLayout &l, const uint8_t *block, const float *queries,
                          size_t query_stride, uint32_t rows, float *out, size_t out_stride, float *scratch) {
    const uint32_t B = cfg.block_tokens, d = cfg.head_dim;
    float *q_cell = scratch;
    for (uint32_t r = 0; r < rows; ++r) {
      const float *q = queries + r * query_stride;
      float offset = 0.0f;
      for (uint32_t j = 0; j < d; ++j) {
        const float cell = mixed::cell(range_of(l, block, j), width_of(l, block, j));
        q_cell[j] = q[j] * cell;
        offset += q[j] * (low_of(l, block, j) + 0.5f * cell);
      }
      for (uint32_t t = 0; t < B; ++t) {
        const uint8_t *row = block + l.key_codes + t * l.key_bytes_per_token_codes;
        float sum = 0.0f;
        for (uint32_t j = 0, bit = 0; j < d; ++j) {
          const uint32_t width = width_of(l, block, j);
          sum += q_cell[j] * float(mixed::get_field(row, bit, width));
          bit += width;
        }
        out[r * out_stride + t] = sum + offset;
      }
    }
  }
};

}  // namespace qjlkv
