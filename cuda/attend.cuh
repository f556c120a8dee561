// Fused decode attention on the compressed cache, flash-decoding style.
//
// One CTA = (sequence, kv head, tile of up to ROWS query rows, split of the positions). The query
// rows of a kv head are its GQA group (times n_queries), so each kv head's bytes are read once for
// all its query heads. The CTA walks its units (quantized blocks, then pieces of the tail) in
// tiles of 32 positions:
//   stage   the tile's key and value bytes go to shared memory (coalesced 4-byte loads);
//   score   lane = position, warp = a quarter of the position's key bytes; partial dot products;
//   combine the four partials + the method's per-token factors, scale (or soft-cap), causal and
//           window mask;
//   softmax online: running max / sum per row, rescale factor for the accumulators;
//   values  each thread owns 8 channels of a few positions and accumulates weight · value.
// It ends by writing its (max, sum, unnormalized output) per row; attend_reduce_kernel merges the
// splits. A layer's attention variant (qjlkv_layer_attention) is fused: the soft-cap applies to
// each logit as combine makes it, a sink logit joins its row's denominator in the merge, and a
// sliding window masks each row's positions before its start; the blocks wholly before the first
// query's window are no units of the split, so no CTA reads them. The
// kernel is a template over the key policy (keys.cuh: per-block setup, staging, partial dot
// products, per-token score) and the value policy (values.cuh: staging, decoding, whether the sum
// is rotated); nothing in it branches on a method. AttendCta holds one CTA's state and names its
// phases. Per-element math is shared with the CPU backend (quant_math.hpp, lloyd_max.hpp,
// layout.hpp).
#pragma once
#include <cfloat>

#include "policies.cuh"

namespace qjlkv::cuda {

// One CTA of attend_kernel: its place in the grid, its shared memory, its policies' per-CTA state,
// and the running softmax state and value sums of its query rows; a member function per phase.
template <class IO, class KEYS, class VALUES, uint32_t ROWS>
struct AttendCta {
  using T = typename IO::type;
  static constexpr bool kBf16 = IO::stored_bf16;
  static constexpr uint32_t kThreads = kAttendThreads;

  const AttendArgs &a;
  const KernelShape &s;
  const AttendSmem &L;
  uint8_t *smem;
  uint32_t tid, lane, warp;
  uint32_t row_tile, split, kv_head, seq;
  AttendSeq sd;
  uint32_t d, B, G, d32, row0, n_rows;
  float *q;                                 // [ROWS][d32]
  float *scores;                            // [ROWS][kTile]: scores, then softmax weights
  float *red;                               // [2][kParts][ROWS][kTile]
  float *run_max, *run_sum, *rescale;       // [ROWS] each
  uint8_t *stage_k, *stage_v;
  // Full-precision rows (tail, sinks, OTT's outlier tokens): d input elements each.
  size_t row_bytes;
  uint32_t row_words, key_stride;
  // The value phase: thread = (slice of 8 channels, lane of positions).
  uint32_t slices, value_lanes, slice, value_lane;
  bool value_active;
  float vacc[ROWS][kSliceChannels] = {};
  // Rotated values (VALUES::kRotated): whether vacc holds a rotated sum of block values.
  bool rotated_sum = false;
  typename KEYS::template Scorer<ROWS> keys;
  const typename VALUES::Decoder values;

  // blockIdx.x = ((seq * Hkv + kv head) * splits + split) * row_tiles + row tile: the CTAs that
  // read the same bytes run side by side.
  __device__ AttendCta(const AttendArgs &args, uint8_t *shared)
      : a(args), s(args.shape), L(args.smem), smem(shared), tid(threadIdx.x), lane(tid & 31u), warp(tid >> 5),
        row_tile(blockIdx.x % args.row_tiles), split(blockIdx.x / args.row_tiles % args.split.splits),
        kv_head(blockIdx.x / args.row_tiles / args.split.splits % args.shape.Hkv),
        seq(blockIdx.x / args.row_tiles / args.split.splits / args.shape.Hkv), sd(args.seqs[seq]), d(s.d), B(s.B),
        G(s.G), d32(round_up(d, 32)), row0(row_tile * ROWS), n_rows(min(ROWS, args.qps * G - row0)),
        q(reinterpret_cast<float *>(smem + L.q)), scores(reinterpret_cast<float *>(smem + L.scores)),
        red(reinterpret_cast<float *>(smem + L.red)), run_max(reinterpret_cast<float *>(smem + L.state)),
        run_sum(run_max + ROWS), rescale(run_sum + ROWS), stage_k(smem + L.stage_k), stage_v(smem + L.stage_v),
        row_bytes(size_t(d) * sizeof(T)), row_words(uint32_t(row_bytes / 4)),
        key_stride(padded_row_words(uint32_t(row_bytes))), slices(d / kSliceChannels),
        value_lanes(kThreads / slices), slice(tid % slices), value_lane(tid / slices),
        value_active(value_lane < value_lanes), keys(s, L, smem), values(s, L, smem, slice) {}

