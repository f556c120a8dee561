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

// ---- KIVI/OTT key scores in integers (SPEC §9, docs/DESIGN.md "Integer decode paths") -----------
// Per block and query row, q'_c = q_c·scale_c becomes Q_c = round(q'_c / step), |Q_c| <=
// kQueryCodeMax, step = max|q'| / kQueryCodeMax; the codes are unpacked to int16 words and
// vpmaddwd sums code·Q pairs in int32 (below 2^31: d·255·32767 < 2^31 for d <= 256).
// The rounding residuals ρ_c = q'_c − step·Q_c are not lost: Σ ρ_c·code_c is taken as mid·Σ ρ_c
// (mid = (2^bits − 1)/2), so the error is Σ ρ_c·(code_c − mid), |ρ_c| <= step/2, about
// 1/(2·32767·sqrt(3)) of max|q'| per channel. One int16 digit, not the AVX-512 kernel's two int8
// ones: AVX2 has no u8·s8 instruction that does not saturate.
constexpr float kQueryCodeMax = 32767.0f;
static_assert(double(QJLKV_MAX_HEAD_DIM) * 255.0 * kQueryCodeMax < 2147483647.0);

// 16 codes of BITS bits (2·BITS source bytes, broadcast to every qword) as int16 words: word i
// takes source bytes k, k + 1 (k = BITS·i / 8) by vpshufb and is multiplied by 2^(8 − s) (s =
// BITS·i mod 8), which puts bits s.. of the pair in its high byte.
struct CodeUnpack {
  alignas(32) uint8_t place[32];
  alignas(32) uint16_t multiplier[16];
};
constexpr CodeUnpack make_code_unpack(uint32_t bits) {
  CodeUnpack u{};
  for (uint32_t i = 0; i < 16; ++i) {
    const uint32_t bit = bits * i, lane_word = i % 8;
    u.place[16 * (i / 8) + 2 * lane_word] = uint8_t(bit / 8);
    u.place[16 * (i / 8) + 2 * lane_word + 1] = uint8_t(bit / 8 + 1);
    u.multiplier[i] = uint16_t(1u << (8 - bit % 8));
  }
  return u;
}

template <uint32_t BITS>
inline __m256i unpack16(const uint8_t *src) {
  if constexpr (BITS == 8) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src)));
  } else {
    static constexpr CodeUnpack kUnpack = make_code_unpack(BITS);
    uint64_t bytes;  // exactly the 2·BITS bytes: never past the row
    if constexpr (BITS == 3) {
      bytes = load_bytes_le<6>(src);
    } else if constexpr (BITS == 2) {
      uint32_t word;
      std::memcpy(&word, src, 4);
      bytes = word;
    } else {
      std::memcpy(&bytes, src, 8);
    }
    const __m256i placed = _mm256_shuffle_epi8(_mm256_set1_epi64x(int64_t(bytes)),
                                               _mm256_load_si256(reinterpret_cast<const __m256i *>(kUnpack.place)));
    const __m256i shifted = _mm256_mullo_epi16(placed, _mm256_load_si256(reinterpret_cast<const __m256i *>(kUnpack.multiplier)));
    return _mm256_and_si256(_mm256_srli_epi16(shifted, 8), _mm256_set1_epi16((1 << BITS) - 1));
  }
}

// sum + x, the sum kept in its register: GCC 12 put every vpaddd of the loop below into a fresh
// register and copied it back (8 moves per 16 channels and token pair).
inline __m256i add_into(__m256i sum, __m256i x) {
#if defined(__clang__)
  return _mm256_add_epi32(sum, x);
#else
  asm("vpaddd %1, %0, %0" : "+x"(sum) : "x"(x));
  return sum;
#endif
}

