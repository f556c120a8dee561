// KIVI/OTT key scores in integers on AVX-512 VNNI (vpdpbusd, vpermb, vpmultishiftqb), within the
// error budget of SPEC §9 (docs/DESIGN.md, "Integer decode paths"). The target pragma comes after
// every include (avx512_vnni_begin.inc).
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

// Per block and query row, q'_c = q_c·scale_c is quantized to Q_c = round(q'_c / step) with
// |Q_c| <= 127·256, step = max|q'| / (127·256), and split into two byte digits Q = 256·hi + lo:
// two vpdpbusd with the codes give Σ code·hi and Σ code·lo exactly. hi is signed; lo is Q's low
// byte, unsigned, multiplied as vpdpbusd's unsigned operand against the codes as signed bytes
// (codes of up to 4 bits fit), so that both digits are bytes of Q, taken by one vpermb. 8-bit
// codes need the unsigned side themselves: then lo is signed (lo in [-128, 127], hi = (Q + 128)
// >> 8). The rounding residuals ρ_c = q'_c − step·Q_c are not lost:
// Σ ρ_c·code_c is taken as mid·Σ ρ_c with mid = (2^bits − 1)/2, so the error is
// Σ ρ_c·(code_c − mid), |ρ_c| <= step/2, about 1/(2·127·256·sqrt(3)) of max|q'| per channel.
// (Without that term the error doubled, to 0.8–2.4e-5 of ‖q‖·‖k‖, and q4's mean KL moved by 2 %
// in tools/eval.)
constexpr float kQueryCodeMax = 127.0f * 256.0f;
static_assert(255.0 * kQueryCodeMax * QJLKV_MAX_HEAD_DIM < 2147483647.0, "Σ code·Q must fit int32");
template <uint32_t BITS>
constexpr bool kSignedLow = BITS > 7;
constexpr uint32_t kDigitChunkBytes = 32;  // a chunk's hi and lo digits of one row

// Byte constants of the code unpacking, per bit width (the 8·BITS source bytes end a
// bytes_ending_at load).
struct Unpack {
  alignas(64) uint8_t gather[64];  // vpermb: qword q takes the BITS bytes of codes 8q..8q+7
  alignas(64) uint8_t shifts[64];  // vpmultishiftqb: byte i of a qword starts at bit BITS·i
};
constexpr Unpack make_unpack(uint32_t bits) {
  Unpack u{};
  for (uint32_t q = 0; q < 8; ++q)
    for (uint32_t i = 0; i < 8; ++i) {
      u.gather[8 * q + i] = uint8_t(kBytesEndingAt - 8 * bits + bits * q + i);
      u.shifts[8 * q + i] = uint8_t(bits * i);
    }
  return u;
}

// x and the dword at p, broadcast (embedded broadcast: a load, where GCC rematerialized the
// constant with a vpbroadcastd from a general register, a shuffle-port operation, at each use).
inline __m512i and_broadcast(__m512i x, const uint32_t *p) {
#if defined(__clang__)
  return _mm512_and_si512(x, _mm512_set1_epi32(int(*p)));
#else
  asm("vpandd %1%{1to16%}, %0, %0" : "+v"(x) : "m"(*p));
  return x;
#endif
}

// Codes 64h..64h+63 of a packed row as bytes (BITS·8 source bytes at row + 8·BITS·h, read by
// bytes_ending_at their end).
template <uint32_t BITS>
inline __m512i unpack64(const uint8_t *src) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(src);
  } else {
    static constexpr Unpack kUnpack = make_unpack(BITS);
    static constexpr uint32_t kCodeBits = 0x01010101u * ((1u << BITS) - 1u);
    static_assert(8 * BITS <= kBytesEndingAt);
    const __m512i bytes = _mm512_castsi256_si512(bytes_ending_at(src + 8 * BITS));
    const __m512i placed = _mm512_permutexvar_epi8(_mm512_load_si512(kUnpack.gather), bytes);
    return and_broadcast(_mm512_multishift_epi64_epi8(_mm512_load_si512(kUnpack.shifts), placed), &kCodeBits);
  }
}

