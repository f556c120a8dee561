// Export and import (docs/FORMAT.md): the CRC-32C against the published vectors, round trips of
// every key method, dtype and layer range followed by a continued decode that must stay
// bit-identical to the cache that never left, the streaming variants, and every refusal (each
// leaving the destination unchanged).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "crc32c.hpp"
#include "testing.hpp"

namespace {

using qt::Cache;

// ---- CRC-32C --------------------------------------------------------------------------------------
TEST(Crc32c, CheckValueAndRfc3720Vectors) {
  EXPECT_EQ(qjlkv::crc32c("123456789", 9), 0xE3069283u);  // the catalogue's check value
  std::vector<uint8_t> bytes(32, 0x00);
  EXPECT_EQ(qjlkv::crc32c(bytes.data(), 32), 0x8A9136AAu);  // RFC 3720 B.4: 32 bytes of zeros
  std::fill(bytes.begin(), bytes.end(), 0xFF);
  EXPECT_EQ(qjlkv::crc32c(bytes.data(), 32), 0x62A8AB43u);  // 32 bytes of ones
  for (int i = 0; i < 32; ++i) bytes[i] = uint8_t(i);
  EXPECT_EQ(qjlkv::crc32c(bytes.data(), 32), 0x46DD794Eu);  // incrementing
  for (int i = 0; i < 32; ++i) bytes[i] = uint8_t(31 - i);
  EXPECT_EQ(qjlkv::crc32c(bytes.data(), 32), 0x113FDB5Cu);  // decrementing
  EXPECT_EQ(qjlkv::crc32c(nullptr, 0), 0u);
}

TEST(Crc32c, PiecesAndImplementationsAgree) {
  qt::Rng rng(5);
  std::vector<uint8_t> data(1000);
  for (uint8_t &b : data) b = uint8_t(rng.below(256));
  for (size_t offset : {0, 1, 3, 7}) {
    for (size_t size : {0, 1, 7, 8, 9, 63, 500, 993}) {
      const uint8_t *p = data.data() + offset;
      const uint32_t whole = qjlkv::crc32c(p, size);
      EXPECT_EQ(qjlkv::crc32c_update_portable(0xFFFFFFFFu, p, size) ^ 0xFFFFFFFFu, whole);
#ifdef QJLKV_CRC32C_SSE42
      if (__builtin_cpu_supports("sse4.2")) {
        EXPECT_EQ(qjlkv::crc32c_update_sse42(0xFFFFFFFFu, p, size) ^ 0xFFFFFFFFu, whole);
      }
#endif
      const size_t half = size / 3;
      EXPECT_EQ(qjlkv::crc32c_update(qjlkv::crc32c_update(0xFFFFFFFFu, p, half), p + half, size - half) ^ 0xFFFFFFFFu,
                whole);
    }
  }
}

// ---- helpers --------------------------------------------------------------------------------------
std::vector<uint8_t> rows(const qjlkv_config &cfg, uint32_t tokens, uint64_t seed) {
  qt::Rng rng(seed);
  std::vector<float> x = rng.normals(size_t(tokens) * cfg.num_kv_heads * cfg.head_dim);
  // A few small keys and values, so that OTT's pool changes hands (it keeps the smallest norms).
  for (size_t i = 0; i < x.size(); i += 7 * cfg.head_dim) x[i] *= 0.01f;
  return qt::encode(x, qt::dtype_of(cfg));
}

void append(qjlkv_cache *c, const qjlkv_config &cfg, uint32_t layer, uint32_t seq, uint32_t n, uint64_t seed) {
  const std::vector<uint8_t> k = rows(cfg, n, seed), v = rows(cfg, n, seed + 1000);
  QT_ASSERT_OK(qjlkv_cache_append(c, layer, seq, n, k.data(), v.data()));
}

std::vector<uint8_t> export_buffer(const qjlkv_cache *c, uint32_t seq, uint32_t first, uint32_t n) {
  uint64_t size = 0;
  EXPECT_EQ(qjlkv_cache_export_size(c, seq, first, n, &size), QJLKV_OK) << qt::describe(QJLKV_OK);
  std::vector<uint8_t> out(size, 0xEE);
  const qjlkv_status s = qjlkv_cache_export(c, seq, first, n, out.data(), out.size());
  EXPECT_EQ(s, QJLKV_OK) << qt::describe(s);
  return out;
}

bool same_bits(const void *a, const void *b, size_t bytes) { return bytes == 0 || std::memcmp(a, b, bytes) == 0; }

// Everything observable of (layer, seq) in a and (layer, seq_b) in b is bitwise equal: lengths,
// the reconstruction, the scores of a query and attention of up to 3 queries.
void expect_identical(qjlkv_cache *a, uint32_t seq_a, qjlkv_cache *b, uint32_t seq_b, const qjlkv_config &cfg,
                      uint64_t seed, const std::string &what) {
  SCOPED_TRACE(what);
  for (uint32_t l = 0; l < cfg.num_layers; ++l) {
    const uint64_t len = qt::length_of(a, l, seq_a);
    ASSERT_EQ(qt::length_of(b, l, seq_b), len) << "layer " << l;
    if (len == 0) continue;
    const size_t floats = len * cfg.num_kv_heads * cfg.head_dim;
    std::vector<float> ka(floats), va(floats), kb(floats), vb(floats);
    QT_ASSERT_OK(qjlkv_cache_reconstruct(a, l, seq_a, 0, len, ka.data(), va.data()));
    QT_ASSERT_OK(qjlkv_cache_reconstruct(b, l, seq_b, 0, len, kb.data(), vb.data()));
    EXPECT_TRUE(same_bits(ka.data(), kb.data(), floats * 4)) << "layer " << l << ": reconstructed keys differ";
    EXPECT_TRUE(same_bits(va.data(), vb.data(), floats * 4)) << "layer " << l << ": reconstructed values differ";
    const uint32_t nq = uint32_t(std::min<uint64_t>(3, len));
    qt::Rng rng(seed + l);
    const std::vector<uint8_t> q = qt::encode(rng.normals(size_t(nq) * cfg.num_q_heads * cfg.head_dim), qt::dtype_of(cfg));
    std::vector<float> sa(size_t(cfg.num_q_heads) * len), sb(sa.size());
    QT_ASSERT_OK(qjlkv_cache_scores(a, l, seq_a, q.data(), sa.data(), sa.size()));
    QT_ASSERT_OK(qjlkv_cache_scores(b, l, seq_b, q.data(), sb.data(), sb.size()));
    EXPECT_TRUE(same_bits(sa.data(), sb.data(), sa.size() * 4)) << "layer " << l << ": scores differ";
    std::vector<uint8_t> oa(q.size()), ob(q.size());
    QT_ASSERT_OK(qjlkv_cache_attend(a, l, seq_a, nq, q.data(), 0.0f, oa.data()));
    QT_ASSERT_OK(qjlkv_cache_attend(b, l, seq_b, nq, q.data(), 0.0f, ob.data()));
    EXPECT_TRUE(same_bits(oa.data(), ob.data(), oa.size())) << "layer " << l << ": attention differs";
  }
}

// ---- round trips ------------------------------------------------------------------------------------
struct Variant {
  const char *name;
  const char *preset;
  qjlkv_dtype dtype;
  void (*tweak)(qjlkv_config &);
};

void no_tweak(qjlkv_config &) {}
void qjl_no_outliers(qjlkv_config &c) {
  c.outlier_channels = 0;
  c.outlier_sketch_dim = 0;
  c.value_bits = 8;
}
void qjl_initial_layers(qjlkv_config &c) {
  c.initial_layers = 1;
  c.initial_key_sketch_dim = 128;
  c.initial_outlier_sketch_dim = 64;
  c.value_bits = 4;
  c.value_group_size = 8;
}
void kivi_4bit_no_residual(qjlkv_config &c) {
  c.key_bits = 4;
  c.value_bits = 4;
  c.residual_tokens = 0;
}
void ott_tiny_spill(qjlkv_config &c) { c.outlier_spill_tokens = 2; }  // tracing stops early
void ott_exact_values(qjlkv_config &c) {
  c.value_bits = 16;
  c.key_bits = 8;
}

// Small shapes that reach every state in a few dozen tokens: B = 16, R = 8, OTT's first layer
// untraced.
qjlkv_config variant_config(const Variant &v) {
  qjlkv_config cfg = qt::make_config(v.preset, 3, 4, 2, 32);
  cfg.dtype = v.dtype;
  cfg.block_tokens = 16;
  cfg.residual_tokens = 8;
  cfg.seed = 1234;
  if (cfg.key_method == QJLKV_KEYS_OTT) {
    cfg.outlier_tokens = 3;
    cfg.outlier_skip_layers = 1;
  }
  v.tweak(cfg);
  QT_EXPECT_OK(qjlkv_config_validate(&cfg));
  return cfg;
}

class RoundTrip : public ::testing::TestWithParam<Variant> {};

// Layer 0: blocks and a tail; layer 1: a tail only; layer 2: blocks with the shortest tail.
void fill_source(qjlkv_cache *c, const qjlkv_config &cfg, uint32_t seq) {
  const uint32_t B = cfg.block_tokens, R = cfg.residual_tokens;
  append(c, cfg, 0, seq, R + 3 * B + 5, 10);
  append(c, cfg, 1, seq, R + B - 1, 20);
  append(c, cfg, 2, seq, 1, 30);  // a decode-sized append, then a prefill onto it
  append(c, cfg, 2, seq, R + 4 * B - 1, 31);
}

// Appends the same tokens, one at a time and in a batch, to (seq_a of a) and (seq_b of b),
// crossing block boundaries, comparing attention after each step.
void continue_decode(qjlkv_cache *a, uint32_t seq_a, qjlkv_cache *b, uint32_t seq_b, const qjlkv_config &cfg) {
  const uint32_t steps = 2 * cfg.block_tokens + 3;
  for (uint32_t step = 0; step < steps; ++step) {
    for (uint32_t l = 0; l < cfg.num_layers; ++l) {
      const std::vector<uint8_t> k = rows(cfg, 1, 500 + step * 7 + l), v = rows(cfg, 1, 900 + step * 7 + l);
      QT_ASSERT_OK(qjlkv_cache_append(a, l, seq_a, 1, k.data(), v.data()));
      QT_ASSERT_OK(qjlkv_cache_append_batch(b, l, 1, &seq_b, k.data(), v.data()));
      qt::Rng rng(step * 31 + l);
      const std::vector<uint8_t> q = qt::encode(rng.normals(size_t(cfg.num_q_heads) * cfg.head_dim), qt::dtype_of(cfg));
      std::vector<uint8_t> oa(q.size()), ob(q.size());
      QT_ASSERT_OK(qjlkv_cache_attend(a, l, seq_a, 1, q.data(), 0.0f, oa.data()));
      QT_ASSERT_OK(qjlkv_cache_attend(b, l, seq_b, 1, q.data(), 0.0f, ob.data()));
      ASSERT_TRUE(same_bits(oa.data(), ob.data(), oa.size())) << "step " << step << ", layer " << l;
    }
  }
}

TEST_P(RoundTrip, AllLayersThenContinuedDecodeIsBitIdentical) {
  const qjlkv_config cfg = variant_config(GetParam());
  Cache source = qt::make_cache(cfg);
  fill_source(source.get(), cfg, 7);
  const std::vector<uint8_t> stream = export_buffer(source.get(), 7, 0, cfg.num_layers);
  ASSERT_FALSE(stream.empty());

  qjlkv_config other_threads = cfg;
  other_threads.num_threads = 3;  // the stream does not depend on the thread count
  Cache dest = qt::make_cache(other_threads);
  append(dest.get(), cfg, 0, 1, 20, 77);  // another sequence, untouched by the import
  QT_ASSERT_OK(qjlkv_cache_import(dest.get(), 42, stream.data(), stream.size()));
  expect_identical(source.get(), 7, dest.get(), 42, cfg, 1, "after import");
  // The destination's own export is the same stream, byte for byte.
  EXPECT_EQ(export_buffer(dest.get(), 42, 0, cfg.num_layers), stream);
  ASSERT_NO_FATAL_FAILURE(continue_decode(source.get(), 7, dest.get(), 42, cfg));
  expect_identical(source.get(), 7, dest.get(), 42, cfg, 2, "after the continued decode");
  EXPECT_EQ(export_buffer(dest.get(), 42, 0, cfg.num_layers), export_buffer(source.get(), 7, 0, cfg.num_layers));
  EXPECT_EQ(qt::length_of(dest.get(), 0, 1), 20u);
}

TEST_P(RoundTrip, LayerRangesImportSeparately) {
  const qjlkv_config cfg = variant_config(GetParam());
  Cache source = qt::make_cache(cfg);
  fill_source(source.get(), cfg, 3);
  // A pipeline split: layer 0 in one stream, layers 1-2 in another.
  const std::vector<uint8_t> first = export_buffer(source.get(), 3, 0, 1);
  const std::vector<uint8_t> rest = export_buffer(source.get(), 3, 1, 2);
  Cache dest = qt::make_cache(cfg);
  QT_ASSERT_OK(qjlkv_cache_import(dest.get(), 3, rest.data(), rest.size()));
  EXPECT_EQ(qt::length_of(dest.get(), 0, 3), 0u);
  EXPECT_EQ(qt::length_of(dest.get(), 2, 3), qt::length_of(source.get(), 2, 3));
  QT_ASSERT_OK(qjlkv_cache_import(dest.get(), 3, first.data(), first.size()));
  expect_identical(source.get(), 3, dest.get(), 3, cfg, 3, "after two partial imports");
  ASSERT_NO_FATAL_FAILURE(continue_decode(source.get(), 3, dest.get(), 3, cfg));
}

TEST_P(RoundTrip, StreamingVariantsMatchTheBuffer) {
  const qjlkv_config cfg = variant_config(GetParam());
  Cache source = qt::make_cache(cfg);
  fill_source(source.get(), cfg, 9);
  const std::vector<uint8_t> stream = export_buffer(source.get(), 9, 0, cfg.num_layers);
  std::vector<uint8_t> streamed;
  const auto collect = [](void *user, const void *data, size_t size) -> size_t {
    const auto *p = static_cast<const uint8_t *>(data);
    static_cast<std::vector<uint8_t> *>(user)->insert(static_cast<std::vector<uint8_t> *>(user)->end(), p, p + size);
    return size;
  };
  QT_ASSERT_OK(qjlkv_cache_export_stream(source.get(), 9, 0, cfg.num_layers, collect, &streamed));
  EXPECT_EQ(streamed, stream);
  // A reader that hands out at most 5 bytes per call... in a loop, as a pipe would.
  struct Pipe {
    const std::vector<uint8_t> *bytes;
    size_t at = 0;
  } pipe{&stream};
  const auto read = [](void *user, void *data, size_t size) -> size_t {
    auto *p = static_cast<Pipe *>(user);
    size_t done = 0;
    while (done < size && p->at < p->bytes->size()) {
      const size_t n = std::min({size - done, size_t(5), p->bytes->size() - p->at});
      std::memcpy(static_cast<uint8_t *>(data) + done, p->bytes->data() + p->at, n);
      p->at += n;
      done += n;
    }
    return done;
  };
  Cache dest = qt::make_cache(cfg);
  QT_ASSERT_OK(qjlkv_cache_import_stream(dest.get(), 9, read, &pipe));
  EXPECT_EQ(pipe.at, stream.size());
  expect_identical(source.get(), 9, dest.get(), 9, cfg, 4, "streamed import");
}

const Variant kVariants[] = {
    {"qjl_f32", "qjl", QJLKV_DTYPE_F32, no_tweak},
    {"qjl_f16", "qjl", QJLKV_DTYPE_F16, no_tweak},
    {"qjl_bf16", "qjl", QJLKV_DTYPE_BF16, no_tweak},
    {"qjl_no_outliers_v8", "qjl", QJLKV_DTYPE_F32, qjl_no_outliers},
    {"qjl_initial_layers_v4", "qjl", QJLKV_DTYPE_F16, qjl_initial_layers},
    {"kivi_f32", "kivi", QJLKV_DTYPE_F32, no_tweak},
    {"kivi_f16", "kivi", QJLKV_DTYPE_F16, no_tweak},
    {"kivi_bf16", "kivi", QJLKV_DTYPE_BF16, no_tweak},
    {"kivi_4bit_no_residual", "kivi", QJLKV_DTYPE_F32, kivi_4bit_no_residual},
    {"ott_f32", "ott", QJLKV_DTYPE_F32, no_tweak},
    {"ott_f16", "ott", QJLKV_DTYPE_F16, no_tweak},
    {"ott_bf16", "ott", QJLKV_DTYPE_BF16, no_tweak},
    {"ott_tiny_spill", "ott", QJLKV_DTYPE_F32, ott_tiny_spill},
    {"ott_exact_values_8bit_keys", "ott", QJLKV_DTYPE_BF16, ott_exact_values},
    {"exact_f32", "exact", QJLKV_DTYPE_F32, no_tweak},
    {"exact_f16", "exact", QJLKV_DTYPE_F16, no_tweak},
    {"exact_bf16", "exact", QJLKV_DTYPE_BF16, no_tweak},
};
INSTANTIATE_TEST_SUITE_P(Methods, RoundTrip, ::testing::ValuesIn(kVariants),
                         [](const ::testing::TestParamInfo<Variant> &info) { return std::string(info.param.name); });

// The outlier states (pool, spilled, tracing) of every traced (layer, kv head) of a stream,
// read by walking its sections as docs/FORMAT.md lays them out.
struct OutlierState {
  uint32_t pool, spilled, tracing;
};
std::vector<OutlierState> outlier_states(const std::vector<uint8_t> &s, const qjlkv_config &cfg) {
  const auto u32 = [&](size_t at) {
    uint32_t v;
    std::memcpy(&v, s.data() + at, 4);
    return v;
  };
  std::vector<OutlierState> states;
  const size_t io = qt::dtype_bytes(qt::dtype_of(cfg)), row = size_t(cfg.head_dim) * io;
  size_t at = 128;
  for (uint32_t l = 0; l < u32(28); ++l) {
    const uint32_t heads = u32(at + 20), blocks = u32(at + 32), tail = u32(at + 36), record = u32(at + 40);
    size_t p = at + 48 + size_t(blocks) * cfg.num_kv_heads * record + 2 * size_t(tail) * cfg.num_kv_heads * row;
    for (uint32_t h = 0; h < heads; ++h) {
      const OutlierState st{u32(p), u32(p + 4), u32(p + 8)};
      states.push_back(st);
      p += 16 + size_t(st.pool + st.spilled) * (4 + 2 * row) + 4 * size_t(st.pool);
    }
    uint64_t body;
    std::memcpy(&body, s.data() + at + 8, 8);
    EXPECT_EQ(p, at + 16 + body) << "layer " << l;
    at += 16 + body;
  }
  EXPECT_EQ(at + 4, s.size());
  return states;
}

// The OTT variants really reach the states they are meant to test: tokens in the pool and the
// spill area, and (tiny spill area) tracing stopped.
TEST(RoundTripCoverage, OttStreamsHoldPoolSpillAndStoppedTracing) {
  for (const Variant &v : kVariants) {
    if (std::string(v.preset) != "ott") continue;
    SCOPED_TRACE(v.name);
    const qjlkv_config cfg = variant_config(v);
    Cache source = qt::make_cache(cfg);
    fill_source(source.get(), cfg, 1);
    const std::vector<OutlierState> states = outlier_states(export_buffer(source.get(), 1, 0, 3), cfg);
    ASSERT_EQ(states.size(), 2u * cfg.num_kv_heads);  // layers 1 and 2 are traced
    bool pool = false, spill = false, stopped = false;
    for (const OutlierState &st : states) {
      pool = pool || st.pool > 0;
      spill = spill || st.spilled > 0;
      stopped = stopped || st.tracing == 0;
    }
    EXPECT_TRUE(pool);
    EXPECT_TRUE(spill);
    EXPECT_EQ(stopped, cfg.outlier_spill_tokens == 2);
  }
}

// ---- refusals ---------------------------------------------------------------------------------------
class Refusal : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg_ = variant_config({"qjl", "qjl", QJLKV_DTYPE_F32, no_tweak});
    source_ = qt::make_cache(cfg_);
    fill_source(source_.get(), cfg_, 5);
    stream_ = export_buffer(source_.get(), 5, 0, cfg_.num_layers);
    dest_ = qt::make_cache(cfg_);
    append(dest_.get(), cfg_, 1, 8, 30, 40);  // the destination holds something else already
    query_ = rows(cfg_, cfg_.num_q_heads / cfg_.num_kv_heads, 3);
    ASSERT_NO_FATAL_FAILURE(snap(&before_));
  }
  void snap(qt::Snapshot *out) {
    qt::take_snapshot(dest_.get(), {{0, 5}, {1, 5}, {2, 5}, {1, 8}}, query_, out);
  }
  // A failed import: the expected status, a fresh message naming `name`, the destination unchanged.
  void expect_refused(const std::vector<uint8_t> &bytes, qjlkv_status expected, const char *name,
                      uint32_t seq = 5) {
    const std::string stale = qt::stale_error_message();
    const qjlkv_status s = qjlkv_cache_import(dest_.get(), seq, bytes.data(), bytes.size());
    EXPECT_TRUE(qt::fails_naming(s, expected, stale, {name}));
    qt::Snapshot after;
    ASSERT_NO_FATAL_FAILURE(snap(&after));
    qt::expect_same_snapshot(before_, after, std::string("import refused for ") + name);
  }
  static void fix_checksums(std::vector<uint8_t> &s) {
    const uint32_t header = qjlkv::crc32c(s.data(), 124);
    std::memcpy(s.data() + 124, &header, 4);
    const uint32_t all = qjlkv::crc32c(s.data(), s.size() - 4);
    std::memcpy(s.data() + s.size() - 4, &all, 4);
  }
  static uint32_t u32_at(const std::vector<uint8_t> &s, size_t at) {
    uint32_t v;
    std::memcpy(&v, s.data() + at, 4);
    return v;
  }
  static void set_u32(std::vector<uint8_t> &s, size_t at, uint32_t v) { std::memcpy(s.data() + at, &v, 4); }

  qjlkv_config cfg_;
  Cache source_, dest_;
  std::vector<uint8_t> stream_, query_;
  qt::Snapshot before_;
};

