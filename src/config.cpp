#include "config.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string_view>

#include <unistd.h>

#include "error.hpp"
#include "half.hpp"

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

void check_sketch_dim(const char *field, uint32_t value, bool allow_zero) {
  QJLKV_REQUIRE(value % 8 == 0 && value <= QJLKV_MAX_SKETCH_DIM && (allow_zero || value > 0),
                "%s is %u, must be a multiple of 8 in [%u, %u]", field, value, allow_zero ? 0u : 8u,
                QJLKV_MAX_SKETCH_DIM);
}

bool is_bits(uint32_t b) { return b == 2 || b == 3 || b == 4 || b == 8; }

}  // namespace

// Every size of qjlkv_config that a release shipped, oldest first. 0.2 appended `backend` after
// 0.1's tail padding, which became the named field unused_0_1.
constexpr uint32_t kConfigSizes[] = {QJLKV_CONFIG_SIZE_0_1, uint32_t(sizeof(qjlkv_config))};
static_assert(offsetof(qjlkv_config, backend) == QJLKV_CONFIG_SIZE_0_1, "0.2's fields start after 0.1's struct");

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
    fail(QJLKV_ERROR_INVALID_ARGUMENT, "preset \"%.64s\" is unknown; known presets: q3, q4, qjl, kivi, ott, exact",
         preset);
  }
  write_caller_config(out, cfg);
}

void validate_config(const qjlkv_config &caller_cfg) {
  const qjlkv_config cfg = complete_config(caller_cfg);
  check_shape(cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim);
  const uint32_t d = cfg.head_dim;
  // Enum fields are uint32_t: any value a caller stores is compared as an integer.
  QJLKV_REQUIRE(cfg.dtype == QJLKV_DTYPE_F32 || cfg.dtype == QJLKV_DTYPE_F16 || cfg.dtype == QJLKV_DTYPE_BF16,
                "config.dtype is %u, must be QJLKV_DTYPE_F32, _F16 or _BF16", cfg.dtype);
  QJLKV_REQUIRE(cfg.key_method == QJLKV_KEYS_QJL || cfg.key_method == QJLKV_KEYS_KIVI ||
                    cfg.key_method == QJLKV_KEYS_OTT || cfg.key_method == QJLKV_KEYS_EXACT,
                "config.key_method is %u, must be QJLKV_KEYS_QJL, _KIVI, _OTT or _EXACT", cfg.key_method);
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
  switch (key_method_of(cfg)) {
    case QJLKV_KEYS_QJL: {
      check_sketch_dim("config.key_sketch_dim", cfg.key_sketch_dim, false);
      QJLKV_REQUIRE(cfg.outlier_channels < d, "config.outlier_channels is %u, must be below head_dim (%u)",
                    cfg.outlier_channels, d);
      check_sketch_dim("config.outlier_sketch_dim", cfg.outlier_sketch_dim, true);
      QJLKV_REQUIRE(cfg.outlier_channels == 0 || cfg.outlier_sketch_dim > 0,
                    "config.outlier_sketch_dim is 0 but config.outlier_channels is %u: outlier channels need "
                    "an outlier sketch",
                    cfg.outlier_channels);
      QJLKV_REQUIRE(cfg.initial_layers <= cfg.num_layers, "config.initial_layers is %u, must be <= num_layers (%u)",
                    cfg.initial_layers, cfg.num_layers);
      if (cfg.initial_layers > 0) {
        check_sketch_dim("config.initial_key_sketch_dim", cfg.initial_key_sketch_dim, false);
        check_sketch_dim("config.initial_outlier_sketch_dim", cfg.initial_outlier_sketch_dim, true);
        QJLKV_REQUIRE(cfg.outlier_channels == 0 || cfg.initial_outlier_sketch_dim > 0,
                      "config.initial_outlier_sketch_dim is 0 but config.outlier_channels is %u",
                      cfg.outlier_channels);
      }
      break;
    }
    case QJLKV_KEYS_OTT:
      // A block must keep at least one token to take the mean of.
      QJLKV_REQUIRE(cfg.outlier_tokens < cfg.block_tokens,
                    "config.outlier_tokens is %u, must be below block_tokens (%u)", cfg.outlier_tokens,
                    cfg.block_tokens);
      QJLKV_REQUIRE(cfg.outlier_spill_tokens <= QJLKV_MAX_SPILL_TOKENS,
                    "config.outlier_spill_tokens is %u, must be <= %u", cfg.outlier_spill_tokens,
                    QJLKV_MAX_SPILL_TOKENS);
      QJLKV_REQUIRE(cfg.outlier_skip_layers <= cfg.num_layers,
                    "config.outlier_skip_layers is %u, must be <= num_layers (%u)", cfg.outlier_skip_layers,
                    cfg.num_layers);
      [[fallthrough]];
    case QJLKV_KEYS_KIVI:
      QJLKV_REQUIRE(is_bits(cfg.key_bits), "config.key_bits is %u, must be 2, 3, 4 or 8", cfg.key_bits);
      break;
    case QJLKV_KEYS_EXACT:
      break;
  }
  switch (cfg.value_method) {
    case QJLKV_VALUES_UNIFORM:
      QJLKV_REQUIRE(is_bits(cfg.value_bits) || cfg.value_bits == 16,
                    "config.value_bits is %u, must be 2, 3, 4, 8 or 16", cfg.value_bits);
      QJLKV_REQUIRE(cfg.value_group_size >= 1 && d % cfg.value_group_size == 0,
                    "config.value_group_size is %u, must divide head_dim (%u)", cfg.value_group_size, d);
      break;
    case QJLKV_VALUES_ROTATED_LLOYD_MAX:
      QJLKV_REQUIRE(cfg.value_bits >= 2 && cfg.value_bits <= 4,
                    "config.value_bits is %u, must be 2, 3 or 4 with config.value_method "
                    "QJLKV_VALUES_ROTATED_LLOYD_MAX",
                    cfg.value_bits);
      break;
    default:
      fail(QJLKV_ERROR_INVALID_ARGUMENT, "config.value_method is %u, must be a qjlkv_value_method", cfg.value_method);
  }
  QJLKV_REQUIRE(cfg.sink_tokens <= QJLKV_MAX_RESIDUAL_TOKENS, "config.sink_tokens is %u, must be <= %u", cfg.sink_tokens,
                QJLKV_MAX_RESIDUAL_TOKENS);
  QJLKV_REQUIRE(cfg.num_threads <= QJLKV_MAX_THREADS, "config.num_threads is %u, must be <= %u (0 = cores available)",
                cfg.num_threads, QJLKV_MAX_THREADS);
}

