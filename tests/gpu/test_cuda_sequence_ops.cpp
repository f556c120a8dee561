// The sequence operations (qjlkv.h, "Sequence operations") on the CUDA backend against the CPU
// backend, which is their reference: random programs of append, append_batch, fork, truncate,
// clear, export and import applied to both caches must store the same bytes (exported streams
// identical), attend alike within the error budget, count the same bytes (stats components, shared
// bytes) and predict their own growth exactly (bytes_needed); rollback within the floor and forks
// equal sequences that never saw the undone tokens; budget refusals change nothing.
//
// Built twice like test_cuda_backend.cpp: on a GPU and on the CPU emulator.
#include <cmath>
#include <functional>
#include <map>
#include <ostream>
#include <string>

#include "gpu_test_util.hpp"

namespace {

using namespace gputest;

constexpr uint32_t kLayers = 2;

struct OpsCase {
  const char *preset;
  qjlkv_dtype dtype;
  const char *variant = "";  // a name for `adjust`
  void (*adjust)(qjlkv_config &) = nullptr;
};
void PrintTo(const OpsCase &c, std::ostream *os) { *os << c.preset << ", " << dtype_name(c.dtype) << " " << c.variant; }
std::string ops_case_name(const testing::TestParamInfo<OpsCase> &info) {
  return std::string(info.param.preset) + "_" + dtype_name(info.param.dtype) + info.param.variant;
}
std::vector<OpsCase> ops_cases() {
  std::vector<OpsCase> cases;
  for (const char *preset : {"q2", "q3", "q4", "qjl", "kivi", "ott", "exact"})
    for (qjlkv_dtype dtype : {QJLKV_DTYPE_F32, QJLKV_DTYPE_F16, QJLKV_DTYPE_BF16}) cases.push_back({preset, dtype});
  // No rollback copies at all (every truncate that reopens a block reconstructs it); sinks longer
  // than a block with a rollback depth that is not a multiple of it.
  cases.push_back({"ott", QJLKV_DTYPE_F32, "_no_rollback", [](qjlkv_config &c) { c.rollback_tokens = 0; }});
  cases.push_back({"q4", QJLKV_DTYPE_BF16, "_sinks20_depth40", [](qjlkv_config &c) {
                     c.sink_tokens = 20;
                     c.rollback_tokens = 40;
                   }});
  return cases;
}

// Small blocks and tails, so that short sequences cross many block boundaries and the rollback
// depth (32) spans several blocks; OTT with a pool and spill area small enough to fill.
qjlkv_config ops_config(const OpsCase &c, uint64_t memory_budget = 0) {
  qjlkv_config cfg{};
  cfg.struct_size = sizeof cfg;
  EXPECT_EQ(qjlkv_config_init(&cfg, c.preset, kLayers, 4, 2, 64), QJLKV_OK);
  cfg.dtype = c.dtype;
  cfg.seed = 77;
  cfg.block_tokens = 16;
  cfg.residual_tokens = 8;
  if (std::string(c.preset) == "q3") cfg.sink_tokens = 5;
  if (std::string(c.preset) == "ott") {
    cfg.outlier_tokens = 4;
    cfg.outlier_spill_tokens = 6;
    cfg.outlier_skip_layers = 1;  // layer 1 traced
  }
  cfg.memory_budget = memory_budget;
  if (c.adjust) c.adjust(cfg);
  return cfg;
}

std::vector<uint8_t> export_seq(qjlkv_cache *c, uint32_t seq) {
  uint64_t size = 0;
  EXPECT_EQ(qjlkv_cache_export_size(c, seq, 0, kLayers, &size), QJLKV_OK) << qjlkv_last_error_message();
  std::vector<uint8_t> stream(size);
  EXPECT_EQ(qjlkv_cache_export(c, seq, 0, kLayers, stream.data(), size), QJLKV_OK) << qjlkv_last_error_message();
  return stream;
}

qjlkv_stats stats_of(qjlkv_cache *c) {
  qjlkv_stats s{};
  s.struct_size = sizeof s;
  EXPECT_EQ(qjlkv_cache_stats(c, &s), QJLKV_OK) << qjlkv_last_error_message();
  return s;
}

uint64_t longest(qjlkv_cache *c, uint32_t seq) {
  uint64_t most = 0;
  for (uint32_t l = 0; l < kLayers; ++l) {
    uint64_t length = 0;
    EXPECT_EQ(qjlkv_cache_length(c, l, seq, &length), QJLKV_OK);
    most = std::max(most, length);
  }
  return most;
}

// n random tokens of keys and values (floats) for a cache of cfg's shape.
struct Tokens {
  std::vector<float> keys, values;
};
Tokens make_tokens(std::mt19937 &rng, const qjlkv_config &cfg, uint32_t n) {
  return {make_keys(rng, n, cfg.num_kv_heads, cfg.head_dim), make_values(rng, size_t(n) * cfg.num_kv_heads * cfg.head_dim)};
}

// Appends n tokens to seq in every layer of one cache (device buffers for the CUDA one).
qjlkv_status append_all_layers(qjlkv_cache *c, bool device, const qjlkv_config &cfg, uint32_t seq, const Tokens &t) {
  const uint32_t n = uint32_t(t.keys.size() / (size_t(cfg.num_kv_heads) * cfg.head_dim));
  const auto k = encode(t.keys, qjlkv_dtype(cfg.dtype)), v = encode(t.values, qjlkv_dtype(cfg.dtype));
  DeviceBytes dk, dv;
  if (device) {
    dk.upload(k);
    dv.upload(v);
  }
  for (uint32_t l = 0; l < kLayers; ++l) {
    const qjlkv_status s = qjlkv_cache_append(c, l, seq, n, device ? dk.get() : k.data(), device ? dv.get() : v.data());
    if (s != QJLKV_OK) return s;
  }
  return QJLKV_OK;
}

// The two caches of a pair hold the same positions and count the same bytes per component.
void expect_same_counts(CachePair &pair) {
  const qjlkv_stats a = stats_of(pair.cpu()), b = stats_of(pair.gpu());
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.bytes_keys_quantized, b.bytes_keys_quantized);
  EXPECT_EQ(a.bytes_values_quantized, b.bytes_values_quantized);
  EXPECT_EQ(a.bytes_full_precision, b.bytes_full_precision);
  EXPECT_EQ(a.bytes_rollback, b.bytes_rollback);
  EXPECT_EQ(a.bytes_shared, b.bytes_shared);
}

