// Statistical guarantees of the QJL estimator (SPEC §3): unbiasedness with the right c_d over
// thousands of sketches, and Lemma 3.5's distortion bound. Seeds are fixed, so results are
// deterministic; each run prints its figures.
#include "testing.hpp"

namespace {

// Mean and standard error of per-seed means.
struct Moments {
  double sum = 0.0, sum2 = 0.0;
  size_t n = 0;
  void add(double x) {
    sum += x;
    sum2 += x * x;
    ++n;
  }
  double mean() const { return sum / n; }
  double standard_error() const { return std::sqrt((sum2 / n - mean() * mean()) / (n - 1)); }
};

// E_S[est(q,k)] = <q,k> (Lemma 3.2). Over many seeds, the mean relative error of est is within
// 4 standard errors of 0; the same samples rescaled to c_d = sqrt(pi/2) (the Gaussian constant,
// wrong for orthogonal rows) must be rejected, so the test can tell the two constants apart.
// Each seed is one small cache holding one block of 32 tokens; the standard error comes from the
// per-seed means, so tokens sharing a sketch need not be independent.
void check_unbiased(uint32_t d, uint32_t m, bool outliers, uint32_t seeds) {
  SCOPED_TRACE("d=" + std::to_string(d) + " m=" + std::to_string(m) + (outliers ? " with outliers" : ""));
  const uint32_t tokens = 32;
  Moments parallel, random;
  for (uint32_t seed = 0; seed < seeds; ++seed) {
    qjlkv_config cfg = qt::make_config("qjl", 1, 1, 1, d);
    cfg.seed = 1000003ull * seed + d;
    cfg.block_tokens = tokens;
    cfg.residual_tokens = 0;
    cfg.key_sketch_dim = m;
    cfg.outlier_channels = outliers ? 4 : 0;
    cfg.outlier_sketch_dim = outliers ? m : 0;
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    qt::Rng rng(seed * 7919ull + d + (outliers ? 1 : 0));
    std::vector<float> keys = rng.normals(size_t(tokens) * d), values = rng.normals(size_t(tokens) * d);
    if (outliers) qt::amplify_channels(keys, d, {1, 5, 9, 13}, 4.0f);
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, tokens, keys.data(), values.data()));
    std::vector<float> scores(tokens);
    double parallel_sum = 0.0, random_sum = 0.0;
    for (uint32_t t = 0; t < tokens; ++t) {  // q = k: where a wrong constant shows most
      const float *k = &keys[size_t(t) * d];
      QT_ASSERT_OK(qjlkv_cache_scores(cache.get(), 0, 0, k, scores.data(), scores.size()));
      const double kk = qt::dot(k, k, d);
      parallel_sum += (scores[t] - kk) / kk;
    }
    const std::vector<float> q = rng.normals(d);
    QT_ASSERT_OK(qjlkv_cache_scores(cache.get(), 0, 0, q.data(), scores.data(), scores.size()));
    for (uint32_t t = 0; t < tokens; ++t) {
      const float *k = &keys[size_t(t) * d];
      random_sum += (scores[t] - qt::dot(q.data(), k, d)) / (qt::norm(q.data(), d) * qt::norm(k, d));
    }
    parallel.add(parallel_sum / tokens);
    random.add(random_sum / tokens);
  }
  const double wrong = std::sqrt(std::numbers::pi / 2.0) / qt::qjl_constant(d, true);
  const double wrong_mean = (1.0 + parallel.mean()) * wrong - 1.0, wrong_se = wrong * parallel.standard_error();
  std::printf("[ bias     ] d=%u m=%u %s, %u seeds: q=k mean %.2e (SE %.2e), random q mean %.2e (SE %.2e); "
              "with sqrt(pi/2): %.2e = %.1f SE\n",
              d, m, outliers ? "outliers" : "clean", seeds, parallel.mean(), parallel.standard_error(),
              random.mean(), random.standard_error(), wrong_mean, std::abs(wrong_mean) / wrong_se);
  EXPECT_LE(std::abs(parallel.mean()), 4.0 * parallel.standard_error()) << "biased for q = k";
  EXPECT_LE(std::abs(random.mean()), 4.0 * random.standard_error()) << "biased for random q";
  EXPECT_GT(std::abs(wrong_mean), 4.0 * wrong_se) << "too few samples to tell c_d from sqrt(pi/2)";
}

