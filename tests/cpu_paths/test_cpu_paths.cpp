// The CPU kernel paths (scalar, AVX2, AVX-512, AVX-512 VNNI; src/cpu/simd_*.cpp) against the
// reference kernels of src/cpu/kernels.hpp, on every path this machine supports: scores, value
// sums and softmax within float tolerance (the integer kernels within SPEC §9's error budget,
// against fp64 references); sign bits, codes and 16-bit copies byte for byte. Then the
// whole cache through the C API on each path (QJLKV_CPU_ISA): attention against a softmax over
// the cache's own reconstruction, identical stored bits on every path, and results that do not
// depend on the number of threads.
#include <gtest/gtest.h>
#include <qjlkv/qjlkv.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "config.hpp"
#include "cpu/isa.hpp"
#include "cpu/kernels.hpp"
#include "cpu/method_kernels.hpp"
#include "cpu/simd.hpp"
#include "error.hpp"
#include "methods/methods.hpp"

namespace {

using namespace qjlkv;
using namespace qjlkv::cpu;

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni})
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

// Whether a path scores keys of this method in integers (SPEC §9): it is held to the error
// budget (ScoresWithinErrorBudget), not to float tolerance. (QJL sketches whose rows are not a
// power-of-two number of 32-bit words fall back to the fp32 kernel; they are held to the budget
// all the same.) AVX2 and AVX-512 score KIVI/OTT keys in integers (the AVX2 kernel) when
// head_dim is a multiple of 16, and QJL and mixed-bit keys (the AVX2 kernels) always.
bool integer_key_scores(Isa isa, const qjlkv_config &cfg) {
  const bool codes = cfg.key_method == QJLKV_KEYS_KIVI || cfg.key_method == QJLKV_KEYS_OTT;
  const bool qjl = cfg.key_method == QJLKV_KEYS_QJL, mixed = cfg.key_method == QJLKV_KEYS_MIXED;
  return (isa == Isa::Avx512Vnni && (codes || qjl || mixed)) ||
         ((isa == Isa::Avx2 || isa == Isa::Avx512) && ((codes && cfg.head_dim % 16 == 0) || qjl || mixed));
}
// Likewise for value sums (ValueSumsWithinErrorBudget): rotated Lloyd-Max codes of 2 to 4 bits
// in 16-channel chunks; uniform codes of 2 to 8 bits in 16-channel chunks, with groups of 8 or a
// multiple of 16 channels, a power-of-two number of groups, at most 16, per token, and blocks of
// at least 16 tokens.
bool integer_value_sums(Isa isa, const qjlkv_config &cfg) {
  if (isa != Isa::Avx512Vnni || cfg.head_dim % 16 != 0) return false;
  if (cfg.value_method == QJLKV_VALUES_ROTATED_LLOYD_MAX) return cfg.value_bits >= 2 && cfg.value_bits <= 4;
  const uint32_t groups = cfg.head_dim / cfg.value_group_size;
  return cfg.value_bits <= 8 && cfg.block_tokens >= 16 && (cfg.value_group_size % 16 == 0 || cfg.value_group_size == 8) && groups <= 16 &&
         (groups & (groups - 1)) == 0;
}
bool integer_attention(Isa isa, const qjlkv_config &cfg) {
  return integer_key_scores(isa, cfg) || integer_value_sums(isa, cfg);
}

// A measured error for the test report (--gtest_output=xml), e.g. "3.1e-05".
std::string scientific(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2g", x);
  return text;
}

// Sets QJLKV_CPU_ISA for one scope.
class ForcedIsa {
 public:
  explicit ForcedIsa(const char *name) { setenv("QJLKV_CPU_ISA", name, 1); }
  ~ForcedIsa() { unsetenv("QJLKV_CPU_ISA"); }
};

template <class T>
T *aligned(std::vector<float> &storage, size_t floats) {
  storage.assign(floats + 16, 0.0f);
  auto address = reinterpret_cast<uintptr_t>(storage.data());
  return reinterpret_cast<T *>(storage.data() + ((64 - address % 64) % 64) / sizeof(float));
}

// ---- ISA selection ------------------------------------------------------------------------------

TEST(IsaSelection, ScalarAlwaysAndBestIsSupported) {
  EXPECT_TRUE(isa_supported(Isa::Scalar));
  EXPECT_TRUE(isa_supported(best_isa()));
  unsetenv("QJLKV_CPU_ISA");
  EXPECT_EQ(select_isa(), best_isa());
}

TEST(IsaSelection, EnvironmentForcesEachSupportedPath) {
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa_name(isa));
    EXPECT_EQ(select_isa(), isa) << isa_name(isa);
    EXPECT_EQ(kernel_table(isa).isa, isa);
  }
}

