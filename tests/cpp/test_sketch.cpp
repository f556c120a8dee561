// The QJL sketch (SPEC §2): orthonormal blocks of d rows scaled to sqrt(d), a Gaussian option,
// determinism by seed, and the per-layer sketches of a cache.
#include "testing.hpp"

namespace {

std::vector<float> sketch_matrix(uint32_t d, uint32_t m, uint64_t seed, uint32_t flags) {
  qjlkv_sketch *raw = nullptr;
  const qjlkv_status s = qjlkv_sketch_create(d, m, seed, flags, &raw);
  EXPECT_EQ(s, QJLKV_OK) << qt::describe(s);
  qt::Sketch sketch(raw);
  if (!sketch) return {};
  uint32_t rows = 0, cols = 0;
  EXPECT_EQ(qjlkv_sketch_shape(sketch.get(), &rows, &cols), QJLKV_OK);
  EXPECT_EQ(rows, m);
  EXPECT_EQ(cols, d);
  std::vector<float> matrix(size_t(m) * d, NAN);
  EXPECT_EQ(qjlkv_sketch_matrix(sketch.get(), matrix.data(), matrix.size()), QJLKV_OK);
  return matrix;
}

double row_dot(const std::vector<float> &S, uint32_t d, uint32_t i, uint32_t j) {
  return qt::dot(&S[size_t(i) * d], &S[size_t(j) * d], d);
}

TEST(Sketch, RowsAreOrthonormalWithinEachBlockOfDRows) {
  const std::vector<std::pair<uint32_t, uint32_t>> shapes = {{64, 64},  {64, 200}, {128, 256}, {80, 40},
                                                             {8, 8},    {96, 104}, {256, 520}, {1000, 16}};
  for (auto [d, m] : shapes) {
    SCOPED_TRACE("d=" + std::to_string(d) + " m=" + std::to_string(m));
    const std::vector<float> S = sketch_matrix(d, m, 42, QJLKV_SKETCH_ORTHOGONAL);
    ASSERT_EQ(S.size(), size_t(m) * d);
    double worst = 0.0;
    for (uint32_t first = 0; first < m; first += d) {
      const uint32_t last = std::min(m, first + d);
      for (uint32_t i = first; i < last; ++i)
        for (uint32_t j = first; j <= i; ++j)
          worst = std::max(worst, std::abs(row_dot(S, d, i, j) / d - (i == j ? 1.0 : 0.0)));
    }
    EXPECT_LE(worst, 1e-6) << "max |S_i·S_j/d - delta_ij| within a block";
    if (m > d && d >= 64) {
      // Different blocks are independent draws, not orthogonal to each other.
      double cross = 0.0;
      for (uint32_t i = 0; i < 8; ++i) cross = std::max(cross, std::abs(row_dot(S, d, i, d + i)) / d);
      EXPECT_GT(cross, 1e-3);
    }
  }
}

TEST(Sketch, SameSeedGivesSameBytes) {
  for (uint32_t flags : {0u, QJLKV_SKETCH_ORTHOGONAL}) {
    const std::vector<float> a = sketch_matrix(96, 200, 12345, flags), b = sketch_matrix(96, 200, 12345, flags);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "flags " << flags;
  }
}

TEST(Sketch, OtherSeedGivesOtherMatrix) {
  for (uint32_t flags : {0u, QJLKV_SKETCH_ORTHOGONAL}) {
    const std::vector<float> base = sketch_matrix(64, 128, 1, flags);
    // Seeds that differ in the low word, and in the high word only.
    for (uint64_t other : {uint64_t(2), uint64_t(1) | (uint64_t(1) << 32)}) {
      const std::vector<float> s = sketch_matrix(64, 128, other, flags);
      size_t same = 0;
      for (size_t i = 0; i < s.size(); ++i) same += s[i] == base[i];
      EXPECT_LT(same, s.size() / 100) << "seed " << other << " flags " << flags;
    }
  }
}

TEST(Sketch, GaussianOptionIsNotOrthogonalNorNormalized) {
  const uint32_t d = 64, m = 256;
  const std::vector<float> S = sketch_matrix(d, m, 7, 0);
  ASSERT_EQ(S.size(), size_t(m) * d);
  double worst_off = 0.0, worst_norm = 0.0;
  for (uint32_t i = 0; i < d; ++i) {
    worst_norm = std::max(worst_norm, std::abs(row_dot(S, d, i, i) / d - 1.0));
    for (uint32_t j = 0; j < i; ++j) worst_off = std::max(worst_off, std::abs(row_dot(S, d, i, j)) / d);
  }
  EXPECT_GT(worst_off, 0.1) << "Gaussian rows are not orthogonal";
  EXPECT_GT(worst_norm, 0.1) << "Gaussian rows are not scaled to norm sqrt(d)";
  // The entries are standard normal.
  double sum = 0.0, sum2 = 0.0, sum4 = 0.0;
  size_t beyond_two = 0;
  for (float x : S) {
    sum += x;
    sum2 += double(x) * x;
    sum4 += double(x) * x * x * x;
    beyond_two += std::abs(x) > 2.0f;
  }
  const double n = double(S.size());
  EXPECT_NEAR(sum / n, 0.0, 0.04);
  EXPECT_NEAR(sum2 / n, 1.0, 0.05);
  EXPECT_NEAR(sum4 / n, 3.0, 0.25);
  EXPECT_NEAR(beyond_two / n, 0.0455, 0.008);
}

// With the same seed, the orthogonal sketch is the Q of a Householder QR of the Gaussian draws
// (each block's rows = Qᵀ with diag(R) > 0): Gaussian row i = sum_{j<=i} R[j][i] Q_j.
TEST(Sketch, OrthogonalBlocksAreTheQrOfTheGaussianDraws) {
  const uint32_t d = 32, m = 80;  // blocks of 32, 32 and 16 rows
  const std::vector<float> G = sketch_matrix(d, m, 99, 0), Q = sketch_matrix(d, m, 99, QJLKV_SKETCH_ORTHOGONAL);
  ASSERT_EQ(G.size(), Q.size());
  const double root_d = std::sqrt(double(d));
  for (uint32_t first = 0; first < m; first += d) {
    const uint32_t r = std::min(d, m - first);
    for (uint32_t i = 0; i < r; ++i) {
      const float *g = &G[size_t(first + i) * d];
      const double g_norm = qt::norm(g, d);
      std::vector<double> rebuilt(d, 0.0);
      for (uint32_t j = 0; j < r; ++j) {
        const float *q = &Q[size_t(first + j) * d];
        const double coeff = qt::dot(g, q, d) / root_d;  // R[j][i] with Q_j = q / sqrt(d)
        if (j > i) {
          EXPECT_LE(std::abs(coeff), 1e-5 * g_norm) << "block " << first / d << " R is not triangular";
        }
        if (j == i) {
          EXPECT_GT(coeff, 0.0) << "block " << first / d << " row " << i << ": diag(R) must be > 0";
        }
        if (j <= i)
          for (uint32_t c = 0; c < d; ++c) rebuilt[c] += coeff * q[c] / root_d;
      }
      double err = 0.0;
      for (uint32_t c = 0; c < d; ++c) err = std::max(err, std::abs(rebuilt[c] - g[c]));
      EXPECT_LE(err, 1e-5 * g_norm) << "block " << first / d << " row " << i;
    }
  }
}

// Entry (i, j) is draw i*d + j of the stream (DESIGN.md): a Gaussian sketch with fewer rows is a
// prefix of one with more, as are whole orthogonal blocks.
TEST(Sketch, RowsArePrefixesOfLongerSketches) {
  const std::vector<float> short_g = sketch_matrix(48, 40, 5, 0), long_g = sketch_matrix(48, 200, 5, 0);
  EXPECT_EQ(0, std::memcmp(short_g.data(), long_g.data(), short_g.size() * sizeof(float)));
  const std::vector<float> one_block = sketch_matrix(48, 48, 5, QJLKV_SKETCH_ORTHOGONAL),
                           three_blocks = sketch_matrix(48, 144, 5, QJLKV_SKETCH_ORTHOGONAL);
  EXPECT_EQ(0, std::memcmp(one_block.data(), three_blocks.data(), one_block.size() * sizeof(float)));
}

std::vector<float> cache_layer_sketch(const qjlkv_cache *cache, uint32_t layer, uint32_t expected_rows,
                                      uint32_t d) {
  const qjlkv_sketch *s = nullptr;
  EXPECT_EQ(qjlkv_cache_sketch(cache, layer, &s), QJLKV_OK);
  if (!s) return {};
  uint32_t rows = 0, cols = 0;
  EXPECT_EQ(qjlkv_sketch_shape(s, &rows, &cols), QJLKV_OK);
  EXPECT_EQ(rows, expected_rows) << "layer " << layer;
  EXPECT_EQ(cols, d);
  std::vector<float> matrix(size_t(rows) * cols);
  EXPECT_EQ(qjlkv_sketch_matrix(s, matrix.data(), matrix.size()), QJLKV_OK);
  return matrix;
}

TEST(Sketch, CacheLayerZeroUsesTheStandaloneSketch) {
  struct Case {
    uint32_t d, m, m_out, c, flags;
  };
  for (const Case k : {Case{64, 128, 32, 8, QJLKV_SKETCH_ORTHOGONAL}, Case{64, 32, 96, 4, QJLKV_SKETCH_ORTHOGONAL},
                       Case{80, 160, 40, 8, 0}, Case{128, 256, 0, 0, QJLKV_SKETCH_ORTHOGONAL}}) {
    SCOPED_TRACE("d=" + std::to_string(k.d) + " m=" + std::to_string(k.m) + " m_out=" + std::to_string(k.m_out));
    qjlkv_config cfg = qt::make_config("qjl", 2, 2, 1, k.d);
    cfg.seed = 0xfeedbeefcafeull;
    cfg.sketch_flags = k.flags;
    cfg.key_sketch_dim = k.m;
    cfg.outlier_sketch_dim = k.m_out;
    cfg.outlier_channels = k.c;
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    const uint32_t rows = std::max(k.m, k.m_out);
    const std::vector<float> standalone = sketch_matrix(k.d, rows, cfg.seed, k.flags);
    const std::vector<float> layer0 = cache_layer_sketch(cache.get(), 0, rows, k.d);
    const std::vector<float> layer1 = cache_layer_sketch(cache.get(), 1, rows, k.d);
    ASSERT_EQ(layer0.size(), standalone.size());
    ASSERT_EQ(layer1.size(), standalone.size());
    EXPECT_EQ(0, std::memcmp(layer0.data(), standalone.data(), layer0.size() * sizeof(float)))
        << "layer 0 must be byte for byte qjlkv_sketch_create(d, max(m, m_out), seed, flags)";
    EXPECT_NE(0, std::memcmp(layer1.data(), standalone.data(), layer1.size() * sizeof(float)))
        << "layer 1 uses its own stream";
    // Another cache with the same seed has the same layer sketches.
    qt::Cache twin = qt::make_cache(cfg);
    ASSERT_TRUE(twin);
    const std::vector<float> twin1 = cache_layer_sketch(twin.get(), 1, rows, k.d);
    EXPECT_EQ(0, std::memcmp(layer1.data(), twin1.data(), layer1.size() * sizeof(float)));
  }
}

TEST(Sketch, InitialLayersUseTheirOwnSizes) {
  qjlkv_config cfg = qt::make_config("qjl", 3, 1, 1, 64);
  cfg.initial_layers = 2;
  cfg.initial_key_sketch_dim = 256;
  cfg.initial_outlier_sketch_dim = 64;
  cfg.key_sketch_dim = 96;
  cfg.outlier_sketch_dim = 24;
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  const std::vector<float> layer0 = cache_layer_sketch(cache.get(), 0, 256, 64);
  cache_layer_sketch(cache.get(), 1, 256, 64);
  cache_layer_sketch(cache.get(), 2, 96, 64);
  const std::vector<float> standalone = sketch_matrix(64, 256, cfg.seed, cfg.sketch_flags);
  ASSERT_EQ(layer0.size(), standalone.size());
  EXPECT_EQ(0, std::memcmp(layer0.data(), standalone.data(), layer0.size() * sizeof(float)));
}

TEST(Sketch, CacheLendsOneSketchPerLayer) {
  qt::Cache cache = qt::make_cache(qt::make_config("qjl", 1, 1, 1, 64));
  ASSERT_TRUE(cache);
  const qjlkv_sketch *a = nullptr, *b = nullptr;
  QT_ASSERT_OK(qjlkv_cache_sketch(cache.get(), 0, &a));
  QT_ASSERT_OK(qjlkv_cache_sketch(cache.get(), 0, &b));
  EXPECT_EQ(a, b) << "the cache lends the one sketch it uses";
}

}  // namespace