// out[r][t] = step[r]·Σ_c Q_rc·code_tc + offset[r] for the block's B tokens (B even), two tokens
// at a time; Q: per row and 16-channel chunk, 16 int16.
template <uint32_t BITS, uint32_t R>
void codes_scores(const uint8_t *codes, size_t row_bytes, uint32_t B, uint32_t d, const int16_t *Q,
                  const float *step, const float *offset, float *out, size_t out_stride) {
  const uint32_t chunks = d / 16;
  // Lane 2r + p of the sums below is row r, token t + p.
  alignas(32) float steps[8] = {}, offsets[8] = {};
  for (uint32_t r = 0; r < R; ++r) {
    steps[2 * r] = steps[2 * r + 1] = step[r];
    offsets[2 * r] = offsets[2 * r + 1] = offset[r];
  }
  const __m256 step_lanes = _mm256_load_ps(steps), offset_lanes = _mm256_load_ps(offsets);
  for (uint32_t t = 0; t < B; t += 2) {
    __m256i acc[4][2];
    for (uint32_t r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const uint8_t *row0 = codes + size_t(t) * row_bytes, *row1 = row0 + row_bytes;
    for (uint32_t k = 0; k < chunks; ++k) {
      const __m256i c0 = unpack16<BITS>(row0 + 2 * BITS * k), c1 = unpack16<BITS>(row1 + 2 * BITS * k);
      for (uint32_t r = 0; r < R; ++r) {
        const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i *>(Q + (size_t(r) * chunks + k) * 16));
        acc[r][0] = add_into(acc[r][0], _mm256_madd_epi16(c0, q));
        acc[r][1] = add_into(acc[r][1], _mm256_madd_epi16(c1, q));
      }
    }
    // Two rounds of vphaddd leave, per 128-bit lane, (r t, r t+1, r+1 t, r+1 t+1) partial sums;
    // the lanes are added last.
    const __m256i quad01 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0][0], acc[0][1]), _mm256_hadd_epi32(acc[1][0], acc[1][1]));
    const __m256i quad23 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[2][0], acc[2][1]), _mm256_hadd_epi32(acc[3][0], acc[3][1]));
    const __m256i total = _mm256_add_epi32(_mm256_permute2x128_si256(quad01, quad23, 0x20),
                                           _mm256_permute2x128_si256(quad01, quad23, 0x31));
    alignas(32) float scores[8];
    _mm256_store_ps(scores, _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), step_lanes, offset_lanes));
    for (uint32_t r = 0; r < R; ++r) std::memcpy(out + size_t(r) * out_stride + t, scores + 2 * r, 2 * sizeof(float));
  }
}

// Per row r < R: the int16 query codes Q (see kQueryCodeMax), step[r] and offset[r] = Σ_c q_c·min_c
// + mid·Σ_c ρ_c, with Σ_c ρ_c = Σ_c q'_c − step·Σ_c Q_c.
template <uint32_t BITS>
void query_codes(const float *q, uint32_t dp, uint32_t R, const float *scale, const float *mins, uint32_t d,
                 int16_t *Q, float *step, float *offset) {
  for (uint32_t r = 0; r < R; ++r) {
    const float *qr = q + size_t(r) * dp;
    __m256 top = _mm256_setzero_ps(), products = _mm256_setzero_ps(), scaled_sum = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (uint32_t j = 0; j < d; j += 8) {
      const __m256 x = _mm256_loadu_ps(qr + j), scaled = _mm256_mul_ps(x, _mm256_load_ps(scale + j));
      top = _mm256_max_ps(top, _mm256_and_ps(scaled, magnitude));
      products = _mm256_fmadd_ps(x, _mm256_load_ps(mins + j), products);
      scaled_sum = _mm256_add_ps(scaled_sum, scaled);
    }
    const float largest = V::hmax(top);
    const CodeScale code = code_scale(largest, kQueryCodeMax);
    const __m256 prescale = _mm256_set1_ps(code.prescale), inverse = _mm256_set1_ps(code.factor);
    step[r] = largest > 0.0f ? largest / kQueryCodeMax : 0.0f;
    __m256i code_sum = _mm256_setzero_si256();
    int16_t *row_codes = Q + size_t(r) * d;
    for (uint32_t j = 0; j < d; j += 16) {
      const auto codes_of = [&](uint32_t c) {
        const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(qr + c), _mm256_load_ps(scale + c));
        return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(scaled, prescale), inverse));
      };
      const __m256i low = codes_of(j), high = codes_of(j + 8);
      code_sum = _mm256_add_epi32(code_sum, _mm256_add_epi32(low, high));
      // vpackssdw packs per 128-bit lane: restore channel order with a qword permutation.
      _mm256_store_si256(reinterpret_cast<__m256i *>(row_codes + j),
                         _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xD8));
    }
    alignas(32) int32_t code_lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i *>(code_lanes), code_sum);
    int64_t codes_total = 0;
    for (int32_t c : code_lanes) codes_total += c;
    const float residual = V::hsum(scaled_sum) - step[r] * float(codes_total);
    offset[r] = V::hsum(products) + residual * (float((1u << BITS) - 1u) * 0.5f);
  }
}

