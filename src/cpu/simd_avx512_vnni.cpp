// AVX-512 kernels with integer decode paths (VNNI vpdpbusd/vpdpwssd, VBMI vpermb/vpmultishiftqb):
// the AVX-512 table with QJL and KIVI/OTT key scores and rotated Lloyd-Max and uniform value sums
// in integers, within the error budget of SPEC §9 (docs/DESIGN.md, "Integer decode paths").
// Every other kernel is the AVX-512 one.
// The target pragma comes after every include, as in simd_avx512.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "simd.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(                                                                                   \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace qjlkv::cpu::avx512_vnni {
namespace {

// sum + the pairwise products of a and b: vpdpbusd (a unsigned bytes, b signed bytes, 4 per dword)
// and vpdpwssd (int16 pairs). GCC 12 does not tie the builtins' accumulator to their result, and
// in the kernels' loops it copied every sum through another register, often the stack, at each
// use (the Lloyd-Max value sums measured ~25 % slower than clang's code); tied asm operands keep
// the sums in place. b may come from memory.
inline __m512i dpbusd(__m512i sum, __m512i a, __m512i b) {
#if defined(__clang__)
  return _mm512_dpbusd_epi32(sum, a, b);
#else
  asm("vpdpbusd %2, %1, %0" : "+v"(sum) : "v"(a), "vm"(b));
  return sum;
#endif
}
inline __m512i dpwssd(__m512i sum, __m512i a, __m512i b) {
#if defined(__clang__)
  return _mm512_dpwssd_epi32(sum, a, b);
#else
  asm("vpdpwssd %2, %1, %0" : "+v"(sum) : "v"(a), "vm"(b));
  return sum;
#endif
}
// sum + the pairwise products of a and the int16 pair at p, broadcast to every dword (embedded
// broadcast: one instruction, where a separate vpbroadcastd was another for each product).
inline __m512i dpwssd_broadcast(__m512i sum, __m512i a, const int16_t *p) {
#if defined(__clang__)
  int32_t pair;
  std::memcpy(&pair, p, 4);
  return _mm512_dpwssd_epi32(sum, a, _mm512_set1_epi32(pair));
#else
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(a), "m"(*reinterpret_cast<const int32_t *>(p)));
  return sum;
#endif
}

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

// The kBytesEndingAt bytes before `end`: how the kernels read packed codes, a plain load where a
// masked one that read no byte past them was a second operation on the vector ports. Before a
// block's key codes lie its scales and minima, before its value codes its value scales and keys
// (at least 32 bytes either way), so the loads stay in the block and never pass the rows.
constexpr uint32_t kBytesEndingAt = 32;
inline __m256i bytes_ending_at(const uint8_t *end) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(end - kBytesEndingAt));
}

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

