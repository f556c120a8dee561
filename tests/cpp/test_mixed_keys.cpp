// Mixed-bit keys (QJLKV_KEYS_MIXED, the "q2" preset), black-box: the exported block record
// (docs/FORMAT.md, "Block record") checked field by field against the rules of qjlkv.h, written
// here independently (one bit at a time to the channel whose squared error it cuts most), and
// the scores against float64 sums over the stored keys.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "crc32c.hpp"
#include "testing.hpp"

namespace {

constexpr size_t kHeaderBytes = 140;  // format version 4 (docs/FORMAT.md)
constexpr size_t kBlockRecordAt = kHeaderBytes + 48;  // the layer section's fields, no sink rows

uint32_t get_u32(const std::vector<uint8_t> &s, size_t at) {
  uint32_t v;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}
float get_f16(const std::vector<uint8_t> &s, size_t at) {
  uint16_t h;
  std::memcpy(&h, s.data() + at, 2);
  return qjlkv::half_to_float(h);
}
uint32_t get_bits(const std::vector<uint8_t> &s, size_t byte, uint32_t bit, uint32_t width) {
  uint32_t v = 0;
  for (uint32_t i = 0; i < width; ++i) v |= uint32_t(s[byte + (bit + i) / 8] >> ((bit + i) % 8) & 1u) << i;
  return v;
}

// One layer, one kv head, no sinks and no tail: `tokens` = B keys make exactly one block.
qjlkv_config one_block_config(uint32_t d, qjlkv_dtype dtype, uint32_t hq = 1) {
  qjlkv_config cfg = qt::make_config("q2", 1, hq, 1, d);
  cfg.dtype = dtype;
  cfg.sink_tokens = 0;
  cfg.residual_tokens = 0;
  return cfg;
}

// Keys with the shapes real keys have: Gaussian channels of unequal spread, a constant channel
// (zero range), a large bias with a small spread (Qwen's), an outlier channel, and two channels
// of the same range (a tie).
std::vector<float> block_keys(uint32_t B, uint32_t d, uint64_t seed) {
  qt::Rng rng(seed);
  std::vector<float> k = rng.normals(size_t(B) * d);
  for (uint32_t t = 0; t < B; ++t)
    for (uint32_t j = 0; j < d; ++j) {
      float &x = k[size_t(t) * d + j];
      x *= 0.25f + float(j % 7);
      if (j == 1) x = 3.0f;
      if (j == 2) x = 40.0f + 0.01f * x;
      if (j == 5) x *= 30.0f;
      if (j == 6 || j == 7) x = (t % 2 ? 1.0f : -1.0f) * (t == 0 ? 2.0f : 1.0f);
    }
  return k;
}

struct Record {
  std::vector<float> lo, hi;
  std::vector<uint32_t> widths;
  size_t codes_at;
};

Record parse_record(const std::vector<uint8_t> &s, uint32_t d) {
  Record r;
  const size_t at = kBlockRecordAt;
  for (uint32_t j = 0; j < d; ++j) {
    r.lo.push_back(get_f16(s, at + 2 * j));
    r.hi.push_back(get_f16(s, at + 2 * d + 2 * j));
    r.widths.push_back(get_bits(s, at + 4 * d, 3 * j, 3));
  }
  r.codes_at = at + 4 * d + 3 * d / 8;
  return r;
}

// The widths of qjlkv.h's rule, one bit at a time: each goes to the channel whose next bit
// removes the most squared error, range²·4^-w (w < 4), the lower channel on ties.
std::vector<uint32_t> greedy_widths(const std::vector<float> &lo, const std::vector<float> &hi, uint32_t bits) {
  const size_t d = lo.size();
  std::vector<uint32_t> w(d, 0);
  for (uint32_t n = 0; n < bits; ++n) {
    size_t best = d;
    double best_gain = -1.0;
    for (size_t j = 0; j < d; ++j) {
      const double r = double(hi[j]) - double(lo[j]);
      const double gain = r * r * std::pow(4.0, -double(w[j]));
      if (w[j] < 4 && gain > best_gain) best = j, best_gain = gain;
    }
    ++w[best];
  }
  return w;
}

class MixedKeysBlock : public ::testing::TestWithParam<std::tuple<uint32_t, qjlkv_dtype>> {};

TEST_P(MixedKeysBlock, StoresWhatTheRulesSay) {
  const auto [d, dtype] = GetParam();
  const qjlkv_config cfg = one_block_config(d, dtype);
  const uint32_t B = cfg.block_tokens, bits = cfg.key_token_bits;
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  std::vector<float> keys = block_keys(B, d, d + dtype), values = qt::Rng(9).normals(size_t(B) * d);
  qt::make_representable(keys, dtype);
  const std::vector<uint8_t> k = qt::encode(keys, dtype), v = qt::encode(values, dtype);
  QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, B, k.data(), v.data()));
  const std::vector<uint8_t> s = qt::exported(cache.get(), 0, 1);
  ASSERT_EQ(get_u32(s, 8), 4u) << "mixed keys need format version 4";
  ASSERT_EQ(get_u32(s, 12), kHeaderBytes);
  ASSERT_EQ(get_u32(s, kHeaderBytes - 8), bits) << "key_token_bits in the header";
  ASSERT_EQ(get_u32(s, kHeaderBytes + 32), 1u) << "one block";
  ASSERT_EQ(get_u32(s, kHeaderBytes + 36), 0u) << "no tail";

  const Record r = parse_record(s, d);
  for (uint32_t j = 0; j < d; ++j) {
    float lo = keys[j], hi = keys[j];
    for (uint32_t t = 1; t < B; ++t) {
      lo = std::min(lo, keys[size_t(t) * d + j]);
      hi = std::max(hi, keys[size_t(t) * d + j]);
    }
    ASSERT_EQ(r.lo[j], qt::fp16_floor(lo)) << "channel " << j;
    ASSERT_EQ(r.hi[j], qt::fp16_ceil(hi)) << "channel " << j;
  }
  const std::vector<uint32_t> want = greedy_widths(r.lo, r.hi, bits);
  ASSERT_EQ(r.widths, want);
  EXPECT_EQ(r.widths[1], 0u) << "a constant channel gets no bits";

  // Every code is the midrise cell of its key, and decodes within half a cell of it.
  for (uint32_t t = 0; t < B; ++t)
    for (uint32_t j = 0, bit = 0; j < d; bit += r.widths[j], ++j) {
      const float x = keys[size_t(t) * d + j], cell = std::ldexp(r.hi[j] - r.lo[j], -int(r.widths[j]));
      const uint32_t code = get_bits(s, r.codes_at + size_t(t) * bits / 8, bit, r.widths[j]);
      const float top = float((1u << r.widths[j]) - 1u);
      const float expected = r.widths[j] == 0 || cell == 0.0f
                                 ? 0.0f
                                 : std::min(std::max(std::floor((x - r.lo[j]) / cell), 0.0f), top);
      ASSERT_EQ(float(code), expected) << "token " << t << " channel " << j;
      const float decoded = r.lo[j] + (float(code) + 0.5f) * cell;
      ASSERT_LE(std::fabs(decoded - x), 0.5f * cell * (1.0f + 1e-5f) + 1e-30f) << "token " << t << " channel " << j;
    }
}

