// The CUDA backend against the CPU backend on the same inputs: stored bytes (through their
// reconstructions, which decode the bytes with the same CPU code on both backends), scores and
// attention outputs, for every key method (QJL, KIVI, OTT, exact, mixed; 2/3/4/8-bit codes), every
// value method (uniform 2/3/4/8-bit, 16-bit, rotated Lloyd-Max 2/3/4-bit), attention sinks, the
// tiers q2, q3 and q4, every dtype, head dims 64/128/256 and GQA ratios 1/4/7; batching, causal multi-query
// attention, sequence reuse, data validation, streams, long contexts, large batches, and export /
// import between the backends.
//
// Built twice (see gpu_test_util.hpp): on a GPU (skipping with the CUDA error without one) and on
// the CPU emulator, where the large cases shrink to what a CPU can emulate in seconds.
#include <ostream>
#include <tuple>

#include "gpu_test_util.hpp"

namespace {

using namespace gputest;

#if defined(QJLKV_CUDA_EMULATION)
constexpr bool kEmulated = true;
#else
constexpr bool kEmulated = false;
#endif

struct Case {
  const char *preset;
  qjlkv_dtype dtype;
  uint32_t head_dim, group;
};

void PrintTo(const Case &c, std::ostream *os) {
  *os << c.preset << ", " << dtype_name(c.dtype) << ", head_dim " << c.head_dim << ", group " << c.group;
}

std::string case_name(const testing::TestParamInfo<Case> &info) {
  return std::string(info.param.preset) + "_" + dtype_name(info.param.dtype) + "_d" +
         std::to_string(info.param.head_dim) + "_g" + std::to_string(info.param.group);
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const char *preset : {"q2", "q3", "q4", "qjl", "kivi", "ott", "exact"})
    for (qjlkv_dtype dtype : {QJLKV_DTYPE_F32, QJLKV_DTYPE_F16, QJLKV_DTYPE_BF16})
      for (uint32_t d : {64u, 128u, 256u})
        for (uint32_t g : {1u, 4u, 7u}) {
          // The emulator covers every preset, dtype, head dim and ratio, not every combination.
          if (kEmulated && !((d == 64 && g == 4) || (dtype == QJLKV_DTYPE_BF16 && g == 7) ||
                             (dtype == QJLKV_DTYPE_F16 && d == 128 && g == 1) ||
                             (dtype == QJLKV_DTYPE_F32 && d == 256 && g == 1)))
            continue;
          cases.push_back({preset, dtype, d, g});
        }
  return cases;
}

qjlkv_config make_config(const Case &c, uint32_t kv_heads = 2, uint32_t layers = 2) {
  qjlkv_config cfg{};
  cfg.struct_size = sizeof cfg;
  EXPECT_EQ(qjlkv_config_init(&cfg, c.preset, layers, kv_heads * c.group, kv_heads, c.head_dim), QJLKV_OK);
  cfg.dtype = c.dtype;
  cfg.seed = 1234;
  const std::string preset = c.preset;
  if (preset == "kivi" || preset == "ott" || preset == "q2" || preset == "q3" || preset == "q4")
    cfg.block_tokens = 32;  // more blocks
  if (std::string(c.preset) == "ott") cfg.outlier_skip_layers = std::min(1u, layers - 1);  // layer 1 traced
  if (std::string(c.preset) == "exact") cfg.residual_tokens = 16;
  return cfg;
}

// Compares everything observable about (layer, seq) on the two backends.
void expect_same_sequence(CachePair &pair, uint32_t layer, uint32_t seq, std::mt19937 &rng, const char *when) {
  SCOPED_TRACE(std::string(when) + ", seq " + std::to_string(seq));
  const qjlkv_config &cfg = pair.cfg();
  uint64_t length_cpu = 0, length_gpu = 0;
  ASSERT_EQ(qjlkv_cache_length(pair.cpu(), layer, seq, &length_cpu), QJLKV_OK);
  ASSERT_EQ(qjlkv_cache_length(pair.gpu(), layer, seq, &length_gpu), QJLKV_OK);
  ASSERT_EQ(length_cpu, length_gpu);

  // Stored bytes: values and KIVI/exact keys decode identically; QJL keys too, but for the rare
  // projection within float rounding of zero (each counted vector holds at least one such bit).
  const auto r = pair.reconstruct(layer, seq);
  EXPECT_EQ(count_bit_differences(r[3], r[2]), 0u) << "value reconstructions differ";
  const size_t key_diffs = count_bit_differences(r[1], r[0]);
  if (cfg.key_method == QJLKV_KEYS_QJL) {
    const size_t vectors = size_t(length_cpu) * cfg.num_kv_heads;
    size_t differing_vectors = 0;
    for (size_t v = 0; v < vectors; ++v)
      differing_vectors +=
          std::memcmp(&r[1][v * cfg.head_dim], &r[0][v * cfg.head_dim], cfg.head_dim * sizeof(float)) != 0;
    const double bits = double(vectors) * (cfg.key_sketch_dim + cfg.outlier_sketch_dim);
    EXPECT_LE(double(differing_vectors), 1e-4 * bits)
        << differing_vectors << " of " << vectors << " QJL key vectors differ";
    if (differing_vectors) std::printf("note: %zu of %zu QJL key vectors differ\n", differing_vectors, vectors);
  } else {
    EXPECT_EQ(key_diffs, 0u) << "key reconstructions differ";
  }

  // Raw scores of one query.
  const auto query = make_values(rng, pair.query_elems());
  const auto [s_cpu, s_gpu] = pair.scores(layer, seq, query);
  const Mismatch ms = compare_close(s_gpu, s_cpu, 1e-3);
  EXPECT_EQ(ms.count, 0u) << "scores: first mismatch at " << ms.first << ": gpu " << s_gpu[ms.first] << ", cpu "
                          << s_cpu[ms.first] << " (worst relative error " << ms.worst << ")";

  // Decode attention, one query and (causal) several.
  for (uint32_t n_queries : {1u, 5u}) {
    if (n_queries > length_cpu) continue;
    const auto queries = make_values(rng, n_queries * pair.query_elems());
    const auto [o_cpu, o_gpu] = pair.attend(layer, {seq}, n_queries, queries, 0.0f, false);
    const Mismatch mo = compare_outputs(o_gpu, o_cpu, qjlkv_dtype(cfg.dtype));
    EXPECT_EQ(mo.count, 0u) << "attend (" << n_queries << " queries): first mismatch at " << mo.first << ": gpu "
                            << o_gpu[mo.first] << ", cpu " << o_cpu[mo.first] << " (worst " << mo.worst << ", rms "
                            << mo.rms_relative << ")";
  }
}

class CudaVsCpu : public testing::TestWithParam<Case> {};