  // Query row r: query i = (row0 + r) / G at position length - qps + i, head kv_head * G + (row0 + r) % G.
  __device__ __forceinline__ uint32_t query_row(uint32_t r) const {
    const uint32_t row = row0 + r;
    return (row / G) * s.Hq + kv_head * G + row % G;  // index into [qps][Hq]
  }
  __device__ __forceinline__ uint32_t query_position(uint32_t r) const { return sd.length - a.qps + (row0 + r) / G; }
  // Whether row r sees `position`: causal, and from its window's start (the CPU backend's rule).
  __device__ __forceinline__ bool sees(uint32_t r, uint32_t position) const {
    const uint32_t query = query_position(r);
    return position <= query && position >= window_start(query, a.window);
  }

  // The queries into shared memory, the softmax state, then the policies' per-CTA setup.
  __device__ __forceinline__ void start() {
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
    keys.init();
    values.init();
    __syncthreads();
  }

  // ---- the phases of one tile of n positions ----
  __device__ __forceinline__ void write_partials(const float (&acc_a)[ROWS], const float (&acc_b)[ROWS]) {
#pragma unroll
    for (uint32_t r = 0; r < ROWS; ++r) {
      red[(warp * ROWS + r) * kTile + lane] = acc_a[r];
      if constexpr (KEYS::kTwoSums) red[((kParts + warp) * ROWS + r) * kTile + lane] = acc_b[r];
    }
  }
  // raw(r, t) from the partials; token_score(r, t, sum_a, sum_b) adds the method's factors.
  // position_of(t): the position of tile entry t; listed: whether scores() lists it (OTT's pool and
  // spill tokens are not listed: their slots are, as -inf).
  template <class PositionOf, class TokenScore>
  __device__ __forceinline__ void combine(uint32_t n, PositionOf position_of, bool listed, TokenScore token_score) {
    for (uint32_t i = tid; i < ROWS * kTile; i += kThreads) {
      const uint32_t r = i / kTile, t = i % kTile;
      float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
      for (uint32_t p = 0; p < kParts; ++p) {
        sum_a += red[(p * ROWS + r) * kTile + t];
        if constexpr (KEYS::kTwoSums) sum_b += red[((kParts + p) * ROWS + r) * kTile + t];
      }
      const bool valid = t < n && r < n_rows;
      const float raw = valid ? token_score(r, t, sum_a, sum_b) : 0.0f;
      const uint32_t position = valid ? position_of(t) : 0;
      if (a.scores && valid && listed)
        a.scores[size_t(kv_head * G + (row0 + r) % G) * sd.length + position] = raw;
      scores[r * kTile + t] = valid && sees(r, position) ? logit(raw) : kNegInf;
    }
  }
  // The logit of a raw score: scale·raw, or soft-capped softcap·tanh(scale·raw / softcap) (as the
  // CPU backend computes it); a -inf score (OTT's moved slots) stays -inf.
  __device__ __forceinline__ float logit(float raw) const {
    if (a.softcap > 0.0f) return raw == kNegInf ? kNegInf : a.softcap * tanhf(a.softcap_inside * raw);
    return raw * a.scale;
  }
  // Online softmax: the tile's weights, and per row the running max and sum and the factor that
  // rescales the value sums.
  __device__ __forceinline__ void softmax() {
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
  }
  // decode(t, v) fills the 8 channels of this thread's slice at tile position t.
  template <class Decode>
  __device__ __forceinline__ void accumulate_values(uint32_t n, Decode decode) {
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
  }
  // The partial dot products of a tile are in acc_a / acc_b: score, softmax, values.
  template <class PositionOf, class TokenScore, class Decode>
  __device__ __forceinline__ void finish_tile(const float (&acc_a)[ROWS], const float (&acc_b)[ROWS], uint32_t n,
                              PositionOf position_of, bool listed, TokenScore token_score, Decode decode) {
    write_partials(acc_a, acc_b);
    __syncthreads();
    combine(n, position_of, listed, token_score);
    __syncthreads();
    softmax();
    __syncthreads();
    accumulate_values(n, decode);
    __syncthreads();
  }