// The two caches of a pair agree on everything observable about `seqs`.
void expect_same_state(CachePair &pair, const std::vector<uint32_t> &seqs, std::mt19937 &rng, const char *when) {
  SCOPED_TRACE(when);
  expect_same_counts(pair);
  const qjlkv_stats a = stats_of(pair.cpu()), b = stats_of(pair.gpu());
  EXPECT_GE(b.bytes_reserved, b.bytes_used);
  // Metadata differs by the size of a (layer, sequence) record alone.
  uint64_t records = 0;
  std::map<uint32_t, uint64_t> records_of;
  for (uint32_t seq : seqs)
    for (uint32_t l = 0; l < kLayers; ++l) {
      uint64_t n_cpu = 0, n_gpu = 0;
      ASSERT_EQ(qjlkv_cache_length(pair.cpu(), l, seq, &n_cpu), QJLKV_OK);
      ASSERT_EQ(qjlkv_cache_length(pair.gpu(), l, seq, &n_gpu), QJLKV_OK);
      ASSERT_EQ(n_cpu, n_gpu) << "seq " << seq << ", layer " << l;
      records += n_cpu > 0;
      records_of[seq] += n_cpu > 0;
    }
  const int64_t record_delta = records ? (int64_t(b.bytes_metadata) - int64_t(a.bytes_metadata)) / int64_t(records) : 0;
  EXPECT_EQ(int64_t(b.bytes_metadata) - int64_t(a.bytes_metadata), record_delta * int64_t(records));
  for (uint32_t seq : seqs) {
    uint64_t bytes_cpu = 0, shared_cpu = 0, bytes_gpu = 0, shared_gpu = 0;
    ASSERT_EQ(qjlkv_cache_sequence_bytes(pair.cpu(), seq, &bytes_cpu, &shared_cpu), QJLKV_OK);
    ASSERT_EQ(qjlkv_cache_sequence_bytes(pair.gpu(), seq, &bytes_gpu, &shared_gpu), QJLKV_OK);
    EXPECT_EQ(shared_cpu, shared_gpu) << "seq " << seq;
    EXPECT_EQ(int64_t(bytes_gpu) - int64_t(bytes_cpu), record_delta * int64_t(records_of[seq])) << "seq " << seq;
    if (records_of[seq] == 0) continue;
    EXPECT_EQ(export_seq(pair.cpu(), seq), export_seq(pair.gpu(), seq)) << "seq " << seq << ": the streams differ";
  }
  // Attention over one held (layer, sequence).
  std::vector<std::pair<uint32_t, uint32_t>> held;
  for (uint32_t seq : seqs)
    for (uint32_t l = 0; l < kLayers; ++l) {
      uint64_t n = 0;
      ASSERT_EQ(qjlkv_cache_length(pair.cpu(), l, seq, &n), QJLKV_OK);
      if (n > 0) held.push_back({l, seq});
    }
  if (held.empty()) return;
  const auto [layer, seq] = held[rng() % held.size()];
  const auto [o_cpu, o_gpu] = pair.attend(layer, {seq}, 1, make_values(rng, pair.query_elems()), 0.0f, false);
  const Mismatch m = compare_outputs(o_gpu, o_cpu, qjlkv_dtype(pair.cfg().dtype));
  EXPECT_EQ(m.count, 0u) << "attend, layer " << layer << ", seq " << seq << ": worst " << m.worst << ", rms "
                         << m.rms_relative;
  // attend_batch over every sequence the layer holds (forks reading shared blocks side by side).
  std::vector<uint32_t> batch;
  for (const auto &[l, s] : held)
    if (l == layer) batch.push_back(s);
  const auto [b_cpu, b_gpu] =
      pair.attend(layer, batch, 1, make_values(rng, batch.size() * pair.query_elems()), 0.0f, true);
  const Mismatch mb = compare_outputs(b_gpu, b_cpu, qjlkv_dtype(pair.cfg().dtype));
  EXPECT_EQ(mb.count, 0u) << "attend_batch, layer " << layer << ": worst " << mb.worst << ", rms " << mb.rms_relative;
}