// Scores: Σ_j q_j·k̂_j over the stored keys, in float64, for every query head of a GQA group.
TEST_P(MixedKeysBlock, ScoresAreTheStoredKeysDotTheQuery) {
  const auto [d, dtype] = GetParam();
  const uint32_t hq = 4;
  const qjlkv_config cfg = one_block_config(d, dtype, hq);
  const uint32_t B = cfg.block_tokens, bits = cfg.key_token_bits;
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  std::vector<float> keys = block_keys(B, d, 7 * d + dtype), values = qt::Rng(3).normals(size_t(B) * d);
  qt::make_representable(keys, dtype);
  const std::vector<uint8_t> k = qt::encode(keys, dtype), v = qt::encode(values, dtype);
  QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, B, k.data(), v.data()));
  const std::vector<uint8_t> s = qt::exported(cache.get(), 0, 1);
  const Record r = parse_record(s, d);
  std::vector<float> q = qt::Rng(11 + d).normals(size_t(hq) * d);
  qt::make_representable(q, dtype);
  std::vector<float> got;
  qt::library_scores(cache.get(), 0, 0, qt::encode(q, dtype), &got);
  ASSERT_EQ(got.size(), size_t(hq) * B);
  double err2 = 0.0, scale2 = 0.0;
  for (uint32_t h = 0; h < hq; ++h)
    for (uint32_t t = 0; t < B; ++t) {
      double want = 0.0, k2 = 0.0;
      for (uint32_t j = 0, bit = 0; j < d; bit += r.widths[j], ++j) {
        const uint32_t code = get_bits(s, r.codes_at + size_t(t) * bits / 8, bit, r.widths[j]);
        const double cell = std::ldexp(double(r.hi[j]) - double(r.lo[j]), -int(r.widths[j]));
        const double key = double(r.lo[j]) + (code + 0.5) * cell;
        want += double(q[size_t(h) * d + j]) * key;
        k2 += key * key;
      }
      const double e = double(got[size_t(h) * B + t]) - want;
      err2 += e * e;
      scale2 += qt::dot(&q[size_t(h) * d], &q[size_t(h) * d], d) * k2;
    }
  // SPEC §9: rms error at most 1e-3·‖q‖·‖k‖ on every path.
  EXPECT_LE(std::sqrt(err2 / scale2), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Shapes, MixedKeysBlock,
                         ::testing::Combine(::testing::Values(64u, 72u, 128u, 256u),
                                            ::testing::Values(QJLKV_DTYPE_F32, QJLKV_DTYPE_F16, QJLKV_DTYPE_BF16)));

