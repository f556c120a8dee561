// Append kernels: data validation, block quantization (QJL / KIVI / EXACT keys; values through
// their policy types, values.cuh)
// and the commit of block tables and tail tokens. Compiled with --fmad=false: the quantizers
// reproduce the CPU backend's fp32 arithmetic operation by operation (and QJL's corrections,
// exact integer sums, through the same quant_math.hpp functions), so sign bits, norms, corrections,
// outlier channels and codes come out bit-identical.
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <initializer_list>

#include "methods/ott_tracing.hpp"
#include "values.cuh"

namespace qjlkv::cuda {
namespace {

// ---- validation -------------------------------------------------------------------------------
template <class IO>
__global__ void validate_kernel(const typename IO::type *keys, const typename IO::type *values, size_t elements,
                                float key_limit, float value_limit, double key_norm_limit,
                                double value_norm_limit, uint32_t d, unsigned long long *flags) {
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = first; i < elements; i += stride) {
    // !(|x| <= limit) is also true for NaN.
    if (!(fabsf(IO::load(keys, i)) <= key_limit)) atomicMin(&flags[0], (unsigned long long)i);
    if (values && !(fabsf(IO::load(values, i)) <= value_limit)) atomicMin(&flags[1], (unsigned long long)i);
  }
  // The methods' norm limits (src/methods/; 0: none), e.g. QJL stores ||k|| as fp16, rotated
  // Lloyd-Max values ||v|| / ||levels||: one warp per vector, in float64 like the CPU checks.
  const uint32_t lane = threadIdx.x & 31u;
  const auto check_norms = [&](const typename IO::type *x, double limit, unsigned long long *flag) {
    for (size_t v = first / 32; v < elements / d; v += stride / 32) {
      double sum = 0.0;
      for (uint32_t j = lane; j < d; j += 32) {
        const double e = IO::load(x, v * d + j);
        sum += e * e;
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      if (lane == 0 && sqrt(sum) > limit) atomicMin(flag, (unsigned long long)v);
    }
  };
  if (key_norm_limit > 0.0) check_norms(keys, key_norm_limit, &flags[2]);
  if (values && value_norm_limit > 0.0) check_norms(values, value_norm_limit, &flags[3]);
}

// ---- quantization -------------------------------------------------------------------------------
// Where token t of the block being quantized lives: the tail ring or the input.
template <class IO>
struct BlockSource {
  using T = typename IO::type;
  const QuantJob &job;
  const KernelShape &s;
  uint32_t head;
  __device__ const T *row(const uint8_t *ring, const uint8_t *input, uint32_t t) const {
    const uint32_t position = job.first_pos + t;
    if (position < job.old_length)
      return reinterpret_cast<const T *>(ring) + (size_t(position % s.ring) * s.Hkv + head) * s.d;
    return reinterpret_cast<const T *>(input) + (size_t(position - job.old_length) * s.Hkv + head) * s.d;
  }
  __device__ float raw_key(uint32_t t, uint32_t j) const { return IO::load(row(job.ring_k, job.in_k, t), j); }
  __device__ float raw_value(uint32_t t, uint32_t j) const { return IO::load(row(job.ring_v, job.in_v, t), j); }
  // OTT: a token that moved to the outlier pool is quantized as the mean of the block's others.
  const uint8_t *moved = nullptr;  // [B] in shared memory, or null
  const float *mean_key = nullptr, *mean_value = nullptr;
  __device__ float key(uint32_t t, uint32_t j) const { return moved && moved[t] ? mean_key[j] : raw_key(t, j); }
  __device__ float value(uint32_t t, uint32_t j) const { return moved && moved[t] ? mean_value[j] : raw_value(t, j); }
};

constexpr uint32_t kThreads = kQuantizeThreads;

// The rows of one kv head of the block into its rollback copy, as they come (before OTT moves
// any of them): a truncate puts them back into the tail.
template <class IO>
__device__ void save_rows(const KernelShape &s, const BlockSource<IO> &src) {
  using T = typename IO::type;
  auto *keys = reinterpret_cast<T *>(src.job.copy);
  auto *values = reinterpret_cast<T *>(src.job.copy + s.copy.values);
  for (uint32_t i = threadIdx.x; i < s.B * s.d; i += kQuantizeThreads) {
    const uint32_t t = i / s.d, j = i % s.d;
    const size_t to = (size_t(t) * s.Hkv + src.head) * s.d + j;
    keys[to] = src.row(src.job.ring_k, src.job.in_k, t)[j];
    values[to] = src.row(src.job.ring_v, src.job.in_v, t)[j];
  }
}

// QJL keys (CPU: qjl_quantize_block). Sums run sequentially in the CPU's order, without FMA.
// Dynamic shared memory: the chunk's outlier sign bits (quantize_smem), which only the
// corrections read: the block does not store them.
template <class IO>
__device__ void quantize_qjl_keys(const KernelShape &s, const BlockSource<IO> &src, uint8_t *block) {
  using Sort = cub::BlockRadixSort<unsigned long long, kThreads, 1>;
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ union {
    typename Sort::TempStorage sort;
    typename Scan::TempStorage scan;
  } cub_storage;
  __shared__ int is_outlier[kThreads];
  __shared__ uint32_t outliers[kThreads];
  __shared__ float inlier_keys[kQuantizeChunk][kThreads];  // outlier channels zeroed
  __shared__ float raw_keys[kQuantizeChunk][kThreads];
  QJLKV_DYNAMIC_SMEM(outlier_bits);  // [kQuantizeChunk][m_out / 8]: sign(S_out·k_out)
  const uint32_t tid = threadIdx.x, lane = tid & 31u, d = s.d, B = s.B, c = s.outlier_channels;

  is_outlier[tid] = 0;
  if (c > 0) {
    // Channel energies Σ_t k_tj², then the c largest (ties: lower channel) through a block sort.
    float energy = 0.0f;
    if (tid < d)
      for (uint32_t t = 0; t < B; ++t) {
        const float x = src.key(t, tid);
        energy = __fadd_rn(energy, __fmul_rn(x, x));
      }
    unsigned long long sort_key[1] = {tid < d ? outlier_sort_key(energy, tid) : 0ull};
    Sort(cub_storage.sort).SortDescending(sort_key);
    __syncthreads();
    if (tid < c) is_outlier[outlier_sort_channel(sort_key[0])] = 1;
    __syncthreads();
    // Stored ascending: each outlier channel's slot is the number of outlier channels below it.
    const int flag = is_outlier[tid];
    int slot = 0;
    Scan(cub_storage.scan).ExclusiveSum(flag, slot);
    if (flag) {
      outliers[slot] = tid;
      block[s.key_outlier_idx + slot] = uint8_t(tid);
    }
  }
  __syncthreads();

  auto *norm_in = reinterpret_cast<uint16_t *>(block + s.key_norm_in);
  auto *norm_out = reinterpret_cast<uint16_t *>(block + s.key_norm_out);
  auto *corrections = reinterpret_cast<uint16_t *>(block + s.key_corrections);
  const uint32_t outlier_bytes = s.m_out / 8;
  const float *sketch_t = s.sketch_t;
  const uint32_t rows = s.sketch_rows;
  for (uint32_t t0 = 0; t0 < B; t0 += kQuantizeChunk) {  // B is a multiple of 8
    for (uint32_t i = tid; i < kQuantizeChunk * d; i += kThreads) {
      const uint32_t tt = i / d, j = i % d;
      const float x = src.key(t0 + tt, j);
      raw_keys[tt][j] = x;
      inlier_keys[tt][j] = is_outlier[j] ? 0.0f : x;
    }
    __syncthreads();
    if (tid < kQuantizeChunk) {
      float norm2 = 0.0f;
      for (uint32_t j = 0; j < d; ++j) norm2 = __fadd_rn(norm2, __fmul_rn(inlier_keys[tid][j], inlier_keys[tid][j]));
      norm_in[t0 + tid] = float_to_half(sqrtf(norm2));
    } else if (c > 0 && tid >= 32 && tid < 32 + kQuantizeChunk) {
      const uint32_t tt = tid - 32;
      float norm2 = 0.0f;
      for (uint32_t i = 0; i < c; ++i) {
        const float x = raw_keys[tt][outliers[i]];
        norm2 = __fadd_rn(norm2, __fmul_rn(x, x));
      }
      norm_out[t0 + tt] = float_to_half(sqrtf(norm2));
    }
    // Sign bits of n_rows sketch rows over the channels channel(0..n_channels-1) of keys: thread i
    // projects the chunk's tokens on sketch row i; a warp ballot packs 8 rows per byte (bit j of
    // byte b = row 8b + j) into the chunk's rows of bytes_per_token bytes at `bits`.
    const auto pack_signs = [&](uint32_t n_rows, uint32_t n_channels, auto channel,
                                const float (&keys)[kQuantizeChunk][kThreads], uint8_t *bits,
                                uint32_t bytes_per_token) {
      for (uint32_t base = 0; base < n_rows; base += kThreads) {
        const uint32_t i = base + tid;
        float projection[kQuantizeChunk] = {};
        if (i < n_rows)
          for (uint32_t k = 0; k < n_channels; ++k) {
            const uint32_t j = channel(k);
            const float w = sketch_t[size_t(j) * rows + i];
#pragma unroll
            for (uint32_t tt = 0; tt < kQuantizeChunk; ++tt)
              projection[tt] = __fadd_rn(projection[tt], __fmul_rn(w, keys[tt][j]));
          }
#pragma unroll
        for (uint32_t tt = 0; tt < kQuantizeChunk; ++tt) {
          const uint32_t positive = __ballot_sync(0xffffffffu, i < n_rows && projection[tt] > 0.0f);
          if (i < n_rows && (lane & 7u) == 0) bits[size_t(tt) * bytes_per_token + i / 8] = uint8_t(positive >> lane);
        }
      }
    };
    uint8_t *bits_in = block + s.key_bits_in;
    pack_signs(s.m, d, [](uint32_t k) { return k; }, inlier_keys, bits_in + size_t(t0) * s.bits_in_bpt,
               s.bits_in_bpt);
    if (c > 0) {
      pack_signs(s.m_out, c, [&](uint32_t k) { return outliers[k]; }, raw_keys, outlier_bits, outlier_bytes);
      __syncthreads();  // the chunk's norms and bits are written
      // The corrections (QjlKeys::store_corrections), one thread per (outlier, token). Column o of
      // the sketch is row o of sketch_t: column_signed_sum reads it as a [rows][1] matrix.
      for (uint32_t pair = tid; pair < c * kQuantizeChunk; pair += kThreads) {
        const uint32_t j = pair / kQuantizeChunk, tt = pair % kQuantizeChunk, t = t0 + tt;
        const float *column = sketch_t + size_t(outliers[j]) * rows;
        const int64_t inlier_sum = column_signed_sum(column, 1, 0, bits_in + size_t(t) * s.bits_in_bpt, s.m);
        const int64_t outlier_sum = column_signed_sum(column, 1, 0, outlier_bits + tt * outlier_bytes, s.m_out);
        corrections[size_t(j) * B + t] = qjl_correction(s.qjl_constant, half_to_float(norm_in[t]),
                                                        half_to_float(norm_out[t]), inlier_sum, outlier_sum, s.m,
                                                        s.m_out);
      }
    }
    __syncthreads();
  }
}

// KIVI keys (CPU: kivi_quantize_block): per channel over the block's tokens.
template <class IO>
__device__ void quantize_kivi_keys(const KernelShape &s, const BlockSource<IO> &src, uint8_t *block) {
  __shared__ float channel_scale[kThreads], channel_min[kThreads];
  const uint32_t tid = threadIdx.x, d = s.d, B = s.B, bits = s.key_bits;
  if (tid < d) {
    float lo = src.key(0, tid), hi = lo;
    for (uint32_t t = 1; t < B; ++t) kivi_minmax_step(src.key(t, tid), lo, hi);
    const GroupQuant q = group_quant(lo, hi, bits);
    reinterpret_cast<uint16_t *>(block + s.key_scale)[tid] = q.scale_bits;
    reinterpret_cast<uint16_t *>(block + s.key_min)[tid] = q.min_bits;
    channel_scale[tid] = q.scale;
    channel_min[tid] = q.min;
  }
  __syncthreads();
  const uint32_t eights = d / 8;
  for (uint32_t i = tid; i < B * eights; i += kThreads) {
    const uint32_t t = i / eights, g8 = i % eights;
    uint64_t packed = 0;
    for (uint32_t k = 0; k < 8; ++k) {
      const uint32_t j = 8 * g8 + k;
      GroupQuant q{};
      q.scale = channel_scale[j];
      q.min = channel_min[j];
      packed |= uint64_t(quant_code(src.key(t, j), q, bits)) << (k * bits);
    }
    store_codes8(block + s.key_codes + size_t(t) * s.key_codes_bpt, g8, bits, packed);
  }
}

template <class IO>
__device__ void store_exact_keys(const KernelShape &s, const BlockSource<IO> &src, uint8_t *block) {
  auto *dst = reinterpret_cast<uint16_t *>(block + s.key_codes);
  for (uint32_t i = threadIdx.x; i < s.B * s.d; i += kThreads)
    dst[i] = float_to_stored16<IO::stored_bf16>(src.key(i / s.d, i % s.d));
}

// grid (jobs, kv heads): one CTA quantizes one head of one block.
template <class IO, KeyKind KIND, class VALUES>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const KernelShape s, const QuantJob *jobs) {
  const QuantJob job = jobs[blockIdx.x];
  const BlockSource<IO> src{job, s, blockIdx.y};
  uint8_t *block = job.slot + size_t(blockIdx.y) * s.head_stride;
  if (job.copy) save_rows<IO>(s, src);
  // Zero the whole block first, padding included, like the CPU backend.
  for (uint32_t i = threadIdx.x; i < s.head_stride / 16; i += kThreads)
    reinterpret_cast<uint4 *>(block)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  if constexpr (KIND == KeyKind::qjl) quantize_qjl_keys<IO>(s, src, block);
  if constexpr (KIND == KeyKind::kivi) quantize_kivi_keys<IO>(s, src, block);
  if constexpr (KIND == KeyKind::exact) store_exact_keys<IO>(s, src, block);
  __syncthreads();
  VALUES::template quantize<IO::stored_bf16>(s, src, block);
}

// ---- OTT: outlier-token tracing (the steps of src/methods/ott_tracing.hpp), then KIVI -------------
// One CTA per (sequence, kv head) walks the sequence's new blocks in order, since each block's
// tracing starts from the pool the previous one left. The state is updated in `to`, a copy of the
// committed state, so a rejected append leaves the committed state as it was.
template <class IO>
__device__ void trace_block(const KernelShape &s, const BlockSource<IO> &src, uint8_t *state, uint8_t *block,
                            uint8_t *smem, uint32_t *entering_count) {
  using T = typename IO::type;
  const OttSmem L = ott_smem(s.B, s.ott_pool, s.d);
  const uint32_t tid = threadIdx.x, d = s.d, B = s.B, P = s.ott_pool;
  auto *header = reinterpret_cast<uint32_t *>(state);
  auto *positions = reinterpret_cast<uint32_t *>(state + s.ott.positions);
  auto *norms = reinterpret_cast<float *>(state + s.ott.norms);
  auto *keys = reinterpret_cast<T *>(state + s.ott.keys);
  auto *values = reinterpret_cast<T *>(state + s.ott.values);
  auto *token_norm = reinterpret_cast<float *>(smem + L.norms);
  auto *candidate = reinterpret_cast<unsigned long long *>(smem + L.keys);
  auto *rank = reinterpret_cast<uint32_t *>(smem + L.ranks);
  uint8_t *moved = smem + L.moved;
  auto *mean_key = reinterpret_cast<float *>(smem + L.mean_key);
  auto *mean_value = reinterpret_cast<float *>(smem + L.mean_value);
  const uint32_t pool = header[0], spilled = header[1], first_position = s.sinks + src.job.first_pos;
  if (tid == 0) *entering_count = 0;
  for (uint32_t t = tid; t < B; t += kThreads)
    token_norm[t] = ott::key_norm([&](uint32_t j) { return src.raw_key(t, j); }, d);
  __syncthreads();
  // Candidates: the pool, then the block; a candidate's rank is its place in candidate order.
  const uint32_t n = pool + B;
  for (uint32_t c = tid; c < n; c += kThreads)
    candidate[c] = c < pool ? ott::candidate_key(norms[c], positions[c])
                            : ott::candidate_key(token_norm[c - pool], first_position + (c - pool));
  __syncthreads();
  for (uint32_t c = tid; c < n; c += kThreads) {
    const unsigned long long me = candidate[c];
    uint32_t r = 0;
    for (uint32_t k = 0; k < n; ++k) r += candidate[k] < me;
    rank[c] = r;
    if (c >= pool && r < P) atomicAdd(entering_count, 1u);
  }
  __syncthreads();
  const ott::PoolChange change = ott::pool_change(pool, P, *entering_count);
  const uint32_t entering = change.entering, kept = change.kept;
  if (!ott::spill_takes(spilled, change.evicted, s.ott_spill)) {
    __syncthreads();
    if (tid == 0) header[2] = 0;
    return;
  }
  // The pool's slots move in slot order, as on the CPU: one thread per channel (and thread 0 for
  // positions and norms) copies slot after slot.
  if (tid < d) {
    ott::PoolCompaction compaction(P, spilled);
    for (uint32_t i = 0; i < pool; ++i) {
      const uint32_t to = compaction.next(rank[i] < P);
      keys[size_t(to) * d + tid] = keys[size_t(i) * d + tid];
      values[size_t(to) * d + tid] = values[size_t(i) * d + tid];
    }
  }
  if (tid == 0) {
    ott::PoolCompaction compaction(P, spilled);
    for (uint32_t i = 0; i < pool; ++i) {
      const uint32_t to = compaction.next(rank[i] < P);
      if (rank[i] < P) norms[to] = norms[i];
      positions[to] = positions[i];
    }
  }
  __syncthreads();
  // Entering block tokens join the pool with their exact key and value.
  for (uint32_t c = pool + tid; c < n; c += kThreads) {
    if (rank[c] >= P) continue;
    const uint32_t t = c - pool;
    uint32_t kept_below = 0;
    for (uint32_t i = 0; i < pool; ++i) kept_below += rank[i] < rank[c];
    const uint32_t slot = ott::entering_slot(kept, rank[c], kept_below);
    positions[slot] = first_position + t;
    norms[slot] = token_norm[t];
    const T *key_row = src.row(src.job.ring_k, src.job.in_k, t);
    const T *value_row = src.row(src.job.ring_v, src.job.in_v, t);
    for (uint32_t j = 0; j < d; ++j) {
      keys[size_t(slot) * d + j] = key_row[j];
      values[size_t(slot) * d + j] = value_row[j];
    }
    moved[t] = 1;
  }
  __syncthreads();
  if (tid == 0) {
    header[0] = kept + entering;
    header[1] = spilled + change.evicted;
  }
  if (entering == 0) return;
  // Their slots are masked out and quantized as the mean of the block's other tokens.
  if (tid < d) {
    const auto is_moved = [&](uint32_t t) { return moved[t] != 0; };
    mean_key[tid] = ott::mean_of_others([&](uint32_t t) { return src.raw_key(t, tid); }, is_moved, B, entering);
    mean_value[tid] = ott::mean_of_others([&](uint32_t t) { return src.raw_value(t, tid); }, is_moved, B, entering);
  }
  for (uint32_t byte = tid; byte < B / 8; byte += kThreads)
    block[s.key_mask + byte] = ott::mask_byte(moved + 8 * byte);
}

// The pool of one head's outlier state (header, and P slots of positions, norms, keys and
// values; not the spill area, which only grows) into a rollback copy's saved pool.
__device__ void save_pool(const KernelShape &s, const uint8_t *state, uint8_t *saved) {
  const uint32_t row_bytes = s.d * (s.dtype == QJLKV_DTYPE_F32 ? 4 : 2), P = s.ott_pool;
  const auto copy_words = [](const uint8_t *from, uint8_t *to, uint32_t bytes) {
    for (uint32_t i = threadIdx.x; i < bytes / 4; i += kThreads)
      reinterpret_cast<uint32_t *>(to)[i] = reinterpret_cast<const uint32_t *>(from)[i];
  };
  copy_words(state, saved, 16);
  copy_words(state + s.ott.positions, saved + s.ott_saved.positions, 4 * P);
  copy_words(state + s.ott.norms, saved + s.ott_saved.norms, 4 * P);
  copy_words(state + s.ott.keys, saved + s.ott_saved.keys, P * row_bytes);
  copy_words(state + s.ott.values, saved + s.ott_saved.values, P * row_bytes);
}

// grid (jobs, kv heads).
template <class IO, class VALUES>
__global__ void __launch_bounds__(kThreads) ott_quantize_kernel(const KernelShape s, const OttJob *jobs) {
  QJLKV_DYNAMIC_SMEM(smem);
  __shared__ uint32_t entering_count;
  const OttJob job = jobs[blockIdx.x];
  const uint32_t head = blockIdx.y, tid = threadIdx.x;
  const OttSmem L = ott_smem(s.B, s.ott_pool, s.d);
  uint8_t *state = job.to + size_t(head) * s.ott.bytes;
  if (job.fresh) {
    if (tid == 0) {
      auto *header = reinterpret_cast<uint32_t *>(state);
      header[0] = 0;  // pool
      header[1] = 0;  // spilled
      header[2] = 1;  // tracing
      header[3] = 0;
    }
  } else {
    const auto *from = reinterpret_cast<const uint4 *>(job.from + size_t(head) * s.ott.bytes);
    for (uint32_t i = tid; i < s.ott.bytes / 16; i += kThreads) reinterpret_cast<uint4 *>(state)[i] = from[i];
  }
  uint8_t *moved = smem + L.moved;
  for (uint32_t b = 0; b < job.n_blocks; ++b) {
    const QuantJob block_job = job.blocks[b];
    BlockSource<IO> src{block_job, s, head};
    uint8_t *block = block_job.slot + size_t(head) * s.head_stride;
    for (uint32_t i = tid; i < s.head_stride / 16; i += kThreads)
      reinterpret_cast<uint4 *>(block)[i] = make_uint4(0, 0, 0, 0);
    for (uint32_t t = tid; t < s.B; t += kThreads) moved[t] = 0;
    __syncthreads();
    if (block_job.copy) {  // the rows, and the pool that tracing this block starts from
      save_rows<IO>(s, src);
      save_pool(s, state, block_job.copy + s.copy.pools + size_t(head) * s.ott_saved.bytes);
    }
    const bool tracing = reinterpret_cast<const uint32_t *>(state)[2] != 0;
    __syncthreads();  // every thread has read the state before tracing changes it
    if (tracing) trace_block<IO>(s, src, state, block, smem, &entering_count);
    __syncthreads();
    src.moved = moved;
    src.mean_key = reinterpret_cast<const float *>(smem + L.mean_key);
    src.mean_value = reinterpret_cast<const float *>(smem + L.mean_value);
    quantize_kivi_keys<IO>(s, src, block);
    __syncthreads();
    VALUES::template quantize<IO::stored_bf16>(s, src, block);
    __syncthreads();
  }
}

// grid (jobs, kCommitSpread): block table entries, sinks and tail tokens of one sequence.
constexpr uint32_t kCommitSpread = 16;
__global__ void __launch_bounds__(kThreads) commit_kernel(const KernelShape s, const CommitJob *jobs) {
  const CommitJob job = jobs[blockIdx.x];
  const uint32_t first = blockIdx.y * kThreads + threadIdx.x, stride = kCommitSpread * kThreads;
  if (job.old_table)
    for (uint32_t i = first; i < job.n_old; i += stride) job.table[i] = job.old_table[i];
  for (uint32_t i = first; i < job.n_new; i += stride) job.table[job.n_old + i] = job.entries[i];
  const size_t words = size_t(s.Hkv) * s.d * (s.dtype == QJLKV_DTYPE_F32 ? 4 : 2) / 4;  // one token, all heads
  const size_t sink_words = size_t(job.n_sinks) * words;
  for (size_t i = first; i < sink_words; i += stride) {
    const size_t to = size_t(job.first_sink) * words + i;
    reinterpret_cast<uint32_t *>(job.sink_k)[to] = reinterpret_cast<const uint32_t *>(job.sink_in_k)[i];
    reinterpret_cast<uint32_t *>(job.sink_v)[to] = reinterpret_cast<const uint32_t *>(job.sink_in_v)[i];
  }
  const size_t total = size_t(job.n_tokens) * words;
  for (size_t i = first; i < total; i += stride) {
    const size_t k = i / words, w = i % words;
    const size_t slot = (size_t(job.first_pos) + k) % s.ring;
    const size_t from = (size_t(job.first_token) + k) * words + w;
    reinterpret_cast<uint32_t *>(job.ring_k)[slot * words + w] = reinterpret_cast<const uint32_t *>(job.in_k)[from];
    reinterpret_cast<uint32_t *>(job.ring_v)[slot * words + w] = reinterpret_cast<const uint32_t *>(job.in_v)[from];
  }
}

template <class IO>
cudaError_t launch_quantize_io(const KernelShape &s, const QuantJob *jobs, uint32_t n_jobs, cudaStream_t stream) {
  return with_value_policy(s.value_kind, [&](auto values) {
    using V = decltype(values);
    auto kernel = s.kind == KeyKind::qjl    ? quantize_kernel<IO, KeyKind::qjl, V>
                  : s.kind == KeyKind::kivi ? quantize_kernel<IO, KeyKind::kivi, V>
                                            : quantize_kernel<IO, KeyKind::exact, V>;
    QJLKV_LAUNCH(kernel, dim3(n_jobs, s.Hkv), kThreads, quantize_smem(s), stream, s, jobs);
    return cudaGetLastError();
  });
}

// Raises each kernel's dynamic shared memory limit to what the device allows next to its static
// shared memory (static and dynamic together must fit smem_optin); *max_dynamic receives the
// smallest of those limits.
template <class... Kernels>
cudaError_t raise_dynamic_smem(size_t smem_optin, size_t *max_dynamic, Kernels... kernels) {
  *max_dynamic = smem_optin;
  for (auto kernel : {kernels...}) {
    cudaFuncAttributes attributes;
    cudaError_t e = cudaFuncGetAttributes(&attributes, kernel);
    if (e != cudaSuccess) return e;
    const size_t dynamic = smem_optin > attributes.sharedSizeBytes ? smem_optin - attributes.sharedSizeBytes : 0;
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dynamic));
    if (e != cudaSuccess) return e;
    if (dynamic < *max_dynamic) *max_dynamic = dynamic;
  }
  return cudaSuccess;
}

