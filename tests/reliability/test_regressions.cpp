// Regression tests for the bugs that the reliability work found (see docs/RELIABILITY.md).
// Each test names the input that failed; the fuzz corpus (tests/fuzz/corpus) holds the
// harness inputs that found them.
#include <cmath>
#include <limits>
#include <vector>

#include "reliability.hpp"

namespace qjlkv_test {
namespace {

// Every element finite, or the call refused the input (INVALID_ARGUMENT naming one of the
// arguments that made the logits overflow fp32).
void expect_finite_or_refused(qjlkv_status s, const std::vector<float> &out) {
  if (s == QJLKV_OK) {
    for (size_t i = 0; i < out.size(); ++i) ASSERT_TRUE(std::isfinite(out[i])) << "out[" << i << "] = " << out[i];
    return;
  }
  EXPECT_EQ(s, QJLKV_ERROR_INVALID_ARGUMENT) << describe(s);
  const std::string message = qjlkv_last_error_message();
  EXPECT_TRUE(names_identifier(message, "queries") || names_identifier(message, "scale")) << message;
}

// Finite queries and a finite scale whose logits overflow fp32: the joint softmax computed
// exp(inf - inf) = NaN and returned NaN outputs with QJLKV_OK.
class LogitOverflow : public ::testing::TestWithParam<const char *> {};

TEST_P(LogitOverflow, HugeFiniteQueryGivesFiniteOutputOrIsRefused) {
  const qjlkv_config cfg = small_config(GetParam());
  qjlkv_cache *c = nullptr;
  ASSERT_EQ(qjlkv_cache_create(&cfg, &c), QJLKV_OK);
  Cache cache(c);
  const uint32_t n = cfg.residual_tokens + 2 * cfg.block_tokens + 1;
  const size_t token_elems = size_t(cfg.num_kv_heads) * cfg.head_dim;
  std::vector<float> keys(n * token_elems, 1.0f), values(n * token_elems);
  for (size_t i = 0; i < values.size(); ++i) values[i] = float(i % 5) - 2.0f;
  QT_ASSERT_OK(qjlkv_cache_append(c, 0, 0, n, keys.data(), values.data()));
  const Snapshot before = snapshot(c, {{0, 0}});
  std::vector<float> query(size_t(cfg.num_q_heads) * cfg.head_dim, 3e38f), out(query.size());
  expect_finite_or_refused(qjlkv_cache_attend(c, 0, 0, 1, query.data(), 0.0f, out.data()), out);
  EXPECT_TRUE(snapshot(c, {{0, 0}}) == before);
}

TEST_P(LogitOverflow, HugeFiniteScaleGivesFiniteOutputOrIsRefused) {
  const qjlkv_config cfg = small_config(GetParam());
  qjlkv_cache *c = nullptr;
  ASSERT_EQ(qjlkv_cache_create(&cfg, &c), QJLKV_OK);
  Cache cache(c);
  const uint32_t n = cfg.residual_tokens + cfg.block_tokens + 2;
  QT_ASSERT_OK(append_tokens(c, cfg, 0, 0, n, 3));
  const std::vector<uint8_t> q = queries(cfg, 1, 4);
  std::vector<float> out(size_t(cfg.num_q_heads) * cfg.head_dim);
  expect_finite_or_refused(qjlkv_cache_attend(c, 0, 0, 1, q.data(), 3e38f, out.data()), out);
}

INSTANTIATE_TEST_SUITE_P(Presets, LogitOverflow, ::testing::Values("qjl", "kivi", "ott", "exact"));

// A finite query whose products with the keys overflow fp32 gave NaN scores (QJL: the projected
// query S·q holds +-inf of both signs; exact and KIVI: a running dot product of +inf meets a -inf
// product). scores reports raw logits, so +-inf is an honest result; NaN is not. Found by
// tests/fuzz/corpus/api/regression-scores-nan.
class ScoresOverflow : public ::testing::TestWithParam<const char *> {};

TEST_P(ScoresOverflow, HugeFiniteQueryGivesNoNaN) {
  const qjlkv_config cfg = small_config(GetParam());
  qjlkv_cache *c = nullptr;
  QT_ASSERT_OK(qjlkv_cache_create(&cfg, &c));
  Cache cache(c);
  const uint32_t n = cfg.residual_tokens + 2 * cfg.block_tokens + 1;
  const size_t token_elems = size_t(cfg.num_kv_heads) * cfg.head_dim;
  std::vector<float> keys(n * token_elems), values(n * token_elems, 0.5f);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = i % 3 == 0 ? -100.0f : 100.0f;
  QT_ASSERT_OK(qjlkv_cache_append(c, 0, 0, n, keys.data(), values.data()));
  const Snapshot before = snapshot(c, {{0, 0}});
  std::vector<float> query(size_t(cfg.num_q_heads) * cfg.head_dim);
  for (size_t i = 0; i < query.size(); ++i) query[i] = i % 2 ? -3e38f : 3e38f;
  std::vector<float> scores(size_t(cfg.num_q_heads) * n);
  const qjlkv_status s = qjlkv_cache_scores(c, 0, 0, query.data(), scores.data(), scores.size());
  if (s == QJLKV_OK) {
    for (size_t i = 0; i < scores.size(); ++i) ASSERT_FALSE(std::isnan(scores[i])) << "scores[" << i << "] is NaN";
  } else {
    EXPECT_EQ(s, QJLKV_ERROR_INVALID_ARGUMENT) << describe(s);
    EXPECT_TRUE(names_identifier(qjlkv_last_error_message(), "query")) << qjlkv_last_error_message();
  }
  EXPECT_TRUE(snapshot(c, {{0, 0}}) == before);
}

INSTANTIATE_TEST_SUITE_P(Presets, ScoresOverflow, ::testing::Values("qjl", "kivi", "ott", "exact"));

// bf16 values with 16-bit storage need not fit fp16, so values near the float maximum were
// accepted; attention sums weighted values before normalizing and returned +inf (40 tokens of
// value 2.99e38 with equal weights gave inf instead of 2.99e38). Such values are now refused
// (|x| <= 2^95 keeps a sum over 2^32 tokens finite), and values at that bound average exactly.
class ValuesNearFloatMax : public ::testing::Test {
 protected:
  static constexpr uint16_t kOne = 0x3f80;  // bf16 1.0
  qjlkv_config cfg = small_config("exact", QJLKV_DTYPE_BF16);
  uint32_t n = cfg.residual_tokens + 4 * cfg.block_tokens;
  size_t token_elems = size_t(cfg.num_kv_heads) * cfg.head_dim;
  std::vector<uint16_t> keys = std::vector<uint16_t>(n * token_elems, kOne);
};

TEST_F(ValuesNearFloatMax, Bf16ValuesBeyondTwoTo95AreRefused) {
  qjlkv_cache *c = nullptr;
  QT_ASSERT_OK(qjlkv_cache_create(&cfg, &c));
  Cache cache(c);
  std::vector<uint16_t> values(n * token_elems, 0x3f80);
  values[7] = 0x7f61;  // 2.99e38
  const Snapshot before = snapshot(c, {});
  const qjlkv_status appended = qjlkv_cache_append(c, 0, 0, n, keys.data(), values.data());
  EXPECT_EQ(appended, QJLKV_ERROR_INVALID_ARGUMENT) << describe(appended);
  EXPECT_TRUE(names_identifier(qjlkv_last_error_message(), "values")) << qjlkv_last_error_message();
  EXPECT_NE(std::string(qjlkv_last_error_message()).find("values[7]"), std::string::npos)
      << qjlkv_last_error_message();
  EXPECT_TRUE(snapshot(c, {}) == before);
}

TEST_F(ValuesNearFloatMax, Bf16ValuesAtTwoTo95AverageExactly) {
  qjlkv_cache *c = nullptr;
  QT_ASSERT_OK(qjlkv_cache_create(&cfg, &c));
  Cache cache(c);
  const uint16_t bound = 0x6f00;  // bf16 2^95
  std::vector<uint16_t> values(n * token_elems, bound);
  QT_ASSERT_OK(qjlkv_cache_append(c, 0, 0, n, keys.data(), values.data()));
  std::vector<uint16_t> query(size_t(cfg.num_q_heads) * cfg.head_dim, kOne), out(query.size());
  QT_ASSERT_OK(qjlkv_cache_attend(c, 0, 0, 1, query.data(), 0.0f, out.data()));
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], bound) << "out[" << i << "] is bf16 0x" << std::hex << out[i];
}

