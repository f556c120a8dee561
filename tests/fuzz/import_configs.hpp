// The small caches of the import harness (fuzz_import.cpp) and of its seed maker
// (make_import_seeds.cpp): every key method, attention sinks and rotated values (the q3/q4
// tiers, and sinks with OTT), tiny shapes, so that a stream of a few blocks per layer stays far
// below libFuzzer's -max_len of 4096 bytes. Configs 0-4 are those of format version 1 (the
// corpus's v1_* streams were written for them): change them only with those streams.
#pragma once
#include <qjlkv/qjlkv.h>

#include <cstdint>
#include <cstring>

namespace qjlkv_fuzz {

inline constexpr uint32_t kImportConfigs = 8;

// Config `index` (taken modulo kImportConfigs): 2 layers, Hq 2, Hkv 1, d 8, B 8, R 2; q3/q4 with
// their 4 sink tokens, config 7 ("q4" with OTT keys) with 3.
inline qjlkv_config import_config(uint32_t index) {
  static const char *const kPresets[kImportConfigs] = {"qjl", "kivi", "ott", "exact", "qjl", "q3", "q4", "q4"};
  static const qjlkv_dtype kDtypes[kImportConfigs] = {QJLKV_DTYPE_F32, QJLKV_DTYPE_F16,  QJLKV_DTYPE_F32,
                                                      QJLKV_DTYPE_BF16, QJLKV_DTYPE_F16, QJLKV_DTYPE_F32,
                                                      QJLKV_DTYPE_BF16, QJLKV_DTYPE_F16};
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
  if (index == 7) {
    cfg.key_method = QJLKV_KEYS_OTT;
    cfg.sink_tokens = 3;
  }
  return cfg;
}

}  // namespace qjlkv_fuzz