namespace {

BlockLayout make_layout(const qjlkv_config &cfg, const LayerSpec &layer) {
  BlockLayout l;
  const size_t B = cfg.block_tokens, d = cfg.head_dim;
  size_t at = 0;
  const auto take = [&at](size_t bytes) {
    const size_t offset = at;
    at += bytes;
    return offset;
  };
  switch (key_method_of(cfg)) {
    case QJLKV_KEYS_QJL:
      l.key_bytes_per_token_bits_in = layer.m / 8;
      l.key_bytes_per_token_bits_out = layer.m_out / 8;
      l.key_norm_in = take(2 * B);
      l.key_norm_out = take(layer.m_out ? 2 * B : 0);
      l.key_bits_in = take(B * l.key_bytes_per_token_bits_in);
      l.key_bits_out = take(B * l.key_bytes_per_token_bits_out);
      l.key_outlier_idx = take(layer.m_out ? cfg.outlier_channels : 0);
      break;
    case QJLKV_KEYS_KIVI:
    case QJLKV_KEYS_OTT:
      l.key_bytes_per_token_codes = d * cfg.key_bits / 8;
      l.key_scale = take(2 * d);
      l.key_min = take(2 * d);
      l.key_codes = take(B * l.key_bytes_per_token_codes);
      l.key_mask = take(cfg.key_method == QJLKV_KEYS_OTT ? B / 8 : 0);
      break;
    case QJLKV_KEYS_EXACT:
      l.key_bytes_per_token_codes = 2 * d;
      l.key_codes = take(B * l.key_bytes_per_token_codes);
      break;
  }
  l.key_bytes = at;
  at = (at + 7) & ~size_t(7);
  const size_t value_start = at;
  if (cfg.value_method == QJLKV_VALUES_ROTATED_LLOYD_MAX) {
    l.value_bytes_per_token_codes = d * cfg.value_bits / 8;
    l.value_scale = take(2 * B);
  } else if (cfg.value_bits == 16) {
    l.value_bytes_per_token_codes = 2 * d;
  } else {
    const size_t groups = d / cfg.value_group_size;
    l.value_bytes_per_token_codes = d * cfg.value_bits / 8;
    l.value_scale = take(2 * B * groups);
    l.value_min = take(2 * B * groups);
  }
  l.value_codes = take(B * l.value_bytes_per_token_codes);
  l.value_bytes = at - value_start;
  l.stride = (at + 7) & ~size_t(7);
  return l;
}

}  // namespace