TEST_P(CudaVsCpu, SameBytesScoresAndOutputs) {
  REQUIRE_CUDA_DEVICE();
  const Case c = GetParam();
  CachePair pair(make_config(c));
  ASSERT_TRUE(pair.ok()) << pair.error();
  const qjlkv_config &cfg = pair.cfg();
  std::mt19937 rng(c.head_dim * 31 + c.group);
  const size_t te = pair.token_elems();

  // seq 7: a prefill in one call, then decode steps (blocks built from the tail ring and the input).
  const uint32_t prefill = 150;
  pair.append(1, 7, make_keys(rng, prefill, cfg.num_kv_heads, cfg.head_dim), make_values(rng, prefill * te));
  expect_same_sequence(pair, 1, 7, rng, "after the prefill");
  for (int step = 0; step < 45; ++step)
    pair.append(1, 7, make_keys(rng, 1, cfg.num_kv_heads, cfg.head_dim), make_values(rng, te));
  expect_same_sequence(pair, 1, 7, rng, "after 45 decode steps");

  // seq 3: appends of 37 tokens, in layer 0 (another sketch for QJL).
  for (int chunk = 0; chunk < 4; ++chunk)
    pair.append(0, 3, make_keys(rng, 37, cfg.num_kv_heads, cfg.head_dim), make_values(rng, 37 * te));
  expect_same_sequence(pair, 0, 3, rng, "after chunked appends");

  // A sequence cleared and refilled reuses the freed memory.
  ASSERT_EQ(qjlkv_cache_clear_sequence(pair.cpu(), 7), QJLKV_OK);
  ASSERT_EQ(qjlkv_cache_clear_sequence(pair.gpu(), 7), QJLKV_OK);
  pair.append(1, 7, make_keys(rng, 70, cfg.num_kv_heads, cfg.head_dim), make_values(rng, 70 * te));
  expect_same_sequence(pair, 1, 7, rng, "after clear and refill");

  // The statistics count the same stored bytes.
  qjlkv_stats a{}, b{};
  a.struct_size = b.struct_size = sizeof(qjlkv_stats);
  ASSERT_EQ(qjlkv_cache_stats(pair.cpu(), &a), QJLKV_OK);
  ASSERT_EQ(qjlkv_cache_stats(pair.gpu(), &b), QJLKV_OK);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.bytes_keys_quantized, b.bytes_keys_quantized);
  EXPECT_EQ(a.bytes_values_quantized, b.bytes_values_quantized);
  EXPECT_EQ(a.bytes_full_precision, b.bytes_full_precision);
  EXPECT_GE(b.bytes_reserved, b.bytes_used);
}

INSTANTIATE_TEST_SUITE_P(AllMethods, CudaVsCpu, testing::ValuesIn(all_cases()), case_name);

// Configurations off the presets' paths: sketch sizes that are not multiples of 32 (bit rows
// not 4-byte aligned), no outlier channels, more (outlier channel, token) pairs per chunk than
// the QJL quantizer has threads, initial layers, head dims that are not multiples of
// 32, value groups that straddle the kernels' 8-channel slices, 4- and 8-bit codes, 16-bit values
// under quantized keys, blocks that are not multiples of the 32-position tile, and GQA groups
// larger than the 8 rows of one CTA.
struct Corner {
  const char *name, *preset;
  qjlkv_dtype dtype;
  uint32_t q_heads, kv_heads, head_dim;
  void (*adjust)(qjlkv_config &);
};

void PrintTo(const Corner &c, std::ostream *os) { *os << c.name; }

const Corner kCorners[] = {
    {"qjl_m40_mout24_c3", "qjl", QJLKV_DTYPE_F32, 8, 2, 64,
     [](qjlkv_config &c) {
       c.key_sketch_dim = 40;
       c.outlier_sketch_dim = 24;
       c.outlier_channels = 3;
     }},
    {"qjl_m8_no_outliers", "qjl", QJLKV_DTYPE_F16, 4, 1, 64,
     [](qjlkv_config &c) {
       c.key_sketch_dim = 8;
       c.outlier_channels = 0;
       c.outlier_sketch_dim = 0;
     }},
    {"qjl_c40_mout64", "qjl", QJLKV_DTYPE_F32, 4, 1, 64,
     [](qjlkv_config &c) {
       c.outlier_channels = 40;
       c.outlier_sketch_dim = 64;
     }},
    {"qjl_initial_layers_m520", "qjl", QJLKV_DTYPE_BF16, 4, 2, 128,
     [](qjlkv_config &c) {
       c.initial_layers = 1;
       c.initial_key_sketch_dim = 520;
       c.initial_outlier_sketch_dim = 136;
       c.outlier_channels = 20;
     }},
    {"qjl_d24_g3_vbits8", "qjl", QJLKV_DTYPE_F32, 6, 2, 24,
     [](qjlkv_config &c) {
       c.value_bits = 8;
       c.value_group_size = 3;
     }},
    {"qjl_d8", "qjl", QJLKV_DTYPE_F16, 2, 1, 8, [](qjlkv_config &) {}},
    {"kivi_kbits4_vbits4_d96_g12", "kivi", QJLKV_DTYPE_F16, 4, 2, 96,
     [](qjlkv_config &c) {
       c.key_bits = 4;
       c.value_bits = 4;
       c.value_group_size = 12;
       c.block_tokens = 40;
     }},
    {"kivi_kbits8_vbits16_d72", "kivi", QJLKV_DTYPE_BF16, 2, 2, 72,
     [](qjlkv_config &c) {
       c.key_bits = 8;
       c.value_bits = 16;
       c.block_tokens = 24;
       c.residual_tokens = 5;
     }},
    {"kivi_d40_group1_b8", "kivi", QJLKV_DTYPE_F32, 2, 1, 40,
     [](qjlkv_config &c) {
       c.value_group_size = 1;
       c.block_tokens = 8;
       c.residual_tokens = 0;
     }},
    {"exact_mqa_16_heads", "exact", QJLKV_DTYPE_F16, 16, 1, 64, [](qjlkv_config &) {}},
    {"exact_keys_2bit_values_b48", "exact", QJLKV_DTYPE_F32, 12, 4, 128,
     [](qjlkv_config &c) {
       c.value_bits = 2;
       c.value_group_size = 64;
       c.block_tokens = 48;
     }},
    {"qjl_group_12_d256", "qjl", QJLKV_DTYPE_BF16, 12, 1, 256, [](qjlkv_config &) {}},
    {"qjl_b256_r100", "qjl", QJLKV_DTYPE_F16, 8, 2, 128,
     [](qjlkv_config &c) {
       c.block_tokens = 256;
       c.residual_tokens = 100;
     }},
    {"kivi_preset_b128", "kivi", QJLKV_DTYPE_BF16, 8, 2, 128, [](qjlkv_config &) {}},
    {"ott_preset_b128_all_layers_traced", "ott", QJLKV_DTYPE_F16, 8, 2, 128,
     [](qjlkv_config &c) { c.outlier_skip_layers = 0; }},
    {"ott_spill_overflows_p6_s4", "ott", QJLKV_DTYPE_F32, 4, 2, 64,
     [](qjlkv_config &c) {
       c.block_tokens = 16;
       c.outlier_tokens = 6;
       c.outlier_spill_tokens = 4;
       c.outlier_skip_layers = 0;
     }},
    {"ott_no_spill_p1_kbits4", "ott", QJLKV_DTYPE_BF16, 6, 3, 96,
     [](qjlkv_config &c) {
       c.block_tokens = 24;
       c.outlier_tokens = 1;
       c.outlier_spill_tokens = 0;
       c.key_bits = 4;
       c.outlier_skip_layers = 1;
     }},
    // 3-bit codes (8 codes in 3 bytes), rotated Lloyd-Max values, attention sinks.
    // The tiers with their 128-token blocks (a residual of 8 so that 161 tokens fill a block).
    {"q3_preset_b128_r8", "q3", QJLKV_DTYPE_BF16, 8, 2, 128, [](qjlkv_config &c) { c.residual_tokens = 8; }},
    {"q4_preset_b128_r8", "q4", QJLKV_DTYPE_F16, 8, 2, 128, [](qjlkv_config &c) { c.residual_tokens = 8; }},
    {"q2_preset_b128_r8", "q2", QJLKV_DTYPE_F32, 8, 2, 128, [](qjlkv_config &c) { c.residual_tokens = 8; }},
    // Mixed-bit keys: rows of 20 bytes (d 72) and 68 (d 256), every width from 0 to 4 bits.
    {"q2_d72_b24_sinks0", "q2", QJLKV_DTYPE_BF16, 6, 2, 72,
     [](qjlkv_config &c) {
       c.block_tokens = 24;
       c.sink_tokens = 0;
     }},
    {"q2_d256_bits600_b16", "q2", QJLKV_DTYPE_F16, 4, 1, 256,
     [](qjlkv_config &c) {
       c.key_token_bits = 600;
       c.block_tokens = 16;
     }},
    {"q2_d8_bits32_uniform_values", "q2", QJLKV_DTYPE_F32, 2, 1, 8,
     [](qjlkv_config &c) {
       c.key_token_bits = 32;  // 4 bits a channel: every channel full
       c.value_method = QJLKV_VALUES_UNIFORM;
       c.value_bits = 4;
       c.block_tokens = 8;
     }},
    {"kivi_kbits3_vbits3_d96_g32_b40", "kivi", QJLKV_DTYPE_F16, 4, 2, 96,
     [](qjlkv_config &c) {
       c.key_bits = 3;
       c.value_bits = 3;
       c.block_tokens = 40;
     }},
    {"kivi_kbits3_d40_vbits3_g5_b16", "kivi", QJLKV_DTYPE_F32, 2, 1, 40,
     [](qjlkv_config &c) {
       c.key_bits = 3;
       c.value_bits = 3;
       c.value_group_size = 5;
       c.block_tokens = 16;
     }},
    {"ott_kbits3_sinks2_b24", "ott", QJLKV_DTYPE_BF16, 6, 3, 64,
     [](qjlkv_config &c) {
       c.key_bits = 3;
       c.sink_tokens = 2;
       c.block_tokens = 24;
       c.outlier_skip_layers = 0;
     }},
    {"qjl_sinks5_lloyd4_d96", "qjl", QJLKV_DTYPE_F32, 4, 2, 96,
     [](qjlkv_config &c) {
       c.sink_tokens = 5;
       c.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
       c.value_bits = 4;
     }},
    {"exact_lloyd3_d40_b8_r0_sinks3", "exact", QJLKV_DTYPE_F16, 4, 1, 40,
     [](qjlkv_config &c) {
       c.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
       c.value_bits = 3;
       c.block_tokens = 8;
       c.residual_tokens = 0;
       c.sink_tokens = 3;
     }},
    {"q4_d72_sinks20_b8_r3", "q4", QJLKV_DTYPE_F32, 6, 2, 72,
     [](qjlkv_config &c) {
       c.block_tokens = 8;
       c.residual_tokens = 3;
       c.sink_tokens = 20;  // more sinks than a block
     }},
};