class CudaSequenceOps : public testing::TestWithParam<OpsCase> {};

// Random programs over five sequence ids, both caches compared after every operation.
TEST_P(CudaSequenceOps, RandomProgramsMatchCpu) {
  REQUIRE_CUDA_DEVICE();
  const OpsCase c = GetParam();
  CachePair pair(ops_config(c));
  ASSERT_TRUE(pair.ok()) << pair.error();
  const qjlkv_config &cfg = pair.cfg();
  std::mt19937 rng(uint32_t(std::hash<std::string>{}(ops_case_name(testing::TestParamInfo<OpsCase>(c, 0)))));
  const std::vector<uint32_t> ids = {0, 1, 2, 3, 4};
  const auto pick = [&](bool held) {  // a sequence holding tokens (held) or an empty one; ids.size() if none
    std::vector<uint32_t> found;
    for (uint32_t id : ids)
      if ((longest(pair.cpu(), id) > 0) == held) found.push_back(id);
    return found.empty() ? uint32_t(ids.size()) : found[rng() % found.size()];
  };
  for (int step = 0; step < 60; ++step) {
    std::string what;
    switch (rng() % 8) {
      case 0:
      case 1:
      case 2: {  // append n tokens to every layer; bytes_needed predicted the growth
        const uint32_t seq = ids[rng() % ids.size()], n = rng() % 3 ? 1 + rng() % 40 : 1;
        what = "append " + std::to_string(n) + " to seq " + std::to_string(seq);
        const Tokens t = make_tokens(rng, cfg, n);
        for (bool device : {false, true}) {
          qjlkv_cache *cache = device ? pair.gpu() : pair.cpu();
          uint64_t needed = 0;
          ASSERT_EQ(qjlkv_cache_bytes_needed(cache, seq, n, &needed), QJLKV_OK);
          const uint64_t before = stats_of(cache).bytes_used;
          ASSERT_EQ(append_all_layers(cache, device, cfg, seq, t), QJLKV_OK) << qjlkv_last_error_message();
          // An append that frees more rollback copies than it adds bytes shrinks bytes_used: 0 needed.
          const int64_t growth = int64_t(stats_of(cache).bytes_used - before);
          EXPECT_EQ(needed, uint64_t(std::max<int64_t>(growth, 0))) << what << (device ? " (CUDA)" : " (CPU)");
        }
        break;
      }
      case 3: {  // one token to each of up to three sequences of one layer
        const uint32_t layer = rng() % kLayers, count = 1 + rng() % 3;
        std::vector<uint32_t> seqs;
        for (uint32_t id : ids)
          if (seqs.size() < count && rng() % 2) seqs.push_back(id);
        if (seqs.empty()) seqs.push_back(ids[0]);
        what = "append_batch of " + std::to_string(seqs.size()) + " in layer " + std::to_string(layer);
        const Tokens t = make_tokens(rng, cfg, uint32_t(seqs.size()));
        pair.append_batch(layer, seqs, t.keys, t.values);
        break;
      }
      case 4: {  // fork a prefix into an empty sequence
        const uint32_t src = pick(true), dst = pick(false);
        if (src == ids.size() || dst == ids.size()) continue;
        const uint64_t length = 1 + rng() % longest(pair.cpu(), src);
        what = "fork " + std::to_string(src) + " -> " + std::to_string(dst) + " at " + std::to_string(length);
        QJLKV_OK(qjlkv_cache_fork(pair.cpu(), src, dst, length));
        QJLKV_OK(qjlkv_cache_fork(pair.gpu(), src, dst, length));
        break;
      }
      case 5: {  // truncate: mostly within the rollback depth, sometimes deeper
        const uint32_t seq = pick(true);
        if (seq == ids.size()) continue;
        const uint64_t most = longest(pair.cpu(), seq);
        const uint64_t depth = rng() % 3 ? rng() % (std::min<uint64_t>(most, cfg.rollback_tokens) + 1) : rng() % (most + 1);
        what = "truncate seq " + std::to_string(seq) + " to " + std::to_string(most - depth);
        QJLKV_OK(qjlkv_cache_truncate(pair.cpu(), seq, most - depth));
        QJLKV_OK(qjlkv_cache_truncate(pair.gpu(), seq, most - depth));
        break;
      }
      case 6: {
        const uint32_t seq = pick(true);
        if (seq == ids.size()) continue;
        what = "clear seq " + std::to_string(seq);
        QJLKV_OK(qjlkv_cache_clear_sequence(pair.cpu(), seq));
        QJLKV_OK(qjlkv_cache_clear_sequence(pair.gpu(), seq));
        break;
      }
      default: {  // export from each backend, import into the other
        const uint32_t src = pick(true), dst = pick(false);
        if (src == ids.size() || dst == ids.size()) continue;
        what = "export " + std::to_string(src) + ", import as " + std::to_string(dst);
        const auto from_cpu = export_seq(pair.cpu(), src), from_gpu = export_seq(pair.gpu(), src);
        ASSERT_EQ(from_cpu, from_gpu);
        QJLKV_OK(qjlkv_cache_import(pair.gpu(), dst, from_cpu.data(), from_cpu.size()));
        QJLKV_OK(qjlkv_cache_import(pair.cpu(), dst, from_gpu.data(), from_gpu.size()));
        break;
      }
    }
    expect_same_state(pair, ids, rng, what.c_str());
    if (HasFailure()) {
      ADD_FAILURE() << "stopped after step " << step << ": " << what;
      return;
    }
  }
}

