// AVX-512 (F, BW, DQ, VL) kernels (16 lanes): table lookups are single vpermps instructions.
// The target pragma comes after every include, so inline functions of shared headers keep the
// baseline instruction set (no AVX-512 copy can leak into code that runs on older CPUs).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "simd.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
// GCC 12's own intrinsics (_mm512_undefined_ps in reductions and conversions) trip this.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace qjlkv::cpu::avx512 {
namespace {

struct V {
  static constexpr uint32_t W = 16, kScoreRows = 4, kValueRows = 4, kValueVectors = 4;
  static constexpr bool kFusedTables = true;  // 2W = 32 tokens share each table built in registers
  using F = __m512;
  using I = __m512i;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float *p) { return _mm512_loadu_ps(p); }
  static void store(float *p, F v) { _mm512_storeu_ps(p, v); }
  static F loadn(const float *p, uint32_t n, float fill) {
    if (n >= W) return load(p);
    return _mm512_mask_loadu_ps(set1(fill), __mmask16((1u << n) - 1u), p);
  }
  static I loadi(const uint32_t *p) { return _mm512_loadu_si512(p); }
  static void storei(uint32_t *p, I v) { _mm512_storeu_si512(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F one_where_greater(F a, F b) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), set1(1.0f)); }
  static F round_even(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static I to_int(F x) { return _mm512_cvttps_epi32(x); }
  static bool all_within(F x, F bound) { return _mm512_cmp_ps_mask(_mm512_abs_ps(x), bound, _CMP_LE_OQ) == 0xFFFF; }
  using M = __mmask16;
  static M equal(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static I zero_where(I v, M m) { return _mm512_maskz_mov_epi32(__mmask16(~m), v); }
  // W codes into the packed row at code index `first` (a multiple of W; the row starts zeroed).
  template <uint32_t BITS>
  static void pack_codes(I code, uint8_t *row, uint32_t first) {
    if constexpr (BITS == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i *>(row + first), _mm512_cvtepi32_epi8(code));
    } else if constexpr (BITS == 4) {
      const I fields = _mm512_sllv_epi32(code, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28));
      const uint32_t words[2] = {uint32_t(_mm512_reduce_or_epi32(_mm512_maskz_mov_epi32(0x00ff, fields))),
                                 uint32_t(_mm512_reduce_or_epi32(_mm512_maskz_mov_epi32(0xff00, fields)))};
      std::memcpy(row + first / 2, words, 8);
    } else if constexpr (BITS == 3) {
      // 16 codes in 6 bytes: lanes 0-7 fill the low 24 bits, lanes 8-15 the next 24.
      const I fields = _mm512_sllv_epi32(code, _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21));
      const uint64_t low = uint32_t(_mm512_reduce_or_epi32(_mm512_maskz_mov_epi32(0x00ff, fields)));
      const uint64_t high = uint32_t(_mm512_reduce_or_epi32(_mm512_maskz_mov_epi32(0xff00, fields)));
      const uint64_t bytes = low | high << 24;
      std::memcpy(row + first * 3 / 8, &bytes, 6);  // little-endian: the stream's first 48 bits
    } else {
      const I fields = _mm512_sllv_epi32(code, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
      const uint32_t word = uint32_t(_mm512_reduce_or_epi32(fields));
      std::memcpy(row + first / 4, &word, 4);
    }
  }
  static float hsum(F a) { return _mm512_reduce_add_ps(a); }
  static float hmax(F a) { return _mm512_reduce_max_ps(a); }
  static float hmin(F a) { return _mm512_reduce_min_ps(a); }
  static __m256 half_sum(F a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  }
  static void hsum4(F a, F b, F c, F d, float *out) {
    const __m256 ab = _mm256_hadd_ps(half_sum(a), half_sum(b)), cd = _mm256_hadd_ps(half_sum(c), half_sum(d));
    const __m256 all = _mm256_hadd_ps(ab, cd);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1)));
  }
  // exp for x <= 0 (Cephes expf: 2^n · polynomial); 0 below ln(FLT_MIN) and for -inf. n = round(x·log2 e)
  // by adding and subtracting 1.5·2^23 (exact for |x·log2 e| < 2^22), and vscalefps for 2^n: five
  // operations fewer than vrndscaleps and building 2^n's bits, the same results on [-80, 0]. Lanes
  // below ln(FLT_MIN) (their NaN from -inf included) are zeroed by the mask.
  static F exp(F x) {
    const __mmask16 normal = _mm512_cmp_ps_mask(x, set1(-87.33654f), _CMP_GE_OQ);
    const F n = _mm512_sub_ps(fma(x, set1(1.44269504088896341f), set1(12582912.0f)), set1(12582912.0f));
    F r = _mm512_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    F y = set1(1.9875691500e-4f);
    y = fma(y, r, set1(1.3981999507e-3f));
    y = fma(y, r, set1(8.3334519073e-3f));
    y = fma(y, r, set1(4.1665795894e-2f));
    y = fma(y, r, set1(1.6666665459e-1f));
    y = fma(y, r, set1(5.0000001201e-1f));
    y = fma(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, set1(1.0f)));
    return _mm512_maskz_scalef_ps(normal, y, n);
  }
  static F load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))); }
  static F load_bf16(const uint16_t *p) {
    const I wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void store_f16(uint16_t *p, F v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // float_to_bf16 for finite values: round to nearest even on the upper 16 bits.
  static void store_bf16(uint16_t *p, F v) {
    const I x = _mm512_castps_si512(v);
    const I odd = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    const I rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), odd), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), _mm512_cvtepi32_epi16(rounded));
  }
  static uint32_t positive_bits(F p) { return _mm512_cmp_ps_mask(p, zero(), _CMP_GT_OQ); }
  static F permute(F table, I index) { return _mm512_permutexvar_ps(index, table); }
  // table[code] for W codes from code index `first`, the table (16 entries, entry e = the value of
  // code e mod 2^BITS) indexed by the packed fields themselves: no conversion to float.
  template <uint32_t BITS>
  static F code_levels(const float *table, const uint8_t *row, uint32_t first) {
    const F t = load(table);
    if constexpr (BITS == 4) {
      // 16 nibbles in 8 bytes: word 0 feeds lanes 0-7, word 1 lanes 8-15; vpermps reads the
      // low 4 bits of each shifted word.
      uint64_t bytes;
      std::memcpy(&bytes, row + first / 2, 8);
      const I words = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                               _mm512_castsi128_si512(_mm_cvtsi64_si128(int64_t(bytes))));
      return _mm512_permutexvar_ps(
          _mm512_srlv_epi32(words, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28)), t);
    } else if constexpr (BITS == 3) {
      // 16 codes in 6 bytes: 24-bit half 0 feeds lanes 0-7, half 1 lanes 8-15; the mask keeps
      // the code from the bits above it.
      const uint64_t bytes = load_bytes_le<6>(row + first * 3 / 8);
      const I halves = _mm512_permutexvar_epi32(
          _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
          _mm512_castsi128_si512(_mm_cvtsi64_si128(int64_t((bytes & 0xffffffu) | (bytes >> 24) << 32))));
      const I fields = _mm512_srlv_epi32(halves, _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21));
      return _mm512_permutexvar_ps(_mm512_and_si512(fields, _mm512_set1_epi32(7)), t);
    } else {
      // 16 2-bit codes in one word; the low 4 bits of each shifted copy hold the code and its
      // neighbour, and the table repeats every 4 entries.
      static_assert(BITS == 2);
      uint32_t word;
      std::memcpy(&word, row + first / 4, 4);
      return _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_set1_epi32(int(word)),
                                                     _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)),
                                   t);
    }
  }
  // Codes as floats: their own values looked up.
  template <uint32_t BITS>
  static F codes(const uint8_t *row, uint32_t first) {
    if constexpr (BITS == 8) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(row + first))));
    } else {
      // 3-bit fields are masked, 2-bit ones are not: their table repeats every 4 entries.
      alignas(64) static constexpr float kValues[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      alignas(64) static constexpr float kValues2[16] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
      return code_levels<BITS>(BITS == 2 ? kValues2 : kValues, row, first);
    }
  }
  static I lookup_index(I i) { return i; }
  static F lookup16(const float *table, I i) { return _mm512_permutexvar_ps(i, load(table)); }
  static I srl4(I i) { return _mm512_srli_epi32(i, 4); }
  // table[e] = Σ_k (bit k of e ? x_k : −x_k), in a register.
  static F signs_table(const float *x) {
    const F p0 = _mm512_setr_ps(-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1);
    const F p1 = _mm512_setr_ps(-1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1);
    const F p2 = _mm512_setr_ps(-1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1);
    const F p3 = _mm512_setr_ps(-1, -1, -1, -1, -1, -1, -1, -1, 1, 1, 1, 1, 1, 1, 1, 1);
    return fma(set1(x[3]), p3, fma(set1(x[2]), p2, fma(set1(x[1]), p1, mul(set1(x[0]), p0))));
  }
  static F lookup(F table, I i) { return _mm512_permutexvar_ps(i, table); }
  // 32-bit word k of the packed rows of tokens t..t+W-1 (rows of row_words words); 0 from token n on.
  static I gather_words(const uint8_t *rows, uint32_t row_words, uint32_t k, uint32_t t, uint32_t n) {
    const I token = _mm512_add_epi32(_mm512_set1_epi32(int(t)), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const I index = _mm512_add_epi32(_mm512_mullo_epi32(token, _mm512_set1_epi32(int(row_words))), _mm512_set1_epi32(int(k)));
    const __mmask16 valid = t >= n ? 0 : t + W <= n ? 0xffff : __mmask16((1u << (n - t)) - 1u);
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, index, rows, 4);
  }
  static void table_signs(const float *x, float *table) {
    const F p0 = _mm512_setr_ps(-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1);
    const F p1 = _mm512_setr_ps(-1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1);
    const F p2 = _mm512_setr_ps(-1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1);
    const F p3 = _mm512_setr_ps(-1, -1, -1, -1, -1, -1, -1, -1, 1, 1, 1, 1, 1, 1, 1, 1);
    // Two sign flips by XOR and one add keep half the work off the FMA pipes.
    const F sign2 = _mm512_castsi512_ps(_mm512_setr_epi32(INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, 0, 0, 0, 0,
                                                           INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, 0, 0, 0, 0));
    const F sign3 = _mm512_castsi512_ps(_mm512_setr_epi32(INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN,
                                                           INT32_MIN, INT32_MIN, INT32_MIN, 0, 0, 0, 0, 0, 0, 0, 0));
    const F high = add(_mm512_xor_ps(set1(x[2]), sign2), _mm512_xor_ps(set1(x[3]), sign3));
    store(table, fma(set1(x[1]), p1, fma(set1(x[0]), p0, high)));
    (void)p2;
    (void)p3;
  }
  static void table_codes2(float a, float b, float *table) {
    const F low = _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    const F high = _mm512_setr_ps(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    store(table, fma(set1(b), high, mul(set1(a), low)));
  }
  static void table_linear(float a, float *table) {
    store(table, mul(set1(a), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)));
  }
};