// Sums the 4 dword partials of every token: partial[g] holds tokens 4g..4g+3, token 4g + i in
// 128-bit lane i; the result has token k in lane k.
inline __m512i sum_partials(const __m512i *partial) {
  const __m512i s0 = partial[0], s1 = partial[1], s2 = partial[2], s3 = partial[3];
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(s0, s1), _mm512_unpackhi_epi32(s0, s1));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(s2, s3), _mm512_unpackhi_epi32(s2, s3));
  const __m512i sum = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
  // Lane 4i + g now holds token 4g + i.
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sum);
}

// Scores of R query rows over the block's codes: out[r][t] = step[r]·Σ_c Q_rc·code_tc + offset[r].
// digits: per 16-channel chunk j and row, the 16 hi then the 16 lo digits (query_digits), each
// broadcast to the four 128-bit lanes as it is loaded (a load, no vector-port operation; chunk-major:
// a chunk's loads are one pointer and immediate offsets).
// Two groups of 4 tokens share each digit load: with one group, the 2·R digit loads per chunk
// outnumbered the vpdpbusd they fed half the time (loads, not multiplies, set the pace).
// Requests the next block's copy of each 8 tokens' codes as it starts them (prefetch_next_block).
template <uint32_t BITS, uint32_t R>
void codes_scores(const BlockLayout &layout, const uint8_t *codes, size_t row_bytes, uint32_t B, uint32_t d,
                  const int8_t *digits, const float *step, const float *offset, float *out, size_t out_stride) {
  const uint32_t halves = d / 64, Bp = padded_tokens(B);
  // 16 tokens from t0; kAll: all below B (no test per token, which made GCC rematerialize the
  // unpacking's constants in each branch).
  const auto tokens16 = [&](uint32_t t0, auto kAll) {
    const size_t stride = row_bytes;  // locals: through the captures GCC reloaded them for every token
    const int8_t *const digit_base = digits;
    // Σ code·Q per 4-token group, in int32 (exactly: see kQueryCodeMax).
    __m512i partial[R][4];
    for (uint32_t g = 0; g < 4; g += 2) {
      const uint32_t first = t0 + 4 * g;
      prefetch_next_block(layout, codes + first * stride, (std::min(first + 8, B) - std::min(first, B)) * stride);
      __m512i hi[2][R], lo[2][R];
      for (uint32_t k = 0; k < 2; ++k)
        for (uint32_t r = 0; r < R; ++r) hi[k][r] = lo[k][r] = _mm512_setzero_si512();
      for (uint32_t h = 0; h < halves; ++h) {
        __m512i x[2][4];
        for (uint32_t k = 0; k < 2; ++k) {
          const uint32_t t = t0 + 4 * (g + k);
          __m512i u[4];
          for (uint32_t i = 0; i < 4; ++i)
            u[i] = kAll || t + i < B ? unpack64<BITS>(codes + (t + i) * stride + 8 * BITS * h) : _mm512_setzero_si512();
          transpose_lanes(u, x[k]);
        }
        const int8_t *half_digits = digit_base + size_t(h) * 4 * R * kDigitChunkBytes;
        for (uint32_t c = 0; c < 4; ++c)
          for (uint32_t r = 0; r < R; ++r) {
            const int8_t *chunk = half_digits + (c * R + r) * kDigitChunkBytes;
            const __m512i high = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i *>(chunk)));
            const __m512i low = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i *>(chunk + 16)));
            for (uint32_t k = 0; k < 2; ++k) {
              hi[k][r] = dpbusd(hi[k][r], x[k][c], high);
              lo[k][r] = kSignedLow<BITS> ? dpbusd(lo[k][r], x[k][c], low) : dpbusd(lo[k][r], low, x[k][c]);
            }
          }
      }
      for (uint32_t k = 0; k < 2; ++k)
        for (uint32_t r = 0; r < R; ++r) partial[r][g + k] = _mm512_add_epi32(_mm512_slli_epi32(hi[k][r], 8), lo[k][r]);
    }
    for (uint32_t r = 0; r < R; ++r)
      _mm512_storeu_ps(out + size_t(r) * out_stride + t0,
                       _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_partials(partial[r])), _mm512_set1_ps(step[r]),
                                       _mm512_set1_ps(offset[r])));
  };
  for (uint32_t t0 = 0; t0 < Bp; t0 += 16) {
    if (t0 + 16 <= B) tokens16(t0, std::true_type{});
    else tokens16(t0, std::false_type{});
  }
}

