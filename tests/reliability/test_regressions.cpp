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
  RELIABILITY_ASSERT_OK(qjlkv_cache_append(c, 0, 0, n, keys.data(), values.data()));
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
  RELIABILITY_ASSERT_OK(append_tokens(c, cfg, 0, 0, n, 3));
  const std::vector<uint8_t> q = queries(cfg, 1, 4);
  std::vector<float> out(size_t(cfg.num_q_heads) * cfg.head_dim);
  expect_finite_or_refused(qjlkv_cache_attend(c, 0, 0, 1, q.data(), 3e38f, out.data()), out);
}

INSTANTIATE_TEST_SUITE_P(Presets, LogitOverflow, ::testing::Values("qjl", "kivi", "ott", "exact"));

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

}  // namespace
}  // namespace qjlkv_test
