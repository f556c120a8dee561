// Attention variants of a layer (qjlkv_cache_set_layer_attention) on the CUDA backend: soft-capped
// logits, learned sink logits and sliding windows, fused into the attention kernels, against the
// CPU backend given the same appended data and the same variant — decode and causal multi-query
// attends, and attend_batch split over several CTAs or not — within SPEC §9's budget
// (compare_outputs); the
// call's checks and refusals as on the CPU; a variant per layer, reversible, ordered on the
// cache's stream, and left as it was when the sink logits cannot be stored.
//
// Built twice, like test_cuda_backend.cpp (see gpu_test_util.hpp): on a GPU and on the emulator.
#include <initializer_list>
#include <iterator>
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

qjlkv_layer_attention make_attention(float softcap, const float *sinks, uint32_t window = 0) {
  qjlkv_layer_attention a;
  std::memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.logit_softcap = softcap;
  a.sink_logits = sinks;
  a.window_tokens = window;
  return a;
}

// The same variant on both caches.
void set_both(CachePair &pair, uint32_t layer, const qjlkv_layer_attention &a) {
  QJLKV_OK(qjlkv_cache_set_layer_attention(pair.cpu(), layer, &a));
  QJLKV_OK(qjlkv_cache_set_layer_attention(pair.gpu(), layer, &a));
}

// One sink logit per query head, from negligible to dominant.
std::vector<float> sink_logits(uint32_t heads) {
  std::vector<float> sinks(heads);
  for (uint32_t h = 0; h < heads; ++h) sinks[h] = -2.0f + 0.7f * float(h);
  return sinks;
}

struct VariantCase {
  const char *preset;
  qjlkv_dtype dtype;
};

void PrintTo(const VariantCase &c, std::ostream *os) { *os << c.preset << ", " << dtype_name(c.dtype); }

std::vector<VariantCase> variant_cases() {
  std::vector<VariantCase> cases;
  for (const char *preset : {"q2", "q3", "q4", "qjl", "kivi", "ott", "exact"})
    for (qjlkv_dtype dtype : {QJLKV_DTYPE_F32, QJLKV_DTYPE_F16, QJLKV_DTYPE_BF16}) cases.push_back({preset, dtype});
  return cases;
}

// 8 query heads on 2 kv heads (GQA groups of 4), blocks of 32 tokens; the preset's attention
// sinks (positions), four of them; OTT traces every layer.
qjlkv_config variant_config(const char *preset, qjlkv_dtype dtype) {
  qjlkv_config cfg{};
  cfg.struct_size = sizeof cfg;
  EXPECT_EQ(qjlkv_config_init(&cfg, preset, 2, 8, 2, 64), QJLKV_OK);
  cfg.dtype = dtype;
  cfg.seed = 4321;
  cfg.block_tokens = 32;
  cfg.residual_tokens = 8;
  if (cfg.sink_tokens) cfg.sink_tokens = 4;
  if (cfg.key_method == QJLKV_KEYS_OTT) cfg.outlier_skip_layers = 0;
  return cfg;
}

class CudaLayerAttention : public testing::TestWithParam<VariantCase> {};

