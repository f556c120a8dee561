// Helpers of the CUDA backend tests: device buffers, test data in every dtype, a pair of caches
// (CPU and CUDA) fed the same inputs, and the comparisons.
//
// The same sources build twice: against the real CUDA runtime (qjlkv_test_gpu, which skips with
// the CUDA error when no device is present) and against the CPU emulator of tests/gpu/emu
// (qjlkv_test_cuda_emu, QJLKV_CUDA_EMULATION defined), which runs the backend's kernels on the CPU.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "half.hpp"
#include "qjlkv/qjlkv.h"

#if defined(QJLKV_CUDA_EMULATION)
#include "emu.hpp"
#endif

namespace gputest {

// Whether a CUDA device is usable; *why names the CUDA error when not.
inline bool cuda_device_available(std::string *why) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    *why = std::string("cudaGetDeviceCount failed with ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
    (void)cudaGetLastError();
    return false;
  }
  if (count == 0) {
    *why = "cudaGetDeviceCount found no device";
    return false;
  }
  return true;
}

#define REQUIRE_CUDA_DEVICE()                                                \
  do {                                                                       \
    std::string why_no_device;                                               \
    if (!::gputest::cuda_device_available(&why_no_device))                   \
      GTEST_SKIP() << "no CUDA device: " << why_no_device;                   \
  } while (0)

#define CUDA_OK(expr)                                                        \
  do {                                                                       \
    const cudaError_t cuda_status = (expr);                                  \
    ASSERT_EQ(cuda_status, cudaSuccess) << #expr << ": " << cudaGetErrorName(cuda_status); \
  } while (0)
#define QJLKV_OK(expr) ASSERT_EQ((expr), QJLKV_OK) << #expr << ": " << qjlkv_last_error_message()

// Device memory owned by the test.
class DeviceBytes {
 public:
  DeviceBytes() = default;
  explicit DeviceBytes(size_t bytes) { resize(bytes); }
  explicit DeviceBytes(const std::vector<uint8_t> &host) { upload(host); }
  ~DeviceBytes() {
    if (p_) (void)cudaFree(p_);
  }
  DeviceBytes(const DeviceBytes &) = delete;
  DeviceBytes &operator=(const DeviceBytes &) = delete;
  void resize(size_t bytes) {
    if (p_) (void)cudaFree(p_);
    p_ = nullptr;
    bytes_ = bytes;
    if (cudaMalloc(&p_, std::max<size_t>(bytes, 1)) != cudaSuccess) p_ = nullptr;
  }
  void upload(const std::vector<uint8_t> &host) {
    resize(host.size());
    if (p_ && !host.empty()) (void)cudaMemcpy(p_, host.data(), host.size(), cudaMemcpyHostToDevice);
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> host(bytes_);
    if (p_ && bytes_) (void)cudaMemcpy(host.data(), p_, bytes_, cudaMemcpyDeviceToHost);
    return host;
  }
  void *get() const { return p_; }

 private:
  void *p_ = nullptr;
  size_t bytes_ = 0;
};

inline size_t dtype_bytes(qjlkv_dtype t) { return t == QJLKV_DTYPE_F32 ? 4 : 2; }
inline const char *dtype_name(qjlkv_dtype t) {
  return t == QJLKV_DTYPE_F32 ? "f32" : t == QJLKV_DTYPE_F16 ? "f16" : "bf16";
}

