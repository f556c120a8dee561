#include "kernels.hpp"

#include "../methods/methods.hpp"

namespace qjlkv::cpu {

void select_outlier_channels(const float *keys, uint32_t tokens, uint32_t d, uint32_t c, float *channel_energy,
                             uint32_t *order, uint8_t *out_idx) {
  std::fill(channel_energy, channel_energy + d, 0.0f);
  for (uint32_t t = 0; t < tokens; ++t)
    for (uint32_t j = 0; j < d; ++j) channel_energy[j] += keys[size_t(t) * d + j] * keys[size_t(t) * d + j];
  for (uint32_t j = 0; j < d; ++j) order[j] = j;
  std::partial_sort(order, order + c, order + d, [&](uint32_t a, uint32_t b) {
    return channel_energy[a] > channel_energy[b] || (channel_energy[a] == channel_energy[b] && a < b);
  });
  std::sort(order, order + c);
  for (uint32_t i = 0; i < c; ++i) out_idx[i] = uint8_t(order[i]);
}

void qjl_split_key(const BlockLayout &l, const float *k, uint32_t d, const uint8_t *outlier_idx, uint32_t c,
                   uint32_t t, float *inlier, float *outliers, uint8_t *block) {
  std::copy(k, k + d, inlier);
  float outlier_norm2 = 0.0f;
  for (uint32_t i = 0; i < c; ++i) {
    const float x = k[outlier_idx[i]];
    outlier_norm2 += x * x;
    inlier[outlier_idx[i]] = 0.0f;
    if (outliers) outliers[i] = x;
  }
  at<uint16_t>(block, l.key_norm_in)[t] = float_to_half(std::sqrt(dot(inlier, inlier, d)));
  if (c) at<uint16_t>(block, l.key_norm_out)[t] = float_to_half(std::sqrt(outlier_norm2));
}

void qjl_quantize_block(const LayerSpec &layer, const qjlkv_config &cfg, float qjl_constant, const float *keys,
                        uint8_t *block, float *scratch) {
  const uint32_t B = cfg.block_tokens, d = cfg.head_dim, c = layer.m_out ? cfg.outlier_channels : 0;
  const BlockLayout &l = layer.layout;
  float *inlier_key = scratch;                             // [d]
  float *energy = inlier_key + d;                          // [d]
  auto *order = reinterpret_cast<uint32_t *>(energy + d);  // [d]
  auto *bits_out = reinterpret_cast<uint8_t *>(order + d);  // [m_out / 8]
  uint8_t *outlier_idx = block + l.key_outlier_idx;
  if (c) select_outlier_channels(keys, B, d, c, energy, order, outlier_idx);
  const float *S = layer.sketch->matrix.data.data();
  std::memset(block + l.key_bits_in, 0, B * l.key_bytes_per_token_bits_in);
  for (uint32_t t = 0; t < B; ++t) {
    const float *k = keys + size_t(t) * d;
    qjl_split_key(l, k, d, outlier_idx, c, t, inlier_key, nullptr, block);
    uint8_t *bits_in = block + l.key_bits_in + t * l.key_bytes_per_token_bits_in;
    for (uint32_t i = 0; i < layer.m; ++i) set_sign_bit(bits_in, i, dot(S + size_t(i) * d, inlier_key, d));
    if (c) {
      std::memset(bits_out, 0, layer.m_out / 8);
      for (uint32_t i = 0; i < layer.m_out; ++i) {
        float p = 0.0f;
        for (uint32_t j = 0; j < c; ++j) p += S[size_t(i) * d + outlier_idx[j]] * k[outlier_idx[j]];
        set_sign_bit(bits_out, i, p);
      }
      QjlKeys::store_corrections(layer, cfg, qjl_constant, block, t, bits_out);
    }
  }
}

void qjl_project_query(const LayerSpec &layer, uint32_t d, const float *q, float *sq) {
  const float *S = layer.sketch->matrix.data.data();
  for (uint32_t i = 0; i < layer.sketch_rows; ++i) sq[i] = dot(S + size_t(i) * d, q, d);
}

void qjl_score_block(const LayerSpec &layer, const qjlkv_config &cfg, float qjl_constant, const uint8_t *block,
                     const float *queries, const float *projected, uint32_t rows, float *out) {
  const uint32_t B = cfg.block_tokens, d = cfg.head_dim, c = layer.m_out ? cfg.outlier_channels : 0;
  const BlockLayout &l = layer.layout;
  const uint8_t *outlier_idx = block + l.key_outlier_idx;
  const uint16_t *norm_in = at<uint16_t>(block, l.key_norm_in);
  const uint16_t *norm_out = at<uint16_t>(block, l.key_norm_out);
  const uint16_t *corrections = at<uint16_t>(block, l.key_corrections);
  const float in_factor = qjl_constant / float(layer.m);
  for (uint32_t r = 0; r < rows; ++r) {
    const float *q = queries + size_t(r) * d;
    const float *sq = projected + size_t(r) * layer.sketch_rows;
    for (uint32_t t = 0; t < B; ++t) {
      const uint8_t *bits_in = block + l.key_bits_in + t * l.key_bytes_per_token_bits_in;
      const float n_in = half_to_float(norm_in[t]);
      float score = in_factor * n_in * signed_dot(sq, bits_in, layer.m);
      if (c) {
        float outliers = 0.0f;
        for (uint32_t j = 0; j < c; ++j) outliers += q[outlier_idx[j]] * half_to_float(corrections[size_t(j) * B + t]);
        score += outliers * (n_in + half_to_float(norm_out[t]));
      }
      out[size_t(r) * B + t] = score;
    }
  }
}

void exact_keys_store_block(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &layout,
                            const float *keys, uint8_t *block) {
  uint16_t *dst = at<uint16_t>(block, layout.key_codes);
  for (size_t i = 0; i < size_t(cfg.block_tokens) * cfg.head_dim; ++i) dst[i] = to_16bit(keys[i], stored);
}

void exact_keys_score_block(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &layout,
                            const uint8_t *block, const float *queries, uint32_t rows, float *out, float *scratch) {
  const uint32_t B = cfg.block_tokens, d = cfg.head_dim;
  const uint16_t *keys = at<uint16_t>(block, layout.key_codes);
  for (uint32_t t = 0; t < B; ++t) {
    for (uint32_t j = 0; j < d; ++j) scratch[j] = from_16bit(keys[size_t(t) * d + j], stored);
    for (uint32_t r = 0; r < rows; ++r) out[size_t(r) * B + t] = dot(queries + size_t(r) * d, scratch, d);
  }
}

void kivi_quantize_block(const qjlkv_config &cfg, const BlockLayout &layout, const float *keys, uint8_t *block) {
  const uint32_t B = cfg.block_tokens, d = cfg.head_dim, bits = cfg.key_bits;
  uint16_t *scales = at<uint16_t>(block, layout.key_scale);
  uint16_t *mins = at<uint16_t>(block, layout.key_min);
  std::memset(block + layout.key_codes, 0, B * layout.key_bytes_per_token_codes);
  for (uint32_t j = 0; j < d; ++j) {
    float lo = keys[j], hi = keys[j];
    for (uint32_t t = 1; t < B; ++t) {
      lo = std::min(lo, keys[size_t(t) * d + j]);
      hi = std::max(hi, keys[size_t(t) * d + j]);
    }
    const GroupQuant q = group_quant(lo, hi, bits);
    scales[j] = q.scale_bits;
    mins[j] = q.min_bits;
    for (uint32_t t = 0; t < B; ++t)
      pack_code(block + layout.key_codes + t * layout.key_bytes_per_token_codes, j, bits,
                quant_code(keys[size_t(t) * d + j], q, bits));
  }
}

void kivi_score_block(const qjlkv_config &cfg, const BlockLayout &layout, const uint8_t *block,
                      const float *queries, uint32_t rows, float *out, float *scratch) {
  const uint32_t B = cfg.block_tokens, d = cfg.head_dim, bits = cfg.key_bits;
  const uint16_t *scales = at<uint16_t>(block, layout.key_scale);
  const uint16_t *mins = at<uint16_t>(block, layout.key_min);
  float *q_scaled = scratch;  // q_c · scale_c
  for (uint32_t r = 0; r < rows; ++r) {
    const float *q = queries + size_t(r) * d;
    float offset = 0.0f;  // Σ_c q_c · min_c, shared by every token of the block
    for (uint32_t j = 0; j < d; ++j) {
      q_scaled[j] = q[j] * half_to_float(scales[j]);
      offset += q[j] * half_to_float(mins[j]);
    }
    for (uint32_t t = 0; t < B; ++t) {
      const uint8_t *codes = block + layout.key_codes + t * layout.key_bytes_per_token_codes;
      float sum = 0.0f;
      for (uint32_t j = 0; j < d; ++j) sum += q_scaled[j] * float(unpack_code(codes, j, bits));
      out[size_t(r) * B + t] = sum + offset;
    }
  }
}

void values_quantize_block(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &layout,
                           const float *value_signs, const float *values, uint8_t *block) {
  with_value_method(cfg.value_method, [&](auto value_method) {
    value_method.quantize_block(cfg, stored, layout, value_signs, values, block);
  });
}

void values_dequantize_token(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &layout,
                             const float *value_signs, const uint8_t *block, uint32_t t, float *out) {
  values_decode_token(cfg, stored, layout, block, t, out);
  with_value_method(cfg.value_method, [&](auto value_method) { value_method.unrotate(value_signs, cfg.head_dim, out); });
}

void values_decode_token(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &layout,
                         const uint8_t *block, uint32_t t, float *out) {
  with_value_method(cfg.value_method,
                    [&](auto value_method) { value_method.decode_token(cfg, stored, layout, block, t, out); });
}

void values_accumulate_block(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &layout,
                             const uint8_t *block, const float *weights, uint32_t rows, float *acc) {
  const uint32_t B = cfg.block_tokens, d = cfg.head_dim;
  with_value_method(cfg.value_method, [&](auto value_method) {
    float v[256];
    for (uint32_t t = 0; t < B; ++t) {
      bool any = false;
      for (uint32_t r = 0; r < rows; ++r) any |= weights[size_t(r) * B + t] != 0.0f;
      if (!any) continue;
      value_method.decode_token(cfg, stored, layout, block, t, v);
      for (uint32_t r = 0; r < rows; ++r) {
        const float w = weights[size_t(r) * B + t];
        if (w == 0.0f) continue;
        float *a = acc + size_t(r) * d;
        for (uint32_t j = 0; j < d; ++j) a[j] += w * v[j];
      }
    }
  });
}

bool softmax_fold(SoftmaxRow &row, float *scores, uint32_t n, float *acc, uint32_t d) {
  float block_max = kNegInf;
  for (uint32_t t = 0; t < n; ++t) block_max = std::max(block_max, scores[t]);
  if (block_max == kNegInf) {
    std::fill(scores, scores + n, 0.0f);
    return false;
  }
  if (block_max > row.max) {
    const float factor = std::exp(row.max - block_max);  // 0 on the first fold
    row.sum *= factor;
    for (uint32_t j = 0; j < d; ++j) acc[j] *= factor;
    row.max = block_max;
  }
  for (uint32_t t = 0; t < n; ++t) {
    scores[t] = std::exp(scores[t] - row.max);  // exp(-inf) = 0 for masked entries
    row.sum += scores[t];
  }
  return true;
}

}  // namespace qjlkv::cpu
