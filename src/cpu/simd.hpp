// The fast CPU kernels, compiled once per instruction set (simd_scalar.cpp, simd_avx2.cpp,
// simd_avx512.cpp from the one template source simd_impl.inc and the methods' cpu_simd.inc; the
// methods' cpu_avx512_vnni.cpp) and chosen at run time (isa.hpp), one group per method.
// They compute what the reference kernels of kernels.hpp compute, within float tolerance, except
// the QJL sign bits, which are bit-identical (same fp32 sums in the same order, no FMA).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../config.hpp"
#include "../methods/mixed/mixed_math.hpp"
#include "../rotation.hpp"
#include "isa.hpp"
#include "kernels.hpp"

namespace qjlkv::cpu {

// Decode reads a head's blocks in order, each right after the previous one in memory, and the
// hardware prefetchers alone left the kernels waiting on memory (a q3 step at 32k tokens about
// 2x slower). So every decode kernel requests the next block's copy of the bytes it reads, one
// stride ahead: the integer kernels a few lines at a time as they go, the others up front. Each
// software prefetch holds one of the core's few L1 miss buffers until its line arrives, and one
// that finds none free stalls the core: half a block at once made kivi at 32k ≈ 12 % slower and
// q4 ≈ 20 %, and with 32 tokens' value codes at once 18 % of the samples of q4's value sums fell
// on the instruction after a prefetch (docs/PERFORMANCE.md, "Tried and not kept"). Blocks
// over kPrefetchedBlockBytes (16-bit keys) are left to the hardware, which streams them at full
// rate. The last block of a run prefetches past it: prefetches never fault, so the address is
// formed as an integer, not as a pointer past the buffer.
constexpr size_t kPrefetchedBlockBytes = 16384;
inline void prefetch_next_block(const BlockLayout &l, const void *from, size_t bytes) {
  if (l.stride > kPrefetchedBlockBytes || bytes == 0) return;
  const uintptr_t start = reinterpret_cast<uintptr_t>(from) + l.stride;
  for (uintptr_t line = start & ~uintptr_t(63); line < start + bytes; line += 64)
    __builtin_prefetch(reinterpret_cast<const void *>(line));
}

// The integer QJL kernels look up, per sign byte of a token (8 sketch rows: the low nibble rows
// 0-3, the high nibble rows 4-7), the subset sums of the 8 rows' integer codes X, |X| <=
// kQjlCodeMax (4·8191 < 2^15: a sum of 4 fits int16), in the kernel's layout of a SignTable:
// - QuadBytes (avx512vnni, vpermb): a pair of tables per pair of sign bytes 2b, 2b + 1 (16 rows;
//   nibble p = 0..3: byte 2b's low, its high, byte 2b + 1's low, its high). Entry 16p + e is
//   T_p[e], the sum of X_4p..X_4p+3 over the set bits of e, as bytes: table 2b holds its low
//   byte (unsigned), table 2b + 1 its high byte (signed), T = 256·high + low.
// - SplitBytes (avx2, vpshufb): U = T + kQjlSplitBias in [4, 65532] split into bytes, split[0][e]
//   and split[2][e] the low and high byte of T0[e]'s, split[1][e] and split[3][e] of T1[e]'s.
constexpr float kQjlCodeMax = 8191.0f;
constexpr int32_t kQjlSplitBias = 32768;
// Whether the integer QJL kernel takes sign rows of this count: a power-of-two number of 32-bit
// words, at most 16.
inline bool qjl_integer_rows(uint32_t rows) {
  const uint32_t words = rows / 32;
  return rows % 32 == 0 && words >= 1 && words <= 16 && (words & (words - 1)) == 0;
}

// One sign byte's table of subset sums, in a kernel's layout (above).
struct alignas(64) SignTable {
  union {
    uint8_t bytes[64];
    uint8_t split[4][16];
  };
};

// What make_qjl_args builds for one QJL layer and its arguments point into.
struct QjlTables {
  std::vector<float> sketch_t;
};

// One quantized QJL block layout plus the layer's transposed sketch (make_qjl_args).
struct QjlArgs {
  const BlockLayout *layout = nullptr;
  uint32_t block_tokens = 0, head_dim = 0, m = 0, m_out = 0;
  uint32_t outlier_channels = 0;  // c, 0 where the layer has no outlier sketch
  const float *sketch_t = nullptr;  // [head_dim][sketch_t_stride]: S transposed, rows zero-padded
  size_t sketch_t_stride = 0;       // >= sketch_rows, a multiple of 32
  size_t projected_stride = 0;      // qjl_project's rows: sketch_t_stride + 2·padded_sketch_rows(m) + 16
  float in_factor = 0.0f;           // c_d/m
};
// Whether the integer QJL kernels take the layer's sign rows (otherwise the fp32 kernels do).
inline bool qjl_integer_layer(const QjlArgs &a) { return qjl_integer_rows(a.m); }
// What an integer kernel's qjl_project keeps of row r of `sq` after S·q: from sketch_t_stride
// on, the sign tables of the row's codes X (m/8, in the kernel's layout), and in the
// row's last 16 floats the codes' step (float 0) and Σ X (float 2, an int32's bytes).
struct ProjectedRow {
  const SignTable *tables;
  float step;
  int32_t sum;
};
inline ProjectedRow projected_row(const QjlArgs &a, const float *sq, uint32_t r) {
  const float *row = sq + size_t(r) * a.projected_stride;
  const float *tail = row + a.projected_stride - 16;
  int32_t sum;
  std::memcpy(&sum, tail + 2, sizeof sum);
  return {reinterpret_cast<const SignTable *>(row + a.sketch_t_stride), tail[0], sum};
}
inline void store_projected_tail(const QjlArgs &a, float *sq, uint32_t r, float step, int32_t sum) {
  float *tail = sq + size_t(r + 1) * a.projected_stride - 16;
  tail[0] = step;
  std::memcpy(tail + 2, &sum, sizeof sum);
}

// The arguments of one QJL layer; fills `tables` with the layer's sketch transposed.
QjlArgs make_qjl_args(const CacheSpec &spec, const LayerSpec &layer, QjlTables &tables);

struct CodesArgs {  // KIVI/OTT keys or quantized values of one block
  const BlockLayout *layout = nullptr;
  uint32_t block_tokens = 0, head_dim = 0, bits = 0, group = 0;  // group: uniform values only
  qjlkv_dtype stored = QJLKV_DTYPE_F16;                         // values with bits == 16
  const float *signs = nullptr;                                  // rotated Lloyd-Max: the rotation's s
};

// The fast kernels of one value method; each method has its own, so that none asks which
// method's block it reads.
struct ValueKernels {
  // acc[r][d] += Σ_t w[r][t]·v̂_t over a block's quantized values, v̂_t as stored: rotated
  // Lloyd-Max values stay rotated, as in values_accumulate_block.
  void (*accumulate)(const CodesArgs &a, const uint8_t *block, const float *w, size_t w_stride, uint32_t rows,
                     float *acc, float *scratch);
  // accumulate may keep each row of acc in its own order of channels (a layer's blocks all the
  // same order; avx512vnni's 2-bit sums, which saves it a shuffle of every block's sums); this
  // puts the rows back in channel order, once after the last block. Between the two, acc may
  // only be scaled as a whole (softmax_fold) or added to by accumulate.
  void (*in_channel_order)(const CodesArgs &a, uint32_t rows, float *acc);
  // values_quantize_block of kernels.hpp, byte for byte (block zeroed).
  void (*quantize)(const CodesArgs &a, const float *values, uint8_t *block);
};

// Query rows and accumulator rows are padded_dim(d) floats apart (queries zero-padded).
// Scores are written to out[r * out_stride + t] and weights read from w[r * w_stride + t], with
// strides of at least padded_tokens(n): kernels may write scores past the block's last token.
// Every `scratch` holds at least kernel_scratch_floats(...) floats, 64-byte aligned.
inline constexpr uint32_t padded_dim(uint32_t d) { return (d + 15) / 16 * 16; }
inline constexpr uint32_t padded_tokens(uint32_t n) { return (n + 31) / 32 * 32; }
inline constexpr uint32_t padded_sketch_rows(uint32_t rows) { return (rows + 31) / 32 * 32; }

// The N bytes at p (N = 3 or 6) as a little-endian integer, without reading past them. Whole
// loads and shifts: a memcpy of 3 or 6 bytes into an integer went through the stack, and the wide
// reload after two narrow stores waited on store forwarding (3-bit value sums 8x slower on AVX2).
template <uint32_t N>
inline uint64_t load_bytes_le(const uint8_t *p) {
  static_assert(N == 3 || N == 6);
  uint16_t low2;
  if constexpr (N == 3) {
    std::memcpy(&low2, p, 2);
    return uint64_t(low2) | uint64_t(p[2]) << 16;
  } else {
    uint32_t low4;
    std::memcpy(&low4, p, 4);
    std::memcpy(&low2, p + 4, 2);
    return uint64_t(low4) | uint64_t(low2) << 32;
  }
}

// The integer kernels code x, |x| <= largest, as round(x·prescale·factor) in [-code_max, code_max].
// factor = code_max / largest alone overflows fp32 for largest below code_max / FLT_MAX (queries
// or weights of magnitude 1e-35): there x is first multiplied by prescale = 2^64, exactly, and
// factor divided by it. largest 0 (or NaN) gives factor 0: every code 0.
struct CodeScale {
  float prescale = 1.0f, factor = 0.0f;
};
inline CodeScale code_scale(float largest, float code_max) {
  if (!(largest > 0.0f)) return {};
  const float prescale = largest < 0x1p-64f ? 0x1p64f : 1.0f;
  return {prescale, code_max / (largest * prescale)};
}

// The kernel table holds one group of fast kernels per key or value method (each method's
// src/methods/<method>/cpu_simd.inc and per-ISA files build its group), then the ones they share.
struct QjlKernels {
  // sq[r * projected_stride + i] = <S_i, q_r> for every sketch row i (and 0 in the padding up
  // to sketch_t_stride); the integer paths keep their per-call quantization of the row in the
  // rest of it.
  void (*project)(const QjlArgs &a, const float *q, uint32_t rows, float *sq);
  void (*scores)(const QjlArgs &a, const uint8_t *block, const float *q, const float *sq, uint32_t rows, float *out,
                 size_t out_stride, float *scratch);
  // Sign bits of n_out projections for n keys: bit i of row t = (Σ_j keys[t][j]·st_rows[j][i] > 0),
  // summed in order j = 0..n_channels-1 in fp32 without FMA (the reference order).
  void (*sign_bits)(const float *keys, size_t key_stride, uint32_t n, const float *const *st_rows,
                    uint32_t n_channels, uint32_t n_out, uint8_t *bits, size_t bits_stride);
};

struct KiviKernels {  // KIVI and OTT keys
  void (*scores)(const CodesArgs &a, const uint8_t *block, const float *q, uint32_t rows, float *out,
                 size_t out_stride, float *scratch);
  // kivi_quantize_block of kernels.hpp, byte for byte (block zeroed).
  void (*quantize)(const CodesArgs &a, const float *keys, uint8_t *block);
};

// Mixed-bit keys (CodesArgs: layout, block_tokens, head_dim; a row's bytes are the layout's
// key_bytes_per_token_codes).
struct MixedKernels {
  void (*scores)(const CodesArgs &a, const uint8_t *block, const float *q, uint32_t rows, float *out,
                 size_t out_stride, float *scratch);
  // MixedKeys::quantize_block, byte for byte (block zeroed).
  void (*quantize)(const CodesArgs &a, const float *keys, uint8_t *block);
};

// Full-precision rows (exact keys, 16-bit values, the exact tokens of any method): rows of
// `dtype` elements, `row_stride` elements apart.
struct DenseKernels {
  void (*scores)(const void *keys, qjlkv_dtype dtype, size_t row_stride, uint32_t n, uint32_t d, const float *q,
                 uint32_t rows, float *out, size_t out_stride);
  void (*values)(const void *values, qjlkv_dtype dtype, size_t row_stride, uint32_t n, uint32_t d, const float *w,
                 size_t w_stride, uint32_t rows, float *acc);
};

struct KernelTable {
  Isa isa;
  QjlKernels qjl;
  KiviKernels kivi;
  MixedKernels mixed;
  DenseKernels dense;
  ValueKernels uniform_values;    // bits 2, 3, 4, 8 or 16
  ValueKernels lloyd_max_values;  // bits 2, 3 or 4
  // ---- appending: the reference quantizers' exact results, vectorized ----
  // dst[i] = element first + i of src (dtype), for i < n.
  void (*load_floats)(const void *src, qjlkv_dtype dtype, size_t first, size_t n, float *dst);
  // The first index i < n whose element is not finite or exceeds limit in magnitude; n if none.
  size_t (*first_invalid)(const void *src, qjlkv_dtype dtype, size_t n, float limit);
  // Σ_j x_j² over elements first..first+n-1 of src, in float (for a quick range check).
  float (*sum_squares)(const void *src, qjlkv_dtype dtype, size_t first, uint32_t n);
  // dst[i] = to_16bit(src[i], stored) of kernels.hpp (round to nearest even; finite inputs).
  void (*store_16bit)(const float *src, size_t n, qjlkv_dtype stored, uint16_t *dst);
  // softmax_fold of kernels.hpp on scale·scores (-inf = masked) for each of `rows` rows.
  // Returns false when every score of every row is masked.
  bool (*softmax_fold)(SoftmaxRow *state, float *scores, size_t stride, uint32_t rows, uint32_t n, float scale,
                       float *acc, uint32_t d);
  // rotate_inverse of lloyd_max.hpp in place (x = diag(signs)·H·x), the sums in another order.
  void (*rotate_inverse)(const float *signs, uint32_t d, float *x);
};

const KernelTable &kernel_table(Isa isa);
// The reference quantizers (kernels.hpp) on CodesArgs: the fast kernels' fallback for layouts
// their vectors do not cover.
void uniform_values_quantize_reference(const CodesArgs &a, const float *values, uint8_t *block);
void lloyd_max_values_quantize_reference(const CodesArgs &a, const float *values, uint8_t *block);
void kivi_quantize_block_reference(const CodesArgs &a, const float *keys, uint8_t *block);
void mixed_quantize_block_reference(const CodesArgs &a, const float *keys, uint8_t *block);
// MixedKeys::choose_widths: the widths of d channels of these ranges (width[] zeroed).
void mixed_choose_widths(uint32_t d, uint32_t token_bits, const float *range, uint32_t *width);
const KernelTable &scalar_kernels();
const KernelTable &avx2_kernels();
const KernelTable &avx512_kernels();
const KernelTable &avx512_vnni_kernels();  // avx512 with integer decode kernels
// The integer QJL paths' shared steps (x86-64 only): S·q in fp32 on AVX-512 (the fp32 kernels' qjl_project;
// the sums in the same order at every width), and the SplitBytes codes of its rows on AVX2.
void qjl_project_avx512(const QjlArgs &a, const float *q, uint32_t rows, float *sq);
void qjl_code_rows_avx2(const QjlArgs &a, uint32_t rows, float *sq);

// Scratch (floats) that the key scores and the values' accumulate need for one block.
size_t kernel_scratch_floats(const qjlkv_config &cfg, uint32_t m, uint32_t m_out);

}  // namespace qjlkv::cpu
