// Export and import (docs/FORMAT.md): the CRC-32C against the published vectors, round trips of
// every key and value method (attention sinks, rotated values and 3-bit codes included), dtype
// and layer range followed by a continued decode that must stay bit-identical to the cache that
// never left, the streaming variants, streams of format versions 1 and 2 (QJL records with the
// outlier sign bits that version 3 replaced by corrections included), and every refusal (each
// leaving the destination unchanged).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "../fuzz/import_configs.hpp"
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
void sinks_alone(qjlkv_config &c) { c.sink_tokens = 3; }
void rotated_alone(qjlkv_config &c) {
  c.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
  c.value_bits = c.dtype == QJLKV_DTYPE_F32 ? 2 : c.dtype == QJLKV_DTYPE_F16 ? 4 : 3;
}
void three_bit_codes(qjlkv_config &c) {
  c.key_bits = 3;
  c.value_bits = 3;
}
void ott_sinks(qjlkv_config &c) { c.sink_tokens = 5; }  // OTT's positions start after the sinks
void qjl_sinks_rotated_4bit(qjlkv_config &c) {
  c.sink_tokens = 2;
  c.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
  c.value_bits = 4;
}
void exact_keys_rotated_3bit_sinks(qjlkv_config &c) {
  c.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
  c.value_bits = 3;
  c.sink_tokens = 1;
}

void mixed_uniform_values(qjlkv_config &c) {  // mixed keys with another value method and fewer bits
  c.value_method = QJLKV_VALUES_UNIFORM;
  c.value_bits = 4;
  c.key_token_bits = 48;
}