// Speculative decoding: k draft tokens appended and truncated away leave the stream of a sequence
// that never saw them, across block boundaries and OTT tracing, and later appends continue it as
// they continue a sequence fed the same tokens directly.
TEST_P(CudaSequenceOps, RollbackWithinTheFloorIsExact) {
  REQUIRE_CUDA_DEVICE();
  const OpsCase c = GetParam();
  CachePair pair(ops_config(c));
  ASSERT_TRUE(pair.ok()) << pair.error();
  const qjlkv_config &cfg = pair.cfg();
  if (cfg.rollback_tokens == 0) GTEST_SKIP() << "rollback_tokens 0: a truncate that reopens a block is not exact";
  std::mt19937 rng(7);
  const Tokens prefix = make_tokens(rng, cfg, 70);
  const size_t te = size_t(cfg.num_kv_heads) * cfg.head_dim;
  uint32_t accepted = 0;
  for (uint32_t step = 0; step < 4; ++step) {
    // Accept a few prefix tokens, then try a draft of k tokens and reject it.
    const uint32_t take = step == 0 ? 29 : 1 + rng() % 13;
    const Tokens accepted_tokens{{prefix.keys.begin() + accepted * te, prefix.keys.begin() + (accepted + take) * te},
                                 {prefix.values.begin() + accepted * te, prefix.values.begin() + (accepted + take) * te}};
    accepted += take;
    for (bool device : {false, true}) {
      qjlkv_cache *cache = device ? pair.gpu() : pair.cpu();
      ASSERT_EQ(append_all_layers(cache, device, cfg, 1, accepted_tokens), QJLKV_OK) << qjlkv_last_error_message();
    }
    const auto before_cpu = export_seq(pair.cpu(), 1), before_gpu = export_seq(pair.gpu(), 1);
    ASSERT_EQ(before_cpu, before_gpu);
    const qjlkv_stats stats_before = stats_of(pair.gpu());
    for (uint32_t k : {1u, cfg.block_tokens, cfg.rollback_tokens}) {
      SCOPED_TRACE("draft of " + std::to_string(k) + " after " + std::to_string(accepted));
      const Tokens draft = make_tokens(rng, cfg, k);
      for (bool device : {false, true}) {
        qjlkv_cache *cache = device ? pair.gpu() : pair.cpu();
        ASSERT_EQ(append_all_layers(cache, device, cfg, 1, draft), QJLKV_OK) << qjlkv_last_error_message();
        QJLKV_OK(qjlkv_cache_truncate(cache, 1, accepted));
      }
      EXPECT_EQ(export_seq(pair.gpu(), 1), before_gpu) << "the rejected draft left a trace";
      EXPECT_EQ(export_seq(pair.cpu(), 1), before_cpu);
      EXPECT_EQ(stats_of(pair.gpu()).bytes_full_precision, stats_before.bytes_full_precision);
    }
  }
  // The continuation, on seq 1 and on seq 2 fed everything at once.
  const Tokens rest{{prefix.keys.begin() + accepted * te, prefix.keys.end()},
                    {prefix.values.begin() + accepted * te, prefix.values.end()}};
  for (bool device : {false, true}) {
    qjlkv_cache *cache = device ? pair.gpu() : pair.cpu();
    ASSERT_EQ(append_all_layers(cache, device, cfg, 1, rest), QJLKV_OK) << qjlkv_last_error_message();
    ASSERT_EQ(append_all_layers(cache, device, cfg, 2, prefix), QJLKV_OK) << qjlkv_last_error_message();
  }
  EXPECT_EQ(export_seq(pair.gpu(), 1), export_seq(pair.gpu(), 2));
  std::mt19937 compare_rng(3);
  expect_same_state(pair, {1, 2}, compare_rng, "after the continuation");
}