// A valid config could ask for terabytes of sketches (every QJL layer owns one) and spend hours
// generating them before the kernel killed the process; create now refuses it up front.
TEST(SketchMemory, ConfigNeedingMoreThanTheMachineFailsFast) {
  qjlkv_config cfg{};
  cfg.struct_size = sizeof cfg;
  QT_ASSERT_OK(qjlkv_config_init(&cfg, "qjl", 65536, 1, 1, 256));
  cfg.key_sketch_dim = 65536;  // 2 x 65536 layers x 65536 x 256 floats: 8 TiB
  QT_ASSERT_OK(qjlkv_config_validate(&cfg));
  qjlkv_cache *c = nullptr;
  const qjlkv_status s = qjlkv_cache_create(&cfg, &c);
  EXPECT_EQ(s, QJLKV_ERROR_OUT_OF_MEMORY) << describe(s);
  EXPECT_EQ(c, nullptr);
  EXPECT_NE(std::string(qjlkv_last_error_message()).find("sketches of 65536 layers"), std::string::npos)
      << qjlkv_last_error_message();
}

// Fields of another key method are ignored by validation (qjlkv_config_validate accepts any
// key_bits on a QJL cache), so they must not change anything either. src/cpu/isa.cpp
// kernel_scratch_floats() sized attend's scratch from key_bits for every key method: a QJL
// config with key_bits = 2753474462 (fuzz input tests/fuzz/corpus/config/
// regression-ignored-key-bits) made attend ask for terabytes and fail.
class IgnoredFields : public ::testing::TestWithParam<const char *> {};