// The stored bits per token are config.key_token_bits, whatever the head dim.
TEST(MixedKeys, TokenBitsSizeTheRows) {
  for (uint32_t bits : {8u, 136u, 200u, 256u}) {
    SCOPED_TRACE(bits);
    qjlkv_config cfg = one_block_config(64, QJLKV_DTYPE_F32);
    cfg.key_token_bits = bits;
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    const std::vector<float> keys = block_keys(cfg.block_tokens, 64, bits), values(keys.size(), 1.0f);
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, cfg.block_tokens, keys.data(), values.data()));
    const std::vector<uint8_t> s = qt::exported(cache.get(), 0, 1);
    const Record r = parse_record(s, 64);
    uint32_t sum = 0;
    for (uint32_t w : r.widths) sum += w;
    EXPECT_EQ(sum, bits);
    EXPECT_EQ(r.widths, greedy_widths(r.lo, r.hi, bits));
  }
}

TEST(MixedKeys, ConfigRefusesTokenBitsOutsideTheRule) {
  for (uint32_t bits : {0u, 4u, 12u, 4 * 64u + 8}) {
    qjlkv_config cfg = one_block_config(64, QJLKV_DTYPE_F32);
    cfg.key_token_bits = bits;
    QT_EXPECT_FAIL(qjlkv_config_validate(&cfg), QJLKV_ERROR_INVALID_ARGUMENT, "key_token_bits");
  }
  qjlkv_config cfg = one_block_config(64, QJLKV_DTYPE_F32);
  cfg.key_token_bits = 4 * 64;
  QT_EXPECT_OK(qjlkv_config_validate(&cfg));
  // Other key methods ignore the field.
  cfg.key_method = QJLKV_KEYS_KIVI;
  cfg.key_token_bits = 3;
  QT_EXPECT_OK(qjlkv_config_validate(&cfg));
}