template <uint32_t BITS>
void kivi_scores_bits(const CodesArgs &a, const uint8_t *block, const float *q, uint32_t rows, float *out,
                      size_t out_stride, float *scratch) {
  const BlockLayout &l = *a.layout;
  const uint32_t B = a.block_tokens, d = a.head_dim, dp = padded_dim(d);
  float *scale = scratch, *mins = scratch + d;  // [d] each (d % 16 == 0), then Q of 4 rows
  auto *Q = reinterpret_cast<int16_t *>(scratch + 2 * d);
  for (uint32_t j = 0; j < d; j += 8) {
    _mm256_store_ps(scale + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(block + l.key_scale + 2 * j))));
    _mm256_store_ps(mins + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(block + l.key_min + 2 * j))));
  }
  const uint8_t *codes = block + l.key_codes;
  const size_t row_bytes = l.key_bytes_per_token_codes;
  for (uint32_t r0 = 0; r0 < rows; r0 += 4) {
    const uint32_t R = std::min(4u, rows - r0);
    float step[4], offset[4];
    query_codes<BITS>(q + size_t(r0) * dp, dp, R, scale, mins, d, Q, step, offset);
    float *o = out + size_t(r0) * out_stride;
    switch (R) {
      case 1: codes_scores<BITS, 1>(codes, row_bytes, B, d, Q, step, offset, o, out_stride); break;
      case 2: codes_scores<BITS, 2>(codes, row_bytes, B, d, Q, step, offset, o, out_stride); break;
      case 3: codes_scores<BITS, 3>(codes, row_bytes, B, d, Q, step, offset, o, out_stride); break;
      default: codes_scores<BITS, 4>(codes, row_bytes, B, d, Q, step, offset, o, out_stride); break;
    }
  }
}

// The integer kernel where the codes come in whole 16-channel chunks; the fp32 table kernel else.
void kivi_scores_integer(const CodesArgs &a, const uint8_t *block, const float *q, uint32_t rows, float *out,
                         size_t out_stride, float *scratch) {
  if (a.head_dim % 16 != 0) {
    kivi_scores(a, block, q, rows, out, out_stride, scratch);
    return;
  }
  prefetch_next_block(*a.layout, block, a.layout->key_bytes);
  switch (a.bits) {
    case 2: kivi_scores_bits<2>(a, block, q, rows, out, out_stride, scratch); break;
    case 3: kivi_scores_bits<3>(a, block, q, rows, out, out_stride, scratch); break;
    case 4: kivi_scores_bits<4>(a, block, q, rows, out, out_stride, scratch); break;
    default: kivi_scores_bits<8>(a, block, q, rows, out, out_stride, scratch); break;
  }
}

// ---- QJL keys in integers (SPEC §9, docs/DESIGN.md "Integer decode paths") --------------------
// The avx512vnni kernel's arithmetic and codes (its section "QJL keys": the same integer sums)
// with AVX2's lookups: per sign byte of a token the SplitBytes tables (simd.hpp) of the subset
// sums of its two nibbles' codes, biased to U in [4, 65532]. vpshufb looks up 32 tokens' nibbles
// at once, one byte each, the low and the high bytes of U apart; each is accumulated over the
// sign bytes in 16-bit words (even and odd tokens' bytes apart), and a token's sum comes out
// exact: Σ_i X_i·b_i = Σ low + 256·Σ high − 2·32768·bytes.
inline __m256i broadcast16(const uint8_t *p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}

// The int16 subset sums of x_0..x_3 (T0) and x_4..x_7 (T1), the 8 codes of one sign byte (the
// words of `codes`, broadcast to both lanes), entry e of T in word e: word e picks code i where
// bit i of e is set (vpshufb, zero elsewhere).
struct NibbleSelect {
  alignas(32) uint8_t pick[8][32];  // [nibble·4 + i]
};
constexpr NibbleSelect make_nibble_select() {
  NibbleSelect s{};
  for (uint32_t n = 0; n < 2; ++n)
    for (uint32_t i = 0; i < 4; ++i)
      for (uint32_t e = 0; e < 16; ++e) {
        const bool set = (e >> i) & 1;
        const uint32_t lane_byte = 2 * (e % 8) + 16 * (e / 8), code = 4 * n + i;
        s.pick[4 * n + i][lane_byte] = set ? uint8_t(2 * code) : 0x80;
        s.pick[4 * n + i][lane_byte + 1] = set ? uint8_t(2 * code + 1) : 0x80;
      }
  return s;
}
constexpr NibbleSelect kNibbleSelect = make_nibble_select();