// Small shapes that reach every state in a few dozen tokens: B = 16, R = 8, 4 sink tokens where
// the preset has sinks (the tiers), OTT's first layer untraced.
qjlkv_config variant_config(const Variant &v) {
  qjlkv_config cfg = qt::make_config(v.preset, 3, 4, 2, 32);
  cfg.dtype = v.dtype;
  cfg.block_tokens = 16;
  cfg.residual_tokens = 8;
  if (cfg.sink_tokens) cfg.sink_tokens = 4;
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
struct SourceAppend {
  uint32_t layer, tokens;
  uint64_t seed;
};
std::vector<SourceAppend> source_appends(const qjlkv_config &cfg) {
  const uint32_t B = cfg.block_tokens, R = cfg.residual_tokens;
  return {{0, R + 3 * B + 5, 10},
          {1, R + B - 1, 20},
          {2, 1, 30},  // a decode-sized append, then a prefill onto it
          {2, R + 4 * B - 1, 31}};
}

void fill_source(qjlkv_cache *c, const qjlkv_config &cfg, uint32_t seq) {
  for (const SourceAppend &a : source_appends(cfg)) append(c, cfg, a.layer, seq, a.tokens, a.seed);
}

// The keys fill_source appends, per layer from position 0, as the cache reads them: [pos][Hkv][d].
std::vector<std::vector<float>> source_keys(const qjlkv_config &cfg) {
  std::vector<std::vector<float>> keys(cfg.num_layers);
  for (const SourceAppend &a : source_appends(cfg)) {
    const std::vector<uint8_t> k = rows(cfg, a.tokens, a.seed);
    const std::vector<float> x = qt::decode(k.data(), size_t(a.tokens) * cfg.num_kv_heads * cfg.head_dim,
                                            qt::dtype_of(cfg));
    keys[a.layer].insert(keys[a.layer].end(), x.begin(), x.end());
  }
  return keys;
}

// ---- streams of format versions 1 and 2 ---------------------------------------------------------------
uint32_t u32_of(const std::vector<uint8_t> &s, size_t at) {
  uint32_t v;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}
uint64_t u64_of(const std::vector<uint8_t> &s, size_t at) {
  uint64_t v;
  std::memcpy(&v, s.data() + at, 8);
  return v;
}
void put_u32(std::vector<uint8_t> &s, size_t at, uint32_t v) { std::memcpy(s.data() + at, &v, 4); }
void put_u64(std::vector<uint8_t> &s, size_t at, uint64_t v) { std::memcpy(s.data() + at, &v, 8); }

// A QJL layer's sketch sizes (docs/FORMAT.md): the initial_* ones below initial_layers; m_out is
// 0 without outlier channels.
struct QjlSizes {
  uint32_t m, m_out, c;
};
QjlSizes qjl_sizes(const qjlkv_config &cfg, uint32_t layer) {
  const bool initial = layer < cfg.initial_layers;
  const uint32_t c = cfg.outlier_channels;
  return {initial ? cfg.initial_key_sketch_dim : cfg.key_sketch_dim,
          c == 0 ? 0 : initial ? cfg.initial_outlier_sketch_dim : cfg.outlier_sketch_dim, c};
}

// The stream the format-2 writer wrote for the sequence of the version-3 stream `v3` of cache
// `source`, whose layers were appended `keys` (source_keys): version 2, and in the QJL layers with
// outlier channels block records of the old layout, norm_in fp16[B], norm_out fp16[B], bits_in
// [B][m/8], bits_out [B][m_out/8], outlier channels uint8[c], where bits_out are the signs of
// S_out·k_out over the block's outlier channels, summed as the old reference (qjl_quantize_block
// of format version 2) summed them.
std::vector<uint8_t> to_version2(const qjlkv_cache *source, const qjlkv_config &cfg, const std::vector<uint8_t> &v3,
                                 const std::vector<std::vector<float>> &keys) {
  EXPECT_EQ(u32_of(v3, 8), 3u);
  std::vector<uint8_t> v2(v3.begin(), v3.begin() + 136);
  put_u32(v2, 8, 2);
  const size_t B = cfg.block_tokens, d = cfg.head_dim, H = cfg.num_kv_heads;
  const size_t row = d * qt::dtype_bytes(qt::dtype_of(cfg));
  size_t at = 136;
  for (uint32_t l = u32_of(v3, 24); l < u32_of(v3, 24) + u32_of(v3, 28); ++l) {
    const size_t section_end = at + 16 + u64_of(v3, at + 8);
    const QjlSizes q = qjl_sizes(cfg, l);
    if (cfg.key_method != QJLKV_KEYS_QJL || q.m_out == 0) {  // the same bytes in both versions
      v2.insert(v2.end(), v3.begin() + ptrdiff_t(at), v3.begin() + ptrdiff_t(section_end));
      at = section_end;
      continue;
    }
    const uint32_t blocks = u32_of(v3, at + 32), record = u32_of(v3, at + 40), sinks = u32_of(v3, at + 44);
    const size_t new_keys = 4 * B + 2 * q.c * B + B * q.m / 8 + q.c;
    const size_t bits_out = 4 * B + B * q.m / 8, old_keys = bits_out + B * q.m_out / 8 + q.c;
    const size_t values = record - new_keys, old_record = old_keys + values;
    const size_t records_at = at + 48 + 2 * size_t(sinks) * H * row, records_end = records_at + blocks * H * record;
    std::vector<uint8_t> section(v3.begin() + ptrdiff_t(at), v3.begin() + ptrdiff_t(records_at));
    put_u32(section, 40, uint32_t(old_record));
    put_u64(section, 8, u64_of(v3, at + 8) - blocks * H * record + blocks * H * old_record);
    const qjlkv_sketch *sketch = nullptr;
    EXPECT_EQ(qjlkv_cache_sketch(source, l, &sketch), QJLKV_OK);
    std::vector<float> S(std::max(q.m, q.m_out) * d);
    EXPECT_EQ(qjlkv_sketch_matrix(sketch, S.data(), S.size()), QJLKV_OK);
    for (size_t r = 0; r < size_t(blocks) * H; ++r) {
      const size_t b = r / H, h = r % H;
      const uint8_t *record_in = v3.data() + records_at + r * record;
      const uint8_t *idx = record_in + new_keys - q.c;
      std::vector<uint8_t> old(old_record, 0);
      std::memcpy(old.data(), record_in, 4 * B);                                        // the norms
      std::memcpy(old.data() + 4 * B, record_in + 4 * B + 2 * q.c * B, B * q.m / 8);    // bits_in
      std::memcpy(old.data() + old_keys - q.c, idx, q.c);                               // outlier channels
      std::memcpy(old.data() + old_keys, record_in + new_keys, values);
      for (size_t t = 0; t < B; ++t) {
        const float *k = keys[l].data() + ((sinks + b * B + t) * H + h) * d;
        for (uint32_t i = 0; i < q.m_out; ++i) {
          float p = 0.0f;
          for (uint32_t j = 0; j < q.c; ++j) p += S[i * d + idx[j]] * k[idx[j]];
          if (p > 0.0f) old[bits_out + t * q.m_out / 8 + i / 8] |= uint8_t(1u << (i % 8));
        }
      }
      section.insert(section.end(), old.begin(), old.end());
    }
    section.insert(section.end(), v3.begin() + ptrdiff_t(records_end), v3.begin() + ptrdiff_t(section_end));
    v2.insert(v2.end(), section.begin(), section.end());
    at = section_end;
  }
  EXPECT_EQ(at + 4, v3.size());
  put_u64(v2, 32, v2.size() - 136);
  put_u32(v2, 132, qjlkv::crc32c(v2.data(), 132));
  v2.resize(v2.size() + 4);
  put_u32(v2, v2.size() - 4, qjlkv::crc32c(v2.data(), v2.size() - 4));
  return v2;
}

// The version-1 form of a version-2 stream of a cache without sinks and with uniform values:
// the header without value_method and sink_tokens (128 bytes), the same sections.
std::vector<uint8_t> to_version1(const std::vector<uint8_t> &v2) {
  EXPECT_EQ(u32_of(v2, 8), 2u);
  EXPECT_EQ(u32_of(v2, 12), 136u);
  EXPECT_EQ(u32_of(v2, 124), uint32_t(QJLKV_VALUES_UNIFORM)) << "value_method";
  EXPECT_EQ(u32_of(v2, 128), 0u) << "sink_tokens";
  std::vector<uint8_t> v1(v2.begin(), v2.begin() + 128);
  put_u32(v1, 8, 1);
  put_u32(v1, 12, 128);
  put_u32(v1, 124, qjlkv::crc32c(v1.data(), 124));
  v1.insert(v1.end(), v2.begin() + 136, v2.end());
  put_u32(v1, v1.size() - 4, qjlkv::crc32c(v1.data(), v1.size() - 4));
  return v1;
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
  // The format version this library writes: 4 where the config has key_token_bits, else 3.
  EXPECT_EQ(u32_of(stream, 8), cfg.key_method == QJLKV_KEYS_MIXED ? 4u : 3u);
  EXPECT_EQ(u32_of(stream, 12), cfg.key_method == QJLKV_KEYS_MIXED ? 140u : 136u);

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

// Lengths around the sinks and the first block: fewer tokens than sink_tokens, exactly S, the
// longest tail without a block and the first block (S + R + B). Each round trip continues to
// decode across the following block boundaries.
TEST_P(RoundTrip, LengthsAroundTheSinksAndTheFirstBlock) {
  const qjlkv_config cfg = variant_config(GetParam());
  const uint32_t S = cfg.sink_tokens, R = cfg.residual_tokens, B = cfg.block_tokens;
  std::vector<uint32_t> lengths = {1, S + R + B - 1, S + R + B};
  if (S > 1) lengths.push_back(S - 1);
  if (S > 0) lengths.push_back(S);
  for (const uint32_t length : lengths) {
    SCOPED_TRACE("length " + std::to_string(length));
    Cache source = qt::make_cache(cfg);
    for (uint32_t l = 0; l < cfg.num_layers; ++l) append(source.get(), cfg, l, 4, length, 60 + l);
    const std::vector<uint8_t> stream = export_buffer(source.get(), 4, 0, cfg.num_layers);
    // The first layer section's sink count (docs/FORMAT.md: the header, then the section).
    uint32_t sinks = 0;
    std::memcpy(&sinks, stream.data() + u32_of(stream, 12) + 16 + 28, 4);
    EXPECT_EQ(sinks, std::min(length, S));
    Cache dest = qt::make_cache(cfg);
    QT_ASSERT_OK(qjlkv_cache_import(dest.get(), 4, stream.data(), stream.size()));
    expect_identical(source.get(), 4, dest.get(), 4, cfg, 5, "after import");
    ASSERT_NO_FATAL_FAILURE(continue_decode(source.get(), 4, dest.get(), 4, cfg));
    expect_identical(source.get(), 4, dest.get(), 4, cfg, 6, "after the continued decode");
    EXPECT_EQ(export_buffer(dest.get(), 4, 0, cfg.num_layers), export_buffer(source.get(), 4, 0, cfg.num_layers));
  }
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
    // The tiers: 3- or 4-bit KIVI keys, 16 or 4 sink tokens, rotated 2- or 3-bit values.
    {"q3_f32", "q3", QJLKV_DTYPE_F32, no_tweak},
    {"q3_f16", "q3", QJLKV_DTYPE_F16, no_tweak},
    {"q3_bf16", "q3", QJLKV_DTYPE_BF16, no_tweak},
    {"q4_f32", "q4", QJLKV_DTYPE_F32, no_tweak},
    {"q4_f16", "q4", QJLKV_DTYPE_F16, no_tweak},
    {"q4_bf16", "q4", QJLKV_DTYPE_BF16, no_tweak},
    {"q2_f32", "q2", QJLKV_DTYPE_F32, no_tweak},
    {"q2_f16", "q2", QJLKV_DTYPE_F16, no_tweak},
    {"q2_bf16", "q2", QJLKV_DTYPE_BF16, mixed_uniform_values},
    // ... and each of their pieces alone.
    {"kivi_sinks_f32", "kivi", QJLKV_DTYPE_F32, sinks_alone},
    {"kivi_sinks_f16", "kivi", QJLKV_DTYPE_F16, sinks_alone},
    {"kivi_sinks_bf16", "kivi", QJLKV_DTYPE_BF16, sinks_alone},
    {"kivi_rotated_2bit_f32", "kivi", QJLKV_DTYPE_F32, rotated_alone},
    {"kivi_rotated_4bit_f16", "kivi", QJLKV_DTYPE_F16, rotated_alone},
    {"kivi_rotated_3bit_bf16", "kivi", QJLKV_DTYPE_BF16, rotated_alone},
    {"kivi_3bit_f32", "kivi", QJLKV_DTYPE_F32, three_bit_codes},
    {"kivi_3bit_f16", "kivi", QJLKV_DTYPE_F16, three_bit_codes},
    {"kivi_3bit_bf16", "kivi", QJLKV_DTYPE_BF16, three_bit_codes},
    {"ott_sinks_bf16", "ott", QJLKV_DTYPE_BF16, ott_sinks},
    {"qjl_sinks_rotated_4bit_f16", "qjl", QJLKV_DTYPE_F16, qjl_sinks_rotated_4bit},
    {"exact_keys_rotated_3bit_sinks_f32", "exact", QJLKV_DTYPE_F32, exact_keys_rotated_3bit_sinks},
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
  size_t at = 136;
  for (uint32_t l = 0; l < u32(28); ++l) {
    const uint32_t heads = u32(at + 20), blocks = u32(at + 32), tail = u32(at + 36), record = u32(at + 40);
    const uint32_t sinks = u32(at + 44);
    size_t p = at + 48 + size_t(blocks) * cfg.num_kv_heads * record +
               2 * (size_t(sinks) + tail) * cfg.num_kv_heads * row;
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

// The sink variants really store sinks: every layer section of fill_source's stream holds
// sink_tokens of them (docs/FORMAT.md: the count at offset 28 of the section's fields).
TEST(RoundTripCoverage, SinkVariantsStreamTheirSinks) {
  int variants = 0;
  for (const Variant &v : kVariants) {
    const qjlkv_config cfg = variant_config(v);
    if (cfg.sink_tokens == 0) continue;
    SCOPED_TRACE(v.name);
    ++variants;
    Cache source = qt::make_cache(cfg);
    fill_source(source.get(), cfg, 1);
    const std::vector<uint8_t> s = export_buffer(source.get(), 1, 0, cfg.num_layers);
    size_t at = u32_of(s, 12);  // the header's bytes
    for (uint32_t l = 0; l < cfg.num_layers; ++l) {
      uint32_t sinks;
      uint64_t body;
      std::memcpy(&sinks, s.data() + at + 44, 4);
      std::memcpy(&body, s.data() + at + 8, 8);
      EXPECT_EQ(sinks, cfg.sink_tokens) << "layer " << l;
      at += 16 + body;
    }
  }
  EXPECT_EQ(variants, 15);
}

// ---- refusals ---------------------------------------------------------------------------------------
// The stream imported into caches whose config differs from `base` in one field that determines
// the stored bytes: each import is refused naming that field, and the target stays empty.
struct ConfigChange {
  const char *field;
  void (*change)(qjlkv_config &);
};
void expect_mismatches_refused(const qjlkv_config &base, const std::vector<uint8_t> &stream,
                               std::initializer_list<ConfigChange> changes) {
  for (const ConfigChange &k : changes) {
    SCOPED_TRACE(k.field);
    qjlkv_config other = base;
    k.change(other);
    Cache target = qt::make_cache(other);
    ASSERT_TRUE(target);
    const std::string stale = qt::stale_error_message();
    const qjlkv_status s = qjlkv_cache_import(target.get(), 5, stream.data(), stream.size());
    EXPECT_TRUE(qt::fails_naming(s, QJLKV_ERROR_INVALID_ARGUMENT, stale, {k.field}));
    EXPECT_EQ(qt::stats_of(target.get()).tokens, 0u);
  }
}

class Refusal : public ::testing::Test {
 protected:
  virtual qjlkv_config config() const { return variant_config({"qjl", "qjl", QJLKV_DTYPE_F32, no_tweak}); }
  void SetUp() override {
    cfg_ = config();
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
    const size_t header_bytes = u32_at(s, 12);
    const uint32_t header = qjlkv::crc32c(s.data(), header_bytes - 4);
    std::memcpy(s.data() + header_bytes - 4, &header, 4);
    const uint32_t all = qjlkv::crc32c(s.data(), s.size() - 4);
    std::memcpy(s.data() + s.size() - 4, &all, 4);
  }
  static uint32_t u32_at(const std::vector<uint8_t> &s, size_t at) {
    uint32_t v;
    std::memcpy(&v, s.data() + at, 4);
    return v;
  }
  static void set_u32(std::vector<uint8_t> &s, size_t at, uint32_t v) { std::memcpy(s.data() + at, &v, 4); }
  void check_every_truncation();
  void check_every_flipped_bit();

  qjlkv_config cfg_;
  Cache source_, dest_;
  std::vector<uint8_t> stream_, query_;
  qt::Snapshot before_;
};

// Offsets of docs/FORMAT.md: header 136 bytes; the first layer section's header 16, its fields 32;
// then the sinks (none in the QJL stream of the fixture) and the first block.
constexpr size_t kFirstSection = 136, kFirstLayerFields = 152, kFirstBlock = 184;

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
  for (const uint32_t version : {0u, 6u, 0x80000001u}) {
    std::vector<uint8_t> other = stream_;
    set_u32(other, 8, version);
    fix_checksums(other);
    expect_refused(other, QJLKV_ERROR_INVALID_ARGUMENT, "version");
  }
  std::vector<uint8_t> magic = stream_;
  magic[0] = 'X';
  expect_refused(magic, QJLKV_ERROR_CORRUPT_DATA, "magic");
  expect_refused(std::vector<uint8_t>(3, 0), QJLKV_ERROR_CORRUPT_DATA, "truncated");
}

TEST_F(Refusal, MismatchedConfigsNameTheField) {
  expect_mismatches_refused(cfg_, stream_, {
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
      {"value_method", [](qjlkv_config &c) { c.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX; }},
      {"sink_tokens", [](qjlkv_config &c) { c.sink_tokens = 1; }},
  });
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

void Refusal::check_every_truncation() {
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

void Refusal::check_every_flipped_bit() {
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

TEST_F(Refusal, EveryTruncationIsCorruptData) { check_every_truncation(); }
TEST_F(Refusal, EveryFlippedBitIsRefused) { check_every_flipped_bit(); }

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
    // The first outlier channel of the first block: after 2 fp16 norm arrays, the fp16
    // corrections [c][B] and the sign bits.
    const uint32_t B = cfg_.block_tokens, m = cfg_.key_sketch_dim, c = cfg_.outlier_channels;
    std::vector<uint8_t> s = stream_;
    s[kFirstBlock + 4 * B + 2 * c * B + B * m / 8] = 200;  // >= head_dim
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

// ---- sinks and rotated values (format version 2) ----------------------------------------------------
// The q3 tier, f32: 3-bit KIVI keys, 4 sink tokens, rotated 2-bit Lloyd-Max values.
class TierRefusal : public Refusal {
 protected:
  qjlkv_config config() const override { return variant_config({"q3", "q3", QJLKV_DTYPE_F32, no_tweak}); }
  // Layer 0 of fill_source: 61 tokens = 4 sinks, 3 blocks, a tail of 9. After the section's
  // fields: sink keys and values [4][Hkv][d] f32, the block records, the tail's keys and values.
  size_t sink_keys() const { return kFirstBlock; }
  size_t sink_values() const { return sink_keys() + token_bytes() * cfg_.sink_tokens; }
  size_t first_record() const { return sink_values() + token_bytes() * cfg_.sink_tokens; }
  size_t tail_values() const {
    const size_t records = size_t(u32_at(stream_, kFirstLayerFields + 16)) * cfg_.num_kv_heads;
    return first_record() + records * u32_at(stream_, kFirstLayerFields + 24) +
           token_bytes() * u32_at(stream_, kFirstLayerFields + 20);
  }
  size_t token_bytes() const { return size_t(cfg_.num_kv_heads) * cfg_.head_dim * 4; }
  // The per-token value scales follow the 3-bit key arrays (scale, minimum, codes).
  size_t first_value_scale() const {
    const uint32_t d = cfg_.head_dim;
    return first_record() + 2 * d + 2 * d + size_t(cfg_.block_tokens) * d * 3 / 8;
  }
  void set_f32(std::vector<uint8_t> &s, size_t at, float x, size_t count = 1) {
    for (size_t i = 0; i < count; ++i) std::memcpy(s.data() + at + 4 * i, &x, 4);
  }
};

TEST_F(TierRefusal, TheStreamHoldsTheLayoutTheTestsEdit) {
  ASSERT_EQ(cfg_.sink_tokens, 4u);
  ASSERT_EQ(u32_at(stream_, kFirstLayerFields + 28), 4u);                     // sinks
  ASSERT_EQ(u32_at(stream_, kFirstLayerFields + 16), 3u);                     // blocks
  ASSERT_EQ(u32_at(stream_, kFirstLayerFields + 20), 9u);                     // tail
  ASSERT_EQ(u32_at(stream_, kFirstLayerFields + 24), 320u + 2 * 16 + 128u);  // keys, value scales, codes
  // The sink keys are the first 4 tokens appended to layer 0 (fill_source's seed 10).
  const std::vector<uint8_t> first = rows(cfg_, 4, 10);
  EXPECT_TRUE(same_bits(stream_.data() + sink_keys(), first.data(), first.size()));
  // Scale 0 would mean an all-zero value vector: these are normal samples.
  uint16_t scale;
  std::memcpy(&scale, stream_.data() + first_value_scale(), 2);
  EXPECT_GT(scale, 0u);
  EXPECT_LT(scale, 0x7c00u);
}

TEST_F(TierRefusal, CorruptSinksTailsAndScalesNameWhatIsWrong) {
  {
    std::vector<uint8_t> s = stream_;
    set_f32(s, sink_keys() + 8, std::nanf(""));
    fix_checksums(s);
    expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "sink");
  }
  {
    std::vector<uint8_t> s = stream_;
    set_f32(s, sink_values() + token_bytes(), 1e6f);  // beyond fp16, which rotated values' scale is
    fix_checksums(s);
    expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "sink");
  }
  // A value vector whose norm the fp16 scale cannot hold once quantized (40000·√32 > 65504·0.4528·√32):
  // append refuses it, so no stream holds it, in the sinks or in the tail.
  for (const bool sink : {true, false}) {
    std::vector<uint8_t> s = stream_;
    set_f32(s, sink ? sink_values() : tail_values(), 40000.0f, cfg_.head_dim);
    fix_checksums(s);
    expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "norm");
  }
  for (const uint16_t bad : {uint16_t(0x7c00), uint16_t(0x7e00), uint16_t(0xbc00)}) {  // inf, NaN, -1
    std::vector<uint8_t> s = stream_;
    std::memcpy(s.data() + first_value_scale() + 2 * 5, &bad, 2);
    fix_checksums(s);
    expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "scale");
  }
  {
    std::vector<uint8_t> s = stream_;  // 3 sinks where the length (61) implies 4
    set_u32(s, kFirstLayerFields + 28, 3);
    fix_checksums(s);
    expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "sink");
  }
  {
    std::vector<uint8_t> s = stream_;  // sink rows counted as tail rows: the pair is wrong
    set_u32(s, kFirstLayerFields + 28, 0);
    set_u32(s, kFirstLayerFields + 20, 13);
    fix_checksums(s);
    expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "sink");
  }
}

