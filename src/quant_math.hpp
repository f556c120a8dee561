// Per-element quantization math shared by the CPU and CUDA backends (SPEC §3-§5).
// Every function here is small, branch-light and __host__ __device__, so CPU tests cover the device math.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "half.hpp"
#include "hd.hpp"

namespace qjlkv {

// Round half to even: the current rounding mode is round-to-nearest-even on both backends.
QJLKV_HD float round_half_even(float x) { return rintf(x); }

// Asymmetric min/max quantization of one group (SPEC §4, also KIVI's per-channel groups, §5).
// The minimum is stored as the largest fp16 <= min and the scale as the smallest fp16 >=
// (max - stored_min) / (2^bits - 1): with these directed roundings every code lands in
// [0, 2^bits - 1] before clamping, so |x - x_hat| <= scale/2 (+ fp32 rounding) holds exactly.
struct GroupQuant {
  uint16_t scale_bits;  // fp16
  uint16_t min_bits;    // fp16
  float scale;
  float min;
};

QJLKV_HD GroupQuant group_quant(float group_min, float group_max, uint32_t bits) {
  GroupQuant q;
  q.min_bits = float_to_half_down(group_min);
  q.min = half_to_float(q.min_bits);
  if (group_max == group_min) {  // zero range: scale 0, codes 0, x_hat = min
    q.scale_bits = 0;
    q.scale = 0.0f;
    return q;
  }
  const float levels = float((1u << bits) - 1u);
  q.scale_bits = float_to_half_up((group_max - q.min) / levels);
  q.scale = half_to_float(q.scale_bits);
  return q;
}

QJLKV_HD uint32_t quant_code(float x, const GroupQuant &q, uint32_t bits) {
  if (q.scale == 0.0f) return 0;
  const float max_code = float((1u << bits) - 1u);
  const float code = round_half_even((x - q.min) / q.scale);
  return uint32_t(fminf(fmaxf(code, 0.0f), max_code));
}

QJLKV_HD float dequant(uint32_t code, float scale, float min) { return float(code) * scale + min; }

// b-bit codes (b in {2,3,4,8}) packed as one LSB-first bit stream per row: code j occupies bits
// j*b .. j*b + b - 1 of the row, bit i of the stream being bit i % 8 of byte i / 8. For 2, 4 and 8
// bits a code never crosses a byte; 3-bit codes pack 8 codes in 3 bytes, and codes 2 and 5 of each
// such group cross into the next byte (never past the row: rows hold a multiple of 8 codes).
QJLKV_HD uint32_t unpack_code(const uint8_t *packed, uint32_t j, uint32_t bits) {
  const uint32_t bit = j * bits, shift = bit & 7u;
  uint32_t window = packed[bit >> 3];
  if (shift + bits > 8u) window |= uint32_t(packed[(bit >> 3) + 1]) << 8;
  return (window >> shift) & ((1u << bits) - 1u);
}
QJLKV_HD void pack_code(uint8_t *packed, uint32_t j, uint32_t bits, uint32_t code) {  // bytes start zeroed
  const uint32_t bit = j * bits, shift = bit & 7u;
  packed[bit >> 3] = uint8_t(packed[bit >> 3] | (code << shift));
  if (shift + bits > 8u) packed[(bit >> 3) + 1] = uint8_t(packed[(bit >> 3) + 1] | (code >> (8u - shift)));
}

// Lloyd-Max levels for N(0,1) (Max 1960) of 2^bits codes, ascending: code c decodes to level c.
QJLKV_HD float lloyd_max_level(uint32_t bits, uint32_t code) {
  constexpr float k2[4] = {-1.5104f, -0.4528f, 0.4528f, 1.5104f};
  constexpr float k3[8] = {-2.1520f, -1.3440f, -0.7560f, -0.2451f, 0.2451f, 0.7560f, 1.3440f, 2.1520f};
  constexpr float k4[16] = {-2.7326f, -2.0690f, -1.6180f, -1.2562f, -0.9424f, -0.6568f, -0.3881f, -0.1284f,
                            0.1284f,  0.3881f,  0.6568f,  0.9424f,  1.2562f,  1.6180f,  2.0690f,  2.7326f};
  return bits == 2 ? k2[code & 3u] : bits == 3 ? k3[code & 7u] : k4[code & 15u];
}
// The code of a normalized coordinate u: the number of midpoints 0.5f·(level c + level c+1)
// (fp32) that u exceeds, so a u exactly on a midpoint takes the lower code (and NaN code 0).
QJLKV_HD uint32_t lloyd_max_code(float u, uint32_t bits) {
  uint32_t code = 0;
  for (uint32_t c = 0; c + 1 < (1u << bits); ++c)
    code += u > 0.5f * (lloyd_max_level(bits, c) + lloyd_max_level(bits, c + 1)) ? 1u : 0u;
  return code;
}
// The smallest |level|: the norms of a token's levels are at least this times sqrt(d).
QJLKV_HD float lloyd_max_smallest_level(uint32_t bits) { return lloyd_max_level(bits, (1u << bits) / 2u); }

// QJL sign bit: 1 means projection > 0, 0 means <= 0; bit j of byte b is sketch row 8b + j.
QJLKV_HD bool sign_bit(const uint8_t *bits, uint32_t row) { return (bits[row >> 3] >> (row & 7u)) & 1u; }
QJLKV_HD void set_sign_bit(uint8_t *bits, uint32_t row, float projection) {
  if (projection > 0.0f) bits[row >> 3] = uint8_t(bits[row >> 3] | (1u << (row & 7u)));
}

// <v, ±bits> over `rows` rows: +v_i where the bit is 1, -v_i where it is 0.
QJLKV_HD float signed_dot(const float *v, const uint8_t *bits, uint32_t rows) {
  float sum = 0.0f;
  for (uint32_t i = 0; i < rows; ++i) sum += sign_bit(bits, i) ? v[i] : -v[i];
  return sum;
}

// A sketch entry as the exact integer the outlier corrections sum: S·2^32, truncated. |S| <= 32
// (Gaussian entries stay under 9, orthogonalized rows have norm √d <= 32), so an entry is below
// 2^37 and QJLKV_MAX_SKETCH_DIM = 2^16 of them below 2^53: the sums are exact in int64, the same
// in any order on every backend (the CPU's nibble tables, a CUDA thread's loop).
inline constexpr double kSketchFixedScale = 4294967296.0;  // 2^32
QJLKV_HD int64_t sketch_fixed(float s) { return static_cast<int64_t>(double(s) * kSketchFixedScale); }

// ⟨S_o, ±bits⟩ in units of 2^-32: column o of the row-major [rows][d] sketch S over a token's
// first `rows` sign bits, each entry as sketch_fixed.
QJLKV_HD int64_t column_signed_sum(const float *S, uint32_t d, uint32_t o, const uint8_t *bits, uint32_t rows) {
  int64_t sum = 0;
  for (uint32_t i = 0; i < rows; ++i) {
    const int64_t s = sketch_fixed(S[size_t(i) * d + o]);
    sum += sign_bit(bits, i) ? s : -s;
  }
  return sum;
}

// QJL's stored outlier correction τ of one token and outlier channel o (docs/DESIGN.md, "QJL
// outlier corrections"): the outlier sketch's estimate of k_o, c_d/m_out·n_out·⟨S_out,o, ±bits_out⟩,
// less what the inlier estimate puts on channel o, c_d/m·n_in·⟨S_o, ±bits_in⟩, over n_in + n_out
// (n_in, n_out: the token's stored norms), so that
//   est(q, k) = c_d/m·n_in·⟨S·q, ±bits_in⟩ + Σ_o q_o·τ_o·(n_in + n_out)
// is SPEC §3's estimate. |τ| <= c_d·max |S_io| <= c_d·√d: fp16 holds it to 2^-11.
// inlier_sum, outlier_sum: the two column_signed_sums.
QJLKV_HD uint16_t qjl_correction(float qjl_constant, float n_in, float n_out, int64_t inlier_sum, int64_t outlier_sum,
                                 uint32_t m, uint32_t m_out) {
  const double scale = double(n_in) + double(n_out);
  if (!(scale > 0.0)) return 0;
  const double outlier = double(n_out) * (double(outlier_sum) / kSketchFixedScale) / double(m_out);
  const double inlier = double(n_in) * (double(inlier_sum) / kSketchFixedScale) / double(m);
  return float_to_half(float(double(qjl_constant) * (outlier - inlier) / scale));
}

}  // namespace qjlkv
