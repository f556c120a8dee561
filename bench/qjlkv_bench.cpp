// Google Benchmark programs of the CPU backend (docs/PERFORMANCE.md has the command and the
// measured table):
//   ReadBandwidth      the machine's read bandwidth (all worker threads, a 1 GiB buffer)
//   Gemm               the machine's fp32 GEMM rate (Eigen, one product per worker thread), in
//                      the shape of the QJL projection of 4096 appended keys (d = 128, m = 256)
//   Attend/<model>/<preset>/<context>
//                      one decode step (one query token, one layer, all heads) on an fp16
//                      cache; counters: MB the step reads from the cache, GB_per_s and its
//                      fraction of ReadBandwidth (of_read_bw)
//   ExactOver/<model>/<context>
//                      exact and every compressed preset's steps alternated in one loop (same
//                      machine load): their times and the ratios exact/<preset>
//   AttendBatch/<model>/<preset>/4096/seqs:32
//                      32 sequences in one attend_batch call: ms_per_seq
//   Append/<model>/<preset>
//                      one 4096-token prefill into an empty sequence: Mtoken_heads_per_s and,
//                      for qjl, the fraction of the GEMM rate its sketch products reach, against
//                      a GEMM of the same shape run alternately in the same loop
//   Fork/<model>/<preset>/32768/forks:8
//                      8 forks of one 32k-token sequence (every layer) into empty ids, then their
//                      clears: ms_per_fork, MB each fork adds to bytes_used (its copies of the
//                      exact rows) against the MB the source holds
//   Truncate/<model>/<preset>/32768/tokens:32
//                      a speculative-decoding round on a 32k-token sequence: 32 draft tokens
//                      appended one at a time to every layer (untimed), then one truncate back:
//                      ms_per_truncate
//   RollbackBits/<model>/<preset>/8192
//                      what the rollback copies cost: bits per number over the last 256 decode
//                      steps (one token a step) up to 8192 tokens with rollback_tokens 32 and 0
//   Window/<model>/<preset>/32768/window:4096
//                      a sliding-window layer decoding at 32k tokens against a plain layer at
//                      4k, stepped in turn in one loop (one token appended, then attended):
//                      ns per step of each and the bytes_used of each (the window frees the
//                      blocks it leaves behind, so it holds about what the 4k layer does)
//   Kernels/<isa>/<preset>, VectorPorts/<instruction>
//                      white-box: the kernels on hot data (kernel_bench.cpp) and the vector-port
//                      operations of AVX-512 instructions (port_probe.cpp)
// Each step attends one layer; successive steps cycle over enough layers (up to the model's
// count) that the bytes read exceed the last-level cache, as a real decode step's would.
// QJLKV_BENCH_THREADS sets config.num_threads (default 0: the cores available).
#include <benchmark/benchmark.h>
#include <qjlkv/qjlkv.h>

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "probes.hpp"

namespace {

struct Shape {
  const char *name;
  uint32_t layers, q_heads, kv_heads, head_dim;
};
constexpr Shape kShapes[] = {{"llama3_8b", 32, 32, 8, 128}, {"smollm2_135m", 30, 9, 3, 64}};
constexpr const char *kPresets[] = {"exact", "q2", "q3", "q4", "qjl", "kivi", "ott"};  // exact first
constexpr uint32_t kContexts[] = {1024, 4096, 16384, 32768, 131072};
constexpr double kWorkingSetBytes = 256e6;  // cache bytes cycled through: well beyond the LLC
constexpr uint32_t kChunk = 4096;           // tokens per append call while filling
constexpr uint32_t kBatchSeqs = 32, kBatchContext = 4096;

// Measured by ReadBandwidth, used by later counters (0 when it was filtered out).
double g_read_bytes_per_second = 0.0;

void check(qjlkv_status status, const char *what) {
  if (status == QJLKV_OK) return;
  std::fprintf(stderr, "%s failed: %s\n", what, qjlkv_last_error_message());
  std::exit(1);
}

// QJLKV_BENCH_THREADS overrides config.num_threads (0 = the cores available).
uint32_t bench_threads() {
  const char *v = std::getenv("QJLKV_BENCH_THREADS");
  return v ? uint32_t(std::strtoul(v, nullptr, 10)) : 0;
}
unsigned worker_count() {
  const uint32_t t = bench_threads();
  return t ? t : std::max(1u, std::thread::hardware_concurrency());
}

uint16_t to_half(float x) { return Eigen::numext::bit_cast<uint16_t>(Eigen::half(x)); }

// fp16 keys and values: Gaussian, with a few large channels in the keys as real models have.
// One pool of tokens is reused cyclically, so filling large caches stays fast.
class Tokens {
 public:
  explicit Tokens(const Shape &s) : elems_(size_t(s.kv_heads) * s.head_dim) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    keys_.resize(size_t(kChunk) * elems_);
    values_.resize(keys_.size());
    for (size_t i = 0; i < keys_.size(); ++i) {
      const bool outlier_channel = (i % s.head_dim) % 37 == 5;
      keys_[i] = to_half(normal(rng) * (outlier_channel ? 12.0f : 1.0f));
      values_[i] = to_half(normal(rng));
    }
  }
  const uint16_t *keys(uint32_t first) const { return keys_.data() + size_t(first % kChunk) * elems_; }
  const uint16_t *values(uint32_t first) const { return values_.data() + size_t(first % kChunk) * elems_; }