TEST_P(CudaLayerAttention, SoftcapAndSinksMatchTheCpu) {
  REQUIRE_CUDA_DEVICE();
  const VariantCase c = GetParam();
  CachePair pair(variant_config(c.preset, c.dtype));
  ASSERT_TRUE(pair.ok()) << pair.error();
  const qjlkv_config &cfg = pair.cfg();
  std::mt19937 rng(11);
  const size_t te = pair.token_elems();
  const uint32_t layer = 1, Hkv = cfg.num_kv_heads, d = cfg.head_dim;
  // seq 3: a prefill, then decode steps (blocks, a tail, the sinks); seq 8: a shorter one.
  pair.append(layer, 3, make_keys(rng, 150, Hkv, d), make_values(rng, 150 * te));
  for (int step = 0; step < 10; ++step) pair.append(layer, 3, make_keys(rng, 1, Hkv, d), make_values(rng, te));
  pair.append(layer, 8, make_keys(rng, 70, Hkv, d), make_values(rng, 70 * te));
  const std::vector<float> sinks = sink_logits(cfg.num_q_heads);

  struct Variant {
    float softcap;
    bool sinks;
  };
  for (const Variant v : {Variant{0.0f, true}, Variant{5.0f, false}, Variant{1.5f, true}, Variant{0.0f, false}}) {
    set_both(pair, layer, make_attention(v.softcap, v.sinks ? sinks.data() : nullptr));
    const std::string variant = "softcap " + std::to_string(v.softcap) + (v.sinks ? ", sinks" : "");
    const auto expect_close = [&](const std::vector<float> &gpu, const std::vector<float> &cpu, const std::string &what) {
      const Mismatch m = compare_outputs(gpu, cpu, c.dtype);
      EXPECT_EQ(m.count, 0u) << variant << ", " << what << ": first mismatch at " << m.first << ": gpu "
                             << gpu[m.first] << ", cpu " << cpu[m.first] << " (worst " << m.worst << ", rms "
                             << m.rms_relative << ")";
    };
    // Decode (the default scale) and causal multi-query (the call's own scale, which the cap divides).
    for (const auto &[n_queries, scale] : {std::pair{1u, 0.0f}, std::pair{5u, 0.3f}}) {
      const auto q = make_values(rng, n_queries * pair.query_elems());
      const auto [cpu, gpu] = pair.attend(layer, {3}, n_queries, q, scale, false);
      expect_close(gpu, cpu, "attend, " + std::to_string(n_queries) + " queries");
    }
    // attend_batch: three rows (the positions split over several CTAs each), then eight (one CTA
    // per kv head and row tile: no split to merge but the sink).
    for (const std::vector<uint32_t> &seqs : {std::vector<uint32_t>{8, 3, 8}, std::vector<uint32_t>{3, 8, 3, 8, 8, 3, 3, 8}}) {
      const auto q = make_values(rng, seqs.size() * pair.query_elems());
      const auto [cpu, gpu] = pair.attend(layer, seqs, 1, q, 0.0f, true);
      expect_close(gpu, cpu, "attend_batch of " + std::to_string(seqs.size()));
    }
  }
}

// Keys of `tokens` tokens whose tokens at `loud` have a large norm: OTT keeps them as outlier
// tokens (exact, by their position) instead of in their blocks.
std::vector<float> keys_with_loud_tokens(std::mt19937 &rng, uint32_t tokens, uint32_t heads, uint32_t d,
                                         std::initializer_list<uint32_t> loud) {
  std::vector<float> keys = make_keys(rng, tokens, heads, d);
  for (uint32_t t : loud)
    for (size_t j = size_t(t) * heads * d; j < size_t(t + 1) * heads * d; ++j) keys[j] *= 6.0f;
  return keys;
}