// The SignTable (SplitBytes) of the 8 codes in `codes`' low 128 bits (int16).
inline void store_split_table(__m128i codes, SignTable *table) {
  // T + 32768 wraps in int16 to U as an unsigned word.
  const __m256i both = _mm256_broadcastsi128_si256(codes), bias = _mm256_set1_epi16(int16_t(kQjlSplitBias - 65536));
  __m256i low[2], high[2];
  for (uint32_t n = 0; n < 2; ++n) {
    __m256i sum = bias;
    for (uint32_t i = 0; i < 4; ++i)
      sum = _mm256_add_epi16(sum, _mm256_shuffle_epi8(both, _mm256_load_si256(reinterpret_cast<const __m256i *>(kNibbleSelect.pick[4 * n + i]))));
    low[n] = _mm256_and_si256(sum, _mm256_set1_epi16(255));
    high[n] = _mm256_srli_epi16(sum, 8);
  }
  // vpackuswb packs per 128-bit lane (entries 0-7 of both nibbles, then 8-15): a qword
  // permutation puts each nibble's 16 entries together.
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(table->split[0]), _mm256_permute4x64_epi64(_mm256_packus_epi16(low[0], low[1]), 0xD8));
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(table->split[2]), _mm256_permute4x64_epi64(_mm256_packus_epi16(high[0], high[1]), 0xD8));
}

// Per row of S·q (sq as qjl_project leaves it) its codes X = round(S·q / step), step = max
// |S·q| / kQjlCodeMax, as tables.
void qjl_code_rows(const QjlArgs &a, uint32_t rows, float *sq) {
  for (uint32_t r = 0; r < rows; ++r) {
    float *row = sq + size_t(r) * a.projected_stride;
    __m256 top = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (uint32_t i = 0; i < a.m; i += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(row + i), magnitude));
    const float largest = V::hmax(top);
    const CodeScale code = code_scale(largest, kQjlCodeMax);
    const __m256 prescale = _mm256_set1_ps(code.prescale), factor = _mm256_set1_ps(code.factor);
    auto *tables = reinterpret_cast<SignTable *>(row + a.sketch_t_stride);
    __m256i total = _mm256_setzero_si256();
    for (uint32_t i = 0; i < a.m; i += 16) {
      const auto codes_of = [&](uint32_t j) {
        return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(row + j), prescale), factor));
      };
      const __m256i first = codes_of(i), second = codes_of(i + 8);  // sign bytes i/8 and i/8 + 1
      total = _mm256_add_epi32(total, _mm256_add_epi32(first, second));
      const __m256i packed = _mm256_packs_epi32(first, second);  // lane 0: first's 0-3, second's 0-3
      const __m256i words = _mm256_permute4x64_epi64(packed, 0xD8);  // first's 8 codes, then second's
      store_split_table(_mm256_castsi256_si128(words), tables + i / 8);
      store_split_table(_mm256_extracti128_si256(words, 1), tables + i / 8 + 1);
    }
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i *>(lanes), total);
    uint32_t sum = 0;  // wrapping, as the kernel's sums: codes of a non-finite projection are INT_MIN
    for (int32_t x : lanes) sum += uint32_t(x);
    store_projected_tail(a, sq, r, largest / kQjlCodeMax, int32_t(sum));
  }
}

// S·q as the fp32 kernel computes it, then its codes.
void qjl_project_integer(const QjlArgs &a, const float *q, uint32_t rows, float *sq) {
  qjl_project(a, q, rows, sq);
  if (qjl_integer_layer(a)) qjl_code_rows(a, rows, sq);
}

