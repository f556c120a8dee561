// QJL key scores in integers on AVX-512 VNNI (vpdpbusd, vpermb), within the error budget of
// SPEC §9 (docs/DESIGN.md, "Integer decode paths"). The target pragma comes after every include
// (avx512_vnni_begin.inc).
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

// ---- QJL keys -------------------------------------------------------------------------------------
// With b_i a token's sign bits, ⟨x, ±b⟩ = 2·Σ_i x_i·b_i − Σ_i x_i. The kernel takes Σ_i x_i·b_i on
// int16 codes X ≈ x/step FastScan-style: the four nibbles of every two bytes of a token's sign
// bits (16 sketch rows) go to the four bytes of its dword lane as indices 16p + nibble_p into
// the codes' tables (the 64 subset sums of 4 codes per nibble position, as
// low and high bytes); two vpermb look up the bytes and two vpdpbusd add them, against ones, into
// the token's low-byte and high-byte int32 sums (sum = 256·high + low, exact), 16 tokens and 16
// rows per instruction; all code sets of a pass share each index vector. (vpermw on int16 pair
// tables took 3 operations per 8 rows where these take 4 per 16.) The subset sums are exact in
// int16 while |X| <= kQjlCodeMax (4·8191 < 2^15).
// What is coded: S·q once per call and row (qjl_project, step = max_i |(S·q)_i| / 8191); the
// outlier channels add Σ_o q_o·τ_o·(n_in + n_out) in fp32 from the stored corrections
// (quant_math.hpp's qjl_correction). Each row's error is Σ_i ρ_i·(±1), |ρ_i| <= step/2.

// Constant index vectors of the QJL kernel.
struct QjlConstants {
  // vpmultishiftqb: from dwords holding 4 sign-bit bytes of a token, the 4 nibbles of bytes 2q,
  // 2q + 1 into the dword's bytes 0-3 (upper bits cleared after).
  alignas(64) uint8_t nibbles[2][64];
  // Pair tables from the subset-sum halves of a group of 4 nibble positions (subset_halves:
  // words 8p..8p+3 of position p hold {0, x0, x1, x0 + x1}, words 8p+4..8p+7 {0, x2, x3,
  // x2 + x3}): table[e] = low[e & 3] + high[e >> 2] for positions 2l, 2l+1.
  alignas(64) uint16_t low[2][32], high[2][32];
  // vpermt2b: the low (even) and high (odd) bytes of 64 words in two vectors.
  alignas(64) uint8_t even[64], odd[64];
};
constexpr QjlConstants make_qjl_constants() {
  QjlConstants c{};
  for (uint32_t q = 0; q < 2; ++q)
    for (uint32_t qword = 0; qword < 8; ++qword)
      for (uint32_t b = 0; b < 8; ++b) {
        const uint32_t dword = b / 4, nibble = b % 4;
        c.nibbles[q][8 * qword + b] = uint8_t(32 * dword + 16 * q + 4 * nibble);
      }
  for (uint32_t l = 0; l < 2; ++l)
    for (uint32_t w = 0; w < 32; ++w) {
      const uint32_t p = 2 * l + w / 16, e = w % 16;
      c.low[l][w] = uint16_t(8 * p + (e & 3));
      c.high[l][w] = uint16_t(8 * p + 4 + (e >> 2));
    }
  for (uint32_t i = 0; i < 64; ++i) {
    c.even[i] = uint8_t(2 * i);
    c.odd[i] = uint8_t(2 * i + 1);
  }
  return c;
}
constexpr QjlConstants kQjl = make_qjl_constants();

// Dword k of the R-dword sign rows of 16 tokens from `rows` (tokens past `valid` read as 0):
// out[k] lane t = dword k of token t. log2(R) rounds of even/odd dword splits of the row-major
// 16×R matrix; each round moves the lowest bit of k to the top of the vector index, so the
// vectors end in the order of k.
template <uint32_t R>
void transpose_sign_rows(const uint8_t *rows, uint32_t valid, __m512i *out) {
  const uint32_t valid_dwords = std::min(valid, 16u) * R;
  __m512i z[R];
  for (uint32_t j = 0; j < R; ++j)
    z[j] = _mm512_maskz_loadu_epi32(lanes_below(16 * j, valid_dwords), rows + 64 * size_t(j));
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (uint32_t n = R; n > 1; n /= 2) {
    __m512i y[R];
    for (uint32_t i = 0; i < R / 2; ++i) {
      y[i] = _mm512_permutex2var_epi32(z[2 * i], even, z[2 * i + 1]);
      y[R / 2 + i] = _mm512_permutex2var_epi32(z[2 * i], odd, z[2 * i + 1]);
    }
    for (uint32_t i = 0; i < R; ++i) z[i] = y[i];
  }
  for (uint32_t k = 0; k < R; ++k) out[k] = z[k];
}