TEST(IsaSelection, UnknownNameFailsCacheCreationNamingTheVariable) {
  ForcedIsa forced("sse9");
  qjlkv_config cfg{};
  cfg.struct_size = sizeof cfg;
  ASSERT_EQ(qjlkv_config_init(&cfg, "qjl", 1, 2, 1, 64), QJLKV_OK);
  qjlkv_cache *cache = reinterpret_cast<qjlkv_cache *>(&cfg);  // must be reset to NULL
  EXPECT_EQ(qjlkv_cache_create(&cfg, &cache), QJLKV_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(cache, nullptr);
  const std::string message = qjlkv_last_error_message();
  EXPECT_NE(message.find("QJLKV_CPU_ISA"), std::string::npos) << message;
  EXPECT_NE(message.find("sse9"), std::string::npos) << message;
}

TEST(IsaSelection, UnsupportedPathIsRefusedNamingTheVariable) {
  for (Isa isa : {Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni}) {
    if (isa_supported(isa)) continue;
    ForcedIsa forced(isa_name(isa));
    try {
      select_isa();
      ADD_FAILURE() << isa_name(isa) << " is not supported here, yet it was selected";
    } catch (const Error &e) {
      EXPECT_EQ(e.status(), QJLKV_ERROR_UNSUPPORTED);
      EXPECT_NE(std::string(e.what()).find("QJLKV_CPU_ISA"), std::string::npos) << e.what();
    }
    return;
  }
  GTEST_SKIP() << "this CPU supports every path: nothing to refuse";
}

// ---- kernels against the reference --------------------------------------------------------------

struct KernelCase {
  const char *name;
  const char *preset;
  uint32_t head_dim, block_tokens;
  uint32_t key_sketch_dim, outlier_channels, outlier_sketch_dim;
  uint32_t key_bits, value_bits, value_group_size;
  uint32_t rows;
  uint32_t value_method = QJLKV_VALUES_UNIFORM;
  uint32_t key_token_bits = 0;  // mixed-bit keys: 0 for the preset's
};

// Odd sizes on purpose: sketch rows not a multiple of 32, blocks not a multiple of 16, groups
// narrower than a vector, rows beyond a register group, no outlier channels.
const KernelCase kCases[] = {
    {"qjl_llama", "qjl", 128, 32, 256, 8, 64, 2, 2, 32, 4},
    {"qjl_odd", "qjl", 40, 24, 40, 3, 24, 2, 4, 8, 5},
    {"qjl_no_outliers", "qjl", 64, 8, 72, 0, 0, 2, 8, 16, 3},
    {"qjl_wide", "qjl", 256, 16, 520, 12, 136, 2, 2, 64, 9},
    {"qjl_short_blocks", "qjl", 64, 24, 128, 4, 32, 2, 2, 32, 6},
    {"qjl_long_blocks", "qjl", 128, 80, 256, 8, 64, 2, 4, 32, 4},
    {"qjl_m512_rows5", "qjl", 128, 48, 512, 4, 128, 2, 2, 32, 5},
    {"qjl_no_outliers_m128", "qjl", 64, 32, 128, 0, 0, 2, 2, 32, 4},
    {"qjl_outliers12_rows3", "qjl", 128, 40, 256, 12, 128, 2, 2, 32, 3},  // columns in two passes
    {"qjl_m32_outliers100", "qjl", 128, 32, 32, 100, 32, 2, 2, 32, 2},   // the integer scratch at its largest
    {"qjl_preset_rows8", "qjl", 128, 32, 256, 4, 128, 2, 2, 64, 8},
    {"kivi2", "kivi", 128, 128, 256, 8, 64, 2, 2, 32, 4},
    {"kivi4_odd", "kivi", 24, 40, 48, 8, 24, 4, 4, 24, 6},
    {"kivi8", "kivi", 64, 32, 128, 8, 32, 8, 8, 16, 1},
    {"kivi8_wide", "kivi", 256, 16, 512, 8, 128, 8, 8, 64, 4},  // the integer kernels' int32 bound
    {"kivi3", "kivi", 128, 64, 256, 8, 64, 3, 3, 32, 4},
    {"kivi4_llama", "kivi", 128, 128, 256, 8, 64, 4, 4, 32, 4},
    {"kivi2_short_rows", "ott", 64, 40, 128, 8, 32, 2, 2, 32, 2},
    {"kivi3_odd", "kivi", 40, 24, 80, 8, 40, 3, 3, 8, 5},
    {"kivi3_values_wide", "ott", 256, 16, 512, 8, 128, 3, 3, 64, 9},
    // Uniform values on the integer path: groups of 8 (two per 16-channel chunk) and 128,
    // 8-bit codes over more than the 256 tokens between int32 flushes, 4-bit codes in d = 192.
    {"values4_groups8", "kivi", 128, 40, 256, 8, 64, 2, 4, 8, 5},
    {"values3_groups8_d64", "qjl", 64, 24, 128, 4, 32, 2, 3, 8, 4},
    {"values2_groups128", "kivi", 128, 32, 256, 8, 64, 2, 2, 128, 3},
    {"values8_groups64_long", "kivi", 128, 264, 256, 8, 64, 2, 8, 64, 4},
    {"values4_groups64_d192", "qjl", 192, 16, 384, 8, 96, 2, 4, 64, 6},
    // 2-bit codes in 64-channel tiles of one, two or four groups, the rest in 16-channel chunks.
    {"values2_groups16", "kivi", 128, 32, 256, 8, 64, 2, 2, 16, 4},
    // One group per token in blocks of 40: the weights' last 16 products half past the block.
    {"values2_groups128_block40", "kivi", 128, 40, 256, 8, 64, 2, 2, 128, 3},
    {"values2_d96", "kivi", 96, 40, 192, 8, 48, 2, 2, 32, 5},
    {"rotated3", "kivi", 128, 32, 256, 8, 64, 3, 3, 32, 4, QJLKV_VALUES_ROTATED_LLOYD_MAX},
    {"q3_llama", "q3", 128, 128, 256, 8, 64, 3, 2, 32, 4, QJLKV_VALUES_ROTATED_LLOYD_MAX},
    {"q4_smollm", "q4", 64, 128, 128, 8, 32, 4, 3, 32, 3, QJLKV_VALUES_ROTATED_LLOYD_MAX},
    {"rotated2_wide_odd_block", "kivi", 256, 24, 512, 8, 128, 2, 2, 32, 6, QJLKV_VALUES_ROTATED_LLOYD_MAX},
    {"rotated4_d192", "kivi", 192, 40, 384, 8, 96, 4, 4, 32, 5, QJLKV_VALUES_ROTATED_LLOYD_MAX},
    {"rotated2_odd", "exact", 40, 24, 80, 8, 40, 2, 2, 8, 5, QJLKV_VALUES_ROTATED_LLOYD_MAX},
    {"rotated4_blocks", "qjl", 96, 16, 192, 4, 96, 2, 4, 32, 3, QJLKV_VALUES_ROTATED_LLOYD_MAX},
    // 2-bit Lloyd-Max values in 64-channel tiles, the rest in 16-channel chunks of either half.
    {"rotated2_d96", "kivi", 96, 40, 192, 8, 48, 2, 2, 32, 5, QJLKV_VALUES_ROTATED_LLOYD_MAX},
    {"rotated2_d160", "kivi", 160, 24, 320, 8, 80, 2, 2, 32, 3, QJLKV_VALUES_ROTATED_LLOYD_MAX},
    // Mixed-bit keys: the preset's shape; d = 64, 256, and 72 and 96 (not multiples of 64, 72 not
    // of 16); head_dim 8 and 16 (the smallest the avx512vnni rows take); rows of 1024 bits (every
    // channel 4 bits: a zero-range channel gets bits) and of one byte (most channels 0 bits, the
    // row loads start before the row). SetUp adds a constant channel, two channels of the same
    // range and one of a tiny range.
    {"mixed_q2_llama", "q2", 128, 128, 256, 8, 64, 2, 2, 32, 4, QJLKV_VALUES_ROTATED_LLOYD_MAX},
    {"mixed_d64", "q2", 64, 64, 128, 8, 32, 2, 2, 32, 3, QJLKV_VALUES_ROTATED_LLOYD_MAX},
    {"mixed_d256_rows5", "q2", 256, 32, 512, 8, 128, 2, 4, 64, 5},
    {"mixed_d72_rows6", "q2", 72, 24, 144, 8, 40, 2, 2, 8, 6},
    {"mixed_d96_rows9", "q2", 96, 40, 192, 8, 48, 2, 3, 32, 9, QJLKV_VALUES_ROTATED_LLOYD_MAX},
    {"mixed_d8", "q2", 8, 16, 16, 8, 8, 2, 2, 8, 2},
    {"mixed_d16", "q2", 16, 8, 32, 8, 16, 2, 2, 16, 3},
    {"mixed_all_4bit_d256", "q2", 256, 16, 512, 8, 128, 2, 2, 32, 2, QJLKV_VALUES_UNIFORM, 1024},
    {"mixed_one_byte_d64", "q2", 64, 24, 128, 8, 32, 2, 2, 32, 4, QJLKV_VALUES_UNIFORM, 8},
    {"exact16", "exact", 128, 32, 256, 8, 64, 2, 16, 32, 4},
    {"exact_odd", "exact", 72, 8, 144, 8, 40, 2, 16, 8, 7},
};

void PrintTo(const KernelCase &k, std::ostream *os) { *os << k.name; }

class Kernels : public testing::TestWithParam<KernelCase> {
 protected:
  void SetUp() override {
    const KernelCase &k = GetParam();
    cfg_.struct_size = sizeof cfg_;
    ASSERT_EQ(qjlkv_config_init(&cfg_, k.preset, 1, k.rows, 1, k.head_dim), QJLKV_OK);
    cfg_.block_tokens = k.block_tokens;
    cfg_.key_sketch_dim = k.key_sketch_dim;
    cfg_.outlier_channels = k.outlier_channels;
    cfg_.outlier_sketch_dim = k.outlier_sketch_dim;
    cfg_.key_bits = k.key_bits;
    cfg_.value_bits = k.value_bits;
    cfg_.value_group_size = k.value_group_size;
    cfg_.value_method = k.value_method;
    if (k.key_token_bits) cfg_.key_token_bits = k.key_token_bits;
    cfg_.dtype = QJLKV_DTYPE_F16;
    spec_ = make_cache_spec(cfg_);
    const LayerSpec &ls = spec_.layers[0];
    const uint32_t B = k.block_tokens, d = k.head_dim;
    std::mt19937 rng(5);
    std::normal_distribution<float> normal;
    keys_.resize(size_t(B) * d);
    values_.resize(size_t(B) * d);
    for (size_t i = 0; i < keys_.size(); ++i) {
      keys_[i] = normal(rng) * ((i % d) % 11 == 3 ? 9.0f : 1.0f);
      values_[i] = normal(rng);
    }
    // Edge cases the quantizers must treat like the reference: a constant group; a group whose
    // minimum is zero with both signs present (the first smallest counts); a key channel whose
    // minimum over the block is such a zero; exact ties between levels; a token of zeros.
    const uint32_t g = k.value_group_size;
    for (uint32_t j = 0; j < g; ++j) values_[j] = 0.75f;
    for (uint32_t j = 0; j < g; ++j) values_[d + j] = std::fabs(values_[d + j]);
    values_[d] = -0.0f;
    values_[d + g - 1] = 0.0f;
    values_[2 * d + 1] = 1.5f;
    values_[2 * d + 2] = -1.5f;
    std::fill_n(&values_[3 * size_t(d)], d, 0.0f);  // a zero token: rotated values keep codes 0, scale 0
    for (uint32_t t = 0; t < B; ++t) keys_[size_t(t) * d + 1] = std::fabs(keys_[size_t(t) * d + 1]);
    keys_[2 * size_t(d) + 1] = -0.0f;
    keys_[5 * size_t(d) + 1] = 0.0f;
    if (cfg_.key_method == QJLKV_KEYS_MIXED && d >= 8)
      for (uint32_t t = 0; t < B; ++t) {  // a constant channel, two of one range, one of a tiny range
        float *key = &keys_[size_t(t) * d];
        key[2] = 0.3f;
        key[5] = key[4];
        key[6] *= 1e-3f;
      }
    block_.assign(ls.layout.stride, 0);
    std::vector<float> scratch(qjl_quantize_scratch_floats(d, ls.m_out));
    switch (cfg_.key_method) {
      case QJLKV_KEYS_QJL:
        qjl_quantize_block(ls, cfg_, spec_.qjl_constant, keys_.data(), block_.data(), scratch.data());
        break;
      case QJLKV_KEYS_EXACT:
        exact_keys_store_block(cfg_, spec_.stored_dtype, ls.layout, keys_.data(), block_.data());
        break;
      case QJLKV_KEYS_MIXED: MixedKeys::quantize_block(cfg_, ls.layout, keys_.data(), block_.data()); break;
      default: kivi_quantize_block(cfg_, ls.layout, keys_.data(), block_.data()); break;
    }
    values_quantize_block(cfg_, spec_.stored_dtype, ls.layout, ls.value_signs.data(), values_.data(), block_.data());
    queries_.resize(size_t(k.rows) * d);
    for (float &x : queries_) x = normal(rng);
    // Fast-path arguments, as the backend builds them.
    if (cfg_.key_method == QJLKV_KEYS_QJL) qjl_ = make_qjl_args(spec_, ls, qjl_tables_);
    keys_args_ = CodesArgs{&ls.layout, B, d, cfg_.key_bits, 0, spec_.stored_dtype};
    values_args_ = CodesArgs{&ls.layout,         B,
                             d,                  cfg_.value_bits,
                             cfg_.value_group_size, spec_.stored_dtype,
                             ls.value_signs.data()};
  }

  // The value method's kernels on path K.
  const ValueKernels &value_kernels(const KernelTable &K) const {
    return with_value_method(cfg_.value_method,
                             [&](auto value_method) -> const ValueKernels & { return kernels_of(value_method).entries(K); });
  }

  // Queries in the fast layout: rows of padded_dim(d), zero-padded.
  std::vector<float> padded_queries() const {
    const uint32_t d = GetParam().head_dim, dp = padded_dim(d);
    std::vector<float> q(size_t(GetParam().rows) * dp, 0.0f);
    for (uint32_t r = 0; r < GetParam().rows; ++r) std::copy_n(&queries_[size_t(r) * d], d, &q[size_t(r) * dp]);
    return q;
  }

  // The block's scores on path K: out[r * padded_tokens(B) + t]. QJL: checks the projected
  // queries against sq_ref ([rows][sketch_rows]) first.
  float *path_scores(const KernelTable &K, std::vector<float> &out_storage, const std::vector<float> &sq_ref) const {
    const KernelCase &k = GetParam();
    const LayerSpec &ls = spec_.layers[0];
    const uint32_t B = k.block_tokens, d = k.head_dim, Bp = padded_tokens(B), rows = k.rows;
    const std::vector<float> q = padded_queries();
    std::vector<float> scratch_storage, sq_storage;
    float *out = aligned<float>(out_storage, size_t(rows) * Bp);
    float *scratch = aligned<float>(scratch_storage, kernel_scratch_floats(cfg_, ls.m, ls.m_out));
    switch (cfg_.key_method) {
      case QJLKV_KEYS_QJL: {
        QjlTables tables;  // the path's own column codes, as the backend builds them for it
        const QjlArgs qjl = make_qjl_args(spec_, ls, tables);
        float *sq = aligned<float>(sq_storage, rows * qjl.projected_stride);
        K.qjl.project(qjl, q.data(), rows, sq);
        for (uint32_t r = 0; r < rows; ++r)
          for (uint32_t i = 0; i < ls.sketch_rows; ++i) {
            EXPECT_NEAR(sq[r * qjl.projected_stride + i], sq_ref[size_t(r) * ls.sketch_rows + i], 1e-4f)
                << isa_name(K.isa) << " projection row " << r << " sketch row " << i;
            if (testing::Test::HasFailure()) return out;
          }
        K.qjl.scores(qjl, block_.data(), q.data(), sq, rows, out, Bp, scratch);
        break;
      }
      case QJLKV_KEYS_EXACT:
        K.dense.scores(block_.data() + ls.layout.key_codes, spec_.stored_dtype, d, B, d, q.data(), rows, out, Bp);
        break;
      case QJLKV_KEYS_MIXED: K.mixed.scores(keys_args_, block_.data(), q.data(), rows, out, Bp, scratch); break;
      default: K.kivi.scores(keys_args_, block_.data(), q.data(), rows, out, Bp, scratch); break;
    }
    return out;
  }

  // Attention weights in [0, 1) for rows × B, one of them 0 (the reference skips zero weights;
  // the fast paths add 0·v).
  std::vector<float> random_weights() const {
    std::mt19937 rng(9);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    std::vector<float> w(size_t(GetParam().rows) * GetParam().block_tokens);
    for (float &x : w) x = uniform(rng);
    w[0] = 0.0f;
    return w;
  }

  // acc[r * padded_dim(d) + j] = initial + Σ_t w[r][t]·v̂_t[j] on path K.
  float *path_value_sums(const KernelTable &K, const std::vector<float> &w, float initial,
                         std::vector<float> &acc_storage) const {
    const KernelCase &k = GetParam();
    const LayerSpec &ls = spec_.layers[0];
    const uint32_t B = k.block_tokens, d = k.head_dim, dp = padded_dim(d), Bp = padded_tokens(B), rows = k.rows;
    std::vector<float> w_storage, scratch_storage;
    float *wp = aligned<float>(w_storage, size_t(rows) * Bp);
    for (uint32_t r = 0; r < rows; ++r) std::copy_n(&w[size_t(r) * B], B, wp + size_t(r) * Bp);
    float *acc = aligned<float>(acc_storage, size_t(rows) * dp);
    for (uint32_t r = 0; r < rows; ++r) std::fill_n(acc + size_t(r) * dp, d, initial);
    float *scratch = aligned<float>(scratch_storage, kernel_scratch_floats(cfg_, ls.m, ls.m_out));
    value_kernels(K).accumulate(values_args_, block_.data(), wp, Bp, rows, acc, scratch);
    value_kernels(K).in_channel_order(values_args_, rows, acc);
    return acc;
  }

  friend std::vector<double> value_sums_errors(const Kernels &, const qjlkv_config &, const CacheSpec &,
                                               const std::vector<uint8_t> &, float);

  // Per supported ISA: rms over the block's (row, token) pairs of (score − fp64 q·k̂) / (‖q‖·‖k‖).
  std::vector<double> score_errors() const {
    const KernelCase &k = GetParam();
    const LayerSpec &ls = spec_.layers[0];
    const uint32_t B = k.block_tokens, d = k.head_dim, Bp = padded_tokens(B), rows = k.rows;
    std::vector<double> reference(size_t(rows) * B), key_norm(B), query_norm(rows);
    std::vector<float> k_hat(d);
    for (uint32_t t = 0; t < B; ++t) {
      switch (cfg_.key_method) {
        case QJLKV_KEYS_QJL: QjlKeys::dequantize_token(spec_, ls, block_.data(), t, k_hat.data()); break;
        case QJLKV_KEYS_EXACT:
          for (uint32_t j = 0; j < d; ++j)
            k_hat[j] = load_element(block_.data() + ls.layout.key_codes, size_t(t) * d + j, spec_.stored_dtype);
          break;
        case QJLKV_KEYS_MIXED: MixedKeys::dequantize_token(spec_, ls, block_.data(), t, k_hat.data()); break;
        default: KiviKeys::dequantize_token(spec_, ls, block_.data(), t, k_hat.data()); break;
      }
      double norm = 0.0;
      for (uint32_t j = 0; j < d; ++j) norm += double(keys_[size_t(t) * d + j]) * keys_[size_t(t) * d + j];
      key_norm[t] = std::sqrt(norm);
      for (uint32_t r = 0; r < rows; ++r) {
        double dot = 0.0;
        for (uint32_t j = 0; j < d; ++j) dot += double(queries_[size_t(r) * d + j]) * k_hat[j];
        reference[size_t(r) * B + t] = dot;
      }
    }
    for (uint32_t r = 0; r < rows; ++r) {
      double norm = 0.0;
      for (uint32_t j = 0; j < d; ++j) norm += double(queries_[size_t(r) * d + j]) * queries_[size_t(r) * d + j];
      query_norm[r] = std::sqrt(norm);
    }
    std::vector<float> sq_ref(size_t(rows) * std::max(1u, ls.sketch_rows));
    if (cfg_.key_method == QJLKV_KEYS_QJL)
      for (uint32_t r = 0; r < rows; ++r) qjl_project_query(ls, d, &queries_[size_t(r) * d], &sq_ref[size_t(r) * ls.sketch_rows]);
    std::vector<double> errors;
    for (Isa isa : supported_isas()) {
      std::vector<float> out_storage;
      const float *out = path_scores(kernel_table(isa), out_storage, sq_ref);
      if (HasFailure()) return errors;
      double squares = 0.0;
      for (uint32_t r = 0; r < rows; ++r)
        for (uint32_t t = 0; t < B; ++t) {
          const double e = (out[size_t(r) * Bp + t] - reference[size_t(r) * B + t]) / (query_norm[r] * key_norm[t]);
          squares += e * e;
        }
      errors.push_back(std::sqrt(squares / (double(rows) * B)));
    }
    return errors;
  }

  qjlkv_config cfg_{};
  CacheSpec spec_;
  std::vector<float> keys_, values_, queries_;
  std::vector<uint8_t> block_;
  QjlTables qjl_tables_;
  QjlArgs qjl_;
  CodesArgs keys_args_, values_args_;
};

TEST_P(Kernels, ScoresMatchReference) {
  const KernelCase &k = GetParam();
  const LayerSpec &ls = spec_.layers[0];
  const uint32_t B = k.block_tokens, d = k.head_dim, Bp = padded_tokens(B), rows = k.rows;
  // Reference scores and a scale for the tolerance: the largest |partial sum| involved.
  std::vector<float> want(size_t(rows) * B), ref_scratch(d);
  std::vector<float> sq_ref(size_t(rows) * std::max(1u, ls.sketch_rows));
  double scale = 0.0;
  switch (cfg_.key_method) {
    case QJLKV_KEYS_QJL:
      for (uint32_t r = 0; r < rows; ++r) qjl_project_query(ls, d, &queries_[size_t(r) * d], &sq_ref[size_t(r) * ls.sketch_rows]);
      qjl_score_block(ls, cfg_, spec_.qjl_constant, block_.data(), queries_.data(), sq_ref.data(), rows, want.data());
      for (float x : sq_ref) scale += std::fabs(x);
      scale *= 64.0 * spec_.qjl_constant / ls.m;  // norms here are O(10)
      break;
    case QJLKV_KEYS_EXACT:
      exact_keys_score_block(cfg_, spec_.stored_dtype, ls.layout, block_.data(), queries_.data(), rows, want.data(),
                             ref_scratch.data());
      for (float x : queries_) scale += std::fabs(x) * 30.0;
      break;
    case QJLKV_KEYS_MIXED:
      MixedKeys::score_block(cfg_, ls.layout, block_.data(), queries_.data(), d, rows, want.data(), B,
                             ref_scratch.data());
      for (float x : queries_) scale += std::fabs(x) * 30.0;
      break;
    default:
      kivi_score_block(cfg_, ls.layout, block_.data(), queries_.data(), rows, want.data(), ref_scratch.data());
      for (float x : queries_) scale += std::fabs(x) * 30.0;
      break;
  }
  for (Isa isa : supported_isas()) {
    std::vector<float> out_storage;
    float *out = path_scores(kernel_table(isa), out_storage, sq_ref);
    if (HasFailure()) return;
    if (integer_key_scores(isa, cfg_)) continue;
    for (uint32_t r = 0; r < rows; ++r)
      for (uint32_t t = 0; t < B; ++t)
        ASSERT_NEAR(out[size_t(r) * Bp + t], want[size_t(r) * B + t], 2e-6 * scale + 1e-6)
            << isa_name(isa) << " row " << r << " token " << t;
  }
}

// SPEC §9's score budget on every path: rms over the block's (row, token) pairs of
// (score − fp64 reference) / (‖q‖·‖k‖) at most 1e-3, the reference being q·k̂ in double over the
// stored key k̂ (KIVI codes dequantized, 16-bit keys, QJL's estimate as a dense k̂) and k the key
// appended. Float paths sit near 1e-7; the integer ones must stay under the bound too.
TEST_P(Kernels, ScoresWithinErrorBudget) {
  const std::vector<Isa> isas = supported_isas();
  const std::vector<double> errors = score_errors();
  for (size_t i = 0; i < errors.size(); ++i) {
    EXPECT_LE(errors[i], 1e-3) << isa_name(isas[i]) << ": score rms error / (‖q‖·‖k‖)";
    RecordProperty(std::string("score_rms_") + isa_name(isas[i]), scientific(errors[i]));
  }
}

// The same for queries of magnitude 1e-36: the integer kernels' factor code_max / max|x| would
// overflow fp32 there (code_scale, simd.hpp).
TEST_P(Kernels, TinyQueriesScoresWithinErrorBudget) {
  for (float &x : queries_) x *= 1e-36f;
  const std::vector<Isa> isas = supported_isas();
  const std::vector<double> errors = score_errors();
  for (size_t i = 0; i < errors.size(); ++i)
    EXPECT_LE(errors[i], 1e-3) << isa_name(isas[i]) << ": score rms error / (‖q‖·‖k‖)";
}

TEST_P(Kernels, ValueSumsMatchReference) {
  const KernelCase &k = GetParam();
  const LayerSpec &ls = spec_.layers[0];
  const uint32_t B = k.block_tokens, d = k.head_dim, dp = padded_dim(d), rows = k.rows;
  const std::vector<float> w = random_weights();
  std::vector<float> want(size_t(rows) * d, 0.25f);
  values_accumulate_block(cfg_, spec_.stored_dtype, ls.layout, block_.data(), w.data(), rows, want.data());
  for (Isa isa : supported_isas()) {
    if (integer_value_sums(isa, cfg_)) continue;
    std::vector<float> acc_storage;
    const float *acc = path_value_sums(kernel_table(isa), w, 0.25f, acc_storage);
    for (uint32_t r = 0; r < rows; ++r)
      for (uint32_t j = 0; j < d; ++j)
        ASSERT_NEAR(acc[size_t(r) * dp + j], want[size_t(r) * d + j], 1e-5 * (1.0 + std::fabs(want[size_t(r) * d + j])) * B)
            << isa_name(isa) << " row " << r << " channel " << j;
  }
}

// SPEC §9's output budget at the kernel: rms(Σ_t w_t·v̂_t − the fp64 sum) / rms(the fp64 sum) at
// most 1e-3 on every path, with random weights in [0, 1) times weight_scale and v̂ the stored
// values. Returns the errors per path.
std::vector<double> value_sums_errors(const Kernels &f, const qjlkv_config &cfg, const CacheSpec &spec,
                                      const std::vector<uint8_t> &block, float weight_scale);

TEST_P(Kernels, ValueSumsWithinErrorBudget) {
  const std::vector<Isa> isas = supported_isas();
  const std::vector<double> errors = value_sums_errors(*this, cfg_, spec_, block_, 1.0f);
  for (size_t i = 0; i < isas.size(); ++i) {
    EXPECT_LE(errors[i], 1e-3) << isa_name(isas[i]) << ": value sums rms error / rms sum";
    RecordProperty(std::string("values_rms_") + isa_name(isas[i]), scientific(errors[i]));
  }
}

// Weights of 1e-36 and less (a block far below the row's maximum): the uniform integer kernel's
// factor 32767 / (max w · max scale) would overflow fp32; such rows keep the budget all the same.
TEST_P(Kernels, TinyWeightsValueSumsWithinErrorBudget) {
  const std::vector<Isa> isas = supported_isas();
  const std::vector<double> errors = value_sums_errors(*this, cfg_, spec_, block_, 1e-36f);
  for (size_t i = 0; i < isas.size(); ++i)
    EXPECT_LE(errors[i], 1e-3) << isa_name(isas[i]) << ": value sums rms error / rms sum";
}

// want[r·d + j] = Σ_t w[r·B + t]·v̂_t[j] in fp64 over the block's stored values.
std::vector<double> reference_value_sums(const qjlkv_config &cfg, const CacheSpec &spec, const std::vector<uint8_t> &block,
                                         const std::vector<float> &w, const KernelCase &k) {
  const uint32_t B = k.block_tokens, d = k.head_dim;
  std::vector<double> want(size_t(k.rows) * d, 0.0);
  std::vector<float> v(d);
  for (uint32_t t = 0; t < B; ++t) {
    values_decode_token(cfg, spec.stored_dtype, spec.layers[0].layout, block.data(), t, v.data());
    for (uint32_t r = 0; r < k.rows; ++r)
      for (uint32_t j = 0; j < d; ++j) want[size_t(r) * d + j] += double(w[size_t(r) * B + t]) * v[j];
  }
  return want;
}

// Uniform values whose first group is 1000 times larger than the others (an outlier group):
// every group keeps the output budget on its own channels, not only the row as a whole. (The
// integer kernel's P step was one per row, set by the large group: the others had about 33
// levels of P and errors of 1.6-1.9 % of their sums.)
// The cases with uniform value codes and at least two groups per token.
class GroupedValueKernels : public Kernels {};
std::vector<KernelCase> grouped_value_cases() {
  std::vector<KernelCase> cases;
  for (const KernelCase &k : kCases)
    if (k.value_method == QJLKV_VALUES_UNIFORM && k.value_bits != 16 && k.head_dim / k.value_group_size >= 2)
      cases.push_back(k);
  return cases;
}

TEST_P(GroupedValueKernels, ValueSumsWithinErrorBudgetPerGroup) {
  const KernelCase &k = GetParam();
  const uint32_t B = k.block_tokens, d = k.head_dim, dp = padded_dim(d), rows = k.rows, g = k.value_group_size;
  const LayerSpec &ls = spec_.layers[0];
  std::vector<float> values = values_;
  for (uint32_t t = 0; t < B; ++t)
    for (uint32_t j = 0; j < g; ++j) values[size_t(t) * d + j] *= 1000.0f;
  values_quantize_block(cfg_, spec_.stored_dtype, ls.layout, ls.value_signs.data(), values.data(), block_.data());
  const std::vector<float> w = random_weights();
  const std::vector<double> want = reference_value_sums(cfg_, spec_, block_, w, k);
  for (Isa isa : supported_isas()) {
    std::vector<float> acc_storage;
    const float *acc = path_value_sums(kernel_table(isa), w, 0.0f, acc_storage);
    double worst = 0.0;
    for (uint32_t first = 0; first < d; first += g) {
      double error = 0.0, size = 0.0;
      for (uint32_t r = 0; r < rows; ++r)
        for (uint32_t j = first; j < first + g; ++j) {
          const double e = acc[size_t(r) * dp + j] - want[size_t(r) * d + j];
          error += e * e;
          size += want[size_t(r) * d + j] * want[size_t(r) * d + j];
        }
      const double relative = std::sqrt(error / size);
      worst = std::max(worst, relative);
      EXPECT_LE(relative, 1e-3) << isa_name(isa) << " group " << first / g << ": rms error / rms sum of its channels";
    }
    RecordProperty(std::string("group_values_rms_") + isa_name(isa), scientific(worst));
  }
}

std::vector<double> value_sums_errors(const Kernels &f, const qjlkv_config &cfg, const CacheSpec &spec,
                                      const std::vector<uint8_t> &block, float weight_scale) {
  const KernelCase &k = f.GetParam();
  const uint32_t d = k.head_dim, dp = padded_dim(d), rows = k.rows;
  std::vector<float> w = f.random_weights();
  for (float &x : w) x *= weight_scale;
  const std::vector<double> want = reference_value_sums(cfg, spec, block, w, k);
  std::vector<double> errors;
  for (Isa isa : supported_isas()) {
    std::vector<float> acc_storage;
    const float *acc = f.path_value_sums(kernel_table(isa), w, 0.0f, acc_storage);
    double error = 0.0, size = 0.0;
    for (uint32_t r = 0; r < rows; ++r)
      for (uint32_t j = 0; j < d; ++j) {
        const double e = acc[size_t(r) * dp + j] - want[size_t(r) * d + j];
        error += e * e;
        size += want[size_t(r) * d + j] * want[size_t(r) * d + j];
      }
    errors.push_back(std::sqrt(error / size));
  }
  return errors;
}

TEST_P(Kernels, QuantizersMatchReferenceByteForByte) {
  const KernelCase &k = GetParam();
  const LayerSpec &ls = spec_.layers[0];
  const uint32_t B = k.block_tokens, d = k.head_dim;
  for (Isa isa : supported_isas()) {
    const KernelTable &K = kernel_table(isa);
    std::vector<uint8_t> got(ls.layout.stride, 0);
    switch (cfg_.key_method) {
      case QJLKV_KEYS_QJL: {
        // The sign bits by the blocked product: inlier keys with the outlier channels zeroed,
        // outlier keys over the block's channels, as the backend's quantizer feeds them.
        const uint32_t c = ls.m_out ? cfg_.outlier_channels : 0;
        const uint8_t *outliers = block_.data() + ls.layout.key_outlier_idx;
        std::vector<float> inlier = keys_, outlier(size_t(B) * std::max(c, 1u));
        for (uint32_t t = 0; t < B; ++t)
          for (uint32_t i = 0; i < c; ++i) {
            outlier[size_t(t) * c + i] = keys_[size_t(t) * d + outliers[i]];
            inlier[size_t(t) * d + outliers[i]] = 0.0f;
          }
        std::vector<const float *> columns(d);
        for (uint32_t j = 0; j < d; ++j) columns[j] = qjl_.sketch_t + j * qjl_.sketch_t_stride;
        K.qjl.sign_bits(inlier.data(), d, B, columns.data(), d, ls.m, got.data() + ls.layout.key_bits_in,
                        ls.layout.key_bytes_per_token_bits_in);
        EXPECT_EQ(0, std::memcmp(got.data() + ls.layout.key_bits_in, block_.data() + ls.layout.key_bits_in,
                                 size_t(B) * ls.layout.key_bytes_per_token_bits_in))
            << isa_name(isa) << ": inlier sign bits differ from the reference";
        // The backend's whole quantizer (its sign bits by K, the corrections' column sums by
        // nibble tables) against the reference's block: norms, corrections, bits and channels.
        LayerKernels args;
        MethodKernels<QjlKeys>::prepare(spec_, ls, K, args);
        std::vector<float> scratch(MethodKernels<QjlKeys>::quantize_scratch_floats(cfg_));
        std::vector<uint8_t> fast(ls.layout.stride, 0);
        MethodKernels<QjlKeys>::quantize(CpuLayer{K, spec_, ls, args}, keys_.data(), fast.data(), scratch.data());
        EXPECT_EQ(0, std::memcmp(fast.data(), block_.data(), ls.layout.key_bytes))
            << isa_name(isa) << ": the QJL quantizer's key bytes differ from the reference"
            << (c && std::memcmp(fast.data() + ls.layout.key_corrections, block_.data() + ls.layout.key_corrections,
                                 2 * size_t(c) * B)
                    ? " (in the outlier corrections)"
                    : "");
        break;
      }
      case QJLKV_KEYS_EXACT:
        K.store_16bit(keys_.data(), size_t(B) * d, spec_.stored_dtype,
                      reinterpret_cast<uint16_t *>(got.data() + ls.layout.key_codes));
        EXPECT_EQ(0, std::memcmp(got.data(), block_.data(), ls.layout.key_bytes)) << isa_name(isa);
        break;
      case QJLKV_KEYS_MIXED:
        K.mixed.quantize(keys_args_, keys_.data(), got.data());
        EXPECT_EQ(0, std::memcmp(got.data(), block_.data(), ls.layout.key_bytes)) << isa_name(isa) << ": mixed keys";
        break;
      default:
        K.kivi.quantize(keys_args_, keys_.data(), got.data());
        EXPECT_EQ(0, std::memcmp(got.data(), block_.data(), ls.layout.key_bytes)) << isa_name(isa) << ": key codes";
        break;
    }
    value_kernels(K).quantize(values_args_, values_.data(), got.data());
    const size_t value_start = cfg_.value_bits == 16 ? ls.layout.value_codes : ls.layout.value_scale;
    const size_t value_end = ls.layout.value_codes + size_t(B) * ls.layout.value_bytes_per_token_codes;
    EXPECT_EQ(0, std::memcmp(got.data() + value_start, block_.data() + value_start, value_end - value_start))
        << isa_name(isa) << ": value scales, minima or codes differ from the reference";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Kernels, testing::ValuesIn(kCases),
                         [](const testing::TestParamInfo<KernelCase> &info) { return std::string(info.param.name); });
INSTANTIATE_TEST_SUITE_P(Cases, GroupedValueKernels, testing::ValuesIn(grouped_value_cases()),
                         [](const testing::TestParamInfo<KernelCase> &info) { return std::string(info.param.name); });

TEST(KernelsSoftmax, FoldMatchesReference) {
  const uint32_t rows = 3, d = 40, dp = padded_dim(d), n = 37, stride = padded_tokens(n);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> scores(size_t(rows) * n), acc(size_t(rows) * d);
  for (float &x : scores) x = 4.0f * normal(rng);
  for (uint32_t t = 0; t < n; t += 5) scores[t] = kNegInf;  // masked entries
  for (uint32_t t = 0; t < n; ++t) scores[2 * n + t] = kNegInf;  // a fully masked row
  for (float &x : acc) x = normal(rng);
  const float scale = 0.3f;
  // Reference: scaled scores folded into a state that has already seen a block (max 1.0).
  std::vector<SoftmaxRow> want_state(rows, SoftmaxRow{1.0f, 2.0f});
  std::vector<float> want_w = scores, want_acc = acc;
  for (float &x : want_w) x *= scale;
  for (uint32_t r = 0; r < rows; ++r) softmax_fold(want_state[r], &want_w[size_t(r) * n], n, &want_acc[size_t(r) * d], d);
  for (Isa isa : supported_isas()) {
    std::vector<float> w_storage, acc_storage;
    float *w = aligned<float>(w_storage, size_t(rows) * stride);
    float *a = aligned<float>(acc_storage, size_t(rows) * dp);
    for (uint32_t r = 0; r < rows; ++r) {
      std::copy_n(&scores[size_t(r) * n], n, w + size_t(r) * stride);
      std::copy_n(&acc[size_t(r) * d], d, a + size_t(r) * dp);
    }
    std::vector<SoftmaxRow> state(rows, SoftmaxRow{1.0f, 2.0f});
    EXPECT_TRUE(kernel_table(isa).softmax_fold(state.data(), w, stride, rows, n, scale, a, d));
    for (uint32_t r = 0; r < rows; ++r) {
      EXPECT_EQ(state[r].max, want_state[r].max) << isa_name(isa);
      EXPECT_NEAR(state[r].sum, want_state[r].sum, 2e-6 * want_state[r].sum) << isa_name(isa);
      for (uint32_t t = 0; t < n; ++t)
        ASSERT_NEAR(w[size_t(r) * stride + t], want_w[size_t(r) * n + t], 2e-7 + 2e-6 * want_w[size_t(r) * n + t])
            << isa_name(isa) << " row " << r << " token " << t;
      for (uint32_t j = 0; j < d; ++j)
        ASSERT_NEAR(a[size_t(r) * dp + j], want_acc[size_t(r) * d + j], 1e-6 * (1 + std::fabs(want_acc[size_t(r) * d + j])))
            << isa_name(isa);
    }
  }
}

TEST(KernelsRotation, InverseMatchesReference) {
  std::mt19937 rng(23);
  std::normal_distribution<float> normal;
  // Powers of two below, at and above every vector width, and sums of unequal blocks.
  for (uint32_t d : {1u, 2u, 8u, 16u, 24u, 40u, 64u, 72u, 96u, 128u, 200u, 256u}) {
    std::vector<float> signs(d), y(d), want(d);
    for (float &s : signs) s = rng() % 2 ? 1.0f : -1.0f;
    for (float &v : y) v = normal(rng);
    rotate_inverse(signs.data(), d, y.data(), want.data());
    for (Isa isa : supported_isas()) {
      std::vector<float> x = y;
      kernel_table(isa).rotate_inverse(signs.data(), d, x.data());
      for (uint32_t j = 0; j < d; ++j)
        ASSERT_NEAR(x[j], want[j], 2e-6f * (1.0f + std::fabs(want[j]))) << isa_name(isa) << " d " << d << " channel " << j;
    }
  }
}

TEST(KernelsConversions, LoadsChecksAndRoundingMatchReference) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal;
  const size_t n = 203;  // not a multiple of any vector width
  std::vector<float> x(n);
  for (float &v : x) v = normal(rng) * 300.0f;
  x[3] = 6.0e-8f;         // fp16 subnormal
  x[4] = 65519.0f;        // rounds to 65504 in fp16
  x[5] = 1.0f + 0.00048828125f;  // an fp16 tie: rounds to even
  x[6] = -0.0f;
  for (qjlkv_dtype stored : {QJLKV_DTYPE_F16, QJLKV_DTYPE_BF16}) {
    std::vector<uint16_t> want(n), halves(n);
    for (size_t i = 0; i < n; ++i) want[i] = to_16bit(x[i], stored);
    for (Isa isa : supported_isas()) {
      const KernelTable &K = kernel_table(isa);
      std::fill(halves.begin(), halves.end(), uint16_t(0xffff));
      K.store_16bit(x.data(), n, stored, halves.data());
      EXPECT_EQ(halves, want) << isa_name(isa) << (stored == QJLKV_DTYPE_BF16 ? " bf16" : " fp16");
      std::vector<float> back(n);
      K.load_floats(want.data(), stored, 0, n, back.data());
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(back[i], from_16bit(want[i], stored)) << isa_name(isa) << " " << i;
      const float squares = K.sum_squares(want.data(), stored, 5, 150);
      double expected = 0.0;
      for (size_t i = 5; i < 155; ++i) expected += double(from_16bit(want[i], stored)) * from_16bit(want[i], stored);
      EXPECT_NEAR(squares, expected, 1e-5 * expected) << isa_name(isa);
    }
  }
  // first_invalid: the first non-finite or out-of-range element wherever it sits.
  for (size_t bad : {size_t(0), size_t(15), size_t(16), size_t(100), size_t(202)}) {
    for (float poison : {std::nanf(""), INFINITY, -INFINITY, 70000.0f}) {
      std::vector<float> y(n, 1.0f);
      y[bad] = poison;
      for (Isa isa : supported_isas()) {
        EXPECT_EQ(kernel_table(isa).first_invalid(y.data(), QJLKV_DTYPE_F32, n, kHalfMax), bad)
            << isa_name(isa) << " poison " << poison << " at " << bad;
        const bool finite_ok = std::isfinite(poison);
        EXPECT_EQ(kernel_table(isa).first_invalid(y.data(), QJLKV_DTYPE_F32, n, 3.0e38f), finite_ok ? n : bad)
            << isa_name(isa);
      }
    }
  }
}

// ---- the cache through the C API on each path ----------------------------------------------------

struct CacheCase {
  const char *preset;
  qjlkv_dtype dtype;
  uint32_t q_heads, kv_heads, head_dim;
};

const CacheCase kCacheCases[] = {
    {"qjl", QJLKV_DTYPE_F16, 8, 2, 128},  {"qjl", QJLKV_DTYPE_F32, 6, 3, 40},
    {"kivi", QJLKV_DTYPE_BF16, 4, 1, 64}, {"ott", QJLKV_DTYPE_F16, 6, 2, 64},
    {"exact", QJLKV_DTYPE_F16, 4, 2, 72}, {"exact", QJLKV_DTYPE_BF16, 3, 3, 32},
    {"q3", QJLKV_DTYPE_F16, 8, 2, 128},   {"q4", QJLKV_DTYPE_F32, 6, 2, 64},
    {"q2", QJLKV_DTYPE_F16, 8, 2, 128},   {"q2", QJLKV_DTYPE_F32, 6, 3, 64},
    {"q2", QJLKV_DTYPE_BF16, 4, 1, 72},
};

void PrintTo(const CacheCase &c, std::ostream *os) {
  *os << c.preset << " dtype " << int(c.dtype) << " Hq " << c.q_heads << " Hkv " << c.kv_heads << " d " << c.head_dim;
}

std::vector<uint8_t> encode(const std::vector<float> &x, qjlkv_dtype dtype) {
  std::vector<uint8_t> out(x.size() * dtype_size(dtype));
  for (size_t i = 0; i < x.size(); ++i) {
    if (dtype == QJLKV_DTYPE_F32) std::memcpy(&out[4 * i], &x[i], 4);
    const uint16_t h = dtype == QJLKV_DTYPE_F16 ? float_to_half(x[i]) : float_to_bf16(x[i]);
    if (dtype != QJLKV_DTYPE_F32) std::memcpy(&out[2 * i], &h, 2);
  }
  return out;
}

float decode(const std::vector<uint8_t> &bytes, size_t i, qjlkv_dtype dtype) { return load_element(bytes.data(), i, dtype); }

// One cache filled with the same tokens (several sequences, uneven append sizes) on a path.
struct Filled {
  qjlkv_cache *cache = nullptr;
  qjlkv_config cfg{};
  ~Filled() { qjlkv_cache_destroy(cache); }
};

constexpr uint32_t kLongSeq = 4700;  // several attend tasks per head (2048 tokens each)

// `variant`, when given, is layer 0's attention variant, set before any token.
void fill(Filled &f, const CacheCase &c, const char *isa, uint32_t threads,
          const qjlkv_layer_attention *variant = nullptr) {
  ForcedIsa forced(isa);
  f.cfg.struct_size = sizeof f.cfg;
  ASSERT_EQ(qjlkv_config_init(&f.cfg, c.preset, 2, c.q_heads, c.kv_heads, c.head_dim), QJLKV_OK);
  f.cfg.dtype = c.dtype;
  f.cfg.num_threads = threads;
  ASSERT_EQ(qjlkv_cache_create(&f.cfg, &f.cache), QJLKV_OK) << qjlkv_last_error_message();
  if (variant) ASSERT_EQ(qjlkv_cache_set_layer_attention(f.cache, 0, variant), QJLKV_OK) << qjlkv_last_error_message();
  std::mt19937 rng(21);
  std::normal_distribution<float> normal;
  const size_t token = size_t(c.kv_heads) * c.head_dim;
  for (uint32_t seq : {3u, 7u}) {
    const uint32_t length = seq == 3 ? kLongSeq : 301;
    for (uint32_t done = 0; done < length;) {
      const uint32_t n = std::min(length - done, 1u + uint32_t(rng() % 700));
      std::vector<float> k(n * token), v(n * token);
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = normal(rng) * ((i % c.head_dim) == 7 ? 15.0f : 1.0f) * (rng() % 97 == 0 ? 20.0f : 1.0f);
        v[i] = normal(rng);
      }
      for (uint32_t layer = 0; layer < 2; ++layer)
        ASSERT_EQ(qjlkv_cache_append(f.cache, layer, seq, n, encode(k, c.dtype).data(), encode(v, c.dtype).data()),
                  QJLKV_OK)
            << qjlkv_last_error_message();
      done += n;
    }
  }
}

