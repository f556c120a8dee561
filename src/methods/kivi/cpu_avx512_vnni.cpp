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

// The scheme (Q = 256·hi + lo, the residual term) is avx512_vnni.hpp's: codes of up to 4 bits take
// lo unsigned, 8-bit codes signed.
template <uint32_t BITS>
constexpr bool kSignedLow = BITS > 7;

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

// unpack64 as codes_scores calls it, and code_digits' weights of Σ Q_c (classes: GCC gives lambdas
// no target pragma, and vector returns need it).
template <uint32_t BITS>
struct Unpack64 {
  __m512i operator()(const uint8_t *row, uint32_t h) const { return unpack64<BITS>(row + 8 * BITS * h); }
};
struct UnitWeights {
  __m512i operator()(uint32_t) const { return _mm512_set1_epi32(1); }
};

// Per block, the digits of R <= 4 query rows (q_stride floats apart) into digits[j][r][2][16],
// their steps, and offset[r] = Σ_c q_c·min_c + mid·Σ_c ρ_c, taken as
// Σ_c q_c·(min_c + mid·scale_c) − mid·step·Σ_c Q_c (the Q_c summed exactly in int32 by
// code_digits: one operation per chunk, where summing each ρ_c took three). scale, mins: the block's per-channel key scales and
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
  int64_t code_sums[R];  // Σ Q_c
  code_digits<kSignedLow<BITS>, R>(scaled, d, d / 16, largest, UnitWeights{}, digits, step, code_sums);
  for (uint32_t r = 0; r < R; ++r) offset[r] = sums[4 * r] - mid * step[r] * float(code_sums[r]);
}

template <uint32_t BITS, uint32_t R>
void kivi_rows(const CodesArgs &a, const uint8_t *block, const float *q, size_t q_stride, float *scaled,
               int8_t *digits, float *out, size_t out_stride) {
  const BlockLayout &l = *a.layout;
  float step[R], offset[R];
  query_digits<BITS, R>(q, q_stride, block + l.key_scale, block + l.key_min, a.head_dim, scaled, digits, step,
                        offset);
  codes_scores<kSignedLow<BITS>, R>(l, block + l.key_codes, l.key_bytes_per_token_codes, a.block_tokens,
                                    a.head_dim / 64, digits, step, offset, out, out_stride, Unpack64<BITS>{});
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