// The lanes of [first, first + 16) that lie below `end`.
inline __mmask16 lanes_below(uint32_t first, uint32_t end) {
  return first + 16 <= end ? __mmask16(0xffff) : first < end ? __mmask16((1u << (end - first)) - 1u) : __mmask16(0);
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

// 4×4 transpose of 128-bit lanes: x[c] = lane c of u[0], u[1], u[2], u[3].
inline void transpose_lanes(const __m512i u[4], __m512i x[4]) {
  const __m512i a = _mm512_shuffle_i64x2(u[0], u[1], 0x44), b = _mm512_shuffle_i64x2(u[0], u[1], 0xEE);
  const __m512i c = _mm512_shuffle_i64x2(u[2], u[3], 0x44), e = _mm512_shuffle_i64x2(u[2], u[3], 0xEE);
  x[0] = _mm512_shuffle_i64x2(a, c, 0x88);
  x[1] = _mm512_shuffle_i64x2(a, c, 0xDD);
  x[2] = _mm512_shuffle_i64x2(b, e, 0x88);
  x[3] = _mm512_shuffle_i64x2(b, e, 0xDD);
}

// 64 channels with channel 4j + k in lane j of v[k], put in order: x[m] holds channels
// 16m..16m+15. A 4x4 transpose within each 128-bit lane (lane m of u[a]: channels 16m + 4a +
// 0..3), then one of the lanes.
inline void channel_order(const __m512 v[4], __m512 x[4]) {
  const __m512d lo01 = _mm512_castps_pd(_mm512_unpacklo_ps(v[0], v[1]));
  const __m512d hi01 = _mm512_castps_pd(_mm512_unpackhi_ps(v[0], v[1]));
  const __m512d lo23 = _mm512_castps_pd(_mm512_unpacklo_ps(v[2], v[3]));
  const __m512d hi23 = _mm512_castps_pd(_mm512_unpackhi_ps(v[2], v[3]));
  const __m512i u[4] = {_mm512_castpd_si512(_mm512_unpacklo_pd(lo01, lo23)),
                        _mm512_castpd_si512(_mm512_unpackhi_pd(lo01, lo23)),
                        _mm512_castpd_si512(_mm512_unpacklo_pd(hi01, hi23)),
                        _mm512_castpd_si512(_mm512_unpackhi_pd(hi01, hi23))};
  __m512i t[4];
  transpose_lanes(u, t);
  for (uint32_t m = 0; m < 4; ++m) x[m] = _mm512_castsi512_ps(t[m]);
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

struct MaxOp {
  __m512 operator()(__m512 a, __m512 b) const { return _mm512_max_ps(a, b); }
};
struct AddOp {
  __m512 operator()(__m512 a, __m512 b) const { return _mm512_add_ps(a, b); }
};
// Lanes 4r..4r+3 of the result: op over the 16 lanes of v[r], the 4 rows reduced together.
template <class Op>
inline __m512 reduce_rows4(const __m512 v[4], Op op) {
  const __m512 a = op(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const __m512 b = op(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  const __m512 c = op(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));  // lane r: row r
  const __m512 e = op(c, _mm512_permute_ps(c, 0x4E));
  return op(e, _mm512_permute_ps(e, 0xB1));
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
    avx512_kernels().kivi_scores(a, block, q, rows, out, out_stride, scratch);
    return;
  }
  switch (a.bits) {
    case 2: kivi_scores_bits<2>(a, block, q, rows, out, out_stride, scratch); break;
    case 3: kivi_scores_bits<3>(a, block, q, rows, out, out_stride, scratch); break;
    case 4: kivi_scores_bits<4>(a, block, q, rows, out, out_stride, scratch); break;
    default: kivi_scores_bits<8>(a, block, q, rows, out, out_stride, scratch); break;
  }
}

// ---- rotated Lloyd-Max values ------------------------------------------------------------------
// acc[r] += Σ_t w_rt·scale_t·level(code_t) with vpdpwssd: per block and row, the weights times the
// token scales become P_rt = round(w_rt·scale_t / pstep) in [0, kWeightCodeMax]; the levels are
// int16, L = round(level·kLevelCodeMax / largest level). Two tokens share a dword (P_t, P_t+1)
// against (L_t, L_t+1) of one channel; the int32 sums go to the fp32 accumulators every
// kFlushTokens tokens, within int32: kFlushTokens·kWeightCodeMax·kLevelCodeMax < 2^31. (Flushing
// every 32 tokens with levels to 16000 cost q3's values ≈ 10 % more time for ≈ 10 % less error:
// 1.1–1.6e-4 of the sums instead of 1.2–1.8e-4, tests/cpu_paths.) The next block's codes are
// requested kPrefetchTokens tokens at a time (prefetch_next_block in simd.hpp: larger bursts
// waited for miss buffers).
constexpr float kWeightCodeMax = 4095.0f, kLevelCodeMax = 8000.0f;
constexpr uint32_t kFlushTokens = 64, kPrefetchTokens = 8;
static_assert(double(kFlushTokens) * kWeightCodeMax * kLevelCodeMax < 2147483647.0);

// out + sums·unit[0]·unit[1] (unit: what one P·L step is worth, as two normal floats; unit[1] is
// 1 but for tiny weights, and then a multiply is saved).
inline __m512 add_units(__m512 sums, const float unit[2], __m512 out) {
  if (unit[1] == 1.0f) return _mm512_fmadd_ps(sums, _mm512_set1_ps(unit[0]), out);
  return _mm512_fmadd_ps(_mm512_mul_ps(sums, _mm512_set1_ps(unit[0])), _mm512_set1_ps(unit[1]), out);
}

// Bytes [end − 32, end) of two consecutive rows, token A's in bytes 0-31 and token B's in bytes
// 32-63: two bytes_ending_at loads, the second inserted from memory, where a masked load of each
// row and a two-source vpermt2b took three more operations on the vector ports. The value codes'
// bytes that a tile reads end its window. B is even (block_tokens is a multiple of 8), so every
// token has its pair.
inline __m512i row_pair(const uint8_t *end, size_t row_bytes) {
  static_assert(kBytesEndingAt == 32, "a row_pair is two 32-byte halves");
  return _mm512_inserti64x4(_mm512_castsi256_si512(bytes_ending_at(end)), bytes_ending_at(end + row_bytes), 1);
}

// Per 16-channel chunk z of a tile of CZ chunks (2·BITS·CZ bytes of a row, the end of a row_pair
// window): vpermb places, in qword k, the two bytes holding channels 16z+2k, 16z+2k+1 of token A
// (bytes 0-1) and of token B (bytes 2-3); vpmultishiftqb then puts each code in the low bits of
// its word: words (ch 2k, A), (ch 2k, B), (ch 2k+1, A), (ch 2k+1, B). Bits above the code are
// left in place: the level table repeats every 2^BITS entries, and vpermw reads 5 index bits.
struct ValueUnpack {
  alignas(64) uint8_t place[4][64];
  alignas(64) uint8_t shifts[64];  // the same for every chunk: a chunk starts on a byte
};
constexpr ValueUnpack make_value_unpack(uint32_t bits, uint32_t cz) {
  ValueUnpack u{};
  const uint32_t window = 32 - 2 * bits * cz;  // where the tile's bytes start in a token's 32
  for (uint32_t z = 0; z < cz; ++z)
    for (uint32_t k = 0; k < 8; ++k) {
      const uint32_t bit = 2 * k * bits, byte = window + 2 * bits * z + bit / 8, shift = bit % 8;
      const uint8_t source[8] = {uint8_t(byte), uint8_t(byte + 1), uint8_t(32 + byte), uint8_t(33 + byte), 0, 0, 0, 0};
      const uint8_t offsets[8] = {uint8_t(shift), 0, uint8_t(16 + shift), 0, uint8_t(shift + bits), 0,
                                  uint8_t(16 + shift + bits), 0};
      for (uint32_t i = 0; i < 8; ++i) {
        u.place[z][8 * k + i] = source[i];
        u.shifts[8 * k + i] = offsets[i];
      }
    }
  return u;
}

// The first tile of a row group requests the next block's copy of each kPrefetchTokens tokens'
// codes as it starts them (prefetch_next_block).
template <uint32_t BITS, uint32_t R, uint32_t CZ>
void lloyd_max_tile(const BlockLayout &layout, const uint8_t *codes, size_t row_bytes, uint32_t B, uint32_t half,
                    uint32_t j0, __m512i levels, const int16_t *P, uint32_t P_stride, const float (*unit)[2],
                    float *acc, uint32_t dp) {
  static constexpr ValueUnpack kUnpack = make_value_unpack(BITS, CZ);
  static_assert(2 * BITS * CZ <= 32);
  const uint8_t *tile_end = codes + size_t(half) * 16 * BITS + 2 * BITS * (j0 + CZ);  // of row 0
  for (uint32_t t0 = 0; t0 < B; t0 += kFlushTokens) {
    __m512i sum[R][CZ];
    for (uint32_t r = 0; r < R; ++r)
      for (uint32_t z = 0; z < CZ; ++z) sum[r][z] = _mm512_setzero_si512();
    const uint32_t end = std::min(B, t0 + kFlushTokens);
    for (uint32_t t = t0; t < end; t += 2) {
      if (half == 0 && j0 == 0 && t % kPrefetchTokens == 0)
        prefetch_next_block(layout, codes + t * row_bytes, (std::min(end, t + kPrefetchTokens) - t) * row_bytes);
      const __m512i rows = row_pair(tile_end + t * row_bytes, row_bytes);
      __m512i weight[R];
      for (uint32_t r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, P + size_t(r) * P_stride + t, 4);
        weight[r] = _mm512_set1_epi32(pair);
      }
      for (uint32_t z = 0; z < CZ; ++z) {
        const __m512i placed = _mm512_permutexvar_epi8(_mm512_load_si512(kUnpack.place[z]), rows);
        const __m512i index = _mm512_multishift_epi64_epi8(_mm512_load_si512(kUnpack.shifts), placed);
        const __m512i level = _mm512_permutexvar_epi16(index, levels);
        for (uint32_t r = 0; r < R; ++r) sum[r][z] = dpwssd(sum[r][z], level, weight[r]);
      }
    }
    for (uint32_t r = 0; r < R; ++r)
      for (uint32_t z = 0; z < CZ; ++z) {
        float *a = acc + size_t(r) * dp + 128 * half + 16 * (j0 + z);
        _mm512_storeu_ps(a, add_units(_mm512_cvtepi32_ps(sum[r][z]), unit[r], _mm512_loadu_ps(a)));
      }
  }
}

// 2-bit codes, 64 channels from c0 (a multiple of 64): the 16 bytes of a row that hold them,
// 4 codes each. vpermb puts byte j of token A in word 2j and of token B in word 2j + 1 (from a
// row_pair); the level table T0 (entry i: level of i's bits 0-1) and T2 (bits 2-3), on those
// words and on them shifted right by 4, give the levels of channels 4j + k for k = 0..3 in dword
// lane j: one vpermb, one shift and four vpermw per 64 channels of a pair, where lloyd_max_tile
// takes three shuffles per 16. The sums come out with channel 4j + k in lane j of sum[r][k] and
// stay so in acc (channels c0 + 4j + k at c0 + 16k + j): in_channel_order puts them back
// once per attend, where doing it at each flush took 16 shuffles per row and tile of every block.
// (A layer's blocks all take these tiles, for channels [0, 64·floor(d / 64)).)
// vpermb indices for the 2-bit tiles: lane j takes byte b(j) = (j % n)·16/n + j/n of the 16-byte
// runs of two tokens in a row_pair, bytes 16-31 (A, to word 2j) and 48-63 (B, to word 2j + 1),
// n = 1, 2, 4.
struct TwoBitPlace {
  alignas(64) uint8_t place[3][64];        // per log2 n
  alignas(64) uint32_t byte_order[3][16];  // lane b of the result takes lane j with b(j) = b
};
constexpr TwoBitPlace make_two_bit_place() {
  TwoBitPlace p{};
  for (uint32_t log = 0; log < 3; ++log) {
    const uint32_t n = 1u << log;
    for (uint32_t j = 0; j < 16; ++j) {
      const uint32_t byte = (j % n) * (16 / n) + j / n;
      p.place[log][4 * j] = uint8_t(16 + byte);
      p.place[log][4 * j + 2] = uint8_t(48 + byte);
      p.byte_order[log][byte] = j;
    }
  }
  return p;
}
constexpr TwoBitPlace kTwoBitPlace = make_two_bit_place();

// vpermw indices that build the level table of bits 2-3 from the one of bits 0-1.
struct LevelBits23 {
  alignas(64) uint16_t index[32];
};
constexpr LevelBits23 make_level_bits23() {
  LevelBits23 b{};
  for (uint32_t i = 0; i < 32; ++i) b.index[i] = uint16_t((i >> 2) & 3u);
  return b;
}
constexpr LevelBits23 kLevelBits23 = make_level_bits23();


template <uint32_t R>
void lloyd_max_tile2(const BlockLayout &layout, const uint8_t *codes, size_t row_bytes, uint32_t B, uint32_t c0,
                     __m512i levels, const int16_t *P, uint32_t P_stride, const float (*unit)[2], float *acc,
                     uint32_t dp) {
  const __m512i place = _mm512_load_si512(kTwoBitPlace.place[0]);
  const __m512i T0 = levels, T2 = _mm512_permutexvar_epi16(_mm512_load_si512(kLevelBits23.index), levels);
  const uint8_t *tile_end = codes + c0 / 4 + 16;  // of row 0
  for (uint32_t t0 = 0; t0 < B; t0 += kFlushTokens) {
    __m512i sum[R][4];
    for (uint32_t r = 0; r < R; ++r)
      for (uint32_t k = 0; k < 4; ++k) sum[r][k] = _mm512_setzero_si512();
    const uint32_t end = std::min(B, t0 + kFlushTokens);
    for (uint32_t t = t0; t < end; t += 2) {
      if (c0 == 0 && t % kPrefetchTokens == 0)
        prefetch_next_block(layout, codes + t * row_bytes, (std::min(end, t + kPrefetchTokens) - t) * row_bytes);
      const __m512i placed = _mm512_permutexvar_epi8(place, row_pair(tile_end + t * row_bytes, row_bytes));
      const __m512i shifted = _mm512_srli_epi16(placed, 4);
      const __m512i level[4] = {_mm512_permutexvar_epi16(placed, T0), _mm512_permutexvar_epi16(placed, T2),
                                _mm512_permutexvar_epi16(shifted, T0), _mm512_permutexvar_epi16(shifted, T2)};
#pragma GCC unroll 4
      for (uint32_t r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, P + size_t(r) * P_stride + t, 4);
        const __m512i weight = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (uint32_t k = 0; k < 4; ++k) sum[r][k] = dpwssd(sum[r][k], level[k], weight);
      }
    }
#pragma GCC unroll 4
    for (uint32_t r = 0; r < R; ++r)
      for (uint32_t k = 0; k < 4; ++k) {
        float *out = acc + size_t(r) * dp + c0 + 16 * k;
        _mm512_storeu_ps(out, add_units(_mm512_cvtepi32_ps(sum[r][k]), unit[r], _mm512_loadu_ps(out)));
      }
  }
}