class CudaVsCpuCorners : public testing::TestWithParam<Corner> {};

TEST_P(CudaVsCpuCorners, SameBytesScoresAndOutputs) {
  REQUIRE_CUDA_DEVICE();
  const Corner &c = GetParam();
  qjlkv_config cfg{};
  cfg.struct_size = sizeof cfg;
  QJLKV_OK(qjlkv_config_init(&cfg, c.preset, 2, c.q_heads, c.kv_heads, c.head_dim));
  cfg.dtype = c.dtype;
  cfg.seed = 77;
  c.adjust(cfg);
  QJLKV_OK(qjlkv_config_validate(&cfg));
  CachePair pair(cfg);
  ASSERT_TRUE(pair.ok()) << pair.error();
  std::mt19937 rng(c.head_dim + c.q_heads);
  const size_t te = pair.token_elems();
  for (uint32_t layer : {0u, 1u}) {
    pair.append(layer, 4, make_keys(rng, 131, c.kv_heads, c.head_dim), make_values(rng, 131 * te));
    for (int step = 0; step < 30; ++step)
      pair.append(layer, 4, make_keys(rng, 1, c.kv_heads, c.head_dim), make_values(rng, te));
    expect_same_sequence(pair, layer, 4, rng, "corner case");
  }
}

INSTANTIATE_TEST_SUITE_P(Corners, CudaVsCpuCorners, testing::ValuesIn(kCorners),
                         [](const testing::TestParamInfo<Corner> &info) { return std::string(info.param.name); });

// Mixed-bit keys on blocks that test the width allocation: channels of zero range (constant),
// many equal ranges (small integers: ties go to the lower channel, then the lower bit), ranges
// too small for a bit next to wide ones that take 4; head dims off multiples of 32, few and many
// bits a token.
TEST(CudaBackend, MixedKeysAllocateTheCpuWidths) {
  REQUIRE_CUDA_DEVICE();
  struct MixedCase {
    qjlkv_dtype dtype;
    uint32_t head_dim, token_bits;  // token_bits 0: the preset's
  };
  const MixedCase cases[] = {{QJLKV_DTYPE_F32, 64, 0},  {QJLKV_DTYPE_F16, 72, 0},  {QJLKV_DTYPE_BF16, 128, 0},
                             {QJLKV_DTYPE_F32, 256, 0}, {QJLKV_DTYPE_F16, 128, 512}, {QJLKV_DTYPE_BF16, 40, 8},
                             {QJLKV_DTYPE_F32, 24, 96}};
  for (const MixedCase &c : cases) {
    const uint32_t d = c.head_dim, kv_heads = 2;
    SCOPED_TRACE(std::string(dtype_name(c.dtype)) + ", head_dim " + std::to_string(d) + ", key_token_bits " +
                 std::to_string(c.token_bits));
    qjlkv_config cfg{};
    cfg.struct_size = sizeof cfg;
    QJLKV_OK(qjlkv_config_init(&cfg, "q2", 1, 2 * kv_heads, kv_heads, d));
    cfg.dtype = c.dtype;
    cfg.block_tokens = 16;
    cfg.residual_tokens = 4;
    cfg.sink_tokens = 2;
    if (c.token_bits) cfg.key_token_bits = c.token_bits;
    QJLKV_OK(qjlkv_config_validate(&cfg));
    CachePair pair(cfg);
    ASSERT_TRUE(pair.ok()) << pair.error();
    std::mt19937 rng(d + c.token_bits);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const auto keys_of = [&](uint32_t tokens) {
      std::vector<float> x(size_t(tokens) * kv_heads * d);
      for (size_t i = 0; i < x.size(); ++i) {
        const uint32_t j = uint32_t(i % d);
        switch (j % 6) {
          case 0: x[i] = 0.25f * float(j % 5); break;           // constant: zero range
          case 1: x[i] = float(int(rng() % 5) - 2); break;      // ranges of 4 (ties)
          case 2: x[i] = 30.0f * normal(rng); break;            // wide
          case 3: x[i] = 1e-3f * normal(rng); break;            // too small for a bit
          case 4: x[i] = float(rng() % 3); break;               // ranges of 2 (ties)
          default: x[i] = normal(rng);
        }
      }
      return x;
    };
    const size_t te = pair.token_elems();
    pair.append(0, 1, keys_of(70), make_values(rng, 70 * te));
    for (int step = 0; step < 20; ++step) pair.append(0, 1, keys_of(1), make_values(rng, te));
    expect_same_sequence(pair, 0, 1, rng, "mixed blocks");
  }
}