std::vector<float> random_queries(const CacheCase &c, uint32_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> q(size_t(n) * c.q_heads * c.head_dim);
  for (float &x : q) x = normal(rng);
  return q;
}

class CachePaths : public testing::TestWithParam<CacheCase> {};

// rms(got − want) / rms(want) over the elements of two outputs of one dtype.
double relative_rms(const std::vector<uint8_t> &got, const std::vector<uint8_t> &want, qjlkv_dtype dtype) {
  double error = 0.0, size = 0.0;
  for (size_t i = 0; i < want.size() / dtype_size(dtype); ++i) {
    const double w = decode(want, i, dtype), e = decode(got, i, dtype) - w;
    error += e * e;
    size += w * w;
  }
  return std::sqrt(error / size);
}

// Causal attention of nq queries (the sequence's last nq positions) in double: softmax over
// q·k̂ / sqrt(d) times v̂, with k̂, v̂ the cache's own reconstruction of every token.
std::vector<double> reference_attention(const Filled &f, const CacheCase &c, uint32_t layer, uint32_t seq,
                                        const std::vector<uint8_t> &q_bytes, uint32_t nq) {
  const uint32_t d = c.head_dim, G = c.q_heads / c.kv_heads;
  uint64_t length = 0;
  EXPECT_EQ(qjlkv_cache_length(f.cache, layer, seq, &length), QJLKV_OK);
  std::vector<float> keys(length * c.kv_heads * d), values(keys.size());
  EXPECT_EQ(qjlkv_cache_reconstruct(f.cache, layer, seq, 0, length, keys.data(), values.data()), QJLKV_OK)
      << qjlkv_last_error_message();
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> want(size_t(nq) * c.q_heads * d);
  for (uint32_t i = 0; i < nq; ++i)
    for (uint32_t h = 0; h < c.q_heads; ++h) {
      const uint32_t kv = h / G;
      const uint64_t visible = length - nq + i + 1;
      std::vector<double> s(visible);
      double top = -INFINITY;
      for (uint64_t t = 0; t < visible; ++t) {
        double dot = 0.0;
        for (uint32_t j = 0; j < d; ++j)
          dot += double(decode(q_bytes, (size_t(i) * c.q_heads + h) * d + j, c.dtype)) * keys[(t * c.kv_heads + kv) * d + j];
        s[t] = dot * scale;
        top = std::max(top, s[t]);
      }
      double sum = 0.0;
      double *o = &want[(size_t(i) * c.q_heads + h) * d];
      for (uint64_t t = 0; t < visible; ++t) {
        const double p = std::exp(s[t] - top);
        sum += p;
        for (uint32_t j = 0; j < d; ++j) o[j] += p * values[(t * c.kv_heads + kv) * d + j];
      }
      for (uint32_t j = 0; j < d; ++j) o[j] /= sum;
    }
  return want;
}

