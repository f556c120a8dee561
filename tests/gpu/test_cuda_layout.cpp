// Host checks of the CUDA backend's arithmetic that needs no GPU (cuda/layout.hpp): the
// per-element tricks of the kernels against the CPU backend's definitions, the shared memory
// carve-up of the attention kernel and the split plan.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "config.hpp"
#include "cpu/kernels.hpp"
#include "layout.hpp"
#include "methods/mixed/mixed_math.hpp"
#include "positions.hpp"

namespace {

using namespace qjlkv::cuda;

TEST(CudaLayout, SignFactorIsTheSignBitConvention) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    const uint32_t word = rng();
    uint8_t bytes[4];
    for (int b = 0; b < 4; ++b) bytes[b] = uint8_t(word >> (8 * b));  // LSB-first, as stored
    for (uint32_t i = 0; i < 32; ++i)
      EXPECT_EQ(sign_factor(word, i), qjlkv::sign_bit(bytes, i) ? 1.0f : -1.0f) << word << " row " << i;
  }
  // Σ v_i · sign_factor equals the reference signed dot product.
  std::vector<float> v(32);
  std::normal_distribution<float> normal;
  for (float &x : v) x = normal(rng);
  const uint32_t word = 0x9a3c51e7u;
  uint8_t bytes[4] = {0xe7, 0x51, 0x3c, 0x9a};
  float sum = 0.0f;
  for (uint32_t i = 0; i < 32; ++i) sum += v[i] * sign_factor(word, i);
  EXPECT_EQ(sum, qjlkv::signed_dot(v.data(), bytes, 32));
}

TEST(CudaLayout, CodeToFloatIsExact) {
  for (uint32_t code = 0; code < (1u << 16); ++code) ASSERT_EQ(code_to_float(code), float(code));
  EXPECT_EQ(code_to_float((1u << 23) - 1), float((1u << 23) - 1));
}

// The device's descending sort of outlier_sort_key picks the CPU backend's outlier channels,
// ties (equal energies, zeros) included.
TEST(CudaLayout, OutlierKeysSelectTheCpuChannels) {
  std::mt19937 rng(2);
  for (uint32_t d : {16u, 64u, 128u, 256u}) {
    for (int trial = 0; trial < 20; ++trial) {
      const uint32_t tokens = 8, c = 1 + rng() % 12;
      std::vector<float> keys(tokens * d);
      for (float &x : keys) x = float(int(rng() % 7) - 3);  // small integers: many equal energies
      if (trial % 3 == 0)
        for (uint32_t t = 0; t < tokens; ++t) keys[t * d + 5] = keys[t * d + 9] = 0.0f;
      std::vector<float> energy(d), scratch_energy(d);
      std::vector<uint32_t> order(d);
      std::vector<uint8_t> expected(c);
      qjlkv::cpu::select_outlier_channels(keys.data(), tokens, d, c, scratch_energy.data(), order.data(),
                                          expected.data());
      std::vector<uint64_t> sort_keys(256, 0);
      for (uint32_t j = 0; j < d; ++j) {
        float e = 0.0f;
        for (uint32_t t = 0; t < tokens; ++t) e += keys[t * d + j] * keys[t * d + j];
        sort_keys[j] = outlier_sort_key(e, j);
      }
      std::sort(sort_keys.begin(), sort_keys.end(), std::greater<uint64_t>());
      std::vector<uint8_t> got;
      for (uint32_t i = 0; i < c; ++i) got.push_back(uint8_t(outlier_sort_channel(sort_keys[i])));
      std::sort(got.begin(), got.end());
      EXPECT_EQ(got, expected) << "d " << d << " c " << c;
    }
  }
}