namespace {
// Every QJL layer owns a sketch (and the CPU backend a transposed copy). A valid config can ask
// for terabytes of them (65536 layers of 65536 x 256): fail before generating any rather than
// spend hours and be killed by the kernel's out-of-memory handler.
void check_sketch_memory(const qjlkv_config &cfg) {
  const auto rows = [&](uint32_t m, uint32_t m_out) { return double(std::max(m, cfg.outlier_channels ? m_out : 0u)); };
  const double initial = cfg.initial_layers;
  const double sketch_rows = initial * rows(cfg.initial_key_sketch_dim, cfg.initial_outlier_sketch_dim) +
                             (cfg.num_layers - initial) * rows(cfg.key_sketch_dim, cfg.outlier_sketch_dim);
  const double bytes = 2.0 * sketch_rows * cfg.head_dim * sizeof(float);
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return;  // unknown: let the allocations decide
  const double physical = double(pages) * double(page_size);
  if (bytes > physical)
    fail(QJLKV_ERROR_OUT_OF_MEMORY,
         "the sketches of %u layers (key_sketch_dim %u, head_dim %u) need %.3g GiB, more than this machine's "
         "%.3g GiB of memory",
         cfg.num_layers, cfg.key_sketch_dim, cfg.head_dim, bytes / 1073741824.0, physical / 1073741824.0);
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
  // Validation ignores the fields of other key methods, so nothing downstream may read them.
  qjlkv_config cfg = spec.created_with;
  if (cfg.key_method != QJLKV_KEYS_QJL) {
    cfg.key_sketch_dim = cfg.outlier_channels = cfg.outlier_sketch_dim = 0;
    cfg.initial_layers = cfg.initial_key_sketch_dim = cfg.initial_outlier_sketch_dim = 0;
  }
  if (cfg.key_method != QJLKV_KEYS_KIVI && cfg.key_method != QJLKV_KEYS_OTT) cfg.key_bits = 0;
  if (cfg.key_method != QJLKV_KEYS_OTT) cfg.outlier_tokens = cfg.outlier_spill_tokens = cfg.outlier_skip_layers = 0;
  const bool rotated_values = cfg.value_method == QJLKV_VALUES_ROTATED_LLOYD_MAX;
  if (rotated_values) cfg.value_group_size = 0;
  spec.cfg = cfg;
  spec.group_size = cfg.num_q_heads / cfg.num_kv_heads;
  spec.io_elem = dtype_size(dtype_of(cfg));
  spec.stored_dtype = cfg.dtype == QJLKV_DTYPE_BF16 ? QJLKV_DTYPE_BF16 : QJLKV_DTYPE_F16;
  spec.tail_elem = spec.io_elem;
  const bool orthogonal = cfg.sketch_flags & QJLKV_SKETCH_ORTHOGONAL;
  spec.qjl_constant = float(qjl_constant(cfg.head_dim, orthogonal));
  const bool exact_keys_in_bf16 = cfg.key_method == QJLKV_KEYS_EXACT && spec.stored_dtype == QJLKV_DTYPE_BF16;
  spec.key_limit = exact_keys_in_bf16 ? std::numeric_limits<float>::max() : kHalfMax;
  spec.value_limit = cfg.value_bits == 16 && spec.stored_dtype == QJLKV_DTYPE_BF16 ? kSummableMax : kHalfMax;
  if (cfg.key_method == QJLKV_KEYS_QJL) check_sketch_memory(cfg);
  spec.layers.resize(cfg.num_layers);
  for (uint32_t l = 0; l < cfg.num_layers; ++l) {
    LayerSpec &layer = spec.layers[l];
    if (cfg.key_method == QJLKV_KEYS_QJL) {
      const bool initial = l < cfg.initial_layers;
      layer.m = initial ? cfg.initial_key_sketch_dim : cfg.key_sketch_dim;
      layer.m_out = cfg.outlier_channels ? (initial ? cfg.initial_outlier_sketch_dim : cfg.outlier_sketch_dim) : 0;
      layer.sketch_rows = std::max(layer.m, layer.m_out);
      layer.sketch = std::make_unique<qjlkv_sketch>(
          qjlkv_sketch{make_sketch(cfg.head_dim, layer.sketch_rows, cfg.seed, l, orthogonal)});
    }
    layer.traced = cfg.key_method == QJLKV_KEYS_OTT && l >= cfg.outlier_skip_layers && cfg.outlier_tokens > 0;
    layer.layout = make_layout(cfg, layer);
    if (rotated_values) layer.value_signs = value_rotation_signs(cfg.head_dim, cfg.seed, l);
  }
  return spec;
}

}  // namespace qjlkv
