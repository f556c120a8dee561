// The CUDA policy of QJL keys (cuda/key_policy.cuh says what a key policy provides).
#pragma once
#include "../../../cuda/key_policy.cuh"

namespace qjlkv::cuda {

// QJL keys (src/methods/qjl/qjl_keys.hpp): per token the sign bits of the sketched inlier key, the
// fp16 norms of its inlier and outlier parts, and fp16 corrections τ on the block's c outlier
// channels. Raw score: c_d/m·n_in·⟨S·q, ±bits_in⟩ + (n_in + n_out)·Σ_j q[o_j]·τ_j.
struct QjlKeys : KeyPolicyDefaults {
  static constexpr bool kTwoSums = true;  // the sketch sum and the outlier corrections' sum

  // The CPU's qjl_quantize_block. Sums run sequentially in the CPU's order, without FMA.
  // Dynamic shared memory: the chunk's outlier sign bits (quantize_smem), which only the
  // corrections read: the block does not store them.
  template <bool, class Source>
  __device__ static void quantize(const KernelShape &s, const Source &src, uint8_t *block) {
    using Sort = cub::BlockRadixSort<unsigned long long, kQuantizeThreads, 1>;
    using Scan = cub::BlockScan<int, kQuantizeThreads>;
    __shared__ union {
      typename Sort::TempStorage sort;
      typename Scan::TempStorage scan;
    } cub_storage;
    __shared__ int is_outlier[kQuantizeThreads];
    __shared__ uint32_t outliers[kQuantizeThreads];
    __shared__ float inlier_keys[kQuantizeChunk][kQuantizeThreads];  // outlier channels zeroed
    __shared__ float raw_keys[kQuantizeChunk][kQuantizeThreads];
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
        block[s.layout.key_outlier_idx + slot] = uint8_t(tid);
      }
    }
    __syncthreads();

