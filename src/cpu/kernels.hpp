// CPU reference kernels: small functions over one block of one kv head, named by the methods of
// src/methods/ that own them. They define the results; fast paths must match them.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "../config.hpp"
#include "../elements.hpp"
#include "../error.hpp"
#include "../half.hpp"
#include "../lloyd_max.hpp"
#include "../quant_math.hpp"

namespace qjlkv::cpu {

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float dot(const float *a, const float *b, size_t n) {
  float sum = 0.0f;
  for (size_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// ---- QJL keys (SPEC §3) ----------------------------------------------------------------------
// The c channels with the largest sum of squares over the block's tokens, ascending; ties go to
// the lower channel index.
void select_outlier_channels(const float *keys, uint32_t tokens, uint32_t d, uint32_t c, float *channel_energy,
                             uint32_t *order, uint8_t *out_idx);
// Token t of a QJL block: key k into `inlier` with the block's c outlier channels zeroed, their
// values into `outliers` (c floats; may be null), and the fp16 norms of both parts into the block.
void qjl_split_key(const BlockLayout &l, const float *k, uint32_t d, const uint8_t *outlier_idx, uint32_t c,
                   uint32_t t, float *inlier, float *outliers, uint8_t *block);


// Scratch: qjl_quantize_scratch_floats (masked key, channel energies, channel order, outlier bits).
inline size_t qjl_quantize_scratch_floats(uint32_t d, uint32_t m_out) { return 3 * size_t(d) + m_out / 32 + 1; }
void qjl_quantize_block(const LayerSpec &layer, const qjlkv_config &cfg, float qjl_constant,
                        const float *keys /*[B][d]*/, uint8_t *block, float *scratch);

// Per query row: the projected query S·q over the layer's sketch rows (shared by every block).
void qjl_project_query(const LayerSpec &layer, uint32_t d, const float *q, float *sq);

// Raw estimated scores of one block for `rows` queries: out[r * B + t].
void qjl_score_block(const LayerSpec &layer, const qjlkv_config &cfg, float qjl_constant, const uint8_t *block,
                     const float *queries /*[rows][d]*/, const float *projected /*[rows][sketch_rows]*/,
                     uint32_t rows, float *out);


// ---- 16-bit exact keys -----------------------------------------------------------------------
void exact_keys_store_block(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &layout,
                            const float *keys, uint8_t *block);
// Scratch: d floats.
void exact_keys_score_block(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &layout,
                            const uint8_t *block, const float *queries, uint32_t rows, float *out, float *scratch);

// ---- KIVI keys (SPEC §5): per-channel key_bits quantization over the block ---------------------
void kivi_quantize_block(const qjlkv_config &cfg, const BlockLayout &layout, const float *keys /*[B][d]*/,
                         uint8_t *block);
// Scores on the codes: Σ_c (q_c·scale_c)·code_c + Σ_c q_c·min_c. Scratch: d floats.
void kivi_score_block(const qjlkv_config &cfg, const BlockLayout &layout, const uint8_t *block,
                      const float *queries, uint32_t rows, float *out, float *scratch);

// ---- per-token values (SPEC §4) ---------------------------------------------------------------
// value_signs: the layer's rotation signs for rotated Lloyd-Max values (LayerSpec::value_signs),
// else unused (may be NULL).
void values_quantize_block(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &layout,
                           const float *value_signs, const float *values /*[B][d]*/, uint8_t *block);
// acc[r][d] += Σ_t weights[r][t] · v̂_t over the block's tokens, with v̂_t as stored: rotated
// Lloyd-Max values stay rotated (attention rotates the sum back once).
void values_accumulate_block(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &layout,
                             const uint8_t *block, const float *weights /*[rows][B]*/, uint32_t rows,
                             float *acc /*[rows][d]*/);
// The value of token t as stored (rotated for rotated Lloyd-Max values).
void values_decode_token(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &layout,
                         const uint8_t *block, uint32_t t, float *out);
// The dequantized value of token t, rotated back (tests and reconstruction paths).
void values_dequantize_token(const qjlkv_config &cfg, qjlkv_dtype stored, const BlockLayout &layout,
                             const float *value_signs, const uint8_t *block, uint32_t t, float *out);

// ---- online softmax ----------------------------------------------------------------------------
// State of one query row: running max, running sum and the unnormalized output.
struct SoftmaxRow {
  float max = kNegInf;
  float sum = 0.0f;
};
// Folds n scaled scores (-inf = masked) into the row state; rescales acc[d] when the max grows
// and turns scores into weights in place (0 for masked entries). Returns false when all are masked.
bool softmax_fold(SoftmaxRow &row, float *scores, uint32_t n, float *acc, uint32_t d);

}  // namespace qjlkv::cpu