// Offsets of docs/FORMAT.md: header 128 bytes; the first layer section's header 16, its fields 32.
constexpr size_t kFirstSection = 128, kFirstLayerFields = 144, kFirstBlock = 176;

TEST_F(Refusal, ExportArguments) {
  uint64_t size = 0;
  const std::string stale = qt::stale_error_message();
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_export_size(nullptr, 5, 0, 1, &size), QJLKV_ERROR_INVALID_ARGUMENT,
                               stale, {"c"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_export_size(source_.get(), 5, 0, 1, nullptr),
                               QJLKV_ERROR_INVALID_ARGUMENT, stale, {"size"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_export_size(source_.get(), 5, 0, 0, &size), QJLKV_ERROR_INVALID_ARGUMENT,
                               stale, {"num_layers"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_export_size(source_.get(), 5, 2, 2, &size), QJLKV_ERROR_INVALID_ARGUMENT,
                               stale, {"first_layer"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_export_size(source_.get(), 5, 0xFFFFFFFFu, 2, &size),
                               QJLKV_ERROR_INVALID_ARGUMENT, stale, {"first_layer"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_export_size(source_.get(), 6, 0, 3, &size), QJLKV_ERROR_INVALID_ARGUMENT,
                               stale, {"seq"}));
  std::vector<uint8_t> small(stream_.size() - 1);
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_export(source_.get(), 5, 0, 3, small.data(), small.size()),
                               QJLKV_ERROR_INVALID_ARGUMENT, stale, {"buf_size"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_export(source_.get(), 5, 0, 3, nullptr, 1 << 20),
                               QJLKV_ERROR_INVALID_ARGUMENT, stale, {"buf"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_export_stream(source_.get(), 5, 0, 3, nullptr, nullptr),
                               QJLKV_ERROR_INVALID_ARGUMENT, stale, {"write"}));
  const auto refuse = [](void *, const void *, size_t size) -> size_t { return size / 2; };
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_export_stream(source_.get(), 5, 0, 3, refuse, nullptr),
                               QJLKV_ERROR_INVALID_ARGUMENT, stale, {"write"}));
  // A larger buffer is fine; exactly the stream's bytes are written.
  std::vector<uint8_t> large(stream_.size() + 10, 0xAB);
  QT_ASSERT_OK(qjlkv_cache_export(source_.get(), 5, 0, 3, large.data(), large.size()));
  EXPECT_TRUE(std::equal(stream_.begin(), stream_.end(), large.begin()));
  EXPECT_EQ(large.back(), 0xAB);
}

TEST_F(Refusal, ImportArguments) {
  const std::string stale = qt::stale_error_message();
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_import(nullptr, 5, stream_.data(), stream_.size()),
                               QJLKV_ERROR_INVALID_ARGUMENT, stale, {"c"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_import(dest_.get(), 5, nullptr, stream_.size()),
                               QJLKV_ERROR_INVALID_ARGUMENT, stale, {"buf"}));
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_import_stream(dest_.get(), 5, nullptr, nullptr),
                               QJLKV_ERROR_INVALID_ARGUMENT, stale, {"read"}));
  std::vector<uint8_t> longer = stream_;
  longer.push_back(0);
  expect_refused(longer, QJLKV_ERROR_INVALID_ARGUMENT, "size");
}

