// White-box tests of src/half.hpp against references written here: exact decoding by ldexp,
// round-to-nearest-even by searching the table of all fp16 values, and the compiler's _Float16.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "half.hpp"

namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

bool half_is_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

// The exact value of an fp16 bit pattern (NaN patterns excluded).
double half_value(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  const double sign = (h & 0x8000u) ? -1.0 : 1.0;
  if (exponent == 0x1f) return sign * std::numeric_limits<double>::infinity();
  if (exponent == 0) return sign * std::ldexp(double(mantissa), -24);
  return sign * std::ldexp(double(1024 + mantissa), exponent - 25);
}

// Round to nearest even by search: the non-negative finite fp16 values increase with their bit
// patterns 0x0000..0x7bff, so the nearest is one of two neighbours in that table.
uint16_t nearest_half(float f) {
  static const std::vector<double> table = [] {
    std::vector<double> t(0x7c00);
    for (uint32_t h = 0; h < 0x7c00; ++h) t[h] = half_value(uint16_t(h));
    return t;
  }();
  const uint16_t sign = std::signbit(f) ? 0x8000u : 0u;
  if (std::isnan(f)) return uint16_t(sign | 0x7e00u);
  const double a = std::abs(double(f));
  if (a >= 65520.0) return uint16_t(sign | 0x7c00u);  // at or beyond the midpoint to 2^16: overflow
  const size_t hi = std::lower_bound(table.begin(), table.end(), a) - table.begin();
  if (hi == 0) return sign;
  if (hi == table.size()) return uint16_t(sign | 0x7bffu);
  const size_t lo = hi - 1;
  const double below = a - table[lo], above = table[hi] - a;
  const size_t pick = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
  return uint16_t(sign | pick);
}

// Round to nearest even to bf16 by comparing the two candidates in double.
uint16_t nearest_bf16(float f) {
  const uint32_t x = to_bits(f);
  if (std::isnan(f)) return uint16_t((x >> 16) | 0x40u);
  const uint32_t lo = x & 0xffff0000u;
  const uint32_t hi = lo + 0x10000u;  // next magnitude; may be the Inf pattern
  const double a = std::abs(double(f));
  const double lo_value = std::abs(double(from_bits(lo)));
  const double hi_value = (hi & 0x7fffffffu) == 0x7f800000u ? std::ldexp(1.0, 128) : std::abs(double(from_bits(hi)));
  if (std::isinf(f)) return uint16_t(x >> 16);
  const double below = a - lo_value, above = hi_value - a;
  const uint32_t pick = below < above ? lo : above < below ? hi : (((lo >> 16) & 1u) == 0 ? lo : hi);
  return uint16_t(pick >> 16);
}

// Floats that stress the conversions: every fp16 midpoint and neighbour, the overflow and
// underflow boundaries, then random bit patterns over the whole float range.
std::vector<float> conversion_inputs() {
  std::vector<float> in;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const double v = half_value(uint16_t(h)), next = half_value(uint16_t(h + 1));
    const float mid = float(0.5 * (v + next));  // fp16 midpoints have 12 significant bits: exact in fp32
    for (float x : {float(v), mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      in.push_back(x);
      in.push_back(-x);
    }
  }
  for (float x : {65504.0f, 65519.996f, 65520.0f, 65536.0f, 1e30f, 0x1p-24f, 0x1p-25f, std::nextafter(0x1p-25f, 1.0f),
                  0x1p-26f, 0x1p-14f, std::nextafter(0x1p-14f, 0.0f), 1e-45f, 0.0f, INFINITY,
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::min()}) {
    in.push_back(x);
    in.push_back(-x);
  }
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = uint32_t(rng());
    if ((bits & 0x7f800000u) != 0x7f800000u) in.push_back(from_bits(bits));
  }
  return in;
}

TEST(Half, EveryPatternDecodesExactly) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const float f = qjlkv::half_to_float(uint16_t(h));
    if (half_is_nan(uint16_t(h))) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << h;
      continue;
    }
    ASSERT_EQ(double(f), half_value(uint16_t(h))) << std::hex << h;
    ASSERT_EQ(std::signbit(f), (h & 0x8000u) != 0) << std::hex << h;
  }
}