  // vacc[r][c] to buf[value_lane][r][slice channel c] ([value_lanes][ROWS][d]); the stage's space.
  __device__ __forceinline__ void store_value_sums(float *buf) const {
    if (value_active)
#pragma unroll
      for (uint32_t r = 0; r < ROWS; ++r)
#pragma unroll
        for (uint32_t c = 0; c < kSliceChannels; ++c)
          buf[(value_lane * ROWS + r) * d + slice * kSliceChannels + c] = vacc[r][c];
  }
  // Rotated values: the blocks' weighted sum is rotated; this CTA rotates its sum back (a linear
  // map, so before or after the rescaling and the merge of splits alike) once its blocks are done,
  // before any exact token joins it.
  __device__ __forceinline__ void rotate_back() {
    float *buf = reinterpret_cast<float *>(smem + L.final_buf);  // [value_lanes][ROWS][d], the stage
    store_value_sums(buf);
    __syncthreads();
    for (uint32_t v = tid; v < value_lanes * ROWS; v += kThreads)
      rotate_inverse(s.value_signs, d, buf + v * d, buf + v * d);
    __syncthreads();
    if (value_active)
#pragma unroll
      for (uint32_t r = 0; r < ROWS; ++r)
#pragma unroll
        for (uint32_t c = 0; c < kSliceChannels; ++c)
          vacc[r][c] = buf[(value_lane * ROWS + r) * d + slice * kSliceChannels + c];
    __syncthreads();
    rotated_sum = false;
  }

  // ---- the units of this split: blocks, tail pieces, OTT's outlier tokens, then the sinks ----
  // Quantized block `unit` (positions sinks + unit·B, ...): the policies stage, score and decode
  // it, tile by tile; OTT's moved slots score -inf.
  __device__ __forceinline__ void process_block(uint32_t unit) {
    if constexpr (VALUES::kRotated) rotated_sum = true;
    const uint8_t *block = reinterpret_cast<const uint8_t *>(sd.table[unit]) + size_t(kv_head) * s.head_stride;
    keys.setup_block(block);  // what this block's scores share
    for (uint32_t t0 = 0; t0 < B; t0 += kTile) {
      const uint32_t n = min(kTile, B - t0);  // a multiple of 8
      keys.stage(stage_k, block, t0, n);
      values.stage(stage_v, block, t0, n);
      __syncthreads();
      float acc_a[ROWS] = {}, acc_b[ROWS] = {};
      if (lane < n) keys.template score<kBf16>(stage_k, lane, warp, acc_a, acc_b);
      const uint32_t pos0 = sd.sinks + unit * B + t0;
      finish_tile(
          acc_a, acc_b, n, [&](uint32_t t) { return pos0 + t; }, true,
          [&](uint32_t r, uint32_t t, float sum_a, float sum_b) {
            return keys.token_score(stage_k, block, r, t0, t, sum_a, sum_b);
          },
          [&](uint32_t t, float (&v)[kSliceChannels]) { values.template decode<kBf16>(stage_v, t, v); });
    }
  }

