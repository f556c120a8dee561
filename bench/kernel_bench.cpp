// White-box benchmarks of the CPU kernels (src/cpu/simd.hpp) on hot data: what one decode step
// costs per token and kv head when memory is not the limit, per instruction set, for the
// Llama-3-8B head shape (d = 128, 4 query heads per kv head, one query token). The phases are
// timed in thread CPU time, which a shared machine's other processes do not inflate.
#include <benchmark/benchmark.h>

#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "config.hpp"
#include "cpu/method_kernels.hpp"
#include "cpu/simd.hpp"
#include "methods/methods.hpp"
#include "probes.hpp"

namespace {

using namespace qjlkv;
using namespace qjlkv::cpu;

constexpr uint32_t kRows = 4, kDim = 128, kTokens = 2048;

double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

void bm_kernels(benchmark::State &state, Isa isa, const char *preset) {
  const KernelTable &K = kernel_table(isa);
  qjlkv_config cfg{};
  cfg.struct_size = sizeof cfg;
  init_preset(cfg, preset, 1, kRows, 1, kDim);
  cfg.dtype = QJLKV_DTYPE_F16;
  const CacheSpec spec = make_cache_spec(cfg);
  const LayerSpec &ls = spec.layers[0];
  const BlockLayout &layout = ls.layout;
  const uint32_t B = cfg.block_tokens, blocks = kTokens / B, Bp = padded_tokens(B), dp = padded_dim(kDim);
  // Blocks quantized from random keys and values by the kernels themselves.
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> keys(size_t(B) * kDim), values(keys.size());
  std::vector<uint8_t> data(layout.stride * blocks, 0);
  QjlTables qjl_tables;
  QjlArgs qjl;
  if (cfg.key_method == QJLKV_KEYS_QJL) qjl = make_qjl_args(spec, ls, qjl_tables);
  const CodesArgs key_args{&layout, B, kDim, cfg.key_bits, 0, spec.stored_dtype};
  const CodesArgs value_args{&layout, B, kDim, cfg.value_bits, cfg.value_group_size, spec.stored_dtype,
                             ls.value_signs.data()};
  const ValueKernels &value_kernels = with_value_method(
      cfg.value_method, [&](auto value_method) -> const ValueKernels & { return kernels_of(value_method).entries(K); });
  std::vector<float> scratch_storage(kernel_scratch_floats(cfg, ls.m, ls.m_out) + 16);
  const auto misalignment = reinterpret_cast<uintptr_t>(scratch_storage.data()) % 64;
  float *scratch = scratch_storage.data() + (64 - misalignment) % 64 / sizeof(float);  // 64-byte aligned (simd.hpp)
  for (uint32_t b = 0; b < blocks; ++b) {
    for (float &x : keys) x = normal(rng);
    for (float &x : values) x = normal(rng);
    uint8_t *block = &data[size_t(b) * layout.stride];
    switch (cfg.key_method) {
      case QJLKV_KEYS_QJL: qjl_quantize_block(ls, cfg, spec.qjl_constant, keys.data(), block, scratch); break;
      case QJLKV_KEYS_EXACT:
        K.store_16bit(keys.data(), keys.size(), spec.stored_dtype, reinterpret_cast<uint16_t *>(block + layout.key_codes));
        break;
      case QJLKV_KEYS_MIXED: K.mixed.quantize(key_args, keys.data(), block); break;
      default: K.kivi.quantize(key_args, keys.data(), block); break;
    }
    value_kernels.quantize(value_args, values.data(), block);
  }
  std::vector<float> q(size_t(kRows) * dp, 0.0f), sq(size_t(kRows) * qjl.projected_stride), acc(size_t(kRows) * dp, 0.0f);
  for (uint32_t r = 0; r < kRows; ++r)
    for (uint32_t j = 0; j < kDim; ++j) q[size_t(r) * dp + j] = normal(rng);
  if (cfg.key_method == QJLKV_KEYS_QJL) K.qjl.project(qjl, q.data(), kRows, sq.data());
  std::vector<float> weights(size_t(kRows) * Bp * blocks);
  std::vector<SoftmaxRow> rows(kRows);
  double keys_s = 0, softmax_s = 0, values_s = 0;
  for (auto _ : state) {
    const double t0 = thread_seconds();
    for (uint32_t b = 0; b < blocks; ++b) {
      const uint8_t *block = &data[size_t(b) * layout.stride];
      float *w = &weights[size_t(b) * kRows * Bp];
      switch (cfg.key_method) {
        case QJLKV_KEYS_QJL: K.qjl.scores(qjl, block, q.data(), sq.data(), kRows, w, Bp, scratch); break;
        case QJLKV_KEYS_EXACT:
          K.dense.scores(block + layout.key_codes, spec.stored_dtype, kDim, B, kDim, q.data(), kRows, w, Bp);
          break;
        case QJLKV_KEYS_MIXED: K.mixed.scores(key_args, block, q.data(), kRows, w, Bp, scratch); break;
        default: K.kivi.scores(key_args, block, q.data(), kRows, w, Bp, scratch); break;
      }
    }
    const double t1 = thread_seconds();
    for (uint32_t b = 0; b < blocks; ++b)
      K.softmax_fold(rows.data(), &weights[size_t(b) * kRows * Bp], Bp, kRows, B, 0.088f, acc.data(), kDim);
    const double t2 = thread_seconds();
    for (uint32_t b = 0; b < blocks; ++b)
      value_kernels.accumulate(value_args, &data[size_t(b) * layout.stride], &weights[size_t(b) * kRows * Bp], Bp,
                               kRows, acc.data(), scratch);
    value_kernels.in_channel_order(value_args, kRows, acc.data());
    const double t3 = thread_seconds();
    keys_s += t1 - t0;
    softmax_s += t2 - t1;
    values_s += t3 - t2;
    rows.assign(kRows, SoftmaxRow{});
  }
  benchmark::DoNotOptimize(acc.data());
  const double per = 1e9 / (double(state.iterations()) * kTokens);  // ns per token (and kv head)
  state.counters["keys_ns"] = keys_s * per;
  state.counters["softmax_ns"] = softmax_s * per;
  state.counters["values_ns"] = values_s * per;
  state.counters["ns_per_token_head"] = (keys_s + softmax_s + values_s) * per;
}

}  // namespace

void register_kernel_benchmarks() {
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni}) {
    if (!isa_supported(isa)) continue;
    for (const char *preset : {"exact", "q2", "q3", "q4", "qjl", "kivi"})
      benchmark::RegisterBenchmark((std::string("Kernels/") + isa_name(isa) + "/" + preset).c_str(), bm_kernels, isa,
                                   preset)
          ->Unit(benchmark::kMicrosecond);
  }
}