template <uint32_t BITS, uint32_t R>
void lloyd_max_rows(const BlockLayout &layout, const uint8_t *codes, size_t row_bytes, uint32_t B, uint32_t d,
                    __m512i levels, const int16_t *P, uint32_t P_stride, const float (*unit)[2], float *acc) {
  const uint32_t dp = padded_dim(d);
  uint32_t from = 0;  // 2-bit codes: whole 64-channel tiles first, the rest by 16-channel chunks
  if constexpr (BITS == 2)
    for (; from + 64 <= d; from += 64)
      lloyd_max_tile2<R>(layout, codes, row_bytes, B, from, levels, P, P_stride, unit, acc, dp);
  for (uint32_t c0 = from / 128 * 128; c0 < d; c0 += 128) {
    const uint32_t chunks = std::min(128u, d - c0) / 16;
    uint32_t j = (std::max(from, c0) - c0) / 16;
    for (; j + 4 <= chunks; j += 4)
      lloyd_max_tile<BITS, R, 4>(layout, codes, row_bytes, B, c0 / 128, j, levels, P, P_stride, unit, acc, dp);
    for (; j < chunks; ++j)
      lloyd_max_tile<BITS, R, 1>(layout, codes, row_bytes, B, c0 / 128, j, levels, P, P_stride, unit, acc, dp);
  }
}

// R <= 4 rows of weights w (w_stride floats apart) against one block: P_rt = round(w_rt·scale_t / pstep_r)
// with pstep_r = max_t w_rt·scale_t / kWeightCodeMax (weights and scales are >= 0), then the sums.
// The rows share the scale loads and one reduction of their maxima.
template <uint32_t BITS, uint32_t R>
void lloyd_max_group(const BlockLayout &layout, const uint8_t *codes, size_t row_bytes, uint32_t B, uint32_t d,
                     __m512i levels, float largest_level, const float *scales, const float *w, size_t w_stride,
                     int16_t *P, uint32_t P_stride, float *acc) {
  // Weights past B are not read (masked): they need not be zero. Whole chunks load unmasked (a
  // masked load is a second operation on the vector ports).
  const auto weighted = [&](uint32_t r, uint32_t t) {
    const float *from = w + r * w_stride + t;
    const __m512 weights = t + 16 <= B ? _mm512_loadu_ps(from) : _mm512_maskz_loadu_ps(lanes_below(t, B), from);
    return _mm512_mul_ps(weights, _mm512_loadu_ps(scales + t));
  };
  __m512 top[4];
  for (uint32_t r = 0; r < 4; ++r) top[r] = _mm512_setzero_ps();
  for (uint32_t t = 0; t < P_stride; t += 16)
    for (uint32_t r = 0; r < R; ++r) top[r] = _mm512_max_ps(top[r], weighted(r, t));
  alignas(64) float largest[16];
  _mm512_store_ps(largest, reduce_rows4(top, MaxOp{}));
  float unit[R][2];  // what one P·L step is worth: the product of the two (each a normal float)
  for (uint32_t r = 0; r < R; ++r) {
    const CodeScale code = code_scale(largest[4 * r], kWeightCodeMax);
    const __m512 prescale = _mm512_set1_ps(code.prescale), factor = _mm512_set1_ps(code.factor);
    int16_t *Pr = P + size_t(r) * P_stride;
    for (uint32_t t = 0; t < P_stride; t += 16) {
      __m512 x = weighted(r, t);
      if (code.prescale != 1.0f) x = _mm512_mul_ps(x, prescale);  // tiny weights only
      const __m512i codes16 = _mm512_cvtps_epi32(_mm512_mul_ps(x, factor));
      _mm256_storeu_si256(reinterpret_cast<__m256i *>(Pr + t), _mm512_cvtepi32_epi16(codes16));
    }
    unit[r][0] = largest[4 * r] * code.prescale / kWeightCodeMax * (largest_level / kLevelCodeMax);
    unit[r][1] = 1.0f / code.prescale;
  }
  lloyd_max_rows<BITS, R>(layout, codes, row_bytes, B, d, levels, P, P_stride, unit, acc);
}