  // Full-precision tail values (input dtype, staged rows of d elements).
  __device__ __forceinline__ void decode_exact_value(uint32_t t, float (&v)[kSliceChannels]) const {
    const uint8_t *p = stage_v + (size_t(t) * d + slice * kSliceChannels) * sizeof(T);
    if constexpr (sizeof(T) == 4) {
      const float4 x = *reinterpret_cast<const float4 *>(p), y = *reinterpret_cast<const float4 *>(p + 16);
      v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
    } else {
      unpack8_16bit<kBf16>(p, v);
    }
  }
  // Full-precision positions (the tail, OTT's outlier tokens, the sinks), n <= kTile of them: key
  // and value rows of d input elements at key_row(t) / value_row(t), positions position_of(t).
  template <class KeyRow, class ValueRow, class PositionOf>
  __device__ __forceinline__ void process_exact(uint32_t n, KeyRow key_row, ValueRow value_row, PositionOf position_of,
                                                bool listed) {
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
    finish_tile(
        acc_a, acc_b, n, position_of, listed, [&](uint32_t, uint32_t, float sum, float) { return sum; },
        [&](uint32_t t, float (&v)[kSliceChannels]) { decode_exact_value(t, v); });
  }
  // Tail piece `piece`: position sinks + p (p counted after the sinks) is in ring slot p % ring. The
  // positions before `seen` (no row of this CTA sees them) are not read.
  __device__ __forceinline__ void process_tail(uint32_t piece, uint32_t seen) {
    const uint32_t first = (sd.blocks + piece) * B, last = min(first + B, sd.length - sd.sinks);
    for (uint32_t pos0 = max(first, seen > sd.sinks ? seen - sd.sinks : 0u); pos0 < last; pos0 += kTile) {
      const auto ring_row = [&](const uint8_t *ring, uint32_t t) {
        return ring + ((size_t((pos0 + t) % s.ring) * s.Hkv + kv_head) * row_bytes);
      };
      process_exact(
          min(kTile, last - pos0), [&](uint32_t t) { return ring_row(sd.ring_k, t); },
          [&](uint32_t t) { return ring_row(sd.ring_v, t); }, [&](uint32_t t) { return sd.sinks + pos0 + t; }, true);
    }
  }
  // OTT's outlier tokens [first, last) of this kv head's state: the pool, then the spill area,
  // each token at its own position.
  __device__ __forceinline__ void process_outliers(const uint8_t *ott_state, uint32_t outlier_pool, uint32_t first,
                                                   uint32_t last) {
    for (uint32_t o0 = first; o0 < last; o0 += kTile) {
      const auto slot = [&](uint32_t t) { return ott_slot(o0 + t, outlier_pool, s.ott_pool); };
      process_exact(
          min(kTile, last - o0), [&](uint32_t t) { return ott_state + s.ott.keys + size_t(slot(t)) * row_bytes; },
          [&](uint32_t t) { return ott_state + s.ott.values + size_t(slot(t)) * row_bytes; },
          [&](uint32_t t) { return reinterpret_cast<const uint32_t *>(ott_state + s.ott.positions)[slot(t)]; },
          false);
    }
  }
  // The attention sinks [first, last) of positions [0, sinks), those from `seen` on.
  __device__ __forceinline__ void process_sinks(uint32_t first, uint32_t last, uint32_t seen) {
    for (uint32_t pos0 = max(first, seen); pos0 < last; pos0 += kTile) {
      const auto sink_row = [&](const uint8_t *sinks, uint32_t t) {
        return sinks + (size_t(pos0 + t) * s.Hkv + kv_head) * row_bytes;
      };
      process_exact(
          min(kTile, last - pos0), [&](uint32_t t) { return sink_row(sd.sink_k, t); },
          [&](uint32_t t) { return sink_row(sd.sink_v, t); }, [&](uint32_t t) { return pos0 + t; }, true);
    }
  }
  __device__ __forceinline__ void process_units() {
    // OTT: this kv head's outlier tokens (none before the sequence's first traced block).
    const uint8_t *ott_state = sd.ott ? sd.ott + size_t(kv_head) * s.ott.bytes : nullptr;
    const uint32_t outlier_pool = ott_state ? reinterpret_cast<const uint32_t *>(ott_state)[0] : 0;
    const uint32_t outlier_count = ott_state ? outlier_pool + reinterpret_cast<const uint32_t *>(ott_state)[1] : 0;
    // Units: the blocks from first_block on and the tail (positions after the sinks), OTT's outlier
    // tokens, the sinks. A window's blocks before first_block are no unit: never read (they may
    // be freed). A split whose units no row sees keeps its empty state (max -inf, sum 0).
    const uint32_t blocks_end = sd.blocks - sd.first_block;
    const uint32_t tail_end = attend_units(sd.length - sd.sinks, sd.blocks, B) - sd.first_block;
    const uint32_t outliers_end = tail_end + div_up(outlier_count, B);
    const uint32_t units = outliers_end + div_up(sd.sinks, B);
    const uint32_t unit_begin = split * a.split.units_per_split;
    const uint32_t unit_end = min(unit_begin + a.split.units_per_split, units);
    const uint32_t seen = uint32_t(window_start(query_position(0), a.window));  // this CTA's first row's
    for (uint32_t unit = unit_begin; unit < unit_end; ++unit) {
      if constexpr (VALUES::kRotated)
        if (rotated_sum && unit >= blocks_end) rotate_back();
      if (unit < blocks_end) {
        const uint32_t block = sd.first_block + unit;
        if (sd.sinks + (block + 1) * B > seen) process_block(block);  // else no row of this CTA sees it
      } else if (unit < tail_end) {
        process_tail(unit - blocks_end, seen);
      } else if (unit >= outliers_end) {
        const uint32_t first = (unit - outliers_end) * B;
        process_sinks(first, min(first + B, sd.sinks), seen);
      } else {
        const uint32_t first = (unit - tail_end) * B;
        process_outliers(ott_state, outlier_pool, first, min(first + B, outlier_count));
      }
    }
    if constexpr (VALUES::kRotated)
      if (rotated_sum) rotate_back();
  }