// Attention (n queries, causal) against a double-precision softmax over the cache's own
// reconstruction k̂, v̂, whose products are the attention's scores: this checks the fast
// kernels, the split of long sequences into tasks and their merge, on every path.
TEST_P(CachePaths, AttentionMatchesSoftmaxOverReconstruction) {
  const CacheCase &c = GetParam();
  const uint32_t layer = 1, seq = 3, nq = 3;
  for (Isa isa : supported_isas()) {
    Filled f;
    fill(f, c, isa_name(isa), 0);
    const std::vector<uint8_t> q_bytes = encode(random_queries(c, nq, 4), c.dtype);
    std::vector<uint8_t> out(q_bytes.size());
    ASSERT_EQ(qjlkv_cache_attend(f.cache, layer, seq, nq, q_bytes.data(), 0.0f, out.data()), QJLKV_OK)
        << qjlkv_last_error_message();
    if (integer_attention(isa, f.cfg)) continue;  // held to the budget: OutputsWithinErrorBudget
    const std::vector<double> want = reference_attention(f, c, layer, seq, q_bytes, nq);
    // Values are O(1): float error is absolute at that scale, plus the output dtype's rounding.
    const double tolerance = c.dtype == QJLKV_DTYPE_F32 ? 2e-5 : c.dtype == QJLKV_DTYPE_F16 ? 2e-3 : 1.6e-2;
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_NEAR(decode(out, i, c.dtype), want[i], tolerance * (0.25 + std::fabs(want[i])))
          << isa_name(isa) << " output element " << i << " (query, head, channel)";
  }
}