TEST_F(Refusal, TargetMustBeEmptyInTheStreamsLayers) {
  expect_refused(stream_, QJLKV_ERROR_INVALID_ARGUMENT, "seq", 8);
  // Once cleared, the same import succeeds.
  QT_ASSERT_OK(qjlkv_cache_clear_sequence(dest_.get(), 8));
  QT_ASSERT_OK(qjlkv_cache_import(dest_.get(), 8, stream_.data(), stream_.size()));
  expect_identical(source_.get(), 5, dest_.get(), 8, cfg_, 9, "after clearing the target");
}

TEST_F(Refusal, OtherFormatVersionAndNotAStream) {
  std::vector<uint8_t> v2 = stream_;
  set_u32(v2, 8, 2);
  fix_checksums(v2);
  expect_refused(v2, QJLKV_ERROR_INVALID_ARGUMENT, "version");
  std::vector<uint8_t> magic = stream_;
  magic[0] = 'X';
  expect_refused(magic, QJLKV_ERROR_CORRUPT_DATA, "magic");
  expect_refused(std::vector<uint8_t>(3, 0), QJLKV_ERROR_CORRUPT_DATA, "truncated");
}

TEST_F(Refusal, MismatchedConfigsNameTheField) {
  struct Case {
    const char *field;
    void (*change)(qjlkv_config &);
  };
  const Case cases[] = {
      {"seed", [](qjlkv_config &c) { c.seed += 1; }},
      {"dtype", [](qjlkv_config &c) { c.dtype = QJLKV_DTYPE_F16; }},
      {"key_method", [](qjlkv_config &c) { c.key_method = QJLKV_KEYS_EXACT; }},
      {"num_kv_heads", [](qjlkv_config &c) { c.num_kv_heads = 4; }},
      {"head_dim", [](qjlkv_config &c) { c.head_dim = 64; }},
      {"block_tokens", [](qjlkv_config &c) { c.block_tokens = 24; }},
      {"residual_tokens", [](qjlkv_config &c) { c.residual_tokens = 9; }},
      {"key_sketch_dim", [](qjlkv_config &c) { c.key_sketch_dim = 128; }},
      {"outlier_channels", [](qjlkv_config &c) { c.outlier_channels = 2; }},
      {"value_bits", [](qjlkv_config &c) { c.value_bits = 4; }},
      {"value_group_size", [](qjlkv_config &c) { c.value_group_size = 16; }},
  };
  for (const Case &k : cases) {
    SCOPED_TRACE(k.field);
    qjlkv_config other = cfg_;
    k.change(other);
    Cache target = qt::make_cache(other);
    ASSERT_TRUE(target);
    const std::string stale = qt::stale_error_message();
    const qjlkv_status s = qjlkv_cache_import(target.get(), 5, stream_.data(), stream_.size());
    EXPECT_TRUE(qt::fails_naming(s, QJLKV_ERROR_INVALID_ARGUMENT, stale, {k.field}));
    EXPECT_EQ(qt::stats_of(target.get()).tokens, 0u);
  }
  // Fields that do not determine the stored bytes may differ: query heads, threads, layer count.
  qjlkv_config compatible = cfg_;
  compatible.num_q_heads = 2;
  compatible.num_layers = 5;
  compatible.num_threads = 2;
  Cache target = qt::make_cache(compatible);
  QT_ASSERT_OK(qjlkv_cache_import(target.get(), 5, stream_.data(), stream_.size()));
  EXPECT_EQ(qt::length_of(target.get(), 2, 5), qt::length_of(source_.get(), 2, 5));
  // ... but the stream's layers must exist.
  qjlkv_config fewer = cfg_;
  fewer.num_layers = 2;
  Cache small = qt::make_cache(fewer);
  const std::string stale = qt::stale_error_message();
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_import(small.get(), 5, stream_.data(), stream_.size()),
                               QJLKV_ERROR_INVALID_ARGUMENT, stale, {"layers"}));
}