// The min/max rules keep the CPU backend's choice between +0 and -0, which the stored fp16
// minimum keeps.
TEST(CudaLayout, MinMaxRulesMatchTheCpuOnSignedZeros) {
  const std::vector<std::vector<float>> groups = {
      {0.0f, -0.0f}, {-0.0f, 0.0f}, {0.0f, -0.0f, 1.0f}, {-0.0f, 2.0f, 0.0f}, {1.0f, -0.0f, 0.0f, -0.0f}};
  for (const auto &g : groups) {
    float lo = g[0], hi = g[0];
    for (size_t i = 1; i < g.size(); ++i) group_minmax_step(g[i], lo, hi);
    const auto [lo_ref, hi_ref] = std::minmax_element(g.begin(), g.end());
    EXPECT_EQ(qjlkv::float_bits(lo), qjlkv::float_bits(*lo_ref));
    EXPECT_EQ(qjlkv::float_bits(hi), qjlkv::float_bits(*hi_ref));
    float klo = g[0], khi = g[0];
    for (size_t i = 1; i < g.size(); ++i) kivi_minmax_step(g[i], klo, khi);
    float rlo = g[0], rhi = g[0];
    for (size_t i = 1; i < g.size(); ++i) {
      rlo = std::min(rlo, g[i]);
      rhi = std::max(rhi, g[i]);
    }
    EXPECT_EQ(qjlkv::float_bits(klo), qjlkv::float_bits(rlo));
    EXPECT_EQ(qjlkv::float_bits(khi), qjlkv::float_bits(rhi));
  }
}

AttendShape shape(qjlkv_key_method kind, uint32_t rows, uint32_t d, uint32_t io_elem, uint32_t value_bits = 2,
                  uint32_t group = 32) {
  AttendShape s;
  s.key_method = kind;
  s.rows = rows;
  s.d = d;
  s.m = 2 * d;
  s.outlier_channels = 8;
  s.key_bits = 2;
  s.value_bits = value_bits;
  s.value_groups = d / group;
  s.io_elem = io_elem;
  return s;
}

// The regions of the attention kernel's shared memory are 16-aligned, in order, and as large as
// the kernel's tiles need.
TEST(CudaLayout, AttendSharedMemoryRegionsHoldTheirTiles) {
  for (qjlkv_key_method kind : {QJLKV_KEYS_QJL, QJLKV_KEYS_KIVI, QJLKV_KEYS_EXACT})
    for (uint32_t rows : {1u, 2u, 4u, 8u})
      for (uint32_t d : {8u, 64u, 96u, 128u, 256u})
        for (uint32_t io : {2u, 4u})
          for (uint32_t vb : {2u, 4u, 8u, 16u}) {
            const AttendShape s = shape(kind, rows, d, io, vb, d % 32 == 0 ? 32 : 8);
            const AttendSmem m = attend_smem(s);
            const uint32_t d32 = round_up(d, 32);
            for (uint32_t offset : {m.q, m.scores, m.red, m.state, m.stage_k, m.stage_v, m.final_buf})
              EXPECT_EQ(offset % 16, 0u);
            EXPECT_GE(m.scores - m.q, 4 * rows * d32);
            EXPECT_GE(m.stage_k, m.state + 4 * 3 * rows);
            // keys: the method's tile and the full-precision tail rows
            uint32_t key_tile = 4 * kTile * padded_row_words(d * io);
            if (kind == QJLKV_KEYS_QJL) {
              EXPECT_GE(m.k_norm_out - m.k_norm_in, 2 * kTile);
              EXPECT_GE(m.k_corrections - m.k_norm_out, 2 * kTile);
              EXPECT_GE(m.k_bits_in - m.k_corrections, 2 * kTile * s.outlier_channels);
              EXPECT_EQ(m.k_corrections % 4, 0u);  // staged in whole words
              key_tile = std::max(key_tile, m.k_bits_in + kTile * s.m / 8 + 4);
              EXPECT_GE(m.outlier - m.sq, 4 * rows * round_up(s.m, 32));
              EXPECT_GE(m.scores - m.outlier, 4 * s.outlier_channels);
            } else if (kind == QJLKV_KEYS_KIVI) {
              key_tile = std::max(key_tile, kTile * d * s.key_bits / 8 + 4);
              EXPECT_GE(m.koff - m.qdigits, 2 * rows * d32);  // {hi, lo} digit bytes per channel
              EXPECT_GE(m.scores - m.koff, 4 * 2 * rows);     // offset and step per row
            } else {
              key_tile = std::max(key_tile, 4 * kTile * padded_row_words(2 * d));
            }
            EXPECT_GE(m.stage_v - m.stage_k, key_tile);
            uint32_t value_tile = kTile * d * io;
            if (vb == 16) {
              value_tile = std::max(value_tile, kTile * 2 * d);
            } else {
              EXPECT_GE(m.v_min - m.v_scale, kTile * s.value_groups * 2);
              EXPECT_GE(m.v_codes - m.v_min, kTile * s.value_groups * 2);
              value_tile = std::max(value_tile, m.v_codes + kTile * d * vb / 8);
            }
            EXPECT_GE(m.total - m.stage_v, value_tile);
            const uint32_t lanes = kAttendThreads / (d / kSliceChannels);
            EXPECT_GE(m.total - m.final_buf, 4 * rows * std::max(lanes * d, d32));
          }
}