// SPEC §9's output budget on every path: rms(output − reference) / rms(reference) at most 1e-3,
// the reference being the double softmax over q·k̂ times v̂ (reference_attention). The output's
// own rounding to its dtype counts against the budget (2^-12 relative for fp16); bf16 outputs,
// whose rounding alone is 2^-9, are held to that rounding plus the budget.
TEST_P(CachePaths, OutputsWithinErrorBudget) {
  const CacheCase &c = GetParam();
  const uint32_t layer = 0, seq = 3, nq = 2;
  const double budget = c.dtype == QJLKV_DTYPE_BF16 ? 1e-3 + 2.3e-3 : 1e-3;
  for (Isa isa : supported_isas()) {
    Filled f;
    fill(f, c, isa_name(isa), 0);
    const std::vector<uint8_t> q_bytes = encode(random_queries(c, nq, 31), c.dtype);
    std::vector<uint8_t> out(q_bytes.size());
    ASSERT_EQ(qjlkv_cache_attend(f.cache, layer, seq, nq, q_bytes.data(), 0.0f, out.data()), QJLKV_OK)
        << qjlkv_last_error_message();
    const std::vector<double> want = reference_attention(f, c, layer, seq, q_bytes, nq);
    double error = 0.0, size = 0.0;
    for (size_t i = 0; i < want.size(); ++i) {
      const double e = decode(out, i, c.dtype) - want[i];
      error += e * e;
      size += want[i] * want[i];
    }
    const double relative = std::sqrt(error / size);
    EXPECT_LE(relative, budget) << isa_name(isa) << ": output rms error / rms output";
    RecordProperty(std::string("output_rms_") + isa_name(isa), scientific(relative));
  }
}

