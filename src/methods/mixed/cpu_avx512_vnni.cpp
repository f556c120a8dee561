// Mixed-bit key scores in integers on AVX-512 VNNI (vpdpbusd, vpermb, vpmultishiftqb), within the
// error budget of SPEC §9 (docs/DESIGN.md, "Integer decode paths"): KIVI's digit products
// (avx512_vnni.hpp's codes_scores) on codes that per-block tables unpack. The target pragma comes
// after every include (avx512_vnni_begin.inc).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "cpu_kernels.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "../../cpu/avx512_vnni_begin.inc"
#include "../../cpu/avx512_vnni.hpp"

namespace qjlkv::cpu::avx512_vnni {
namespace {

// Per block, each group of 64 channels gets a vpermb table, a vpmultishiftqb table and a mask, so
// that a token's codes unpack as KIVI's fixed-width ones do: one load of the row, vpermb,
// vpmultishiftqb, vpandq per 64 channels. Channel j's field starts at bit o_j = Σ_{i<j} w_i. Output
// qword q (channels 8q..8q+7 of the group) gathers the 8 row bytes from b_q = floor(o_8q / 8): its
// fields span at most 7 + 32 bits of them; byte i of the qword then takes 8 bits from o_j − 8·b_q
// (< 40) and the mask keeps w_j of them. The group's 64 row bytes are loaded from `start`, its
// first field byte, or row_bytes − 64 where that would read past the row (the bytes before a row
// are the block's, for head_dim >= 16); gather indices past the row wrap, onto bytes no field uses.
struct MixedGroup {
  alignas(64) uint8_t gather[64];
  alignas(64) uint8_t shift[64];
  alignas(64) uint8_t mask[64];
  int64_t start;
};

struct alignas(64) WidthUnpack {  // 3-bit widths to bytes: vpermb of 24 bytes, then vpmultishiftqb
  uint8_t gather[64];
  uint8_t shift[64];
};
constexpr WidthUnpack make_width_unpack() {
  WidthUnpack u{};
  for (uint32_t q = 0; q < 8; ++q)
    for (uint32_t i = 0; i < 8; ++i) {
      u.gather[8 * q + i] = uint8_t(3 * q + i);
      u.shift[8 * q + i] = uint8_t(3 * i);
    }
  return u;
}
constexpr WidthUnpack kWidthUnpack = make_width_unpack();

// Group h's widths as bytes, 0 past d.
inline __m512i width_bytes(const uint8_t *packed, uint32_t d, uint32_t h) {
  const uint32_t first = 64 * h, channels = std::min(64u, d - first), bytes = channels * 3 / 8;  // d % 8 == 0
  const __m512i source = _mm512_maskz_loadu_epi8(__mmask64((uint64_t(1) << bytes) - 1), packed + first * 3 / 8);
  const __m512i fields = _mm512_multishift_epi64_epi8(_mm512_load_si512(kWidthUnpack.shift),
                                                      _mm512_permutexvar_epi8(_mm512_load_si512(kWidthUnpack.gather), source));
  const __mmask64 valid = channels == 64 ? ~__mmask64(0) : (__mmask64(1) << channels) - 1;
  return _mm512_maskz_mov_epi8(valid, _mm512_and_si512(fields, _mm512_set1_epi8(7)));
}

// Group h's tables from its widths w (bytes, 0 past d) and `bit`, the offset of its first field
// (moved past the group). Per qword: vpmullq by 0x0101…01 gives the fields' inclusive prefix
// sums in its bytes (<= 32: no carries), byte 7 the qword's bits; their prefix over the qwords
// (three shifted adds) gives each qword's first bit.
inline void mixed_group(__m512i w, size_t row_bytes, uint32_t &bit, MixedGroup &g) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i inclusive = _mm512_mullo_epi64(w, _mm512_set1_epi64(0x0101010101010101));
  const __m512i bits = _mm512_srli_epi64(inclusive, 56);
  __m512i first = _mm512_add_epi64(bits, _mm512_alignr_epi64(bits, zero, 7));  // lane q: Σ over q − 1, q
  first = _mm512_add_epi64(first, _mm512_alignr_epi64(first, zero, 6));
  first = _mm512_add_epi64(first, _mm512_alignr_epi64(first, zero, 4));
  first = _mm512_add_epi64(_mm512_sub_epi64(first, bits), _mm512_set1_epi64(bit));  // exclusive, from the row's start
  const int64_t start = std::min<int64_t>(bit / 8, int64_t(row_bytes) - 64);
  g.start = start;
  // Byte 0 of each qword to all its bytes.
  const __m512i spread = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8));
  const __m512i low_bits = _mm512_shuffle_epi8(_mm512_and_si512(first, _mm512_set1_epi64(7)), spread);
  _mm512_store_si512(g.shift, _mm512_add_epi8(_mm512_sub_epi8(inclusive, w), low_bits));
  const __m512i byte = _mm512_shuffle_epi8(_mm512_sub_epi64(_mm512_srli_epi64(first, 3), _mm512_set1_epi64(start)), spread);
  _mm512_store_si512(g.gather, _mm512_and_si512(_mm512_add_epi8(byte, _mm512_set1_epi64(0x0706050403020100)),
                                                _mm512_set1_epi8(63)));
  // 2^w − 1 by vpshufb of a table of 16 bytes (w <= 4).
  const __m512i powers = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 2, 4, 8, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0));
  _mm512_store_si512(g.mask, _mm512_sub_epi8(_mm512_shuffle_epi8(powers, w), _mm512_set1_epi8(1)));
  bit = uint32_t(_mm_extract_epi64(_mm512_extracti64x2_epi64(_mm512_add_epi64(first, bits), 3), 1));
}