// fork(L) and appends equal a fresh sequence fed the same tokens; fork(p) equals fork(L) +
// truncate(p); the source does not change.
TEST_P(CudaSequenceOps, ForksShareBlocksAndEqualFreshSequences) {
  REQUIRE_CUDA_DEVICE();
  const OpsCase c = GetParam();
  CachePair pair(ops_config(c));
  ASSERT_TRUE(pair.ok()) << pair.error();
  const qjlkv_config &cfg = pair.cfg();
  std::mt19937 rng(11);
  const uint32_t L = 90, p = 41;
  const Tokens prompt = make_tokens(rng, cfg, L), continuation = make_tokens(rng, cfg, 37);
  Tokens whole = prompt;
  whole.keys.insert(whole.keys.end(), continuation.keys.begin(), continuation.keys.end());
  whole.values.insert(whole.values.end(), continuation.values.begin(), continuation.values.end());
  for (bool device : {false, true}) {
    qjlkv_cache *cache = device ? pair.gpu() : pair.cpu();
    ASSERT_EQ(append_all_layers(cache, device, cfg, 1, prompt), QJLKV_OK) << qjlkv_last_error_message();
  }
  const auto source = export_seq(pair.gpu(), 1);
  for (bool device : {false, true}) {
    qjlkv_cache *cache = device ? pair.gpu() : pair.cpu();
    const qjlkv_stats before = stats_of(cache);
    QJLKV_OK(qjlkv_cache_fork(cache, 1, 2, L));
    // No compressed byte is copied: the fork adds its own exact rows alone.
    const qjlkv_stats after = stats_of(cache);
    EXPECT_GT(after.bytes_shared, 0u);
    EXPECT_EQ(after.bytes_keys_quantized, before.bytes_keys_quantized);
    EXPECT_EQ(after.bytes_rollback, before.bytes_rollback);
    uint64_t bytes = 0, shared = 0;
    QJLKV_OK(qjlkv_cache_sequence_bytes(cache, 2, &bytes, &shared));
    EXPECT_EQ(after.bytes_used - before.bytes_used, bytes - shared);
    ASSERT_EQ(append_all_layers(cache, device, cfg, 2, continuation), QJLKV_OK) << qjlkv_last_error_message();
    ASSERT_EQ(append_all_layers(cache, device, cfg, 3, whole), QJLKV_OK) << qjlkv_last_error_message();
    QJLKV_OK(qjlkv_cache_fork(cache, 1, 4, p));
    QJLKV_OK(qjlkv_cache_fork(cache, 1, 5, L));
    QJLKV_OK(qjlkv_cache_truncate(cache, 5, p));
  }
  EXPECT_EQ(export_seq(pair.gpu(), 2), export_seq(pair.gpu(), 3)) << "fork + appends differ from a fresh sequence";
  EXPECT_EQ(export_seq(pair.gpu(), 4), export_seq(pair.gpu(), 5)) << "fork(p) differs from fork(L) + truncate(p)";
  EXPECT_EQ(export_seq(pair.gpu(), 1), source) << "the forks changed their source";
  std::mt19937 compare_rng(5);
  expect_same_state(pair, {1, 2, 3, 4, 5}, compare_rng, "after the forks");
  // Clearing the source leaves the forks whole.
  QJLKV_OK(qjlkv_cache_clear_sequence(pair.cpu(), 1));
  QJLKV_OK(qjlkv_cache_clear_sequence(pair.gpu(), 1));
  expect_same_state(pair, {1, 2, 3, 4, 5}, compare_rng, "after clearing the source");
}