// The integer KIVI scores unpack a row's codes in groups (one 32-bit word, or 12 bytes of 3-bit
// codes) into words of four 8-bit codes, as the kernel does (keys.cuh, unpack_codes): byte i of
// unpacked word u of group g is the packed code of channel kivi_unpacked_channel(bits, g, u, i),
// and the channels of a row's groups are each listed once.
TEST(CudaLayout, KiviUnpackedCodesAreTheDeclaredChannels) {
  std::mt19937 rng(5);
  for (uint32_t bits : {2u, 3u, 4u, 8u}) {
    const uint32_t d = 128, per_group = kivi_group_codes(bits), words = per_group / 4;
    std::vector<uint8_t> row(d * bits / 8, 0);
    std::vector<uint32_t> codes(d);
    for (uint32_t j = 0; j < d; ++j) {
      codes[j] = rng() & ((1u << bits) - 1u);
      qjlkv::pack_code(row.data(), j, bits, codes[j]);
    }
    const auto word_at = [&](uint32_t byte) {
      return uint32_t(row[byte]) | uint32_t(row[byte + 1]) << 8 | uint32_t(row[byte + 2]) << 16 |
             uint32_t(row[byte + 3]) << 24;
    };
    std::vector<int> seen(d, 0);
    for (uint32_t g = 0; g < d / per_group; ++g) {
      std::vector<uint32_t> u(words);
      if (bits == 3) {
        const uint32_t w0 = word_at(12 * g), w1 = word_at(12 * g + 4), w2 = word_at(12 * g + 8);
        const uint32_t chunk[4] = {w0, w0 >> 24 | w1 << 8, w1 >> 16 | w2 << 16, w2 >> 8};
        for (uint32_t k = 0; k < 4; ++k) {
          u[2 * k] = spread3(chunk[k]);
          u[2 * k + 1] = spread3(chunk[k] >> 3);
        }
      } else {
        for (uint32_t k = 0; k < words; ++k)
          u[k] = bits == 8 ? word_at(4 * g) : word_at(4 * g) >> (k * bits) & (0x01010101u * ((1u << bits) - 1u));
      }
      for (uint32_t k = 0; k < words; ++k)
        for (uint32_t i = 0; i < 4; ++i) {
          const uint32_t channel = kivi_unpacked_channel(bits, g, k, i);
          ASSERT_LT(channel, d);
          EXPECT_EQ(u[k] >> (8 * i) & 0xffu, codes[channel]) << bits << " bits, group " << g << ", word " << k;
          ++seen[channel];
        }
    }
    for (uint32_t j = 0; j < d; ++j) EXPECT_EQ(seen[j], 1) << bits << " bits, channel " << j;
  }
}

// MIXED keys' regions: query digits, per-row offset and step, the field groups, staged rows of
// odd word strides with one word of slack (a group's window reads the word after its first), and
// the block setup's scratch in the stage's space.
TEST(CudaLayout, MixedKeysHaveTheirRegions) {
  for (uint32_t rows : {1u, 2u, 4u, 8u})
    for (uint32_t d : {8u, 40u, 64u, 72u, 128u, 256u})
      for (uint32_t token_bits : {8u, 8 * ((17 * d + 63) / 64), 4 * d})
        for (uint32_t io : {2u, 4u}) {
          AttendShape s = shape(QJLKV_KEYS_MIXED, rows, d, io, 2, 8);
          s.key_token_bits = token_bits;
          s.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
          s.value_groups = 1;
          const AttendSmem m = attend_smem(s);
          const uint32_t d32 = round_up(d, 32);
          for (uint32_t offset : {m.qdigits, m.koff, m.kgroups, m.stage_k, m.stage_v, m.final_buf})
            EXPECT_EQ(offset % 16, 0u);
          EXPECT_GE(m.koff - m.qdigits, 2 * rows * d32);
          EXPECT_GE(m.kgroups - m.koff, 4 * 2 * rows);
          EXPECT_GE(m.scores - m.kgroups, 4 * kMixedGroupWords * (d / 8));
          EXPECT_EQ(padded_row_words(token_bits / 8) % 2, 1u);
          EXPECT_GE(m.stage_v - m.stage_k, 4 * kTile * padded_row_words(token_bits / 8) + 4);
          EXPECT_GE(m.total - m.final_buf, 4 * mixed_setup_floats(rows, d));
        }
}