// Batched decode: append_batch and attend_batch over many sequences of different lengths.
// SPEC §9's error budget for the GPU's integer key scores (KIVI/OTT/mixed: dp4a with the query's
// int8 digits), measured against double-precision references over the cache's own reconstruction k̂,
// v̂ (the stored bytes, decoded on the host): scores as rms over the quantized positions of
// (score − q·k̂) / (‖q‖·‖k‖) ≤ 1e-3, attention outputs as rms(output − softmax(q·k̂/√d)·v̂) /
// rms(reference) ≤ 1e-3 (bf16 outputs: plus their own rounding, 2.3e-3, as in tests/cpu_paths).
struct BudgetCase {
  const char *name, *preset;
  qjlkv_dtype dtype;
  uint32_t head_dim, key_bits;  // key_bits 0: the preset's
};
void PrintTo(const BudgetCase &c, std::ostream *os) { *os << c.name; }
const BudgetCase kBudgetCases[] = {
    {"kivi2_f32_d128", "kivi", QJLKV_DTYPE_F32, 128, 0}, {"q3_f32_d128", "q3", QJLKV_DTYPE_F32, 128, 0},
    {"q4_f16_d64", "q4", QJLKV_DTYPE_F16, 64, 0},         {"kivi8_bf16_d96", "kivi", QJLKV_DTYPE_BF16, 96, 8},
    {"ott3_f32_d40", "ott", QJLKV_DTYPE_F32, 40, 3},
    {"q2_f32_d128", "q2", QJLKV_DTYPE_F32, 128, 0},    {"q2_bf16_d72", "q2", QJLKV_DTYPE_BF16, 72, 0},
};

class CudaErrorBudget : public testing::TestWithParam<BudgetCase> {};

TEST_P(CudaErrorBudget, IntegerScoresAndOutputs) {
  REQUIRE_CUDA_DEVICE();
  const BudgetCase &c = GetParam();
  const uint32_t kv_heads = 2, group = 4, d = c.head_dim, layer = 0, seq = 9;
  qjlkv_config cfg{};
  cfg.struct_size = sizeof cfg;
  QJLKV_OK(qjlkv_config_init(&cfg, c.preset, 1, kv_heads * group, kv_heads, d));
  cfg.dtype = c.dtype;
  cfg.seed = 77;
  cfg.block_tokens = 32;
  if (c.key_bits) cfg.key_bits = c.key_bits;
  if (std::string(c.preset) == "ott") cfg.outlier_skip_layers = 0;
  CachePair pair(cfg);
  ASSERT_TRUE(pair.ok()) << pair.error();
  std::mt19937 rng(d + c.key_bits);
  const uint32_t length = 300, te = kv_heads * d;
  const auto keys = decode(encode(make_keys(rng, length, kv_heads, d), c.dtype), c.dtype);  // as stored
  pair.append(layer, seq, keys, make_values(rng, size_t(length) * te));
  const auto r = pair.reconstruct(layer, seq);  // r[1], r[3]: the GPU's k̂, v̂
  const auto query = decode(encode(make_values(rng, pair.query_elems()), c.dtype), c.dtype);

  // Scores over the quantized positions [sinks, sinks + blocks·B) (the others are exact).
  const uint32_t sinks = std::min(length, cfg.sink_tokens), rest = length - sinks;
  const uint32_t blocks = rest >= cfg.residual_tokens + cfg.block_tokens ? (rest - cfg.residual_tokens) / cfg.block_tokens : 0;
  ASSERT_GE(blocks, 2u);
  const auto [s_cpu, s_gpu] = pair.scores(layer, seq, query);
  const auto norm = [&](const float *x) {
    double sum = 0.0;
    for (uint32_t j = 0; j < d; ++j) sum += double(x[j]) * x[j];
    return std::sqrt(sum);
  };
  double squares_gpu = 0.0, squares_cpu = 0.0;
  size_t counted = 0;
  for (uint32_t h = 0; h < cfg.num_q_heads; ++h)
    for (uint32_t p = sinks; p < sinks + blocks * cfg.block_tokens; ++p) {
      const float *k_hat = &r[1][(size_t(p) * kv_heads + h / group) * d];
      double dot = 0.0;
      for (uint32_t j = 0; j < d; ++j) dot += double(query[size_t(h) * d + j]) * k_hat[j];
      if (std::isinf(s_gpu[size_t(h) * length + p])) continue;  // OTT: a moved token's slot
      const double unit = norm(&query[size_t(h) * d]) * norm(&keys[(size_t(p) * kv_heads + h / group) * d]);
      squares_gpu += std::pow((s_gpu[size_t(h) * length + p] - dot) / unit, 2);
      squares_cpu += std::pow((s_cpu[size_t(h) * length + p] - dot) / unit, 2);
      ++counted;
    }
  const double score_rms = std::sqrt(squares_gpu / double(counted)), score_rms_cpu = std::sqrt(squares_cpu / double(counted));
  EXPECT_LE(score_rms, 1e-3) << "GPU score rms error / (‖q‖·‖k‖)";

  // One decode query: the output against the double softmax over q·k̂/√d times v̂.
  const auto [o_cpu, o_gpu] = pair.attend(layer, {seq}, 1, query, 0.0f, false);
  double error2 = 0.0, size2 = 0.0;
  for (uint32_t h = 0; h < cfg.num_q_heads; ++h) {
    std::vector<double> weight(length);
    double top = -INFINITY, total = 0.0;
    for (uint32_t p = 0; p < length; ++p) {
      double dot = 0.0;
      for (uint32_t j = 0; j < d; ++j) dot += double(query[size_t(h) * d + j]) * r[1][(size_t(p) * kv_heads + h / group) * d + j];
      weight[p] = dot / std::sqrt(double(d));
      top = std::max(top, weight[p]);
    }
    for (double &w : weight) total += (w = std::exp(w - top));
    for (uint32_t j = 0; j < d; ++j) {
      double want = 0.0;
      for (uint32_t p = 0; p < length; ++p) want += weight[p] * r[3][(size_t(p) * kv_heads + h / group) * d + j];
      want /= total;
      error2 += std::pow(o_gpu[size_t(h) * d + j] - want, 2);
      size2 += want * want;
    }
  }
  const double output_rms = std::sqrt(error2 / size2);
  EXPECT_LE(output_rms, c.dtype == QJLKV_DTYPE_BF16 ? 1e-3 + 2.3e-3 : 1e-3) << "GPU output rms error / rms output";
  std::printf("error budget %s: GPU scores rms %.2g (CPU %.2g) of ‖q‖·‖k‖, GPU outputs rms %.2g\n", c.name, score_rms,
              score_rms_cpu, output_rms);
  RecordProperty("score_rms", std::to_string(score_rms));
  RecordProperty("output_rms", std::to_string(output_rms));
}