// Sliding windows free the blocks they leave behind (qjlkv.h, "Attention variants of a layer"):
// the CUDA backend frees and counts what the CPU backend does, its streams (format version 5)
// are the same, and its attends over what is left match the CPU's.
TEST_P(CudaSequenceOps, WindowFreesTheBlocksTheCpuFrees) {
  CachePair pair(ops_config(GetParam()));
  if (!pair.ok()) GTEST_SKIP() << pair.error();
  const qjlkv_config &cfg = pair.cfg();
  constexpr uint32_t kWindow = 40;
  qjlkv_layer_attention window{};
  window.struct_size = sizeof window;
  window.window_tokens = kWindow;
  for (uint32_t l = 0; l < kLayers; ++l)
    for (qjlkv_cache *c : {pair.cpu(), pair.gpu()})
      ASSERT_EQ(qjlkv_cache_set_layer_attention(c, l, &window), QJLKV_OK) << qjlkv_last_error_message();
  std::mt19937 rng(5);
  const auto expect_same_storage = [&](const std::vector<uint32_t> &seqs, const std::string &when) {
    SCOPED_TRACE(when);
    expect_same_counts(pair);
    for (uint32_t seq : seqs) {
      EXPECT_EQ(export_seq(pair.cpu(), seq), export_seq(pair.gpu(), seq)) << "seq " << seq;
      uint64_t need_cpu = 0, need_gpu = 0;
      ASSERT_EQ(qjlkv_cache_bytes_needed(pair.cpu(), seq, 1, &need_cpu), QJLKV_OK);
      ASSERT_EQ(qjlkv_cache_bytes_needed(pair.gpu(), seq, 1, &need_gpu), QJLKV_OK);
      EXPECT_EQ(need_cpu, need_gpu) << "seq " << seq;
      for (uint32_t l = 0; l < kLayers; ++l) {
        const auto [o_cpu, o_gpu] = pair.attend(l, {seq}, 1, make_values(rng, pair.query_elems()), 0.0f, false);
        const Mismatch m = compare_outputs(o_gpu, o_cpu, qjlkv_dtype(cfg.dtype));
        EXPECT_EQ(m.count, 0u) << "attend, layer " << l << ", seq " << seq << ": worst " << m.worst;
      }
    }
    const auto [b_cpu, b_gpu] =
        pair.attend(0, seqs, 1, make_values(rng, seqs.size() * pair.query_elems()), 0.0f, true);
    const Mismatch mb = compare_outputs(b_gpu, b_cpu, qjlkv_dtype(cfg.dtype));
    EXPECT_EQ(mb.count, 0u) << "attend_batch: worst " << mb.worst;
  };
  const auto append_both = [&](uint32_t seq, uint32_t n) {
    const Tokens t = make_tokens(rng, cfg, n);
    uint64_t needed = 0;
    ASSERT_EQ(qjlkv_cache_bytes_needed(pair.gpu(), seq, n, &needed), QJLKV_OK);
    const uint64_t used = stats_of(pair.gpu()).bytes_used;
    ASSERT_EQ(append_all_layers(pair.cpu(), false, cfg, seq, t), QJLKV_OK) << qjlkv_last_error_message();
    ASSERT_EQ(append_all_layers(pair.gpu(), true, cfg, seq, t), QJLKV_OK) << qjlkv_last_error_message();
    const uint64_t now = stats_of(pair.gpu()).bytes_used;
    EXPECT_EQ(needed, now > used ? now - used : 0) << "bytes_needed of " << n << " tokens";
  };
  for (uint32_t i = 0; i < 10; ++i) append_both(0, 30);
  for (uint32_t i = 0; i < 120; ++i) append_both(0, 1);
  expect_same_storage({0}, "after 420 tokens");
  const uint64_t length = longest(pair.cpu(), 0);
  EXPECT_LT(stats_of(pair.gpu()).tokens, 2 * length / 3) << "nothing freed";

  // A fork shares the freed state; the source frees blocks the fork still holds.
  ASSERT_EQ(qjlkv_cache_fork(pair.cpu(), 0, 1, length), QJLKV_OK);
  ASSERT_EQ(qjlkv_cache_fork(pair.gpu(), 0, 1, length), QJLKV_OK);
  for (uint32_t i = 0; i < 60; ++i) append_both(0, 1);
  expect_same_storage({0, 1}, "after a fork");

  // Scores: -INFINITY at the freed positions, as on the CPU; freed positions refused.
  const auto [scores_cpu, scores_gpu] = pair.scores(0, 1, make_values(rng, pair.query_elems()));
  ASSERT_EQ(scores_cpu.size(), scores_gpu.size());
  for (size_t i = 0; i < scores_cpu.size(); ++i)
    EXPECT_EQ(scores_cpu[i] == -INFINITY, scores_gpu[i] == -INFINITY) << "score " << i;
  std::vector<float> keys(pair.token_elems());
  EXPECT_EQ(qjlkv_cache_reconstruct(pair.gpu(), 0, 1, cfg.sink_tokens, 1, keys.data(), nullptr),
            QJLKV_ERROR_INVALID_ARGUMENT);

  // A truncate to the floor, then a clear of the fork.
  for (qjlkv_cache *c : {pair.cpu(), pair.gpu()}) {
    ASSERT_EQ(qjlkv_cache_truncate(c, 0, longest(c, 0) - cfg.rollback_tokens), QJLKV_OK) << qjlkv_last_error_message();
    ASSERT_EQ(qjlkv_cache_clear_sequence(c, 1), QJLKV_OK);
  }
  expect_same_storage({0}, "after a truncate and a clear");

  // The CPU cache's stream (version 5) imports into the CUDA cache and exports as it came.
  const std::vector<uint8_t> stream = export_seq(pair.cpu(), 0);
  ASSERT_EQ(qjlkv_cache_import(pair.gpu(), 7, stream.data(), stream.size()), QJLKV_OK) << qjlkv_last_error_message();
  EXPECT_EQ(export_seq(pair.gpu(), 7), stream);
  ASSERT_EQ(qjlkv_cache_import(pair.cpu(), 7, stream.data(), stream.size()), QJLKV_OK);
  for (uint32_t i = 0; i < 40; ++i) append_both(7, 1);
  expect_same_storage({0, 7}, "after an import");
  for (qjlkv_cache *c : {pair.cpu(), pair.gpu()})
    for (uint32_t seq : {0u, 7u}) ASSERT_EQ(qjlkv_cache_clear_sequence(c, seq), QJLKV_OK);
  EXPECT_EQ(stats_of(pair.gpu()).bytes_used, 0u);
}

