// Fused decode attention on the compressed cache, flash-decoding style.
//
// One CTA = (sequence, kv head, tile of up to ROWS query rows, split of the positions). The query
// rows of a kv head are its GQA group (times n_queries), so each kv head's bytes are read once for
// all its query heads. The CTA walks its units (quantized blocks, then pieces of the tail) in
// tiles of 32 positions:
//   stage   the tile's key and value bytes go to shared memory (coalesced 4-byte loads);
//   score   lane = position, warp = a quarter of the position's key bytes; partial dot products;
//   combine the four partials + the method's per-token factors, scale, causal mask;
//   softmax online: running max / sum per row, rescale factor for the accumulators;
//   values  each thread owns 8 channels of a few positions and accumulates weight · value.
// It ends by writing its (max, sum, unnormalized output) per row; attend_reduce_kernel merges the
// splits. Per-element math is shared with the CPU backend (quant_math.hpp, layout.hpp).
#pragma once
#include <cfloat>

#include "values.cuh"

namespace qjlkv::cuda {

inline constexpr float kNegInf = -__builtin_huge_valf();

// Σ_i v_r[i]·(±1) over the 32 sketch rows of one word of sign bits, for every query row r.
template <uint32_t ROWS>
__device__ __forceinline__ void accumulate_signs(uint32_t word, const float *v, uint32_t stride, float (&acc)[ROWS]) {
#pragma unroll
  for (uint32_t i = 0; i < 32; i += 4) {
    const float f0 = sign_factor(word, i), f1 = sign_factor(word, i + 1), f2 = sign_factor(word, i + 2),
                f3 = sign_factor(word, i + 3);
#pragma unroll
    for (uint32_t r = 0; r < ROWS; ++r) {
      const float4 x = *reinterpret_cast<const float4 *>(v + r * stride + i);
      acc[r] = fmaf(x.x, f0, fmaf(x.y, f1, fmaf(x.z, f2, fmaf(x.w, f3, acc[r]))));
    }
  }
}

// Σ_c qs_r[c]·code_c over the 32/BITS codes of one word, for every query row r.
template <uint32_t BITS, uint32_t ROWS>
__device__ __forceinline__ void accumulate_codes(uint32_t word, const float *qs, uint32_t stride, float (&acc)[ROWS]) {
  constexpr uint32_t kPerWord = 32 / BITS, kMask = (1u << BITS) - 1u;
#pragma unroll
  for (uint32_t c = 0; c < kPerWord; c += 4) {
    const float f0 = code_to_float((word >> (c * BITS)) & kMask);
    const float f1 = code_to_float((word >> ((c + 1) * BITS)) & kMask);
    const float f2 = code_to_float((word >> ((c + 2) * BITS)) & kMask);
    const float f3 = code_to_float((word >> ((c + 3) * BITS)) & kMask);
#pragma unroll
    for (uint32_t r = 0; r < ROWS; ++r) {
      const float4 x = *reinterpret_cast<const float4 *>(qs + r * stride + c);
      acc[r] = fmaf(x.x, f0, fmaf(x.y, f1, fmaf(x.z, f2, fmaf(x.w, f3, acc[r]))));
    }
  }
}

// Σ_c qs_r[c]·code_c over the 32 3-bit codes of three words (96 bits), for every query row r.
template <uint32_t ROWS>
__device__ __forceinline__ void accumulate_codes3(uint32_t w0, uint32_t w1, uint32_t w2, const float *qs,
                                                  uint32_t stride, float (&acc)[ROWS]) {
  const uint64_t lo = uint64_t(w0) | uint64_t(w1) << 32;  // codes 0..20 and the low bit of code 21
  const uint64_t hi = uint64_t(w1) | uint64_t(w2) << 32;  // from bit 32: codes 11 (partly) .. 31
#pragma unroll
  for (uint32_t c = 0; c < 32; c += 4) {
    float f[4];
#pragma unroll
    for (uint32_t k = 0; k < 4; ++k) {
      const uint32_t bit = 3 * (c + k);
      f[k] = code_to_float(uint32_t(bit + 3 <= 64 ? lo >> bit : hi >> (bit - 32)) & 7u);
    }
#pragma unroll
    for (uint32_t r = 0; r < ROWS; ++r) {
      const float4 x = *reinterpret_cast<const float4 *>(qs + r * stride + c);
      acc[r] = fmaf(x.x, f[0], fmaf(x.y, f[1], fmaf(x.z, f[2], fmaf(x.w, f[3], acc[r]))));
    }
  }
}

// Σ q_r[e]·x_e over the two 16-bit numbers (fp16, or bf16 when BF16) of one word, for every
// query row r; q points at the word's first element of row 0.
template <bool BF16, uint32_t ROWS>
__device__ __forceinline__ void accumulate_16bit_pair(uint32_t word, const float *q, uint32_t stride,
                                                      float (&acc)[ROWS]) {
  const float x0 = stored16_to_float<BF16>(word & 0xffffu), x1 = stored16_to_float<BF16>(word >> 16);
#pragma unroll
  for (uint32_t r = 0; r < ROWS; ++r) {
    const float2 qq = *reinterpret_cast<const float2 *>(q + r * stride);
    acc[r] = fmaf(qq.x, x0, fmaf(qq.y, x1, acc[r]));
  }
}

// Rows of `words` 4-byte words from global memory into shared rows of dst_stride words:
// one warp per row, lanes along the row (coalesced).
template <class RowAddress>
__device__ __forceinline__ void copy_rows(uint32_t *dst, uint32_t dst_stride, uint32_t words, uint32_t n_rows,
                                          RowAddress row_address) {
  const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  for (uint32_t t = warp; t < n_rows; t += kAttendThreads / 32) {
    const auto *src = reinterpret_cast<const uint32_t *>(row_address(t));
    for (uint32_t k = lane; k < words; k += 32) dst[t * dst_stride + k] = __ldg(src + k);
  }
}

template <class IO, KeyKind KIND, class VALUES, uint32_t ROWS>
__global__ void __launch_bounds__(kAttendThreads) attend_kernel(const AttendArgs a) {
  using T = typename IO::type;
  constexpr bool kBf16 = IO::stored_bf16;
  constexpr uint32_t kThreads = kAttendThreads;
  QJLKV_DYNAMIC_SMEM(smem);
  const KernelShape &s = a.shape;
  const AttendSmem &L = a.smem;
  const uint32_t tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;

  // blockIdx.x = ((seq * Hkv + kv head) * splits + split) * row_tiles + row tile: the CTAs that
  // read the same bytes run side by side.
  uint32_t index = blockIdx.x;
  const uint32_t row_tile = index % a.row_tiles;
  index /= a.row_tiles;
  const uint32_t split = index % a.split.splits;
  index /= a.split.splits;
  const uint32_t kv_head = index % s.Hkv, seq = index / s.Hkv;

  const AttendSeq sd = a.seqs[seq];
  const uint32_t d = s.d, B = s.B, G = s.G, d32 = round_up(d, 32);
  const uint32_t row0 = row_tile * ROWS, n_rows = min(ROWS, a.qps * G - row0);
  // OTT: this kv head's outlier tokens (none before the sequence's first traced block).
  const uint8_t *ott_state = sd.ott ? sd.ott + size_t(kv_head) * s.ott.bytes : nullptr;
  const uint32_t outlier_pool = ott_state ? reinterpret_cast<const uint32_t *>(ott_state)[0] : 0;
  const uint32_t outlier_count = ott_state ? outlier_pool + reinterpret_cast<const uint32_t *>(ott_state)[1] : 0;
  // Units: the blocks and the tail (positions after the sinks), OTT's outlier tokens, the sinks.
  const uint32_t tail_end = attend_units(sd.length - sd.sinks, sd.blocks, B);
  const uint32_t outliers_end = tail_end + div_up(outlier_count, B);
  const uint32_t units = outliers_end + div_up(sd.sinks, B);
  const uint32_t unit_begin = split * a.split.units_per_split;
  const uint32_t unit_end = min(unit_begin + a.split.units_per_split, units);

  float *q = reinterpret_cast<float *>(smem + L.q);  // [ROWS][d32]
  float *scores = reinterpret_cast<float *>(smem + L.scores);
  float *red = reinterpret_cast<float *>(smem + L.red);  // [2][kParts][ROWS][kTile]
  float *run_max = reinterpret_cast<float *>(smem + L.state), *run_sum = run_max + ROWS, *rescale = run_sum + ROWS;
  uint8_t *stage_k = smem + L.stage_k, *stage_v = smem + L.stage_v;

  // Query row r: query i = (row0 + r) / G at position length - qps + i, head kv_head * G + (row0 + r) % G.
  const auto query_row = [&](uint32_t r) {
    const uint32_t row = row0 + r;
    return (row / G) * s.Hq + kv_head * G + row % G;  // index into [qps][Hq]
  };
  const auto query_position = [&](uint32_t r) { return sd.length - a.qps + (row0 + r) / G; };

  const T *queries = static_cast<const T *>(a.queries) + size_t(seq) * a.qps * s.Hq * d;
  for (uint32_t i = tid; i < ROWS * d32; i += kThreads) {
    const uint32_t r = i / d32, j = i % d32;
    q[i] = r < n_rows && j < d ? IO::load(queries, size_t(query_row(r)) * d + j) : 0.0f;
  }
  if (tid < ROWS) {
    run_max[tid] = kNegInf;
    run_sum[tid] = 0.0f;
    rescale[tid] = 1.0f;
  }
  __syncthreads();

  // QJL: S·q once per CTA (rows of the layer sketch beyond sketch_rows are zero padding).
  const uint32_t sr32 = round_up(s.sketch_rows, 32), m32 = round_up(s.m, 32), mo32 = round_up(s.m_out, 32);
  float *sq = reinterpret_cast<float *>(smem + L.sq);
  float *sq_in = reinterpret_cast<float *>(smem + L.sq_in);
  float *sq_out = reinterpret_cast<float *>(smem + L.sq_out);
  if constexpr (KIND == KeyKind::qjl) {
    for (uint32_t i = tid; i < sr32; i += kThreads) {
      float acc[ROWS] = {};
      if (i < s.sketch_rows)
        for (uint32_t j = 0; j < d; ++j) {
          const float w = __ldg(s.sketch_t + size_t(j) * s.sketch_rows + i);
#pragma unroll
          for (uint32_t r = 0; r < ROWS; ++r) acc[r] = fmaf(w, q[r * d32 + j], acc[r]);
        }
#pragma unroll
      for (uint32_t r = 0; r < ROWS; ++r) sq[r * sr32 + i] = acc[r];
    }
    __syncthreads();
  }

  // The value phase: thread = (slice of 8 channels, lane of positions).
  const uint32_t slices = d / kSliceChannels, value_lanes = kThreads / slices;
  const uint32_t slice = tid % slices, value_lane = tid / slices;
  const bool value_active = value_lane < value_lanes;
  float vacc[ROWS][kSliceChannels] = {};
  const typename VALUES::Decoder values(s, L, smem, slice);
  values.init();
  __syncthreads();

  // ---- the phases of one tile of n positions starting at position pos0 ----
  const auto write_partials = [&](const float (&acc_a)[ROWS], const float (&acc_b)[ROWS]) {
#pragma unroll
    for (uint32_t r = 0; r < ROWS; ++r) {
      red[(warp * ROWS + r) * kTile + lane] = acc_a[r];
      if constexpr (KIND == KeyKind::qjl) red[((kParts + warp) * ROWS + r) * kTile + lane] = acc_b[r];
    }
  };
  // combine: raw(r, t) from the partials; token_score(r, t, sum_a, sum_b) adds the method's factors.
  // position(t): the position of tile entry t; listed: whether scores() lists it (OTT's pool and
  // spill tokens are not listed: their slots are, as -inf).
  const auto combine = [&](uint32_t n, auto position_of, bool listed, auto token_score) {
    for (uint32_t i = tid; i < ROWS * kTile; i += kThreads) {
      const uint32_t r = i / kTile, t = i % kTile;
      float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
      for (uint32_t p = 0; p < kParts; ++p) {
        sum_a += red[(p * ROWS + r) * kTile + t];
        if constexpr (KIND == KeyKind::qjl) sum_b += red[((kParts + p) * ROWS + r) * kTile + t];
      }
      const bool valid = t < n && r < n_rows;
      const float raw = valid ? token_score(r, t, sum_a, sum_b) : 0.0f;
      const uint32_t position = valid ? position_of(t) : 0;
      if (a.scores && valid && listed)
        a.scores[size_t(kv_head * G + (row0 + r) % G) * sd.length + position] = raw;
      scores[r * kTile + t] = valid && position <= query_position(r) ? raw * a.scale : kNegInf;
    }
  };
  const auto softmax = [&]() {
    for (uint32_t r = warp; r < ROWS; r += kParts) {
      const float x = scores[r * kTile + lane];
      const float tile_max = warp_max(x);
      if (tile_max == kNegInf) {  // every position of this tile is masked for this row
        scores[r * kTile + lane] = 0.0f;
        if (lane == 0) rescale[r] = 1.0f;
        continue;
      }
      const float old_max = run_max[r], new_max = fmaxf(old_max, tile_max);
      const float factor = __expf(old_max - new_max);  // 0 on the first tile
      const float weight = __expf(x - new_max);
      scores[r * kTile + lane] = weight;
      const float sum = warp_sum(weight);
      if (lane == 0) {
        run_sum[r] = run_sum[r] * factor + sum;
        run_max[r] = new_max;
        rescale[r] = factor;
      }
    }
  };
  // values: decode(t, v) fills the 8 channels of this thread's slice at tile position t.
  const auto accumulate_values = [&](uint32_t n, auto decode) {
    if (!value_active) return;
#pragma unroll
    for (uint32_t r = 0; r < ROWS; ++r) {
      const float factor = rescale[r];
#pragma unroll
      for (uint32_t c = 0; c < kSliceChannels; ++c) vacc[r][c] *= factor;
    }
    for (uint32_t t = value_lane; t < n; t += value_lanes) {
      float v[kSliceChannels];
      decode(t, v);
#pragma unroll
      for (uint32_t r = 0; r < ROWS; ++r) {
        const float w = scores[r * kTile + t];
#pragma unroll
        for (uint32_t c = 0; c < kSliceChannels; ++c) vacc[r][c] = fmaf(w, v[c], vacc[r][c]);
      }
    }
  };

  const auto decode_block_value = [&](uint32_t t, float (&v)[kSliceChannels]) {
    values.template decode<kBf16>(stage_v, t, v);
  };
  // Rotated values (VALUES::kRotated): the blocks' weighted sum is rotated; this CTA rotates its
  // sum back (a linear map, so before or after the rescaling and the merge of splits alike) once
  // its blocks are done, before any exact token joins it.
  bool rotated_sum = false;
  const auto rotate_back = [&]() {
    float *buf = reinterpret_cast<float *>(smem + L.final_buf);  // [value_lanes][ROWS][d], the stage
    if (value_active)
#pragma unroll
      for (uint32_t r = 0; r < ROWS; ++r)
#pragma unroll
        for (uint32_t c = 0; c < kSliceChannels; ++c)
          buf[(value_lane * ROWS + r) * d + slice * kSliceChannels + c] = vacc[r][c];
    __syncthreads();
    for (uint32_t v = tid; v < value_lanes * ROWS; v += kThreads) rotate_inverse(s.value_signs, d, buf + v * d, buf + v * d);
    __syncthreads();
    if (value_active)
#pragma unroll
      for (uint32_t r = 0; r < ROWS; ++r)
#pragma unroll
        for (uint32_t c = 0; c < kSliceChannels; ++c)
          vacc[r][c] = buf[(value_lane * ROWS + r) * d + slice * kSliceChannels + c];
    __syncthreads();
    rotated_sum = false;
  };
  // Full-precision tail values (input dtype, staged rows of d elements).
  const auto decode_tail_value = [&](uint32_t t, float (&v)[kSliceChannels]) {
    const uint8_t *p = stage_v + (size_t(t) * d + slice * kSliceChannels) * sizeof(T);
    if constexpr (sizeof(T) == 4) {
      const float4 x = *reinterpret_cast<const float4 *>(p), y = *reinterpret_cast<const float4 *>(p + 16);
      v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
    } else {
      unpack8_16bit<kBf16>(p, v);
    }
  };

  // Full-precision positions (the tail, OTT's outlier tokens), n <= kTile of them: key and value
  // rows of d input elements at key_row(t) / value_row(t), positions position_of(t).
  const size_t row_bytes = size_t(d) * sizeof(T);
  const uint32_t row_words = uint32_t(row_bytes / 4), key_stride = padded_row_words(uint32_t(row_bytes));
  const auto process_exact = [&](uint32_t n, auto key_row, auto value_row, auto position_of, bool listed) {
    copy_rows(reinterpret_cast<uint32_t *>(stage_k), key_stride, row_words, n, key_row);
    copy_rows(reinterpret_cast<uint32_t *>(stage_v), row_words, row_words, n, value_row);
    __syncthreads();
    float acc_a[ROWS] = {}, acc_b[ROWS] = {};
    if (lane < n) {
      const uint32_t *row = reinterpret_cast<const uint32_t *>(stage_k) + lane * key_stride;
      for (uint32_t k = warp; k < row_words; k += kParts) {
        const uint32_t word = row[k];
        if constexpr (sizeof(T) == 4) {
          const float x = __uint_as_float(word);
#pragma unroll
          for (uint32_t r = 0; r < ROWS; ++r) acc_a[r] = fmaf(q[r * d32 + k], x, acc_a[r]);
        } else {
          accumulate_16bit_pair<kBf16, ROWS>(word, q + 2 * k, d32, acc_a);
        }
      }
    }
    write_partials(acc_a, acc_b);
    __syncthreads();
    combine(n, position_of, listed, [&](uint32_t, uint32_t, float sum, float) { return sum; });
    __syncthreads();
    softmax();
    __syncthreads();
    accumulate_values(n, decode_tail_value);
    __syncthreads();
  };

  // ---- the units of this split: blocks, tail pieces, OTT's outlier tokens, then the sinks ----
  for (uint32_t unit = unit_begin; unit < unit_end; ++unit) {
    if constexpr (VALUES::kRotated)
      if (rotated_sum && unit >= sd.blocks) rotate_back();
    if (unit < sd.blocks) {
      if constexpr (VALUES::kRotated) rotated_sum = true;
      const uint8_t *block = reinterpret_cast<const uint8_t *>(sd.table[unit]) + size_t(kv_head) * s.head_stride;

      // Per-block setup of the query-side vectors.
      if constexpr (KIND == KeyKind::qjl) {
        // S·q_in = S·q − S·q_out, with q_out = q on the block's c outlier channels.
        auto *outliers = reinterpret_cast<uint32_t *>(smem + L.outlier);
        const uint32_t c = s.outlier_channels;
        for (uint32_t i = tid; i < c; i += kThreads) outliers[i] = block[s.key_outlier_idx + i];
        __syncthreads();
        const uint32_t span = max(m32, mo32);
        for (uint32_t i = tid; i < span; i += kThreads) {
          float p[ROWS] = {};
          if (i < s.sketch_rows)
            for (uint32_t k = 0; k < c; ++k) {
              const uint32_t j = outliers[k];
              const float w = __ldg(s.sketch_t + size_t(j) * s.sketch_rows + i);
#pragma unroll
              for (uint32_t r = 0; r < ROWS; ++r) p[r] = fmaf(w, q[r * d32 + j], p[r]);
            }
#pragma unroll
          for (uint32_t r = 0; r < ROWS; ++r) {
            if (i < m32) sq_in[r * m32 + i] = i < s.m ? sq[r * sr32 + i] - p[r] : 0.0f;
            if (i < mo32) sq_out[r * mo32 + i] = i < s.m_out ? p[r] : 0.0f;
          }
        }
        __syncthreads();
      }
      float *qs = reinterpret_cast<float *>(smem + L.qs);
      float *key_offset = reinterpret_cast<float *>(smem + L.koff);
      if constexpr (KIND == KeyKind::kivi) {
        // q_c·scale_c for the codes and Σ_c q_c·min_c for the offset shared by the block's tokens.
        float *products = reinterpret_cast<float *>(smem + L.final_buf);  // [ROWS][d32] scratch
        const auto *scale16 = reinterpret_cast<const uint16_t *>(block + s.key_scale);
        const auto *min16 = reinterpret_cast<const uint16_t *>(block + s.key_min);
        for (uint32_t i = tid; i < ROWS * d32; i += kThreads) {
          const uint32_t j = i % d32;
          const float scale = j < d ? fp16_bits_to_float(scale16[j]) : 0.0f;
          const float minimum = j < d ? fp16_bits_to_float(min16[j]) : 0.0f;
          qs[i] = q[i] * scale;
          products[i] = q[i] * minimum;
        }
        __syncthreads();
        for (uint32_t r = warp; r < ROWS; r += kParts) {
          float sum = 0.0f;
          for (uint32_t j = lane; j < d32; j += 32) sum += products[r * d32 + j];
          sum = warp_sum(sum);
          if (lane == 0) key_offset[r] = sum;
        }
        __syncthreads();
      }

      for (uint32_t t0 = 0; t0 < B; t0 += kTile) {
        const uint32_t n = min(kTile, B - t0);  // a multiple of 8
        // stage
        if constexpr (KIND == KeyKind::qjl) {
          copy_words(stage_k + L.k_norm_in, block + s.key_norm_in + t0 * 2, n * 2, kThreads);
          copy_words(stage_k + L.k_bits_in, block + s.key_bits_in + t0 * s.bits_in_bpt, n * s.bits_in_bpt, kThreads);
          if (s.m_out) {
            copy_words(stage_k + L.k_norm_out, block + s.key_norm_out + t0 * 2, n * 2, kThreads);
            copy_words(stage_k + L.k_bits_out, block + s.key_bits_out + t0 * s.bits_out_bpt, n * s.bits_out_bpt,
                       kThreads);
          }
        } else if constexpr (KIND == KeyKind::kivi) {
          copy_words(stage_k, block + s.key_codes + t0 * s.key_codes_bpt, n * s.key_codes_bpt, kThreads);
        } else {
          copy_rows(reinterpret_cast<uint32_t *>(stage_k), padded_row_words(2 * d), d / 2, n,
                    [&](uint32_t t) { return block + s.key_codes + size_t(t0 + t) * 2 * d; });
        }
        values.stage(stage_v, block, t0, n);
        __syncthreads();

        // score
        float acc_a[ROWS] = {}, acc_b[ROWS] = {};
        if (lane < n) {
          if constexpr (KIND == KeyKind::qjl) {
            const uint32_t words_in = div_up(s.m, 32), words_out = div_up(s.m_out, 32);
            const uint8_t *bits_in = stage_k + L.k_bits_in + lane * s.bits_in_bpt;
            const uint8_t *bits_out = stage_k + L.k_bits_out + lane * s.bits_out_bpt;
            const bool aligned_in = s.bits_in_bpt % 4 == 0, aligned_out = s.bits_out_bpt % 4 == 0;
            for (uint32_t k = warp; k < words_in + words_out; k += kParts) {
              if (k < words_in) {
                accumulate_signs<ROWS>(load_word(bits_in + 4 * k, aligned_in), sq_in + 32 * k, m32, acc_a);
              } else {
                const uint32_t kk = k - words_in;
                accumulate_signs<ROWS>(load_word(bits_out + 4 * kk, aligned_out), sq_out + 32 * kk, mo32, acc_b);
              }
            }
          } else if constexpr (KIND == KeyKind::kivi) {
            const uint32_t bytes = s.key_codes_bpt, words = div_up(bytes, 4);
            const uint8_t *codes = stage_k + lane * bytes;
            const bool aligned = bytes % 4 == 0;
            // 3-bit codes: groups of 32 codes in 12 bytes (the last group of a row whose head_dim is
            // not a multiple of 32 reads into the next row or the stage's slack, times qs's zeros).
            if (s.key_bits == 3)
              for (uint32_t k = warp; k < div_up(d, 32); k += kParts)
                accumulate_codes3<ROWS>(load_word(codes + 12 * k, aligned), load_word(codes + 12 * k + 4, aligned),
                                        load_word(codes + 12 * k + 8, aligned), qs + 32 * k, d32, acc_a);
            else
            for (uint32_t k = warp; k < words; k += kParts) {
              const uint32_t word = load_word(codes + 4 * k, aligned);
              if (s.key_bits == 2) {
                accumulate_codes<2, ROWS>(word, qs + 16 * k, d32, acc_a);
              } else if (s.key_bits == 4) {
                accumulate_codes<4, ROWS>(word, qs + 8 * k, d32, acc_a);
              } else {
                accumulate_codes<8, ROWS>(word, qs + 4 * k, d32, acc_a);
              }
            }
          } else {
            const uint32_t *row = reinterpret_cast<const uint32_t *>(stage_k) + lane * padded_row_words(2 * d);
            for (uint32_t k = warp; k < d / 2; k += kParts)
              accumulate_16bit_pair<kBf16, ROWS>(row[k], q + 2 * k, d32, acc_a);
          }
        }
        write_partials(acc_a, acc_b);
        __syncthreads();

        // combine; OTT: slots whose token moved to the outlier pool are masked out (-inf)
        const uint32_t pos0 = sd.sinks + unit * B + t0;
        const auto block_position = [&](uint32_t t) { return pos0 + t; };
        const auto moved = [&](uint32_t t) {
          return s.has_mask && (block[s.key_mask + (t0 + t) / 8] >> ((t0 + t) % 8) & 1u);
        };
        if constexpr (KIND == KeyKind::qjl) {
          const float in_factor = s.qjl_constant / float(s.m);
          const float out_factor = s.m_out ? s.qjl_constant / float(s.m_out) : 0.0f;
          const auto *norm_in = reinterpret_cast<const uint16_t *>(stage_k + L.k_norm_in);
          const auto *norm_out = reinterpret_cast<const uint16_t *>(stage_k + L.k_norm_out);
          combine(n, block_position, true, [&](uint32_t, uint32_t t, float sum_in, float sum_out) {
            float score = in_factor * fp16_bits_to_float(norm_in[t]) * sum_in;
            if (s.m_out) score += out_factor * fp16_bits_to_float(norm_out[t]) * sum_out;
            return score;
          });
        } else if constexpr (KIND == KeyKind::kivi) {
          combine(n, block_position, true, [&](uint32_t r, uint32_t t, float sum, float) {
            return moved(t) ? kNegInf : sum + key_offset[r];
          });
        } else {
          combine(n, block_position, true, [&](uint32_t, uint32_t, float sum, float) { return sum; });
        }
        __syncthreads();
        softmax();
        __syncthreads();
        accumulate_values(n, decode_block_value);
        __syncthreads();
      }
    } else if (unit < tail_end) {
      // The full-precision tail: position sinks + p (p counted after the sinks) is in ring slot p % ring.
      const uint32_t first = sd.blocks * B + (unit - sd.blocks) * B, last = min(first + B, sd.length - sd.sinks);
      for (uint32_t pos0 = first; pos0 < last; pos0 += kTile) {
        const auto ring_row = [&](const uint8_t *ring, uint32_t t) {
          return ring + ((size_t((pos0 + t) % s.ring) * s.Hkv + kv_head) * row_bytes);
        };
        process_exact(
            min(kTile, last - pos0), [&](uint32_t t) { return ring_row(sd.ring_k, t); },
            [&](uint32_t t) { return ring_row(sd.ring_v, t); }, [&](uint32_t t) { return sd.sinks + pos0 + t; },
            true);
      }
    } else if (unit >= outliers_end) {
      // The attention sinks, positions [0, sinks).
      const uint32_t first = (unit - outliers_end) * B, last = min(first + B, sd.sinks);
      for (uint32_t pos0 = first; pos0 < last; pos0 += kTile) {
        const auto sink_row = [&](const uint8_t *sinks, uint32_t t) {
          return sinks + (size_t(pos0 + t) * s.Hkv + kv_head) * row_bytes;
        };
        process_exact(
            min(kTile, last - pos0), [&](uint32_t t) { return sink_row(sd.sink_k, t); },
            [&](uint32_t t) { return sink_row(sd.sink_v, t); }, [&](uint32_t t) { return pos0 + t; }, true);
      }
    } else {
      // OTT's outlier tokens: the pool, then the spill area, each token at its own position.
      const uint32_t first = (unit - tail_end) * B, last = min(first + B, outlier_count);
      for (uint32_t o0 = first; o0 < last; o0 += kTile) {
        const auto slot = [&](uint32_t t) { return ott_slot(o0 + t, outlier_pool, s.ott_pool); };
        process_exact(
            min(kTile, last - o0), [&](uint32_t t) { return ott_state + s.ott.keys + size_t(slot(t)) * row_bytes; },
            [&](uint32_t t) { return ott_state + s.ott.values + size_t(slot(t)) * row_bytes; },
            [&](uint32_t t) { return reinterpret_cast<const uint32_t *>(ott_state + s.ott.positions)[slot(t)]; },
            false);
      }
    }
  }

  if constexpr (VALUES::kRotated)
    if (rotated_sum) rotate_back();

  // ---- partial results of this CTA: sum the value lanes, then (max, sum, output) per row ----
  float *final_buf = reinterpret_cast<float *>(smem + L.final_buf);  // [value_lanes][ROWS][d]
  if (value_active)
#pragma unroll
    for (uint32_t r = 0; r < ROWS; ++r)
#pragma unroll
      for (uint32_t c = 0; c < kSliceChannels; ++c)
        final_buf[(value_lane * ROWS + r) * d + slice * kSliceChannels + c] = vacc[r][c];
  __syncthreads();
  const size_t rows_per_seq = size_t(a.qps) * s.Hq;
  const size_t part_base = (size_t(seq) * a.split.splits + split) * rows_per_seq;
  for (uint32_t i = tid; i < n_rows * d; i += kThreads) {
    const uint32_t r = i / d, j = i % d;
    float sum = 0.0f;
    for (uint32_t l = 0; l < value_lanes; ++l) sum += final_buf[(l * ROWS + r) * d + j];
    a.part_acc[(part_base + query_row(r)) * d + j] = sum;
  }
  if (tid < n_rows) {
    a.part_ml[(part_base + query_row(tid)) * 2] = run_max[tid];
    a.part_ml[(part_base + query_row(tid)) * 2 + 1] = run_sum[tid];
  }
}

// One CTA per output row (sequence, query, head): merges the splits' partial softmax states.
template <class IO>
__global__ void __launch_bounds__(kAttendThreads) attend_reduce_kernel(const AttendArgs a) {
  const size_t row = blockIdx.x;
  const size_t rows_per_seq = size_t(a.qps) * a.shape.Hq;
  const size_t seq = row / rows_per_seq, query_row = row % rows_per_seq;
  const uint32_t splits = a.split.splits, d = a.shape.d;
  const auto part = [&](uint32_t split) { return (seq * splits + split) * rows_per_seq + query_row; };
  float global_max = kNegInf;
  for (uint32_t sp = 0; sp < splits; ++sp) global_max = fmaxf(global_max, a.part_ml[part(sp) * 2]);
  float total = 0.0f;
  for (uint32_t sp = 0; sp < splits; ++sp)
    total += a.part_ml[part(sp) * 2 + 1] * __expf(a.part_ml[part(sp) * 2] - global_max);
  const float inverse = 1.0f / total;  // every query sees at least its own position
  auto *out = static_cast<typename IO::type *>(a.out);
  for (uint32_t j = threadIdx.x; j < d; j += kAttendThreads) {
    float o = 0.0f;
    for (uint32_t sp = 0; sp < splits; ++sp)
      o += a.part_acc[part(sp) * d + j] * __expf(a.part_ml[part(sp) * 2] - global_max);
    IO::store(out, row * d + j, o * inverse);
  }
}

// ---- dispatch (instantiated once per dtype in attend_<dtype>.cu) ----
template <class IO, KeyKind KIND, class VALUES, uint32_t ROWS>
cudaError_t configure_one(size_t smem_optin) {
  // The kernel has no static shared memory; the limit covers static and dynamic together.
  cudaFuncAttributes attributes;
  const cudaError_t e = cudaFuncGetAttributes(&attributes, attend_kernel<IO, KIND, VALUES, ROWS>);
  if (e != cudaSuccess) return e;
  if (attributes.sharedSizeBytes > 0) return cudaErrorInvalidValue;  // attend_smem() would not account for it
  return cudaFuncSetAttribute(attend_kernel<IO, KIND, VALUES, ROWS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(smem_optin));
}

// A kernel's shared memory limit is process-wide (every layer and every cache launches the same
// kernels), so it is raised to the device's maximum rather than to one layer's need.
template <class IO, KeyKind KIND, class VALUES>
cudaError_t configure_kind(size_t smem_limit) {
  cudaError_t e = configure_one<IO, KIND, VALUES, 1>(smem_limit);
  if (e == cudaSuccess) e = configure_one<IO, KIND, VALUES, 2>(smem_limit);
  if (e == cudaSuccess) e = configure_one<IO, KIND, VALUES, 4>(smem_limit);
  if (e == cudaSuccess) e = configure_one<IO, KIND, VALUES, 8>(smem_limit);
  return e;
}

template <class IO>
cudaError_t configure_io(const KernelShape &shape, size_t smem_limit) {
  return with_value_policy(shape.value_kind, [&](auto values) {
    using V = decltype(values);
    switch (shape.kind) {
      case KeyKind::qjl: return configure_kind<IO, KeyKind::qjl, V>(smem_limit);
      case KeyKind::kivi: return configure_kind<IO, KeyKind::kivi, V>(smem_limit);
      case KeyKind::exact: return configure_kind<IO, KeyKind::exact, V>(smem_limit);
    }
    return cudaErrorInvalidValue;  // unreachable: every KeyKind is listed
  });
}

template <class IO, KeyKind KIND, class VALUES>
cudaError_t launch_kind(const AttendArgs &a, uint32_t rows, uint32_t grid, cudaStream_t stream) {
  auto kernel = rows == 1 ? attend_kernel<IO, KIND, VALUES, 1>
                : rows == 2 ? attend_kernel<IO, KIND, VALUES, 2>
                : rows == 4 ? attend_kernel<IO, KIND, VALUES, 4>
                            : attend_kernel<IO, KIND, VALUES, 8>;
  QJLKV_LAUNCH(kernel, grid, kAttendThreads, a.smem.total, stream, a);
  return cudaGetLastError();
}

template <class IO>
cudaError_t launch_io(const AttendArgs &a, uint32_t rows, cudaStream_t stream) {
  const uint64_t grid = uint64_t(a.n_seqs) * a.shape.Hkv * a.split.splits * a.row_tiles;
  if (grid == 0 || grid > 0x7fffffffu) return cudaErrorInvalidConfiguration;
  return with_value_policy(a.shape.value_kind, [&](auto values) {
    using V = decltype(values);
    switch (a.shape.kind) {
      case KeyKind::qjl: return launch_kind<IO, KeyKind::qjl, V>(a, rows, uint32_t(grid), stream);
      case KeyKind::kivi: return launch_kind<IO, KeyKind::kivi, V>(a, rows, uint32_t(grid), stream);
      case KeyKind::exact: return launch_kind<IO, KeyKind::exact, V>(a, rows, uint32_t(grid), stream);
    }
    return cudaErrorInvalidValue;  // unreachable: every KeyKind is listed
  });
}

template <class IO>
cudaError_t launch_reduce_io(const AttendArgs &a, cudaStream_t stream) {
  const uint64_t grid = uint64_t(a.n_seqs) * a.qps * a.shape.Hq;
  if (grid == 0 || grid > 0x7fffffffu) return cudaErrorInvalidConfiguration;
  auto kernel = attend_reduce_kernel<IO>;
  QJLKV_LAUNCH(kernel, uint32_t(grid), kAttendThreads, 0, stream, a);
  return cudaGetLastError();
}

}  // namespace qjlkv::cuda
