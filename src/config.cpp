#include "config.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string_view>

#include "error.hpp"
#include "half.hpp"
#include "methods/methods.hpp"

namespace qjlkv {

size_t dtype_size(qjlkv_dtype dtype) {
  switch (dtype) {
    case QJLKV_DTYPE_F32: return 4;
    case QJLKV_DTYPE_F16:
    case QJLKV_DTYPE_BF16: return 2;
  }
  unreachable();
}

namespace {

void check_shape(uint32_t num_layers, uint32_t num_q_heads, uint32_t num_kv_heads, uint32_t head_dim) {
  QJLKV_REQUIRE(num_layers >= 1 && num_layers <= QJLKV_MAX_LAYERS, "num_layers is %u, must be in [1, %u]", num_layers,
                QJLKV_MAX_LAYERS);
  QJLKV_REQUIRE(num_kv_heads >= 1 && num_kv_heads <= QJLKV_MAX_HEADS, "num_kv_heads is %u, must be in [1, %u]",
                num_kv_heads, QJLKV_MAX_HEADS);
  QJLKV_REQUIRE(num_q_heads >= 1 && num_q_heads <= QJLKV_MAX_HEADS, "num_q_heads is %u, must be in [1, %u]",
                num_q_heads, QJLKV_MAX_HEADS);
  QJLKV_REQUIRE(num_q_heads % num_kv_heads == 0,
                "num_q_heads (%u) is not a multiple of num_kv_heads (%u): GQA needs an integer group size",
                num_q_heads, num_kv_heads);
  QJLKV_REQUIRE(head_dim >= 8 && head_dim <= QJLKV_MAX_HEAD_DIM && head_dim % 8 == 0,
                "head_dim is %u, must be a multiple of 8 in [8, %u]", head_dim, QJLKV_MAX_HEAD_DIM);
}

}  // namespace

// Every size of qjlkv_config that a release shipped, oldest first. 0.2 appended `backend` after
// 0.1's tail padding, which became the named field unused_0_1; 0.4 appended memory_budget after
// 0.3's, which became unused_0_3; 0.5 appended key_token_bits after 0.4's, which became unused_0_4.
constexpr uint32_t kConfigSizes[] = {QJLKV_CONFIG_SIZE_0_1, QJLKV_CONFIG_SIZE_0_3, QJLKV_CONFIG_SIZE_0_4,
                                     uint32_t(sizeof(qjlkv_config))};
static_assert(offsetof(qjlkv_config, backend) == QJLKV_CONFIG_SIZE_0_1, "0.2's fields start after 0.1's struct");
static_assert(offsetof(qjlkv_config, memory_budget) == QJLKV_CONFIG_SIZE_0_3, "0.4's fields start after 0.3's struct");
static_assert(offsetof(qjlkv_config, key_token_bits) == QJLKV_CONFIG_SIZE_0_4, "0.5's fields start after 0.4's struct");

namespace {

// 0.1's `int32_t device` (-1 = CPU, >= 0 = CUDA ordinal) sits where device_ordinal is now.
int32_t legacy_device(const qjlkv_config &cfg) {
  int32_t device;
  std::memcpy(&device, &cfg.device_ordinal, sizeof device);
  return device;
}

void set_legacy_device(qjlkv_config &cfg, int32_t device) {
  std::memcpy(&cfg.device_ordinal, &device, sizeof device);
}

}  // namespace

qjlkv_config complete_config(const qjlkv_config &cfg) {
  require_shipped_size("config.struct_size", cfg.struct_size, kConfigSizes, "qjlkv_config");
  qjlkv_config full;
  std::memset(&full, 0, sizeof full);  // fields added after the caller's release default to 0
  std::memcpy(&full, &cfg, cfg.struct_size);
  full.struct_size = sizeof full;
  full.unused_0_1 = 0;
  full.unused_0_3 = 0;
  full.unused_0_4 = 0;
  if (cfg.struct_size == QJLKV_CONFIG_SIZE_0_1) {
    const int32_t device = legacy_device(cfg);
    QJLKV_REQUIRE(device >= -1,
                  "config.device (a 0.1-sized config: struct_size %u) is %d, must be -1 (CPU) or a CUDA device "
                  "ordinal >= 0",
                  cfg.struct_size, device);
    full.backend = device < 0 ? QJLKV_BACKEND_CPU : QJLKV_BACKEND_CUDA;
    full.device_ordinal = device < 0 ? 0 : uint32_t(device);
  }
  return full;
}

void write_caller_config(qjlkv_config &dst, const qjlkv_config &full) {
  const uint32_t size = dst.struct_size;
  require_shipped_size("config.struct_size", size, kConfigSizes, "qjlkv_config");
  qjlkv_config out = full;
  out.struct_size = size;
  out.unused_0_1 = 0;
  out.unused_0_3 = 0;
  out.unused_0_4 = 0;
  if (size == QJLKV_CONFIG_SIZE_0_1) {
    switch (backend_of(full)) {
      case QJLKV_BACKEND_CPU: set_legacy_device(out, -1); break;
      // A CUDA cache exists only for an ordinal the runtime reported, so it fits in an int32.
      case QJLKV_BACKEND_CUDA: set_legacy_device(out, int32_t(full.device_ordinal)); break;
    }
  }
  std::memcpy(&dst, &out, size);
}

void init_preset(qjlkv_config &out, const char *preset, uint32_t num_layers, uint32_t num_q_heads,
                 uint32_t num_kv_heads, uint32_t head_dim) {
  require_shipped_size("cfg->struct_size", out.struct_size, kConfigSizes, "qjlkv_config");
  check_shape(num_layers, num_q_heads, num_kv_heads, head_dim);
  const std::string_view name = preset ? preset : "";
  qjlkv_config cfg;
  std::memset(&cfg, 0, sizeof cfg);  // padding too, so configs compare bytewise
  cfg.struct_size = sizeof cfg;
  cfg.num_layers = num_layers;
  cfg.num_q_heads = num_q_heads;
  cfg.num_kv_heads = num_kv_heads;
  cfg.head_dim = head_dim;
  cfg.dtype = QJLKV_DTYPE_F32;
  cfg.backend = QJLKV_BACKEND_CPU;
  cfg.device_ordinal = 0;
  cfg.seed = 0;
  cfg.sketch_flags = QJLKV_SKETCH_ORTHOGONAL;
  // QJL fields are filled in every preset so that switching key_method gives sane sizes.
  // Measured on SmolLM2-135M (docs/ACCURACY.md): 4 outlier channels with a d-row outlier sketch
  // beat 8 channels with d/2 rows by 5x in KL.
  cfg.key_sketch_dim = 2 * head_dim;
  cfg.outlier_channels = head_dim >= 16 ? 4 : 0;
  cfg.outlier_sketch_dim = cfg.outlier_channels ? head_dim : 0;
  cfg.initial_layers = 0;
  cfg.initial_key_sketch_dim = cfg.key_sketch_dim;
  cfg.initial_outlier_sketch_dim = cfg.outlier_sketch_dim;
  cfg.key_bits = 2;
  cfg.outlier_tokens = 3;
  cfg.outlier_spill_tokens = 32;
  cfg.outlier_skip_layers = std::min(2u, num_layers);
  cfg.value_bits = 2;
  cfg.value_group_size = head_dim % 32 == 0 ? 32 : head_dim % 16 == 0 ? 16 : 8;  // head_dim % 8 == 0
  cfg.num_threads = 0;
  cfg.value_method = QJLKV_VALUES_UNIFORM;
  cfg.sink_tokens = 0;
  // Exact rollback of the draft lengths engines use for speculative decoding (Hugging Face's
  // assisted decoding starts at 20 and grows to at most its cap).
  cfg.rollback_tokens = 32;
  cfg.memory_budget = 0;
  cfg.key_token_bits = 8 * ((17 * head_dim + 63) / 64);  // 2.125 bits a channel, whole bytes a token
  if (name.empty() || name == "q3" || name == "q4") {
    // The tiers (docs/ACCURACY.md, "Goal table"): per-channel 3- or 4-bit keys, the first tokens
    // exact (attention sinks), rotated 2- or 3-bit Lloyd-Max values. The 3-bit tier takes blocks
    // of 64, a tail of 16 and 16 sinks: with 128 / 32 / 4 it missed 3 of 16 pass keys on SmolLM2
    // at the same bits (the "q3 parameter candidates" there).
    const bool four = name == "q4";
    cfg.key_method = QJLKV_KEYS_KIVI;
    cfg.key_bits = four ? 4 : 3;
    cfg.block_tokens = four ? 128 : 64;
    cfg.residual_tokens = four ? 32 : 16;
    cfg.sink_tokens = four ? 4 : 16;
    cfg.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
    cfg.value_bits = four ? 3 : 2;
  } else if (name == "q2") {
    // The 2-bit tier (docs/ACCURACY.md, "2-bit candidates", Q2q): mixed-bit keys, 2.125 bits a
    // channel where the block's ranges are, 16 sinks, q3's rotated 2-bit Lloyd-Max values.
    cfg.key_method = QJLKV_KEYS_MIXED;
    cfg.block_tokens = 128;
    cfg.residual_tokens = 32;
    cfg.sink_tokens = 16;
    cfg.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
    cfg.value_bits = 2;
  } else if (name == "qjl") {
    cfg.key_method = QJLKV_KEYS_QJL;
    cfg.block_tokens = 32;
    cfg.residual_tokens = 32;
    // Groups of 64 pay for the larger outlier sketch: same KL on SmolLM2 (docs/ACCURACY.md).
    if (head_dim % 64 == 0) cfg.value_group_size = 64;
  } else if (name == "kivi" || name == "ott") {
    cfg.key_method = name == "kivi" ? QJLKV_KEYS_KIVI : QJLKV_KEYS_OTT;
    cfg.block_tokens = 128;
    cfg.residual_tokens = 32;
  } else if (name == "exact") {
    cfg.key_method = QJLKV_KEYS_EXACT;
    cfg.block_tokens = 32;
    cfg.residual_tokens = 0;
    cfg.value_bits = 16;
  } else {
    fail(QJLKV_ERROR_INVALID_ARGUMENT, "preset \"%.64s\" is unknown; known presets: q2, q3, q4, qjl, kivi, ott, exact",
         preset);
  }
  write_caller_config(out, cfg);
}

void validate_config(const qjlkv_config &caller_cfg) {
  const qjlkv_config cfg = complete_config(caller_cfg);
  check_shape(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim);
  // Enum fields are uint32_t: any value a caller stores is compared as an integer.
  QJLKV_REQUIRE(cfg.dtype == QJLKV_DTYPE_F32 || cfg.dtype == QJLKV_DTYPE_F16 || cfg.dtype == QJLKV_DTYPE_BF16,
                "config.dtype is %u, must be QJLKV_DTYPE_F32, _F16 or _BF16", cfg.dtype);
  QJLKV_REQUIRE(cfg.key_method == QJLKV_KEYS_QJL || cfg.key_method == QJLKV_KEYS_KIVI ||
                    cfg.key_method == QJLKV_KEYS_OTT || cfg.key_method == QJLKV_KEYS_EXACT ||
                    cfg.key_method == QJLKV_KEYS_MIXED,
                "config.key_method is %u, must be QJLKV_KEYS_QJL, _KIVI, _OTT, _EXACT or _MIXED", cfg.key_method);
  QJLKV_REQUIRE(cfg.backend == QJLKV_BACKEND_CPU || cfg.backend == QJLKV_BACKEND_CUDA,
                "config.backend is %u, must be QJLKV_BACKEND_CPU or _CUDA", cfg.backend);
  QJLKV_REQUIRE(cfg.backend != QJLKV_BACKEND_CPU || cfg.device_ordinal == 0,
                "config.device_ordinal is %u, must be 0 for QJLKV_BACKEND_CPU", cfg.device_ordinal);
  QJLKV_REQUIRE((cfg.sketch_flags & ~QJLKV_SKETCH_ORTHOGONAL) == 0,
                "config.sketch_flags is 0x%x, only QJLKV_SKETCH_ORTHOGONAL (0x1) is defined", cfg.sketch_flags);
  QJLKV_REQUIRE(cfg.block_tokens >= 8 && cfg.block_tokens <= QJLKV_MAX_BLOCK_TOKENS && cfg.block_tokens % 8 == 0,
                "config.block_tokens is %u, must be a multiple of 8 in [8, %u]", cfg.block_tokens,
                QJLKV_MAX_BLOCK_TOKENS);
  QJLKV_REQUIRE(cfg.residual_tokens <= QJLKV_MAX_RESIDUAL_TOKENS, "config.residual_tokens is %u, must be <= %u",
                cfg.residual_tokens, QJLKV_MAX_RESIDUAL_TOKENS);
  with_key_method(cfg.key_method, [&](auto keys) { keys.validate(cfg); });
  QJLKV_REQUIRE(cfg.value_method == QJLKV_VALUES_UNIFORM || cfg.value_method == QJLKV_VALUES_ROTATED_LLOYD_MAX,
                "config.value_method is %u, must be a qjlkv_value_method", cfg.value_method);
  with_value_method(cfg.value_method, [&](auto values) { values.validate(cfg); });
  QJLKV_REQUIRE(cfg.rollback_tokens <= QJLKV_MAX_ROLLBACK_TOKENS, "config.rollback_tokens is %u, must be <= %u",
                cfg.rollback_tokens, QJLKV_MAX_ROLLBACK_TOKENS);
  QJLKV_REQUIRE(cfg.sink_tokens <= QJLKV_MAX_RESIDUAL_TOKENS, "config.sink_tokens is %u, must be <= %u", cfg.sink_tokens,
                QJLKV_MAX_RESIDUAL_TOKENS);
  QJLKV_REQUIRE(cfg.num_threads <= QJLKV_MAX_THREADS, "config.num_threads is %u, must be <= %u (0 = cores available)",
                cfg.num_threads, QJLKV_MAX_THREADS);
}

namespace {

BlockLayout make_layout(const qjlkv_config &cfg, const LayerSpec &layer) {
  BlockLayout l;
  LayoutCursor at;
  with_key_method(cfg.key_method, [&](auto keys) { keys.layout(cfg, layer, at, l); });
  l.key_bytes = at.at;
  at.at = (at.at + 7) & ~size_t(7);
  l.values_offset = at.at;
  with_value_method(cfg.value_method, [&](auto values) { values.layout(cfg, at, l); });
  l.value_bytes = at.at - l.values_offset;
  l.stride = (at.at + 7) & ~size_t(7);
  return l;
}

}  // namespace

void fail_bad_element(const char *name, size_t index, float x, float limit) {
  if (!std::isfinite(x))
    fail(QJLKV_ERROR_INVALID_ARGUMENT, "%s[%zu] is %g: keys, values and queries must be finite", name, index, double(x));
  if (limit == kHalfMax)
    fail(QJLKV_ERROR_INVALID_ARGUMENT,
         "%s[%zu] is %g, outside the fp16 range (|x| <= 65504) that this configuration stores", name, index, double(x));
  fail(QJLKV_ERROR_INVALID_ARGUMENT,
       "%s[%zu] is %g: |x| must be at most %g, so that attention's sum over up to 2^32 tokens stays finite", name,
       index, double(x), double(limit));
}

CacheSpec make_cache_spec(const qjlkv_config &caller_cfg) {
  validate_config(caller_cfg);
  CacheSpec spec;
  spec.created_with = complete_config(caller_cfg);
  // Validation ignores the fields of other methods, so nothing downstream may read them: the
  // fields a method owns are 0 unless it is the configuration's method (its copy_fields()).
  qjlkv_config cfg = spec.created_with;
  cfg.key_sketch_dim = cfg.outlier_channels = cfg.outlier_sketch_dim = 0;
  cfg.initial_layers = cfg.initial_key_sketch_dim = cfg.initial_outlier_sketch_dim = 0;
  cfg.key_bits = cfg.outlier_tokens = cfg.outlier_spill_tokens = cfg.outlier_skip_layers = 0;
  cfg.key_token_bits = 0;
  cfg.value_group_size = 0;
  with_methods(cfg, [&](auto keys, auto values) {
    keys.copy_fields(spec.created_with, cfg);
    values.copy_fields(spec.created_with, cfg);
  });
  spec.cfg = cfg;
  spec.group_size = cfg.num_q_heads / cfg.num_kv_heads;
  spec.io_elem = dtype_size(dtype_of(cfg));
  spec.stored_dtype = cfg.dtype == QJLKV_DTYPE_BF16 ? QJLKV_DTYPE_BF16 : QJLKV_DTYPE_F16;
  spec.tail_elem = spec.io_elem;
  spec.qjl_constant = float(qjl_constant(cfg.head_dim, (cfg.sketch_flags & QJLKV_SKETCH_ORTHOGONAL) != 0));
  spec.layers.resize(cfg.num_layers);
  with_methods(cfg, [&](auto keys, auto values) {
    spec.key_limit = keys.element_limit(cfg, spec.stored_dtype);
    spec.value_limit = values.element_limit(cfg, spec.stored_dtype);
    keys.init_layers(cfg, spec.layers);
    values.init_layers(cfg, spec.layers);
  });
  for (LayerSpec &layer : spec.layers) layer.layout = make_layout(cfg, layer);
  return spec;
}

}  // namespace qjlkv