template <uint32_t BITS>
void values_lloyd_max(const CodesArgs &a, const uint8_t *block, const float *w, size_t w_stride, uint32_t rows,
                      float *acc, float *scratch) {
  const BlockLayout &l = *a.layout;
  const uint32_t B = a.block_tokens, d = a.head_dim, dp = padded_dim(d), P_stride = (B + 31) / 32 * 32;
  prefetch_next_block(l, block + l.values_offset, l.value_codes - l.values_offset);  // codes: in the tiles
  float *scales = scratch;  // [P_stride], zero past B; then P: [4][P_stride] int16
  auto *P = reinterpret_cast<int16_t *>(scratch + P_stride);
  for (uint32_t t = 0; t < P_stride; t += 16) {
    const __mmask16 valid = lanes_below(t, B);
    _mm512_storeu_ps(scales + t, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, block + l.value_scale + 2 * size_t(t))));
  }
  const float largest_level = lloyd_max_level(BITS, (1u << BITS) - 1u);
  struct LevelTable {
    alignas(64) int16_t code[32];
  };
  static const LevelTable table = [largest_level] {  // built once: lrintf per block measured 3 % of the kernel
    LevelTable t{};
    for (uint32_t e = 0; e < 32; ++e)
      t.code[e] = int16_t(std::lrint(lloyd_max_level(BITS, e % (1u << BITS)) * (kLevelCodeMax / largest_level)));
    return t;
  }();
  const __m512i levels = _mm512_load_si512(table.code);
  const uint8_t *codes = block + l.value_codes;
  const size_t row_bytes = l.value_bytes_per_token_codes;
  for (uint32_t r0 = 0; r0 < rows; r0 += 4) {
    const float *wr = w + size_t(r0) * w_stride;
    float *ar = acc + size_t(r0) * dp;
    switch (std::min(4u, rows - r0)) {
      case 1:
        lloyd_max_group<BITS, 1>(l, codes, row_bytes, B, d, levels, largest_level, scales, wr, w_stride, P, P_stride, ar);
        break;
      case 2:
        lloyd_max_group<BITS, 2>(l, codes, row_bytes, B, d, levels, largest_level, scales, wr, w_stride, P, P_stride, ar);
        break;
      case 3:
        lloyd_max_group<BITS, 3>(l, codes, row_bytes, B, d, levels, largest_level, scales, wr, w_stride, P, P_stride, ar);
        break;
      default:
        lloyd_max_group<BITS, 4>(l, codes, row_bytes, B, d, levels, largest_level, scales, wr, w_stride, P, P_stride, ar);
        break;
    }
  }
}

// ---- uniform values ------------------------------------------------------------------------------
// acc[r][c] += Σ_t w_rt·(min_tg + scale_tg·code_tc), g the group of channel c, as
//   Σ_t w_rt·min_tg (fp32, one number per row and group, shared by the group's channels)
//   + pstep_rg·Σ_t P_rtg·code_tc, P_rtg = round(w_rt·scale_tg / pstep_rg) in int16,
// pstep_rg = max_t |w_rt·scale_tg| / kUniformWeightMax, a step per row and group. vpdpwssd sums
// P·code over token pairs: a dword lane holds (code_tc, code_t+1,c) against (P_tg, P_t+1,g), the
// codes unpacked to int16 words; no level lookup. The int32 sums go to the fp32 accumulators
// every uniform_flush_tokens(bits) tokens, within int32 (the static_assert), each lane times its
// group's step. The only error is P's rounding: pstep_rg·Σ_t ρ_t·code_tc with |ρ_t| <= 1/2, at
// most 2^-16 of the group's largest |w·scale|·code per token. (A step per row, set by its
// largest group, left a group 1000x smaller a few dozen P levels and errors of ~2 % of its sums:
// cpu_paths ValueSumsWithinErrorBudgetPerGroup; before that, max|w| times the block's largest
// scale, from different tokens, failed the fuzz corpus's regression-uniform-values-scale-spread.)
constexpr float kUniformWeightMax = 32767.0f;
// Below this max|w·scale| of a group the factor kUniformWeightMax / span could overflow fp32:
// rows with such a group (weights or scales below ~1e-30 over the whole block) take the fp32
// kernel; a span of 0 (the group's weights or scales all 0) is covered.
constexpr float kUniformSmallestSpan = 1e-30f;
constexpr uint32_t uniform_flush_tokens(uint32_t bits) { return bits == 8 ? 256u : QJLKV_MAX_BLOCK_TOKENS; }
static_assert(256.0 * kUniformWeightMax * 255 < 2147483647.0 &&
              double(QJLKV_MAX_BLOCK_TOKENS) * kUniformWeightMax * 15 < 2147483647.0);

// Codes are unpacked per 16-channel chunk j of a region (128 channels, 64 for 8-bit codes: at
// most 64 bytes of a row). With N groups per chunk (N = 1; N = 2 for groups of 8 channels) lane i
// holds channel 16j + (i % N)·16/N + i/N: the lanes alternate between the chunk's groups, so that
// one broadcast of N P dwords serves the chunk; the sums are put back in channel order at the
// flush. vpermt2b places, in qword k, the two bytes that hold lane 2k's code and lane 2k+1's, of
// token A (words 0, 2) and B (words 1, 3, from the second source); vpmultishiftqb shifts each
// code to the low bits of its word, and an and clears the bits above it (8-bit codes: the
// placement alone, the high bytes zeroed by the mask).
constexpr uint32_t uniform_lane_channel(uint32_t n, uint32_t i) { return (i % n) * (16 / n) + i / n; }
struct UniformUnpack {
  alignas(64) uint8_t place[8][64];
  alignas(64) uint8_t shifts[8][64];
};
constexpr UniformUnpack make_uniform_unpack(uint32_t bits, uint32_t n) {
  UniformUnpack u{};
  for (uint32_t j = 0; j < 8; ++j)
    for (uint32_t i = 0; i < 16; ++i) {
      const uint32_t bit = (16 * j + uniform_lane_channel(n, i)) * bits, byte = bit / 8, shift = bit % 8;
      const uint32_t at = 4 * i, base = 32 * (i % 2);  // lane i: bytes 4i..4i+3, bits 32·(i % 2) of its qword
      const uint8_t source[4] = {uint8_t(byte), uint8_t(byte + 1), uint8_t(64 + byte), uint8_t(65 + byte)};
      const uint8_t offsets[4] = {uint8_t(base + shift), 0, uint8_t(base + 16 + shift), 0};
      for (uint32_t k = 0; k < 4; ++k) {
        u.place[j][at + k] = uint8_t(source[k] & 127u);
        u.shifts[j][at + k] = offsets[k];
      }
    }
  return u;
}

