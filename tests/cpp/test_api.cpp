// Versions, statuses and messages, presets and configs, handles, streams and devices.
#include <cstdio>
#include <string>
#include <thread>

#include "testing.hpp"

namespace {

TEST(Version, RuntimeMatchesHeader) {
  EXPECT_EQ(qjlkv_version_number(), unsigned(QJLKV_VERSION_NUMBER));
  EXPECT_EQ(QJLKV_VERSION_NUMBER, QJLKV_VERSION_MAJOR * 10000 + QJLKV_VERSION_MINOR * 100 + QJLKV_VERSION_PATCH);
  char expected[64];
  std::snprintf(expected, sizeof expected, "%d.%d.%d", QJLKV_VERSION_MAJOR, QJLKV_VERSION_MINOR,
                QJLKV_VERSION_PATCH);
  ASSERT_NE(qjlkv_version_string(), nullptr);
  EXPECT_STREQ(qjlkv_version_string(), expected);
  EXPECT_EQ(qjlkv_version_string(), qjlkv_version_string()) << "a static string";
}

TEST(Status, NamesEveryStatus) {
  EXPECT_EQ(QJLKV_OK, 0);
  EXPECT_STREQ(qjlkv_status_string(QJLKV_OK), "QJLKV_OK");
  EXPECT_STREQ(qjlkv_status_string(QJLKV_ERROR_INVALID_ARGUMENT), "QJLKV_ERROR_INVALID_ARGUMENT");
  EXPECT_STREQ(qjlkv_status_string(QJLKV_ERROR_OUT_OF_MEMORY), "QJLKV_ERROR_OUT_OF_MEMORY");
  EXPECT_STREQ(qjlkv_status_string(QJLKV_ERROR_UNSUPPORTED), "QJLKV_ERROR_UNSUPPORTED");
  EXPECT_STREQ(qjlkv_status_string(QJLKV_ERROR_DEVICE), "QJLKV_ERROR_DEVICE");
  EXPECT_STREQ(qjlkv_status_string(QJLKV_ERROR_CORRUPT_DATA), "QJLKV_ERROR_CORRUPT_DATA");
  EXPECT_STREQ(qjlkv_status_string(QJLKV_ERROR_INTERNAL), "QJLKV_ERROR_INTERNAL");
  EXPECT_STREQ(qjlkv_status_string(static_cast<qjlkv_status>(999)), "unknown status");
  EXPECT_STREQ(qjlkv_status_string(static_cast<qjlkv_status>(-1)), "unknown status");
}

TEST(Status, LastErrorIsThreadLocalAndSticky) {
  std::string fresh_thread_message = "not run";
  std::thread([&] { fresh_thread_message = qjlkv_last_error_message(); }).join();
  EXPECT_EQ(fresh_thread_message, "") << "a thread that saw no failure has an empty message";

  qjlkv_sketch *s = nullptr;
  ASSERT_EQ(qjlkv_sketch_create(0, 64, 0, 0, &s), QJLKV_ERROR_INVALID_ARGUMENT);
  const std::string mine = qjlkv_last_error_message();
  EXPECT_TRUE(qt::names_identifier(mine, "head_dim")) << mine;

  std::thread([] {
    qjlkv_sketch *t = nullptr;
    EXPECT_EQ(qjlkv_sketch_create(64, 12, 0, 0, &t), QJLKV_ERROR_INVALID_ARGUMENT);
    EXPECT_TRUE(qt::names_identifier(qjlkv_last_error_message(), "sketch_dim"));
  }).join();
  EXPECT_EQ(mine, qjlkv_last_error_message()) << "another thread's failure must not change this thread's message";

  QT_ASSERT_OK(qjlkv_sketch_create(64, 64, 0, 0, &s));
  qjlkv_sketch_destroy(s);
  EXPECT_EQ(mine, qjlkv_last_error_message()) << "successful calls do not clear the message";
}

TEST(Handles, DestroyNullIsANoOp) {
  qjlkv_sketch_destroy(nullptr);
  qjlkv_cache_destroy(nullptr);
  SUCCEED();
}

TEST(Presets, DocumentedDefaults) {
  for (uint32_t d : {64u, 128u}) {
    for (const char *name : {"q3", "q4", "qjl", "kivi", "ott", "exact"}) {
      SCOPED_TRACE(std::string(name) + " d=" + std::to_string(d));
      qjlkv_config cfg;
      cfg.struct_size = sizeof cfg;
      QT_ASSERT_OK(qjlkv_config_init(&cfg, name, 3, 8, 2, d));
      EXPECT_EQ(cfg.struct_size, sizeof(qjlkv_config));
      const std::string preset = name;
      const bool tier = preset == "q3" || preset == "q4";
      EXPECT_EQ(cfg.value_method, uint32_t(tier ? QJLKV_VALUES_ROTATED_LLOYD_MAX : QJLKV_VALUES_UNIFORM));
      EXPECT_EQ(cfg.sink_tokens, tier ? 4u : 0u);
      EXPECT_EQ(cfg.num_layers, 3u);
      EXPECT_EQ(cfg.num_q_heads, 8u);
      EXPECT_EQ(cfg.num_kv_heads, 2u);
      EXPECT_EQ(cfg.head_dim, d);
      EXPECT_EQ(cfg.dtype, QJLKV_DTYPE_F32);
      EXPECT_EQ(cfg.device, -1);
      EXPECT_EQ(cfg.seed, 0u);
      EXPECT_EQ(cfg.num_threads, 0u);
      EXPECT_EQ(cfg.sketch_flags, QJLKV_SKETCH_ORTHOGONAL);
      QT_EXPECT_OK(qjlkv_config_validate(&cfg));
      if (tier) {
        EXPECT_EQ(cfg.key_method, QJLKV_KEYS_KIVI);
        EXPECT_EQ(cfg.key_bits, preset == "q3" ? 3u : 4u);
        EXPECT_EQ(cfg.value_bits, preset == "q3" ? 2u : 3u);
        EXPECT_EQ(cfg.block_tokens, 128u);
        EXPECT_EQ(cfg.residual_tokens, 32u);
      } else if (preset == "qjl") {
        EXPECT_EQ(cfg.key_method, QJLKV_KEYS_QJL);
        EXPECT_EQ(cfg.key_sketch_dim, 2 * d);
        EXPECT_EQ(cfg.outlier_channels, 4u);
        EXPECT_EQ(cfg.outlier_sketch_dim, d);
        EXPECT_EQ(cfg.block_tokens, 32u);
        EXPECT_EQ(cfg.residual_tokens, 32u);
        EXPECT_EQ(cfg.value_bits, 2u);
        EXPECT_EQ(cfg.value_group_size, 64u);
      } else if (preset == "kivi" || preset == "ott") {
        EXPECT_EQ(cfg.key_method, preset == "kivi" ? QJLKV_KEYS_KIVI : QJLKV_KEYS_OTT);
        EXPECT_EQ(cfg.key_bits, 2u);
        EXPECT_EQ(cfg.block_tokens, 128u);
        EXPECT_EQ(cfg.residual_tokens, 32u);
        EXPECT_EQ(cfg.value_bits, 2u);
        EXPECT_EQ(cfg.value_group_size, 32u);
        if (preset == "ott") {
          EXPECT_EQ(cfg.outlier_tokens, 3u);
          EXPECT_EQ(cfg.outlier_spill_tokens, 32u);
          EXPECT_EQ(cfg.outlier_skip_layers, 2u);
        }
      } else {
        EXPECT_EQ(cfg.key_method, QJLKV_KEYS_EXACT);
        EXPECT_EQ(cfg.value_bits, 16u);
      }
    }
  }
}

void expect_same_config(const qjlkv_config &a, const qjlkv_config &b) {
#define QT_SAME(field) EXPECT_EQ(a.field, b.field) << #field
  QT_SAME(struct_size);
  QT_SAME(num_layers);
  QT_SAME(num_q_heads);
  QT_SAME(num_kv_heads);
  QT_SAME(head_dim);
  QT_SAME(dtype);
  QT_SAME(device);
  QT_SAME(seed);
  QT_SAME(sketch_flags);
  QT_SAME(key_method);
  QT_SAME(block_tokens);
  QT_SAME(residual_tokens);
  QT_SAME(key_sketch_dim);
  QT_SAME(outlier_channels);
  QT_SAME(outlier_sketch_dim);
  QT_SAME(initial_layers);
  QT_SAME(initial_key_sketch_dim);
  QT_SAME(initial_outlier_sketch_dim);
  QT_SAME(key_bits);
  QT_SAME(outlier_tokens);
  QT_SAME(outlier_spill_tokens);
  QT_SAME(outlier_skip_layers);
  QT_SAME(value_bits);
  QT_SAME(value_group_size);
  QT_SAME(num_threads);
  QT_SAME(value_method);
  QT_SAME(sink_tokens);
#undef QT_SAME
}

// A struct whose struct_size is no size this library knows (e.g. never set) is a 0.1 struct:
// config_init writes its 112 bytes (fields up to num_threads, then zeroed tail padding, where
// value_method now lives) and nothing after them, and create gives the fields added after 0.1
// their defaults.
TEST(Presets, UnknownStructSizeWritesTheFirstReleasesFields) {
  qjlkv_config cfg;
  std::memset(&cfg, 0xA5, sizeof cfg);
  QT_ASSERT_OK(qjlkv_config_init(&cfg, "kivi", 1, 2, 1, 64));
  EXPECT_EQ(cfg.struct_size, QJLKV_CONFIG_SIZE_0_1);
  EXPECT_EQ(cfg.value_method, 0u) << "0.1's tail padding, written as zeros";
  EXPECT_EQ(cfg.sink_tokens, 0xA5A5A5A5u);
  cfg.value_method = 0xA5A5A5A5u;  // never read from a 0.1 struct
  QT_EXPECT_OK(qjlkv_config_validate(&cfg));
  qjlkv_cache *c = nullptr;
  QT_ASSERT_OK(qjlkv_cache_create(&cfg, &c));
  qjlkv_config got;
  got.struct_size = sizeof got;
  QT_EXPECT_OK(qjlkv_cache_config(c, &got));
  EXPECT_EQ(got.struct_size, sizeof got);
  EXPECT_EQ(got.value_method, 0u);
  EXPECT_EQ(got.sink_tokens, 0u);
  qjlkv_cache_destroy(c);
}

TEST(Presets, NullAndEmptyNameMeanQ3) {
  qjlkv_config q3, null_name, empty_name;
  q3.struct_size = null_name.struct_size = empty_name.struct_size = sizeof(qjlkv_config);
  QT_ASSERT_OK(qjlkv_config_init(&q3, "q3", 2, 4, 4, 96));
  QT_ASSERT_OK(qjlkv_config_init(&null_name, nullptr, 2, 4, 4, 96));
  QT_ASSERT_OK(qjlkv_config_init(&empty_name, "", 2, 4, 4, 96));
  expect_same_config(q3, null_name);
  expect_same_config(q3, empty_name);
}

TEST(Presets, EveryPresetRunsEndToEnd) {
  for (const char *name : {"q3", "q4", "qjl", "kivi", "ott", "exact"}) {
    SCOPED_TRACE(name);
    qjlkv_config cfg = qt::make_config(name, 3, 4, 2, 64);
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    qt::Rng rng(1);
    const uint32_t n = 300;
    for (uint32_t layer = 0; layer < 3; ++layer) {
      const std::vector<float> k = rng.normals(size_t(n) * 2 * 64), v = rng.normals(size_t(n) * 2 * 64);
      QT_ASSERT_OK(qjlkv_cache_append(cache.get(), layer, 9, n, k.data(), v.data()));
      EXPECT_EQ(qt::length_of(cache.get(), layer, 9), n);
      const std::vector<float> q = rng.normals(4 * 64);
      std::vector<float> out(4 * 64, NAN);
      QT_ASSERT_OK(qjlkv_cache_attend(cache.get(), layer, 9, 1, q.data(), 0.0f, out.data()));
      for (float x : out) ASSERT_TRUE(std::isfinite(x));
      std::vector<float> s(4 * n, NAN);
      QT_ASSERT_OK(qjlkv_cache_scores(cache.get(), layer, 9, q.data(), s.data(), s.size()));
      for (float x : s) ASSERT_FALSE(std::isnan(x));
    }
    const qjlkv_stats st = qt::stats_of(cache.get());
    EXPECT_EQ(st.tokens, 3u * n);
    EXPECT_GT(st.bytes_used, 0u);
  }
}

TEST(Config, ValidateAcceptsWhatInitProduces) {
  for (uint32_t d : {8u, 16u, 80u, 96u, 136u, 256u}) {
    for (const char *name : {"q3", "q4", "qjl", "kivi", "ott", "exact"}) {
      qjlkv_config cfg;
      cfg.struct_size = sizeof cfg;
      QT_ASSERT_OK(qjlkv_config_init(&cfg, name, 1, 6, 3, d));
      QT_EXPECT_OK(qjlkv_config_validate(&cfg));
      EXPECT_EQ(d % cfg.value_group_size, 0u) << name << " d=" << d;
      qt::Cache cache = qt::make_cache(cfg);
      EXPECT_TRUE(cache) << name << " d=" << d;
    }
  }
}

TEST(Config, CacheReturnsTheConfigItWasCreatedWith) {
  qjlkv_config cfg;
  cfg.struct_size = sizeof cfg;
  QT_ASSERT_OK(qjlkv_config_init(&cfg, "qjl", 4, 12, 4, 80));
  cfg.seed = 0x123456789abcdefull;
  cfg.dtype = QJLKV_DTYPE_BF16;
  cfg.block_tokens = 16;
  cfg.residual_tokens = 5;
  cfg.key_sketch_dim = 72;
  cfg.outlier_channels = 3;
  cfg.outlier_sketch_dim = 24;
  cfg.initial_layers = 2;
  cfg.initial_key_sketch_dim = 160;
  cfg.initial_outlier_sketch_dim = 40;
  cfg.value_bits = 4;
  cfg.value_group_size = 20;
  cfg.num_threads = 3;
  cfg.sink_tokens = 7;
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  qjlkv_config back;
  std::memset(&back, 0xAB, sizeof back);
  back.struct_size = sizeof back;
  QT_ASSERT_OK(qjlkv_cache_config(cache.get(), &back));
  expect_same_config(cfg, back);
}

TEST(Stream, CpuCacheAcceptsOnlyTheDefaultStream) {
  qt::Cache cache = qt::make_cache(qt::make_config("qjl", 1, 2, 1, 64));
  ASSERT_TRUE(cache);
  QT_EXPECT_OK(qjlkv_cache_set_stream(cache.get(), nullptr));
  int not_a_stream = 0;
  QT_EXPECT_FAIL(qjlkv_cache_set_stream(cache.get(), &not_a_stream), QJLKV_ERROR_UNSUPPORTED, "cuda_stream",
                 "stream");
  QT_EXPECT_FAIL(qjlkv_cache_set_stream(nullptr, nullptr), QJLKV_ERROR_INVALID_ARGUMENT, "c", "cache");
}

// On a machine or build without CUDA, asking for a device fails cleanly; where a device exists the
// cache must work like a CPU one for these calls.
TEST(Device, DeviceOrdinalWithoutGpuFailsCleanly) {
  qjlkv_config cfg = qt::make_config("qjl", 1, 2, 1, 64);
  cfg.device = 0;
  qjlkv_cache *cache = reinterpret_cast<qjlkv_cache *>(uintptr_t(0x10));
  const std::string stale = qt::stale_error_message();
  const qjlkv_status s = qjlkv_cache_create(&cfg, &cache);
  if (s == QJLKV_OK) {
    ASSERT_NE(cache, nullptr);
    qjlkv_config back;
    QT_EXPECT_OK(qjlkv_cache_config(cache, &back));
    EXPECT_EQ(back.device, 0);
    QT_EXPECT_OK(qjlkv_cache_set_stream(cache, nullptr));
    qjlkv_cache_destroy(cache);
    return;
  }
  EXPECT_TRUE(s == QJLKV_ERROR_UNSUPPORTED || s == QJLKV_ERROR_DEVICE) << qt::describe(s);
  EXPECT_EQ(cache, nullptr) << "*out is set to NULL on failure";
  EXPECT_TRUE(qt::fails_naming(s, s, stale, {"device"}));
  cfg.device = 1000;
  cache = nullptr;
  const qjlkv_status far = qjlkv_cache_create(&cfg, &cache);
  EXPECT_TRUE(far == QJLKV_ERROR_UNSUPPORTED || far == QJLKV_ERROR_DEVICE) << qt::describe(far);
  EXPECT_EQ(cache, nullptr);
}

}  // namespace
