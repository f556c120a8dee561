// Fuzz harness 1: configurations. Bytes become a preset and shape for qjlkv_config_init, then
// arbitrary field values for qjlkv_config_validate and qjlkv_cache_create, and sizes for
// qjlkv_sketch_create. Besides "never crash", it checks:
//   - config_init succeeds exactly for the shapes the header allows, and what it fills validates;
//     on failure *cfg is unchanged;
//   - validate accepts exactly the configs the header's field rules allow (the oracle below),
//     and a rejection names a field that is wrong;
//   - cache_create agrees with validate (CPU builds: device >= 0 is UNSUPPORTED), sets *out to
//     NULL on failure, and a created (small) cache appends, quantizes and attends;
//   - sketch_create succeeds exactly for the documented sizes; its rows have norm sqrt(d) when
//     orthogonal, and two calls give the same matrix.
#include <qjlkv/qjlkv.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_input.hpp"

namespace {

using qjlkv_fuzz::Input;
using qjlkv_fuzz::names;

constexpr uint32_t kInteresting[] = {0,    1,     2,     3,     4,     7,     8,          9,          15,
                                     16,   24,    31,    32,    33,    64,    127,        128,        255,
                                     256,  257,   1024,  1025,  4095,  4096,  4097,       65535,      65536,
                                     65537, 0x7fffffffu, 0x80000000u, 0xfffffff8u, 0xffffffffu, 5, 6};

uint32_t fuzz_u32(Input &in) { return in.flag() ? in.u32() : in.pick(kInteresting); }

// 0.1's `int32_t device` (-1 = CPU, >= 0 = CUDA ordinal), where device_ordinal is now: a config of
// 0.1's size keeps that meaning.
int32_t legacy_device(const qjlkv_config &c) {
  int32_t device;
  std::memcpy(&device, &c.device_ordinal, sizeof device);
  return device;
}

bool asks_for_cuda(const qjlkv_config &c) {
  return c.struct_size == QJLKV_CONFIG_SIZE_0_1 ? legacy_device(c) >= 0 : c.backend == QJLKV_BACKEND_CUDA;
}

// The sizes a caller may pass: this header's (0.5's), 0.1's, 0.2's and 0.3's, and 0.4's.
bool shipped_size(uint32_t size) {
  return size == sizeof(qjlkv_config) || size == QJLKV_CONFIG_SIZE_0_1 || size == QJLKV_CONFIG_SIZE_0_3 ||
         size == QJLKV_CONFIG_SIZE_0_4;
}
static_assert(sizeof(qjlkv_config) == 152, "a new config size: teach this harness its fields");

uint32_t fuzz_struct_size(Input &in) {
  static constexpr uint32_t kSizes[] = {uint32_t(sizeof(qjlkv_config)), QJLKV_CONFIG_SIZE_0_1, QJLKV_CONFIG_SIZE_0_3,
                                        QJLKV_CONFIG_SIZE_0_4};
  return in.pick(kSizes);
}

bool is_bits(uint32_t b) { return b == 2 || b == 3 || b == 4 || b == 8; }
bool sketch_dim_ok(uint32_t v, bool allow_zero) { return v % 8 == 0 && v <= 65536 && (allow_zero || v > 0); }

// The header's rules (include/qjlkv/qjlkv.h, struct qjlkv_config), plus the upper limits that
// src/config.cpp adds for sizes (layers <= 65536, heads <= 4096, threads <= 1024). Returns the
// fields that are wrong; empty = valid. Fields of other key methods are ignored.
std::vector<std::string> wrong_fields(const qjlkv_config &caller) {
  std::vector<std::string> wrong;
  const auto rule = [&](bool ok, const char *field) {
    if (!ok) wrong.push_back(field);
  };
  const bool size_ok = shipped_size(caller.struct_size);
  rule(size_ok, "struct_size");
  if (!size_ok) return wrong;
  // An older struct: the fields added after its release are never read and take their defaults (0).
  qjlkv_config c = caller;
  if (c.struct_size == QJLKV_CONFIG_SIZE_0_1) c.value_method = c.sink_tokens = 0;
  if (c.struct_size < QJLKV_CONFIG_SIZE_0_4) c.memory_budget = c.rollback_tokens = 0;
  // An older struct cannot configure mixed-bit keys: key_token_bits 0 is never valid for them.
  if (c.struct_size < sizeof(qjlkv_config)) c.key_token_bits = 0;
  rule(c.num_layers >= 1 && c.num_layers <= 65536, "num_layers");
  rule(c.num_kv_heads >= 1 && c.num_kv_heads <= 4096, "num_kv_heads");
  rule(c.num_q_heads >= 1 && c.num_q_heads <= 4096 && c.num_kv_heads != 0 && c.num_q_heads % c.num_kv_heads == 0,
       "num_q_heads");
  const bool d_ok = c.head_dim >= 8 && c.head_dim <= 256 && c.head_dim % 8 == 0;
  rule(d_ok, "head_dim");
  rule(c.dtype <= QJLKV_DTYPE_BF16, "dtype");
  if (c.struct_size == QJLKV_CONFIG_SIZE_0_1) {
    rule(legacy_device(c) >= -1, "device");
  } else {
    rule(c.backend <= QJLKV_BACKEND_CUDA, "backend");
    rule(c.backend != QJLKV_BACKEND_CPU || c.device_ordinal == 0, "device_ordinal");
  }
  rule((c.sketch_flags & ~QJLKV_SKETCH_ORTHOGONAL) == 0, "sketch_flags");
  rule(c.block_tokens >= 8 && c.block_tokens <= 4096 && c.block_tokens % 8 == 0, "block_tokens");
  rule(c.residual_tokens <= 65536, "residual_tokens");
  switch (c.key_method) {
    case QJLKV_KEYS_QJL:
      rule(sketch_dim_ok(c.key_sketch_dim, false), "key_sketch_dim");
      rule(c.outlier_channels < c.head_dim, "outlier_channels");
      rule(sketch_dim_ok(c.outlier_sketch_dim, true) && (c.outlier_channels == 0 || c.outlier_sketch_dim > 0),
           "outlier_sketch_dim");
      rule(c.initial_layers <= c.num_layers, "initial_layers");
      if (c.initial_layers > 0) {
        rule(sketch_dim_ok(c.initial_key_sketch_dim, false), "initial_key_sketch_dim");
        rule(sketch_dim_ok(c.initial_outlier_sketch_dim, true) &&
                 (c.outlier_channels == 0 || c.initial_outlier_sketch_dim > 0),
             "initial_outlier_sketch_dim");
      }
      break;
    case QJLKV_KEYS_OTT:
      rule(c.outlier_tokens < c.block_tokens, "outlier_tokens");  // a block keeps a token to average
      rule(c.outlier_spill_tokens <= 4096, "outlier_spill_tokens");
      rule(c.outlier_skip_layers <= c.num_layers, "outlier_skip_layers");
      [[fallthrough]];
    case QJLKV_KEYS_KIVI:
      rule(is_bits(c.key_bits), "key_bits");
      break;
    case QJLKV_KEYS_EXACT:
      break;
    case QJLKV_KEYS_MIXED:  // at most 4 bits a channel, whole bytes a token
      rule(c.key_token_bits >= 8 && uint64_t(c.key_token_bits) <= 4ull * c.head_dim && c.key_token_bits % 8 == 0,
           "key_token_bits");
      break;
    default:
      wrong.push_back("key_method");
  }
  if (c.value_method == QJLKV_VALUES_UNIFORM) {
    rule(is_bits(c.value_bits) || c.value_bits == 16, "value_bits");
    rule(c.value_group_size >= 1 && (!d_ok || c.head_dim % c.value_group_size == 0), "value_group_size");
  } else if (c.value_method == QJLKV_VALUES_ROTATED_LLOYD_MAX) {
    rule(c.value_bits >= 2 && c.value_bits <= 4, "value_bits");  // value_group_size is ignored
  } else {
    wrong.push_back("value_method");
  }
  rule(c.rollback_tokens <= 65536, "rollback_tokens");
  rule(c.sink_tokens <= 65536, "sink_tokens");
  rule(c.num_threads <= 1024, "num_threads");
  return wrong;
}

// Small enough that creating it costs milliseconds.
bool small(const qjlkv_config &c) {
  return c.num_layers <= 3 && c.num_q_heads <= 16 && c.key_sketch_dim <= 1024 && c.outlier_sketch_dim <= 1024 &&
         c.initial_key_sketch_dim <= 1024 && c.initial_outlier_sketch_dim <= 1024 && c.block_tokens <= 256 &&
         c.residual_tokens <= 256 && c.num_threads <= 4;
}

void fuzz_config_init(Input &in, qjlkv_config &cfg) {
  static const char *const kPresets[] = {"qjl", "kivi", "ott", "exact", "", nullptr, "QJL", "qjl ",
                                         "exactly", "q3", "q4", "q5", "q2", "Q2", "q1"};
  const char *preset = in.pick(kPresets);
  const uint32_t layers = fuzz_u32(in), hq = fuzz_u32(in), hkv = fuzz_u32(in), d = fuzz_u32(in);
  std::memset(&cfg, 0xA5, sizeof cfg);
  // The caller sets struct_size first: a shipped size or a wrong one.
  cfg.struct_size = in.flag() ? fuzz_struct_size(in) : fuzz_u32(in);
  const bool size_ok = shipped_size(cfg.struct_size);
  const qjlkv_config before = cfg;
  const qjlkv_status s = qjlkv_config_init(&cfg, preset, layers, hq, hkv, d);
  const std::string p = preset ? preset : "";
  const bool preset_ok =
      p.empty() || p == "q2" || p == "q3" || p == "q4" || p == "qjl" || p == "kivi" || p == "ott" || p == "exact";
  const bool shape_ok = layers >= 1 && layers <= 65536 && hkv >= 1 && hkv <= 4096 && hq >= 1 && hq <= 4096 &&
                        hq % hkv == 0 && d >= 8 && d <= 256 && d % 8 == 0;
  FUZZ_CHECK((s == QJLKV_OK) == (size_ok && preset_ok && shape_ok),
             "config_init(\"%s\", %u, %u, %u, %u) with struct_size %u -> %s", p.c_str(), layers, hq, hkv, d,
             before.struct_size, qjlkv_status_string(s));
  if (s != QJLKV_OK) {
    FUZZ_CHECK(s == QJLKV_ERROR_INVALID_ARGUMENT, "status %s", qjlkv_status_string(s));
    FUZZ_CHECK(std::memcmp(&cfg, &before, sizeof cfg) == 0, "a failed config_init changed *cfg");
    // Start the field fuzzing from a valid config anyway.
    cfg.struct_size = sizeof cfg;
    FUZZ_CHECK(qjlkv_config_init(&cfg, "qjl", 1, 2, 1, 16) == QJLKV_OK, "fallback config");
    return;
  }
  FUZZ_CHECK(cfg.struct_size == before.struct_size, "struct_size %u, was %u", cfg.struct_size, before.struct_size);
  if (cfg.struct_size == QJLKV_CONFIG_SIZE_0_1)
    FUZZ_CHECK(legacy_device(cfg) == -1, "0.1's device is %d, must default to -1 (CPU)", legacy_device(cfg));
  if (cfg.struct_size == QJLKV_CONFIG_SIZE_0_1)
    FUZZ_CHECK(cfg.value_method == 0xA5A5A5A5u && cfg.sink_tokens == 0xA5A5A5A5u,
               "config_init must write nothing past a 0.1-sized struct");
  if (cfg.struct_size < QJLKV_CONFIG_SIZE_0_4)
    FUZZ_CHECK(cfg.rollback_tokens == 0xA5A5A5A5u && cfg.memory_budget == 0xA5A5A5A5A5A5A5A5ull,
               "config_init must write nothing past an older struct");
  if (cfg.struct_size < sizeof cfg)
    FUZZ_CHECK(cfg.key_token_bits == 0xA5A5A5A5u, "config_init must write nothing past an older struct");
  else  // every preset: 2.125 bits a channel, whole bytes a token
    FUZZ_CHECK(cfg.key_token_bits == 8 * ((17 * d + 63) / 64), "key_token_bits %u at head_dim %u",
               cfg.key_token_bits, d);
  const qjlkv_status v = qjlkv_config_validate(&cfg);
  if (p == "q2" && cfg.struct_size < sizeof cfg) {
    // An older struct has no key_token_bits, so the mixed-bit keys that "q2" fills in are not
    // valid there: validate and create refuse them, naming the field.
    FUZZ_CHECK(cfg.key_method == QJLKV_KEYS_MIXED, "q2's key_method is %u", cfg.key_method);
    FUZZ_CHECK(v == QJLKV_ERROR_INVALID_ARGUMENT && names(qjlkv_last_error_message(), "key_token_bits"),
               "q2 in a struct of %u bytes -> %s", cfg.struct_size, qjlkv_status_string(v));
    return;
  }
  FUZZ_CHECK(v == QJLKV_OK, "config_init(\"%s\", %u, %u, %u, %u) filled a config that does not validate",
             p.c_str(), layers, hq, hkv, d);
}

// Overwrites a few fields with fuzzed values.
void mutate(Input &in, qjlkv_config &cfg) {
  uint32_t *const fields[] = {&cfg.struct_size,       &cfg.num_layers,          &cfg.num_q_heads,
                              &cfg.num_kv_heads,      &cfg.head_dim,            &cfg.sketch_flags,
                              &cfg.block_tokens,      &cfg.residual_tokens,     &cfg.key_sketch_dim,
                              &cfg.outlier_channels,  &cfg.outlier_sketch_dim,  &cfg.initial_layers,
                              &cfg.initial_key_sketch_dim, &cfg.initial_outlier_sketch_dim, &cfg.key_bits,
                              &cfg.outlier_tokens,    &cfg.outlier_spill_tokens, &cfg.outlier_skip_layers,
                              &cfg.value_bits,        &cfg.value_group_size,    &cfg.num_threads,
                              &cfg.value_method,      &cfg.sink_tokens,         &cfg.rollback_tokens,
                              &cfg.key_token_bits};
  constexpr size_t kFields = sizeof fields / sizeof fields[0];
  for (uint32_t n = in.byte() % 6; n > 0; --n) {
    const uint32_t which = in.byte() % (kFields + 7);
    if (which < kFields) {
      *fields[which] = fuzz_u32(in);
    } else if (which == kFields) {
      cfg.dtype = uint32_t(int(in.byte() % 5) - 1);
    } else if (which == kFields + 1) {
      cfg.key_method = uint32_t(int(in.byte() % 7) - 1);  // -1, the five methods, one past them
    } else if (which == kFields + 2) {  // for a 0.1-sized config: its int32_t device
      cfg.device_ordinal = in.flag() ? in.u32() : uint32_t(int(in.byte() % 4) - 2);
    } else if (which == kFields + 3) {
      cfg.backend = in.flag() ? in.u32() : in.byte() % 3;
    } else if (which == kFields + 4) {
      cfg.struct_size = fuzz_struct_size(in);
    } else if (which == kFields + 5) {
      // 0 (no budget), a budget too small for one block, or room for a few.
      static constexpr uint64_t kBudgets[] = {0, 1, 4096, 1ull << 20, ~0ull};
      cfg.memory_budget = in.flag() ? in.u64() : in.pick(kBudgets);
    } else {
      cfg.seed = in.u64();
    }
  }
}

void exercise_cache(Input &in, qjlkv_cache *c, const qjlkv_config &cfg) {
  const uint32_t layer = in.byte() % cfg.num_layers;
  const uint32_t n = cfg.residual_tokens + cfg.block_tokens + in.byte() % 4;  // quantizes a block
  const size_t io = cfg.dtype == QJLKV_DTYPE_F32 ? 4 : 2;
  const size_t token_elems = size_t(cfg.num_kv_heads) * cfg.head_dim;
  std::vector<uint8_t> keys(n * token_elems * io), values(keys.size());
  // Small positive numbers in every dtype: 0x3c00 is 1.0 in fp16, 0x3f80 is 1.0 in bf16.
  for (size_t i = 0; i < n * token_elems; ++i) {
    const uint16_t low = uint16_t(in.byte()) % 64;
    if (io == 4) {
      const float kf = 1.0f + float(low) / 64.0f, vf = 1.0f - float(i % 7) / 8.0f;
      std::memcpy(&keys[4 * i], &kf, 4);
      std::memcpy(&values[4 * i], &vf, 4);
    } else {
      const uint16_t one = cfg.dtype == QJLKV_DTYPE_F16 ? 0x3c00 : 0x3f80;
      const uint16_t k = uint16_t(one + low), v = uint16_t(one - (i % 7));
      std::memcpy(&keys[2 * i], &k, 2);
      std::memcpy(&values[2 * i], &v, 2);
    }
  }
  qjlkv_status s = qjlkv_cache_append(c, layer, 3, n, keys.data(), values.data());
  uint64_t length = 0;
  if (s == QJLKV_ERROR_MEMORY_BUDGET) {
    // Only a config with a budget refuses, and the refusal changes nothing.
    FUZZ_CHECK(cfg.struct_size == sizeof cfg && cfg.memory_budget != 0, "append refused with no memory_budget");
    FUZZ_CHECK(names(qjlkv_last_error_message(), "memory_budget"), "the refusal does not name memory_budget");
    FUZZ_CHECK(qjlkv_cache_length(c, layer, 3, &length) == QJLKV_OK && length == 0, "a refused append stored %llu",
               (unsigned long long)length);
    return;
  }
  FUZZ_CHECK(s == QJLKV_OK, "append of %u tokens: %s", n, qjlkv_status_string(s));
  FUZZ_CHECK(qjlkv_cache_length(c, layer, 3, &length) == QJLKV_OK && length == n, "length %llu, appended %u",
             (unsigned long long)length, n);
  std::vector<uint8_t> query(size_t(cfg.num_q_heads) * cfg.head_dim * io, 0);
  std::vector<uint8_t> out(query.size());
  s = qjlkv_cache_attend(c, layer, 3, 1, query.data(), 0.0f, out.data());
  FUZZ_CHECK(s == QJLKV_OK, "attend: %s", qjlkv_status_string(s));
  // A zero query weighs every position equally: the output is the mean of the values, which lie
  // in [1/4, 1] (1 - 6/8 up to 1; quantization stays within the group's range up to rounding).
  // Rotated Lloyd-Max values keep only each token's norm (<= sqrt(d)), not the channel ranges.
  const bool rotated = cfg.struct_size != QJLKV_CONFIG_SIZE_0_1 && cfg.value_method == QJLKV_VALUES_ROTATED_LLOYD_MAX;
  const float lo = rotated ? -1.01f * std::sqrt(float(cfg.head_dim)) : 0.2f;
  const float hi = rotated ? 1.01f * std::sqrt(float(cfg.head_dim)) : 1.05f;
  for (size_t i = 0; i < size_t(cfg.num_q_heads) * cfg.head_dim; ++i) {
    float x;
    if (io == 4) {
      std::memcpy(&x, &out[4 * i], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &out[2 * i], 2);
      uint32_t bits;
      if (cfg.dtype == QJLKV_DTYPE_BF16) {
        bits = uint32_t(h) << 16;
        std::memcpy(&x, &bits, 4);
      } else {  // normal fp16 numbers only: the bound check below rejects anything else
        bits = (uint32_t(h & 0x8000u) << 16) | ((uint32_t(h >> 10 & 0x1f) + 112u) << 23) | (uint32_t(h & 0x3ffu) << 13);
        std::memcpy(&x, &bits, 4);
        if ((h >> 10 & 0x1f) == 0 || (h >> 10 & 0x1f) == 0x1f) x = NAN;
      }
    }
    FUZZ_CHECK(std::isfinite(x) && x >= lo && x <= hi, "attend output[%zu] = %g with a zero query", i,
               double(x));
  }
  qjlkv_stats st;
  std::memset(&st, 0, sizeof st);
  st.struct_size = sizeof st;
  FUZZ_CHECK(qjlkv_cache_stats(c, &st) == QJLKV_OK, "stats");
  FUZZ_CHECK(st.tokens == n && st.bytes_used <= st.bytes_reserved && st.bytes_used > 0, "stats: tokens %llu",
             (unsigned long long)st.tokens);
  FUZZ_CHECK(qjlkv_cache_clear_sequence(c, 3) == QJLKV_OK, "clear");
}

void fuzz_fields(Input &in, qjlkv_config cfg) {
  mutate(in, cfg);
  const std::vector<std::string> wrong = wrong_fields(cfg);
  const qjlkv_status v = qjlkv_config_validate(&cfg);
  const std::string message = qjlkv_last_error_message();
  FUZZ_CHECK((v == QJLKV_OK) == wrong.empty(), "validate -> %s; the header's rules say %s%s",
             qjlkv_status_string(v), wrong.empty() ? "valid" : "wrong: ", wrong.empty() ? "" : wrong[0].c_str());
  if (v != QJLKV_OK) {
    FUZZ_CHECK(v == QJLKV_ERROR_INVALID_ARGUMENT, "validate status %s", qjlkv_status_string(v));
    bool named = false;
    for (const std::string &field : wrong) named = named || names(message, field);
    FUZZ_CHECK(named, "the message names none of the wrong fields (first: %s)", wrong[0].c_str());
  }
  if (!small(cfg) && v == QJLKV_OK) return;  // valid but costly: creating it is not the point here
  qjlkv_cache *c = reinterpret_cast<qjlkv_cache *>(&cfg);  // must be overwritten
  const qjlkv_status s = qjlkv_cache_create(&cfg, &c);
  FUZZ_TRACE("create: size %u, key_method %u, dtype %u, backend %u, device_ordinal %u, layers %u, Hq %u, Hkv %u, d %u, B %u, R %u, threads %u, "
             "key_bits %u, value_bits %u, group %u, m %u, c %u, m_out %u, initial %u (%u, %u), P %u, spill %u, "
             "skip %u, key_token_bits %u -> %s\n",
             cfg.struct_size, cfg.key_method, cfg.dtype, cfg.backend, cfg.device_ordinal, cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads,
             cfg.head_dim, cfg.block_tokens, cfg.residual_tokens, cfg.num_threads, cfg.key_bits, cfg.value_bits,
             cfg.value_group_size, cfg.key_sketch_dim, cfg.outlier_channels, cfg.outlier_sketch_dim,
             cfg.initial_layers, cfg.initial_key_sketch_dim, cfg.initial_outlier_sketch_dim, cfg.outlier_tokens,
             cfg.outlier_spill_tokens, cfg.outlier_skip_layers, cfg.struct_size == sizeof cfg ? cfg.key_token_bits : 0,
             qjlkv_status_string(s));
  if (v != QJLKV_OK) {
    FUZZ_CHECK(s == v, "create -> %s but validate -> %s", qjlkv_status_string(s), qjlkv_status_string(v));
    FUZZ_CHECK(c == nullptr, "a failed create left *out non-NULL");
    return;
  }
  if (asks_for_cuda(cfg)) {
    // CPU builds have no CUDA backend; CUDA builds may or may not find such a device.
    FUZZ_CHECK(s == QJLKV_OK || s == QJLKV_ERROR_UNSUPPORTED || s == QJLKV_ERROR_DEVICE, "create on CUDA %u -> %s",
               cfg.device_ordinal, qjlkv_status_string(s));
    FUZZ_CHECK(s == QJLKV_OK || names(qjlkv_last_error_message(), "device_ordinal"),
               "the message does not name device_ordinal");
  } else {
    FUZZ_CHECK(s == QJLKV_OK, "create of a valid config -> %s", qjlkv_status_string(s));
  }
  if (s != QJLKV_OK) {
    FUZZ_CHECK(c == nullptr, "a failed create left *out non-NULL");
    return;
  }
  if (!asks_for_cuda(cfg)) exercise_cache(in, c, cfg);
  qjlkv_cache_destroy(c);
}

void fuzz_sketch(Input &in) {
  const uint32_t d = in.flag() ? in.range(0, 1100) : fuzz_u32(in);
  const uint32_t m = in.flag() ? in.range(0, 1100) : fuzz_u32(in);
  const uint32_t flags = in.flag() ? in.u32() : in.byte() % 3;
  const uint64_t seed = in.u64();
  const bool valid = d >= 1 && d <= 1024 && m >= 8 && m <= 65536 && m % 8 == 0 && (flags & ~1u) == 0;
  if (valid && uint64_t(d) * m > (uint64_t(1) << 18)) return;  // valid but slow
  qjlkv_sketch *s = reinterpret_cast<qjlkv_sketch *>(&in);
  const qjlkv_status st = qjlkv_sketch_create(d, m, seed, flags, &s);
  FUZZ_CHECK((st == QJLKV_OK) == valid, "sketch_create(%u, %u, flags 0x%x) -> %s", d, m, flags,
             qjlkv_status_string(st));
  if (st != QJLKV_OK) {
    FUZZ_CHECK(s == nullptr, "a failed sketch_create left *out non-NULL");
    return;
  }
  uint32_t rows = 0, cols = 0;
  FUZZ_CHECK(qjlkv_sketch_shape(s, &rows, &cols) == QJLKV_OK && rows == m && cols == d, "shape %u x %u", rows,
             cols);
  std::vector<float> a(size_t(m) * d), b(a.size());
  FUZZ_CHECK(qjlkv_sketch_matrix(s, a.data(), a.size()) == QJLKV_OK, "matrix");
  qjlkv_sketch *again = nullptr;
  FUZZ_CHECK(qjlkv_sketch_create(d, m, seed, flags, &again) == QJLKV_OK, "second create");
  FUZZ_CHECK(qjlkv_sketch_matrix(again, b.data(), b.size()) == QJLKV_OK, "matrix");
  FUZZ_CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0, "same seed, different matrix");
  for (uint32_t i = 0; i < m; ++i) {
    double norm2 = 0.0;
    for (uint32_t j = 0; j < d; ++j) {
      const float x = a[size_t(i) * d + j];
      FUZZ_CHECK(std::isfinite(x), "entry (%u, %u) is %g", i, j, double(x));
      norm2 += double(x) * x;
    }
    if (flags & QJLKV_SKETCH_ORTHOGONAL)
      FUZZ_CHECK(std::fabs(std::sqrt(norm2) - std::sqrt(double(d))) <= 1e-4 * std::sqrt(double(d)),
                 "row %u has norm %g, expected sqrt(%u)", i, std::sqrt(norm2), d);
  }
  qjlkv_sketch_destroy(again);
  qjlkv_sketch_destroy(s);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  Input in(data, size);
  qjlkv_config cfg;
  fuzz_config_init(in, cfg);
  fuzz_fields(in, cfg);
  fuzz_sketch(in);
  return 0;
}