// vpermw order of a row's P: 32 products (16/G tokens per vector, lane i of vector h holding
// group i/(16/G) of token h·16/G + i % (16/G): see uniform_weights) come from vpackssdw of the
// two vectors (per 128-bit lane L: words 8L..8L+3 from the first, 8L+4..8L+7 from the second)
// and go to word (t/2)·2G + 2g + t % 2, so that dword (pair, g) = (P_2·pair,g, P_2·pair+1,g).
struct PairOrder {
  alignas(64) uint16_t index[5][32];  // per log2 G
};
constexpr PairOrder make_pair_order() {
  PairOrder o{};
  for (uint32_t log = 0; log < 5; ++log) {
    const uint32_t G = 1u << log, T = 16 / G;
    for (uint32_t h = 0; h < 2; ++h)
      for (uint32_t i = 0; i < 16; ++i) {
        const uint32_t g = i / T, t = h * T + i % T, packed = 8 * (i / 4) + 4 * h + i % 4;
        o.index[log][(t / 2) * 2 * G + 2 * g + t % 2] = uint16_t(packed);
      }
  }
  return o;
}
constexpr PairOrder kPairOrder = make_pair_order();

// Whether values_uniform covers the layout: d a multiple of 16, groups of 8 or a multiple of 16
// channels, and a power-of-two number G <= 16 of groups per token (the P setup's vectors hold
// whole tokens or 16/G of them). Blocks of 8 tokens keep fp32: there the per-block setup
// measured as slow as the sums it saves.
bool uniform_integer_layout(const CodesArgs &a) {
  const uint32_t groups = a.group ? a.head_dim / a.group : 0;
  return a.bits <= 8 && a.block_tokens >= 16 && a.head_dim % 16 == 0 && (a.group % 16 == 0 || a.group == 8) &&
         groups >= 1 && groups <= 16 && (groups & (groups - 1)) == 0;
}

// The n numbers from p repeated over the 16 lanes (lane j: p[j % n]).
template <uint32_t n, class T>
inline __m512i repeat_lanes(const T *p) {
  if constexpr (n == 1) {
    int32_t x;
    std::memcpy(&x, p, 4);
    return _mm512_set1_epi32(x);
  } else if constexpr (n == 2) {
    long long x;
    std::memcpy(&x, p, 8);
    return _mm512_set1_epi64(x);
  } else {
    return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
  }
}

// The first tile of a row group requests the next block's copy of the codes it is about to read
// (prefetch_next_block), 16 tokens' at a time.
template <uint32_t BITS, uint32_t N, uint32_t R, uint32_t CZ>
void uniform_tile(const BlockLayout &layout, const uint8_t *codes, size_t row_bytes, uint32_t B, uint32_t g,
                  uint32_t G, uint32_t region, uint32_t j0, const int16_t *P, size_t P_stride, const float (*unit)[16],
                  const float *mins, float *acc,
                  uint32_t dp) {
  static constexpr UniformUnpack kUnpack = make_uniform_unpack(BITS, N);
  constexpr uint32_t kRegion = BITS == 8 ? 64 : 128, kRegionBytes = kRegion * BITS / 8;
  // The region's bytes of a row (fewer in a last region of under kRegion channels): never past the row.
  const size_t bytes = std::min<size_t>(kRegionBytes, row_bytes - size_t(region) * kRegionBytes);
  const __mmask64 load_mask = bytes >= 64 ? ~__mmask64(0) : (__mmask64(1) << bytes) - 1u;
  const uint8_t *first = codes + size_t(region) * kRegionBytes;
  uint32_t group[CZ];  // the chunk's (first) group
  for (uint32_t z = 0; z < CZ; ++z) {
    const uint32_t chunk = region * (kRegion / 16) + j0 + z;
    group[z] = N == 1 ? 16 * chunk / g : 2 * chunk;
  }
  // Row r's P dword of a token pair for chunk z's group; N == 2: its two groups' dwords.
  const auto weights = [&](uint32_t r, uint32_t pair, uint32_t z) {
    return P + r * P_stride + 2 * (size_t(pair) * G + group[z]);
  };
  constexpr uint32_t kFlush = uniform_flush_tokens(BITS);
  for (uint32_t t0 = 0; t0 < B; t0 += kFlush) {
    __m512i sum[R][CZ];
    for (uint32_t r = 0; r < R; ++r)
      for (uint32_t z = 0; z < CZ; ++z) sum[r][z] = _mm512_setzero_si512();
    const uint32_t end = std::min(B, t0 + kFlush);
    for (uint32_t t = t0; t < end; t += 2) {
      if (region == 0 && j0 == 0 && (t - t0) % 16 == 0)
        prefetch_next_block(layout, codes + t * row_bytes, (std::min(end, t + 16) - t) * row_bytes);
      const __m512i a = _mm512_maskz_loadu_epi8(load_mask, first + t * row_bytes);
      const __m512i b = t + 1 < B ? _mm512_maskz_loadu_epi8(load_mask, first + (t + 1) * row_bytes) : _mm512_setzero_si512();
      // Unrolled (here and at the flush) so that GCC keeps sum[][] in registers: otherwise it
      // copied the sums to the stack at every token pair (measured 11.9 against 7.7 ns per token).
#pragma GCC unroll 4
      for (uint32_t z = 0; z < CZ; ++z) {
        const __m512i place = _mm512_load_si512(kUnpack.place[j0 + z]);
        __m512i code;
        if constexpr (BITS == 8) {
          code = _mm512_maskz_permutex2var_epi8(__mmask64(0x5555555555555555ull), a, place, b);
        } else {
          const __m512i placed = _mm512_permutex2var_epi8(a, place, b);
          code = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(kUnpack.shifts[j0 + z]), placed),
                                  _mm512_set1_epi16(short((1u << BITS) - 1u)));
        }
#pragma GCC unroll 4
        for (uint32_t r = 0; r < R; ++r) {
          if constexpr (N == 1) {
            sum[r][z] = dpwssd_broadcast(sum[r][z], code, weights(r, t / 2, z));
          } else {
            sum[r][z] = dpwssd(sum[r][z], code, repeat_lanes<2>(weights(r, t / 2, z)));
          }
        }
      }
    }
#pragma GCC unroll 4
    for (uint32_t r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (uint32_t z = 0; z < CZ; ++z) {
        // A number per group spread over the lanes: the chunk's group in every lane, or (N == 2)
        // group[z]'s in the even lanes and group[z] + 1's in the odd ones.
        const auto per_lane = [&](const float *by_group) {
          return _mm512_castsi512_ps(repeat_lanes<N>(by_group + group[z]));
        };
        __m512 part = _mm512_cvtepi32_ps(sum[r][z]);
        if (t0 == 0)  // the minima's part, once
          part = _mm512_fmadd_ps(part, per_lane(unit[r]), per_lane(mins + 16 * r));
        else
          part = _mm512_mul_ps(part, per_lane(unit[r]));
        if constexpr (N == 2)  // back to channel order: channel c < 8 is in lane 2c, c >= 8 in lane 2(c − 8) + 1
          part = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15), part);
        float *out = acc + size_t(r) * dp + region * kRegion + 16 * (j0 + z);
        _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), part));
      }
  }
}