TEST_F(TierRefusal, MismatchedConfigsNameTheField) {
  expect_mismatches_refused(cfg_, stream_, {
      {"sink_tokens", [](qjlkv_config &c) { c.sink_tokens = 2; }},
      {"sink_tokens", [](qjlkv_config &c) { c.sink_tokens = 0; }},
      {"value_method", [](qjlkv_config &c) { c.value_method = QJLKV_VALUES_UNIFORM; }},
      {"value_bits", [](qjlkv_config &c) { c.value_bits = 3; }},
      {"key_bits", [](qjlkv_config &c) { c.key_bits = 4; }},
      {"seed", [](qjlkv_config &c) { c.seed += 1; }},  // the rotation's signs, even with KIVI keys
  });
}

TEST_F(TierRefusal, EveryTruncationIsCorruptData) { check_every_truncation(); }
TEST_F(TierRefusal, EveryFlippedBitIsRefused) { check_every_flipped_bit(); }

// ---- format versions 1 and 2 ----------------------------------------------------------------------------
// Every variant's stream in the form of the version-2 writer (and of the version-1 writer where
// the cache has neither sinks nor rotated values) imports, holds the same sequence and exports
// as the version-3 stream of the cache that appended the same keys: the QJL records converted
// from outlier sign bits to corrections are the ones append stores, so scores and attention are
// bit-identical, and so is the decode that continues from there.
TEST(OlderFormatVersions, StreamsImportAndContinueBitIdentically) {
  int converted = 0;
  for (const Variant &v : kVariants) {
    const qjlkv_config cfg = variant_config(v);
    if (cfg.key_method == QJLKV_KEYS_MIXED) continue;  // no older version describes mixed keys
    SCOPED_TRACE(v.name);
    Cache source = qt::make_cache(cfg);
    fill_source(source.get(), cfg, 2);
    const std::vector<uint8_t> v3 = export_buffer(source.get(), 2, 0, cfg.num_layers);
    const std::vector<uint8_t> v2 = to_version2(source.get(), cfg, v3, source_keys(cfg));
    if (v2.size() != v3.size()) ++converted;  // the QJL variants with outlier channels
    std::vector<std::vector<uint8_t>> older = {v2};
    if (cfg.sink_tokens == 0 && cfg.value_method == QJLKV_VALUES_UNIFORM) older.push_back(to_version1(v2));
    for (const std::vector<uint8_t> &old : older) {
      SCOPED_TRACE("format version " + std::to_string(u32_of(old, 8)));
      Cache dest = qt::make_cache(cfg);
      QT_ASSERT_OK(qjlkv_cache_import(dest.get(), 6, old.data(), old.size()));
      EXPECT_EQ(export_buffer(dest.get(), 6, 0, cfg.num_layers), v3);
      expect_identical(source.get(), 2, dest.get(), 6, cfg, 8, "after import");
      Cache twin = qt::make_cache(cfg);  // the source, for a decode that leaves the source as it is
      QT_ASSERT_OK(qjlkv_cache_import(twin.get(), 2, v3.data(), v3.size()));
      ASSERT_NO_FATAL_FAILURE(continue_decode(twin.get(), 2, dest.get(), 6, cfg));
    }
  }
  EXPECT_EQ(converted, 5);
}