TEST_F(Refusal, EveryTruncationIsCorruptData) {
  const std::string stale = qt::stale_error_message();
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_import(dest_.get(), 5, stream_.data(), 0), QJLKV_ERROR_CORRUPT_DATA, stale,
                               {"truncated"}));
  for (size_t size = 1; size < stream_.size(); size += (size < 300 ? 1 : 97)) {
    std::vector<uint8_t> cut(stream_.begin(), stream_.begin() + ptrdiff_t(size));
    SCOPED_TRACE("truncated to " + std::to_string(size));
    expect_refused(cut, QJLKV_ERROR_CORRUPT_DATA, "truncated");
    if (HasFatalFailure()) return;
  }
}

TEST_F(Refusal, EveryFlippedBitIsRefused) {
  // Each byte of the header and of the first layer section's start, and a sample of the rest.
  for (size_t at = 0; at < stream_.size(); at += (at < 400 ? 1 : 61)) {
    std::vector<uint8_t> flipped = stream_;
    flipped[at] ^= uint8_t(1u << (at % 8));
    const qjlkv_status s = qjlkv_cache_import(dest_.get(), 5, flipped.data(), flipped.size());
    ASSERT_TRUE(s == QJLKV_ERROR_CORRUPT_DATA || s == QJLKV_ERROR_INVALID_ARGUMENT)
        << "byte " << at << ": " << qt::describe(s);
    EXPECT_STRNE(qjlkv_last_error_message(), "");
  }
  qt::Snapshot after;
  ASSERT_NO_FATAL_FAILURE(snap(&after));
  qt::expect_same_snapshot(before_, after, "flipped bits");
}