inline __m512i unpack_group(const uint8_t *row, const MixedGroup &g) {
  const __m512i bytes = _mm512_loadu_si512(row + g.start);
  const __m512i placed = _mm512_permutexvar_epi8(_mm512_load_si512(g.gather), bytes);
  return _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(g.shift), placed), _mm512_load_si512(g.mask));
}

// unpack_group as codes_scores calls it, and 2^w − 1 of a chunk's channels as code_digits' weights
// (classes: GCC gives lambdas no target pragma, and vector returns need it).
struct GroupUnpack {
  const MixedGroup *groups;
  __m512i operator()(const uint8_t *row, uint32_t h) const { return unpack_group(row, groups[h]); }
};
struct AllOnes {
  const uint8_t *width;
  __m512i operator()(uint32_t chunk) const {
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(width + 16 * chunk)));
    return _mm512_sub_epi32(_mm512_sllv_epi32(_mm512_set1_epi32(1), w), _mm512_set1_epi32(1));
  }
};

inline __m512 load_f16_masked(const uint8_t *p, __mmask16 valid) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, p));
}

// Per block, the digits of R <= 4 query rows (q_stride floats apart) of q'_j = q_j·cell_j (0 at
// 0 bits: those codes are 0), their steps, and offset[r] = Σ_j q_j·(lo_j + cell_j/2) + Σ_j ρ_j·mid_j
// (mid_j = (2^w_j − 1)/2), taken as Σ_j q_j·(lo_j + hi_j)/2 − step·Σ_j Q_j·(2^w_j − 1)/2 (as
// q_j·cell_j·mid_j + q_j·cell_j/2 = q_j·range_j/2; the Q_j·(2^w_j − 1) summed exactly in int32).
// The per-channel cells and midpoints are taken from the fp16 ranges as they are read, shared by
// the rows; scaled: scratch for R rows of groups·64 floats.
template <uint32_t R>
void query_digits(const float *q, size_t q_stride, const uint8_t *block, const BlockLayout &l, uint32_t d,
                  uint32_t groups, const uint8_t *width, float *scaled, int8_t *digits, float *step, float *offset) {
  const size_t stride = 64 * size_t(groups);
  __m512 top[4], dot[4];
  for (uint32_t r = 0; r < 4; ++r) top[r] = dot[r] = _mm512_setzero_ps();
  for (uint32_t j = 0; j < stride; j += 16) {
    const __mmask16 valid = lanes_below(j, d);
    const __m512 lo = load_f16_masked(block + l.key_min + 2 * j, valid);
    const __m512 hi = load_f16_masked(block + l.key_max + 2 * j, valid);
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(width + j)));
    // cell = range·2^-w, exact as mixed::cell's ldexpf; 0 where w = 0.
    const __m512 cell = _mm512_maskz_scalef_ps(_mm512_cmpgt_epi32_mask(w, _mm512_setzero_si512()), _mm512_sub_ps(hi, lo),
                                               _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_setzero_si512(), w)));
    const __m512 middle = _mm512_mul_ps(_mm512_add_ps(lo, hi), _mm512_set1_ps(0.5f));
    for (uint32_t r = 0; r < R; ++r) {
      const __m512 x = _mm512_maskz_loadu_ps(valid, q + r * q_stride + j), product = _mm512_mul_ps(x, cell);
      _mm512_storeu_ps(scaled + r * stride + j, product);
      top[r] = _mm512_range_ps(top[r], product, 0x0B);  // the larger magnitude, sign cleared
      dot[r] = _mm512_fmadd_ps(x, middle, dot[r]);
    }
  }
  alignas(64) float largest[16], sums[16];
  _mm512_store_ps(largest, reduce_rows4(top, MaxOp{}));
  _mm512_store_ps(sums, reduce_rows4(dot, AddOp{}));
  int64_t weighted[R];
  code_digits<false, R>(scaled, stride, uint32_t(stride / 16), largest, AllOnes{width}, digits, step, weighted);
  for (uint32_t r = 0; r < R; ++r) offset[r] = float(double(sums[4 * r]) - 0.5 * double(step[r]) * double(weighted[r]));
}