#include "simd_impl.inc"

// KIVI/OTT key scores: the AVX2 integer kernel where it applies (head_dim a multiple of 16), 3-4x
// faster than the fp32 nibble tables, whose per-block table builds dominate short blocks (every
// AVX-512 CPU runs AVX2); these fp32 tables else.
void kivi_scores_fastest(const CodesArgs &a, const uint8_t *block, const float *q, uint32_t rows, float *out,
                         size_t out_stride, float *scratch) {
  if (a.head_dim % 16 == 0) avx2_kernels().kivi.scores(a, block, q, rows, out, out_stride, scratch);
  else kivi_scores(a, block, q, rows, out, out_stride, scratch);
}

// Mixed-bit keys likewise, at any head_dim: the AVX2 integer kernel (keys 19.7 ns per token and kv
// head on `Kernels/avx512/q2`, these fp32 tables 45).
void mixed_scores_fastest(const CodesArgs &a, const uint8_t *block, const float *q, uint32_t rows, float *out,
                          size_t out_stride, float *scratch) {
  avx2_kernels().mixed.scores(a, block, q, rows, out, out_stride, scratch);
}

// QJL keys likewise: the AVX2 integer kernel (keys about 1.6x faster than these fp32 tables on
// this machine's `Kernels` benchmark) for the layers it takes, these tables else.
void qjl_project_fastest(const QjlArgs &a, const float *q, uint32_t rows, float *sq) {
  qjl_project(a, q, rows, sq);
  if (qjl_integer_layer(a)) qjl_code_rows_avx2(a, rows, sq);
}
void qjl_scores_fastest(const QjlArgs &a, const uint8_t *block, const float *q, const float *sq, uint32_t rows,
                        float *out, size_t out_stride, float *scratch) {
  if (qjl_integer_layer(a)) avx2_kernels().qjl.scores(a, block, q, sq, rows, out, out_stride, scratch);
  else qjl_scores(a, block, q, sq, rows, out, out_stride, scratch);
}

}  // namespace
}  // namespace qjlkv::cpu::avx512

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace qjlkv::cpu {
void qjl_project_avx512(const QjlArgs &a, const float *q, uint32_t rows, float *sq) {
  avx512::qjl_project(a, q, rows, sq);
}

const KernelTable &avx512_kernels() {
  static constexpr KernelTable table = [] {
    KernelTable t = avx512::make_table(Isa::Avx512);
    t.kivi.scores = &avx512::kivi_scores_fastest;
    t.mixed.scores = &avx512::mixed_scores_fastest;
    t.qjl.project = &avx512::qjl_project_fastest;
    t.qjl.scores = &avx512::qjl_scores_fastest;
    return t;
  }();
  return table;
}
}  // namespace qjlkv::cpu

#else  // not x86-64: never selected (isa_supported is false)
namespace qjlkv::cpu {
const KernelTable &avx512_kernels() { return scalar_kernels(); }
}  // namespace qjlkv::cpu
#endif
