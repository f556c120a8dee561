// Helpers of the reliability tests: handles, deterministic data, and a snapshot of everything a
// caller can observe of a cache (lengths, statistics, scores and attention outputs, compared
// bit for bit) to check that a failed call left the cache exactly as it was.
#pragma once

#include <gtest/gtest.h>
#include <qjlkv/qjlkv.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "testing.hpp"

namespace qjlkv_test {

// Handles, statuses, dtypes and message checks are those of the core tests (tests/cpp); assert
// success with QT_ASSERT_OK.
using qt::Cache;
using qt::describe;
using qt::dtype_bytes;
using qt::names_identifier;

// A small preset config: B = 8 and R = 5 so that a few dozen tokens cross several block
// boundaries; one worker thread unless told otherwise.
inline qjlkv_config small_config(const char *preset, qjlkv_dtype dtype = QJLKV_DTYPE_F32, uint32_t threads = 1) {
  qjlkv_config cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.struct_size = sizeof cfg;  // the fields added after 0.1 too (the q3/q4 tiers use them)
  const qjlkv_status s = qjlkv_config_init(&cfg, preset, /*layers*/ 2, /*Hq*/ 4, /*Hkv*/ 2, /*d*/ 16);
  EXPECT_EQ(s, QJLKV_OK) << preset << ": " << describe(s);
  cfg.dtype = dtype;
  cfg.block_tokens = 8;
  cfg.residual_tokens = 5;
  cfg.num_threads = threads;
  cfg.seed = 7;
  return cfg;
}

// Deterministic tensor bytes in dtype t: N(0, sd) numbers, converted by truncation for the
// 16-bit types (any finite pattern is fine here; what matters is that calls are repeatable).
inline std::vector<uint8_t> tensor(size_t elems, qjlkv_dtype t, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, sd);
  std::vector<uint8_t> bytes(elems * dtype_bytes(t));
  for (size_t i = 0; i < elems; ++i) {
    const float x = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if (t == QJLKV_DTYPE_F32) {
      std::memcpy(&bytes[4 * i], &x, 4);
    } else if (t == QJLKV_DTYPE_BF16) {
      const uint16_t h = uint16_t(bits >> 16);
      std::memcpy(&bytes[2 * i], &h, 2);
    } else {  // fp16 with a small exponent: 0.5 <= |x| < 2
      const uint16_t h = uint16_t((bits >> 16 & 0x8000u) | (0x3800u + (bits >> 13 & 0x7ffu)));
      std::memcpy(&bytes[2 * i], &h, 2);
    }
  }
  return bytes;
}

// Token tensors ([n][Hkv][d]) and query tensors ([n][Hq][d]) of a config.
inline std::vector<uint8_t> tokens(const qjlkv_config &cfg, uint32_t n, uint64_t seed) {
  return tensor(size_t(n) * cfg.num_kv_heads * cfg.head_dim, cfg.dtype, seed);
}
inline std::vector<uint8_t> queries(const qjlkv_config &cfg, uint32_t n, uint64_t seed) {
  return tensor(size_t(n) * cfg.num_q_heads * cfg.head_dim, cfg.dtype, seed);
}

inline qjlkv_status append_tokens(qjlkv_cache *c, const qjlkv_config &cfg, uint32_t layer, uint32_t seq, uint32_t n,
                                  uint64_t seed) {
  const std::vector<uint8_t> k = tokens(cfg, n, seed), v = tokens(cfg, n, seed ^ 0x5555);
  return qjlkv_cache_append(c, layer, seq, n, k.data(), v.data());
}

// Everything observable of a set of (layer, seq) streams. Output bytes are compared bitwise.
struct Snapshot {
  std::vector<uint64_t> lengths;
  std::vector<uint8_t> stats;    // the whole qjlkv_stats struct
  std::vector<uint8_t> outputs;  // scores and attention outputs of every non-empty stream
  friend bool operator==(const Snapshot &, const Snapshot &) = default;
};

struct Stream {
  uint32_t layer, seq;
};

inline void append_bytes(std::vector<uint8_t> &to, const void *p, size_t n) {
  const auto *b = static_cast<const uint8_t *>(p);
  to.insert(to.end(), b, b + n);
}

// Takes a snapshot; any failing call of the library is recorded in the snapshot as its status,
// so that a difference shows up as inequality rather than as a crash of the test.
inline Snapshot snapshot(qjlkv_cache *c, const std::vector<Stream> &streams) {
  qjlkv_config cfg;
  cfg.struct_size = sizeof cfg;
  Snapshot snap;
  if (qjlkv_cache_config(c, &cfg) != QJLKV_OK) return snap;
  qjlkv_stats st;
  std::memset(&st, 0, sizeof st);
  st.struct_size = sizeof st;
  const qjlkv_status stats_status = qjlkv_cache_stats(c, &st);
  append_bytes(snap.stats, &stats_status, sizeof stats_status);
  append_bytes(snap.stats, &st, sizeof st);
  const size_t io = dtype_bytes(cfg.dtype);
  for (const Stream &s : streams) {
    uint64_t len = ~uint64_t(0);
    const qjlkv_status ls = qjlkv_cache_length(c, s.layer, s.seq, &len);
    snap.lengths.push_back(ls == QJLKV_OK ? len : ~uint64_t(0) - ls);
    if (ls != QJLKV_OK || len == 0) continue;
    const std::vector<uint8_t> q = queries(cfg, 3, 1000 + s.seq);
    std::vector<float> scores(size_t(cfg.num_q_heads) * len);
    const qjlkv_status ss = qjlkv_cache_scores(c, s.layer, s.seq, q.data(), scores.data(), scores.size());
    append_bytes(snap.outputs, &ss, sizeof ss);
    append_bytes(snap.outputs, scores.data(), scores.size() * sizeof(float));
    for (uint32_t nq = 1; nq <= 3 && nq <= len; nq += 2) {
      std::vector<uint8_t> out(size_t(nq) * cfg.num_q_heads * cfg.head_dim * io);
      const qjlkv_status as = qjlkv_cache_attend(c, s.layer, s.seq, nq, q.data(), 0.0f, out.data());
      append_bytes(snap.outputs, &as, sizeof as);
      append_bytes(snap.outputs, out.data(), out.size());
    }
  }
  return snap;
}

}  // namespace qjlkv_test