void transpose_sign_rows(uint32_t R, const uint8_t *rows, uint32_t valid, __m512i *out) {
  switch (R) {
    case 1: transpose_sign_rows<1>(rows, valid, out); break;
    case 2: transpose_sign_rows<2>(rows, valid, out); break;
    case 4: transpose_sign_rows<4>(rows, valid, out); break;
    case 8: transpose_sign_rows<8>(rows, valid, out); break;
    default: transpose_sign_rows<16>(rows, valid, out); break;
  }
}

// The int32 lanes of x summed with wrapping (unsigned) adds: a non-finite projection (a query
// whose logits overflow) turns codes into INT_MIN, and signed sums would overflow on them.
int32_t lane_sum(__m512i x) {
  const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64(x, 1));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
}

// The subset-sum halves of the 16 codes in the low words of X's dwords (QjlConstants: words
// 8p..8p+7 from codes 4p..4p+3). They stay within each 128-bit lane, so two in-lane byte
// shuffles make them (cheaper than vpermw): {0, x0, x1, x0, 0, x2, x3, x2} + {0, 0, 0, x1, 0, 0,
// 0, x3}.
inline __m512i subset_halves(__m512i X) {
  const __m512i singles = _mm512_broadcast_i32x4(
      _mm_setr_epi8(-1, -1, 0, 1, 4, 5, 0, 1, -1, -1, 8, 9, 12, 13, 8, 9));
  const __m512i seconds = _mm512_broadcast_i32x4(
      _mm_setr_epi8(-1, -1, -1, -1, -1, -1, 4, 5, -1, -1, -1, -1, -1, -1, 12, 13));
  return _mm512_add_epi16(_mm512_shuffle_epi8(X, singles), _mm512_shuffle_epi8(X, seconds));
}

// The QuadBytes tables of the 16 codes in the low words of X's dwords (two sign bytes): the 64
// subset sums as words (entries 16p + e, p = 2l + w/16 in word w of vector l), split into their
// low and high bytes.
inline void store_quad_tables(__m512i X, __m512i *tables) {
  const __m512i halves = subset_halves(X);
  __m512i sums[2];
  for (uint32_t l = 0; l < 2; ++l)
    sums[l] = _mm512_add_epi16(_mm512_permutexvar_epi16(_mm512_load_si512(kQjl.low[l]), halves),
                               _mm512_permutexvar_epi16(_mm512_load_si512(kQjl.high[l]), halves));
  _mm512_storeu_si512(tables, _mm512_permutex2var_epi8(sums[0], _mm512_load_si512(kQjl.even), sums[1]));
  _mm512_storeu_si512(tables + 1, _mm512_permutex2var_epi8(sums[0], _mm512_load_si512(kQjl.odd), sums[1]));
}