// The sign bytes (`bytes` per token, W = bytes/4 a power of two <= 16) of the span's 32 tokens
// from t0 (tokens at B and past read as 0), as vpshufb indices: index[2k] byte β the low nibble
// of sign byte k of token τ(β), index[2k + 1] its high nibble, τ(16L + 4g + i) = 8g + 4L + i (L
// the 128-bit lane). Per 8 tokens 8g..8g+7, lane L loads the 4 tokens from 8g + 4L; log2(W)
// rounds of in-lane even/odd dword splits leave vector k holding dword k of each (in token
// order); a byte shuffle groups each dword's 4 bytes by byte, and a 4x4 dword transposition over
// the 4 groups gives each byte position's 32 tokens.
template <uint32_t W>
void transpose_span(const uint8_t *bits, uint32_t B, uint32_t t0, __m256i *index) {
  constexpr uint32_t bytes = 4 * W;
  const __m256i by_byte = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  __m256i grouped[4][W];
  for (uint32_t g = 0; g < 4; ++g) {
    __m128i half[2][W];
    for (uint32_t L = 0; L < 2; ++L) {
      const uint32_t t = t0 + 8 * g + 4 * L, valid = t < B ? std::min(B - t, 4u) : 0;
      const uint8_t *from = bits + size_t(t) * bytes;
      for (uint32_t j = 0; j < W; ++j) {
        if (valid == 4) {
          half[L][j] = _mm_loadu_si128(reinterpret_cast<const __m128i *>(from + 16 * j));
        } else {  // dwords 4j..4j+3 of the 4 tokens' rows, those past the valid tokens as 0
          const __m128i dword = _mm_add_epi32(_mm_set1_epi32(int(4 * j)), _mm_setr_epi32(0, 1, 2, 3));
          const __m128i mask = _mm_cmpgt_epi32(_mm_set1_epi32(int(valid * W)), dword);
          half[L][j] = _mm_maskload_epi32(reinterpret_cast<const int *>(from + 16 * j), mask);
        }
      }
    }
    __m256i z[W];
    for (uint32_t j = 0; j < W; ++j) z[j] = _mm256_set_m128i(half[1][j], half[0][j]);
    for (uint32_t n = W; n > 1; n /= 2) {
      __m256i y[W];
      for (uint32_t i = 0; i < W / 2; ++i) {
        const __m256 a = _mm256_castsi256_ps(z[2 * i]), b = _mm256_castsi256_ps(z[2 * i + 1]);
        y[i] = _mm256_castps_si256(_mm256_shuffle_ps(a, b, 0x88));
        y[W / 2 + i] = _mm256_castps_si256(_mm256_shuffle_ps(a, b, 0xDD));
      }
      for (uint32_t i = 0; i < W; ++i) z[i] = y[i];
    }
    for (uint32_t k = 0; k < W; ++k) grouped[g][k] = _mm256_shuffle_epi8(z[k], by_byte);
  }
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (uint32_t k = 0; k < W; ++k) {
    const __m256i lo01 = _mm256_unpacklo_epi32(grouped[0][k], grouped[1][k]), hi01 = _mm256_unpackhi_epi32(grouped[0][k], grouped[1][k]);
    const __m256i lo23 = _mm256_unpacklo_epi32(grouped[2][k], grouped[3][k]), hi23 = _mm256_unpackhi_epi32(grouped[2][k], grouped[3][k]);
    const __m256i position[4] = {_mm256_unpacklo_epi64(lo01, lo23), _mm256_unpackhi_epi64(lo01, lo23),
                                 _mm256_unpacklo_epi64(hi01, hi23), _mm256_unpackhi_epi64(hi01, hi23)};
    for (uint32_t b = 0; b < 4; ++b) {
      _mm256_store_si256(index + 2 * (4 * k + b), _mm256_and_si256(position[b], nibble));
      _mm256_store_si256(index + 2 * (4 * k + b) + 1, _mm256_and_si256(_mm256_srli_epi16(position[b], 4), nibble));
    }
  }
}

void transpose_span(const uint8_t *bits, uint32_t bytes, uint32_t B, uint32_t t0, __m256i *index) {
  switch (bytes / 4) {
    case 1: transpose_span<1>(bits, B, t0, index); break;
    case 2: transpose_span<2>(bits, B, t0, index); break;
    case 4: transpose_span<4>(bits, B, t0, index); break;
    case 8: transpose_span<8>(bits, B, t0, index); break;
    default: transpose_span<16>(bits, B, t0, index); break;
  }
}

