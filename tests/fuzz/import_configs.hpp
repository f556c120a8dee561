// The small caches of the import harness (fuzz_import.cpp) and of its seed maker
// (make_import_seeds.cpp): every key method, attention sinks and rotated values (the q2/q3/q4
// tiers, and sinks with OTT), tiny shapes, so that a stream of a few blocks per layer stays far
// below libFuzzer's -max_len of 4096 bytes. Configs 0-4 are those of format version 1 (the
// corpus's v1_* streams were written for them): change them only with those streams.
#pragma once
#include <qjlkv/qjlkv.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace qjlkv_fuzz {

inline constexpr uint32_t kImportConfigs = 9;

// The sliding window of every layer of the harness's destinations and of the v5_seed_* streams'
// caches, whose sequences (kFreedSeedTokens tokens appended one at a time; rollback_tokens 0)
// free their first blocks: streams of format version 5 import.
inline constexpr uint32_t kImportWindow = 12, kFreedSeedTokens = 58;

// Config `index` (taken modulo kImportConfigs): 2 layers, Hq 2, Hkv 1, d 8, B 8, R 2; q3/q4 with
// 4 sink tokens (q4's, and q3's before its preset took 16: the v2_seed_5_* streams hold 4),
// config 7 ("q4" with OTT keys) with 3, config 8 ("q2": mixed-bit keys of the preset's 24 bits a
// token, 3 bits a channel at d 8) with 4.
inline qjlkv_config import_config(uint32_t index) {
  static const char *const kPresets[kImportConfigs] = {"qjl", "kivi", "ott", "exact", "qjl",
                                                       "q3",  "q4",   "q4",  "q2"};
  static const qjlkv_dtype kDtypes[kImportConfigs] = {QJLKV_DTYPE_F32, QJLKV_DTYPE_F16,  QJLKV_DTYPE_F32,
                                                      QJLKV_DTYPE_BF16, QJLKV_DTYPE_F16, QJLKV_DTYPE_F32,
                                                      QJLKV_DTYPE_BF16, QJLKV_DTYPE_F16, QJLKV_DTYPE_F32};
  index %= kImportConfigs;
  qjlkv_config cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.struct_size = sizeof cfg;
  if (qjlkv_config_init(&cfg, kPresets[index], 2, 2, 1, 8) != QJLKV_OK) __builtin_trap();
  cfg.dtype = kDtypes[index];
  cfg.block_tokens = 8;
  cfg.residual_tokens = 2;
  cfg.num_threads = 1;
  cfg.seed = 11;
  cfg.rollback_tokens = 0;  // not stored; lets a windowed sequence free blocks right away
  cfg.key_sketch_dim = 16;
  if (cfg.key_method == QJLKV_KEYS_QJL) {
    cfg.outlier_channels = index == 0 ? 2 : 0;
    cfg.outlier_sketch_dim = index == 0 ? 8 : 0;
  }
  cfg.outlier_tokens = 2;
  cfg.outlier_spill_tokens = 3;
  cfg.outlier_skip_layers = 1;
  cfg.value_group_size = 4;
  cfg.value_bits = index == 4 ? 4 : cfg.value_bits;
  if (index == 5 || index == 8) cfg.sink_tokens = 4;
  if (index == 7) {
    cfg.key_method = QJLKV_KEYS_OTT;
    cfg.sink_tokens = 3;
  }
  return cfg;
}

// The sequences of the seed streams (make_import_seeds.cpp), seq 0-3: tokens per layer, 0 where a
// sequence skips the layer. 5 tokens (tail only, or 4 sinks and a tail of 1), 29 tokens (3 blocks,
// or 2 after 4 sinks: OTT's pool and spill move), 12 tokens in layer 1 only, and 2 and 3 tokens
// (fewer than the sinks). Each seed stream covers the layers its sequence fills.
inline constexpr uint32_t kSeedSequences = 4;
inline constexpr uint32_t kSeedLengths[kSeedSequences][2] = {{5, 5}, {29, 21}, {0, 12}, {2, 3}};

// The keys and values the seed streams' caches appended to (layer, seq): n tokens in cfg's dtype.
inline void seed_tokens(const qjlkv_config &cfg, uint32_t seq, uint32_t layer, std::vector<uint8_t> &k,
                        std::vector<uint8_t> &v) {
  const uint32_t n = kSeedLengths[seq][layer];
  const size_t elem = cfg.dtype == QJLKV_DTYPE_F32 ? 4 : 2;
  k.assign(size_t(n) * cfg.head_dim * elem, 0);
  v.assign(k.size(), 0);
  // An exact fp16 encoder for the multiples of 1/64 in [-1, 1] below (the library's conversion is
  // not public); bf16 is the top half of the f32 bits.
  const auto fp16 = [](float f) -> uint16_t {
    if (f == 0.0f) return std::signbit(f) ? 0x8000 : 0;
    int e;
    const float m = std::frexp(std::fabs(f), &e);  // f = m * 2^e, m in [0.5, 1)
    const uint16_t sign = f < 0 ? 0x8000 : 0;
    return uint16_t(sign | uint16_t((e + 14) << 10) | uint16_t((m * 2048.0f - 1024.0f)));
  };
  for (size_t i = 0; i < size_t(n) * cfg.head_dim; ++i) {
    const float x = std::sin(float(i * 7 + seq + layer)) * (i % 5 == 0 ? 0.1f : 1.0f);
    const float y = std::cos(float(i * 3 + seq));
    if (elem == 4) {
      std::memcpy(&k[4 * i], &x, 4);
      std::memcpy(&v[4 * i], &y, 4);
    } else {  // 16-bit caches: values rounded to multiples of 1/64, exact in fp16 and bf16
      const float xs = std::round(x * 64) / 64, ys = std::round(y * 64) / 64;
      uint32_t xb, yb;
      std::memcpy(&xb, &xs, 4);
      std::memcpy(&yb, &ys, 4);
      const uint16_t kh = cfg.dtype == QJLKV_DTYPE_BF16 ? uint16_t(xb >> 16) : fp16(xs);
      const uint16_t vh = cfg.dtype == QJLKV_DTYPE_BF16 ? uint16_t(yb >> 16) : fp16(ys);
      std::memcpy(&k[2 * i], &kh, 2);
      std::memcpy(&v[2 * i], &vh, 2);
    }
  }
}

// The layer range of seq's seed stream: layer 1 alone for seq 2, both layers otherwise.
inline uint32_t seed_first_layer(uint32_t seq) { return kSeedLengths[seq][0] == 0 ? 1 : 0; }
inline uint32_t seed_num_layers(uint32_t seq) { return kSeedLengths[seq][0] == 0 ? 1 : 2; }

}  // namespace qjlkv_fuzz