TEST_P(IgnoredFields, DoNotChangeResults) {
  const qjlkv_config plain = small_config(GetParam());
  qjlkv_config odd = plain;
  if (plain.key_method != QJLKV_KEYS_KIVI && plain.key_method != QJLKV_KEYS_OTT) odd.key_bits = 2753474462u;
  if (plain.key_method != QJLKV_KEYS_OTT) {
    odd.outlier_tokens = UINT32_MAX;
    odd.outlier_spill_tokens = UINT32_MAX;
    odd.outlier_skip_layers = UINT32_MAX;
  }
  if (plain.key_method != QJLKV_KEYS_QJL) {
    odd.key_sketch_dim = 0xfffffff8u;
    odd.outlier_sketch_dim = 0xfffffff8u;
    odd.outlier_channels = UINT32_MAX;
    odd.initial_layers = UINT32_MAX;
    odd.initial_key_sketch_dim = 0xfffffff8u;
    odd.initial_outlier_sketch_dim = 0xfffffff8u;
  }
  const qjlkv_status valid = qjlkv_config_validate(&odd);
  ASSERT_EQ(valid, QJLKV_OK) << describe(valid);
  std::vector<Snapshot> results;
  for (const qjlkv_config &cfg : {plain, odd}) {
    qjlkv_cache *c = nullptr;
    qjlkv_status s = qjlkv_cache_create(&cfg, &c);
    ASSERT_EQ(s, QJLKV_OK) << "create: " << describe(s);
    Cache cache(c);
    s = append_tokens(c, cfg, 0, 1, cfg.residual_tokens + 2 * cfg.block_tokens + 3, 5);
    ASSERT_EQ(s, QJLKV_OK) << "append: " << describe(s);
    // The snapshot records statuses only; make a failing attend readable.
    const std::vector<uint8_t> q = queries(cfg, 1, 6);
    std::vector<uint8_t> out(q.size());
    s = qjlkv_cache_attend(c, 0, 1, 1, q.data(), 0.0f, out.data());
    EXPECT_EQ(s, QJLKV_OK) << "attend: " << describe(s);
    results.push_back(snapshot(c, {{0, 1}}));
  }
  EXPECT_TRUE(results[0] == results[1]) << "a field of another key method changed the results";
}

INSTANTIATE_TEST_SUITE_P(Presets, IgnoredFields, ::testing::Values("qjl", "kivi", "ott", "exact"));

// An empty sink store (no sink_tokens) or an empty tail (a sequence of sinks only) may own no
// buffer; attend and scores offset its null data() by the kv head's row (clang's UBSan:
// "applying non-zero offset 128 to null pointer" in src/cpu/cpu_backend.cpp, found by
// tools/fuzz.sh on the committed fuzz_api corpus). Kv head 1 of each: sinks absent, tail empty.
TEST(EmptyExactRows, AttendAndScoresOfEveryKvHead) {
  for (const char *preset : {"kivi", "q3"}) {
    SCOPED_TRACE(preset);
    const qjlkv_config cfg = small_config(preset);
    ASSERT_EQ(cfg.num_kv_heads, 2u);
    qjlkv_cache *c = nullptr;
    ASSERT_EQ(qjlkv_cache_create(&cfg, &c), QJLKV_OK);
    Cache cache(c);
    // kivi: 3 tokens in the tail, no sinks; q3: 3 of its 4 sinks, no tail.
    QT_ASSERT_OK(append_tokens(c, cfg, 0, 1, 3, 5));
    const std::vector<uint8_t> q = queries(cfg, 1, 6);
    std::vector<float> out(size_t(cfg.num_q_heads) * cfg.head_dim), scores(size_t(cfg.num_q_heads) * 3);
    QT_ASSERT_OK(qjlkv_cache_attend(c, 0, 1, 1, q.data(), 0.0f, out.data()));
    QT_ASSERT_OK(qjlkv_cache_scores(c, 0, 1, q.data(), scores.data(), scores.size()));
    for (float x : out) ASSERT_TRUE(std::isfinite(x));
    for (float x : scores) ASSERT_TRUE(std::isfinite(x));
  }
}

}  // namespace
}  // namespace qjlkv_test