INSTANTIATE_TEST_SUITE_P(IntegerKeys, CudaErrorBudget, testing::ValuesIn(kBudgetCases),
                         [](const testing::TestParamInfo<BudgetCase> &info) { return std::string(info.param.name); });

TEST(CudaBackend, BatchedDecodeMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  const uint32_t n_seqs = kEmulated ? 6 : 64, steps = kEmulated ? 36 : 40;
  for (const char *preset : {"qjl", "kivi", "q3"}) {
    SCOPED_TRACE(preset);
    CachePair pair(make_config({preset, QJLKV_DTYPE_F16, 128, 4}, 2, 1));
    ASSERT_TRUE(pair.ok()) << pair.error();
    std::mt19937 rng(5);
    const size_t te = pair.token_elems();
    std::vector<uint32_t> seqs(n_seqs);
    for (uint32_t i = 0; i < n_seqs; ++i) {
      seqs[i] = 1000 + 17 * i;
      const uint32_t n = 20 + 13 * i % 90;
      pair.append(0, seqs[i], make_keys(rng, n, 2, 128), make_values(rng, n * te));
    }
    for (uint32_t step = 0; step < steps; ++step)
      pair.append_batch(0, seqs, make_keys(rng, n_seqs, 2, 128), make_values(rng, n_seqs * te));
    // attend_batch lists sequences in any order, repeats allowed.
    std::vector<uint32_t> order(seqs.rbegin(), seqs.rend());
    order.push_back(seqs[0]);
    const auto queries = make_values(rng, order.size() * pair.query_elems());
    const auto [o_cpu, o_gpu] = pair.attend(0, order, 1, queries, 0.0f, true);
    const Mismatch m = compare_outputs(o_gpu, o_cpu, QJLKV_DTYPE_F16);
    EXPECT_EQ(m.count, 0u) << "attend_batch: first mismatch at " << m.first << " (worst " << m.worst << ")";
    for (uint32_t i = 0; i < n_seqs; i += kEmulated ? 5 : 21) expect_same_sequence(pair, 0, seqs[i], rng, "batch");
  }
}

// A long context, split over many CTAs and merged by the reduction kernel.
TEST(CudaBackend, LongContextMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  const uint32_t tokens = kEmulated ? 1100 : 131072, chunk = kEmulated ? 550 : 8192;
  for (const char *preset : {"qjl", "kivi", "q3"}) {
    SCOPED_TRACE(preset);
    CachePair pair(make_config({preset, QJLKV_DTYPE_BF16, 128, 4}, 2, 1));
    ASSERT_TRUE(pair.ok()) << pair.error();
    std::mt19937 rng(9);
    const size_t te = pair.token_elems();
    for (uint32_t done = 0; done < tokens; done += chunk)
      pair.append(0, 1, make_keys(rng, chunk, 2, 128), make_values(rng, size_t(chunk) * te));
    const auto query = make_values(rng, pair.query_elems());
    const auto [o_cpu, o_gpu] = pair.attend(0, {1}, 1, query, 0.0f, false);
    const Mismatch m = compare_outputs(o_gpu, o_cpu, QJLKV_DTYPE_BF16);
    EXPECT_EQ(m.count, 0u) << "first mismatch at " << m.first << " (worst " << m.worst << ")";
    const auto [s_cpu, s_gpu] = pair.scores(0, 1, query);
    const Mismatch ms = compare_close(s_gpu, s_cpu, 1e-3);
    EXPECT_EQ(ms.count, 0u) << "scores: first mismatch at " << ms.first << " (worst " << ms.worst << ")";
  }
}

// Non-finite or out-of-range data is rejected naming the element, and nothing changes.
TEST(CudaBackend, RejectsBadDataAndStaysUnchanged) {
  REQUIRE_CUDA_DEVICE();
  CachePair pair(make_config({"qjl", QJLKV_DTYPE_F32, 64, 4}, 2, 1));
  ASSERT_TRUE(pair.ok()) << pair.error();
  std::mt19937 rng(3);
  const size_t te = pair.token_elems();
  pair.append(0, 5, make_keys(rng, 60, 2, 64), make_values(rng, 60 * te));
  const auto query = make_values(rng, pair.query_elems());
  const auto before = pair.attend(0, {5}, 1, query, 0.0f, false).second;

  struct BadInput {
    bool in_keys;
    size_t index;
    float value;
    const char *expect;
  };
  const BadInput bad[] = {
      {true, 77, std::nanf(""), "keys[77]"},
      {false, 5, INFINITY, "values[5]"},
      {false, 200, 1e6f, "outside the fp16 range"},
      {true, 64, 60000.0f, "L2 norm"},  // one key vector of norm > 65504 (two elements of 60000)
  };
  for (const BadInput &b : bad) {
    SCOPED_TRACE(b.expect);
    auto keys = make_keys(rng, 40, 2, 64), values = make_values(rng, 40 * te);
    (b.in_keys ? keys : values)[b.index] = b.value;
    if (std::string(b.expect) == "L2 norm") keys[b.index + 1] = b.value;
    const auto k = encode(keys, QJLKV_DTYPE_F32), v = encode(values, QJLKV_DTYPE_F32);
    DeviceBytes dk(k), dv(v);
    EXPECT_EQ(qjlkv_cache_append(pair.gpu(), 0, 5, 40, dk.get(), dv.get()), QJLKV_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(qjlkv_last_error_message()).find(b.expect), std::string::npos)
        << qjlkv_last_error_message();
    // A new sequence is not created either.
    EXPECT_EQ(qjlkv_cache_append(pair.gpu(), 0, 6, 40, dk.get(), dv.get()), QJLKV_ERROR_INVALID_ARGUMENT);
    uint64_t length = 0;
    ASSERT_EQ(qjlkv_cache_length(pair.gpu(), 0, 5, &length), QJLKV_OK);
    EXPECT_EQ(length, 60u);
    ASSERT_EQ(qjlkv_cache_length(pair.gpu(), 0, 6, &length), QJLKV_OK);
    EXPECT_EQ(length, 0u);
  }
  const auto after = pair.attend(0, {5}, 1, query, 0.0f, false).second;
  EXPECT_EQ(count_bit_differences(after, before), 0u) << "a rejected append changed the cache";

  // scores() rejects a non-finite query (it reads back anyway); attend does not check (no sync).
  auto bad_query = query;
  bad_query[3] = std::nanf("");
  const auto q = encode(bad_query, QJLKV_DTYPE_F32);
  DeviceBytes dq(q);
  std::vector<float> out(60 * pair.cfg().num_q_heads);
  EXPECT_EQ(qjlkv_cache_scores(pair.gpu(), 0, 5, dq.get(), out.data(), out.size()), QJLKV_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(qjlkv_last_error_message()).find("query[3]"), std::string::npos)
      << qjlkv_last_error_message();
}