// sums[2j + h] (lane t: token 16h + t of the span) = Σ_i X_ji·b_ti over `bytes` sign bytes, for the
// N code sets whose tables (one per byte) start at tables[j]; dwords[2k + h]: dword k of the
// span's chunk h.
template <uint32_t N>
void sign_sums(const __m512i *dwords, uint32_t bytes, const SignTable *const *tables, __m512i *sums) {
  // (x & clear) | position: nibble p of the dword's 16 rows indexes entries 16p..16p + 15.
  const __m512i clear = _mm512_set1_epi32(0x0F0F0F0F), position = _mm512_set1_epi32(0x30201000);
  const __m512i ones = _mm512_set1_epi8(1);
  for (uint32_t h = 0; h < 2; ++h) {
    __m512i low[N], high[N];
    for (uint32_t j = 0; j < N; ++j) low[j] = high[j] = _mm512_setzero_si512();
    for (uint32_t k = 0; k < bytes / 4; ++k) {
      const __m512i d = _mm512_load_si512(dwords + 2 * k + h);
#pragma GCC unroll 2
      for (uint32_t q = 0; q < 2; ++q) {
        const __m512i index = _mm512_ternarylogic_epi32(
            _mm512_multishift_epi64_epi8(_mm512_load_si512(kQjl.nibbles[q]), d), clear, position, 0xEA);
        for (uint32_t j = 0; j < N; ++j) {
          const SignTable *pair = tables[j] + 4 * k + 2 * q;  // row tables: in sq, any alignment
          low[j] = dpbusd(low[j], _mm512_permutexvar_epi8(index, _mm512_loadu_si512(pair)), ones);
          high[j] = dpbusd(high[j], ones, _mm512_permutexvar_epi8(index, _mm512_loadu_si512(pair + 1)));
        }
      }
    }
    for (uint32_t j = 0; j < N; ++j)
      _mm512_store_si512(sums + 2 * j + h, _mm512_add_epi32(_mm512_slli_epi32(high[j], 8), low[j]));
  }
}

constexpr uint32_t kSignSumSets = 8;  // code sets per pass: 16 accumulators
void sign_sums(const __m512i *dwords, uint32_t bytes, const SignTable *const *tables, uint32_t n, __m512i *sums) {
  switch (n) {
    case 1: sign_sums<1>(dwords, bytes, tables, sums); break;
    case 2: sign_sums<2>(dwords, bytes, tables, sums); break;
    case 3: sign_sums<3>(dwords, bytes, tables, sums); break;
    case 4: sign_sums<4>(dwords, bytes, tables, sums); break;
    case 5: sign_sums<5>(dwords, bytes, tables, sums); break;
    case 6: sign_sums<6>(dwords, bytes, tables, sums); break;
    case 7: sign_sums<7>(dwords, bytes, tables, sums); break;
    default: sign_sums<8>(dwords, bytes, tables, sums); break;
  }
}

// S·q as the avx512 kernel computes it, then per row its codes (header of this section).
void qjl_project(const QjlArgs &a, const float *q, uint32_t rows, float *sq) {
  qjl_project_avx512(a, q, rows, sq);
  if (!qjl_integer_layer(a)) return;
  for (uint32_t r = 0; r < rows; ++r) {
    float *row = sq + size_t(r) * a.projected_stride;
    __m512 top = _mm512_setzero_ps();
    for (uint32_t i = 0; i < a.m; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(row + i)));
    const float largest = _mm512_reduce_max_ps(top);
    const CodeScale code = code_scale(largest, kQjlCodeMax);
    auto *tables = reinterpret_cast<__m512i *>(row + a.sketch_t_stride);
    __m512i total = _mm512_setzero_si512();
    for (uint32_t i = 0; i < a.m; i += 16) {
      const __m512i X = _mm512_cvtps_epi32(
          _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(row + i), _mm512_set1_ps(code.prescale)), _mm512_set1_ps(code.factor)));
      total = _mm512_add_epi32(total, X);
      store_quad_tables(X, tables + i / 8);
    }
    store_projected_tail(a, sq, r, largest / kQjlCodeMax, lane_sum(total));
  }
}

// The sign bits of `sketch_rows` rows at `bits` for the span's 32 tokens from t0, transposed:
// dwords[2k + h] lane t = dword k of token t0 + 16h + t.
void transpose_span(const uint8_t *bits, uint32_t sketch_rows, uint32_t B, uint32_t t0, __m512i *dwords) {
  for (uint32_t h = 0; h < 2; ++h) {
    const uint32_t t = t0 + 16 * h, valid = t < B ? B - t : 0;
    __m512i rows[16];
    transpose_sign_rows(sketch_rows / 32, bits + size_t(t) * (sketch_rows / 8), valid, rows);
    for (uint32_t k = 0; k < sketch_rows / 32; ++k) _mm512_store_si512(dwords + 2 * k + h, rows[k]);
  }
}

// (2·sums − total)·scale of a code set's two 16-token halves, in fp32.
inline __m512 signed_dot(__m512i sums, int32_t total, __m512 scale) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_slli_epi32(sums, 1), _mm512_set1_epi32(total))), scale);
}