// 2-bit codes, 64 channels from c0 (a multiple of 64) in groups of g = 64/n channels (n = 1:
// one group, g a multiple of 64; n = 2 or 4: g = 32 or 16). Lane j takes byte
// b(j) = (j % n)·g/4 + j/n of the tile's 16 (4 channels, of group j % n), so that one broadcast
// of the n P dwords of a token pair serves every lane. vpermb puts byte b(j) of token A in word
// 2j and of token B in word 2j + 1 (from a row_pair), the high bytes zero; the word w = c0 + 4c1
// + 16c2 + 64c3 of the byte's codes and w >> 2, w >> 4, w >> 6 are multiplied unmasked
// (S_k = Σ P·(w >> 2k)), and at the flush C_k = S_k − 4·S_k+1 recovers each channel's Σ P·code
// exactly (mod 2^32, where the true sums fit). One vpermb and three shifts per 64 channels of a
// pair, where uniform_tile takes three operations per 16. The flush puts lane b on byte b's
// channels and leaves them in lloyd_max_tile2's lane order (channel c0 + 4b + k at c0 + 16k + b)
// for in_channel_order.

template <uint32_t R, uint32_t n>
void uniform_tile2(const BlockLayout &layout, const uint8_t *codes, size_t row_bytes, uint32_t B, uint32_t g,
                   uint32_t G, uint32_t c0, const int16_t *P, size_t P_stride, const float (*unit)[16],
                   const float *mins, float *acc, uint32_t dp) {
  constexpr uint32_t kLog = n == 1 ? 0 : n == 2 ? 1 : 2;
  const __m512i place = _mm512_load_si512(kTwoBitPlace.place[kLog]);
  const uint32_t g0 = c0 / g;  // the tile's first group
  const uint8_t *tile_end = codes + c0 / 4 + 16;  // of row 0
  constexpr uint32_t kFlush = uniform_flush_tokens(2);
  for (uint32_t t0 = 0; t0 < B; t0 += kFlush) {
    __m512i sum[R][4];
    for (uint32_t r = 0; r < R; ++r)
      for (uint32_t k = 0; k < 4; ++k) sum[r][k] = _mm512_setzero_si512();
    const uint32_t end = std::min(B, t0 + kFlush);
    // Pointers stepped per token pair: GCC otherwise rebuilt each row's P address with a multiply.
    const uint8_t *pair_end = tile_end + size_t(t0) * row_bytes;
    const int16_t *pair_weights = P + 2 * (size_t(t0 / 2) * G + g0);
    for (uint32_t t = t0; t < end; t += 16) {
      const uint32_t chunk_end = std::min(end, t + 16);
      if (c0 == 0) prefetch_next_block(layout, codes + t * row_bytes, (chunk_end - t) * row_bytes);
      for (uint32_t u = t; u < chunk_end; u += 2, pair_end += 2 * row_bytes, pair_weights += 2 * G) {
        const __m512i word =
            _mm512_maskz_permutexvar_epi8(__mmask64(0x5555555555555555ull), place, row_pair(pair_end, row_bytes));
        const __m512i shifted[4] = {word, _mm512_srli_epi16(word, 2), _mm512_srli_epi16(word, 4),
                                    _mm512_srli_epi16(word, 6)};
#pragma GCC unroll 4
        for (uint32_t r = 0; r < R; ++r) {
          const __m512i weight = repeat_lanes<n>(pair_weights + r * P_stride);
#pragma GCC unroll 4
          for (uint32_t k = 0; k < 4; ++k) sum[r][k] = dpwssd(sum[r][k], shifted[k], weight);
        }
      }
    }
#pragma GCC unroll 4
    for (uint32_t r = 0; r < R; ++r) {
      const __m512 step = _mm512_castsi512_ps(repeat_lanes<n>(unit[r] + g0));
      const __m512 minimum = _mm512_castsi512_ps(repeat_lanes<n>(mins + 16 * r + g0));
      __m512 v[4];
      for (uint32_t k = 0; k < 4; ++k) {
        const __m512i C = k == 3 ? sum[r][3] : _mm512_sub_epi32(sum[r][k], _mm512_slli_epi32(sum[r][k + 1], 2));
        const __m512 sums = _mm512_cvtepi32_ps(C);
        v[k] = t0 == 0 ? _mm512_fmadd_ps(sums, step, minimum) : _mm512_mul_ps(sums, step);  // minima once
        if constexpr (n > 1)  // lane b: byte b's channels
          v[k] = _mm512_permutexvar_ps(_mm512_load_si512(kTwoBitPlace.byte_order[kLog]), v[k]);
      }
      for (uint32_t k = 0; k < 4; ++k) {  // in lane order, as lloyd_max_tile2's
        float *out = acc + size_t(r) * dp + c0 + 16 * k;
        _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), v[k]));
      }
    }
  }
}

// Groups per 64-channel 2-bit tile (uniform_tile2's n) for groups of g channels: 1, 2 or 4, and 0
// where the tiles do not apply (those codes go by 16-channel chunks).
constexpr uint32_t uniform_tile_groups(uint32_t g) { return g % 64 == 0 ? 1 : g == 32 ? 2 : g == 16 ? 4 : 0; }

template <uint32_t BITS, uint32_t N, uint32_t R>
void uniform_rows(const CodesArgs &a, const uint8_t *codes, const int16_t *P, size_t P_stride, const float (*unit)[16],
                  const float *mins, float *acc) {
  constexpr uint32_t kRegion = BITS == 8 ? 64 : 128;
  const uint32_t d = a.head_dim, dp = padded_dim(d), B = a.block_tokens, g = a.group, G = d / g;
  const size_t row_bytes = a.layout->value_bytes_per_token_codes;
  uint32_t from = 0;  // 2-bit codes: whole 64-channel tiles first, the rest by 16-channel chunks
  if constexpr (BITS == 2 && N == 1) {
    const auto tiles = [&](auto lanes_per_group) {
      for (; from + 64 <= d; from += 64)
        uniform_tile2<R, decltype(lanes_per_group)::value>(*a.layout, codes, row_bytes, B, g, G, from, P, P_stride,
                                                          unit, mins, acc, dp);
    };
    switch (uniform_tile_groups(g)) {
      case 1: tiles(std::integral_constant<uint32_t, 1>{}); break;
      case 2: tiles(std::integral_constant<uint32_t, 2>{}); break;
      case 4: tiles(std::integral_constant<uint32_t, 4>{}); break;
      default: break;
    }
  }
  for (uint32_t c0 = from / kRegion * kRegion; c0 < d; c0 += kRegion) {
    const uint32_t chunks = std::min(kRegion, d - c0) / 16, region = c0 / kRegion;
    uint32_t j = (std::max(from, c0) - c0) / 16;
    for (; j + 4 <= chunks; j += 4)
      uniform_tile<BITS, N, R, 4>(*a.layout, codes, row_bytes, B, g, G, region, j, P, P_stride, unit, mins, acc, dp);
    for (; j < chunks; ++j)
      uniform_tile<BITS, N, R, 1>(*a.layout, codes, row_bytes, B, g, G, region, j, P, P_stride, unit, mins, acc, dp);
  }
}

// 0, 1, ..., 15: lane i's own index.
inline __m512i lane_indices() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