// Floats stored in a dtype (rounded to nearest even) and read back as floats.
inline std::vector<uint8_t> encode(const std::vector<float> &x, qjlkv_dtype t) {
  std::vector<uint8_t> out(x.size() * dtype_bytes(t));
  for (size_t i = 0; i < x.size(); ++i) {
    if (t == QJLKV_DTYPE_F32) {
      std::memcpy(out.data() + 4 * i, &x[i], 4);
    } else {
      const uint16_t h = t == QJLKV_DTYPE_F16 ? qjlkv::float_to_half(x[i]) : qjlkv::float_to_bf16(x[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}
inline std::vector<float> decode(const std::vector<uint8_t> &bytes, qjlkv_dtype t) {
  std::vector<float> out(bytes.size() / dtype_bytes(t));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t == QJLKV_DTYPE_F32) {
      std::memcpy(&out[i], bytes.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      out[i] = t == QJLKV_DTYPE_F16 ? qjlkv::half_to_float(h) : qjlkv::bf16_to_float(h);
    }
  }
  return out;
}

// Keys like a real model's: N(0,1) plus a few channels of large magnitude (what QJL's outlier
// channels are for), and a per-token offset so that KIVI's per-channel ranges are not trivial.
inline std::vector<float> make_keys(std::mt19937 &rng, size_t tokens, uint32_t heads, uint32_t d) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(tokens * heads * d);
  for (size_t t = 0; t < tokens; ++t)
    for (uint32_t h = 0; h < heads; ++h)
      for (uint32_t j = 0; j < d; ++j) {
        float v = normal(rng);
        if (j % 29 == 3) v = v * 6.0f + 8.0f;  // outlier channels
        x[(t * heads + h) * d + j] = v;
      }
  return x;
}
inline std::vector<float> make_values(std::mt19937 &rng, size_t count) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(count);
  for (float &v : x) v = normal(rng);
  return x;
}

// |a - b| <= rel * (|b| + rms(b)): relative, with the row's scale as the floor near zero.
struct Mismatch {
  size_t count = 0, first = 0;
  double worst = 0.0;         // largest |a - b| / (|b| + rms)
  double rms_relative = 0.0;  // rms(a - b) / rms(b), where computed (compare_outputs)
};
inline Mismatch compare_close(const std::vector<float> &a, const std::vector<float> &b, double rel) {
  // Infinite entries (OTT's masked slots in scores) must match exactly and stay out of the scale.
  Mismatch m;
  double sum2 = 0.0;
  size_t finite = 0;
  for (float x : b)
    if (std::isfinite(x)) {
      sum2 += double(x) * x;
      ++finite;
    }
  const double rms = finite ? std::sqrt(sum2 / double(finite)) : 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    double err;
    if (std::isinf(b[i])) {
      err = a[i] == b[i] ? 0.0 : 1e30;
    } else {
      const double scale = std::fabs(double(b[i])) + rms + 1e-30;
      err = std::isfinite(a[i]) ? std::fabs(double(a[i]) - double(b[i])) / scale : 1e30;
    }
    m.worst = std::max(m.worst, err);
    if (!(err <= rel)) {
      if (m.count == 0) m.first = i;
      ++m.count;
    }
  }
  return m;
}

// Output tolerance: 1e-3 relative, plus one unit in the last place of the output dtype (the two
// backends round slightly different fp32 results).
inline double output_tolerance(qjlkv_dtype t) {
  return 1e-3 + (t == QJLKV_DTYPE_F32 ? 0.0 : t == QJLKV_DTYPE_F16 ? 1.0 / 1024 : 1.0 / 128);
}

// Attention outputs of the two backends. The CPU may attend in integers within SPEC §9's budget
// (rms error at most 1e-3 of the output's rms), the GPU in fp32, so the two agree to
// output_tolerance in rms over the whole output, and element by element to ten times that (a wrong
// token, head or sink shows as a gross element error). A failed rms check counts as one mismatch.
inline Mismatch compare_outputs(const std::vector<float> &gpu, const std::vector<float> &cpu, qjlkv_dtype t) {
  const double tolerance = output_tolerance(t);
  Mismatch m = compare_close(gpu, cpu, 10 * tolerance);
  double error2 = 0.0, cpu2 = 0.0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    error2 += (double(gpu[i]) - cpu[i]) * (double(gpu[i]) - cpu[i]);
    cpu2 += double(cpu[i]) * cpu[i];
  }
  m.rms_relative = std::sqrt(error2 / (cpu2 + 1e-300));
  if (!(m.rms_relative <= tolerance)) ++m.count;
  return m;
}

// Two caches of one configuration, one per backend, fed the same inputs.
class CachePair {
 public:
  explicit CachePair(qjlkv_config cfg) : cfg_(cfg) {
    qjlkv_config cpu_cfg = cfg;
    cpu_cfg.backend = QJLKV_BACKEND_CPU;
    cpu_cfg.device_ordinal = 0;
    qjlkv_config gpu_cfg = cfg;
    gpu_cfg.backend = QJLKV_BACKEND_CUDA;
    gpu_cfg.device_ordinal = 0;
    status_cpu_ = qjlkv_cache_create(&cpu_cfg, &cpu_);
    status_gpu_ = qjlkv_cache_create(&gpu_cfg, &gpu_);
    if (status_gpu_ != QJLKV_OK) gpu_error_ = qjlkv_last_error_message();
  }
  ~CachePair() {
    qjlkv_cache_destroy(cpu_);
    qjlkv_cache_destroy(gpu_);
  }
  bool ok() const { return status_cpu_ == QJLKV_OK && status_gpu_ == QJLKV_OK; }
  std::string error() const { return gpu_error_; }
  const qjlkv_config &cfg() const { return cfg_; }
  qjlkv_cache *cpu() const { return cpu_; }
  qjlkv_cache *gpu() const { return gpu_; }
  size_t token_elems() const { return size_t(cfg_.num_kv_heads) * cfg_.head_dim; }
  size_t query_elems() const { return size_t(cfg_.num_q_heads) * cfg_.head_dim; }

