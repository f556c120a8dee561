// What the AVX-512 VNNI kernels of the methods (src/methods/*/cpu_avx512_vnni.cpp) share: the
// integer dot products, the code loads and the lane shuffles, and the 2-bit value tiles' lane
// order. Included inside avx512_vnni_begin.inc's target region (x86-64 only).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "simd.hpp"

namespace qjlkv::cpu::avx512_vnni {
// Internal to each including translation unit, as they were when the methods' kernels shared one.
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

// The kBytesEndingAt bytes before `end`: how the kernels read packed codes, a plain load where a
// masked one that read no byte past them was a second operation on the vector ports. Before a
// block's key codes lie its scales and minima, before its value codes its value scales and keys
// (at least 32 bytes either way), so the loads stay in the block and never pass the rows.
constexpr uint32_t kBytesEndingAt = 32;
inline __m256i bytes_ending_at(const uint8_t *end) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(end - kBytesEndingAt));
}

// The lanes of [first, first + 16) that lie below `end`.
inline __mmask16 lanes_below(uint32_t first, uint32_t end) {
  return first + 16 <= end ? __mmask16(0xffff) : first < end ? __mmask16((1u << (end - first)) - 1u) : __mmask16(0);
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

struct MaxOp {
  __m512 operator()(__m512 a, __m512 b) const { return _mm512_max_ps(a, b); }
};
struct AddOp {
  __m512 operator()(__m512 a, __m512 b) const { return _mm512_add_ps(a, b); }
};
struct AddInt32Op {  // int32 lanes carried in __m512: exact sums through reduce_rows4's shuffles
  __m512 operator()(__m512 a, __m512 b) const {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
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

// ---- key scores from byte codes: KIVI/OTT and mixed-bit keys --------------------------------

// Per block and query row, the key method's per-channel factors q'_c (KIVI: q_c·scale_c; mixed-bit
// keys: q_c·cell_c) are quantized to Q_c = round(q'_c / step) with |Q_c| <= 127·256, step =
// max|q'| / (127·256), and split into two byte digits Q = 256·hi + lo: two vpdpbusd with the codes
// give Σ code·hi and Σ code·lo exactly. hi is signed; lo is Q's low byte, unsigned, multiplied as
// vpdpbusd's unsigned operand against the codes as signed bytes (codes of up to 4 bits fit), so
// that both digits are bytes of Q, taken by one vpermb. 8-bit codes need the unsigned side
// themselves: then lo is signed (lo in [-128, 127], hi = (Q + 128) >> 8). The rounding residuals
// ρ_c = q'_c − step·Q_c are not lost: Σ ρ_c·code_c is taken as Σ ρ_c·mid_c, mid_c the middle code
// of channel c ((2^bits − 1)/2), so the error is Σ ρ_c·(code_c − mid_c), |ρ_c| <= step/2, about
// 1/(2·127·256·sqrt(3)) of max|q'| per channel. (Without that term the KIVI error doubled, to
// 0.8–2.4e-5 of ‖q‖·‖k‖, and q4's mean KL moved by 2 % in tools/eval.)
constexpr float kQueryCodeMax = 127.0f * 256.0f;
static_assert(255.0 * kQueryCodeMax * QJLKV_MAX_HEAD_DIM < 2147483647.0, "Σ code·Q must fit int32");
constexpr uint32_t kDigitChunkBytes = 32;  // a chunk's hi and lo digits of one row

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

// Scores of R query rows over a block's codes: out[r][t] = step[r]·Σ_c Q_rc·code_tc + offset[r].
// unpack(row, h) gives codes 64h..64h+63 of a token's row as bytes, h < groups (codes past the
// head's channels 0, and their digits too).
// digits: per 16-channel chunk j and row, the 16 hi then the 16 lo digits (code_digits), each
// broadcast to the four 128-bit lanes as it is loaded (a load, no vector-port operation; chunk-major:
// a chunk's loads are one pointer and immediate offsets).
// Two groups of 4 tokens share each digit load: with one group, the 2·R digit loads per chunk
// outnumbered the vpdpbusd they fed half the time (loads, not multiplies, set the pace).
// Requests the next block's copy of each 8 tokens' codes as it starts them (prefetch_next_block).
template <bool SignedLow, uint32_t R, class Unpack>
void codes_scores(const BlockLayout &layout, const uint8_t *codes, size_t row_bytes, uint32_t B, uint32_t groups,
                  const int8_t *digits, const float *step, const float *offset, float *out, size_t out_stride,
                  const Unpack &unpack) {
  const uint32_t Bp = padded_tokens(B);
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
      for (uint32_t h = 0; h < groups; ++h) {
        __m512i x[2][4];
        for (uint32_t k = 0; k < 2; ++k) {
          const uint32_t t = t0 + 4 * (g + k);
          __m512i u[4];
          for (uint32_t i = 0; i < 4; ++i)
            u[i] = kAll || t + i < B ? unpack(codes + (t + i) * stride, h) : _mm512_setzero_si512();
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
              lo[k][r] = SignedLow ? dpbusd(lo[k][r], x[k][c], low) : dpbusd(lo[k][r], low, x[k][c]);
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

// The digits of R <= 4 rows of q' (scaled: `chunks`·16 floats a row, rows `stride` floats apart;
// overwritten) into digits[j][r][2][16], with largest[4r] the largest |q'| of row r: step[r], and
// weighted[r] = Σ_c Q_c·weight_c, weight(j) the int16 weights of chunk j's channels in the low
// halves of 16 dwords (the offsets' residual term, exact in int32: |Q|·weight·d < 2^31 for
// weights up to 255).
template <bool SignedLow, uint32_t R, class Weight>
void code_digits(float *scaled, size_t stride, uint32_t chunks, const float *largest, const Weight &weight,
                 int8_t *digits, float *step, int64_t *weighted) {
  const __m512i digit_bytes = _mm512_load_si512(kDigitBytes.index);
  __m512 factor[R];
  for (uint32_t r = 0; r < R; ++r) {
    const CodeScale code = code_scale(largest[4 * r], kQueryCodeMax);
    step[r] = largest[4 * r] > 0.0f ? largest[4 * r] / kQueryCodeMax : 0.0f;
    float *row = scaled + size_t(r) * stride;
    if (code.prescale != 1.0f)  // tiny rows only: then one multiply per chunk below
      for (uint32_t j = 0; j < 16 * chunks; j += 16)
        _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), _mm512_set1_ps(code.prescale)));
    factor[r] = _mm512_set1_ps(code.factor);
  }
  __m512i total[R];
  for (uint32_t r = 0; r < R; ++r) total[r] = _mm512_setzero_si512();
  int8_t *chunk = digits;
  for (uint32_t j = 0; j < chunks; ++j) {  // the rows together: one loop, R independent chains
    const __m512i w = weight(j);
    for (uint32_t r = 0; r < R; ++r, chunk += kDigitChunkBytes) {
      const __m512i Q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(scaled + size_t(r) * stride + 16 * j), factor[r]));
      total[r] = _mm512_add_epi32(total[r], _mm512_madd_epi16(Q, w));  // |Q| < 2^15: its low half is Q
      __m512i bytes;
      if constexpr (SignedLow)
        bytes = _mm512_xor_si512(_mm512_permutexvar_epi8(digit_bytes, _mm512_add_epi32(Q, _mm512_set1_epi32(128))),
                                 _mm512_load_si512(kDigitBytes.low_sign));
      else
        bytes = _mm512_permutexvar_epi8(digit_bytes, Q);
      _mm256_storeu_si256(reinterpret_cast<__m256i *>(chunk), _mm512_castsi512_si256(bytes));
    }
  }
  __m512 totals[4];
  for (uint32_t r = 0; r < 4; ++r) totals[r] = r < R ? _mm512_castsi512_ps(total[r]) : _mm512_setzero_ps();
  alignas(64) int32_t sums[16];
  _mm512_store_si512(sums, _mm512_castps_si512(reduce_rows4(totals, AddInt32Op{})));
  for (uint32_t r = 0; r < R; ++r) weighted[r] = sums[4 * r];
}

// ---- shared by the uniform and rotated Lloyd-Max value sums ----------------------------------

// Bytes [end − 32, end) of two consecutive rows, token A's in bytes 0-31 and token B's in bytes
// 32-63: two bytes_ending_at loads, the second inserted from memory, where a masked load of each
// row and a two-source vpermt2b took three more operations on the vector ports. The value codes'
// bytes that a tile reads end its window. B is even (block_tokens is a multiple of 8), so every
// token has its pair.
inline __m512i row_pair(const uint8_t *end, size_t row_bytes) {
  static_assert(kBytesEndingAt == 32, "a row_pair is two 32-byte halves");
  return _mm512_inserti64x4(_mm512_castsi256_si512(bytes_ending_at(end)), bytes_ending_at(end + row_bytes), 1);
}

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

// The tiles of R rows of acc taken `times` times from lane order to channel order. The order is a
// rotation of a channel's 6 bits within its tile by 2, so three times is the identity and twice
// takes channel order to lane order.
inline void reorder_two_bit_tiles(uint32_t d, uint32_t rows, float *acc, uint32_t times) {
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

}  // namespace
}  // namespace qjlkv::cpu::avx512_vnni
