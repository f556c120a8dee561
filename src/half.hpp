// Bit-exact fp16 / bf16 <-> fp32 conversions shared by the CPU and CUDA backends.
// Software conversions keep both backends bit-identical and let CPU tests cover the device math.
#pragma once
#include <cstdint>
#include <cstring>

#include "hd.hpp"

namespace qjlkv {

QJLKV_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

QJLKV_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

QJLKV_HD float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_float(sign);
  // Subnormal: value = mantissa * 2^-24, exact in fp32.
  const float magnitude = float(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

// Round-to-nearest-even fp32 -> fp16; overflow gives Inf, NaN stays NaN.
QJLKV_HD uint16_t float_to_half(float f) {
  const uint32_t x = float_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t abs_bits = x & 0x7fffffffu;
  if (abs_bits >= 0x7f800000u) return uint16_t(sign | (abs_bits > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (abs_bits >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (abs_bits < 0x38800000u) {                                     // below 2^-14: subnormal or zero
    if (abs_bits < 0x33000000u) return sign;                        // below 2^-25 rounds to zero
    const uint32_t exponent = abs_bits >> 23;
    const uint32_t mantissa = (abs_bits & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;                          // 14..24 + 1
    uint32_t half_mantissa = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (remainder > halfway || (remainder == halfway && (half_mantissa & 1u))) ++half_mantissa;
    return uint16_t(sign | half_mantissa);
  }
  uint32_t rounded = abs_bits + 0xfffu + ((abs_bits >> 13) & 1u);  // round half to even at bit 13
  rounded -= 0x38000000u;                                          // rebias exponent 127 -> 15
  return uint16_t(sign | (rounded >> 13));
}

QJLKV_HD float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

// Round-to-nearest-even fp32 -> bf16; NaN stays NaN.
QJLKV_HD uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// The next fp16 value towards -Inf / +Inf of a finite fp16 (used for directed rounding).
QJLKV_HD uint16_t half_next_down(uint16_t h) {
  if (h == 0x0000u) return 0x8001u;
  return (h & 0x8000u) ? uint16_t(h + 1u) : uint16_t(h - 1u);
}
QJLKV_HD uint16_t half_next_up(uint16_t h) {
  if (h == 0x8000u) return 0x0001u;
  return (h & 0x8000u) ? uint16_t(h - 1u) : uint16_t(h + 1u);
}

// Largest fp16 <= f, and smallest fp16 >= f (f finite and within the fp16 range).
QJLKV_HD uint16_t float_to_half_down(float f) {
  uint16_t h = float_to_half(f);
  if (half_to_float(h) > f) h = half_next_down(h);
  return h;
}
QJLKV_HD uint16_t float_to_half_up(float f) {
  uint16_t h = float_to_half(f);
  if (half_to_float(h) < f) h = half_next_up(h);
  return h;
}

inline constexpr float kHalfMax = 65504.0f;

}  // namespace qjlkv