TEST(Half, EveryPatternRoundTrips) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const uint16_t back = qjlkv::float_to_half(qjlkv::half_to_float(uint16_t(h)));
    if (half_is_nan(uint16_t(h))) {
      EXPECT_TRUE(half_is_nan(back)) << std::hex << h;
      EXPECT_EQ(back & 0x8000u, h & 0x8000u) << std::hex << h;
    } else {
      ASSERT_EQ(back, h) << std::hex << h;
    }
  }
}

TEST(Half, FloatToHalfRoundsToNearestEven) {
  for (float f : conversion_inputs()) ASSERT_EQ(qjlkv::float_to_half(f), nearest_half(f)) << f;
  EXPECT_TRUE(half_is_nan(qjlkv::float_to_half(std::nanf(""))));
  EXPECT_TRUE(half_is_nan(qjlkv::float_to_half(-std::nanf(""))));
}

#if defined(__FLT16_MAX__)
TEST(Half, MatchesCompilerFloat16) {
  for (float f : conversion_inputs()) {
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    ASSERT_EQ(qjlkv::float_to_half(f), bits) << f;
  }
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    if (half_is_nan(uint16_t(h))) continue;
    _Float16 x;
    const uint16_t bits = uint16_t(h);
    std::memcpy(&x, &bits, 2);
    ASSERT_EQ(qjlkv::half_to_float(bits), static_cast<float>(x)) << std::hex << h;
  }
}
#endif

TEST(Bf16, FloatToBf16RoundsToNearestEven) {
  std::vector<float> in = conversion_inputs();
  for (float x : {std::numeric_limits<float>::max(), from_bits(0x7f7f7fffu), from_bits(0x7f7f8000u),
                  from_bits(0x3f808000u), from_bits(0x3f818000u), from_bits(0x00008000u), from_bits(0x00018000u),
                  INFINITY}) {
    in.push_back(x);
    in.push_back(-x);
  }
  for (float f : in) ASSERT_EQ(qjlkv::float_to_bf16(f), nearest_bf16(f)) << f;
  EXPECT_EQ(qjlkv::float_to_bf16(from_bits(0x3f808000u)), 0x3f80u) << "tie goes to even";
  EXPECT_EQ(qjlkv::float_to_bf16(from_bits(0x3f818000u)), 0x3f82u) << "tie goes to even";
  EXPECT_EQ(qjlkv::float_to_bf16(std::numeric_limits<float>::max()), 0x7f80u) << "overflow rounds to Inf";
  const uint16_t nan = qjlkv::float_to_bf16(from_bits(0x7f800001u));  // signalling NaN whose payload is low
  EXPECT_TRUE(std::isnan(qjlkv::bf16_to_float(nan))) << "NaN must not become Inf";
}

TEST(Bf16, EveryPatternDecodes) {
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const float f = qjlkv::bf16_to_float(uint16_t(b));
    EXPECT_EQ(to_bits(f), b << 16) << std::hex << b;
    if (!std::isnan(f)) {
      ASSERT_EQ(qjlkv::float_to_bf16(f), b) << std::hex << b;
    }
  }
}

TEST(Half, DirectedRounding) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> exponent(-26.0f, 15.9f);
  std::vector<float> in = {0.0f, -0.0f, 65504.0f, -65504.0f, 0x1p-24f, -0x1p-24f, 1e-10f, -1e-10f, 1.0f, 3.0f};
  for (int i = 0; i < 100000; ++i) {
    const float x = std::exp2(exponent(rng)) * ((rng() & 1) ? 1.0f : -1.0f);
    if (std::abs(x) <= 65504.0f) in.push_back(x);
  }
  for (float x : in) {
    const uint16_t down = qjlkv::float_to_half_down(x), up = qjlkv::float_to_half_up(x);
    const float down_value = qjlkv::half_to_float(down), up_value = qjlkv::half_to_float(up);
    ASSERT_LE(down_value, x);
    ASSERT_GE(up_value, x);
    if (down_value == x) {
      EXPECT_EQ(up_value, x) << "a representable value rounds to itself both ways";
    } else {
      // No fp16 lies strictly between the two results, and they bracket x.
      ASSERT_EQ(qjlkv::half_next_up(down), up) << x;
      ASSERT_GT(up_value, x) << x;
      ASSERT_LT(qjlkv::half_to_float(qjlkv::half_next_down(up)), x) << x;
    }
  }
}

}  // namespace
