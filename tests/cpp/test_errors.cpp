// Bad input to every function: the documented status, a message naming the argument, *out set
// to NULL where documented, and the cache left exactly as it was (lengths, statistics, scores).
#include <cstddef>
#include <functional>

#include "testing.hpp"

namespace {

constexpr qjlkv_status kInvalid = QJLKV_ERROR_INVALID_ARGUMENT;

// ---------------------------------------------------------------------------------------------
// Sketches
// ---------------------------------------------------------------------------------------------
TEST(Errors, SketchCreate) {
  QT_EXPECT_FAIL(qjlkv_sketch_create(64, 64, 0, 0, nullptr), kInvalid, "out");
  struct Bad {
    uint32_t d, m, flags;
    const char *name;
  };
  for (const Bad b : {Bad{0, 64, 1, "head_dim"}, Bad{1025, 64, 1, "head_dim"}, Bad{64, 0, 1, "sketch_dim"},
                      Bad{64, 12, 1, "sketch_dim"}, Bad{64, 65544, 1, "sketch_dim"}, Bad{64, 64, 2, "flags"},
                      Bad{64, 64, 0xffffffffu, "flags"}}) {
    qjlkv_sketch *s = reinterpret_cast<qjlkv_sketch *>(uintptr_t(0x10));
    QT_EXPECT_FAIL(qjlkv_sketch_create(b.d, b.m, 0, b.flags, &s), kInvalid, b.name);
    EXPECT_EQ(s, nullptr) << "*out must be NULL after a failure (" << b.name << ")";
  }
  // The documented extremes are accepted.
  for (auto [d, m] : {std::pair{1u, 8u}, std::pair{1024u, 8u}, std::pair{8u, 65536u}}) {
    qjlkv_sketch *s = nullptr;
    QT_EXPECT_OK(qjlkv_sketch_create(d, m, 0, QJLKV_SKETCH_ORTHOGONAL, &s));
    qjlkv_sketch_destroy(s);
  }
}

TEST(Errors, SketchMatrixAndShape) {
  qjlkv_sketch *raw = nullptr;
  QT_ASSERT_OK(qjlkv_sketch_create(16, 24, 0, 1, &raw));
  qt::Sketch s(raw);
  std::vector<float> out(16 * 24);
  QT_EXPECT_FAIL(qjlkv_sketch_matrix(nullptr, out.data(), out.size()), kInvalid, "s", "sketch");
  QT_EXPECT_FAIL(qjlkv_sketch_matrix(s.get(), nullptr, out.size()), kInvalid, "out");
  QT_EXPECT_FAIL(qjlkv_sketch_matrix(s.get(), out.data(), out.size() - 1), kInvalid, "out_len");
  QT_EXPECT_FAIL(qjlkv_sketch_matrix(s.get(), out.data(), 0), kInvalid, "out_len");
  QT_EXPECT_OK(qjlkv_sketch_matrix(s.get(), out.data(), out.size()));
  uint32_t rows = 0, cols = 0;
  QT_EXPECT_FAIL(qjlkv_sketch_shape(nullptr, &rows, &cols), kInvalid, "s", "sketch");
  QT_EXPECT_FAIL(qjlkv_sketch_shape(s.get(), nullptr, &cols), kInvalid, "rows");
  QT_EXPECT_FAIL(qjlkv_sketch_shape(s.get(), &rows, nullptr), kInvalid, "cols");
}

// ---------------------------------------------------------------------------------------------
// Configs
// ---------------------------------------------------------------------------------------------
TEST(Errors, ConfigInit) {
  qjlkv_config cfg;
  std::memset(&cfg, 0x5A, sizeof cfg);
  qjlkv_config untouched;
  std::memcpy(&untouched, &cfg, sizeof cfg);
  // One struct_size rule (qjlkv.h, "Growing structs"): init does not guess from garbage either.
  QT_EXPECT_FAIL(qjlkv_config_init(&cfg, "qjl", 1, 1, 1, 64), kInvalid, "struct_size");
  EXPECT_EQ(0, std::memcmp(&cfg, &untouched, sizeof cfg)) << "a refused struct_size must leave *cfg unchanged";
  for (uint32_t size : {0u, QJLKV_CONFIG_SIZE_0_1 - 4, QJLKV_CONFIG_SIZE_0_1 + 4, uint32_t(sizeof cfg) + 8}) {
    cfg.struct_size = size;
    QT_EXPECT_FAIL(qjlkv_config_init(&cfg, "qjl", 1, 1, 1, 64), kInvalid, "struct_size");
  }
  cfg.struct_size = sizeof cfg;
  std::memcpy(&untouched, &cfg, sizeof cfg);
  QT_EXPECT_FAIL(qjlkv_config_init(nullptr, "qjl", 1, 1, 1, 64), kInvalid, "cfg", "config");
  QT_EXPECT_FAIL(qjlkv_config_init(&cfg, "qjl2", 1, 1, 1, 64), kInvalid, "preset");
  QT_EXPECT_FAIL(qjlkv_config_init(&cfg, "QJL", 1, 1, 1, 64), kInvalid, "preset");
  QT_EXPECT_FAIL(qjlkv_config_init(&cfg, "qjl", 0, 1, 1, 64), kInvalid, "num_layers");
  QT_EXPECT_FAIL(qjlkv_config_init(&cfg, "qjl", 1, 0, 1, 64), kInvalid, "num_q_heads");
  QT_EXPECT_FAIL(qjlkv_config_init(&cfg, "qjl", 1, 4, 0, 64), kInvalid, "num_kv_heads");
  QT_EXPECT_FAIL(qjlkv_config_init(&cfg, "qjl", 1, 6, 4, 64), kInvalid, "num_q_heads", "num_kv_heads");
  QT_EXPECT_FAIL(qjlkv_config_init(&cfg, "qjl", 1, 1, 1, 0), kInvalid, "head_dim");
  QT_EXPECT_FAIL(qjlkv_config_init(&cfg, "qjl", 1, 1, 1, 12), kInvalid, "head_dim");
  QT_EXPECT_FAIL(qjlkv_config_init(&cfg, "exact", 1, 1, 1, 264), kInvalid, "head_dim");
  EXPECT_EQ(0, std::memcmp(&cfg, &untouched, sizeof cfg)) << "a failed init must leave *cfg unchanged";
}

struct BadField {
  const char *field;
  std::function<void(qjlkv_config &)> spoil;
};

// Each mutation of a valid config is rejected by validate and by create, naming the field.
TEST(Errors, ConfigValidateAndCacheCreateNameTheField) {
  const std::vector<std::pair<const char *, std::vector<BadField>>> cases = {
      {"qjl",
       {
           {"struct_size", [](qjlkv_config &c) { c.struct_size = 0; }},
           {"struct_size", [](qjlkv_config &c) { c.struct_size = sizeof(qjlkv_config) + 4; }},
           {"struct_size", [](qjlkv_config &c) { c.struct_size = sizeof(qjlkv_config) - 4; }},
           {"struct_size", [](qjlkv_config &c) { c.struct_size = QJLKV_CONFIG_SIZE_0_1 + 4; }},
           {"num_layers", [](qjlkv_config &c) { c.num_layers = 0; }},
           {"num_q_heads", [](qjlkv_config &c) { c.num_q_heads = 0; }},
           {"num_kv_heads", [](qjlkv_config &c) { c.num_kv_heads = 0; }},
           {"num_kv_heads", [](qjlkv_config &c) { c.num_kv_heads = 3; }},  // 4 query heads
           {"head_dim", [](qjlkv_config &c) { c.head_dim = 12; }},
           {"head_dim", [](qjlkv_config &c) { c.head_dim = 264; }},
           {"head_dim", [](qjlkv_config &c) { c.head_dim = 0; }},
           {"dtype", [](qjlkv_config &c) { c.dtype = 3; }},
           {"dtype", [](qjlkv_config &c) { c.dtype = 0x80000000u; }},
           {"backend", [](qjlkv_config &c) { c.backend = 2; }},
           {"device_ordinal", [](qjlkv_config &c) { c.device_ordinal = 1; }},  // CPU: only 0
           {"sketch_flags", [](qjlkv_config &c) { c.sketch_flags = 2; }},
           {"key_method", [](qjlkv_config &c) { c.key_method = 5; }},
           {"block_tokens", [](qjlkv_config &c) { c.block_tokens = 0; }},
           {"block_tokens", [](qjlkv_config &c) { c.block_tokens = 12; }},
           {"block_tokens", [](qjlkv_config &c) { c.block_tokens = 4104; }},
           {"residual_tokens", [](qjlkv_config &c) { c.residual_tokens = 65537; }},
           {"key_sketch_dim", [](qjlkv_config &c) { c.key_sketch_dim = 0; }},
           {"key_sketch_dim", [](qjlkv_config &c) { c.key_sketch_dim = 100; }},
           {"key_sketch_dim", [](qjlkv_config &c) { c.key_sketch_dim = 65544; }},
           {"outlier_channels", [](qjlkv_config &c) { c.outlier_channels = 64; }},
           {"outlier_sketch_dim", [](qjlkv_config &c) { c.outlier_sketch_dim = 12; }},
           {"outlier_sketch_dim", [](qjlkv_config &c) { c.outlier_sketch_dim = 0; }},  // c = 8 > 0
           {"initial_layers", [](qjlkv_config &c) { c.initial_layers = 3; }},       // 2 layers
           {"initial_key_sketch_dim",
            [](qjlkv_config &c) {
              c.initial_layers = 1;
              c.initial_key_sketch_dim = 4;
            }},
           {"initial_outlier_sketch_dim",
            [](qjlkv_config &c) {
              c.initial_layers = 1;
              c.initial_outlier_sketch_dim = 0;
            }},
           {"value_bits", [](qjlkv_config &c) { c.value_bits = 5; }},
           {"value_bits", [](qjlkv_config &c) { c.value_bits = 0; }},
           {"value_bits", [](qjlkv_config &c) { c.value_bits = 32; }},
           {"value_group_size", [](qjlkv_config &c) { c.value_group_size = 0; }},
           {"value_group_size", [](qjlkv_config &c) { c.value_group_size = 24; }},
           {"value_group_size", [](qjlkv_config &c) { c.value_group_size = 128; }},
       }},
      {"kivi", {{"key_bits", [](qjlkv_config &c) { c.key_bits = 5; }}}},
      {"ott",
       {
           {"key_bits", [](qjlkv_config &c) { c.key_bits = 16; }},
           {"outlier_tokens", [](qjlkv_config &c) { c.outlier_tokens = 129; }},
           {"outlier_spill_tokens", [](qjlkv_config &c) { c.outlier_spill_tokens = 4097; }},
           {"outlier_skip_layers", [](qjlkv_config &c) { c.outlier_skip_layers = 3; }},
       }},
  };
  for (const auto &[preset, fields] : cases) {
    for (const BadField &bad : fields) {
      SCOPED_TRACE(std::string(preset) + ": " + bad.field);
      qjlkv_config cfg = qt::make_config(preset, 2, 4, 2, 64);
      QT_ASSERT_OK(qjlkv_config_validate(&cfg));
      bad.spoil(cfg);
      QT_EXPECT_FAIL(qjlkv_config_validate(&cfg), kInvalid, bad.field);
      qjlkv_cache *cache = reinterpret_cast<qjlkv_cache *>(uintptr_t(0x10));
      QT_EXPECT_FAIL(qjlkv_cache_create(&cfg, &cache), kInvalid, bad.field);
      EXPECT_EQ(cache, nullptr) << "*out must be NULL after a failure";
    }
  }
  // Boundary values that are valid.
  qjlkv_config cfg = qt::make_config("qjl", 2, 4, 2, 64);
  cfg.outlier_channels = 0;
  cfg.outlier_sketch_dim = 0;
  cfg.value_group_size = 64;
  cfg.block_tokens = 8;
  cfg.residual_tokens = 0;
  cfg.key_sketch_dim = 8;
  QT_EXPECT_OK(qjlkv_config_validate(&cfg));
  cfg.outlier_channels = 63;
  cfg.outlier_sketch_dim = 65536;
  QT_EXPECT_OK(qjlkv_config_validate(&cfg));
}

TEST(Errors, ConfigNullPointers) {
  QT_EXPECT_FAIL(qjlkv_config_validate(nullptr), kInvalid, "cfg", "config");
  qjlkv_cache *cache = reinterpret_cast<qjlkv_cache *>(uintptr_t(0x10));
  QT_EXPECT_FAIL(qjlkv_cache_create(nullptr, &cache), kInvalid, "cfg", "config");
  EXPECT_EQ(cache, nullptr);
  const qjlkv_config cfg = qt::make_config("qjl", 1, 1, 1, 64);
  QT_EXPECT_FAIL(qjlkv_cache_create(&cfg, nullptr), kInvalid, "out");
}

// ---------------------------------------------------------------------------------------------
// Cache calls: a populated cache, snapshotted before each test and compared after it.
// ---------------------------------------------------------------------------------------------
class CacheErrors : public ::testing::Test {
 protected:
  static constexpr uint32_t kLayers = 2, kHq = 4, kHkv = 2, kD = 64;

