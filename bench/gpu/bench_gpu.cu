// GPU benchmark of the CUDA backend (built and run by tests/gpu/run.sh):
//   decode attention time for the presets q2, q3, q4 (the tiers, first), qjl, kivi and exact on a
//   Llama-3-8B layer shape
//   (32 query heads, 8 kv heads, head_dim 128, bf16), contexts 4k..128k, batch 1 and 32;
//   the effective bandwidth (compressed bytes read per second) next to the device's measured
//   copy bandwidth; append throughput (prefill chunks and batched decode steps); and the time to
//   export one sequence's layer to host memory and import it back.
//
//   bench_gpu [--quick]     --quick: 4k context, batch 1 and 4 (e.g. under compute-sanitizer)
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "qjlkv/qjlkv.h"

namespace {

#define CHECK_CUDA(expr)                                                                          \
  do {                                                                                            \
    const cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)
#define CHECK_QJLKV(expr)                                                                                  \
  do {                                                                                                     \
    const qjlkv_status s_ = (expr);                                                                        \
    if (s_ != QJLKV_OK) {                                                                                  \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, qjlkv_last_error_message()); \
      std::exit(3);                                                                                        \
    }                                                                                                      \
  } while (0)

// bf16 test data from a counter-based hash: roughly N(0,1), keys with a few large channels.
__global__ void fill(uint16_t *p, size_t n, uint32_t d, uint64_t seed, bool keys) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
    float sum = 0.0f;
    for (int k = 0; k < 4; ++k) {
      x ^= x >> 31;
      x *= 0xbf58476d1ce4e5b9ull;
      x ^= x >> 29;
      sum += float(x >> 40) * (1.0f / 16777216.0f);
    }
    float v = (sum - 2.0f) * 1.732f;
    if (keys && i % d % 29 == 3) v = v * 6.0f + 8.0f;
    const uint32_t bits = __float_as_uint(v);
    p[i] = uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main(int argc, char **argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const uint32_t Hq = 32, Hkv = 8, d = 128, batch = quick ? 4 : 32, chunk = 4096;
  const std::vector<uint32_t> contexts =
      quick ? std::vector<uint32_t>{4096} : std::vector<uint32_t>{4096, 16384, 32768, 65536, 131072};
  const std::vector<uint32_t> batches = {1, batch};
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  // Copy bandwidth: bytes read + bytes written per second by cudaMemcpy device to device.
  {
    const size_t bytes = size_t(1) << 30;
    void *a, *b;
    CHECK_CUDA(cudaMalloc(&a, bytes));
    CHECK_CUDA(cudaMalloc(&b, bytes));
    CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream));
    CHECK_CUDA(cudaEventRecord(start, stream));
    const int reps = quick ? 2 : 10;
    for (int i = 0; i < reps; ++i) CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream));
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    std::printf("copy_bandwidth read+write_GBps=%.1f (read_GBps=%.1f)\n", 2.0 * bytes * reps / (ms * 1e6),
                double(bytes) * reps / (ms * 1e6));
    CHECK_CUDA(cudaFree(a));
    CHECK_CUDA(cudaFree(b));
  }

  const size_t chunk_elems = size_t(chunk) * Hkv * d;
  uint16_t *keys, *values, *queries, *out;
  CHECK_CUDA(cudaMalloc(&keys, chunk_elems * 2));
  CHECK_CUDA(cudaMalloc(&values, chunk_elems * 2));
  CHECK_CUDA(cudaMalloc(&queries, size_t(batch) * Hq * d * 2));
  CHECK_CUDA(cudaMalloc(&out, size_t(batch) * Hq * d * 2));
  fill<<<256, 256, 0, stream>>>(queries, size_t(batch) * Hq * d, d, 99, false);
  std::vector<uint32_t> seqs(batch);
  for (uint32_t i = 0; i < batch; ++i) seqs[i] = i;

  for (const char *preset : {"q2", "q3", "q4", "qjl", "kivi", "exact"}) {
    qjlkv_config cfg{};
    cfg.struct_size = sizeof cfg;
    CHECK_QJLKV(qjlkv_config_init(&cfg, preset, 1, Hq, Hkv, d));
    cfg.dtype = QJLKV_DTYPE_BF16;
    cfg.backend = QJLKV_BACKEND_CUDA;
    cfg.device_ordinal = 0;
    qjlkv_cache *cache;
    CHECK_QJLKV(qjlkv_cache_create(&cfg, &cache));
    CHECK_QJLKV(qjlkv_cache_set_stream(cache, stream));
    uint32_t length = 0;
    double append_seconds = 0;
    uint64_t appended = 0;
    for (const uint32_t context : contexts) {
      // Prefill every sequence up to `context` in chunks (each append validates: one sync).
      for (; length < context; length += chunk) {
        for (uint32_t s = 0; s < batch; ++s) {
          fill<<<512, 256, 0, stream>>>(keys, chunk_elems, d, 1000003ull * length + s, true);
          fill<<<512, 256, 0, stream>>>(values, chunk_elems, d, 7000003ull * length + s, false);
          CHECK_CUDA(cudaStreamSynchronize(stream));
          const auto t = std::chrono::steady_clock::now();
          CHECK_QJLKV(qjlkv_cache_append(cache, 0, s, chunk, keys, values));
          append_seconds += seconds_since(t);
          appended += chunk;
        }
      }
      qjlkv_stats stats{};
      stats.struct_size = sizeof stats;
      CHECK_QJLKV(qjlkv_cache_stats(cache, &stats));
      const double bytes_per_seq = double(stats.bytes_used) / batch;
      for (const uint32_t b : batches) {
        const auto run = [&] {
          if (b == 1) {
            CHECK_QJLKV(qjlkv_cache_attend(cache, 0, 0, 1, queries, 0.0f, out));
          } else {
            CHECK_QJLKV(qjlkv_cache_attend_batch(cache, 0, b, seqs.data(), queries, 0.0f, out));
          }
        };
        for (int i = 0; i < 3; ++i) run();
        const int reps = quick ? 3 : 20;
        CHECK_CUDA(cudaEventRecord(start, stream));
        const auto t = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) run();
        const double host_us = seconds_since(t) * 1e6 / reps;  // host time to enqueue one call
        CHECK_CUDA(cudaEventRecord(stop, stream));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        const double per_call_ms = ms / reps;
        std::printf("attend preset=%s context=%u batch=%u time_us=%.1f host_enqueue_us=%.1f read_GBps=%.1f "
                    "bits_per_number=%.3f\n",
                    preset, context, b, per_call_ms * 1e3, host_us, bytes_per_seq * b / (per_call_ms * 1e6),
                    stats.bits_per_number);
        std::fflush(stdout);
      }
    }
    std::printf("append preset=%s prefill_tokens_per_s=%.0f (chunks of %u tokens, validation included)\n", preset,
                double(appended) / append_seconds, chunk);
    std::fflush(stdout);  // a step that times out keeps the lines printed so far
    // Batched decode appends: one token for each sequence per call.
    {
      const int steps = quick ? 4 : 64;
      fill<<<512, 256, 0, stream>>>(keys, size_t(batch) * Hkv * d, d, 5, true);
      fill<<<512, 256, 0, stream>>>(values, size_t(batch) * Hkv * d, d, 6, false);
      CHECK_CUDA(cudaStreamSynchronize(stream));
      const auto t = std::chrono::steady_clock::now();
      for (int i = 0; i < steps; ++i) CHECK_QJLKV(qjlkv_cache_append_batch(cache, 0, batch, seqs.data(), keys, values));
      const double s = seconds_since(t);
      std::printf("append_batch preset=%s batch=%u context=%u us_per_call=%.1f tokens_per_s=%.0f\n", preset, batch,
                  length, s * 1e6 / steps, double(steps) * batch / s);
      std::fflush(stdout);
    }
    // Export of sequence 0 (one layer) to host memory and its import as a new sequence: the
    // device copies are batched (one wait per run of blocks on export, one per import).
    {
      uint64_t size = 0;
      CHECK_QJLKV(qjlkv_cache_export_size(cache, 0, 0, 1, &size));
      std::vector<uint8_t> exported(size);
      auto t = std::chrono::steady_clock::now();
      CHECK_QJLKV(qjlkv_cache_export(cache, 0, 0, 1, exported.data(), size));
      const double export_s = seconds_since(t);
      t = std::chrono::steady_clock::now();
      CHECK_QJLKV(qjlkv_cache_import(cache, batch, exported.data(), size));
      const double import_s = seconds_since(t);
      std::printf("export_import preset=%s tokens=%u bytes=%llu export_ms=%.2f export_GBps=%.2f import_ms=%.2f "
                  "import_GBps=%.2f\n",
                  preset, length, (unsigned long long)size, export_s * 1e3, size / (export_s * 1e9), import_s * 1e3,
                  size / (import_s * 1e9));
      std::fflush(stdout);
      CHECK_QJLKV(qjlkv_cache_clear_sequence(cache, batch));
    }
    qjlkv_cache_destroy(cache);
  }
  CHECK_CUDA(cudaFree(keys));
  CHECK_CUDA(cudaFree(values));
  CHECK_CUDA(cudaFree(queries));
  CHECK_CUDA(cudaFree(out));
  CHECK_CUDA(cudaStreamDestroy(stream));
  std::printf("bench_gpu: done\n");
  return 0;
}
