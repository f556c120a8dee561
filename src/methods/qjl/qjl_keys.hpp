// QJL keys (QJLKV_KEYS_QJL, SPEC §3): per token the sign bits of the sketched key without its
// block's outlier channels, the fp16 norms of both parts, and in place of the outlier part's sign
// bits their fp16 corrections τ on the c outlier channels (quant_math.hpp's qjl_correction;
// docs/DESIGN.md, "QJL outlier corrections"). Block: norm_in fp16[B], norm_out fp16[B],
// corrections fp16[c][B], bits_in [B][m/8], outlier channel indices uint8[c] (the outlier arrays
// only when the layer has an outlier sketch).
#pragma once
#include "../method.hpp"

namespace qjlkv {

struct QjlKeys : KeyMethodDefaults {
  static constexpr qjlkv_key_method kMethod = QJLKV_KEYS_QJL;
  static constexpr bool kSketched = true;

  static void validate(const qjlkv_config &cfg);
  static void copy_fields(const qjlkv_config &from, qjlkv_config &to) {
    to.key_sketch_dim = from.key_sketch_dim;
    to.outlier_channels = from.outlier_channels;
    to.outlier_sketch_dim = from.outlier_sketch_dim;
    to.initial_layers = from.initial_layers;
    to.initial_key_sketch_dim = from.initial_key_sketch_dim;
    to.initial_outlier_sketch_dim = from.initial_outlier_sketch_dim;
  }
  // Every layer's sketch sizes and sketch; fails OUT_OF_MEMORY before generating sketches that
  // cannot fit this machine's memory.
  static void init_layers(const qjlkv_config &cfg, std::vector<LayerSpec> &layers);
  static void layout(const qjlkv_config &cfg, const LayerSpec &layer, LayoutCursor &at, BlockLayout &l) {
    const size_t B = cfg.block_tokens;
    l.key_bytes_per_token_bits_in = layer.m / 8;
    const size_t c = layer.m_out ? cfg.outlier_channels : 0;
    l.key_norm_in = at.take(2 * B);
    l.key_norm_out = at.take(c ? 2 * B : 0);
    l.key_corrections = at.take(2 * c * B);
    l.key_bits_in = at.take(B * l.key_bytes_per_token_bits_in);
    l.key_outlier_idx = at.take(layer.m_out ? cfg.outlier_channels : 0);
  }
  // The norms are fp16.
  static double norm_limit(const qjlkv_config &) { return kHalfMax; }
  [[noreturn]] static void fail_norm(const qjlkv_config &cfg, size_t vector, double norm) {
    fail(QJLKV_ERROR_INVALID_ARGUMENT,
         "keys: the key vector of token %zu, kv head %zu has L2 norm %g > 65504, which QJL cannot store (norms are "
         "fp16)",
         vector / cfg.num_kv_heads, vector % cfg.num_kv_heads, norm);
  }
  // The norms and corrections, and the outlier channels: increasing channels below head_dim.
  template <class Check>
  static void check_stored(const CacheSpec &spec, const LayerSpec &layer, const uint8_t *block, const Check &check) {
    const qjlkv_config &cfg = spec.cfg;
    const BlockLayout &l = layer.layout;
    check.halves(l.key_norm_in, cfg.block_tokens, true, QJLKV_DTYPE_F16, "the inlier key norm");
    if (layer.m_out == 0) return;
    check.halves(l.key_norm_out, cfg.block_tokens, true, QJLKV_DTYPE_F16, "the outlier key norm");
    check.halves(l.key_corrections, size_t(cfg.outlier_channels) * cfg.block_tokens, false, QJLKV_DTYPE_F16,
                 "the outlier correction");
    const uint8_t *idx = block + l.key_outlier_idx;
    for (uint32_t i = 0; i < cfg.outlier_channels; ++i)
      if (idx[i] >= cfg.head_dim || (i > 0 && idx[i] <= idx[i - 1]))
        check.fail("the outlier channels are not increasing channels < head_dim (%u): entry %u is %u", cfg.head_dim,
                   i, idx[i]);
  }
  // Token t's outlier corrections (quant_math.hpp's qjl_correction) into the block, from its
  // stored inlier bits, norms and outlier channels and its outlier bits sign(S_out·k_out)
  // (the reference quantizer, and the import of streams that stored the outlier bits).
  static void store_corrections(const LayerSpec &layer, const qjlkv_config &cfg, float qjl_constant, uint8_t *block,
                                uint32_t t, const uint8_t *bits_out /*[m_out/8]*/);
  // The dense k̂ whose dot product with any query equals the block's estimate.
  static void dequantize_token(const CacheSpec &spec, const LayerSpec &layer, const uint8_t *block, uint32_t t,
                               float *out);
};

}  // namespace qjlkv