// A MIXED field group's spread words hold the codes mixed::get_field reads from a row (the bits
// around the fields random), for widths of 0 to 4 bits and any first bit.
TEST(CudaLayout, MixedGroupsSpreadTheStoredFields) {
  std::mt19937 rng(6);
  for (int trial = 0; trial < 4000; ++trial) {
    uint32_t widths[8], total = 0;
    for (uint32_t &w : widths) total += w = trial % 50 == 0 ? 4 : trial % 50 == 1 ? 0 : rng() % 5;
    const uint32_t first = rng() % 97;
    uint8_t row[24];
    for (uint8_t &b : row) b = uint8_t(rng());
    uint32_t codes[8], bit = first;
    for (uint32_t k = 0; k < 8; ++k) {
      codes[k] = rng() & ((1u << widths[k]) - 1u);
      for (uint32_t i = 0; i < widths[k]; ++i, ++bit) {
        row[bit / 8] = uint8_t(row[bit / 8] & ~(1u << (bit % 8)));
        row[bit / 8] = uint8_t(row[bit / 8] | ((codes[k] >> i) & 1u) << (bit % 8));
      }
    }
    ASSERT_EQ(bit, first + total);
    uint32_t desc[kMixedGroupWords];
    mixed_group(widths, first, desc);
    uint64_t pair = 0;  // the two words that hold bit `first`, as the kernel reads them
    for (uint32_t i = 0; i < 8; ++i) pair |= uint64_t(row[4 * (first / 32) + i]) << (8 * i);
    const uint32_t window = uint32_t(pair >> (first % 32));
    const uint32_t u[2] = {mixed_spread(window, desc[4], desc[5], desc[6], desc[2]),
                           mixed_spread(window >> desc[1], desc[7], desc[8], desc[9], desc[3])};
    for (uint32_t k = 0, at = first; k < 8; at += widths[k], ++k) {
      EXPECT_EQ(u[k / 4] >> (8 * (k % 4)) & 0xffu, codes[k]) << "trial " << trial << ", channel " << k;
      EXPECT_EQ(qjlkv::mixed::get_field(row, at, widths[k]), codes[k]);
    }
  }
}

// Rotated Lloyd-Max values stage one fp16 scale per token and the codes; the level table has its
// own region before the stage. 3-bit key codes keep 16 bytes of slack for their 12-byte groups.
TEST(CudaLayout, LloydMaxValuesAndThreeBitKeysHaveTheirRegions) {
  for (uint32_t rows : {1u, 2u, 4u, 8u})
    for (uint32_t d : {8u, 40u, 72u, 96u, 128u, 256u})
      for (uint32_t io : {2u, 4u})
        for (uint32_t vb : {2u, 3u, 4u}) {
          AttendShape s = shape(QJLKV_KEYS_KIVI, rows, d, io, vb, 8);
          s.key_bits = 3;
          s.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
          s.value_groups = 1;
          const AttendSmem m = attend_smem(s);
          EXPECT_EQ(m.levels % 16, 0u);
          EXPECT_GE(m.stage_k, m.levels + 4 * kMaxLevels);
          EXPECT_GE(m.levels, m.state + 4 * 3 * rows);
          EXPECT_GE(m.stage_v - m.stage_k, kTile * d * 3 / 8 + 16);
          EXPECT_GE(m.v_codes - m.v_scale, 2 * kTile);
          EXPECT_GE(m.total - m.stage_v, std::max(m.v_codes + kTile * d * vb / 8, kTile * d * io));
        }
}