 private:
  size_t elems_;
  std::vector<uint16_t> keys_, values_;
};

// One cache per (model, preset), grown as the benchmarks ask for longer contexts.
struct BenchCache {
  Shape shape{};
  qjlkv_config cfg{};
  qjlkv_cache *cache = nullptr;
  std::unique_ptr<Tokens> tokens;
  std::map<uint32_t, std::vector<uint64_t>> lengths;  // seq -> per-layer length
  ~BenchCache() { qjlkv_cache_destroy(cache); }

  // Appends until (layer, seq) holds `context` tokens (the sequence is cleared if longer).
  void fill(uint32_t layer, uint32_t seq, uint64_t context) {
    std::vector<uint64_t> &len = lengths.try_emplace(seq, shape.layers, 0).first->second;
    if (len[layer] > context) {
      check(qjlkv_cache_clear_sequence(cache, seq), "clear");
      std::fill(len.begin(), len.end(), 0);
    }
    while (len[layer] < context) {
      const uint32_t n = uint32_t(std::min<uint64_t>(kChunk, context - len[layer]));
      check(qjlkv_cache_append(cache, layer, seq, n, tokens->keys(uint32_t(len[layer])),
                               tokens->values(uint32_t(len[layer]))),
            "append");
      len[layer] += n;
    }
  }
  // Bytes a decode step reads from one layer of `context` tokens: what the cache stores per
  // token (quantized blocks, full-precision tail and pools; not the bookkeeping), times context.
  double step_bytes(uint64_t context) const {
    qjlkv_stats st{};
    st.struct_size = sizeof st;
    check(qjlkv_cache_stats(cache, &st), "stats");
    const double stored = double(st.bytes_keys_quantized + st.bytes_values_quantized + st.bytes_full_precision);
    return stored / double(st.tokens) * double(context);
  }
  // Layers to cycle over so that the bytes read exceed kWorkingSetBytes (at most the model's).
  uint32_t layers_for(uint64_t context) {
    fill(0, 0, context);
    const double per_layer = step_bytes(context);
    return uint32_t(std::clamp(std::ceil(kWorkingSetBytes / per_layer), 1.0, double(shape.layers)));
  }
};

std::map<std::string, std::unique_ptr<BenchCache>> g_caches;

BenchCache &bench_cache(const Shape &shape, const char *preset) {
  std::unique_ptr<BenchCache> &slot = g_caches[std::string(shape.name) + "/" + preset];
  if (!slot) {
    slot = std::make_unique<BenchCache>();
    slot->shape = shape;
    slot->cfg.struct_size = sizeof slot->cfg;
    check(qjlkv_config_init(&slot->cfg, preset, shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim),
          "config_init");
    slot->cfg.dtype = QJLKV_DTYPE_F16;
    slot->cfg.num_threads = bench_threads();
    check(qjlkv_cache_create(&slot->cfg, &slot->cache), "cache_create");
    slot->tokens = std::make_unique<Tokens>(shape);
  }
  return *slot;
}

std::vector<uint16_t> random_queries(const Shape &s, uint32_t n) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> q(size_t(n) * s.q_heads * s.head_dim);
  for (uint16_t &x : q) x = to_half(normal(rng));
  return q;
}

