// What the AVX-512 VNNI kernels of the methods (src/methods/*/cpu_avx512_vnni.cpp) share: the
// integer dot products, the code loads and the lane shuffles, and the 2-bit value tiles' lane
// order. Included inside avx512_vnni_begin.inc's target region (x86-64 only).
#pragma once
#include <immintrin.h>

#include <cstring>

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
// Lanes 4r..4r+3 of the result: op over the 16 lanes of v[r], the 4 rows reduced together.
template <class Op>
inline __m512 reduce_rows4(const __m512 v[4], Op op) {
  const __m512 a = op(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const __m512 b = op(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  const __m512 c = op(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));  // lane r: row r
  const __m512 e = op(c, _mm512_permute_ps(c, 0x4E));
  return op(e, _mm512_permute_ps(e, 0xB1));
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