  // Appends n tokens (keys/values as floats, encoded in the dtype) to both caches.
  void append(uint32_t layer, uint32_t seq, const std::vector<float> &keys, const std::vector<float> &values) {
    const uint32_t n = uint32_t(keys.size() / token_elems());
    const auto k = encode(keys, qjlkv_dtype(cfg_.dtype)), v = encode(values, qjlkv_dtype(cfg_.dtype));
    ASSERT_EQ(qjlkv_cache_append(cpu_, layer, seq, n, k.data(), v.data()), QJLKV_OK) << qjlkv_last_error_message();
    DeviceBytes dk(k), dv(v);
    ASSERT_EQ(qjlkv_cache_append(gpu_, layer, seq, n, dk.get(), dv.get()), QJLKV_OK) << qjlkv_last_error_message();
  }
  void append_batch(uint32_t layer, const std::vector<uint32_t> &seqs, const std::vector<float> &keys,
                    const std::vector<float> &values) {
    const auto k = encode(keys, qjlkv_dtype(cfg_.dtype)), v = encode(values, qjlkv_dtype(cfg_.dtype));
    const uint32_t n = uint32_t(seqs.size());
    ASSERT_EQ(qjlkv_cache_append_batch(cpu_, layer, n, seqs.data(), k.data(), v.data()), QJLKV_OK)
        << qjlkv_last_error_message();
    DeviceBytes dk(k), dv(v);
    ASSERT_EQ(qjlkv_cache_append_batch(gpu_, layer, n, seqs.data(), dk.get(), dv.get()), QJLKV_OK)
        << qjlkv_last_error_message();
  }

  // attend (n_queries per sequence) or attend_batch (one query per listed sequence) on both;
  // returns {cpu, gpu} outputs as floats.
  std::pair<std::vector<float>, std::vector<float>> attend(uint32_t layer, const std::vector<uint32_t> &seqs,
                                                           uint32_t n_queries, const std::vector<float> &queries,
                                                           float scale, bool batch) {
    const auto q = encode(queries, qjlkv_dtype(cfg_.dtype));
    std::vector<uint8_t> out_cpu(q.size());
    DeviceBytes dq(q), dout(q.size());
    qjlkv_status s_cpu, s_gpu;
    if (batch) {
      const uint32_t n = uint32_t(seqs.size());
      s_cpu = qjlkv_cache_attend_batch(cpu_, layer, n, seqs.data(), q.data(), scale, out_cpu.data());
      s_gpu = qjlkv_cache_attend_batch(gpu_, layer, n, seqs.data(), dq.get(), scale, dout.get());
    } else {
      s_cpu = qjlkv_cache_attend(cpu_, layer, seqs[0], n_queries, q.data(), scale, out_cpu.data());
      s_gpu = qjlkv_cache_attend(gpu_, layer, seqs[0], n_queries, dq.get(), scale, dout.get());
    }
    EXPECT_EQ(s_cpu, QJLKV_OK) << qjlkv_last_error_message();
    EXPECT_EQ(s_gpu, QJLKV_OK) << qjlkv_last_error_message();
    return {decode(out_cpu, qjlkv_dtype(cfg_.dtype)), decode(dout.download(), qjlkv_dtype(cfg_.dtype))};
  }

  std::pair<std::vector<float>, std::vector<float>> scores(uint32_t layer, uint32_t seq,
                                                           const std::vector<float> &query) {
    uint64_t length = 0;
    EXPECT_EQ(qjlkv_cache_length(cpu_, layer, seq, &length), QJLKV_OK);
    const size_t n = size_t(length) * cfg_.num_q_heads;
    std::vector<float> a(n), b(n);
    const auto q = encode(query, qjlkv_dtype(cfg_.dtype));
    DeviceBytes dq(q);
    EXPECT_EQ(qjlkv_cache_scores(cpu_, layer, seq, q.data(), a.data(), n), QJLKV_OK) << qjlkv_last_error_message();
    EXPECT_EQ(qjlkv_cache_scores(gpu_, layer, seq, dq.get(), b.data(), n), QJLKV_OK) << qjlkv_last_error_message();
    return {a, b};
  }

  // Dense reconstructions of every position: {cpu keys, gpu keys, cpu values, gpu values}.
  std::vector<std::vector<float>> reconstruct(uint32_t layer, uint32_t seq) {
    uint64_t length = 0;
    EXPECT_EQ(qjlkv_cache_length(cpu_, layer, seq, &length), QJLKV_OK);
    const size_t n = size_t(length) * token_elems();
    std::vector<std::vector<float>> r(4, std::vector<float>(n));
    EXPECT_EQ(qjlkv_cache_reconstruct(cpu_, layer, seq, 0, length, r[0].data(), r[2].data()), QJLKV_OK)
        << qjlkv_last_error_message();
    EXPECT_EQ(qjlkv_cache_reconstruct(gpu_, layer, seq, 0, length, r[1].data(), r[3].data()), QJLKV_OK)
        << qjlkv_last_error_message();
    return r;
  }

 private:
  qjlkv_config cfg_;
  qjlkv_cache *cpu_ = nullptr, *gpu_ = nullptr;
  qjlkv_status status_cpu_, status_gpu_;
  std::string gpu_error_;
};

// Elements whose bits differ (the reconstructions of equal stored bytes are bit-identical).
inline size_t count_bit_differences(const std::vector<float> &a, const std::vector<float> &b) {
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

}  // namespace gputest
