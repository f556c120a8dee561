// White-box tests of src/quant_math.hpp: code packing, QJL sign bits, and the invariants that the
// directed fp16 rounding of group_quant promises (DESIGN.md "Numbers and rounding").
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "quant_math.hpp"

namespace {

TEST(QuantMath, RoundHalfEven) {
  EXPECT_EQ(qjlkv::round_half_even(0.5f), 0.0f);
  EXPECT_EQ(qjlkv::round_half_even(1.5f), 2.0f);
  EXPECT_EQ(qjlkv::round_half_even(2.5f), 2.0f);
  EXPECT_EQ(qjlkv::round_half_even(-2.5f), -2.0f);
  EXPECT_EQ(qjlkv::round_half_even(2.5000002f), 3.0f);
  EXPECT_EQ(qjlkv::round_half_even(3.4999998f), 3.0f);
}

TEST(QuantMath, PackedCodesAreLsbFirst) {
  // 2-bit codes 1, 2, 3, 0 -> 0b00'11'10'01; 4-bit codes 0xA, 0x5 -> 0x5A.
  uint8_t two[1] = {0};
  for (uint32_t j = 0; j < 4; ++j) qjlkv::pack_code(two, j, 2, std::vector<uint32_t>{1, 2, 3, 0}[j]);
  EXPECT_EQ(two[0], 0x39);
  uint8_t four[1] = {0};
  qjlkv::pack_code(four, 0, 4, 0xA);
  qjlkv::pack_code(four, 1, 4, 0x5);
  EXPECT_EQ(four[0], 0x5A);
  uint8_t eight[2] = {0, 0};
  qjlkv::pack_code(eight, 1, 8, 0xC3);
  EXPECT_EQ(eight[0], 0);
  EXPECT_EQ(eight[1], 0xC3);
}

TEST(QuantMath, ThreeBitCodesAreOneLsbFirstBitStream) {
  // Codes 0..7 in order: stream bits 3j..3j+2 hold j, so the 24-bit little-endian word is
  // Σ j << 3j = 0xFAC688 -> bytes 0x88, 0xC6, 0xFA; codes 2 and 5 cross a byte boundary.
  uint8_t three[3] = {0, 0, 0};
  for (uint32_t j = 0; j < 8; ++j) qjlkv::pack_code(three, j, 3, j);
  EXPECT_EQ(three[0], 0x88);
  EXPECT_EQ(three[1], 0xC6);
  EXPECT_EQ(three[2], 0xFA);
  for (uint32_t j = 0; j < 8; ++j) EXPECT_EQ(qjlkv::unpack_code(three, j, 3), j);
  // A straddling code alone touches exactly its two bytes.
  uint8_t lone[3] = {0, 0, 0};
  qjlkv::pack_code(lone, 2, 3, 7);  // bits 6, 7, 8
  EXPECT_EQ(lone[0], 0xC0);
  EXPECT_EQ(lone[1], 0x01);
  EXPECT_EQ(lone[2], 0x00);
}

TEST(QuantMath, PackUnpackRoundTrip) {
  std::mt19937 rng(3);
  for (uint32_t bits : {2u, 3u, 4u, 8u}) {
    const uint32_t n = 256;
    std::vector<uint32_t> codes(n);
    for (uint32_t &c : codes) c = rng() & ((1u << bits) - 1u);
    std::vector<uint8_t> packed(n * bits / 8, 0);
    for (uint32_t j = 0; j < n; ++j) qjlkv::pack_code(packed.data(), j, bits, codes[j]);
    for (uint32_t j = 0; j < n; ++j) ASSERT_EQ(qjlkv::unpack_code(packed.data(), j, bits), codes[j]) << bits;
    // Independent layout check: bit i of code j is stream bit j*b + i, i.e. bit (j*b + i) % 8
    // of byte (j*b + i) / 8.
    for (uint32_t j = 0; j < n; ++j) {
      uint32_t code = 0;
      for (uint32_t i = 0; i < bits; ++i) code |= uint32_t(packed[(j * bits + i) / 8] >> ((j * bits + i) % 8) & 1u) << i;
      ASSERT_EQ(code, codes[j]) << bits;
    }
  }
}

TEST(QuantMath, SignBitsMeanPositive) {
  const std::vector<float> projections = {1.0f, -1.0f, 0.0f, -0.0f, 1e-40f, -1e-40f, 3.0f, -7.0f, 2.0f, 0.5f};
  std::vector<uint8_t> bits(2, 0);
  for (uint32_t i = 0; i < projections.size(); ++i) qjlkv::set_sign_bit(bits.data(), i, projections[i]);
  // Rows 0, 4, 6 set in byte 0; rows 8, 9 in byte 1 (bit j of byte b is row 8b + j).
  EXPECT_EQ(bits[0], 0b01010001);
  EXPECT_EQ(bits[1], 0b00000011);
  const std::vector<float> v = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  double expected = 0.0;
  for (uint32_t i = 0; i < v.size(); ++i) {
    EXPECT_EQ(qjlkv::sign_bit(bits.data(), i), projections[i] > 0.0f) << i;
    expected += projections[i] > 0.0f ? v[i] : -v[i];
  }
  EXPECT_EQ(qjlkv::signed_dot(v.data(), bits.data(), uint32_t(v.size())), float(expected));
}

// Largest fp16 <= x / smallest fp16 >= x, found by walking the fp16 bit patterns in order.
bool is_largest_half_below(float candidate, float x) {
  if (candidate > x) return false;
  const uint16_t h = qjlkv::float_to_half(candidate);
  return qjlkv::half_to_float(qjlkv::half_next_up(h)) > x;
}
bool is_smallest_half_above(float candidate, float x) {
  if (candidate < x) return false;
  const uint16_t h = qjlkv::float_to_half(candidate);
  return qjlkv::half_to_float(qjlkv::half_next_down(h)) < x;
}

TEST(QuantMath, GroupQuantDirectedRoundingInvariants) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_scale(-10.0f, 10.0f);
  for (int trial = 0; trial < 20000; ++trial) {
    const uint32_t bits = std::vector<uint32_t>{2, 3, 4, 8}[trial % 4];
    const float spread = std::exp2(log_scale(rng));
    const float center = (unit(rng) - 0.5f) * 4.0f * spread * (trial % 5 == 0 ? 100.0f : 1.0f);
    float mn = center - spread * unit(rng), mx = center + spread * unit(rng);
    if (std::abs(mn) > 60000.0f || std::abs(mx) > 60000.0f) continue;
    const qjlkv::GroupQuant q = qjlkv::group_quant(mn, mx, bits);
    ASSERT_EQ(q.min, qjlkv::half_to_float(q.min_bits));
    ASSERT_EQ(q.scale, qjlkv::half_to_float(q.scale_bits));
    ASSERT_TRUE(is_largest_half_below(q.min, mn)) << mn;
    const float levels = float((1u << bits) - 1u);
    if (mx == mn) continue;
    ASSERT_TRUE(is_smallest_half_above(q.scale, (mx - q.min) / levels)) << mn << " " << mx;
    for (int i = 0; i < 16; ++i) {
      const float x = i == 0 ? mn : i == 1 ? mx : mn + (mx - mn) * unit(rng);
      // The directed roundings keep every code in range before clamping.
      const float unclamped = std::rint((x - q.min) / q.scale);
      ASSERT_GE(unclamped, 0.0f);
      ASSERT_LE(unclamped, levels);
      const uint32_t code = qjlkv::quant_code(x, q, bits);
      ASSERT_EQ(float(code), unclamped);
      const float x_hat = qjlkv::dequant(code, q.scale, q.min);
      // |x - x_hat| <= scale/2 up to fp32 rounding of the two operations.
      const double bound = 0.5 * q.scale + 4.0 * std::ldexp(1.0, -24) * (std::abs(x) + std::abs(q.min) + q.scale * levels);
      ASSERT_LE(std::abs(double(x) - double(x_hat)), bound) << "x " << x << " min " << mn << " max " << mx;
    }
  }
}

TEST(QuantMath, ZeroRangeGroupIsExactAndNeverNaN) {
  for (float v : {0.0f, -0.0f, 1.5f, -3.25f, 1000.0f, 0.0999755859375f /* fp16 */, 65504.0f, -65504.0f}) {
    for (uint32_t bits : {2u, 4u, 8u}) {
      const qjlkv::GroupQuant q = qjlkv::group_quant(v, v, bits);
      EXPECT_EQ(q.scale, 0.0f);
      EXPECT_EQ(q.scale_bits, 0u);
      EXPECT_EQ(qjlkv::quant_code(v, q, bits), 0u);
      const float x_hat = qjlkv::dequant(0, q.scale, q.min);
      EXPECT_FALSE(std::isnan(x_hat));
      EXPECT_EQ(x_hat, v) << "an fp16 constant is reconstructed exactly";
    }
  }
  // A constant that fp16 cannot hold comes back as the largest fp16 below it.
  const qjlkv::GroupQuant q = qjlkv::group_quant(0.1f, 0.1f, 2);
  EXPECT_TRUE(is_largest_half_below(q.min, 0.1f));
}

}  // namespace