    auto *norm_in = reinterpret_cast<uint16_t *>(block + s.layout.key_norm_in);
    auto *norm_out = reinterpret_cast<uint16_t *>(block + s.layout.key_norm_out);
    auto *corrections = reinterpret_cast<uint16_t *>(block + s.layout.key_corrections);
    const uint32_t outlier_bytes = s.m_out / 8;
    const float *sketch_t = s.sketch_t;
    const uint32_t rows = s.sketch_rows;
    for (uint32_t t0 = 0; t0 < B; t0 += kQuantizeChunk) {  // B is a multiple of 8
      for (uint32_t i = tid; i < kQuantizeChunk * d; i += kQuantizeThreads) {
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
                                  const float (&keys)[kQuantizeChunk][kQuantizeThreads], uint8_t *bits,
                                  uint32_t bytes_per_token) {
        for (uint32_t base = 0; base < n_rows; base += kQuantizeThreads) {
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
      uint8_t *bits_in = block + s.layout.key_bits_in;
      const size_t bits_bpt = s.layout.key_bytes_per_token_bits_in;
      pack_signs(s.m, d, [](uint32_t k) { return k; }, inlier_keys, bits_in + t0 * bits_bpt, uint32_t(bits_bpt));
      if (c > 0) {
        pack_signs(s.m_out, c, [&](uint32_t k) { return outliers[k]; }, raw_keys, outlier_bits, outlier_bytes);
        __syncthreads();  // the chunk's norms and bits are written
        // The corrections (store_corrections of src/methods/qjl/qjl_keys.hpp), one thread per (outlier, token). Column o of
        // the sketch is row o of sketch_t: column_signed_sum reads it as a [rows][1] matrix.
        for (uint32_t pair = tid; pair < c * kQuantizeChunk; pair += kQuantizeThreads) {
          const uint32_t j = pair / kQuantizeChunk, tt = pair % kQuantizeChunk, t = t0 + tt;
          const float *column = sketch_t + size_t(outliers[j]) * rows;
          const int64_t inlier_sum = column_signed_sum(column, 1, 0, bits_in + t * bits_bpt, s.m);
          const int64_t outlier_sum = column_signed_sum(column, 1, 0, outlier_bits + tt * outlier_bytes, s.m_out);
          corrections[size_t(j) * B + t] = qjl_correction(s.qjl_constant, half_to_float(norm_in[t]),
                                                          half_to_float(norm_out[t]), inlier_sum, outlier_sum, s.m,
                                                          s.m_out);
        }
      }
      __syncthreads();
    }
  }
  static size_t quantize_smem(const KernelShape &s) { return size_t(kQuantizeChunk) * s.m_out / 8; }

  template <uint32_t ROWS>
  struct Scorer {
    const KernelShape &s;
    const AttendSmem &L;
    const float *q;
    uint32_t d32, m32;
    float *sq;
    uint32_t *outliers;
    __device__ Scorer(const KernelShape &shape, const AttendSmem &layout, uint8_t *shared)
        : s(shape), L(layout), q(reinterpret_cast<const float *>(shared + layout.q)),
          d32(round_up(shape.d, 32)), m32(round_up(shape.m, 32)), sq(reinterpret_cast<float *>(shared + layout.sq)),
          outliers(reinterpret_cast<uint32_t *>(shared + layout.outlier)) {}

    // S·q once per CTA over the m inlier sketch rows (zero padding up to m32).
    __device__ void init() {
      for (uint32_t i = threadIdx.x; i < m32; i += kAttendThreads) {
        float acc[ROWS] = {};
        if (i < s.m)
          for (uint32_t j = 0; j < s.d; ++j) {
            const float w = __ldg(s.sketch_t + size_t(j) * s.sketch_rows + i);
#pragma unroll
            for (uint32_t r = 0; r < ROWS; ++r) acc[r] = fmaf(w, q[r * d32 + j], acc[r]);
          }
#pragma unroll
        for (uint32_t r = 0; r < ROWS; ++r) sq[r * m32 + i] = acc[r];
      }
      __syncthreads();
    }
    // The block's outlier channels.
    __device__ void setup_block(const uint8_t *block) {
      for (uint32_t i = threadIdx.x; i < s.outlier_channels; i += kAttendThreads)
        outliers[i] = block[s.layout.key_outlier_idx + i];
      __syncthreads();
    }
    __device__ void stage(uint8_t *stage_k, const uint8_t *block, uint32_t t0, uint32_t n) const {
      const uint32_t bits_bpt = uint32_t(s.layout.key_bytes_per_token_bits_in);
      copy_words(stage_k + L.k_norm_in, block + s.layout.key_norm_in + t0 * 2, n * 2, kAttendThreads);
      copy_words(stage_k + L.k_bits_in, block + s.layout.key_bits_in + t0 * bits_bpt, n * bits_bpt, kAttendThreads);
      if (s.outlier_channels) {
        copy_words(stage_k + L.k_norm_out, block + s.layout.key_norm_out + t0 * 2, n * 2, kAttendThreads);
        // Outlier j's corrections of tokens t0 .. t0 + n (n a multiple of 8: whole words).
        copy_rows(reinterpret_cast<uint32_t *>(stage_k + L.k_corrections), kTile / 2, n / 2, s.outlier_channels,
                  [&](uint32_t j) { return block + s.layout.key_corrections + (size_t(j) * s.B + t0) * 2; });
      }
    }
    template <bool BF16>
    __device__ void score(const uint8_t *stage_k, uint32_t lane, uint32_t warp, float (&acc_in)[ROWS],
                          float (&acc_out)[ROWS]) const {
      const uint32_t bits_bpt = uint32_t(s.layout.key_bytes_per_token_bits_in);
      const uint8_t *bits_in = stage_k + L.k_bits_in + lane * bits_bpt;
      const uint32_t words = div_up(s.m, 32);
      const bool aligned = bits_bpt % 4 == 0;
      for (uint32_t k = warp; k < words; k += kParts)
        accumulate_signs<ROWS>(load_word(bits_in + 4 * k, aligned), sq + 32 * k, m32, acc_in);
      const auto *corrections = reinterpret_cast<const uint16_t *>(stage_k + L.k_corrections) + lane;
      for (uint32_t j = warp; j < s.outlier_channels; j += kParts) {
        const float tau = fp16_bits_to_float(corrections[j * kTile]);
        const float *q_outlier = q + outliers[j];
#pragma unroll
        for (uint32_t r = 0; r < ROWS; ++r) acc_out[r] = fmaf(q_outlier[r * d32], tau, acc_out[r]);
      }
    }
    __device__ float token_score(const uint8_t *stage_k, const uint8_t *, uint32_t, uint32_t, uint32_t t, float sum_in,
                                 float sum_out) const {
      const float n_in = fp16_bits_to_float(reinterpret_cast<const uint16_t *>(stage_k + L.k_norm_in)[t]);
      float score = s.qjl_constant / float(s.m) * n_in * sum_in;
      if (s.outlier_channels) {
        const float n_out = fp16_bits_to_float(reinterpret_cast<const uint16_t *>(stage_k + L.k_norm_out)[t]);
        score += (n_in + n_out) * sum_out;
      }
      return score;
    }
  };
};

}  // namespace qjlkv::cuda