// sums[j][v] (lane i: token 8v + i of the span) = Σ_k U of code set j's tables tables[j][k] at the
// span's sign bytes k < bytes (index from transpose_span) = Σ_i X_i·b_i + 2·32768·bytes. The
// 16-bit sums of either byte stay below 2^15 (bytes <= 64, 2·255 a byte).
template <uint32_t N>
void sign_sums(const __m256i *index, uint32_t bytes, const SignTable *const *tables, __m256i (*sums)[4]) {
  __m256i low_all[N], low_odd[N], high_all[N], high_odd[N];
  for (uint32_t j = 0; j < N; ++j) low_all[j] = low_odd[j] = high_all[j] = high_odd[j] = _mm256_setzero_si256();
  for (uint32_t k = 0; k < bytes; ++k) {
    const __m256i lo = _mm256_load_si256(index + 2 * k), hi = _mm256_load_si256(index + 2 * k + 1);
    for (uint32_t j = 0; j < N; ++j) {
      const SignTable &t = tables[j][k];
      const __m256i low0 = _mm256_shuffle_epi8(broadcast16(t.split[0]), lo), low1 = _mm256_shuffle_epi8(broadcast16(t.split[1]), hi);
      const __m256i high0 = _mm256_shuffle_epi8(broadcast16(t.split[2]), lo), high1 = _mm256_shuffle_epi8(broadcast16(t.split[3]), hi);
      // Word w holds even byte 2w plus 256 times odd byte 2w + 1 (mod 2^16): the odd bytes are
      // also summed apart, which recovers the even ones.
      low_all[j] = _mm256_add_epi16(low_all[j], _mm256_add_epi16(low0, low1));
      low_odd[j] = _mm256_add_epi16(low_odd[j], _mm256_add_epi16(_mm256_srli_epi16(low0, 8), _mm256_srli_epi16(low1, 8)));
      high_all[j] = _mm256_add_epi16(high_all[j], _mm256_add_epi16(high0, high1));
      high_odd[j] = _mm256_add_epi16(high_odd[j], _mm256_add_epi16(_mm256_srli_epi16(high0, 8), _mm256_srli_epi16(high1, 8)));
    }
  }
  const __m256i weights = _mm256_set1_epi32(0x01000001);  // (low, high) word pairs times (1, 256)
  for (uint32_t j = 0; j < N; ++j) {
    const __m256i low_even = _mm256_sub_epi16(low_all[j], _mm256_slli_epi16(low_odd[j], 8));
    const __m256i high_even = _mm256_sub_epi16(high_all[j], _mm256_slli_epi16(high_odd[j], 8));
    // Word w of the even sums is token τ(2w), of the odd ones τ(2w + 1); per lane L, the words'
    // first half holds groups 0 and 1 (tokens 4L, 4L + 2, 8 + 4L, 10 + 4L plus 0 or 1), the second
    // groups 2 and 3.
    const __m256i even01 = _mm256_madd_epi16(_mm256_unpacklo_epi16(low_even, high_even), weights);
    const __m256i even23 = _mm256_madd_epi16(_mm256_unpackhi_epi16(low_even, high_even), weights);
    const __m256i odd01 = _mm256_madd_epi16(_mm256_unpacklo_epi16(low_odd[j], high_odd[j]), weights);
    const __m256i odd23 = _mm256_madd_epi16(_mm256_unpackhi_epi16(low_odd[j], high_odd[j]), weights);
    sums[j][0] = _mm256_unpacklo_epi32(even01, odd01);
    sums[j][1] = _mm256_unpackhi_epi32(even01, odd01);
    sums[j][2] = _mm256_unpacklo_epi32(even23, odd23);
    sums[j][3] = _mm256_unpackhi_epi32(even23, odd23);
  }
}

// Code sets per pass: 16 accumulators would not fit the 16 ymm registers with the indices.
constexpr uint32_t kSignSumSets = 2;
void sign_sums(const __m256i *index, uint32_t bytes, const SignTable *const *tables, uint32_t n, __m256i (*sums)[4]) {
  if (n == 1) sign_sums<1>(index, bytes, tables, sums);
  else sign_sums<2>(index, bytes, tables, sums);
}