// Rotated Lloyd-Max values store one fp16 scale per token: a value vector whose norm would overflow
// it is refused like on the CPU, naming the token and head, and nothing changes.
TEST(CudaBackend, RejectsValueNormsRotatedValuesCannotStore) {
  REQUIRE_CUDA_DEVICE();
  CachePair pair(make_config({"q3", QJLKV_DTYPE_F32, 64, 2}, 2, 1));
  ASSERT_TRUE(pair.ok()) << pair.error();
  std::mt19937 rng(31);
  const size_t te = pair.token_elems();
  pair.append(0, 1, make_keys(rng, 50, 2, 64), make_values(rng, 50 * te));
  auto values = make_values(rng, 20 * te);
  for (uint32_t j = 0; j < 64; ++j) values[(7 * 2 + 1) * 64 + j] = 60000.0f;  // token 7, head 1: norm 480000
  const auto k = encode(make_keys(rng, 20, 2, 64), QJLKV_DTYPE_F32), v = encode(values, QJLKV_DTYPE_F32);
  DeviceBytes dk(k), dv(v);
  for (qjlkv_cache *c : {pair.cpu(), pair.gpu()}) {
    const bool gpu = c == pair.gpu();
    EXPECT_EQ(qjlkv_cache_append(c, 0, 1, 20, gpu ? dk.get() : k.data(), gpu ? dv.get() : v.data()),
              QJLKV_ERROR_INVALID_ARGUMENT);
    const std::string message = qjlkv_last_error_message();
    EXPECT_NE(message.find("token 7, kv head 1 has L2 norm"), std::string::npos) << message;
    uint64_t length = 0;
    ASSERT_EQ(qjlkv_cache_length(c, 0, 1, &length), QJLKV_OK);
    EXPECT_EQ(length, 50u);
  }
  expect_same_sequence(pair, 0, 1, rng, "after the refused append");
}

// Work is ordered on the stream given to set_stream; results do not depend on the stream.
TEST(CudaBackend, StreamsOrderWork) {
  REQUIRE_CUDA_DEVICE();
  CachePair pair(make_config({"kivi", QJLKV_DTYPE_F16, 64, 4}, 2, 1));
  ASSERT_TRUE(pair.ok()) << pair.error();
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  QJLKV_OK(qjlkv_cache_set_stream(pair.gpu(), stream));
  std::mt19937 rng(11);
  const size_t te = pair.token_elems();
  pair.append(0, 2, make_keys(rng, 300, 2, 64), make_values(rng, 300 * te));
  const auto query = make_values(rng, pair.query_elems());
  const auto q = encode(query, QJLKV_DTYPE_F16);
  DeviceBytes dq(q), dout(q.size());
  QJLKV_OK(qjlkv_cache_attend(pair.gpu(), 0, 2, 1, dq.get(), 0.0f, dout.get()));
  CUDA_OK(cudaStreamSynchronize(stream));
  const auto on_stream = decode(dout.download(), QJLKV_DTYPE_F16);
  QJLKV_OK(qjlkv_cache_set_stream(pair.gpu(), nullptr));
  CUDA_OK(cudaStreamDestroy(stream));
  const auto [o_cpu, o_gpu] = pair.attend(0, {2}, 1, query, 0.0f, false);
  EXPECT_EQ(count_bit_differences(on_stream, o_gpu), 0u);
  EXPECT_EQ(compare_outputs(o_gpu, o_cpu, QJLKV_DTYPE_F16).count, 0u);
}

#if !defined(QJLKV_CUDA_EMULATION)
// attend_batch enqueues the same work whatever the number of sequences — one upload, the split
// kernel and the reduction kernel — and never waits for the device, so a CUDA graph can capture it
// (a synchronization inside the capture would fail the call).
TEST(CudaBackend, AttendBatchIsCapturableWithConstantWork) {
  REQUIRE_CUDA_DEVICE();
  qjlkv_config cfg = make_config({"qjl", QJLKV_DTYPE_F16, 128, 4}, 2, 1);
  cfg.backend = QJLKV_BACKEND_CUDA;
  cfg.device_ordinal = 0;
  qjlkv_cache *cache = nullptr;
  QJLKV_OK(qjlkv_cache_create(&cfg, &cache));
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  QJLKV_OK(qjlkv_cache_set_stream(cache, stream));
  std::mt19937 rng(21);
  const uint32_t n_max = 64, tokens = 100;
  std::vector<uint32_t> seqs(n_max);
  for (uint32_t i = 0; i < n_max; ++i) {
    seqs[i] = i;
    DeviceBytes k(encode(make_keys(rng, tokens, 2, 128), QJLKV_DTYPE_F16));
    DeviceBytes v(encode(make_values(rng, tokens * 2 * 128), QJLKV_DTYPE_F16));
    QJLKV_OK(qjlkv_cache_append(cache, 0, i, tokens, k.get(), v.get()));
  }
  DeviceBytes q(encode(make_values(rng, n_max * 8 * 128), QJLKV_DTYPE_F16)), out(n_max * 8 * 128 * 2);
  for (uint32_t n : {1u, 8u, 64u}) {
    SCOPED_TRACE(n);
    QJLKV_OK(qjlkv_cache_attend_batch(cache, 0, n, seqs.data(), q.get(), 0.0f, out.get()));  // sizes scratch
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    const qjlkv_status status = qjlkv_cache_attend_batch(cache, 0, n, seqs.data(), q.get(), 0.0f, out.get());
    const std::string message = qjlkv_last_error_message();
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    EXPECT_EQ(status, QJLKV_OK) << message;
    size_t n_nodes = 0;
    CUDA_OK(cudaGraphGetNodes(graph, nullptr, &n_nodes));
    std::vector<cudaGraphNode_t> nodes(n_nodes);
    CUDA_OK(cudaGraphGetNodes(graph, nodes.data(), &n_nodes));
    size_t kernels = 0, copies = 0;
    for (cudaGraphNode_t node : nodes) {
      cudaGraphNodeType type;
      CUDA_OK(cudaGraphNodeGetType(node, &type));
      kernels += type == cudaGraphNodeTypeKernel;
      copies += type == cudaGraphNodeTypeMemcpy;
    }
    EXPECT_EQ(kernels, 2u);
    EXPECT_EQ(copies, 1u);
    CUDA_OK(cudaGraphDestroy(graph));
  }
  QJLKV_OK(qjlkv_cache_set_stream(cache, nullptr));
  qjlkv_cache_destroy(cache);
  CUDA_OK(cudaStreamDestroy(stream));
}
#endif

// ---- export / import (docs/FORMAT.md): the stream of a sequence is backend-independent ----------
std::vector<uint8_t> export_all(qjlkv_cache *c, uint32_t seq, uint32_t layers) {
  uint64_t size = 0;
  EXPECT_EQ(qjlkv_cache_export_size(c, seq, 0, layers, &size), QJLKV_OK) << qjlkv_last_error_message();
  std::vector<uint8_t> stream(size);
  EXPECT_EQ(qjlkv_cache_export(c, seq, 0, layers, stream.data(), size), QJLKV_OK) << qjlkv_last_error_message();
  return stream;
}