// Full orthogonal blocks: two for d = 64, one for d = 128 (a partial block triples the standard
// error for q = k and leaves too thin a margin against sqrt(pi/2)).
TEST(Estimator, UnbiasedD64) { check_unbiased(64, 128, false, 2000); }
TEST(Estimator, UnbiasedD128) { check_unbiased(128, 128, false, 2000); }
TEST(Estimator, UnbiasedWithOutliersD64) { check_unbiased(64, 128, true, 2000); }
TEST(Estimator, UnbiasedWithOutliersD128) { check_unbiased(128, 128, true, 2000); }

// Lemma 3.5: with m >= (4/3)(1+eps)/eps^2 · log(2/delta) rows,
// P(|est - <q,k>| > eps·|q|·|k|) <= delta. Orthogonal rows must do at least as well.
TEST(Estimator, DistortionWithinLemma35) {
  const double eps = 0.25, delta = 0.05;
  const uint32_t d = 64;
  const uint32_t m_min = uint32_t(std::ceil(4.0 / 3.0 * (1.0 + eps) / (eps * eps) * std::log(2.0 / delta)));
  const uint32_t m = (m_min + 7) / 8 * 8;
  const uint32_t heads = 8, tokens = 8, seeds = 150;
  double parallel_mse[2] = {0.0, 0.0};
  for (uint32_t flags : {0u, QJLKV_SKETCH_ORTHOGONAL}) {
    size_t pairs = 0, beyond = 0;
    for (uint32_t seed = 0; seed < seeds; ++seed) {
      qjlkv_config cfg = qt::make_config("qjl", 1, heads, 1, d);
      cfg.seed = seed + 77;
      cfg.sketch_flags = flags;
      cfg.key_sketch_dim = m;
      cfg.outlier_channels = 0;
      cfg.outlier_sketch_dim = 0;
      cfg.block_tokens = tokens;
      cfg.residual_tokens = 0;
      qt::Cache cache = qt::make_cache(cfg);
      ASSERT_TRUE(cache);
      qt::Rng rng(seed);
      const std::vector<float> keys = rng.normals(size_t(tokens) * d), values = rng.normals(keys.size());
      QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, tokens, keys.data(), values.data()));
      std::vector<float> q = rng.normals(size_t(heads) * d);
      std::copy(keys.begin(), keys.begin() + d, q.begin());  // head 0 asks q = k_0
      std::vector<float> scores(size_t(heads) * tokens);
      QT_ASSERT_OK(qjlkv_cache_scores(cache.get(), 0, 0, q.data(), scores.data(), scores.size()));
      for (uint32_t h = 0; h < heads; ++h)
        for (uint32_t t = 0; t < tokens; ++t) {
          const float *qh = &q[size_t(h) * d], *k = &keys[size_t(t) * d];
          const double rel = (scores[h * tokens + t] - qt::dot(qh, k, d)) / (qt::norm(qh, d) * qt::norm(k, d));
          ++pairs;
          beyond += std::abs(rel) > eps;
          if (h == 0 && t == 0) parallel_mse[flags] += rel * rel / seeds;
        }
    }
    const double fraction = double(beyond) / pairs;
    std::printf("[ distort  ] %s m=%u: P(|err| > %.2f|q||k|) = %.4f over %zu pairs (delta %.2f)\n",
                flags ? "orthogonal" : "gaussian", m, eps, fraction, pairs, delta);
    EXPECT_LE(fraction, delta) << (flags ? "orthogonal" : "gaussian");
  }
  EXPECT_LT(parallel_mse[1], parallel_mse[0]) << "orthogonal rows must lower the variance for q = k";
}

}  // namespace
