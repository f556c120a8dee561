#include "qjl_keys.hpp"

#include "../../sketch.hpp"

#include <algorithm>
#include <cstring>

#include <unistd.h>

namespace qjlkv {
namespace {

void check_sketch_dim(const char *field, uint32_t value, bool allow_zero) {
  QJLKV_REQUIRE(value % 8 == 0 && value <= QJLKV_MAX_SKETCH_DIM && (allow_zero || value > 0),
                "%s is %u, must be a multiple of 8 in [%u, %u]", field, value, allow_zero ? 0u : 8u,
                QJLKV_MAX_SKETCH_DIM);
}

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

void QjlKeys::validate(const qjlkv_config &cfg) {
  check_sketch_dim("config.key_sketch_dim", cfg.key_sketch_dim, false);
  QJLKV_REQUIRE(cfg.outlier_channels < cfg.head_dim, "config.outlier_channels is %u, must be below head_dim (%u)",
                cfg.outlier_channels, cfg.head_dim);
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
                  "config.initial_outlier_sketch_dim is 0 but config.outlier_channels is %u", cfg.outlier_channels);
  }
}

void QjlKeys::init_layers(const qjlkv_config &cfg, std::vector<LayerSpec> &layers) {
  check_sketch_memory(cfg);
  const bool orthogonal = cfg.sketch_flags & QJLKV_SKETCH_ORTHOGONAL;
  for (uint32_t l = 0; l < cfg.num_layers; ++l) {
    LayerSpec &layer = layers[l];
    const bool initial = l < cfg.initial_layers;
    layer.m = initial ? cfg.initial_key_sketch_dim : cfg.key_sketch_dim;
    layer.m_out = cfg.outlier_channels ? (initial ? cfg.initial_outlier_sketch_dim : cfg.outlier_sketch_dim) : 0;
    layer.sketch_rows = std::max(layer.m, layer.m_out);
    layer.sketch = std::make_unique<qjlkv_sketch>(
        qjlkv_sketch{make_sketch(cfg.head_dim, layer.sketch_rows, cfg.seed, l, orthogonal)});
  }
}

// The dense k̂ of token t: the inlier estimate c_d/m·n_in·Sᵀ(±bits_in), moved on the outlier
// channels by the corrections, so that its dot product with any query equals the block's estimate.
void QjlKeys::dequantize_token(const CacheSpec &spec, const LayerSpec &layer, const uint8_t *block, uint32_t t,
                               float *out) {
  const qjlkv_config &cfg = spec.cfg;
  const uint32_t d = cfg.head_dim, B = cfg.block_tokens, c = layer.m_out ? cfg.outlier_channels : 0;
  const BlockLayout &l = layer.layout;
  const float *S = layer.sketch->matrix.data.data();
  const uint8_t *outlier_idx = block + l.key_outlier_idx;
  const uint8_t *bits_in = block + l.key_bits_in + t * l.key_bytes_per_token_bits_in;
  const float n_in = half_to_float(at<uint16_t>(block, l.key_norm_in)[t]);
  const float in_factor = spec.qjl_constant / float(layer.m) * n_in;
  std::fill(out, out + d, 0.0f);
  for (uint32_t i = 0; i < layer.m; ++i) {
    const float sign = sign_bit(bits_in, i) ? in_factor : -in_factor;
    for (uint32_t j = 0; j < d; ++j) out[j] += sign * S[size_t(i) * d + j];
  }
  if (!c) return;
  // Outlier channels: the correction moves the inlier estimate to the outlier sketch's.
  const float scale = n_in + half_to_float(at<uint16_t>(block, l.key_norm_out)[t]);
  const uint16_t *corrections = at<uint16_t>(block, l.key_corrections);
  for (uint32_t j = 0; j < c; ++j) out[outlier_idx[j]] += half_to_float(corrections[size_t(j) * B + t]) * scale;
}

void QjlKeys::store_corrections(const LayerSpec &layer, const qjlkv_config &cfg, float qjl_constant, uint8_t *block,
                                uint32_t t, const uint8_t *bits_out) {
  const uint32_t d = cfg.head_dim, B = cfg.block_tokens;
  const BlockLayout &l = layer.layout;
  const float *S = layer.sketch->matrix.data.data();
  const uint8_t *outlier_idx = block + l.key_outlier_idx;
  const uint8_t *bits_in = block + l.key_bits_in + t * l.key_bytes_per_token_bits_in;
  const float n_in = half_to_float(at<uint16_t>(block, l.key_norm_in)[t]);
  const float n_out = half_to_float(at<uint16_t>(block, l.key_norm_out)[t]);
  uint16_t *corrections = at<uint16_t>(block, l.key_corrections);
  for (uint32_t j = 0; j < cfg.outlier_channels; ++j) {
    const uint32_t o = outlier_idx[j];
    corrections[size_t(j) * B + t] =
        qjl_correction(qjl_constant, n_in, n_out, column_signed_sum(S, d, o, bits_in, layer.m),
                       column_signed_sum(S, d, o, bits_out, layer.m_out), layer.m, layer.m_out);
  }
}

}  // namespace qjlkv