// Sliding windows: seq 3 holds 160 positions (with q2's, q3's and q4's 4 sinks: blocks of 32 at
// 4..131, a tail of 28; loud tokens at 45, 110 and 125 become OTT's outlier tokens), seq 8 holds
// 70, seq 5 holds 20 (no block). Windows of 1, 5, 20 (shorter than a block), 68 and 157 (from
// within the sinks of seq 8 and seq 3), 200 (longer than every sequence); the blocks before the
// first query's window are skipped, and splits that hold only positions before every window (the
// sinks, OTT's outlier tokens) stay empty in the merge.
TEST_P(CudaLayerAttention, WindowsMatchTheCpu) {
  REQUIRE_CUDA_DEVICE();
  const VariantCase c = GetParam();
  const std::vector<float> sinks = sink_logits(8);
  const uint32_t windows[] = {1, 5, 20, 68, 157, 200};
  for (size_t i = 0; i < std::size(windows); ++i) {
    const uint32_t window = windows[i];
    CachePair pair(variant_config(c.preset, c.dtype));
    ASSERT_TRUE(pair.ok()) << pair.error();
    const qjlkv_config &cfg = pair.cfg();
    std::mt19937 rng(17 + uint32_t(i));
    const size_t te = pair.token_elems();
    const uint32_t layer = 1, Hkv = cfg.num_kv_heads, d = cfg.head_dim;
    // Every other window with a soft-cap and sink logits as well: one pass applies all three.
    const bool variant = i % 2 == 1;
    set_both(pair, layer, make_attention(variant ? 1.5f : 0.0f, variant ? sinks.data() : nullptr, window));
    pair.append(layer, 3, keys_with_loud_tokens(rng, 150, Hkv, d, {45, 110, 125}), make_values(rng, 150 * te));
    for (int step = 0; step < 10; ++step) pair.append(layer, 3, make_keys(rng, 1, Hkv, d), make_values(rng, te));
    pair.append(layer, 8, keys_with_loud_tokens(rng, 70, Hkv, d, {10, 60}), make_values(rng, 70 * te));
    pair.append(layer, 5, make_keys(rng, 20, Hkv, d), make_values(rng, 20 * te));
    const auto expect_close = [&](const std::vector<float> &gpu, const std::vector<float> &cpu, const std::string &what) {
      const Mismatch m = compare_outputs(gpu, cpu, c.dtype);
      EXPECT_EQ(m.count, 0u) << "window " << window << ", " << what << ": first mismatch at " << m.first << ": gpu "
                             << gpu[m.first] << ", cpu " << cpu[m.first] << " (worst " << m.worst << ", rms "
                             << m.rms_relative << ")";
    };
    // Decode, and causal multi-query: each query row has its own window.
    for (const auto &[seq, n_queries, scale] :
         {std::tuple{3u, 1u, 0.0f}, std::tuple{3u, 5u, 0.3f}, std::tuple{8u, 7u, 0.0f}, std::tuple{5u, 3u, 0.0f}}) {
      const auto q = make_values(rng, n_queries * pair.query_elems());
      const auto [cpu, gpu] = pair.attend(layer, {seq}, n_queries, q, scale, false);
      expect_close(gpu, cpu, "seq " + std::to_string(seq) + ", " + std::to_string(n_queries) + " queries");
    }
    // attend_batch over sequences of different lengths (each its own window and skipped blocks).
    for (const std::vector<uint32_t> &seqs : {std::vector<uint32_t>{8, 3, 5}, std::vector<uint32_t>{3, 8, 5, 3, 8, 5, 3, 8}}) {
      const auto q = make_values(rng, seqs.size() * pair.query_elems());
      const auto [cpu, gpu] = pair.attend(layer, seqs, 1, q, 0.0f, true);
      expect_close(gpu, cpu, "attend_batch of " + std::to_string(seqs.size()));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, CudaLayerAttention, testing::ValuesIn(variant_cases()),
                         [](const testing::TestParamInfo<VariantCase> &info) {
                           return std::string(info.param.preset) + "_" + dtype_name(info.param.dtype);
                         });

// A long context (many units per split) with both variants at once, then with a window of 1000 as
// well (layer 1): most blocks lie before it, and the splits cover the window alone.
TEST(CudaLayerAttentionRules, LongContextSoftcapSinksAndWindow) {
  REQUIRE_CUDA_DEVICE();
  const uint32_t tokens = kEmulated ? 1100 : 65536, chunk = kEmulated ? 550 : 8192;
  for (const char *preset : {"q3", "kivi"}) {
    SCOPED_TRACE(preset);
    CachePair pair(variant_config(preset, QJLKV_DTYPE_BF16));
    ASSERT_TRUE(pair.ok()) << pair.error();
    std::mt19937 rng(9);
    const size_t te = pair.token_elems();
    // Sink logits about the log of the softmax's sum over the context: they weigh on every output.
    std::vector<float> sinks = sink_logits(8);
    for (float &s : sinks) s += std::log(float(tokens));
    set_both(pair, 1, make_attention(4.0f, sinks.data(), 1000));
    for (uint32_t layer : {0u, 1u})
      for (uint32_t done = 0; done < tokens; done += chunk)
        pair.append(layer, 1, make_keys(rng, chunk, 2, 64), make_values(rng, size_t(chunk) * te));
    set_both(pair, 0, make_attention(4.0f, sinks.data()));
    for (uint32_t layer : {0u, 1u}) {
      const auto [cpu, gpu] = pair.attend(layer, {1}, 1, make_values(rng, pair.query_elems()), 0.0f, false);
      const Mismatch m = compare_outputs(gpu, cpu, QJLKV_DTYPE_BF16);
      EXPECT_EQ(m.count, 0u) << "layer " << layer << ": first mismatch at " << m.first << " (worst " << m.worst
                             << ", rms " << m.rms_relative << ")";
    }
  }
}

// attend on the CUDA cache into a device buffer the caller downloads later.
void enqueue_attend(qjlkv_cache *c, uint32_t layer, uint32_t seq, const DeviceBytes &q, const DeviceBytes &out) {
  EXPECT_EQ(qjlkv_cache_attend(c, layer, seq, 1, q.get(), 0.0f, out.get()), QJLKV_OK) << qjlkv_last_error_message();
}

// The C call's checks are the CPU's (the message names the field), a refused variant changes
// nothing, a variant is per layer and reversible, scores stay raw (a window's too), and a variant
// set between two attends applies to the second alone (stream order).
TEST(CudaLayerAttentionRules, ChecksLayersScoresAndStreamOrder) {
  REQUIRE_CUDA_DEVICE();
  CachePair pair(variant_config("q3", QJLKV_DTYPE_F16));
  ASSERT_TRUE(pair.ok()) << pair.error();
  const qjlkv_dtype dtype = QJLKV_DTYPE_F16;
  std::mt19937 rng(5);
  const size_t te = pair.token_elems();
  // Layer 1 has a window of 16 positions (set while it is empty, kept by every variant it gets).
  const uint32_t window = 16;
  set_both(pair, 1, make_attention(0.0f, nullptr, window));
  for (uint32_t layer : {0u, 1u}) pair.append(layer, 2, make_keys(rng, 120, 2, 64), make_values(rng, 120 * te));
  const auto query = make_values(rng, pair.query_elems());
  const auto encoded = encode(query, dtype);
  const DeviceBytes dq(encoded);
  const auto gpu_output = [&](uint32_t layer) {
    DeviceBytes out(encoded.size());
    enqueue_attend(pair.gpu(), layer, 2, dq, out);
    return decode(out.download(), dtype);
  };
  const std::vector<float> plain0 = gpu_output(0), plain1 = gpu_output(1);

  // Refusals: the same status and message as the CPU's, the layer unchanged.
  const float bad_sinks[8] = {0.0f, 1.0f, 0.0f, NAN, 0.0f, 0.0f, 0.0f, 0.0f};
  struct Bad {
    qjlkv_layer_attention attention;
    uint32_t layer;
    const char *names;
  };
  std::vector<Bad> bad = {{make_attention(1.0f, nullptr), 2, "layer"},
                          {make_attention(-1.0f, nullptr), 0, "logit_softcap"},
                          {make_attention(NAN, nullptr), 0, "logit_softcap"},
                          {make_attention(INFINITY, nullptr), 0, "logit_softcap"},
                          {make_attention(1.0f, bad_sinks), 0, "sink_logits[3]"},
                          {make_attention(1.0f, nullptr), 0, "struct_size"},
                          {make_attention(1.0f, nullptr), 0, "window_tokens"}};  // the layer holds tokens
  bad[5].attention.struct_size = 20;
  bad[6].attention.window_tokens = 32;
  for (const Bad &b : bad) {
    SCOPED_TRACE(b.names);
    EXPECT_EQ(qjlkv_cache_set_layer_attention(pair.cpu(), b.layer, &b.attention), QJLKV_ERROR_INVALID_ARGUMENT);
    const std::string cpu_message = qjlkv_last_error_message();
    EXPECT_EQ(qjlkv_cache_set_layer_attention(pair.gpu(), b.layer, &b.attention), QJLKV_ERROR_INVALID_ARGUMENT);
    const std::string gpu_message = qjlkv_last_error_message();
    EXPECT_EQ(gpu_message, cpu_message);
    EXPECT_NE(gpu_message.find(b.names), std::string::npos) << gpu_message;
  }
  EXPECT_EQ(qjlkv_cache_set_layer_attention(pair.gpu(), 0, nullptr), QJLKV_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(count_bit_differences(gpu_output(0), plain0), 0u) << "a refused variant changed the layer";

  // Per layer: layer 0 changes and matches the CPU, layer 1 does not change.
  const std::vector<float> sinks = sink_logits(8);
  const qjlkv_layer_attention both = make_attention(2.0f, sinks.data());
  set_both(pair, 0, both);
  const auto [cpu0, gpu0] = pair.attend(0, {2}, 1, query, 0.0f, false);
  EXPECT_EQ(compare_outputs(gpu0, cpu0, dtype).count, 0u);
  EXPECT_GT(count_bit_differences(gpu0, plain0), 0u) << "the variant had no effect";
  EXPECT_EQ(count_bit_differences(gpu_output(1), plain1), 0u) << "layer 1 is untouched";

  // scores() returns the raw logits whatever the variant, of every position (those before the
  // window too).
  std::vector<float> raw_plain(8 * 120), raw_variant(8 * 120);
  ASSERT_EQ(qjlkv_cache_scores(pair.gpu(), 1, 2, dq.get(), raw_plain.data(), raw_plain.size()), QJLKV_OK);
  set_both(pair, 1, make_attention(2.0f, sinks.data(), window));
  ASSERT_EQ(qjlkv_cache_scores(pair.gpu(), 1, 2, dq.get(), raw_variant.data(), raw_variant.size()), QJLKV_OK);
  EXPECT_EQ(count_bit_differences(raw_variant, raw_plain), 0u);
  for (size_t i = 0; i < raw_plain.size(); ++i) ASSERT_TRUE(std::isfinite(raw_plain[i])) << "position " << i % 120;

  // Back to the window alone: the same outputs as before, bit for bit.
  set_both(pair, 1, make_attention(0.0f, nullptr, window));
  EXPECT_EQ(count_bit_differences(gpu_output(1), plain1), 0u);

  // Stream order: attend (variant A), set variant B (other sink logits, rewritten in place), attend;
  // only then read both outputs.
  std::vector<float> other_sinks(8);
  for (uint32_t h = 0; h < 8; ++h) other_sinks[h] = 1.5f - 0.5f * float(h);
  const qjlkv_layer_attention a = make_attention(0.0f, sinks.data(), window),
                              b = make_attention(3.0f, other_sinks.data(), window);
  DeviceBytes out_a(encoded.size()), out_b(encoded.size());
  QJLKV_OK(qjlkv_cache_set_layer_attention(pair.gpu(), 1, &a));
  enqueue_attend(pair.gpu(), 1, 2, dq, out_a);
  QJLKV_OK(qjlkv_cache_set_layer_attention(pair.gpu(), 1, &b));
  enqueue_attend(pair.gpu(), 1, 2, dq, out_b);
  std::vector<uint8_t> cpu_out(encoded.size());
  for (const auto &[variant, out] : {std::pair{&a, &out_a}, std::pair{&b, &out_b}}) {
    QJLKV_OK(qjlkv_cache_set_layer_attention(pair.cpu(), 1, variant));
    QJLKV_OK(qjlkv_cache_attend(pair.cpu(), 1, 2, 1, encoded.data(), 0.0f, cpu_out.data()));
    const Mismatch m = compare_outputs(decode(out->download(), dtype), decode(cpu_out, dtype), dtype);
    EXPECT_EQ(m.count, 0u) << (variant == &a ? "the first attend" : "the second attend") << " (worst " << m.worst
                           << ", rms " << m.rms_relative << ")";
  }
}

#if defined(QJLKV_CUDA_EMULATION)
// When the sink logits cannot be stored on the device, the call fails with OUT_OF_MEMORY and the
// layer keeps its variant.
TEST(CudaLayerAttentionRules, FailedAllocationKeepsTheVariant) {
  CachePair pair(variant_config("kivi", QJLKV_DTYPE_F32));
  ASSERT_TRUE(pair.ok()) << pair.error();
  std::mt19937 rng(8);
  const size_t te = pair.token_elems();
  pair.append(0, 1, make_keys(rng, 90, 2, 64), make_values(rng, 90 * te));
  set_both(pair, 0, make_attention(2.0f, nullptr));
  const auto query = make_values(rng, pair.query_elems());
  const auto [cpu, before] = pair.attend(0, {1}, 1, query, 0.0f, false);
  const std::vector<float> sinks = sink_logits(8);
  const qjlkv_layer_attention with_sinks = make_attention(0.0f, sinks.data());
  emu::fail_allocations_after(0);
  const qjlkv_status status = qjlkv_cache_set_layer_attention(pair.gpu(), 0, &with_sinks);
  emu::fail_allocations_after(-1);
  EXPECT_EQ(status, QJLKV_ERROR_OUT_OF_MEMORY) << qjlkv_last_error_message();
  const auto [cpu_again, after] = pair.attend(0, {1}, 1, query, 0.0f, false);
  EXPECT_EQ(count_bit_differences(after, before), 0u) << "a failed call changed the variant";
  EXPECT_EQ(compare_outputs(after, cpu_again, QJLKV_DTYPE_F32).count, 0u);
  // Once memory is there, the same call succeeds.
  set_both(pair, 0, with_sinks);
  const auto [cpu_sinks, gpu_sinks] = pair.attend(0, {1}, 1, query, 0.0f, false);
  EXPECT_EQ(compare_outputs(gpu_sinks, cpu_sinks, QJLKV_DTYPE_F32).count, 0u);
}
#endif

}  // namespace