// The attention variants on every path: layer 0 soft-caps its logits, adds a sink logit per
// query head and slides a window of 1,000 positions (so the window has freed most blocks of the
// long sequence). Held to SPEC §9's budget against a double-precision reference over the cache's
// own reconstruction of the positions each query sees.
TEST_P(CachePaths, VariantsWithinErrorBudget) {
  const CacheCase &c = GetParam();
  const uint32_t seq = 3, nq = 3, window = 1000, d = c.head_dim, G = c.q_heads / c.kv_heads;
  const float softcap = 4.0f;
  std::vector<float> sinks(c.q_heads);
  for (uint32_t h = 0; h < c.q_heads; ++h) sinks[h] = -1.0f + 0.5f * float(h % 5);
  qjlkv_layer_attention variant{};
  variant.struct_size = sizeof variant;
  variant.logit_softcap = softcap;
  variant.sink_logits = sinks.data();
  variant.window_tokens = window;
  const double budget = c.dtype == QJLKV_DTYPE_BF16 ? 1e-3 + 2.3e-3 : 1e-3;
  for (Isa isa : supported_isas()) {
    Filled f;
    fill(f, c, isa_name(isa), 0, &variant);
    qjlkv_stats st{};
    st.struct_size = sizeof st;
    ASSERT_EQ(qjlkv_cache_stats(f.cache, &st), QJLKV_OK);
    const std::vector<uint8_t> q_bytes = encode(random_queries(c, nq, 37), c.dtype);
    std::vector<uint8_t> out(q_bytes.size());
    ASSERT_EQ(qjlkv_cache_attend(f.cache, 0, seq, nq, q_bytes.data(), 0.0f, out.data()), QJLKV_OK)
        << qjlkv_last_error_message();
    // The reference: the positions the first query sees, reconstructed; each query its own window.
    const uint64_t length = kLongSeq, first = length - nq + 1 - window;
    std::vector<float> keys((length - first) * c.kv_heads * d), values(keys.size());
    ASSERT_EQ(qjlkv_cache_reconstruct(f.cache, 0, seq, first, length - first, keys.data(), values.data()), QJLKV_OK)
        << qjlkv_last_error_message();
    const double scale = 1.0 / std::sqrt(double(d));
    double error = 0.0, size = 0.0;
    for (uint32_t i = 0; i < nq; ++i)
      for (uint32_t h = 0; h < c.q_heads; ++h) {
        const uint64_t position = length - nq + i, start = position + 1 - window;
        std::vector<double> logits;
        for (uint64_t t = start; t <= position; ++t) {
          double dot = 0.0;
          for (uint32_t j = 0; j < d; ++j)
            dot += double(decode(q_bytes, (size_t(i) * c.q_heads + h) * d + j, c.dtype)) *
                   keys[((t - first) * c.kv_heads + h / G) * d + j];
          logits.push_back(softcap * std::tanh(dot * scale / softcap));
        }
        const double top = std::max(*std::max_element(logits.begin(), logits.end()), double(sinks[h]));
        double sum = std::exp(double(sinks[h]) - top);
        std::vector<double> o(d, 0.0);
        for (uint64_t t = start; t <= position; ++t) {
          const double p = std::exp(logits[t - start] - top);
          sum += p;
          for (uint32_t j = 0; j < d; ++j) o[j] += p * values[((t - first) * c.kv_heads + h / G) * d + j];
        }
        for (uint32_t j = 0; j < d; ++j) {
          const double want = o[j] / sum, e = decode(out, (size_t(i) * c.q_heads + h) * d + j, c.dtype) - want;
          error += e * e;
          size += want * want;
        }
      }
    const double relative = std::sqrt(error / size);
    EXPECT_LE(relative, budget) << isa_name(isa) << ": output rms error / rms output";
    EXPECT_LT(st.tokens, 2 * uint64_t(kLongSeq) + 2 * 301) << isa_name(isa) << ": the window freed nothing";
    RecordProperty(std::string("variant_output_rms_") + isa_name(isa), scientific(relative));
  }
}

