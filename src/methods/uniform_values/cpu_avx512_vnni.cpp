// Uniform value sums in integers on AVX-512 VNNI (vpdpwssd, vpermb), within the error budget of
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

// Whether the layer's value sums of channels [0, 64·floor(d / 64)) are kept in the 2-bit tiles'
// lane order (lloyd_max_tile2, uniform_tile2: channel c0 + 4j + k at c0 + 16k + j).
bool uniform_two_bit_tiles(const CodesArgs &a) {
  return a.bits == 2 && uniform_integer_layout(a) && uniform_tile_groups(a.group) != 0;
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

void uniform_values_in_channel_order(const CodesArgs &a, uint32_t rows, float *acc) {
  if (uniform_two_bit_tiles(a)) reorder_two_bit_tiles(a.head_dim, rows, acc, 1);
}

}  // namespace
}  // namespace qjlkv::cpu::avx512_vnni

#include "../../cpu/avx512_vnni_end.inc"

namespace qjlkv::cpu {
ValueKernels uniform_value_kernels_avx512_vnni(const ValueKernels &avx512) {
  ValueKernels kernels = avx512;
  kernels.accumulate = &avx512_vnni::uniform_values_accumulate;
  kernels.in_channel_order = &avx512_vnni::uniform_values_in_channel_order;
  return kernels;
}
}  // namespace qjlkv::cpu
#endif