// Cycles one decode step over `layers` layers of `bc`, seq 0.
struct Stepper {
  BenchCache &bc;
  uint32_t layers, next = 0;
  std::vector<uint16_t> query, out;
  Stepper(BenchCache &cache, uint64_t context) : bc(cache), layers(cache.layers_for(context)) {
    for (uint32_t l = 0; l < layers; ++l) bc.fill(l, 0, context);
    query = random_queries(bc.shape, 1);
    out.resize(query.size());
  }
  void step() {
    check(qjlkv_cache_attend(bc.cache, next, 0, 1, query.data(), 0.0f, out.data()), "attend");
    next = (next + 1) % layers;
  }
};

// Wall time of a benchmark's loop, for counters that are plain rates and fractions.
class LoopClock {
 public:
  LoopClock() : start_(std::chrono::steady_clock::now()) {}
  double seconds_per_iteration(const benchmark::State &state) const {
    const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    return total / double(std::max<benchmark::IterationCount>(state.iterations(), 1));
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

void set_bandwidth_counters(benchmark::State &state, double seconds_per_step, double bytes_per_step,
                            double layers) {
  state.counters["MB_per_step"] = bytes_per_step / 1e6;
  state.counters["layers"] = layers;
  const double rate = bytes_per_step / seconds_per_step;
  state.counters["GB_per_s"] = rate / 1e9;
  if (g_read_bytes_per_second > 0) state.counters["of_read_bw"] = rate / g_read_bytes_per_second;
}

void bm_attend(benchmark::State &state, const Shape &shape, const char *preset, uint32_t context) {
  BenchCache &bc = bench_cache(shape, preset);
  Stepper stepper(bc, context);
  const LoopClock clock;
  for (auto _ : state) stepper.step();
  set_bandwidth_counters(state, clock.seconds_per_iteration(state), bc.step_bytes(context), stepper.layers);
}

// exact and every compressed preset alternated in one loop, so that all see the same machine
// load: <preset>_ms per step and the ratio exact/<preset>.
void bm_exact_over(benchmark::State &state, const Shape &shape, uint32_t context) {
  std::vector<std::unique_ptr<Stepper>> steppers;  // kPresets[0] is exact
  for (const char *preset : kPresets) steppers.push_back(std::make_unique<Stepper>(bench_cache(shape, preset), context));
  std::vector<double> seconds(steppers.size(), 0.0);
  for (auto _ : state) {
    double total = 0.0;
    for (size_t i = 0; i < steppers.size(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      steppers[i]->step();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      seconds[i] += s;
      total += s;
    }
    state.SetIterationTime(total);
  }
  const double n = double(state.iterations());
  for (size_t i = 0; i < steppers.size(); ++i) {
    const std::string preset = kPresets[i];
    state.counters[preset + "_ms"] = seconds[i] / n * 1e3;
    if (i > 0) state.counters["exact/" + preset] = seconds[0] / seconds[i];
  }
}

void bm_attend_batch(benchmark::State &state, const Shape &shape, const char *preset) {
  BenchCache &bc = bench_cache(shape, preset);
  std::vector<uint32_t> seqs(kBatchSeqs);
  for (uint32_t i = 0; i < kBatchSeqs; ++i) {
    seqs[i] = 1000 + i;
    bc.fill(0, seqs[i], kBatchContext);
  }
  const std::vector<uint16_t> queries = random_queries(shape, kBatchSeqs);
  std::vector<uint16_t> out(queries.size());
  const LoopClock clock;
  for (auto _ : state)
    check(qjlkv_cache_attend_batch(bc.cache, 0, kBatchSeqs, seqs.data(), queries.data(), 0.0f, out.data()),
          "attend_batch");
  const double seconds = clock.seconds_per_iteration(state);
  state.counters["ms_per_seq"] = seconds / kBatchSeqs * 1e3;
  set_bandwidth_counters(state, seconds, bc.step_bytes(kBatchContext) * kBatchSeqs, 1);
}

void bm_append(benchmark::State &state, const Shape &shape, const char *preset) {
  qjlkv_config cfg{};
  cfg.struct_size = sizeof cfg;
  check(qjlkv_config_init(&cfg, preset, 1, shape.q_heads, shape.kv_heads, shape.head_dim), "config_init");
  cfg.dtype = QJLKV_DTYPE_F16;
  cfg.num_threads = bench_threads();
  qjlkv_cache *cache = nullptr;
  check(qjlkv_cache_create(&cfg, &cache), "cache_create");
  const Tokens tokens(shape);
  // For qjl, every append alternates with the Gemm probe's product of the same shape, so that
  // the fraction of the GEMM rate compares the two under the same machine load.
  const bool qjl = cfg.key_method == QJLKV_KEYS_QJL;
  std::unique_ptr<GemmProbe> gemm;
  if (qjl) gemm = std::make_unique<GemmProbe>(worker_count(), kChunk, shape.head_dim, cfg.key_sketch_dim);
  double append_s = 0.0, gemm_s = 0.0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    check(qjlkv_cache_clear_sequence(cache, 0), "clear");
    check(qjlkv_cache_append(cache, 0, 0, kChunk, tokens.keys(0), tokens.values(0)), "append");
    const auto t1 = std::chrono::steady_clock::now();
    if (gemm) gemm->run();
    const auto t2 = std::chrono::steady_clock::now();
    append_s += std::chrono::duration<double>(t1 - t0).count();
    gemm_s += std::chrono::duration<double>(t2 - t1).count();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
  }
  qjlkv_cache_destroy(cache);
  const double n = double(state.iterations());
  const double token_heads_per_s = double(kChunk) * shape.kv_heads * n / append_s;
  state.counters["Mtoken_heads_per_s"] = token_heads_per_s / 1e6;
  if (qjl) {
    // The sketch products: S·k_in over d channels and S_out·k_out over the outlier channels.
    const double flops = 2.0 * (double(cfg.key_sketch_dim) * shape.head_dim +
                                double(cfg.outlier_sketch_dim) * cfg.outlier_channels);
    const double gemm_rate = gemm->flops() * n / gemm_s;
    state.counters["sketch_GFLOP_per_s"] = token_heads_per_s * flops / 1e9;
    state.counters["gemm_GFLOP_per_s"] = gemm_rate / 1e9;
    state.counters["of_gemm_rate"] = token_heads_per_s * flops / gemm_rate;
  }
}

constexpr uint32_t kForkContext = 32768, kForks = 8, kDraftTokens = 32;

// Fills every layer of seq 0 with `context` tokens.
void fill_all_layers(BenchCache &bc, uint64_t context) {
  for (uint32_t l = 0; l < bc.shape.layers; ++l) bc.fill(l, 0, context);
}

qjlkv_stats stats_of(const qjlkv_cache *cache) {
  qjlkv_stats st{};
  st.struct_size = sizeof st;
  check(qjlkv_cache_stats(cache, &st), "stats");
  return st;
}
uint64_t used_bytes(const qjlkv_cache *cache) { return stats_of(cache).bytes_used; }

void bm_fork(benchmark::State &state, const Shape &shape, const char *preset) {
  BenchCache &bc = bench_cache(shape, preset);
  fill_all_layers(bc, kForkContext);
  const uint64_t source = used_bytes(bc.cache);
  double fork_s = 0.0, added = 0.0;
  for (auto _ : state) {
    const uint64_t before = used_bytes(bc.cache);
    const auto t0 = std::chrono::steady_clock::now();
    for (uint32_t i = 0; i < kForks; ++i) check(qjlkv_cache_fork(bc.cache, 0, 2000 + i, kForkContext), "fork");
    const auto t1 = std::chrono::steady_clock::now();
    added += double(used_bytes(bc.cache) - before) / kForks;
    for (uint32_t i = 0; i < kForks; ++i) check(qjlkv_cache_clear_sequence(bc.cache, 2000 + i), "clear");
    fork_s += std::chrono::duration<double>(t1 - t0).count();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
  }
  const double n = double(state.iterations());
  state.counters["ms_per_fork"] = fork_s / n / kForks * 1e3;
  state.counters["MB_added_per_fork"] = added / n / 1e6;
  state.counters["MB_source"] = double(source) / 1e6;
}

void bm_truncate(benchmark::State &state, const Shape &shape, const char *preset) {
  BenchCache &bc = bench_cache(shape, preset);
  fill_all_layers(bc, kForkContext);
  double truncate_s = 0.0;
  for (auto _ : state) {
    for (uint32_t t = 0; t < kDraftTokens; ++t)
      for (uint32_t l = 0; l < shape.layers; ++l)
        check(qjlkv_cache_append(bc.cache, l, 0, 1, bc.tokens->keys(t), bc.tokens->values(t)), "append");
    const auto t0 = std::chrono::steady_clock::now();
    check(qjlkv_cache_truncate(bc.cache, 0, kForkContext), "truncate");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    truncate_s += s;
    state.SetIterationTime(s);
  }
  state.counters["ms_per_truncate"] = truncate_s / double(state.iterations()) * 1e3;
}

double bits_per_number(const qjlkv_cache *cache) { return stats_of(cache).bits_per_number; }

void bm_rollback_bits(benchmark::State &state, const Shape &shape, const char *preset) {
  constexpr uint32_t kContext = 8192, kSteps = 256;
  double with_copies = 0.0, without = 0.0;
  for (auto _ : state) {
    qjlkv_cache *caches[2];
    for (uint32_t rollback : {32u, 0u}) {
      qjlkv_config cfg{};
      cfg.struct_size = sizeof cfg;
      check(qjlkv_config_init(&cfg, preset, 1, shape.q_heads, shape.kv_heads, shape.head_dim), "config_init");
      cfg.dtype = QJLKV_DTYPE_F16;
      cfg.num_threads = bench_threads();
      cfg.rollback_tokens = rollback;
      check(qjlkv_cache_create(&cfg, &caches[rollback == 0]), "cache_create");
    }
    const Tokens tokens(shape);
    for (qjlkv_cache *c : caches)
      for (uint32_t t = 0; t < kContext - kSteps; t += kChunk)
        check(qjlkv_cache_append(c, 0, 0, std::min(kChunk, kContext - kSteps - t), tokens.keys(t), tokens.values(t)),
              "append");
    for (uint32_t t = kContext - kSteps; t < kContext; ++t)
      for (int i = 0; i < 2; ++i) {
        check(qjlkv_cache_append(caches[i], 0, 0, 1, tokens.keys(t), tokens.values(t)), "append");
        (i == 0 ? with_copies : without) += bits_per_number(caches[i]) / kSteps;
      }
    for (qjlkv_cache *c : caches) qjlkv_cache_destroy(c);
  }
  const double n = double(state.iterations());
  state.counters["bits_rollback_32"] = with_copies / n;
  state.counters["bits_rollback_0"] = without / n;
}

constexpr uint32_t kWindowContext = 32768, kWindowTokens = 4096, kPlainContext = 4096;

void bm_window(benchmark::State &state, const Shape &shape, const char *preset) {
  qjlkv_cache *caches[2];  // [0]: one layer with a window at kWindowContext; [1]: plain at kPlainContext
  for (qjlkv_cache *&c : caches) {
    qjlkv_config cfg{};
    cfg.struct_size = sizeof cfg;
    check(qjlkv_config_init(&cfg, preset, 1, shape.q_heads, shape.kv_heads, shape.head_dim), "config_init");
    cfg.dtype = QJLKV_DTYPE_F16;
    cfg.num_threads = bench_threads();
    check(qjlkv_cache_create(&cfg, &c), "cache_create");
  }
  qjlkv_layer_attention window{};
  window.struct_size = sizeof window;
  window.window_tokens = kWindowTokens;
  check(qjlkv_cache_set_layer_attention(caches[0], 0, &window), "set_layer_attention");
  const Tokens tokens(shape);
  // A prefill in chunks: one append holds all its tokens until it commits.
  constexpr uint32_t kPrefillChunk = 512;
  const uint32_t contexts[2] = {kWindowContext, kPlainContext};
  for (int i = 0; i < 2; ++i)
    for (uint32_t t = 0; t < contexts[i]; t += kPrefillChunk)
      check(qjlkv_cache_append(caches[i], 0, 0, kPrefillChunk, tokens.keys(t), tokens.values(t)), "append");
  const std::vector<uint16_t> query = random_queries(shape, 1);
  std::vector<uint16_t> out(query.size());
  double seconds[2] = {0.0, 0.0};
  uint32_t t = 0;
  for (auto _ : state) {
    double total = 0.0;
    for (int i = 0; i < 2; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      check(qjlkv_cache_append(caches[i], 0, 0, 1, tokens.keys(t), tokens.values(t)), "append");
      check(qjlkv_cache_attend(caches[i], 0, 0, 1, query.data(), 0.0f, out.data()), "attend");
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      seconds[i] += s;
      total += s;
    }
    check(qjlkv_cache_truncate(caches[1], 0, kPlainContext), "truncate");  // the plain layer stays at 4k
    ++t;
    state.SetIterationTime(total);
  }
  const double n = double(state.iterations());
  state.counters["window_ns_per_step"] = seconds[0] / n * 1e9;
  state.counters["plain_ns_per_step"] = seconds[1] / n * 1e9;
  state.counters["window_bytes_used"] = double(used_bytes(caches[0]));
  state.counters["plain_bytes_used"] = double(used_bytes(caches[1]));
  state.counters["window_tokens_held"] = double(stats_of(caches[0]).tokens);
  for (qjlkv_cache *c : caches) qjlkv_cache_destroy(c);
}

// Each worker thread sums its slice of a 1 GiB buffer.
void bm_read_bandwidth(benchmark::State &state) {
  const size_t words = (size_t(1) << 30) / sizeof(uint64_t);
  std::vector<uint64_t> buffer(words, 1);
  const unsigned threads = worker_count();
  std::atomic<uint64_t> sink{0};
  const auto read = [&](size_t first, size_t last) {
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = first; i + 4 <= last; i += 4) {
      a += buffer[i];
      b ^= buffer[i + 1];
      c += buffer[i + 2];
      d ^= buffer[i + 3];
    }
    sink += a + b + c + d;
  };
  const LoopClock clock;
  for (auto _ : state) {
    std::vector<std::thread> pool;
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back(read, words / threads * t, words / threads * (t + 1));
    read(0, words / threads);
    for (std::thread &t : pool) t.join();
  }
  benchmark::DoNotOptimize(sink.load());
  g_read_bytes_per_second = double(words) * sizeof(uint64_t) / clock.seconds_per_iteration(state);
  state.counters["GB_per_s"] = g_read_bytes_per_second / 1e9;
  state.counters["threads"] = threads;
}

void bm_gemm(benchmark::State &state) {
  const unsigned threads = worker_count();
  GemmProbe probe(threads, kChunk, 128, 256);
  const LoopClock clock;
  for (auto _ : state) probe.run();
  const double flops_per_s = probe.flops() / clock.seconds_per_iteration(state);
  state.counters["GFLOP_per_s"] = flops_per_s / 1e9;
  state.counters["threads"] = threads;
}

void register_all() {
  using benchmark::RegisterBenchmark;
  RegisterBenchmark("ReadBandwidth", bm_read_bandwidth)->UseRealTime()->Unit(benchmark::kMillisecond);
  RegisterBenchmark("Gemm", bm_gemm)->UseRealTime()->Unit(benchmark::kMillisecond);
  register_kernel_benchmarks();
  register_port_benchmarks();
  for (const Shape &shape : kShapes) {
    const std::string model = shape.name;
    for (uint32_t context : kContexts)
      for (const char *preset : kPresets)
        RegisterBenchmark((std::string("Attend/") + model + "/" + preset + "/" + std::to_string(context)).c_str(),
                          bm_attend, shape, preset, context)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
    for (uint32_t context : kContexts)
      RegisterBenchmark(("ExactOver/" + model + "/" + std::to_string(context)).c_str(), bm_exact_over, shape, context)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    for (const char *preset : {"exact", "q2", "q3", "qjl"})
      RegisterBenchmark((std::string("AttendBatch/") + model + "/" + preset + "/" + std::to_string(kBatchContext) +
                         "/seqs:" + std::to_string(kBatchSeqs))
                            .c_str(),
                        bm_attend_batch, shape, preset)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    for (const char *preset : kPresets)
      RegisterBenchmark((std::string("Append/") + model + "/" + preset).c_str(), bm_append, shape, preset)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    RegisterBenchmark((std::string("Window/") + model + "/q3/" + std::to_string(kWindowContext) +
                       "/window:" + std::to_string(kWindowTokens))
                          .c_str(),
                      bm_window, shape, "q3")
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
    for (const char *preset : {"q3", "q4", "qjl"}) {
      RegisterBenchmark((std::string("RollbackBits/") + model + "/" + preset + "/8192").c_str(), bm_rollback_bits,
                        shape, preset)
          ->Iterations(1)
          ->Unit(benchmark::kMillisecond);
      const std::string tail = std::string("/") + preset + "/" + std::to_string(kForkContext);
      RegisterBenchmark(("Fork/" + model + tail + "/forks:" + std::to_string(kForks)).c_str(), bm_fork, shape, preset)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
      RegisterBenchmark(("Truncate/" + model + tail + "/tokens:" + std::to_string(kDraftTokens)).c_str(), bm_truncate,
                        shape, preset)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace

int main(int argc, char **argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  g_caches.clear();
  benchmark::Shutdown();
  return 0;
}