// Sign bits and codes are the same on every path: the reconstructions agree exactly.
TEST_P(CachePaths, StoredNumbersIdenticalOnEveryPath) {
  const CacheCase &c = GetParam();
  std::vector<float> first_keys, first_values;
  for (Isa isa : supported_isas()) {
    Filled f;
    fill(f, c, isa_name(isa), 0);
    std::vector<float> keys(size_t(kLongSeq) * c.kv_heads * c.head_dim), values(keys.size());
    ASSERT_EQ(qjlkv_cache_reconstruct(f.cache, 0, 3, 0, kLongSeq, keys.data(), values.data()), QJLKV_OK);
    if (first_keys.empty()) {
      first_keys = keys;
      first_values = values;
      continue;
    }
    EXPECT_EQ(0, std::memcmp(keys.data(), first_keys.data(), keys.size() * sizeof(float))) << isa_name(isa);
    EXPECT_EQ(0, std::memcmp(values.data(), first_values.data(), values.size() * sizeof(float))) << isa_name(isa);
  }
}

// Every path agrees with the scalar one within float tolerance, for attend and attend_batch.
TEST_P(CachePaths, PathsAgreeWithScalar) {
  const CacheCase &c = GetParam();
  const std::vector<uint8_t> q = encode(random_queries(c, 1, 8), c.dtype);
  const std::vector<uint8_t> qb = encode(random_queries(c, 2, 9), c.dtype);
  const uint32_t seqs[2] = {7, 3};
  std::vector<uint8_t> want(q.size()), want_batch(qb.size());
  {
    Filled f;
    fill(f, c, "scalar", 0);
    ASSERT_EQ(qjlkv_cache_attend(f.cache, 0, 3, 1, q.data(), 0.0f, want.data()), QJLKV_OK);
    ASSERT_EQ(qjlkv_cache_attend_batch(f.cache, 0, 2, seqs, qb.data(), 0.0f, want_batch.data()), QJLKV_OK);
  }
  // Values are O(1): the outputs' float error is absolute at that scale, plus the output dtype's rounding.
  const double tolerance = c.dtype == QJLKV_DTYPE_F32 ? 2e-5 : c.dtype == QJLKV_DTYPE_F16 ? 1e-3 : 8e-3;
  for (Isa isa : supported_isas()) {
    Filled f;
    fill(f, c, isa_name(isa), 0);
    std::vector<uint8_t> got(q.size()), got_batch(qb.size());
    ASSERT_EQ(qjlkv_cache_attend(f.cache, 0, 3, 1, q.data(), 0.0f, got.data()), QJLKV_OK);
    ASSERT_EQ(qjlkv_cache_attend_batch(f.cache, 0, 2, seqs, qb.data(), 0.0f, got_batch.data()), QJLKV_OK);
    if (integer_attention(isa, f.cfg)) {
      // Within the budget of both paths (SPEC §9), and the output dtype's rounding.
      const double budget = 2e-3 + (c.dtype == QJLKV_DTYPE_BF16 ? 4.6e-3 : 0.0);
      EXPECT_LE(relative_rms(got, want, c.dtype), budget) << isa_name(isa);
      EXPECT_LE(relative_rms(got_batch, want_batch, c.dtype), budget) << isa_name(isa) << " batch";
      continue;
    }
    for (size_t i = 0; i < q.size() / dtype_size(c.dtype); ++i) {
      const float w = decode(want, i, c.dtype);
      ASSERT_NEAR(decode(got, i, c.dtype), w, tolerance * (0.25 + std::fabs(w))) << isa_name(isa) << " " << i;
    }
    for (size_t i = 0; i < qb.size() / dtype_size(c.dtype); ++i) {
      const float w = decode(want_batch, i, c.dtype);
      ASSERT_NEAR(decode(got_batch, i, c.dtype), w, tolerance * (0.25 + std::fabs(w))) << isa_name(isa) << " batch " << i;
    }
  }
}