// (2·Σ_i X_i·b_i − Σ_i X_i)·scale from sign_sums' biased sums; `offset` = 2·2·32768·bytes + Σ_i X_i.
inline __m256 signed_dot(__m256i sums, int32_t offset, __m256 scale) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_slli_epi32(sums, 1), _mm256_set1_epi32(offset))), scale);
}

// 8 tokens' fp16 numbers from t (those at B and past as 0), as fp32.
inline __m256 load_halves(const uint8_t *p, uint32_t t, uint32_t B) {
  if (t + 8 <= B) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + 2 * size_t(t))));
  alignas(16) uint16_t halves[8] = {};
  if (t < B) std::memcpy(halves, p + 2 * size_t(t), 2 * size_t(B - t));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i *>(halves)));
}

void qjl_scores_integer(const QjlArgs &a, const uint8_t *block, const float *q, const float *sq, uint32_t rows,
                        float *out, size_t out_stride, float *scratch) {
  if (!qjl_integer_layer(a)) {
    qjl_scores(a, block, q, sq, rows, out, out_stride, scratch);
    return;
  }
  const BlockLayout &l = *a.layout;
  prefetch_next_block(l, block, l.key_bytes);
  const uint32_t dp = padded_dim(a.head_dim), m = a.m, B = a.block_tokens, Bp = padded_tokens(B);
  const uint32_t c = a.outlier_channels, bytes_in = m / 8;
  // Scratch (32-byte aligned pieces): the span's sign-byte indices; per outlier channel j and
  // vector v, the term (n_in + n_out)·τ_j: score = inlier row term + Σ_j q_oj·term_j.
  auto *index_in = reinterpret_cast<__m256i *>(scratch);
  auto *terms = reinterpret_cast<__m256 (*)[4]>(index_in + 2 * bytes_in);
  const uint8_t *outliers = block + l.key_outlier_idx;
  const SignTable *tables[kSignSumSets];
  __m256i sums[kSignSumSets][4];
  for (uint32_t t0 = 0; t0 < Bp; t0 += 32) {
    __m256 norm_in[4];  // times c_d/m
    for (uint32_t v = 0; v < 4; ++v) {
      const __m256 n_in = load_halves(block + l.key_norm_in, t0 + 8 * v, B);
      norm_in[v] = _mm256_mul_ps(n_in, _mm256_set1_ps(a.in_factor));
      if (!c) continue;
      const __m256 scale = _mm256_add_ps(n_in, load_halves(block + l.key_norm_out, t0 + 8 * v, B));
      for (uint32_t j = 0; j < c; ++j)
        terms[j][v] = _mm256_mul_ps(scale, load_halves(block + l.key_corrections + 2 * size_t(j) * B, t0 + 8 * v, B));
    }
    transpose_span(block + l.key_bits_in, bytes_in, B, t0, index_in);
    for (uint32_t r0 = 0; r0 < rows; r0 += kSignSumSets) {
      const uint32_t n = std::min(kSignSumSets, rows - r0);
      for (uint32_t r = r0; r < r0 + n; ++r) tables[r - r0] = projected_row(a, sq, r).tables;
      sign_sums(index_in, bytes_in, tables, n, sums);
      for (uint32_t r = r0; r < r0 + n; ++r) {
        const __m256i *sum = sums[r - r0];
        const ProjectedRow row = projected_row(a, sq, r);
        const float *qr = q + size_t(r) * dp;
        const __m256 step = _mm256_set1_ps(row.step);
        const int32_t offset = int32_t(uint32_t(4 * kQjlSplitBias) * bytes_in + uint32_t(row.sum));
        __m256 score[4];
        for (uint32_t v = 0; v < 4; ++v) score[v] = _mm256_mul_ps(norm_in[v], signed_dot(sum[v], offset, step));
        for (uint32_t j = 0; j < c; ++j) {
          const __m256 qj = _mm256_set1_ps(qr[outliers[j]]);
          for (uint32_t v = 0; v < 4; ++v) score[v] = _mm256_fmadd_ps(qj, terms[j][v], score[v]);
        }
        for (uint32_t v = 0; v < 4; ++v) _mm256_storeu_ps(out + size_t(r) * out_stride + t0 + 8 * v, score[v]);
      }
    }
  }
}

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
    t.kivi_scores = &avx2::kivi_scores_integer;
    t.qjl_project = &avx2::qjl_project_integer;
    t.qjl_scores = &avx2::qjl_scores_integer;
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