template <uint32_t R>
void mixed_rows(const CodesArgs &a, const uint8_t *block, const float *q, size_t q_stride, const uint8_t *width,
                const MixedGroup *groups, uint32_t group_count, float *scaled, int8_t *digits, float *out,
                size_t out_stride) {
  const BlockLayout &l = *a.layout;
  float step[R], offset[R];
  query_digits<R>(q, q_stride, block, l, a.head_dim, group_count, width, scaled, digits, step, offset);
  codes_scores<false, R>(l, block + l.key_codes, l.key_bytes_per_token_codes, a.block_tokens, group_count, digits,
                         step, offset, out, out_stride, GroupUnpack{groups});
}

// Scratch: the groups' tables, the widths as bytes, q·cell [4][groups·64], then the digits of 4
// rows.
void mixed_scores(const CodesArgs &a, const uint8_t *block, const float *q, uint32_t rows, float *out,
                  size_t out_stride, float *scratch) {
  const uint32_t d = a.head_dim;
  if (d < 16) {  // the row loads reach 63 bytes before a row: past the block's start below that
    avx512_kernels().mixed.scores(a, block, q, rows, out, out_stride, scratch);
    return;
  }
  const BlockLayout &l = *a.layout;
  const uint32_t dp = padded_dim(d), group_count = (d + 63) / 64;
  // The next block's ranges and widths now, its codes as codes_scores reaches them.
  prefetch_next_block(l, block, l.key_codes);
  auto *groups = reinterpret_cast<MixedGroup *>(scratch);
  static_assert(sizeof(MixedGroup) % 64 == 0);
  auto *width = reinterpret_cast<uint8_t *>(groups + group_count);
  float *scaled = reinterpret_cast<float *>(width + 64 * size_t(group_count));
  auto *digits = reinterpret_cast<int8_t *>(scaled + 4 * 64 * size_t(group_count));
  for (uint32_t h = 0, bit = 0; h < group_count; ++h) {
    const __m512i w = width_bytes(block + l.key_widths, d, h);
    _mm512_store_si512(width + 64 * h, w);
    mixed_group(w, l.key_bytes_per_token_codes, bit, groups[h]);
  }
  for (uint32_t r0 = 0; r0 < rows; r0 += 4) {
    const float *qr = q + size_t(r0) * dp;
    float *o = out + size_t(r0) * out_stride;
    switch (std::min(4u, rows - r0)) {
      case 1: mixed_rows<1>(a, block, qr, dp, width, groups, group_count, scaled, digits, o, out_stride); break;
      case 2: mixed_rows<2>(a, block, qr, dp, width, groups, group_count, scaled, digits, o, out_stride); break;
      case 3: mixed_rows<3>(a, block, qr, dp, width, groups, group_count, scaled, digits, o, out_stride); break;
      default: mixed_rows<4>(a, block, qr, dp, width, groups, group_count, scaled, digits, o, out_stride); break;
    }
  }
}

}  // namespace
}  // namespace qjlkv::cpu::avx512_vnni

#include "../../cpu/avx512_vnni_end.inc"

namespace qjlkv::cpu {
MixedKernels mixed_kernels_avx512_vnni(const MixedKernels &avx512) {
  MixedKernels kernels = avx512;
  kernels.scores = &avx512_vnni::mixed_scores;
  return kernels;
}
}  // namespace qjlkv::cpu
#endif