  void SetUp() override {
    cfg_ = qt::make_config("qjl", kLayers, kHq, kHkv, kD);
    cfg_.block_tokens = 8;
    cfg_.residual_tokens = 4;
    cache_ = qt::make_cache(cfg_);
    ASSERT_TRUE(cache_);
    keys_ = rng_.normals(64 * kHkv * kD);
    values_ = rng_.normals(keys_.size());
    queries_ = rng_.normals(64 * kHq * kD);
    QT_ASSERT_OK(qjlkv_cache_append(cache_.get(), 0, 1, 30, keys_.data(), values_.data()));
    QT_ASSERT_OK(qjlkv_cache_append(cache_.get(), 0, 2, 5, keys_.data(), values_.data()));
    QT_ASSERT_OK(qjlkv_cache_append(cache_.get(), 1, 1, 12, keys_.data(), values_.data()));
    ASSERT_NO_FATAL_FAILURE(qt::take_snapshot(cache_.get(), streams_, probe(), &before_));
  }

  void TearDown() override {
    if (!cache_) return;
    qt::Snapshot after;
    ASSERT_NO_FATAL_FAILURE(qt::take_snapshot(cache_.get(), streams_, probe(), &after));
    qt::expect_same_snapshot(before_, after, "after the failing calls");
  }

