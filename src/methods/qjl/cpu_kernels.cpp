// QJL keys' quantizer on the CPU: the sign bits by the fast kernels, the outlier corrections by
// nibble tables, the same bytes as qjl_quantize_block (kernels.hpp).
#include "cpu_kernels.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../../cpu/kernels.hpp"

namespace qjlkv::cpu {
namespace {

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

void MethodKernels<QjlKeys>::prepare(const CacheSpec &spec, const LayerSpec &layer, const KernelTable &,
                                     LayerKernels &args) {
  args.qjl = make_qjl_args(spec, layer, args.qjl_tables);
}

void MethodKernels<QjlKeys>::quantize(const CpuLayer &c, const float *keys, uint8_t *block, float *scratch) {
  const qjlkv_config &cfg = c.spec.cfg;
  const LayerSpec &ls = c.layer;
  const LayerKernels &lk = c.args;
  const BlockLayout &l = ls.layout;
  const uint32_t B = cfg.block_tokens, d = cfg.head_dim, ch = ls.m_out ? cfg.outlier_channels : 0;
  float *inlier_keys = scratch;                            // [B][d]: outlier channels zeroed
  float *outlier_keys = inlier_keys + size_t(B) * d;       // [B][c]
  float *energy = outlier_keys + size_t(B) * ch;           // [d]
  auto *order = reinterpret_cast<uint32_t *>(energy + d);  // [d]
  uint8_t *outlier_idx = block + l.key_outlier_idx;
  if (ch) select_outlier_channels(keys, B, d, ch, energy, order, outlier_idx);
  for (uint32_t t = 0; t < B; ++t)
    qjl_split_key(l, keys + size_t(t) * d, d, outlier_idx, ch, t, inlier_keys + size_t(t) * d,
                       outlier_keys + size_t(t) * ch, block);
  // The projections S·k_in and S_out·k_out as blocked products with the reference's sums.
  const float *columns[256];
  for (uint32_t j = 0; j < d; ++j) columns[j] = lk.qjl.sketch_t + j * lk.qjl.sketch_t_stride;
  c.kernels.qjl.sign_bits(inlier_keys, d, B, columns, d, ls.m, block + l.key_bits_in, l.key_bytes_per_token_bits_in);
  if (!ch) return;
  for (uint32_t i = 0; i < ch; ++i) columns[i] = lk.qjl.sketch_t + outlier_idx[i] * lk.qjl.sketch_t_stride;
  auto *bits_out = reinterpret_cast<uint8_t *>(order + d);  // [B][m_out/8]
  const size_t bytes_out = ls.m_out / 8;
  std::memset(bits_out, 0, B * bytes_out);  // kernels narrower than 8 lanes set bits one at a time
  c.kernels.qjl.sign_bits(outlier_keys, ch, B, columns, ch, ls.m_out, bits_out, bytes_out);
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

}  // namespace qjlkv::cpu
