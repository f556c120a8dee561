// Linked against the shared libqjlkv: the exported C API is complete enough to run a cache, and
// the library found at run time matches the header it was compiled with.
#include <cstdio>

#include "testing.hpp"

namespace {

TEST(SharedLibrary, VersionMatchesHeader) {
  EXPECT_EQ(qjlkv_version_number(), unsigned(QJLKV_VERSION_NUMBER));
  char expected[64];
  std::snprintf(expected, sizeof expected, "%d.%d.%d", QJLKV_VERSION_MAJOR, QJLKV_VERSION_MINOR,
                QJLKV_VERSION_PATCH);
  EXPECT_STREQ(qjlkv_version_string(), expected);
}

TEST(SharedLibrary, RunsACacheThroughTheExportedApi) {
  qjlkv_config cfg = qt::make_config("qjl", 1, 4, 2, 64);
  QT_ASSERT_OK(qjlkv_config_validate(&cfg));
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  QT_ASSERT_OK(qjlkv_cache_set_stream(cache.get(), nullptr));
  qt::Rng rng(1);
  const std::vector<float> k = rng.normals(100 * 2 * 64), v = rng.normals(k.size()), q = rng.normals(4 * 64);
  QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 0, 100, k.data(), v.data()));
  const uint32_t seqs[1] = {0};
  QT_ASSERT_OK(qjlkv_cache_append_batch(cache.get(), 0, 1, seqs, k.data(), v.data()));
  std::vector<float> out(q.size()), scores(4 * 101);
  QT_ASSERT_OK(qjlkv_cache_attend(cache.get(), 0, 0, 1, q.data(), 0.0f, out.data()));
  QT_ASSERT_OK(qjlkv_cache_attend_batch(cache.get(), 0, 1, seqs, q.data(), 0.0f, out.data()));
  QT_ASSERT_OK(qjlkv_cache_scores(cache.get(), 0, 0, q.data(), scores.data(), scores.size()));
  EXPECT_EQ(qt::length_of(cache.get(), 0, 0), 101u);
  const qjlkv_sketch *sketch = nullptr;
  QT_ASSERT_OK(qjlkv_cache_sketch(cache.get(), 0, &sketch));
  uint32_t rows = 0, cols = 0;
  QT_ASSERT_OK(qjlkv_sketch_shape(sketch, &rows, &cols));
  EXPECT_EQ(rows, 128u);
  EXPECT_GT(qt::stats_of(cache.get()).bytes_used, 0u);
  QT_ASSERT_OK(qjlkv_cache_clear_sequence(cache.get(), 0));
  EXPECT_EQ(qt::length_of(cache.get(), 0, 0), 0u);
  EXPECT_STREQ(qjlkv_status_string(QJLKV_OK), "QJLKV_OK");
}

}  // namespace