// Streams whose checksums are right but whose contents no cache holds (a buggy or hostile writer).
TEST_F(Refusal, ConsistentChecksumsButImpossibleContents) {
  const uint32_t blocks = u32_at(stream_, kFirstLayerFields + 16);
  const uint32_t record = u32_at(stream_, kFirstLayerFields + 24);
  ASSERT_EQ(u32_at(stream_, kFirstSection), 1u);  // the layer tag
  ASSERT_GT(blocks, 0u);
  {
    std::vector<uint8_t> s = stream_;
    set_u32(s, kFirstLayerFields + 16, blocks + 1);  // more blocks than the length stores
    fix_checksums(s);
    expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "blocks");
  }
  {
    // The first outlier channel of the first block: after 2 fp16 norm arrays and the sign bits.
    const uint32_t B = cfg_.block_tokens, m = cfg_.key_sketch_dim, m_out = cfg_.outlier_sketch_dim;
    std::vector<uint8_t> s = stream_;
    s[kFirstBlock + 4 * B + B * m / 8 + B * m_out / 8] = 200;  // >= head_dim
    fix_checksums(s);
    expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "outlier");
  }
  {
    std::vector<uint8_t> s = stream_;
    const size_t tail_key = kFirstBlock + size_t(blocks) * cfg_.num_kv_heads * record;
    const float nan = std::nanf("");
    std::memcpy(s.data() + tail_key + 8, &nan, 4);
    fix_checksums(s);
    expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "tail");
  }
  {
    std::vector<uint8_t> s = stream_;
    const uint16_t inf = 0x7c00;  // the first inlier key norm
    std::memcpy(s.data() + kFirstBlock, &inf, 2);
    fix_checksums(s);
    expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "norm");
  }
  {
    std::vector<uint8_t> s = stream_;
    set_u32(s, kFirstSection, 7);  // an unknown section tag
    fix_checksums(s);
    expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "tag");
  }
  {
    std::vector<uint8_t> s = stream_;
    s[200] ^= 1;  // payload only: the header checksum still holds
    expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "checksum");
  }
}