// Streams that the version-1 and version-2 writers wrote: the v1_* and v2_* seeds of the import
// fuzz corpus (each with the harness's two control bytes: config index, repair flag), among them
// QJL records with outlier sign bits (v1_seed_0_*, v2_seed_0_*). Each imports and exports as the
// version-3 stream of a cache that appended the seed maker's keys (import_configs.hpp), byte for
// byte, and continues.
TEST(OlderFormatVersions, StreamsOfTheOlderWritersImport) {
  int imported[3] = {};
  for (const auto &entry : std::filesystem::directory_iterator(QJLKV_IMPORT_CORPUS)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("v1_seed_", 0) != 0 && name.rfind("v2_seed_", 0) != 0) continue;
    SCOPED_TRACE(name);
    FILE *f = std::fopen(entry.path().c_str(), "rb");
    ASSERT_NE(f, nullptr);
    std::vector<uint8_t> file(1 << 16);
    file.resize(std::fread(file.data(), 1, file.size(), f));
    std::fclose(f);
    ASSERT_GT(file.size(), 2u + 132u);
    const qjlkv_config cfg = qjlkv_fuzz::import_config(file[0]);
    const uint32_t seq = uint32_t(name.back() - '0');  // vN_seed_<config>_<seq>
    ASSERT_LT(seq, qjlkv_fuzz::kSeedSequences);
    const std::vector<uint8_t> old(file.begin() + 2, file.end());
    const uint32_t version = u32_of(old, 8);
    ASSERT_EQ(version, uint32_t(name[1] - '0'));
    const uint32_t first = qjlkv_fuzz::seed_first_layer(seq), layers = qjlkv_fuzz::seed_num_layers(seq);
    ASSERT_EQ(u32_of(old, 24), first);
    ASSERT_EQ(u32_of(old, 28), layers);

    Cache appended = qt::make_cache(cfg);
    for (uint32_t l = first; l < first + layers; ++l) {
      std::vector<uint8_t> k, v;
      qjlkv_fuzz::seed_tokens(cfg, seq, l, k, v);
      QT_ASSERT_OK(qjlkv_cache_append(appended.get(), l, seq, qjlkv_fuzz::kSeedLengths[seq][l], k.data(), v.data()));
    }
    Cache dest = qt::make_cache(cfg);
    QT_ASSERT_OK(qjlkv_cache_import(dest.get(), 1, old.data(), old.size()));
    ++imported[version];
    EXPECT_EQ(export_buffer(dest.get(), 1, first, layers), export_buffer(appended.get(), seq, first, layers));
    // The sequence continues: one more token in each of its layers, then attention.
    const size_t io = qt::dtype_bytes(qt::dtype_of(cfg));
    const std::vector<uint8_t> token(size_t(cfg.num_kv_heads) * cfg.head_dim * io, 0);
    std::vector<uint8_t> q(size_t(cfg.num_q_heads) * cfg.head_dim * io, 0), out(q.size());
    for (uint32_t l = first; l < first + layers; ++l) {
      QT_ASSERT_OK(qjlkv_cache_append(dest.get(), l, 1, 1, token.data(), token.data()));
      QT_ASSERT_OK(qjlkv_cache_attend(dest.get(), l, 1, 1, q.data(), 0.0f, out.data()));
    }
  }
  EXPECT_EQ(imported[1], 15);  // configs 0-4, sequences 0-2
  EXPECT_EQ(imported[2], 32);  // every config and sequence
}