  // The partial result of this CTA: the value lanes summed, then (max, sum, output) per row.
  __device__ __forceinline__ void write_partial_results() {
    float *final_buf = reinterpret_cast<float *>(smem + L.final_buf);  // [value_lanes][ROWS][d]
    store_value_sums(final_buf);
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
};

template <class IO, class KEYS, class VALUES, uint32_t ROWS>
__global__ void __launch_bounds__(kAttendThreads) attend_kernel(const AttendArgs a) {
  QJLKV_DYNAMIC_SMEM(smem);
  AttendCta<IO, KEYS, VALUES, ROWS> cta(a, smem);
  cta.start();
  cta.process_units();
  cta.write_partial_results();
}

// One CTA per output row (sequence, query, head): merges the splits' partial softmax states, and
// the head's sink logit (a term of the denominator that attends to no value) when the layer has
// them. Every attend path ends here, so the sinks cost no pass over the cache.
template <class IO>
__global__ void __launch_bounds__(kAttendThreads) attend_reduce_kernel(const AttendArgs a) {
  const size_t row = blockIdx.x;
  const size_t rows_per_seq = size_t(a.qps) * a.shape.Hq;
  const size_t seq = row / rows_per_seq, query_row = row % rows_per_seq;
  const uint32_t splits = a.split.splits, d = a.shape.d;
  const auto part = [&](uint32_t split) { return (seq * splits + split) * rows_per_seq + query_row; };
  const float sink = a.sink_logits ? a.sink_logits[query_row % a.shape.Hq] : kNegInf;
  float global_max = sink;
  for (uint32_t sp = 0; sp < splits; ++sp) global_max = fmaxf(global_max, a.part_ml[part(sp) * 2]);
  float total = a.sink_logits ? __expf(sink - global_max) : 0.0f;
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
template <class IO, class KEYS, class VALUES, uint32_t ROWS>
cudaError_t configure_one(size_t smem_optin) {
  // The kernel has no static shared memory; the limit covers static and dynamic together.
  cudaFuncAttributes attributes;
  const cudaError_t e = cudaFuncGetAttributes(&attributes, attend_kernel<IO, KEYS, VALUES, ROWS>);
  if (e != cudaSuccess) return e;
  if (attributes.sharedSizeBytes > 0) return cudaErrorInvalidValue;  // attend_smem() would not account for it
  return cudaFuncSetAttribute(attend_kernel<IO, KEYS, VALUES, ROWS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(smem_optin));
}

// A kernel's shared memory limit is process-wide (every layer and every cache launches the same
// kernels), so it is raised to the device's maximum rather than to one layer's need.
template <class IO, class KEYS, class VALUES>
cudaError_t configure_methods(size_t smem_limit) {
  cudaError_t e = configure_one<IO, KEYS, VALUES, 1>(smem_limit);
  if (e == cudaSuccess) e = configure_one<IO, KEYS, VALUES, 2>(smem_limit);
  if (e == cudaSuccess) e = configure_one<IO, KEYS, VALUES, 4>(smem_limit);
  if (e == cudaSuccess) e = configure_one<IO, KEYS, VALUES, 8>(smem_limit);
  return e;
}

template <class IO>
cudaError_t configure_io(const KernelShape &shape, size_t smem_limit) {
  return with_policies(shape, [&](auto keys, auto values) {
    return configure_methods<IO, decltype(keys), decltype(values)>(smem_limit);
  });
}

template <class IO, class KEYS, class VALUES>
cudaError_t launch_methods(const AttendArgs &a, uint32_t rows, uint32_t grid, cudaStream_t stream) {
  auto kernel = rows == 1 ? attend_kernel<IO, KEYS, VALUES, 1>
                : rows == 2 ? attend_kernel<IO, KEYS, VALUES, 2>
                : rows == 4 ? attend_kernel<IO, KEYS, VALUES, 4>
                            : attend_kernel<IO, KEYS, VALUES, 8>;
  QJLKV_LAUNCH(kernel, grid, kAttendThreads, a.smem.total, stream, a);
  return cudaGetLastError();
}

template <class IO>
cudaError_t launch_io(const AttendArgs &a, uint32_t rows, cudaStream_t stream) {
  const uint64_t grid = uint64_t(a.n_seqs) * a.shape.Hkv * a.split.splits * a.row_tiles;
  if (grid == 0 || grid > 0x7fffffffu) return cudaErrorInvalidConfiguration;
  return with_policies(a.shape, [&](auto keys, auto values) {
    return launch_methods<IO, decltype(keys), decltype(values)>(a, rows, uint32_t(grid), stream);
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