// attend on the CUDA cache (device buffers), output as floats.
std::vector<float> gpu_attend(qjlkv_cache *c, const qjlkv_config &cfg, uint32_t layer, uint32_t seq,
                              const std::vector<float> &query) {
  const auto q = encode(query, qjlkv_dtype(cfg.dtype));
  DeviceBytes dq(q), dout(q.size());
  EXPECT_EQ(qjlkv_cache_attend(c, layer, seq, 1, dq.get(), 0.0f, dout.get()), QJLKV_OK) << qjlkv_last_error_message();
  return decode(dout.download(), qjlkv_dtype(cfg.dtype));
}
std::vector<float> cpu_attend(qjlkv_cache *c, const qjlkv_config &cfg, uint32_t layer, uint32_t seq,
                              const std::vector<float> &query) {
  const auto q = encode(query, qjlkv_dtype(cfg.dtype));
  std::vector<uint8_t> out(q.size());
  EXPECT_EQ(qjlkv_cache_attend(c, layer, seq, 1, q.data(), 0.0f, out.data()), QJLKV_OK) << qjlkv_last_error_message();
  return decode(out, qjlkv_dtype(cfg.dtype));
}
std::vector<float> reconstruct_all(qjlkv_cache *c, const qjlkv_config &cfg, uint32_t layer, uint32_t seq) {
  uint64_t length = 0;
  EXPECT_EQ(qjlkv_cache_length(c, layer, seq, &length), QJLKV_OK);
  const size_t n = size_t(length) * cfg.num_kv_heads * cfg.head_dim;
  std::vector<float> kv(2 * n);
  EXPECT_EQ(qjlkv_cache_reconstruct(c, layer, seq, 0, length, kv.data(), kv.data() + n), QJLKV_OK)
      << qjlkv_last_error_message();
  return kv;
}

struct ExportCase {
  const char *name, *preset;
  qjlkv_dtype dtype;
  void (*adjust)(qjlkv_config &);
};
void PrintTo(const ExportCase &c, std::ostream *os) { *os << c.name; }
const ExportCase kExportCases[] = {
    {"q3_bf16", "q3", QJLKV_DTYPE_BF16, [](qjlkv_config &c) { c.block_tokens = 32; }},
    {"q2_f16", "q2", QJLKV_DTYPE_F16, [](qjlkv_config &c) { c.block_tokens = 32; }},
    {"q4_f32_sinks20_b8", "q4", QJLKV_DTYPE_F32,
     [](qjlkv_config &c) {
       c.block_tokens = 8;
       c.residual_tokens = 3;
       c.sink_tokens = 20;
     }},
    {"qjl_f16", "qjl", QJLKV_DTYPE_F16, [](qjlkv_config &) {}},
    {"ott_traced_kbits3_sinks2_f16", "ott", QJLKV_DTYPE_F16,
     [](qjlkv_config &c) {
       c.block_tokens = 16;
       c.key_bits = 3;
       c.sink_tokens = 2;
       c.outlier_tokens = 4;
       c.outlier_spill_tokens = 6;
       c.outlier_skip_layers = 1;
     }},
    {"exact_f32", "exact", QJLKV_DTYPE_F32, [](qjlkv_config &) {}},
};

class CudaExportImport : public testing::TestWithParam<ExportCase> {};