// vpermb indices that put the digits of 16 int32 Q in bytes 0-31: hi (byte 1 of each) in bytes
// 0-15, lo (byte 0) in bytes 16-31. With signed lo they are taken from Q + 128, whose byte 1 is
// (Q + 128) >> 8 and byte 0 lo with its top bit flipped (an xor with low_sign flips it back).
struct DigitBytes {
  alignas(64) uint8_t index[64];
  alignas(64) uint8_t low_sign[64];
};
constexpr DigitBytes make_digit_bytes() {
  DigitBytes b{};
  for (uint32_t i = 0; i < 16; ++i) {
    b.index[i] = uint8_t(4 * i + 1);
    b.index[16 + i] = uint8_t(4 * i);
    b.low_sign[16 + i] = 0x80;
  }
  return b;
}
constexpr DigitBytes kDigitBytes = make_digit_bytes();

// Per block, the digits of R <= 4 query rows (q_stride floats apart) into digits[j][r][2][16],
// their steps, and offset[r] = Σ_c q_c·min_c + mid·Σ_c ρ_c, taken as
// Σ_c q_c·(min_c + mid·scale_c) − mid·step·Σ_c Q_c (the Q_c summed exactly in int32: one add per
// chunk, where summing each ρ_c took three). scale, mins: the block's per-channel key scales and
// minima (fp16, converted as they are read: through fp32 scratch they were a store and a reload
// more per block); scaled: scratch for R rows of q·scale. The rows share every conversion of
// scale and mins and every horizontal reduction.
inline __m512 load_f16(const uint8_t *p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
}
template <uint32_t BITS, uint32_t R>
void query_digits(const float *q, size_t q_stride, const uint8_t *scale, const uint8_t *mins, uint32_t d,
                  float *scaled, int8_t *digits, float *step, float *offset) {
  constexpr float mid = float((1u << BITS) - 1u) * 0.5f;
  __m512 top[4], dot[4];
  for (uint32_t r = 0; r < 4; ++r) top[r] = dot[r] = _mm512_setzero_ps();
  for (uint32_t j = 0; j < d; j += 16) {
    const __m512 s = load_f16(scale + 2 * j);
    const __m512 m = _mm512_fmadd_ps(s, _mm512_set1_ps(mid), load_f16(mins + 2 * j));  // min + mid·scale
    for (uint32_t r = 0; r < R; ++r) {
      const __m512 x = _mm512_loadu_ps(q + r * q_stride + j), product = _mm512_mul_ps(x, s);
      _mm512_storeu_ps(scaled + size_t(r) * d + j, product);
      top[r] = _mm512_range_ps(top[r], product, 0x0B);  // the larger magnitude, sign cleared
      dot[r] = _mm512_fmadd_ps(x, m, dot[r]);
    }
  }
  alignas(64) float largest[16], sums[16];
  _mm512_store_ps(largest, reduce_rows4(top, MaxOp{}));
  _mm512_store_ps(sums, reduce_rows4(dot, AddOp{}));
  const __m512i digit_bytes = _mm512_load_si512(kDigitBytes.index);
  __m512 factor[R];
  for (uint32_t r = 0; r < R; ++r) {
    const CodeScale code = code_scale(largest[4 * r], kQueryCodeMax);
    step[r] = largest[4 * r] > 0.0f ? largest[4 * r] / kQueryCodeMax : 0.0f;
    offset[r] = sums[4 * r];
    float *row = scaled + size_t(r) * d;
    if (code.prescale != 1.0f)  // tiny rows only: then one multiply per chunk below
      for (uint32_t j = 0; j < d; j += 16)
        _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), _mm512_set1_ps(code.prescale)));
    factor[r] = _mm512_set1_ps(code.factor);
  }
  __m512i total[R];  // Σ Q_c, |Σ| <= 127·256·256 < 2^24: exact in fp32 too
  for (uint32_t r = 0; r < R; ++r) total[r] = _mm512_setzero_si512();
  int8_t *chunk = digits;
  for (uint32_t j = 0; j < d; j += 16)  // the rows together: one loop, R independent chains
    for (uint32_t r = 0; r < R; ++r, chunk += kDigitChunkBytes) {
      const __m512i Q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(scaled + size_t(r) * d + j), factor[r]));
      total[r] = _mm512_add_epi32(total[r], Q);
      __m512i bytes;
      if constexpr (kSignedLow<BITS>)
        bytes = _mm512_xor_si512(_mm512_permutexvar_epi8(digit_bytes, _mm512_add_epi32(Q, _mm512_set1_epi32(128))),
                                 _mm512_load_si512(kDigitBytes.low_sign));
      else
        bytes = _mm512_permutexvar_epi8(digit_bytes, Q);
      _mm256_storeu_si256(reinterpret_cast<__m256i *>(chunk), _mm512_castsi512_si256(bytes));
    }
  __m512 totals[4];
  for (uint32_t r = 0; r < 4; ++r) totals[r] = r < R ? _mm512_cvtepi32_ps(total[r]) : _mm512_setzero_ps();
  alignas(64) float code_sums[16];
  _mm512_store_ps(code_sums, reduce_rows4(totals, AddOp{}));
  for (uint32_t r = 0; r < R; ++r) offset[r] -= mid * step[r] * code_sums[4 * r];
}