INSTANTIATE_TEST_SUITE_P(Presets, CudaSequenceOps, testing::ValuesIn(ops_cases()), ops_case_name);

// A budget refusal (append, append_batch, fork, import) changes nothing; what bytes_needed predicts
// fits exactly.
TEST(CudaSequenceBudget, RefusalsChangeNothing) {
  REQUIRE_CUDA_DEVICE();
  const OpsCase c{"q3", QJLKV_DTYPE_F16};
  qjlkv_config cfg = ops_config(c);
  std::mt19937 rng(13);
  // Measure the bytes of a 60-token sequence, then allow one such sequence and a little more.
  uint64_t budget = 0;
  {
    CachePair probe(cfg);
    ASSERT_TRUE(probe.ok()) << probe.error();
    ASSERT_EQ(append_all_layers(probe.gpu(), true, cfg, 1, make_tokens(rng, cfg, 60)), QJLKV_OK);
    budget = stats_of(probe.gpu()).bytes_used + 4096;
  }
  cfg.memory_budget = budget;
  cfg.backend = QJLKV_BACKEND_CUDA;
  qjlkv_cache *gpu = nullptr;
  QJLKV_OK(qjlkv_cache_create(&cfg, &gpu));
  ASSERT_EQ(append_all_layers(gpu, true, cfg, 1, make_tokens(rng, cfg, 60)), QJLKV_OK) << qjlkv_last_error_message();
  const auto stream = export_seq(gpu, 1);
  const uint64_t used = stats_of(gpu).bytes_used;
  // Appends up to the budget succeed, with the growth predicted; the first beyond it is refused.
  for (;;) {
    uint64_t needed = 0;
    QJLKV_OK(qjlkv_cache_bytes_needed(gpu, 1, 1, &needed));
    const uint64_t before = stats_of(gpu).bytes_used;
    const Tokens t = make_tokens(rng, cfg, 1);
    const auto k = encode(t.keys, qjlkv_dtype(cfg.dtype)), v = encode(t.values, qjlkv_dtype(cfg.dtype));
    DeviceBytes dk(k), dv(v);
    const auto one_layer = [&](uint32_t layer) { return qjlkv_cache_append(gpu, layer, 1, 1, dk.get(), dv.get()); };
    // bytes_needed covers every layer; layer 0 alone may still fit when both do not.
    const qjlkv_status status = one_layer(0);
    if (status != QJLKV_OK) {
      EXPECT_EQ(status, QJLKV_ERROR_MEMORY_BUDGET) << qjlkv_last_error_message();
      EXPECT_GT(before + needed, budget);
      EXPECT_EQ(stats_of(gpu).bytes_used, before);
      break;
    }
    const qjlkv_status second = one_layer(1);
    if (second != QJLKV_OK) {
      EXPECT_EQ(second, QJLKV_ERROR_MEMORY_BUDGET) << qjlkv_last_error_message();
      EXPECT_GT(before + needed, budget);
      break;
    }
    EXPECT_LE(before + needed, budget);
    EXPECT_EQ(uint64_t(std::max<int64_t>(int64_t(stats_of(gpu).bytes_used - before), 0)), needed);
  }
  EXPECT_LE(stats_of(gpu).bytes_used, budget);
  const auto full = export_seq(gpu, 1);
  const uint64_t full_used = stats_of(gpu).bytes_used;
  // A fork of the whole sequence needs its own rows: refused, nothing changed.
  EXPECT_EQ(qjlkv_cache_fork(gpu, 1, 2, longest(gpu, 1)), QJLKV_ERROR_MEMORY_BUDGET);
  // append_batch to a new sequence and the stream of the first 60 tokens: refused too.
  {
    const Tokens t = make_tokens(rng, cfg, 2);
    const auto k = encode(t.keys, qjlkv_dtype(cfg.dtype)), v = encode(t.values, qjlkv_dtype(cfg.dtype));
    DeviceBytes dk(k), dv(v);
    const uint32_t seqs[2] = {1, 3};
    EXPECT_EQ(qjlkv_cache_append_batch(gpu, 1, 2, seqs, dk.get(), dv.get()), QJLKV_ERROR_MEMORY_BUDGET);
  }
  EXPECT_EQ(qjlkv_cache_import(gpu, 4, stream.data(), stream.size()), QJLKV_ERROR_MEMORY_BUDGET);
  EXPECT_EQ(export_seq(gpu, 1), full);
  EXPECT_EQ(stats_of(gpu).bytes_used, full_used);
  for (uint32_t seq : {2u, 3u, 4u}) EXPECT_EQ(longest(gpu, seq), 0u);
  // Truncating frees room again: the fork of a short prefix then fits.
  QJLKV_OK(qjlkv_cache_truncate(gpu, 1, 20));
  EXPECT_LT(stats_of(gpu).bytes_used, used);
  QJLKV_OK(qjlkv_cache_fork(gpu, 1, 2, 10));
  qjlkv_cache_destroy(gpu);
}

