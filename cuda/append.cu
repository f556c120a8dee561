// Append kernels: data validation, block quantization (keys and values through their policy
// types, keys.cuh and values.cuh), OTT tracing and the commit of block tables and tail tokens.
// Compiled with --fmad=false: the quantizers reproduce the CPU backend's fp32 arithmetic operation
// by operation (and QJL's corrections, exact integer sums, through the same quant_math.hpp
// functions), so sign bits, norms, corrections, outlier channels and codes come out bit-identical.
#include "methods/ott_tracing.hpp"
#include "policies.cuh"

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

// grid (jobs, kv heads): one CTA quantizes one head of one block.
template <class IO, class KEYS, class VALUES>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const KernelShape s, const QuantJob *jobs) {
  const QuantJob job = jobs[blockIdx.x];
  const BlockSource<IO> src{job, s, blockIdx.y};
  uint8_t *block = job.slot + size_t(blockIdx.y) * s.head_stride;
  if (job.copy) save_rows<IO>(s, src);
  // Zero the whole block first, padding included, like the CPU backend.
  for (uint32_t i = threadIdx.x; i < s.head_stride / 16; i += kThreads)
    reinterpret_cast<uint4 *>(block)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  KEYS::template quantize<IO::stored_bf16>(s, src, block);
  __syncthreads();
  VALUES::template quantize<IO::stored_bf16>(s, src, block);
}

// ---- OTT: outlier-token tracing (the steps of src/methods/ott_tracing.hpp), then OttKeys ----------
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
    block[s.layout.key_mask + byte] = ott::mask_byte(moved + 8 * byte);
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
    OttKeys::quantize<IO::stored_bf16>(s, src, block);
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
  return with_policies(s, [&](auto keys, auto values) {
    auto kernel = quantize_kernel<IO, decltype(keys), decltype(values)>;
    QJLKV_LAUNCH(kernel, dim3(n_jobs, s.Hkv), kThreads, quantize_smem(s), stream, s, jobs);
    return cudaGetLastError();
  });
}

// Raises a kernel's dynamic shared memory limit to what the device allows next to its static
// shared memory (static and dynamic together must fit smem_optin); *max_dynamic receives it.
template <class Kernel>
cudaError_t raise_dynamic_smem(size_t smem_optin, size_t *max_dynamic, Kernel kernel) {
  cudaFuncAttributes attributes;
  cudaError_t e = cudaFuncGetAttributes(&attributes, kernel);
  if (e != cudaSuccess) return e;
  const size_t dynamic = smem_optin > attributes.sharedSizeBytes ? smem_optin - attributes.sharedSizeBytes : 0;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dynamic));
  if (e != cudaSuccess) return e;
  *max_dynamic = dynamic;
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

size_t quantize_smem(const KernelShape &s) {
  return with_key_policy(s.key_method, [&](auto keys) { return decltype(keys)::quantize_smem(s); });
}

cudaError_t configure_quantize(const KernelShape &s, size_t smem_optin, size_t *max_dynamic) {
  return with_policies(s, [&](auto keys, auto values) {
    using K = decltype(keys);
    using V = decltype(values);
    auto kernel = s.dtype == QJLKV_DTYPE_F32   ? quantize_kernel<IoF32, K, V>
                  : s.dtype == QJLKV_DTYPE_F16 ? quantize_kernel<IoF16, K, V>
                                               : quantize_kernel<IoBF16, K, V>;
    return raise_dynamic_smem(smem_optin, max_dynamic, kernel);
  });
}

size_t ott_quantize_smem(const KernelShape &s) { return ott_smem(s.B, s.ott_pool, s.d).total; }

cudaError_t configure_ott_quantize(const KernelShape &s, size_t smem_optin, size_t *max_dynamic) {
  return with_value_policy(s, [&](auto values) {
    using V = decltype(values);
    auto kernel = s.dtype == QJLKV_DTYPE_F32   ? ott_quantize_kernel<IoF32, V>
                  : s.dtype == QJLKV_DTYPE_F16 ? ott_quantize_kernel<IoF16, V>
                                               : ott_quantize_kernel<IoBF16, V>;
    return raise_dynamic_smem(smem_optin, max_dynamic, kernel);
  });
}

cudaError_t launch_ott_quantize(const KernelShape &s, const OttJob *jobs, uint32_t n_jobs, cudaStream_t stream) {
  if (n_jobs == 0) return cudaSuccess;
  return with_value_policy(s, [&](auto values) {
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