// The same output bytes with 1, 2 and 3 worker threads.
TEST_P(CachePaths, ResultsDoNotDependOnThreadCount) {
  const CacheCase &c = GetParam();
  const std::vector<uint8_t> q = encode(random_queries(c, 2, 12), c.dtype);
  const uint32_t seqs[2] = {3, 7};
  const std::vector<uint8_t> qb = encode(random_queries(c, 2, 13), c.dtype);
  std::vector<uint8_t> first, first_batch;
  for (uint32_t threads : {1u, 2u, 3u}) {
    Filled f;
    fill(f, c, isa_name(best_isa()), threads);
    std::vector<uint8_t> out(q.size()), out_batch(qb.size());
    ASSERT_EQ(qjlkv_cache_attend(f.cache, 1, 3, 2, q.data(), 0.0f, out.data()), QJLKV_OK);
    ASSERT_EQ(qjlkv_cache_attend_batch(f.cache, 1, 2, seqs, qb.data(), 0.0f, out_batch.data()), QJLKV_OK);
    if (first.empty()) {
      first = out;
      first_batch = out_batch;
      continue;
    }
    EXPECT_EQ(out, first) << threads << " threads";
    EXPECT_EQ(out_batch, first_batch) << threads << " threads";
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, CachePaths, testing::ValuesIn(kCacheCases),
                         [](const testing::TestParamInfo<CacheCase> &info) {
                           const char *dtype = info.param.dtype == QJLKV_DTYPE_F32   ? "f32"
                                               : info.param.dtype == QJLKV_DTYPE_F16 ? "f16"
                                                                                    : "bf16";
                           return std::string(info.param.preset) + "_" + dtype + "_d" +
                                  std::to_string(info.param.head_dim);
                         });

}  // namespace