#if defined(QJLKV_CUDA_EMULATION)
// Every device (and pinned host) allocation that an operation makes fails in turn: the operation
// reports OUT_OF_MEMORY and the cache stays as it was (streams, bytes), until it succeeds and
// matches the CPU again. Each operation below needs new pool chunks or tables, so each fails at
// least once.
TEST(CudaSequenceFailures, OutOfMemoryChangesNothing) {
  for (const char *preset : {"q3", "ott"}) {
    SCOPED_TRACE(preset);
    {
      CachePair pair(ops_config(OpsCase{preset, QJLKV_DTYPE_F16}));
      ASSERT_TRUE(pair.ok()) << pair.error();
      const qjlkv_config &cfg = pair.cfg();
      std::mt19937 rng(17);
      const std::vector<uint32_t> ids = {0, 1, 2, 3, 4, 5, 6};
      for (uint32_t seq = 0; seq < 4; ++seq) {
        const Tokens t = make_tokens(rng, cfg, 50 + 9 * seq);
        for (uint32_t l = 0; l < kLayers; ++l) pair.append(l, seq, t.keys, t.values);
      }
      const Tokens more = make_tokens(rng, cfg, 160);
      const auto k = encode(more.keys, qjlkv_dtype(cfg.dtype)), v = encode(more.values, qjlkv_dtype(cfg.dtype));
      DeviceBytes dk(k), dv(v);
      const auto stream = export_seq(pair.cpu(), 3);
      struct Operation {
        const char *name;
        std::function<qjlkv_status(qjlkv_cache *, bool)> run;
      };
      const Operation operations[] = {
          {"truncate below the floor", [](qjlkv_cache *c, bool) { return qjlkv_cache_truncate(c, 1, 30); }},
          {"fork", [](qjlkv_cache *c, bool) { return qjlkv_cache_fork(c, 0, 5, 45); }},
          {"append",
           [&](qjlkv_cache *c, bool device) {
             return qjlkv_cache_append(c, 1, 2, 160, device ? dk.get() : k.data(), device ? dv.get() : v.data());
           }},
          {"import", [&](qjlkv_cache *c, bool) { return qjlkv_cache_import(c, 6, stream.data(), stream.size()); }},
      };
      for (const Operation &op : operations) {
        SCOPED_TRACE(op.name);
        std::vector<std::vector<uint8_t>> before;
        for (uint32_t id : ids) before.push_back(longest(pair.gpu(), id) ? export_seq(pair.gpu(), id) : std::vector<uint8_t>{});
        const uint64_t used = stats_of(pair.gpu()).bytes_used;
        uint32_t failures = 0;
        for (;; ++failures) {
          ASSERT_LT(failures, 100u);
          emu::fail_allocations_after(failures);
          const qjlkv_status status = op.run(pair.gpu(), true);
          emu::fail_allocations_after(-1);
          if (status == QJLKV_OK) break;
          ASSERT_EQ(status, QJLKV_ERROR_OUT_OF_MEMORY) << qjlkv_last_error_message();
          for (size_t i = 0; i < ids.size(); ++i)
            EXPECT_EQ(longest(pair.gpu(), ids[i]) ? export_seq(pair.gpu(), ids[i]) : std::vector<uint8_t>{}, before[i])
                << "seq " << ids[i] << " changed after a failure at allocation " << failures;
          EXPECT_EQ(stats_of(pair.gpu()).bytes_used, used);
        }
        EXPECT_GT(failures, 0u) << "the operation allocated nothing";
        QJLKV_OK(op.run(pair.cpu(), false));
        expect_same_state(pair, ids, rng, op.name);
      }
    }
    EXPECT_STREQ(emu::first_error(), "") << "leaked or damaged device memory";
  }
}
#endif

}  // namespace
