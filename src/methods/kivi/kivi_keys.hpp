// Per-channel keys (SPEC §5): KIVI (QJLKV_KEYS_KIVI) and OTT (QJLKV_KEYS_OTT), which is KIVI plus
// outlier tracing: a traced block's slots whose tokens moved to the outlier pool are marked in a
// mask and hold the mean of the block's other tokens (the backends own the pool; the tracing's
// steps are ott_tracing.hpp's).
// Block: scale fp16[d], min fp16[d], codes [B][d·key_bits/8], then (OTT) the mask [B/8].
#pragma once
#include "../method.hpp"
#include "../ott_tracing.hpp"

namespace qjlkv {

template <bool OTT>
struct PerChannelKeys : KeyMethodDefaults {
  static constexpr qjlkv_key_method kMethod = OTT ? QJLKV_KEYS_OTT : QJLKV_KEYS_KIVI;

  static void validate(const qjlkv_config &cfg) {
    if constexpr (OTT) {
      // A block must keep at least one token to take the mean of.
      QJLKV_REQUIRE(cfg.outlier_tokens < cfg.block_tokens,
                    "config.outlier_tokens is %u, must be below block_tokens (%u)", cfg.outlier_tokens,
                    cfg.block_tokens);
      QJLKV_REQUIRE(cfg.outlier_spill_tokens <= QJLKV_MAX_SPILL_TOKENS,
                    "config.outlier_spill_tokens is %u, must be <= %u", cfg.outlier_spill_tokens,
                    QJLKV_MAX_SPILL_TOKENS);
      QJLKV_REQUIRE(cfg.outlier_skip_layers <= cfg.num_layers,
                    "config.outlier_skip_layers is %u, must be <= num_layers (%u)", cfg.outlier_skip_layers,
                    cfg.num_layers);
    }
    const uint32_t b = cfg.key_bits;
    QJLKV_REQUIRE(b == 2 || b == 3 || b == 4 || b == 8, "config.key_bits is %u, must be 2, 3, 4 or 8", b);
  }
  static void copy_fields(const qjlkv_config &from, qjlkv_config &to) {
    to.key_bits = from.key_bits;
    if constexpr (OTT) {
      to.outlier_tokens = from.outlier_tokens;
      to.outlier_spill_tokens = from.outlier_spill_tokens;
      to.outlier_skip_layers = from.outlier_skip_layers;
    }
  }
  // OTT traces every layer from outlier_skip_layers on (none with outlier_tokens = 0).
  static void init_layers(const qjlkv_config &cfg, std::vector<LayerSpec> &layers) {
    if constexpr (OTT)
      for (uint32_t l = 0; l < cfg.num_layers; ++l)
        layers[l].traced = l >= cfg.outlier_skip_layers && cfg.outlier_tokens > 0;
  }
  static void layout(const qjlkv_config &cfg, const LayerSpec &, LayoutCursor &at, BlockLayout &l) {
    const size_t B = cfg.block_tokens, d = cfg.head_dim;
    l.key_bytes_per_token_codes = d * cfg.key_bits / 8;
    l.key_scale = at.take(2 * d);
    l.key_min = at.take(2 * d);
    l.key_codes = at.take(B * l.key_bytes_per_token_codes);
    l.key_mask = at.take(OTT ? B / 8 : 0);
  }
  // Any code and mask bit is valid (the importer matches the mask against the outlier tokens).
  template <class Check>
  static void check_stored(const CacheSpec &spec, const LayerSpec &layer, const uint8_t *, const Check &check) {
    check.halves(layer.layout.key_scale, spec.cfg.head_dim, true, QJLKV_DTYPE_F16, "the key scale");
    check.halves(layer.layout.key_min, spec.cfg.head_dim, false, QJLKV_DTYPE_F16, "the key minimum");
  }
  static bool moved(const BlockLayout &l, const uint8_t *block, uint32_t t) {
    return OTT && ott::is_moved(block + l.key_mask, t);
  }
  static void dequantize_token(const CacheSpec &spec, const LayerSpec &layer, const uint8_t *block, uint32_t t,
                               float *out) {
    const BlockLayout &l = layer.layout;
    const uint16_t *scales = at<uint16_t>(block, l.key_scale);
    const uint16_t *mins = at<uint16_t>(block, l.key_min);
    const uint8_t *codes = block + l.key_codes + t * l.key_bytes_per_token_codes;
    for (uint32_t j = 0; j < spec.cfg.head_dim; ++j)
      out[j] = dequant(unpack_code(codes, j, spec.cfg.key_bits), half_to_float(scales[j]), half_to_float(mins[j]));
  }
};

using KiviKeys = PerChannelKeys<false>;
using OttKeys = PerChannelKeys<true>;

}  // namespace qjlkv
