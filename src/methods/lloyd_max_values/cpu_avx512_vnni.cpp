// Rotated Lloyd-Max value sums in integers on AVX-512 VNNI (vpdpwssd, vpermw), within the error
// budget of SPEC §9 (docs/DESIGN.md, "Integer decode paths"). The target pragma comes after every
// include (avx512_vnni_begin.inc).
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

// 2-bit codes, 64 channels from c0 (a multiple of 64): the 16 bytes of a row that hold them,
// 4 codes each. vpermb puts byte j of token A in word 2j and of token B in word 2j + 1 (from a
// row_pair); the level table T0 (entry i: level of i's bits 0-1) and T2 (bits 2-3), on those
// words and on them shifted right by 4, give the levels of channels 4j + k for k = 0..3 in dword
// lane j: one vpermb, one shift and four vpermw per 64 channels of a pair, where lloyd_max_tile
// takes three shuffles per 16. The sums come out with channel 4j + k in lane j of sum[r][k] and
// stay so in acc (channels c0 + 4j + k at c0 + 16k + j): in_channel_order puts them back
// once per attend, where doing it at each flush took 16 shuffles per row and tile of every block.
// (A layer's blocks all take these tiles, for channels [0, 64·floor(d / 64)).)
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

// Whether lloyd_max_values_accumulate takes values_lloyd_max (for 2, 3 and 4 bits).
bool lloyd_max_integer_layout(const CodesArgs &a) { return a.head_dim % 16 == 0; }

// Whether the layer's value sums of channels [0, 64·floor(d / 64)) are kept in the 2-bit tiles'
// lane order (lloyd_max_tile2, uniform_tile2: channel c0 + 4j + k at c0 + 16k + j).
bool lloyd_max_two_bit_tiles(const CodesArgs &a) { return a.bits == 2 && lloyd_max_integer_layout(a); }

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

void lloyd_max_values_in_channel_order(const CodesArgs &a, uint32_t rows, float *acc) {
  if (lloyd_max_two_bit_tiles(a)) reorder_two_bit_tiles(a.head_dim, rows, acc, 1);
}

}  // namespace
}  // namespace qjlkv::cpu::avx512_vnni

#include "../../cpu/avx512_vnni_end.inc"

namespace qjlkv::cpu {
ValueKernels lloyd_max_value_kernels_avx512_vnni(const ValueKernels &avx512) {
  ValueKernels kernels = avx512;
  kernels.accumulate = &avx512_vnni::lloyd_max_values_accumulate;
  kernels.in_channel_order = &avx512_vnni::lloyd_max_values_in_channel_order;
  return kernels;
}
}  // namespace qjlkv::cpu
#endif
