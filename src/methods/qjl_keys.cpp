#include "qjl_keys.hpp"

#include "../cpu/method_kernels.hpp"

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

// The corrections' column sums (column_signed_sum, exact in int64, so any order gives its bits)
// by nibble tables, four outlier channels at a time: entry v of table p holds, per channel, the
// sum of sketch_fixed over the rows 4p + k for the bits k of v (rows 4p..4p+3 are bits 0-3 of
// sign byte p/2 for even p, bits 4-7 for odd p). A token's sums over m rows are then m/4
// lookups of four int64 each, where the reference adds m terms per channel one after another.
constexpr uint32_t kTableChannels = 4;
struct ChannelSums {
  int64_t v[kTableChannels];
};

// columns[j]: sketch_t rows of the group's channels; nullptr for a padding channel (zeros).
void build_nibble_tables(const float *const columns[kTableChannels], uint32_t rows, ChannelSums *tables) {
  for (uint32_t p = 0; p < rows / 4; ++p) {
    int64_t entry[4][kTableChannels];
    for (uint32_t k = 0; k < 4; ++k)
      for (uint32_t j = 0; j < kTableChannels; ++j) entry[k][j] = columns[j] ? sketch_fixed(columns[j][4 * p + k]) : 0;
    ChannelSums *table = tables + 16 * p;
    table[0] = {};
    for (uint32_t v = 1; v < 16; ++v) {
      const uint32_t low = uint32_t(__builtin_ctz(v));
      for (uint32_t j = 0; j < kTableChannels; ++j) table[v].v[j] = table[v & (v - 1)].v[j] + entry[low][j];
    }
  }
}

// Per channel, Σ sketch_fixed over the rows i < rows whose bit is set (rows a multiple of 8).
ChannelSums nibble_sums(const ChannelSums *tables, const uint8_t *bits, uint32_t rows) {
  ChannelSums sum{};
  for (uint32_t b = 0; b < rows / 8; ++b) {
    const ChannelSums &low = tables[32 * b + (bits[b] & 15u)], &high = tables[32 * b + 16 + (bits[b] >> 4)];
    for (uint32_t j = 0; j < kTableChannels; ++j) sum.v[j] += low.v[j] + high.v[j];
  }
  return sum;
}

// Per channel, Σ sketch_fixed over every row i < rows: each table's all-ones entry.
ChannelSums column_totals(const ChannelSums *tables, uint32_t rows) {
  ChannelSums sum{};
  for (uint32_t p = 0; p < rows / 4; ++p)
    for (uint32_t j = 0; j < kTableChannels; ++j) sum.v[j] += tables[16 * p + 15].v[j];
  return sum;
}

template <class T> T *align_up(void *p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<T *>((address + alignof(T) - 1) / alignof(T) * alignof(T));
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

void cpu::MethodKernels<QjlKeys>::prepare(const CacheSpec &spec, const LayerSpec &layer, const cpu::KernelTable &,
                                          cpu::LayerKernels &args) {
  args.qjl = cpu::make_qjl_args(spec, layer, args.qjl_tables);
}

void cpu::MethodKernels<QjlKeys>::quantize(const cpu::CpuLayer &c, const float *keys, uint8_t *block,
                                           float *scratch) {
  const qjlkv_config &cfg = c.spec.cfg;
  const LayerSpec &ls = c.layer;
  const cpu::LayerKernels &lk = c.args;
  const BlockLayout &l = ls.layout;
  const uint32_t B = cfg.block_tokens, d = cfg.head_dim, ch = ls.m_out ? cfg.outlier_channels : 0;
  float *inlier_keys = scratch;                            // [B][d]: outlier channels zeroed
  float *outlier_keys = inlier_keys + size_t(B) * d;       // [B][c]
  float *energy = outlier_keys + size_t(B) * ch;           // [d]
  auto *order = reinterpret_cast<uint32_t *>(energy + d);  // [d]
  uint8_t *outlier_idx = block + l.key_outlier_idx;
  if (ch) cpu::select_outlier_channels(keys, B, d, ch, energy, order, outlier_idx);
  for (uint32_t t = 0; t < B; ++t)
    cpu::qjl_split_key(l, keys + size_t(t) * d, d, outlier_idx, ch, t, inlier_keys + size_t(t) * d,
                       outlier_keys + size_t(t) * ch, block);
  // The projections S·k_in and S_out·k_out as blocked products with the reference's sums.
  const float *columns[256];
  for (uint32_t j = 0; j < d; ++j) columns[j] = lk.qjl.sketch_t + j * lk.qjl.sketch_t_stride;
  c.kernels.qjl_sign_bits(inlier_keys, d, B, columns, d, ls.m, block + l.key_bits_in, l.key_bytes_per_token_bits_in);
  if (!ch) return;
  for (uint32_t i = 0; i < ch; ++i) columns[i] = lk.qjl.sketch_t + outlier_idx[i] * lk.qjl.sketch_t_stride;
  auto *bits_out = reinterpret_cast<uint8_t *>(order + d);  // [B][m_out/8]
  const size_t bytes_out = ls.m_out / 8;
  std::memset(bits_out, 0, B * bytes_out);  // kernels narrower than 8 lanes set bits one at a time
  c.kernels.qjl_sign_bits(outlier_keys, ch, B, columns, ch, ls.m_out, bits_out, bytes_out);
  // The corrections, four channels at a time from nibble tables (build_nibble_tables).
  auto *tables = align_up<ChannelSums>(bits_out + B * bytes_out);  // [sketch_rows/4][16]
  const uint16_t *norm_in = reinterpret_cast<const uint16_t *>(block + l.key_norm_in);
  const uint16_t *norm_out = reinterpret_cast<const uint16_t *>(block + l.key_norm_out);
  auto *corrections = reinterpret_cast<uint16_t *>(block + l.key_corrections);
  for (uint32_t j0 = 0; j0 < ch; j0 += kTableChannels) {
    const uint32_t group = std::min(kTableChannels, ch - j0);
    const float *group_columns[kTableChannels] = {};
    for (uint32_t j = 0; j < group; ++j) group_columns[j] = columns[j0 + j];
    build_nibble_tables(group_columns, ls.sketch_rows, tables);
    const ChannelSums all_in = column_totals(tables, ls.m), all_out = column_totals(tables, ls.m_out);
    for (uint32_t t = 0; t < B; ++t) {
      const ChannelSums in = nibble_sums(tables, block + l.key_bits_in + t * l.key_bytes_per_token_bits_in, ls.m);
      const ChannelSums out = nibble_sums(tables, bits_out + t * bytes_out, ls.m_out);
      for (uint32_t j = 0; j < group; ++j)  // ⟨S_o, ±b⟩ = 2·Σ_{b_i = 1} S_io − Σ_i S_io
        corrections[size_t(j0 + j) * B + t] =
            qjl_correction(c.spec.qjl_constant, half_to_float(norm_in[t]), half_to_float(norm_out[t]),
                           2 * in.v[j] - all_in.v[j], 2 * out.v[j] - all_out.v[j], ls.m, ls.m_out);
    }
  }
}

}  // namespace qjlkv