// The presets' attention kernels fit an H100/H200 (227 KiB) with 8 rows, an A100 (163 KiB) too.
TEST(CudaLayout, PresetShapesFitTheDevices) {
  for (qjlkv_key_method kind : {QJLKV_KEYS_QJL, QJLKV_KEYS_KIVI, QJLKV_KEYS_EXACT})
    for (uint32_t d : {64u, 128u, 256u}) {
      const uint32_t total = attend_smem(shape(kind, 8, d, 4, kind == QJLKV_KEYS_EXACT ? 16 : 2)).total;
      EXPECT_LE(total, 166912u) << "d " << d;
    }
  for (uint32_t d : {64u, 128u, 256u})  // q3 / q4: 3- or 4-bit keys, 2- or 3-bit rotated values
    for (uint32_t key_bits : {3u, 4u}) {
      AttendShape s = shape(QJLKV_KEYS_KIVI, 8, d, 4, key_bits - 1);
      s.key_bits = key_bits;
      s.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
      s.value_groups = 1;
      EXPECT_LE(attend_smem(s).total, 166912u) << "d " << d << ", key_bits " << key_bits;
    }
  for (uint32_t d : {64u, 128u, 256u})  // q2: mixed-bit keys, 2-bit rotated values
    for (uint32_t token_bits : {8 * ((17 * d + 63) / 64), 4 * d}) {
      AttendShape s = shape(QJLKV_KEYS_MIXED, 8, d, 4, 2);
      s.key_token_bits = token_bits;
      s.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
      s.value_groups = 1;
      EXPECT_LE(attend_smem(s).total, 166912u) << "d " << d << ", key_token_bits " << token_bits;
    }
}

// A rollback copy on the device holds at least the bytes the statistics count for it (positions.hpp),
// its regions in order and 16-byte aligned, every saved pool inside its own OttLayout.
TEST(CudaLayout, RollbackCopiesHoldWhatTheStatisticsCount) {
  for (const char *preset : {"q2", "q3", "ott", "qjl"})
    for (qjlkv_dtype dtype : {QJLKV_DTYPE_F32, QJLKV_DTYPE_F16})
      for (uint32_t d : {40u, 128u}) {
        qjlkv_config cfg{};
        cfg.struct_size = sizeof cfg;
        ASSERT_EQ(qjlkv_config_init(&cfg, preset, 3, 8, 2, d), QJLKV_OK);
        cfg.dtype = dtype;
        const qjlkv::CacheSpec spec = qjlkv::make_cache_spec(cfg);
        const uint32_t io = uint32_t(spec.io_elem), P = spec.cfg.outlier_tokens;
        for (uint32_t layer = 0; layer < 3; ++layer) {
          const bool traced = spec.layers[layer].traced;
          const OttLayout saved = ott_layout(P, 0, d, io);
          const CopyLayout c = copy_layout(spec.cfg.block_tokens, 2, d, io, traced ? saved.bytes : 0);
          EXPECT_GE(c.bytes, qjlkv::rollback_copy_bytes(spec, layer)) << preset << ", layer " << layer;
          EXPECT_EQ(c.values, spec.cfg.block_tokens * 2 * d * io);
          EXPECT_GE(c.pools, 2 * c.values);
          EXPECT_EQ(c.pools % 16, 0u);
          if (!traced) continue;
          EXPECT_LE(saved.values + P * d * io, saved.bytes);
          EXPECT_EQ(saved.bytes % 16, 0u);
        }
      }
}

TEST(CudaLayout, SplitPlanCoversEveryUnitOnce) {
  for (uint32_t units : {1u, 2u, 7u, 100u, 4096u, 70000u})
    for (uint64_t base : {1ull, 8ull, 256ull, 5000ull}) {
      const SplitPlan p = plan_splits(units, base, 1056);
      EXPECT_GE(uint64_t(p.splits) * p.units_per_split, units);
      EXPECT_LT(uint64_t(p.splits - 1) * p.units_per_split, units);  // no empty split at the end
      EXPECT_LE(p.splits, units);
      if (base >= 1056) {
        EXPECT_EQ(p.splits, 1u);
      }
      if (base * units <= 1056) {
        EXPECT_EQ(p.units_per_split, 1u);
      }
    }
  const SplitPlan empty = plan_splits(0, 8, 1056);
  EXPECT_EQ(empty.splits, 1u);
}

TEST(CudaLayout, RowsAndUnits) {
  EXPECT_EQ(pick_rows(1, 8), 1u);
  EXPECT_EQ(pick_rows(4, 8), 4u);
  EXPECT_EQ(pick_rows(7, 8), 8u);
  EXPECT_EQ(pick_rows(3, 8), 4u);
  EXPECT_EQ(pick_rows(40, 8), 8u);
  EXPECT_EQ(pick_rows(40, 2), 2u);
  EXPECT_EQ(pick_rows(40, 1), 1u);
  EXPECT_EQ(attend_units(0, 0, 32), 0u);
  EXPECT_EQ(attend_units(10, 0, 32), 1u);
  EXPECT_EQ(attend_units(64, 1, 32), 2u);
  EXPECT_EQ(attend_units(100, 2, 32), 4u);  // 36 tail tokens: two pieces
}

}  // namespace