TEST_F(Refusal, StreamThatEndsEarlyThroughTheCallback) {
  struct Source {
    const std::vector<uint8_t> *bytes;
    size_t at, stop;
  } source{&stream_, 0, stream_.size() - 1};
  const auto read = [](void *user, void *data, size_t size) -> size_t {
    auto *s = static_cast<Source *>(user);
    const size_t n = std::min(size, s->stop - s->at);
    std::memcpy(data, s->bytes->data() + s->at, n);
    s->at += n;
    return n;
  };
  const std::string stale = qt::stale_error_message();
  EXPECT_TRUE(qt::fails_naming(qjlkv_cache_import_stream(dest_.get(), 5, read, &source), QJLKV_ERROR_CORRUPT_DATA,
                               stale, {"truncated"}));
  qt::Snapshot after;
  ASSERT_NO_FATAL_FAILURE(snap(&after));
  qt::expect_same_snapshot(before_, after, "short stream");
}

}  // namespace

// Stream format 1 has no sections for attention sinks or rotated values: the "q3"/"q4" tiers are
// refused on both sides, naming the field, and nothing changes.
TEST(Refusals, TiersWithSinksOrRotatedValuesAreNotInFormatOne) {
  for (const char *preset : {"q3", "q4"}) {
    SCOPED_TRACE(preset);
    qjlkv_config cfg = qt::make_config(preset, 2, 4, 2, 32);
    qt::Cache cache = qt::make_cache(cfg);
    ASSERT_TRUE(cache);
    qt::Rng rng(3);
    const std::vector<float> k = rng.normals(size_t(40) * 2 * 32), v = rng.normals(size_t(40) * 2 * 32);
    QT_ASSERT_OK(qjlkv_cache_append(cache.get(), 0, 1, 40, k.data(), v.data()));
    uint64_t size = 0;
    EXPECT_EQ(qjlkv_cache_export_size(cache.get(), 1, 0, 1, &size), QJLKV_ERROR_UNSUPPORTED);
    EXPECT_NE(std::string(qjlkv_last_error_message()).find("config.sink_tokens"), std::string::npos)
        << qjlkv_last_error_message();
    cfg.sink_tokens = 0;  // rotated values alone are refused too
    qt::Cache rotated = qt::make_cache(cfg);
    ASSERT_TRUE(rotated);
    std::vector<uint8_t> stream(64, 0);
    EXPECT_EQ(qjlkv_cache_import(rotated.get(), 0, stream.data(), stream.size()), QJLKV_ERROR_UNSUPPORTED);
    EXPECT_NE(std::string(qjlkv_last_error_message()).find("config.value_method"), std::string::npos)
        << qjlkv_last_error_message();
    EXPECT_EQ(qt::length_of(rotated.get(), 0, 0), 0u);
  }
}
