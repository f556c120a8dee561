// The interface between the CUDA backend's host code (cuda_backend.cpp) and its kernels (*.cu):
// plain structs passed by value to the kernels, and one launch function per kernel family. Each
// launch function only enqueues work on the given stream and returns the launch status.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "block_layout.hpp"
#include "layout.hpp"
#include "qjlkv/qjlkv.h"
#include "window.hpp"

namespace qjlkv::cuda {

// The constants of a cache and a layer that the kernels read.
struct KernelShape {
  qjlkv_dtype dtype;        // input/output and tail dtype
  bool stored_bf16;         // 16-bit storage is bf16 (else fp16)
  // The methods, read on the host alone: each launch instantiates its kernel for their policy types
  // (policies.cuh), so no kernel reads them.
  qjlkv_key_method key_method;
  qjlkv_value_method value_method;
  uint32_t d, Hkv, Hq, G;   // head_dim, kv heads, query heads, group size
  uint32_t B;               // block_tokens
  uint32_t ring;            // tail ring capacity in tokens (residual_tokens + block_tokens)
  uint32_t key_bits, value_bits, value_group;
  uint32_t key_token_bits;  // MIXED: the bits of one token's codes (config.key_token_bits)
  const float *value_signs;  // rotated Lloyd-Max values: the layer's rotation signs s_j, [d]
  uint32_t sinks;            // config.sink_tokens: the positions before the first block
  uint32_t m, m_out, sketch_rows, outlier_channels;  // QJL, for this layer
  float qjl_constant;
  const float *sketch_t;    // QJL: the layer sketch transposed, [d][sketch_rows]
  BlockLayout layout;       // the arrays of one head's block, as the CPU backend stores them
  uint32_t head_stride;     // bytes between the blocks of two kv heads in one slot (16-aligned)
  // OTT: traced layers keep outlier tokens.
  bool traced;
  uint32_t ott_pool, ott_spill;  // P and S
  OttLayout ott;                 // one head's state; a sequence holds [2 sides][Hkv] of them
  OttLayout ott_saved;           // one head's pool in a rollback copy (ott_layout(P, 0, ...))
  CopyLayout copy;               // a rollback copy of one block
};

// ---- append ---------------------------------------------------------------------------------
// One block (all kv heads) to quantize. Its tokens are positions first_pos .. first_pos + B - 1;
// positions below old_length come from the sequence's tail ring, the others from the input.
// Positions here count from the end of the sequence's sinks (position S + p of the sequence).
// copy: where the block's rollback copy goes (CopyLayout), or null: its rows as they come, and
// (OTT) the pools from before its tracing.
struct QuantJob {
  uint8_t *slot;
  uint8_t *copy;
  const uint8_t *ring_k, *ring_v;
  const uint8_t *in_k, *in_v;  // this sequence's input tokens after its new sinks ([n][Hkv][d])
  uint32_t first_pos, old_length;
};

// What becomes visible once an append is validated: block table entries and tail tokens.
struct CommitJob {
  uint64_t *table;            // the sequence's device block table (maybe newly allocated)
  const uint64_t *old_table;  // when not null, entries [0, n_old) are copied from it first
  const uint64_t *entries;    // n_new slot addresses written at [n_old, n_old + n_new)
  uint32_t n_old, n_new;
  uint8_t *ring_k, *ring_v;
  const uint8_t *in_k, *in_v;
  uint32_t first_token, n_tokens;  // input tokens (after the new sinks) stored in the ring ...
  uint32_t first_pos;              // ... at positions (after the sinks) first_pos, first_pos + 1, ...
  uint8_t *sink_k, *sink_v;        // sinks ([S][Hkv][d] each): the first n_sinks input tokens go ...
  const uint8_t *sink_in_k, *sink_in_v;  // (from here) ...
  uint32_t first_sink, n_sinks;    // ... to sinks first_sink, first_sink + 1, ...
};

// flags[0], [1], [2], [3] receive the first bad key element, value element, key vector of L2 norm
// > key_norm_limit and value vector of L2 norm > value_norm_limit (UINT64_MAX when none; a norm
// limit of 0: no such check); values may be null (a query check).
cudaError_t launch_validate(const KernelShape &shape, const void *keys, const void *values, size_t elements,
                            float key_limit, float value_limit, double key_norm_limit, double value_norm_limit,
                            unsigned long long *flags, cudaStream_t stream);
cudaError_t launch_quantize(const KernelShape &shape, const QuantJob *jobs, uint32_t n_jobs, cudaStream_t stream);
// Dynamic shared memory of the quantizer for this shape (its key policy's quantize_smem).
size_t quantize_smem(const KernelShape &shape);
// Raises the dynamic shared memory limit of this shape's quantizer to what the device allows next to
// its static shared memory (at creation); *max_dynamic receives that limit.
cudaError_t configure_quantize(const KernelShape &shape, size_t smem_optin, size_t *max_dynamic);

// OTT-traced layers: the new blocks of one sequence, quantized in order by one CTA per kv head,
// which first copies the committed outlier state (`from`, or a fresh one) to `to` and updates it.
struct OttJob {
  const QuantJob *blocks;  // n_blocks consecutive jobs, in position order
  uint32_t n_blocks;
  bool fresh;              // the sequence has no outlier state yet
  const uint8_t *from;     // committed state of the sequence ([Hkv] heads)
  uint8_t *to;             // the state this append commits
};
cudaError_t launch_ott_quantize(const KernelShape &shape, const OttJob *jobs, uint32_t n_jobs, cudaStream_t stream);
// Dynamic shared memory of the OTT quantizer for this shape.
size_t ott_quantize_smem(const KernelShape &shape);
// Raises the dynamic shared memory limit of this shape's OTT quantizer to what the device allows
// next to its static shared memory (at creation); *max_dynamic receives that limit.
cudaError_t configure_ott_quantize(const KernelShape &shape, size_t smem_optin, size_t *max_dynamic);
cudaError_t launch_commit(const KernelShape &shape, const CommitJob *jobs, uint32_t n_jobs, cudaStream_t stream);

// ---- attend -----------------------------------------------------------------------------------
struct AttendSeq {
  const uint64_t *table;
  const uint8_t *ring_k, *ring_v;
  const uint8_t *ott;  // OTT-traced layers: the committed outlier state ([Hkv] heads), else null
  const uint8_t *sink_k, *sink_v;  // the sinks ([sinks][Hkv][d] each), positions [0, sinks)
  uint32_t length, blocks, sinks;  // blocks start at position `sinks`; the tail follows them
  // Sliding windows: blocks [0, first_block) end before the first query's window, or were freed
  // by it, and are not read (blocks_before in window.hpp; 0 without a window).
  uint32_t first_block;
};

struct AttendArgs {
  KernelShape shape;
  AttendSmem smem;
  const AttendSeq *seqs;
  uint32_t n_seqs;
  const void *queries;      // [n_seqs][qps][Hq][d]
  uint32_t qps;             // queries per sequence (the last qps positions, causal)
  uint32_t row_tiles;       // CTAs along the qps * G query rows of one kv head
  SplitPlan split;
  float scale;
  // The layer's attention variant (qjlkv_layer_attention), for attend alone (not scores()):
  float softcap;             // > 0: logits softcap·tanh(softcap_inside·raw) instead of scale·raw
  float softcap_inside;      // scale / softcap
  const float *sink_logits;  // null, or [Hq] on the device: exp(sink_h) joins head h's denominator
  uint32_t window;           // > 0: each query row sees the positions from window_start() of its own
  float *part_acc;          // [n_seqs][splits][qps * Hq][d]
  float *part_ml;           // [n_seqs][splits][qps * Hq][2]: running max and sum
  float *scores;            // when not null (scores()): raw logits [Hq][length] of sequence 0
  void *out;                // [n_seqs][qps][Hq][d]
};

// The shared-memory shape of the attention kernel of this layer for `rows` query rows per CTA.
inline AttendShape attend_shape(const KernelShape &shape, uint32_t rows) {
  AttendShape s;
  s.key_method = shape.key_method;
  s.rows = rows;
  s.d = shape.d;
  s.m = shape.m;
  s.outlier_channels = shape.outlier_channels;
  s.key_bits = shape.key_bits;
  s.key_token_bits = shape.key_token_bits;
  s.value_method = shape.value_method;
  s.value_bits = shape.value_bits;
  s.value_groups = uniform_value_codes(s) ? shape.d / shape.value_group : 1;
  s.io_elem = shape.dtype == QJLKV_DTYPE_F32 ? 4 : 2;
  return s;
}
// Per dtype (one translation unit each, compiled in parallel).
cudaError_t configure_attend_f32(const KernelShape &, size_t);
cudaError_t configure_attend_f16(const KernelShape &, size_t);
cudaError_t configure_attend_bf16(const KernelShape &, size_t);
cudaError_t launch_attend_f32(const AttendArgs &, uint32_t, cudaStream_t);
cudaError_t launch_attend_f16(const AttendArgs &, uint32_t, cudaStream_t);
cudaError_t launch_attend_bf16(const AttendArgs &, uint32_t, cudaStream_t);

// Raises the dynamic shared memory limit of the attention kernels of this dtype and key method to
// smem_limit (the device's maximum; at creation).
inline cudaError_t configure_attend(const KernelShape &shape, size_t smem_limit) {
  switch (shape.dtype) {
    case QJLKV_DTYPE_F32: return configure_attend_f32(shape, smem_limit);
    case QJLKV_DTYPE_F16: return configure_attend_f16(shape, smem_limit);
    case QJLKV_DTYPE_BF16: return configure_attend_bf16(shape, smem_limit);
  }
  return cudaErrorInvalidValue;  // unreachable: the dtype was validated
}
// The split kernel (partials), then the reduction kernel (out) unless args.scores is set: two
// launches whatever the number of sequences.
inline cudaError_t launch_attend(const AttendArgs &args, uint32_t rows, cudaStream_t stream) {
  switch (args.shape.dtype) {
    case QJLKV_DTYPE_F32: return launch_attend_f32(args, rows, stream);
    case QJLKV_DTYPE_F16: return launch_attend_f16(args, rows, stream);
    case QJLKV_DTYPE_BF16: return launch_attend_bf16(args, rows, stream);
  }
  return cudaErrorInvalidValue;  // unreachable: the dtype was validated
}

// Whether this binary has kernels for the current device (cudaErrorNoKernelImageForDevice if not).
cudaError_t probe_kernels();

}  // namespace qjlkv::cuda
