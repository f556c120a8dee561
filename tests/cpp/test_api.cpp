// Versions, statuses and messages, presets and configs, handles, streams and devices.
#include <cstdio>
#include <string>
#include <thread>

#include "c_caller.h"
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
  EXPECT_STREQ(qjlkv_status_string(QJLKV_ERROR_MEMORY_BUDGET), "QJLKV_ERROR_MEMORY_BUDGET");
  // A C caller may pass any int; C++ cannot hold such a value in the enum, so C code passes it.
  EXPECT_STREQ(qjlkv_test_status_string_of_int(6), "QJLKV_ERROR_INTERNAL");
  EXPECT_STREQ(qjlkv_test_status_string_of_int(7), "QJLKV_ERROR_MEMORY_BUDGET");
  EXPECT_STREQ(qjlkv_test_status_string_of_int(8), "unknown status");
  EXPECT_STREQ(qjlkv_test_status_string_of_int(999), "unknown status");
  EXPECT_STREQ(qjlkv_test_status_string_of_int(-1), "unknown status");
  EXPECT_STREQ(qjlkv_test_status_string_of_int(INT32_MIN), "unknown status");
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

// Every number qjlkv.h states about the presets (at qjlkv_config_init), for head dims where the
// group-size and outlier rules differ, and layer counts below and above the OTT skip.
TEST(Presets, DocumentedDefaults) {
  for (uint32_t layers : {1u, 3u}) {
    for (uint32_t d : {8u, 16u, 24u, 32u, 40u, 48u, 64u, 96u, 128u, 192u, 256u}) {
      const uint32_t g = d % 32 == 0 ? 32 : d % 16 == 0 ? 16 : 8;  // the largest of 32, 16, 8 dividing d
      const uint32_t c = d >= 16 ? 4 : 0;
      for (const char *name : {"q2", "q3", "q4", "qjl", "kivi", "ott", "exact"}) {
        SCOPED_TRACE(std::string(name) + " d=" + std::to_string(d) + " layers=" + std::to_string(layers));
        qjlkv_config cfg;
        std::memset(&cfg, 0xEE, sizeof cfg);
        cfg.struct_size = sizeof cfg;
        QT_ASSERT_OK(qjlkv_config_init(&cfg, name, layers, 8, 2, d));
        EXPECT_EQ(cfg.struct_size, sizeof(qjlkv_config));
        EXPECT_EQ(cfg.num_layers, layers);
        EXPECT_EQ(cfg.num_q_heads, 8u);
        EXPECT_EQ(cfg.num_kv_heads, 2u);
        EXPECT_EQ(cfg.head_dim, d);
        EXPECT_EQ(cfg.dtype, uint32_t(QJLKV_DTYPE_F32));
        EXPECT_EQ(cfg.backend, uint32_t(QJLKV_BACKEND_CPU));
        EXPECT_EQ(cfg.device_ordinal, 0u);
        EXPECT_EQ(cfg.unused_0_1, 0u);
        EXPECT_EQ(cfg.seed, 0u);
        EXPECT_EQ(cfg.num_threads, 0u);
        EXPECT_EQ(cfg.sketch_flags, QJLKV_SKETCH_ORTHOGONAL);
        const std::string preset = name;
        const bool tier = preset == "q3" || preset == "q4";
        EXPECT_EQ(cfg.value_method,
                  uint32_t(tier || preset == "q2" ? QJLKV_VALUES_ROTATED_LLOYD_MAX : QJLKV_VALUES_UNIFORM));
        EXPECT_EQ(cfg.sink_tokens, preset == "q3" || preset == "q2" ? 16u : preset == "q4" ? 4u : 0u);
        EXPECT_EQ(cfg.unused_0_4, 0u);
        EXPECT_EQ(cfg.key_token_bits, 8 * ((17 * d + 63) / 64));  // 2.125 bits a channel, whole bytes
        // The fields of every key method, in every preset.
        EXPECT_EQ(cfg.key_sketch_dim, 2 * d);
        EXPECT_EQ(cfg.outlier_channels, c);
        EXPECT_EQ(cfg.outlier_sketch_dim, c ? d : 0u);
        EXPECT_EQ(cfg.initial_layers, 0u);
        EXPECT_EQ(cfg.initial_key_sketch_dim, cfg.key_sketch_dim);
        EXPECT_EQ(cfg.initial_outlier_sketch_dim, cfg.outlier_sketch_dim);
        EXPECT_EQ(cfg.key_bits, preset == "q3" ? 3u : preset == "q4" ? 4u : 2u);
        EXPECT_EQ(cfg.outlier_tokens, 3u);
        EXPECT_EQ(cfg.outlier_spill_tokens, 32u);
        EXPECT_EQ(cfg.outlier_skip_layers, std::min(2u, layers));
        QT_EXPECT_OK(qjlkv_config_validate(&cfg));
        if (preset == "q2") {
          EXPECT_EQ(cfg.key_method, uint32_t(QJLKV_KEYS_MIXED));
          EXPECT_EQ(cfg.block_tokens, 128u);
          EXPECT_EQ(cfg.residual_tokens, 32u);
          EXPECT_EQ(cfg.value_bits, 2u);
          EXPECT_EQ(cfg.value_group_size, g);
        } else if (tier) {
          EXPECT_EQ(cfg.key_method, uint32_t(QJLKV_KEYS_KIVI));
          EXPECT_EQ(cfg.block_tokens, preset == "q3" ? 64u : 128u);
          EXPECT_EQ(cfg.residual_tokens, preset == "q3" ? 16u : 32u);
          EXPECT_EQ(cfg.value_bits, preset == "q3" ? 2u : 3u);
          EXPECT_EQ(cfg.value_group_size, g);
        } else if (preset == "qjl") {
          EXPECT_EQ(cfg.key_method, uint32_t(QJLKV_KEYS_QJL));
          EXPECT_EQ(cfg.block_tokens, 32u);
          EXPECT_EQ(cfg.residual_tokens, 32u);
          EXPECT_EQ(cfg.value_bits, 2u);
          EXPECT_EQ(cfg.value_group_size, d % 64 == 0 ? 64u : g);
        } else if (preset == "kivi" || preset == "ott") {
          EXPECT_EQ(cfg.key_method, uint32_t(preset == "kivi" ? QJLKV_KEYS_KIVI : QJLKV_KEYS_OTT));
          EXPECT_EQ(cfg.block_tokens, 128u);
          EXPECT_EQ(cfg.residual_tokens, 32u);
          EXPECT_EQ(cfg.value_bits, 2u);
          EXPECT_EQ(cfg.value_group_size, g);
        } else {
          EXPECT_EQ(cfg.key_method, uint32_t(QJLKV_KEYS_EXACT));
          EXPECT_EQ(cfg.block_tokens, 32u);
          EXPECT_EQ(cfg.residual_tokens, 0u);
          EXPECT_EQ(cfg.value_bits, 16u);
          EXPECT_EQ(cfg.value_group_size, g);
        }
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
  QT_SAME(device_ordinal);
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
  QT_SAME(unused_0_1);
  QT_SAME(backend);
  QT_SAME(value_method);
  QT_SAME(sink_tokens);
  QT_SAME(unused_0_3);
  QT_SAME(memory_budget);
  QT_SAME(rollback_tokens);
  QT_SAME(unused_0_4);
  QT_SAME(key_token_bits);
#undef QT_SAME
}

TEST(Presets, NullAndEmptyNameMeanQ3) {
  qjlkv_config q3{}, null_name{}, empty_name{};
  q3.struct_size = null_name.struct_size = empty_name.struct_size = sizeof(qjlkv_config);
  QT_ASSERT_OK(qjlkv_config_init(&q3, "q3", 2, 4, 4, 96));
  QT_ASSERT_OK(qjlkv_config_init(&null_name, nullptr, 2, 4, 4, 96));
  QT_ASSERT_OK(qjlkv_config_init(&empty_name, "", 2, 4, 4, 96));
  expect_same_config(q3, null_name);
  expect_same_config(q3, empty_name);
}

TEST(Presets, EveryPresetRunsEndToEnd) {
  for (const char *name : {"q2", "q3", "q4", "qjl", "kivi", "ott", "exact"}) {
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
    for (const char *name : {"q2", "q3", "q4", "qjl", "kivi", "ott", "exact"}) {
      qjlkv_config cfg{};
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
  qjlkv_config cfg{};
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
  cfg.backend = QJLKV_BACKEND_CUDA;
  cfg.device_ordinal = 0;
  qjlkv_cache *cache = reinterpret_cast<qjlkv_cache *>(uintptr_t(0x10));
  const std::string stale = qt::stale_error_message();
  const qjlkv_status s = qjlkv_cache_create(&cfg, &cache);
  if (s == QJLKV_OK) {
    ASSERT_NE(cache, nullptr);
    qjlkv_config back;
    back.struct_size = sizeof back;
    QT_EXPECT_OK(qjlkv_cache_config(cache, &back));
    EXPECT_EQ(back.backend, uint32_t(QJLKV_BACKEND_CUDA));
    EXPECT_EQ(back.device_ordinal, 0u);
    QT_EXPECT_OK(qjlkv_cache_set_stream(cache, nullptr));
    qjlkv_workers *workers = nullptr;
    QT_EXPECT_OK(qjlkv_workers_create(1, &workers));
    QT_EXPECT_FAIL(qjlkv_cache_set_workers(cache, workers), QJLKV_ERROR_UNSUPPORTED, "workers");
    QT_EXPECT_OK(qjlkv_cache_set_workers(cache, nullptr));
    qjlkv_workers_destroy(workers);
    qjlkv_cache_destroy(cache);
    return;
  }
  EXPECT_TRUE(s == QJLKV_ERROR_UNSUPPORTED || s == QJLKV_ERROR_DEVICE) << qt::describe(s);
  EXPECT_EQ(cache, nullptr) << "*out is set to NULL on failure";
  EXPECT_TRUE(qt::fails_naming(s, s, stale, {"device_ordinal"}));
  cfg.device_ordinal = 1000;
  cache = nullptr;
  const qjlkv_status far = qjlkv_cache_create(&cfg, &cache);
  EXPECT_TRUE(far == QJLKV_ERROR_UNSUPPORTED || far == QJLKV_ERROR_DEVICE) << qt::describe(far);
  EXPECT_EQ(cache, nullptr);
}

}  // namespace
