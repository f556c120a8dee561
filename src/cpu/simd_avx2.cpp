// AVX2 + FMA + F16C kernels (8 lanes). The target pragma comes after every include, so inline
// functions of shared headers keep the baseline instruction set (no AVX2 copy can leak into
// code that runs on older CPUs).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "simd.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace qjlkv::cpu::avx2 {
namespace {

struct V {
  // Row groups and vectors per tile sized for 16 ymm registers.
  static constexpr uint32_t W = 8, kScoreRows = 2, kValueRows = 4, kValueVectors = 2;
  static constexpr bool kFusedTables = false;  // tables stored once per block, shared by all its tokens
  using F = __m256;
  using I = __m256i;
  struct Lookup {
    __m256i index;
    __m256 upper;  // sign bit set where bit 3 of the index is: take the upper half table
  };
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float *p) { return _mm256_loadu_ps(p); }
  static void store(float *p, F v) { _mm256_storeu_ps(p, v); }
  static I lane_mask(uint32_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min(n, W))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static F loadn(const float *p, uint32_t n, float fill) {
    if (n >= W) return load(p);
    const I mask = lane_mask(n);
    return _mm256_blendv_ps(set1(fill), _mm256_maskload_ps(p, mask), _mm256_castsi256_ps(mask));
  }
  static I loadi(const uint32_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }
  static void storei(uint32_t *p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F one_where_greater(F a, F b) { return _mm256_and_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ), set1(1.0f)); }
  static F round_even(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static I to_int(F x) { return _mm256_cvttps_epi32(x); }
  static bool all_within(F x, F bound) {
    const F magnitude = _mm256_andnot_ps(set1(-0.0f), x);
    return _mm256_movemask_ps(_mm256_cmp_ps(magnitude, bound, _CMP_LE_OQ)) == 0xFF;
  }
  using M = __m256;
  static M equal(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  static I zero_where(I v, M m) { return _mm256_andnot_si256(_mm256_castps_si256(m), v); }
  static uint32_t or_lanes(I v) {
    __m128i x = _mm_or_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_or_si128(x, _mm_shuffle_epi32(x, 0x4e));
    x = _mm_or_si128(x, _mm_shuffle_epi32(x, 0xb1));
    return uint32_t(_mm_cvtsi128_si32(x));
  }
  // Lane i's bit offset in the W codes' packed word (BITS = 2, 3 or 4: W codes fit 32 bits).
  template <uint32_t BITS>
  static I code_shifts() {
    return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(int(BITS)));
  }
  // W codes into the packed row at code index `first` (a multiple of W; the row starts zeroed).
  template <uint32_t BITS>
  static void pack_codes(I code, uint8_t *row, uint32_t first) {
    if constexpr (BITS == 8) {
      alignas(32) uint32_t lanes[W];
      _mm256_store_si256(reinterpret_cast<__m256i *>(lanes), code);
      for (uint32_t i = 0; i < W; ++i) row[first + i] = uint8_t(lanes[i]);
    } else {
      const uint32_t word = or_lanes(_mm256_sllv_epi32(code, code_shifts<BITS>()));
      std::memcpy(row + first * BITS / 8, &word, W * BITS / 8);
    }
  }
  static __m128 half_sum(F a) { return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); }
  static float hsum(F a) {
    __m128 x = half_sum(a);
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  static float hmin(F a) {
    __m128 x = _mm_min_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_min_ps(x, _mm_movehl_ps(x, x));
    x = _mm_min_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  static float hmax(F a) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  static void hsum4(F a, F b, F c, F d, float *out) {
    const F ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    _mm_storeu_ps(out, half_sum(_mm256_hadd_ps(ab, cd)));
  }
  // exp for x <= 0 (Cephes expf: 2^n · polynomial); 0 below ln(FLT_MIN) and for -inf.
  static F exp(F x) {
    const F tiny = _mm256_cmp_ps(x, set1(-87.33654f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, set1(-87.33654f));
    const F n = _mm256_round_ps(_mm256_mul_ps(x, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    F r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    F y = set1(1.9875691500e-4f);
    y = fma(y, r, set1(1.3981999507e-3f));
    y = fma(y, r, set1(8.3334519073e-3f));
    y = fma(y, r, set1(4.1665795894e-2f));
    y = fma(y, r, set1(1.6666665459e-1f));
    y = fma(y, r, set1(5.0000001201e-1f));
    y = fma(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, set1(1.0f)));
    const I pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2)));
  }
  static F load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))); }
  static F load_bf16(const uint16_t *p) {
    const I wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store_f16(uint16_t *p, F v) {
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // float_to_bf16 for finite values: round to nearest even on the upper 16 bits.
  static void store_bf16(uint16_t *p, F v) {
    const I x = _mm256_castps_si256(v);
    const I odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    const I rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), odd), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p), _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                                                       _mm256_extracti128_si256(rounded, 1)));
  }
  static uint32_t positive_bits(F p) { return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(p, zero(), _CMP_GT_OQ))); }
  static F permute(F table, I index) { return _mm256_permutevar8x32_ps(table, index); }
  // The W integer codes from code index `first` (BITS = 2, 3 or 4).
  template <uint32_t BITS>
  static I code_ints(const uint8_t *row, uint32_t first) {
    uint32_t word;  // loaded whole (load_bytes_le)
    if constexpr (BITS == 2) {
      uint16_t half;
      std::memcpy(&half, row + first / 4, 2);
      word = half;
    } else if constexpr (BITS == 3) {
      word = uint32_t(load_bytes_le<3>(row + first * 3 / 8));
    } else {
      std::memcpy(&word, row + first / 2, 4);
    }
    const I fields = _mm256_srlv_epi32(_mm256_set1_epi32(int(word)), code_shifts<BITS>());
    return _mm256_and_si256(fields, _mm256_set1_epi32((1 << BITS) - 1));
  }
  template <uint32_t BITS>
  static F codes(const uint8_t *row, uint32_t first) {
    if constexpr (BITS == 8) {
      uint64_t bytes;
      std::memcpy(&bytes, row + first, 8);
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(bytes))));
    } else {
      return _mm256_cvtepi32_ps(code_ints<BITS>(row, first));
    }
  }
  // table[code] (16 entries) for W codes: one vpermps where the codes fit 8 entries.
  template <uint32_t BITS>
  static F code_levels(const float *table, const uint8_t *row, uint32_t first) {
    const I code = code_ints<BITS>(row, first);
    if constexpr (BITS <= 3) return _mm256_permutevar8x32_ps(load(table), code);
    return lookup16(table, lookup_index(code));
  }
  static Lookup lookup_index(I i) { return {i, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28))}; }
  static F lookup16(const float *table, const Lookup &l) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(load(table), l.index),
                            _mm256_permutevar8x32_ps(load(table + 8), l.index), l.upper);
  }
  static I srl4(I i) { return _mm256_srli_epi32(i, 4); }
  struct Table {
    F lower, upper;  // entries 0-7 and 8-15
  };
  static Table signs_table(const float *x) {
    const F p0 = _mm256_setr_ps(-1, 1, -1, 1, -1, 1, -1, 1), p1 = _mm256_setr_ps(-1, -1, 1, 1, -1, -1, 1, 1),
            p2 = _mm256_setr_ps(-1, -1, -1, -1, 1, 1, 1, 1);
    const F base = fma(set1(x[2]), p2, fma(set1(x[1]), p1, mul(set1(x[0]), p0)));
    return {sub(base, set1(x[3])), add(base, set1(x[3]))};
  }
  static F lookup(const Table &t, const Lookup &l) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lower, l.index), _mm256_permutevar8x32_ps(t.upper, l.index),
                            l.upper);
  }
  static I gather_words(const uint8_t *rows, uint32_t row_words, uint32_t k, uint32_t t, uint32_t n) {
    const I token = _mm256_add_epi32(_mm256_set1_epi32(int(t)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const I index = _mm256_add_epi32(_mm256_mullo_epi32(token, _mm256_set1_epi32(int(row_words))), _mm256_set1_epi32(int(k)));
    const I valid = lane_mask(t >= n ? 0 : n - t);
    return _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int *>(rows), index, valid, 4);
  }
  static void table_signs(const float *x, float *table) {
    const Table t = signs_table(x);
    store(table, t.lower);
    store(table + 8, t.upper);
  }
  static void table_codes2(float a, float b, float *table) {
    const F low = mul(set1(a), _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3));
    store(table, fma(set1(b), _mm256_setr_ps(0, 0, 0, 0, 1, 1, 1, 1), low));
    store(table + 8, fma(set1(b), _mm256_setr_ps(2, 2, 2, 2, 3, 3, 3, 3), low));
  }
  static void table_linear(float a, float *table) {
    store(table, mul(set1(a), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7)));
    store(table + 8, mul(set1(a), _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15)));
  }
};

#include "simd_impl.inc"

#include "avx2_code_scores.inc"
#include "../methods/kivi/cpu_avx2.inc"
#include "../methods/mixed/cpu_avx2.inc"
#include "../methods/qjl/cpu_avx2.inc"

}  // namespace
}  // namespace qjlkv::cpu::avx2

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace qjlkv::cpu {
void qjl_code_rows_avx2(const QjlArgs &a, uint32_t rows, float *sq) { avx2::qjl_code_rows(a, rows, sq); }

const KernelTable &avx2_kernels() {
  static constexpr KernelTable table = [] {
    KernelTable t = avx2::make_table(Isa::Avx2);
    t.kivi.scores = &avx2::kivi_scores_integer;
    t.mixed.scores = &avx2::mixed_scores_integer;
    t.qjl.project = &avx2::qjl_project_integer;
    t.qjl.scores = &avx2::qjl_scores_integer;
    return t;
  }();
  return table;
}
}  // namespace qjlkv::cpu

#else  // not x86-64: never selected (isa_supported is false)
namespace qjlkv::cpu {
const KernelTable &avx2_kernels() { return scalar_kernels(); }
}  // namespace qjlkv::cpu
#endif