// A version-2 QJL record is checked before its corrections are computed from it (the outlier
// channels index the sketch, the norms scale the corrections); a version-3 record under a
// version-2 header has the wrong size. Each refusal leaves the destination unchanged.
TEST_F(Refusal, CorruptVersion2RecordsNameWhatIsWrong) {
  const std::vector<uint8_t> v2 = to_version2(source_.get(), cfg_, stream_, source_keys(cfg_));
  const QjlSizes q = qjl_sizes(cfg_, 0);
  const size_t B = cfg_.block_tokens;
  ASSERT_GT(q.c, 1u);
  const size_t norm_out = kFirstBlock + 2 * B, outlier_idx = kFirstBlock + 4 * B + B * q.m / 8 + B * q.m_out / 8;
  for (const uint8_t bad : {uint8_t(200), uint8_t(cfg_.head_dim), v2[outlier_idx]}) {  // >= d, or not increasing
    std::vector<uint8_t> s = v2;
    s[outlier_idx + 1] = bad;
    fix_checksums(s);
    expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "outlier");
  }
  for (const uint16_t bad : {uint16_t(0x7c00), uint16_t(0x7e00), uint16_t(0xbc00)}) {  // inf, NaN, -1
    for (const size_t at : {kFirstBlock + 2 * 3, norm_out + 2 * 5}) {
      std::vector<uint8_t> s = v2;
      std::memcpy(s.data() + at, &bad, 2);
      fix_checksums(s);
      expect_refused(s, QJLKV_ERROR_CORRUPT_DATA, "norm");
    }
  }
  std::vector<uint8_t> relabelled = stream_;
  set_u32(relabelled, 8, 2);
  fix_checksums(relabelled);
  expect_refused(relabelled, QJLKV_ERROR_CORRUPT_DATA, "records");
  // The well-formed stream imports into the same destination afterwards.
  QT_ASSERT_OK(qjlkv_cache_import(dest_.get(), 5, v2.data(), v2.size()));
  expect_identical(source_.get(), 5, dest_.get(), 5, cfg_, 10, "after the refusals");
}