template <uint32_t BITS, uint32_t R>
void kivi_rows(const CodesArgs &a, const uint8_t *block, const float *q, size_t q_stride, float *scaled,
               int8_t *digits, float *out, size_t out_stride) {
  const BlockLayout &l = *a.layout;
  float step[R], offset[R];
  query_digits<BITS, R>(q, q_stride, block + l.key_scale, block + l.key_min, a.head_dim, scaled, digits, step,
                        offset);
  codes_scores<BITS, R>(l, block + l.key_codes, l.key_bytes_per_token_codes, a.block_tokens, a.head_dim, digits,
                        step, offset, out, out_stride);
}

template <uint32_t BITS>
void kivi_scores_bits(const CodesArgs &a, const uint8_t *block, const float *q, uint32_t rows, float *out,
                      size_t out_stride, float *scratch) {
  const BlockLayout &l = *a.layout;
  const uint32_t d = a.head_dim, dp = padded_dim(d);  // d % 64 == 0 here
  // scratch: q·scale [4][d], then the digits of 4 rows
  float *scaled = scratch;
  auto *digits = reinterpret_cast<int8_t *>(scaled + 4 * size_t(d));
  // The next block's scales and minima now, its codes as codes_scores reaches them, then the rest
  // (OTT's mask).
  const size_t codes_end = l.key_codes + size_t(a.block_tokens) * l.key_bytes_per_token_codes;
  prefetch_next_block(l, block, l.key_codes);
  prefetch_next_block(l, block + codes_end, l.key_bytes - codes_end);
  for (uint32_t r0 = 0; r0 < rows; r0 += 4) {
    const float *qr = q + size_t(r0) * dp;
    float *o = out + size_t(r0) * out_stride;
    switch (std::min(4u, rows - r0)) {
      case 1: kivi_rows<BITS, 1>(a, block, qr, dp, scaled, digits, o, out_stride); break;
      case 2: kivi_rows<BITS, 2>(a, block, qr, dp, scaled, digits, o, out_stride); break;
      case 3: kivi_rows<BITS, 3>(a, block, qr, dp, scaled, digits, o, out_stride); break;
      default: kivi_rows<BITS, 4>(a, block, qr, dp, scaled, digits, o, out_stride); break;
    }
  }
}

void kivi_scores(const CodesArgs &a, const uint8_t *block, const float *q, uint32_t rows, float *out,
                 size_t out_stride, float *scratch) {
  if (a.head_dim % 64 != 0) {  // the integer path works in 64-code halves of a token's row
    avx512_kernels().kivi.scores(a, block, q, rows, out, out_stride, scratch);
    return;
  }
  switch (a.bits) {
    case 2: kivi_scores_bits<2>(a, block, q, rows, out, out_stride, scratch); break;
    case 3: kivi_scores_bits<3>(a, block, q, rows, out, out_stride, scratch); break;
    case 4: kivi_scores_bits<4>(a, block, q, rows, out, out_stride, scratch); break;
    default: kivi_scores_bits<8>(a, block, q, rows, out, out_stride, scratch); break;
  }
}

}  // namespace
}  // namespace qjlkv::cpu::avx512_vnni

#include "../../cpu/avx512_vnni_end.inc"

namespace qjlkv::cpu {
KiviKernels kivi_kernels_avx512_vnni(const KiviKernels &avx512) {
  KiviKernels kernels = avx512;
  kernels.scores = &avx512_vnni::kivi_scores;
  return kernels;
}
}  // namespace qjlkv::cpu
#endif