// The products w·scale of one 16-lane vector, for 16/G tokens and the G groups of each: lane i
// holds group i/(16/G) of token i % (16/G), so that one broadcast of 16/G weights serves every
// group and only the scales (shared by the rows) are permuted out of their token-major order.
template <uint32_t G>
struct GroupLanes {
  static constexpr uint32_t kTokens = 16 / G;
  // The stored (token-major) scales or minima of the vector's products into its lanes.
  static __m512 load(const uint16_t *bits, __mmask16 valid) {
    const __m512 v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, bits));
    if constexpr (G == 1 || G == 16) return v;
    const __m512i lane = lane_indices();
    const __m512i source = _mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(kTokens - 1)),
                                                              __builtin_ctz(G)),
                                            _mm512_srli_epi32(lane, __builtin_ctz(kTokens)));
    return _mm512_permutexvar_ps(source, v);
  }
  // Weights of tokens t..t + 16/G − 1 (t < B; G == 1: past B read as 0), repeated for each group.
  static __m512 weights(const float *w, uint32_t t, uint32_t B) {
    if constexpr (G == 1) return _mm512_maskz_loadu_ps(lanes_below(t, B), w + t);
    else if constexpr (G == 2) return _mm512_broadcast_f32x8(_mm256_loadu_ps(w + t));
    else if constexpr (G == 4) return _mm512_broadcast_f32x4(_mm_loadu_ps(w + t));
    else if constexpr (G == 8)
      return _mm512_castsi512_ps(_mm512_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(w + t))));
    else return _mm512_set1_ps(w[t]);
  }
  // op over each group's lanes; lane g < G of the result: group g's.
  template <class Op>
  static __m512 fold(__m512 v, Op op) {
    if constexpr (kTokens >= 2) v = op(v, _mm512_permute_ps(v, 0xB1));
    if constexpr (kTokens >= 4) v = op(v, _mm512_permute_ps(v, 0x4E));
    if constexpr (kTokens >= 8) v = op(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    if constexpr (kTokens >= 16) v = op(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    if constexpr (kTokens == 1) return v;
    const __m512i lane = lane_indices();
    return _mm512_permutexvar_ps(_mm512_slli_epi32(lane, __builtin_ctz(kTokens)), v);
  }
};

// The R rows' P in pair order (P[r·P_stride + ...]), their steps unit[r][g] (what one P·code
// step is worth) and their minima's sums mins[16·r + g], from the block's scales and minima
// (B·G halves each, token-major). First pass: the products w·scale into `products` ([R][P_stride]
// floats), each row and group's largest magnitude and Σ_t w·min; second: P = round(w·scale /
// pstep_rg), pstep_rg = largest / kUniformWeightMax. (One step per row, set by its largest group,
// left a group 1000 times smaller about 33 levels of P.) False, with nothing written to P, when
// a row has a group whose largest is below kUniformSmallestSpan but not 0.
template <uint32_t R, uint32_t G>
bool uniform_weights(const uint16_t *scale_bits, const uint16_t *min_bits, uint32_t B, const float *w, size_t w_stride,
                     float *products, int16_t *P, size_t P_stride, float (*unit)[16], float *mins) {
  using Lanes = GroupLanes<G>;
  const uint32_t count = B * G;
  __m512 top[R], min_sums[R];
  for (uint32_t r = 0; r < R; ++r) top[r] = min_sums[r] = _mm512_setzero_ps();
  for (uint32_t x = 0; x < count; x += 16) {
    const uint32_t t = x / G;
    const __m512 scale = Lanes::load(scale_bits + x, lanes_below(x, count));
    const __m512 minimum = Lanes::load(min_bits + x, lanes_below(x, count));
#pragma GCC unroll 4
    for (uint32_t r = 0; r < R; ++r) {
      const __m512 weight = Lanes::weights(w + size_t(r) * w_stride, t, B);
      const __m512 product = _mm512_mul_ps(weight, scale);
      top[r] = _mm512_range_ps(top[r], product, 0x0B);  // the larger magnitude, sign cleared
      min_sums[r] = _mm512_fmadd_ps(weight, minimum, min_sums[r]);
      _mm512_store_ps(products + r * P_stride + x, product);
    }
  }
  for (uint32_t x = (count + 15) / 16 * 16; x < P_stride; x += 16)  // the last 32's rest: read by the second pass
    for (uint32_t r = 0; r < R; ++r) _mm512_store_ps(products + r * P_stride + x, _mm512_setzero_ps());
  __m512 factor[R];  // per lane: P per unit of w·scale of the lane's group
  const __m512i lane_group = _mm512_srli_epi32(lane_indices(), __builtin_ctz(Lanes::kTokens));
  bool covered = true;
  for (uint32_t r = 0; r < R; ++r) {
    const __m512 span = Lanes::fold(top[r], MaxOp{});  // lane g < G: the group's largest
    const __mmask16 positive = _mm512_cmp_ps_mask(span, _mm512_setzero_ps(), _CMP_GT_OQ);
    covered &= _mm512_mask_cmp_ps_mask(positive, span, _mm512_set1_ps(kUniformSmallestSpan), _CMP_LT_OQ) == 0;
    const __m512 group_factor = _mm512_maskz_div_ps(positive, _mm512_set1_ps(kUniformWeightMax), span);
    factor[r] = _mm512_permutexvar_ps(lane_group, group_factor);
    _mm512_store_ps(unit[r], _mm512_div_ps(span, _mm512_set1_ps(kUniformWeightMax)));
    _mm512_store_ps(mins + 16 * r, Lanes::fold(min_sums[r], AddOp{}));
  }
  if (!covered) return false;
  const __m512i pair_order = _mm512_load_si512(kPairOrder.index[__builtin_ctz(G)]);
  for (uint32_t x = 0; x < P_stride; x += 32) {
#pragma GCC unroll 4
    for (uint32_t r = 0; r < R; ++r) {
      // Products past B·G (P_stride is rounded up to 32) are never read by the tiles.
      const float *row = products + r * P_stride + x;
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(row), factor[r]));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(row + 16), factor[r]));
      // vpackssdw saturates: a product rounded up past 32767 stays 32767.
      _mm512_store_si512(P + r * P_stride + x, _mm512_permutexvar_epi16(pair_order, _mm512_packs_epi32(q0, q1)));
    }
  }
  return true;
}

// Whether lloyd_max_values_accumulate takes values_lloyd_max (for 2, 3 and 4 bits).
bool lloyd_max_integer_layout(const CodesArgs &a) { return a.head_dim % 16 == 0; }

// Whether the layer's value sums of channels [0, 64·floor(d / 64)) are kept in the 2-bit tiles'
// lane order (lloyd_max_tile2, uniform_tile2: channel c0 + 4j + k at c0 + 16k + j).
bool lloyd_max_two_bit_tiles(const CodesArgs &a) { return a.bits == 2 && lloyd_max_integer_layout(a); }
bool uniform_two_bit_tiles(const CodesArgs &a) {
  return a.bits == 2 && uniform_integer_layout(a) && uniform_tile_groups(a.group) != 0;
}