template <class IO>
cudaError_t launch_validate_io(const KernelShape &s, const void *keys, const void *values, size_t elements,
                               float key_limit, float value_limit, double key_norm_limit, double value_norm_limit,
                               unsigned long long *flags, cudaStream_t stream) {
  using T = typename IO::type;
  const size_t wanted = (elements + kThreads - 1) / kThreads;
  const uint32_t blocks = uint32_t(wanted < 1 ? 1 : wanted > 2048 ? 2048 : wanted);
  auto kernel = validate_kernel<IO>;
  QJLKV_LAUNCH(kernel, blocks, kThreads, 0, stream, static_cast<const T *>(keys), static_cast<const T *>(values),
               elements, key_limit, value_limit, key_norm_limit, value_norm_limit, s.d, flags);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_validate(const KernelShape &s, const void *keys, const void *values, size_t elements,
                            float key_limit, float value_limit, double key_norm_limit, double value_norm_limit,
                            unsigned long long *flags, cudaStream_t stream) {
  switch (s.dtype) {
    case QJLKV_DTYPE_F32:
      return launch_validate_io<IoF32>(s, keys, values, elements, key_limit, value_limit, key_norm_limit,
                                       value_norm_limit, flags, stream);
    case QJLKV_DTYPE_F16:
      return launch_validate_io<IoF16>(s, keys, values, elements, key_limit, value_limit, key_norm_limit,
                                       value_norm_limit, flags, stream);
    case QJLKV_DTYPE_BF16:
      return launch_validate_io<IoBF16>(s, keys, values, elements, key_limit, value_limit, key_norm_limit,
                                        value_norm_limit, flags, stream);
  }
  return cudaErrorInvalidValue;  // unreachable: the dtype was validated
}

cudaError_t launch_quantize(const KernelShape &s, const QuantJob *jobs, uint32_t n_jobs, cudaStream_t stream) {
  if (n_jobs == 0) return cudaSuccess;
  switch (s.dtype) {
    case QJLKV_DTYPE_F32: return launch_quantize_io<IoF32>(s, jobs, n_jobs, stream);
    case QJLKV_DTYPE_F16: return launch_quantize_io<IoF16>(s, jobs, n_jobs, stream);
    case QJLKV_DTYPE_BF16: return launch_quantize_io<IoBF16>(s, jobs, n_jobs, stream);
  }
  return cudaErrorInvalidValue;  // unreachable: the dtype was validated
}

size_t quantize_smem(const KernelShape &s) { return s.kind == KeyKind::qjl ? size_t(kQuantizeChunk) * s.m_out / 8 : 0; }

cudaError_t configure_qjl_quantize(size_t smem_optin, size_t *max_dynamic) {
  return raise_dynamic_smem(
      smem_optin, max_dynamic, quantize_kernel<IoF32, KeyKind::qjl, UniformValues>,
      quantize_kernel<IoF16, KeyKind::qjl, UniformValues>, quantize_kernel<IoBF16, KeyKind::qjl, UniformValues>,
      quantize_kernel<IoF32, KeyKind::qjl, Stored16Values>, quantize_kernel<IoF16, KeyKind::qjl, Stored16Values>,
      quantize_kernel<IoBF16, KeyKind::qjl, Stored16Values>, quantize_kernel<IoF32, KeyKind::qjl, LloydMaxValues>,
      quantize_kernel<IoF16, KeyKind::qjl, LloydMaxValues>, quantize_kernel<IoBF16, KeyKind::qjl, LloydMaxValues>);
}

size_t ott_quantize_smem(const KernelShape &s) { return ott_smem(s.B, s.ott_pool, s.d).total; }

cudaError_t configure_ott_quantize(size_t smem_optin, size_t *max_dynamic) {
  return raise_dynamic_smem(smem_optin, max_dynamic, ott_quantize_kernel<IoF32, UniformValues>,
                            ott_quantize_kernel<IoF16, UniformValues>, ott_quantize_kernel<IoBF16, UniformValues>,
                            ott_quantize_kernel<IoF32, Stored16Values>, ott_quantize_kernel<IoF16, Stored16Values>,
                            ott_quantize_kernel<IoBF16, Stored16Values>, ott_quantize_kernel<IoF32, LloydMaxValues>,
                            ott_quantize_kernel<IoF16, LloydMaxValues>, ott_quantize_kernel<IoBF16, LloydMaxValues>);
}

cudaError_t launch_ott_quantize(const KernelShape &s, const OttJob *jobs, uint32_t n_jobs, cudaStream_t stream) {
  if (n_jobs == 0) return cudaSuccess;
  return with_value_policy(s.value_kind, [&](auto values) {
    using V = decltype(values);
    auto kernel = s.dtype == QJLKV_DTYPE_F32   ? ott_quantize_kernel<IoF32, V>
                  : s.dtype == QJLKV_DTYPE_F16 ? ott_quantize_kernel<IoF16, V>
                                               : ott_quantize_kernel<IoBF16, V>;
    QJLKV_LAUNCH(kernel, dim3(n_jobs, s.Hkv), kThreads, ott_quantize_smem(s), stream, s, jobs);
    return cudaGetLastError();
  });
}

cudaError_t launch_commit(const KernelShape &s, const CommitJob *jobs, uint32_t n_jobs, cudaStream_t stream) {
  if (n_jobs == 0) return cudaSuccess;
  auto kernel = commit_kernel;
  QJLKV_LAUNCH(kernel, dim3(n_jobs, kCommitSpread), kThreads, 0, stream, s, jobs);
  return cudaGetLastError();
}

cudaError_t probe_kernels() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, commit_kernel);
}

}  // namespace qjlkv::cuda