// A version-1 stream implies value_method uniform and sink_tokens 0: a cache with either of the
// newer fields refuses it, naming the field and the version.
TEST(FormatVersion1, RefusedWhereTheNewerFieldsDiffer) {
  const qjlkv_config cfg = variant_config({"kivi", "kivi", QJLKV_DTYPE_F16, no_tweak});
  Cache source = qt::make_cache(cfg);
  fill_source(source.get(), cfg, 2);
  const std::vector<uint8_t> v3 = export_buffer(source.get(), 2, 0, cfg.num_layers);
  const std::vector<uint8_t> v1 = to_version1(to_version2(source.get(), cfg, v3, source_keys(cfg)));
  for (const bool sinks : {true, false}) {
    qjlkv_config other = cfg;
    if (sinks) other.sink_tokens = 4;
    else other.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
    Cache target = qt::make_cache(other);
    const std::string stale = qt::stale_error_message();
    EXPECT_TRUE(qt::fails_naming(qjlkv_cache_import(target.get(), 2, v1.data(), v1.size()),
                                 QJLKV_ERROR_INVALID_ARGUMENT, stale, {sinks ? "sink_tokens" : "value_method"}));
    EXPECT_NE(std::string(qjlkv_last_error_message()).find("version 1"), std::string::npos)
        << qjlkv_last_error_message();
    EXPECT_EQ(qt::stats_of(target.get()).tokens, 0u);
  }
}

}  // namespace