// The tiles of R rows of acc taken `times` times from lane order to channel order. The order is a
// rotation of a channel's 6 bits within its tile by 2, so three times is the identity and twice
// takes channel order to lane order.
void reorder_two_bit_tiles(uint32_t d, uint32_t rows, float *acc, uint32_t times) {
  const uint32_t dp = padded_dim(d);
  for (uint32_t r = 0; r < rows; ++r)
    for (uint32_t c0 = 0; c0 + 64 <= d; c0 += 64) {
      float *tile = acc + size_t(r) * dp + c0;
      __m512 v[4], x[4];
      for (uint32_t k = 0; k < 4; ++k) v[k] = _mm512_loadu_ps(tile + 16 * k);
      for (uint32_t i = 0; i < times; ++i) {
        channel_order(v, x);
        for (uint32_t k = 0; k < 4; ++k) v[k] = x[k];
      }
      for (uint32_t k = 0; k < 4; ++k) _mm512_storeu_ps(tile + 16 * k, v[k]);
    }
}

template <uint32_t BITS>
void values_uniform(const CodesArgs &a, const uint8_t *block, const float *w, size_t w_stride, uint32_t rows,
                    float *acc, float *scratch) {
  const BlockLayout &l = *a.layout;
  const uint32_t B = a.block_tokens, G = a.head_dim / a.group;
  const size_t P_stride = (size_t(B) * G + 31) / 32 * 32;  // int16 per row
  auto *P = reinterpret_cast<int16_t *>(scratch);           // [4][P_stride]
  float *mins = scratch + 2 * P_stride;                     // [4][16]: Σ_t w_rt·min_tg at [r][g]
  float *products = mins + 64;                              // [4][P_stride]: w·scale
  const auto *scale_bits = reinterpret_cast<const uint16_t *>(block + l.value_scale);
  const auto *min_bits = reinterpret_cast<const uint16_t *>(block + l.value_min);
  const uint8_t *codes = block + l.value_codes;
  prefetch_next_block(l, block + l.values_offset, l.value_codes - l.values_offset);  // codes: in the tiles
  for (uint32_t r0 = 0; r0 < rows; r0 += 4) {
    const uint32_t R = std::min(4u, rows - r0);
    const float *wr = w + size_t(r0) * w_stride;
    float *ar = acc + size_t(r0) * padded_dim(a.head_dim);
    alignas(64) float unit[4][16];  // per row and group: what one P·code step is worth
    const auto run = [&](auto rows_in_group) {
      constexpr uint32_t kR = decltype(rows_in_group)::value;
      const auto weights = [&](auto groups) {
        return uniform_weights<kR, decltype(groups)::value>(scale_bits, min_bits, B, wr, w_stride, products, P,
                                                            P_stride, unit, mins);
      };
      bool covered;
      switch (G) {
        case 1: covered = weights(std::integral_constant<uint32_t, 1>{}); break;
        case 2: covered = weights(std::integral_constant<uint32_t, 2>{}); break;
        case 4: covered = weights(std::integral_constant<uint32_t, 4>{}); break;
        case 8: covered = weights(std::integral_constant<uint32_t, 8>{}); break;
        default: covered = weights(std::integral_constant<uint32_t, 16>{}); break;
      }
      if (!covered) {  // the fp32 kernel adds in channel order
        const bool tiles = uniform_two_bit_tiles(a);
        if (tiles) reorder_two_bit_tiles(a.head_dim, kR, ar, 1);
        avx512_kernels().uniform_values.accumulate(a, block, wr, w_stride, kR, ar, scratch);
        if (tiles) reorder_two_bit_tiles(a.head_dim, kR, ar, 2);
        return;
      }
      if (a.group == 8) uniform_rows<BITS, 2, kR>(a, codes, P, P_stride, unit, mins, ar);
      else uniform_rows<BITS, 1, kR>(a, codes, P, P_stride, unit, mins, ar);
    };
    switch (R) {
      case 1: run(std::integral_constant<uint32_t, 1>{}); break;
      case 2: run(std::integral_constant<uint32_t, 2>{}); break;
      case 3: run(std::integral_constant<uint32_t, 3>{}); break;
      default: run(std::integral_constant<uint32_t, 4>{}); break;
    }
  }
}

void lloyd_max_values_accumulate(const CodesArgs &a, const uint8_t *block, const float *w, size_t w_stride,
                                 uint32_t rows, float *acc, float *scratch) {
  if (lloyd_max_integer_layout(a)) {
    switch (a.bits) {
      case 2: values_lloyd_max<2>(a, block, w, w_stride, rows, acc, scratch); return;
      case 3: values_lloyd_max<3>(a, block, w, w_stride, rows, acc, scratch); return;
      case 4: values_lloyd_max<4>(a, block, w, w_stride, rows, acc, scratch); return;
      default: break;
    }
  }
  // Other layouts keep the fp32 kernel.
  avx512_kernels().lloyd_max_values.accumulate(a, block, w, w_stride, rows, acc, scratch);
}

void uniform_values_accumulate(const CodesArgs &a, const uint8_t *block, const float *w, size_t w_stride,
                               uint32_t rows, float *acc, float *scratch) {
  if (uniform_integer_layout(a)) {
    switch (a.bits) {
      case 2: values_uniform<2>(a, block, w, w_stride, rows, acc, scratch); return;
      case 3: values_uniform<3>(a, block, w, w_stride, rows, acc, scratch); return;
      case 4: values_uniform<4>(a, block, w, w_stride, rows, acc, scratch); return;
      case 8: values_uniform<8>(a, block, w, w_stride, rows, acc, scratch); return;
      default: break;
    }
  }
  // Other layouts (and 16-bit values) keep the fp32 kernel.
  avx512_kernels().uniform_values.accumulate(a, block, w, w_stride, rows, acc, scratch);
}

void lloyd_max_values_in_channel_order(const CodesArgs &a, uint32_t rows, float *acc) {
  if (lloyd_max_two_bit_tiles(a)) reorder_two_bit_tiles(a.head_dim, rows, acc, 1);
}

void uniform_values_in_channel_order(const CodesArgs &a, uint32_t rows, float *acc) {
  if (uniform_two_bit_tiles(a)) reorder_two_bit_tiles(a.head_dim, rows, acc, 1);
}

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
    avx512_kernels().qjl_scores(a, block, q, sq, rows, out, out_stride, scratch);
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

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace qjlkv::cpu {
const KernelTable &avx512_vnni_kernels() {
  static const KernelTable table = [] {
    KernelTable t = avx512_kernels();
    t.isa = Isa::Avx512Vnni;
    t.qjl_project = &avx512_vnni::qjl_project;
    t.qjl_scores = &avx512_vnni::qjl_scores;
    t.kivi_scores = &avx512_vnni::kivi_scores;
    t.uniform_values.accumulate = &avx512_vnni::uniform_values_accumulate;
    t.uniform_values.in_channel_order = &avx512_vnni::uniform_values_in_channel_order;
    t.lloyd_max_values.accumulate = &avx512_vnni::lloyd_max_values_accumulate;
    t.lloyd_max_values.in_channel_order = &avx512_vnni::lloyd_max_values_in_channel_order;
    return t;
  }();
  return table;
}
}  // namespace qjlkv::cpu

#else  // not x86-64: never selected (isa_supported is false)
namespace qjlkv::cpu {
const KernelTable &avx512_vnni_kernels() { return scalar_kernels(); }
}  // namespace qjlkv::cpu
#endif