void qjl_scores(const QjlArgs &a, const uint8_t *block, const float *q, const float *sq, uint32_t rows, float *out,
                size_t out_stride, float *scratch) {
  if (!qjl_integer_layer(a)) {
    avx512_kernels().qjl.scores(a, block, q, sq, rows, out, out_stride, scratch);
    return;
  }
  const BlockLayout &l = *a.layout;
  prefetch_next_block(l, block, l.key_bytes);
  const uint32_t dp = padded_dim(a.head_dim), m = a.m, B = a.block_tokens, Bp = padded_tokens(B);
  const uint32_t c = a.outlier_channels;
  // Scratch (64-byte aligned pieces): the span's transposed sign dwords; per outlier channel j
  // and half h, the term (n_in + n_out)·τ_j: score = inlier row term + Σ_j q_oj·term_j; one
  // pass's sums.
  auto *dwords_in = reinterpret_cast<__m512i *>(scratch);
  auto *terms = reinterpret_cast<__m512 *>(dwords_in + m / 16);
  auto *sums = reinterpret_cast<__m512i *>(terms + 2 * size_t(c));
  const uint8_t *outliers = block + l.key_outlier_idx;
  const SignTable *tables[kSignSumSets];
  const auto halves = [&](size_t offset, __mmask16 valid, uint32_t t) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, block + offset + 2 * size_t(t)));
  };
  for (uint32_t t0 = 0; t0 < Bp; t0 += 32) {
    __m512 norm_in[2];  // times c_d/m
    for (uint32_t h = 0; h < 2; ++h) {
      const uint32_t t = t0 + 16 * h;
      const __mmask16 valid = lanes_below(t, B);
      const __m512 n_in = halves(l.key_norm_in, valid, t);
      norm_in[h] = _mm512_mul_ps(n_in, _mm512_set1_ps(a.in_factor));
      if (!c) continue;
      const __m512 scale = _mm512_add_ps(n_in, halves(l.key_norm_out, valid, t));
      for (uint32_t j = 0; j < c; ++j)
        terms[2 * j + h] = _mm512_mul_ps(scale, halves(l.key_corrections + 2 * size_t(j) * B, valid, t));
    }
    transpose_span(block + l.key_bits_in, m, B, t0, dwords_in);
    for (uint32_t r0 = 0; r0 < rows; r0 += kSignSumSets) {
      const uint32_t n = std::min(kSignSumSets, rows - r0);
      for (uint32_t r = r0; r < r0 + n; ++r) tables[r - r0] = projected_row(a, sq, r).tables;
      sign_sums(dwords_in, m / 8, tables, n, sums);
      for (uint32_t r = r0; r < r0 + n; ++r) {
        const __m512i *sum = sums + 2 * (r - r0);
        const ProjectedRow row = projected_row(a, sq, r);
        const float *qr = q + size_t(r) * dp;
        const __m512 step = _mm512_set1_ps(row.step);
        __m512 score[2] = {_mm512_mul_ps(norm_in[0], signed_dot(sum[0], row.sum, step)),
                           _mm512_mul_ps(norm_in[1], signed_dot(sum[1], row.sum, step))};
        for (uint32_t j = 0; j < c; ++j) {
          const __m512 qj = _mm512_set1_ps(qr[outliers[j]]);
          for (uint32_t h = 0; h < 2; ++h) score[h] = _mm512_fmadd_ps(qj, terms[2 * j + h], score[h]);
        }
        for (uint32_t h = 0; h < 2; ++h) _mm512_storeu_ps(out + size_t(r) * out_stride + t0 + 16 * h, score[h]);
      }
    }
  }
}

}  // namespace
}  // namespace qjlkv::cpu::avx512_vnni

#include "../../cpu/avx512_vnni_end.inc"

namespace qjlkv::cpu {
QjlKernels qjl_kernels_avx512_vnni(const QjlKernels &avx512) {
  QjlKernels kernels = avx512;
  kernels.project = &avx512_vnni::qjl_project;
  kernels.scores = &avx512_vnni::qjl_scores;
  return kernels;
}
}  // namespace qjlkv::cpu
#endif