  std::vector<uint8_t> probe() const {
    return qt::encode(std::vector<float>(queries_.begin(), queries_.begin() + kHq * kD), QJLKV_DTYPE_F32);
  }
  // A copy of the first n tokens' keys with one bad element.
  std::vector<float> spoiled(const std::vector<float> &x, size_t n_elems, size_t at, float bad) const {
    std::vector<float> copy(x.begin(), x.begin() + n_elems);
    copy.at(at) = bad;
    return copy;
  }

  qjlkv_config cfg_{};
  qt::Cache cache_;
  qt::Rng rng_{77};
  std::vector<float> keys_, values_, queries_;
  // Existing streams, plus ids never appended to (their length must stay 0).
  const std::vector<std::pair<uint32_t, uint32_t>> streams_ = {{0, 1}, {0, 2}, {1, 1}, {0, 5}, {1, 5}, {1, 2}};
  qt::Snapshot before_;
};

TEST_F(CacheErrors, CacheConfig) {
  qjlkv_config out;
  out.struct_size = sizeof out;
  QT_EXPECT_FAIL(qjlkv_cache_config(nullptr, &out), kInvalid, "c", "cache");
  for (uint32_t size : {0u, QJLKV_CONFIG_SIZE_0_1 + 4}) {
    out.struct_size = size;
    QT_EXPECT_FAIL(qjlkv_cache_config(cache_.get(), &out), kInvalid, "struct_size");
  }
  QT_EXPECT_FAIL(qjlkv_cache_config(cache_.get(), nullptr), kInvalid, "out");
}

TEST_F(CacheErrors, AppendPointersSizesLayers) {
  qjlkv_cache *c = cache_.get();
  const float *k = keys_.data(), *v = values_.data();
  QT_EXPECT_FAIL(qjlkv_cache_append(nullptr, 0, 1, 1, k, v), kInvalid, "c", "cache");
  QT_EXPECT_FAIL(qjlkv_cache_append(c, 0, 1, 1, nullptr, v), kInvalid, "keys");
  QT_EXPECT_FAIL(qjlkv_cache_append(c, 0, 1, 1, k, nullptr), kInvalid, "values");
  QT_EXPECT_FAIL(qjlkv_cache_append(c, 0, 1, 0, k, v), kInvalid, "n_tokens");
  QT_EXPECT_FAIL(qjlkv_cache_append(c, kLayers, 1, 1, k, v), kInvalid, "layer");
  QT_EXPECT_FAIL(qjlkv_cache_append(c, 0xffffffffu, 5, 1, k, v), kInvalid, "layer");
}

TEST_F(CacheErrors, AppendNonFiniteOrOutOfRangeData) {
  qjlkv_cache *c = cache_.get();
  const size_t n = 20, elems = n * kHkv * kD;
  const size_t late = (17 * kHkv + 1) * kD + 5;  // token 17, kv head 1, channel 5
  struct Bad {
    bool in_keys;
    float x;
  };
  for (const Bad b : {Bad{true, NAN}, Bad{true, INFINITY}, Bad{true, -INFINITY}, Bad{false, NAN},
                      Bad{false, INFINITY}, Bad{true, 70000.0f}, Bad{false, -70000.0f}}) {
    SCOPED_TRACE(std::string(b.in_keys ? "keys" : "values") + " holding " + std::to_string(b.x));
    const std::vector<float> k = b.in_keys ? spoiled(keys_, elems, late, b.x) : std::vector<float>(keys_.begin(), keys_.begin() + elems);
    const std::vector<float> v = b.in_keys ? std::vector<float>(values_.begin(), values_.begin() + elems) : spoiled(values_, elems, late, b.x);
    const char *name = b.in_keys ? "keys" : "values";
    // To an existing sequence (whose tail would flush) and to a new one (which must not appear).
    QT_EXPECT_FAIL(qjlkv_cache_append(c, 0, 1, uint32_t(n), k.data(), v.data()), kInvalid, name);
    QT_EXPECT_FAIL(qjlkv_cache_append(c, 1, 5, uint32_t(n), k.data(), v.data()), kInvalid, name);
  }
  // Every element within fp16 range, but a QJL key norm (stored in fp16) beyond it.
  std::vector<float> k(keys_.begin(), keys_.begin() + elems);
  std::fill(k.begin() + 3 * kHkv * kD, k.begin() + 4 * kHkv * kD, 10000.0f);
  QT_EXPECT_FAIL(qjlkv_cache_append(c, 0, 1, uint32_t(n), k.data(), values_.data()), kInvalid, "keys");
}

TEST(Errors, AppendNonFinite16BitInputs) {
  for (qjlkv_dtype dtype : {QJLKV_DTYPE_F16, QJLKV_DTYPE_BF16}) {
    SCOPED_TRACE(qt::dtype_name(dtype));
    qjlkv_config cfg = qt::make_config("qjl", 1, 2, 2, 32);
    cfg.dtype = dtype;
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    qt::Rng rng(1);
    const std::vector<uint8_t> good = qt::encode(rng.normals(10 * 2 * 32), dtype);
    const uint16_t nan = dtype == QJLKV_DTYPE_F16 ? 0x7e00 : 0x7fc0, inf = dtype == QJLKV_DTYPE_F16 ? 0x7c00 : 0x7f80;
    for (uint16_t bad : {nan, inf, uint16_t(inf | 0x8000u)}) {
      std::vector<uint8_t> spoiled = good;
      std::memcpy(&spoiled[2 * 611], &bad, 2);
      QT_EXPECT_FAIL(qjlkv_cache_append(cache.get(), 0, 0, 10, spoiled.data(), good.data()), kInvalid, "keys");
      QT_EXPECT_FAIL(qjlkv_cache_append(cache.get(), 0, 0, 10, good.data(), spoiled.data()), kInvalid, "values");
    }
    EXPECT_EQ(qt::length_of(cache.get(), 0, 0), 0u);
    // bf16 can hold values beyond the fp16 range: quantized storage cannot.
    if (dtype == QJLKV_DTYPE_BF16) {
      std::vector<uint8_t> big = good;
      const uint16_t b = qjlkv::float_to_bf16(1e6f);
      std::memcpy(&big[2 * 100], &b, 2);
      QT_EXPECT_FAIL(qjlkv_cache_append(cache.get(), 0, 0, 10, good.data(), big.data()), kInvalid, "values");
      EXPECT_EQ(qt::length_of(cache.get(), 0, 0), 0u);
    }
  }
}

// 16-bit exact storage in bf16 holds any finite bf16; in fp16 it needs the fp16 range.
TEST(Errors, ExactStorageRangeFollowsItsDtype) {
  qt::Rng rng(2);
  std::vector<float> k = rng.normals(4 * 32), v = rng.normals(4 * 32);
  k[7] = 1e6f;
  v[9] = -1e6f;
  qjlkv_config bf = qt::make_config("exact", 1, 1, 1, 32);
  bf.dtype = QJLKV_DTYPE_BF16;
  qt::Cache bf_cache = qt::make_cache(bf);
  ASSERT_TRUE(bf_cache);
  QT_EXPECT_OK(qjlkv_cache_append(bf_cache.get(), 0, 0, 4, qt::encode(k, qjlkv_dtype(bf.dtype)).data(),
                                  qt::encode(v, qjlkv_dtype(bf.dtype)).data()));
  qt::Cache f32_cache = qt::make_cache(qt::make_config("exact", 1, 1, 1, 32));
  ASSERT_TRUE(f32_cache);
  QT_EXPECT_FAIL(qjlkv_cache_append(f32_cache.get(), 0, 0, 4, k.data(), v.data()), kInvalid, "keys");
  k[7] = 1.0f;
  QT_EXPECT_FAIL(qjlkv_cache_append(f32_cache.get(), 0, 0, 4, k.data(), v.data()), kInvalid, "values");
  EXPECT_EQ(qt::length_of(f32_cache.get(), 0, 0), 0u);
}

TEST_F(CacheErrors, Attend) {
  qjlkv_cache *c = cache_.get();
  const float *q = queries_.data();
  std::vector<float> out(64 * kHq * kD);
  QT_EXPECT_FAIL(qjlkv_cache_attend(nullptr, 0, 1, 1, q, 0.0f, out.data()), kInvalid, "c", "cache");
  QT_EXPECT_FAIL(qjlkv_cache_attend(c, 0, 1, 1, nullptr, 0.0f, out.data()), kInvalid, "queries");
  QT_EXPECT_FAIL(qjlkv_cache_attend(c, 0, 1, 1, q, 0.0f, nullptr), kInvalid, "out");
  QT_EXPECT_FAIL(qjlkv_cache_attend(c, kLayers, 1, 1, q, 0.0f, out.data()), kInvalid, "layer");
  QT_EXPECT_FAIL(qjlkv_cache_attend(c, 0, 77, 1, q, 0.0f, out.data()), kInvalid, "seq", "sequence");
  QT_EXPECT_FAIL(qjlkv_cache_attend(c, 1, 2, 1, q, 0.0f, out.data()), kInvalid, "seq", "sequence");
  QT_EXPECT_FAIL(qjlkv_cache_attend(c, 0, 1, 0, q, 0.0f, out.data()), kInvalid, "n_queries");
  QT_EXPECT_FAIL(qjlkv_cache_attend(c, 0, 1, 31, q, 0.0f, out.data()), kInvalid, "n_queries");
  QT_EXPECT_OK(qjlkv_cache_attend(c, 0, 1, 30, q, 0.0f, out.data()));
  for (float scale : {NAN, INFINITY, -INFINITY})
    QT_EXPECT_FAIL(qjlkv_cache_attend(c, 0, 1, 1, q, scale, out.data()), kInvalid, "scale");
  for (float bad : {NAN, INFINITY}) {
    const std::vector<float> spoiled_q = spoiled(queries_, 2 * kHq * kD, (kHq + 3) * kD + 63, bad);
    QT_EXPECT_FAIL(qjlkv_cache_attend(c, 0, 1, 2, spoiled_q.data(), 0.0f, out.data()), kInvalid, "queries");
  }
}

TEST_F(CacheErrors, AppendBatch) {
  qjlkv_cache *c = cache_.get();
  const float *k = keys_.data(), *v = values_.data();
  const uint32_t seqs[3] = {1, 5, 2};
  QT_EXPECT_FAIL(qjlkv_cache_append_batch(nullptr, 0, 3, seqs, k, v), kInvalid, "c", "cache");
  QT_EXPECT_FAIL(qjlkv_cache_append_batch(c, 0, 3, nullptr, k, v), kInvalid, "seqs");
  QT_EXPECT_FAIL(qjlkv_cache_append_batch(c, 0, 3, seqs, nullptr, v), kInvalid, "keys");
  QT_EXPECT_FAIL(qjlkv_cache_append_batch(c, 0, 3, seqs, k, nullptr), kInvalid, "values");
  QT_EXPECT_FAIL(qjlkv_cache_append_batch(c, 0, 0, seqs, k, v), kInvalid, "n_seqs");
  QT_EXPECT_FAIL(qjlkv_cache_append_batch(c, kLayers, 3, seqs, k, v), kInvalid, "layer");
  const uint32_t duplicates[4] = {1, 5, 2, 5};
  QT_EXPECT_FAIL(qjlkv_cache_append_batch(c, 0, 4, duplicates, k, v), kInvalid, "seqs");
  // One bad token (the last sequence's) fails the whole batch: no sequence changes.
  const std::vector<float> spoiled_k = spoiled(keys_, 3 * kHkv * kD, (2 * kHkv + 1) * kD, NAN);
  QT_EXPECT_FAIL(qjlkv_cache_append_batch(c, 0, 3, seqs, spoiled_k.data(), v), kInvalid, "keys");
  const std::vector<float> spoiled_v = spoiled(values_, 3 * kHkv * kD, 7, -INFINITY);
  QT_EXPECT_FAIL(qjlkv_cache_append_batch(c, 0, 3, seqs, k, spoiled_v.data()), kInvalid, "values");
}

TEST_F(CacheErrors, AttendBatch) {
  qjlkv_cache *c = cache_.get();
  const float *q = queries_.data();
  std::vector<float> out(4 * kHq * kD);
  const uint32_t seqs[2] = {1, 2};
  QT_EXPECT_FAIL(qjlkv_cache_attend_batch(nullptr, 0, 2, seqs, q, 0.0f, out.data()), kInvalid, "c", "cache");
  QT_EXPECT_FAIL(qjlkv_cache_attend_batch(c, 0, 2, nullptr, q, 0.0f, out.data()), kInvalid, "seqs");
  QT_EXPECT_FAIL(qjlkv_cache_attend_batch(c, 0, 2, seqs, nullptr, 0.0f, out.data()), kInvalid, "queries");
  QT_EXPECT_FAIL(qjlkv_cache_attend_batch(c, 0, 2, seqs, q, 0.0f, nullptr), kInvalid, "out");
  QT_EXPECT_FAIL(qjlkv_cache_attend_batch(c, 0, 0, seqs, q, 0.0f, out.data()), kInvalid, "n_seqs");
  QT_EXPECT_FAIL(qjlkv_cache_attend_batch(c, kLayers, 2, seqs, q, 0.0f, out.data()), kInvalid, "layer");
  const uint32_t unknown[2] = {1, 77};
  QT_EXPECT_FAIL(qjlkv_cache_attend_batch(c, 0, 2, unknown, q, 0.0f, out.data()), kInvalid, "seq", "seqs",
                 "sequence");
  QT_EXPECT_FAIL(qjlkv_cache_attend_batch(c, 0, 2, seqs, q, NAN, out.data()), kInvalid, "scale");
  const std::vector<float> spoiled_q = spoiled(queries_, 2 * kHq * kD, kHq * kD + 1, NAN);
  QT_EXPECT_FAIL(qjlkv_cache_attend_batch(c, 0, 2, seqs, spoiled_q.data(), 0.0f, out.data()), kInvalid, "queries");
}

TEST_F(CacheErrors, Scores) {
  qjlkv_cache *c = cache_.get();
  const float *q = queries_.data();
  std::vector<float> out(kHq * 30);
  QT_EXPECT_FAIL(qjlkv_cache_scores(nullptr, 0, 1, q, out.data(), out.size()), kInvalid, "c", "cache");
  QT_EXPECT_FAIL(qjlkv_cache_scores(c, 0, 1, nullptr, out.data(), out.size()), kInvalid, "query");
  QT_EXPECT_FAIL(qjlkv_cache_scores(c, 0, 1, q, nullptr, out.size()), kInvalid, "out");
  QT_EXPECT_FAIL(qjlkv_cache_scores(c, kLayers, 1, q, out.data(), out.size()), kInvalid, "layer");
  QT_EXPECT_FAIL(qjlkv_cache_scores(c, 0, 77, q, out.data(), out.size()), kInvalid, "seq", "sequence");
  QT_EXPECT_FAIL(qjlkv_cache_scores(c, 0, 1, q, out.data(), out.size() - 1), kInvalid, "out_len");
  QT_EXPECT_OK(qjlkv_cache_scores(c, 0, 1, q, out.data(), out.size()));
  const std::vector<float> spoiled_q = spoiled(queries_, kHq * kD, 2 * kD, -INFINITY);
  QT_EXPECT_FAIL(qjlkv_cache_scores(c, 0, 1, spoiled_q.data(), out.data(), out.size()), kInvalid, "query");
}

TEST_F(CacheErrors, Reconstruct) {
  qjlkv_cache *c = cache_.get();
  std::vector<float> k(30 * kHkv * kD), v(k.size());
  QT_EXPECT_FAIL(qjlkv_cache_reconstruct(nullptr, 0, 1, 0, 30, k.data(), v.data()), kInvalid, "c", "cache");
  QT_EXPECT_FAIL(qjlkv_cache_reconstruct(c, 0, 1, 0, 30, nullptr, nullptr), kInvalid, "keys_out", "values_out");
  QT_EXPECT_FAIL(qjlkv_cache_reconstruct(c, kLayers, 1, 0, 30, k.data(), v.data()), kInvalid, "layer");
  QT_EXPECT_FAIL(qjlkv_cache_reconstruct(c, 0, 1, 0, 0, k.data(), v.data()), kInvalid, "count");
  QT_EXPECT_FAIL(qjlkv_cache_reconstruct(c, 0, 1, 0, 31, k.data(), v.data()), kInvalid, "first", "count");
  QT_EXPECT_FAIL(qjlkv_cache_reconstruct(c, 0, 1, 30, 1, k.data(), v.data()), kInvalid, "first", "count");
  QT_EXPECT_FAIL(qjlkv_cache_reconstruct(c, 0, 1, ~uint64_t(0), 2, k.data(), v.data()), kInvalid, "first", "count");
  QT_EXPECT_FAIL(qjlkv_cache_reconstruct(c, 0, 77, 0, 1, k.data(), v.data()), kInvalid, "seq", "sequence");
  QT_EXPECT_OK(qjlkv_cache_reconstruct(c, 0, 1, 29, 1, k.data(), nullptr));
}

TEST_F(CacheErrors, LengthSketchClear) {
  qjlkv_cache *c = cache_.get();
  uint64_t n = 0;
  QT_EXPECT_FAIL(qjlkv_cache_length(nullptr, 0, 1, &n), kInvalid, "c", "cache");
  QT_EXPECT_FAIL(qjlkv_cache_length(c, 0, 1, nullptr), kInvalid, "out");
  QT_EXPECT_FAIL(qjlkv_cache_length(c, kLayers, 1, &n), kInvalid, "layer");
  n = 99;
  QT_EXPECT_OK(qjlkv_cache_length(c, 0, 123456, &n));
  EXPECT_EQ(n, 0u) << "a sequence never appended to has length 0";

  const qjlkv_sketch *s = nullptr;
  QT_EXPECT_FAIL(qjlkv_cache_sketch(nullptr, 0, &s), kInvalid, "c", "cache");
  QT_EXPECT_FAIL(qjlkv_cache_sketch(c, 0, nullptr), kInvalid, "out");
  QT_EXPECT_FAIL(qjlkv_cache_sketch(c, kLayers, &s), kInvalid, "layer");
  for (const char *preset : {"exact", "kivi", "ott"}) {
    qt::Cache other = qt::make_cache(qt::make_config(preset, 1, 1, 1, 64));
    ASSERT_TRUE(other);
    QT_EXPECT_FAIL(qjlkv_cache_sketch(other.get(), 0, &s), QJLKV_ERROR_UNSUPPORTED, "key_method");
  }
  QT_EXPECT_FAIL(qjlkv_cache_clear_sequence(nullptr, 1), kInvalid, "c", "cache");
}

TEST_F(CacheErrors, Stats) {
  qjlkv_cache *c = cache_.get();
  qjlkv_stats st;
  std::memset(&st, 0, sizeof st);
  st.struct_size = sizeof st;
  QT_EXPECT_FAIL(qjlkv_cache_stats(nullptr, &st), kInvalid, "c", "cache");
  QT_EXPECT_FAIL(qjlkv_cache_stats(c, nullptr), kInvalid, "out");
  for (uint32_t size : {0u, 4u, uint32_t(sizeof(qjlkv_stats) + 8)}) {
    st.struct_size = size;
    QT_EXPECT_FAIL(qjlkv_cache_stats(c, &st), kInvalid, "struct_size");
  }
  // Only sizes that shipped: 0.1's draft stopped after bits_per_number, but no release did.
  st.struct_size = uint32_t(offsetof(qjlkv_stats, bytes_keys_quantized));
  QT_EXPECT_FAIL(qjlkv_cache_stats(c, &st), kInvalid, "struct_size");
  st.struct_size = QJLKV_STATS_SIZE_0_1;
  QT_EXPECT_OK(qjlkv_cache_stats(c, &st));
  EXPECT_EQ(st.struct_size, QJLKV_STATS_SIZE_0_1);
}

// A program built against 0.1 passes a 112-byte config whose `int32_t device` (-1 = CPU,
// >= 0 = CUDA ordinal) sits where device_ordinal is: the library keeps that meaning.
int32_t legacy_device(const qjlkv_config &cfg) {
  int32_t device;
  std::memcpy(&device, &cfg.device_ordinal, sizeof device);
  return device;
}

TEST(Errors, ConfigOfRelease01KeepsItsMeaning) {
  // 0.1's struct inside a larger buffer: nothing beyond its 112 bytes is read or written.
  qjlkv_config cfg;
  std::memset(&cfg, 0xEE, sizeof cfg);
  cfg.struct_size = QJLKV_CONFIG_SIZE_0_1;
  QT_ASSERT_OK(qjlkv_config_init(&cfg, "qjl", 2, 4, 2, 64));
  EXPECT_EQ(cfg.struct_size, QJLKV_CONFIG_SIZE_0_1);
  EXPECT_EQ(legacy_device(cfg), -1) << "0.1's default device: the CPU";
  const auto *bytes = reinterpret_cast<const uint8_t *>(&cfg);
  for (size_t i = QJLKV_CONFIG_SIZE_0_1; i < sizeof cfg; ++i) ASSERT_EQ(bytes[i], 0xEE) << "byte " << i;
  // 0.1 callers may leave garbage in what was their tail padding.
  std::memset(&cfg.unused_0_1, 0x77, sizeof cfg.unused_0_1);
  QT_EXPECT_OK(qjlkv_config_validate(&cfg));
  qt::Cache cache = qt::make_cache(cfg);
  ASSERT_TRUE(cache);
  qjlkv_config back;
  std::memset(&back, 0xEE, sizeof back);
  back.struct_size = QJLKV_CONFIG_SIZE_0_1;
  QT_ASSERT_OK(qjlkv_cache_config(cache.get(), &back));
  EXPECT_EQ(legacy_device(back), -1);
  EXPECT_EQ(back.unused_0_1, 0u);
  EXPECT_EQ(back.head_dim, 64u);
  for (size_t i = QJLKV_CONFIG_SIZE_0_1; i < sizeof back; ++i)
    ASSERT_EQ(reinterpret_cast<const uint8_t *>(&back)[i], 0xEE) << "byte " << i;
  // The same cache, asked with this header's size: CPU backend, ordinal 0.
  qjlkv_config now{};
  now.struct_size = sizeof now;
  QT_ASSERT_OK(qjlkv_cache_config(cache.get(), &now));
  EXPECT_EQ(now.backend, uint32_t(QJLKV_BACKEND_CPU));
  EXPECT_EQ(now.device_ordinal, 0u);

  // 0.1's rule for its device field: -1 or an ordinal; an ordinal means CUDA.
  const int32_t minus_two = -2;
  std::memcpy(&cfg.device_ordinal, &minus_two, sizeof minus_two);
  QT_EXPECT_FAIL(qjlkv_config_validate(&cfg), kInvalid, "device");
  const int32_t gpu0 = 0;
  std::memcpy(&cfg.device_ordinal, &gpu0, sizeof gpu0);
  QT_EXPECT_OK(qjlkv_config_validate(&cfg));
  qjlkv_cache *c = nullptr;
  const qjlkv_status s = qjlkv_cache_create(&cfg, &c);
  if (s == QJLKV_OK) {  // a CUDA build on a machine with a GPU: device 0 of 0.1 is CUDA device 0
    QT_EXPECT_OK(qjlkv_cache_config(c, &now));
    EXPECT_EQ(now.backend, uint32_t(QJLKV_BACKEND_CUDA));
    EXPECT_EQ(now.device_ordinal, 0u);
    qjlkv_cache_destroy(c);
  } else {
    EXPECT_TRUE(s == QJLKV_ERROR_UNSUPPORTED || s == QJLKV_ERROR_DEVICE) << qt::describe(s);
    EXPECT_NE(std::string(qjlkv_last_error_message()).find("CUDA"), std::string::npos) << qjlkv_last_error_message();
  }
}

}  // namespace
