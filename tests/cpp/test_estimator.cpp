// The QJL score estimator (SPEC §3): the library's scores and dense reconstruction against the
// formula computed here from the sketch the cache reports. Statistics: test_statistics.cpp.
#include "testing.hpp"

namespace {

struct FormulaCase {
  const char *name;
  uint32_t layers, hq, hkv, d;
  uint32_t m, c, m_out, flags;
  uint32_t block, residual, tokens;
  uint32_t initial_layers = 0, initial_m = 0, initial_m_out = 0;
};

void check_formula(const FormulaCase &k) {
  SCOPED_TRACE(k.name);
  qjlkv_config cfg = qt::make_config("qjl", k.layers, k.hq, k.hkv, k.d);
  cfg.seed = 2024;
  cfg.key_sketch_dim = k.m;
  cfg.outlier_channels = k.c;
  cfg.outlier_sketch_dim = k.m_out;
  cfg.sketch_flags = k.flags;
  cfg.block_tokens = k.block;
  cfg.residual_tokens = k.residual;
  cfg.initial_layers = k.initial_layers;
  if (k.initial_layers) {
    cfg.initial_key_sketch_dim = k.initial_m;
    cfg.initial_outlier_sketch_dim = k.initial_m_out;
  }
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  qt::Rng rng(k.d * 31 + k.m);
  size_t compared = 0, used_slack = 0, skipped = 0;
  double worst = 0.0;
  for (uint32_t layer = 0; layer < k.layers; ++layer) {
    qt::QjlLayer sketch;
    ASSERT_NO_FATAL_FAILURE(qt::load_qjl_layer(cache.get(), layer, &sketch));
    qt::ReferenceSequence ref(cfg, &sketch);
    // Appended in uneven chunks; a few channels carry large magnitudes, as in real keys.
    for (uint32_t done = 0; done < k.tokens;) {
      const uint32_t n = std::min(k.tokens - done, 1 + rng.below(40));
      std::vector<float> keys = rng.normals(size_t(n) * k.hkv * k.d), values = rng.normals(keys.size());
      qt::amplify_channels(keys, k.d, {2, 7, 11, uint32_t(k.d - 1)}, 6.0f);
      QT_ASSERT_OK(qjlkv_cache_append(cache.get(), layer, 5, n, keys.data(), values.data()));
      ref.append(keys, values);
      done += n;
    }
    ASSERT_GT(ref.quantized(), 0u) << "the case must quantize tokens";
    for (int trial = 0; trial < 3; ++trial) {
      std::vector<float> q = rng.normals(size_t(k.hq) * k.d);
      if (trial == 2) qt::amplify_channels(q, k.d, {2, 7}, 4.0f);
      std::vector<float> lib;
      ASSERT_NO_FATAL_FAILURE(qt::library_scores(cache.get(), layer, 5, qt::encode(q, QJLKV_DTYPE_F32), &lib));
      const qt::ScoreCheck r = qt::check_scores(lib, ref.scores(q.data()), qt::kScoreRelTol, k.name);
      compared += r.compared;
      used_slack += r.used_slack;
      skipped += r.skipped;
      worst = std::max(worst, r.max_rel_error);
    }
  }
  EXPECT_LE(used_slack, compared / 100) << "sign bits of near-zero projections may differ, but rarely";
  EXPECT_LE(skipped, compared / 20) << "outlier channel near-ties";
  ::testing::Test::RecordProperty(std::string(k.name) + "_max_rel_error", std::to_string(worst));
  std::printf("[ formula  ] %s: %zu scores, max |lib - ref| / (|q||k|) = %.3g, %zu within sign slack\n", k.name,
              compared, worst, used_slack);
}

TEST(Estimator, ScoresFollowTheFormulaWithOutliers) {
  check_formula({"d64_gqa2_outliers", 1, 4, 2, 64, 128, 8, 32, QJLKV_SKETCH_ORTHOGONAL, 32, 32, 130});
}
TEST(Estimator, ScoresFollowTheFormulaGaussianSketch) {
  check_formula({"d64_gaussian", 1, 2, 1, 64, 96, 4, 24, 0, 32, 32, 100});
}
TEST(Estimator, ScoresFollowTheFormulaWithoutOutliers) {
  check_formula({"d96_no_outliers", 1, 3, 3, 96, 136, 0, 0, QJLKV_SKETCH_ORTHOGONAL, 16, 8, 80});
}
TEST(Estimator, ScoresFollowTheFormulaOutlierSketchLongerThanMain) {
  check_formula({"d64_mout_gt_m", 1, 1, 1, 64, 32, 6, 96, QJLKV_SKETCH_ORTHOGONAL, 8, 0, 40});
}
TEST(Estimator, ScoresFollowTheFormulaDefaultPresetD128) {
  check_formula({"d128_preset", 1, 8, 2, 128, 256, 8, 64, QJLKV_SKETCH_ORTHOGONAL, 32, 32, 96});
}
TEST(Estimator, ScoresFollowTheFormulaInitialLayers) {
  check_formula({"initial_layers", 2, 2, 2, 64, 64, 8, 16, QJLKV_SKETCH_ORTHOGONAL, 32, 32, 70, 1, 192, 64});
}

// qjlkv_cache_reconstruct returns the dense k̂ of SPEC §3 (whose dot product with a query is the
// score attention uses) and the dequantized values; exact keys and values in the tail.
TEST(Estimator, ReconstructionIsTheDenseForm) {
  const uint32_t hq = 4, hkv = 2, d = 64, tokens = 130;
  qjlkv_config cfg = qt::make_config("qjl", 1, hq, hkv, d);
  cfg.seed = 5;
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  qt::QjlLayer sketch;
  ASSERT_NO_FATAL_FAILURE(qt::load_qjl_layer(cache.get(), 0, &sketch));
  qt::ReferenceSequence ref(cfg, &sketch);
  qt::Rng rng(12);
  for (uint32_t done = 0; done < tokens;) {
    const uint32_t n = std::min(tokens - done, 1 + rng.below(45));
    std::vector<float> keys = rng.normals(size_t(n) * hkv * d), values = rng.normals(keys.size());
    qt::amplify_channels(keys, d, {3, 30}, 8.0f);
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, n, keys.data(), values.data()));
    ref.append(keys, values);
    done += n;
  }
  const size_t row = size_t(hkv) * d;
  std::vector<float> k_hat(tokens * row, NAN), v_hat(tokens * row, NAN);
  QT_ASSERT_OK(qjlkv_cache_reconstruct(cache.get(), 0, 0, 0, tokens, k_hat.data(), v_hat.data()));
  size_t ambiguous_mismatches = 0, compared = 0;
  for (uint64_t t = 0; t < tokens; ++t)
    for (uint32_t kv = 0; kv < hkv; ++kv) {
      bool ambiguous = false;
      std::vector<double> stored;
      const std::vector<double> want = ref.key_hat(t, kv, &ambiguous, &stored);
      const float *got = &k_hat[t * row + kv * d];
      double want_norm = 0.0, err = 0.0;  // err: beyond what the fp16 corrections may add
      for (uint32_t j = 0; j < d; ++j) want_norm += want[j] * want[j];
      for (uint32_t j = 0; j < d; ++j)
        err = std::max(err, std::abs(got[j] - want[j]) - (stored.empty() ? 0.0 : stored[j]));
      ++compared;
      if (t >= ref.quantized()) {
        EXPECT_EQ(0, std::memcmp(got, ref.key(t, kv), d * sizeof(float))) << "tail key " << t << " must be exact";
      } else if (err > 1e-5 * std::sqrt(want_norm)) {
        if (ambiguous) {
          ++ambiguous_mismatches;
        } else {
          ADD_FAILURE() << "position " << t << " kv head " << kv << ": k_hat off by " << err;
        }
      }
      const float *v_got = &v_hat[t * row + kv * d], *v_want = ref.value_used(t, kv);
      for (uint32_t j = 0; j < d; ++j)
        ASSERT_EQ(v_got[j], v_want[j]) << "value at position " << t << " kv head " << kv << " channel " << j;
    }
  EXPECT_LE(ambiguous_mismatches, compared / 100);
  // <q, k_hat> is the score the cache reports.
  const std::vector<float> q = rng.normals(size_t(hq) * d);
  std::vector<float> lib;
  ASSERT_NO_FATAL_FAILURE(qt::library_scores(cache.get(), 0, 0, qt::encode(q, QJLKV_DTYPE_F32), &lib));
  for (uint32_t h = 0; h < hq; ++h)
    for (uint64_t t = 0; t < tokens; ++t) {
      const float *qh = &q[h * d], *kh = &k_hat[t * row + (h / (hq / hkv)) * d];
      EXPECT_NEAR(lib[h * tokens + t], qt::dot(qh, kh, d), qt::kScoreRelTol * qt::norm(qh, d) * qt::norm(kh, d))
          << "head " << h << " position " << t;
    }
  // A sub-range, and one output alone, give the same numbers.
  std::vector<float> part_k(50 * row), part_v(50 * row);
  QT_ASSERT_OK(qjlkv_cache_reconstruct(cache.get(), 0, 0, 20, 50, part_k.data(), nullptr));
  QT_ASSERT_OK(qjlkv_cache_reconstruct(cache.get(), 0, 0, 20, 50, nullptr, part_v.data()));
  EXPECT_EQ(0, std::memcmp(part_k.data(), &k_hat[20 * row], part_k.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(part_v.data(), &v_hat[20 * row], part_v.size() * sizeof(float)));
}

}  // namespace