// A sequence exported by either backend gives the same stream; imported into the other backend it
// decodes (reconstruction, attention) exactly like the sequence that never left, and keeps doing so
// after further appends.
TEST_P(CudaExportImport, StreamsAreBackendIndependentAndRoundTrip) {
  REQUIRE_CUDA_DEVICE();
  const ExportCase &c = GetParam();
  qjlkv_config cfg{};
  cfg.struct_size = sizeof cfg;
  QJLKV_OK(qjlkv_config_init(&cfg, c.preset, 2, 4, 2, 64));
  cfg.dtype = c.dtype;
  cfg.seed = 99;
  c.adjust(cfg);
  QJLKV_OK(qjlkv_config_validate(&cfg));
  CachePair pair(cfg);
  ASSERT_TRUE(pair.ok()) << pair.error();
  std::mt19937 rng(17);
  const size_t te = pair.token_elems();
  for (uint32_t layer : {0u, 1u}) {
    pair.append(layer, 1, make_keys(rng, 101, 2, 64), make_values(rng, 101 * te));
    for (int step = 0; step < 9; ++step) pair.append(layer, 1, make_keys(rng, 1, 2, 64), make_values(rng, te));
  }
  // A short sequence: sinks only, or a short tail (OTT: a traced layer without a block yet).
  for (uint32_t layer : {0u, 1u}) pair.append(layer, 2, make_keys(rng, 3, 2, 64), make_values(rng, 3 * te));

  for (uint32_t seq : {1u, 2u}) {
    SCOPED_TRACE("seq " + std::to_string(seq));
    const uint32_t layers = 2;
    const auto from_cpu = export_all(pair.cpu(), seq, layers), from_gpu = export_all(pair.gpu(), seq, layers);
    ASSERT_FALSE(from_cpu.empty());
    EXPECT_EQ(from_cpu, from_gpu) << "the backends export different streams";
    const uint32_t copy = seq + 10;  // CPU -> CUDA and CUDA -> CPU
    QJLKV_OK(qjlkv_cache_import(pair.gpu(), copy, from_cpu.data(), from_cpu.size()));
    QJLKV_OK(qjlkv_cache_import(pair.cpu(), copy, from_gpu.data(), from_gpu.size()));
    EXPECT_EQ(export_all(pair.gpu(), copy, layers), from_cpu) << "an imported CUDA sequence exports another stream";
    for (int round = 0; round < 2; ++round) {
      SCOPED_TRACE(round ? "after appends to both" : "as imported");
      for (uint32_t layer = 0; layer < layers; ++layer) {
        EXPECT_EQ(count_bit_differences(reconstruct_all(pair.gpu(), cfg, layer, copy),
                                        reconstruct_all(pair.gpu(), cfg, layer, seq)),
                  0u);
        EXPECT_EQ(count_bit_differences(reconstruct_all(pair.cpu(), cfg, layer, copy),
                                        reconstruct_all(pair.cpu(), cfg, layer, seq)),
                  0u);
        const auto query = make_values(rng, pair.query_elems());
        const auto gpu_original = gpu_attend(pair.gpu(), cfg, layer, seq, query);
        EXPECT_EQ(count_bit_differences(gpu_attend(pair.gpu(), cfg, layer, copy, query), gpu_original), 0u);
        EXPECT_EQ(count_bit_differences(cpu_attend(pair.cpu(), cfg, layer, copy, query),
                                        cpu_attend(pair.cpu(), cfg, layer, seq, query)),
                  0u);
        const Mismatch m = compare_outputs(gpu_original, cpu_attend(pair.cpu(), cfg, layer, seq, query),
                                          qjlkv_dtype(cfg.dtype));
        EXPECT_EQ(m.count, 0u) << "worst " << m.worst;
        if (round == 0) {  // the same tokens to the originals and the copies, through blocks and sinks
          const auto keys = make_keys(rng, 40, 2, 64), values = make_values(rng, 40 * te);
          pair.append(layer, seq, keys, values);
          pair.append(layer, copy, keys, values);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, CudaExportImport, testing::ValuesIn(kExportCases),
                         [](const testing::TestParamInfo<ExportCase> &info) { return std::string(info.param.name); });

// Streams that do not fit the cache, or are damaged, are refused by a CUDA cache as by a CPU one,
// naming what is wrong, and the cache stays as it was.
TEST(CudaBackend, ImportRefusesBadStreamsAndChangesNothing) {
  REQUIRE_CUDA_DEVICE();
  qjlkv_config cfg = make_config({"q3", QJLKV_DTYPE_F16, 64, 2}, 2, 2);
  CachePair pair(cfg);
  ASSERT_TRUE(pair.ok()) << pair.error();
  std::mt19937 rng(23);
  const size_t te = pair.token_elems();
  for (uint32_t layer : {0u, 1u}) pair.append(layer, 5, make_keys(rng, 90, 2, 64), make_values(rng, 90 * te));
  const auto stream = export_all(pair.gpu(), 5, 2);
  const auto query = make_values(rng, pair.query_elems());
  const auto before = gpu_attend(pair.gpu(), cfg, 1, 5, query);

  const auto expect_refused = [&](const std::vector<uint8_t> &bytes, uint32_t seq, qjlkv_status status,
                                  const char *message) {
    SCOPED_TRACE(message);
    EXPECT_EQ(qjlkv_cache_import(pair.gpu(), seq, bytes.data(), bytes.size()), status);
    EXPECT_NE(std::string(qjlkv_last_error_message()).find(message), std::string::npos)
        << qjlkv_last_error_message();
    for (uint32_t layer : {0u, 1u}) {
      uint64_t length = 0;
      ASSERT_EQ(qjlkv_cache_length(pair.gpu(), layer, 6, &length), QJLKV_OK);
      EXPECT_EQ(length, 0u);
      ASSERT_EQ(qjlkv_cache_length(pair.gpu(), layer, 5, &length), QJLKV_OK);
      EXPECT_EQ(length, 90u);
    }
  };
  auto damaged = stream;
  damaged[damaged.size() / 2] ^= 0x10;
  expect_refused(damaged, 6, QJLKV_ERROR_CORRUPT_DATA, "checksum");
  expect_refused(std::vector<uint8_t>(stream.begin(), stream.end() - 9), 6, QJLKV_ERROR_CORRUPT_DATA, "truncated");
  expect_refused(stream, 5, QJLKV_ERROR_INVALID_ARGUMENT, "seq 5");  // the target holds tokens
  // A stream of another configuration (2-bit keys).
  qjlkv_config other = cfg;
  other.key_bits = 2;
  other.backend = QJLKV_BACKEND_CPU;
  qjlkv_cache *cpu = nullptr;
  QJLKV_OK(qjlkv_cache_create(&other, &cpu));
  const auto k = encode(make_keys(rng, 90, 2, 64), qjlkv_dtype(cfg.dtype));
  const auto v = encode(make_values(rng, 90 * te), qjlkv_dtype(cfg.dtype));
  QJLKV_OK(qjlkv_cache_append(cpu, 0, 5, 90, k.data(), v.data()));
  const auto foreign = export_all(cpu, 5, 1);
  qjlkv_cache_destroy(cpu);
  expect_refused(foreign, 6, QJLKV_ERROR_INVALID_ARGUMENT, "key_bits");
  EXPECT_EQ(count_bit_differences(gpu_attend(pair.gpu(), cfg, 1, 5, query), before), 0u);
  // The intact stream still imports.
  QJLKV_OK(qjlkv_cache_import(pair.gpu(), 6, stream.data(), stream.size()));
  EXPECT_EQ(count_bit_differences(gpu_attend(pair.gpu(), cfg, 1, 6, query), before), 0u);
}

// Runs everywhere: without a device, the CUDA backend fails cleanly, naming the CUDA error.
TEST(CudaBackend, CreateWithoutDeviceFailsCleanly) {
  std::string why;
  qjlkv_config cfg{};
  cfg.struct_size = sizeof cfg;
  QJLKV_OK(qjlkv_config_init(&cfg, "qjl", 1, 4, 1, 64));
  cfg.backend = QJLKV_BACKEND_CUDA;
  cfg.device_ordinal = 0;
  qjlkv_cache *c = nullptr;
  const qjlkv_status s = qjlkv_cache_create(&cfg, &c);
  if (cuda_device_available(&why)) {
    EXPECT_EQ(s, QJLKV_OK) << qjlkv_last_error_message();
    qjlkv_cache_destroy(c);
    // An ordinal past the last device is reported as such.
    int count = 0;
    CUDA_OK(cudaGetDeviceCount(&count));
    cfg.device_ordinal = uint32_t(count);
    EXPECT_EQ(qjlkv_cache_create(&cfg, &c), QJLKV_ERROR_UNSUPPORTED);
    EXPECT_NE(std::string(qjlkv_last_error_message()).find("config.device_ordinal"), std::string::npos);
    return;
  }
  std::printf("no CUDA device here (%s): checking the error path\n", why.c_str());
  EXPECT_EQ(s, QJLKV_ERROR_UNSUPPORTED);
  EXPECT_EQ(c, nullptr);
  const std::string message = qjlkv_last_error_message();
  EXPECT_NE(message.find("config.device_ordinal"), std::string::npos) << message;
  EXPECT_NE(message.find("cuda"), std::string::npos) << message;  // the CUDA error's name
}

#if defined(QJLKV_CUDA_EMULATION)
// On a device with less shared memory per block, the attention kernels take fewer query rows per
// CTA; where not even one row fits, or the QJL quantizer's outlier sign bits do not, creation says
// which sizes are too large.
TEST(CudaBackend, SmallSharedMemoryTakesFewerRowsOrFailsClearly) {
  setenv("QJLKV_EMU_SMEM_OPTIN", "80000", 1);  // 2 rows per CTA for this shape, not 8
  {
    CachePair pair(make_config({"qjl", QJLKV_DTYPE_F32, 256, 7}, 1, 1));
    ASSERT_TRUE(pair.ok()) << pair.error();
    std::mt19937 rng(4);
    pair.append(0, 1, make_keys(rng, 90, 1, 256), make_values(rng, 90 * pair.token_elems()));
    expect_same_sequence(pair, 0, 1, rng, "80000 bytes of shared memory");
  }
  setenv("QJLKV_EMU_SMEM_OPTIN", "20000", 1);
  qjlkv_config cfg = make_config({"qjl", QJLKV_DTYPE_F32, 128, 4}, 1, 1);
  cfg.key_sketch_dim = 2048;
  cfg.backend = QJLKV_BACKEND_CUDA;
  cfg.device_ordinal = 0;
  qjlkv_cache *c = nullptr;
  EXPECT_EQ(qjlkv_cache_create(&cfg, &c), QJLKV_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(qjlkv_last_error_message()).find("key_sketch_dim"), std::string::npos)
      << qjlkv_last_error_message();
  cfg = make_config({"qjl", QJLKV_DTYPE_F32, 64, 4}, 1, 1);  // one attention row fits 20000 bytes
  cfg.outlier_sketch_dim = 24576;  // 24576 bytes of sign bits per chunk
  cfg.backend = QJLKV_BACKEND_CUDA;
  cfg.device_ordinal = 0;
  EXPECT_EQ(qjlkv_cache_create(&cfg, &c), QJLKV_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(qjlkv_last_error_message()).find("outlier sketch"), std::string::npos)
      << qjlkv_last_error_message();
  unsetenv("QJLKV_EMU_SMEM_OPTIN");
}

// The emulator saw no divergent barrier, shared memory overrun, bad free or leak in any test.
class EmulatorClean : public testing::Environment {
 public:
  void TearDown() override {
    EXPECT_STREQ(emu::first_error(), "");
    EXPECT_EQ(emu::live_allocations(), 0u) << "device allocations leaked";
  }
};
const auto *const kEmulatorClean = testing::AddGlobalTestEnvironment(new EmulatorClean);
#endif

}  // namespace