// 0.4's struct has no key_token_bits: read as 0, so mixed keys cannot be configured through it,
// and the other methods work as in 0.4.
TEST(MixedKeys, ConfigOfRelease04ReadsNoTokenBits) {
  qjlkv_config cfg;
  std::memset(&cfg, 0xEE, sizeof cfg);
  cfg.struct_size = QJLKV_CONFIG_SIZE_0_4;
  QT_ASSERT_OK(qjlkv_config_init(&cfg, "q2", 1, 2, 1, 64));
  const auto *bytes = reinterpret_cast<const uint8_t *>(&cfg);
  for (size_t i = QJLKV_CONFIG_SIZE_0_4; i < sizeof cfg; ++i) ASSERT_EQ(bytes[i], 0xEE) << "byte " << i;
  QT_EXPECT_FAIL(qjlkv_config_validate(&cfg), QJLKV_ERROR_INVALID_ARGUMENT, "key_token_bits");
  QT_ASSERT_OK(qjlkv_config_init(&cfg, "q3", 1, 2, 1, 64));
  QT_EXPECT_OK(qjlkv_config_validate(&cfg));
}

// Streams of other key methods stay at format version 3 (0.4 reads them); a corrupt mixed
// record is refused.
TEST(MixedKeys, StreamsAndTheirChecks) {
  {
    qt::Cache q3 = qt::make_cache(qt::make_config("q3", 1, 2, 1, 64));
    const std::vector<float> x(64 * 100, 0.5f);
    QT_ASSERT_OK(qjlkv_cache_append(q3.get(), 0, 0, 100, x.data(), x.data()));
    const std::vector<uint8_t> s = qt::exported(q3.get(), 0, 1);
    EXPECT_EQ(get_u32(s, 8), 3u);
    EXPECT_EQ(get_u32(s, 12), 136u);
  }
  const qjlkv_config cfg = one_block_config(64, QJLKV_DTYPE_F32);
  qt::Cache cache = qt::make_cache(cfg);
  const std::vector<float> keys = block_keys(cfg.block_tokens, 64, 5), values(keys.size(), 1.0f);
  QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, cfg.block_tokens, keys.data(), values.data()));
  const std::vector<uint8_t> good = qt::exported(cache.get(), 0, 1);
  const auto reimport = [&](std::vector<uint8_t> s) {
    const uint32_t crc = qjlkv::crc32c(s.data(), s.size() - 4);
    std::memcpy(s.data() + s.size() - 4, &crc, 4);
    qt::Cache fresh = qt::make_cache(cfg);
    return qjlkv_cache_import(fresh.get(), 0, s.data(), s.size());
  };
  QT_EXPECT_OK(reimport(good));
  {
    qjlkv_config other = cfg;
    other.key_token_bits -= 8;
    qt::Cache fewer = qt::make_cache(other);
    QT_EXPECT_FAIL(qjlkv_cache_import(fewer.get(), 0, good.data(), good.size()), QJLKV_ERROR_INVALID_ARGUMENT,
                   "key_token_bits");
  }
  std::vector<uint8_t> bad = good;
  bad[kBlockRecordAt + 4 * 64] ^= 0x07;  // channel 0's width
  EXPECT_EQ(reimport(bad), QJLKV_ERROR_CORRUPT_DATA);
  EXPECT_NE(std::string(qjlkv_last_error_message()).find("width"), std::string::npos) << qjlkv_last_error_message();
  bad = good;
  const uint16_t above = qjlkv::float_to_half(1000.0f);  // channel 0's minimum above its maximum
  std::memcpy(bad.data() + kBlockRecordAt, &above, 2);
  EXPECT_EQ(reimport(bad), QJLKV_ERROR_CORRUPT_DATA);
  EXPECT_NE(std::string(qjlkv_last_error_message()).find("maximum"), std::string::npos) << qjlkv_last_error_message();
}

}  // namespace
