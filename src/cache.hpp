// The backend interface: qjlkv_cache is an abstract class that the CPU backend (src/cpu/) and the
// CUDA backend (cuda/) implement. The C layer (api.cpp) checks everything that needs no tensor
// data before calling into a backend; backends check the data and keep every call all-or-nothing.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "config.hpp"

struct qjlkv_cache {
  explicit qjlkv_cache(qjlkv::CacheSpec spec) : spec_(std::move(spec)) {}
  virtual ~qjlkv_cache() = default;
  qjlkv_cache(const qjlkv_cache &) = delete;
  qjlkv_cache &operator=(const qjlkv_cache &) = delete;

  const qjlkv::CacheSpec &spec() const { return spec_; }

  // tokens_per_seq tokens for each of n_seqs distinct sequences; keys/values are
  // [n_seqs][tokens_per_seq][Hkv][d] in the I/O dtype (append: n_seqs = 1; append_batch: 1 token).
  virtual void append(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t tokens_per_seq,
                      const void *keys, const void *values) = 0;
  // queries_per_seq queries for each listed sequence (the last positions, causal);
  // queries/out are [n_seqs][queries_per_seq][Hq][d]. scale > 0.
  virtual void attend(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t queries_per_seq,
                      const void *queries, float scale, void *out) = 0;
  // out[h * length + position] on the host; out_len already checked against the length.
  virtual void scores(uint32_t layer, uint32_t seq, const void *query, float *out) = 0;
  // Dense float32 host reconstruction of positions [first, first + count): [count][Hkv][d] each;
  // either output may be null. The range is already checked against the length.
  virtual void reconstruct(uint32_t layer, uint32_t seq, uint64_t first, uint64_t count, float *keys,
                           float *values) = 0;
  // Length of (layer, seq); 0 when absent.
  virtual uint64_t length(uint32_t layer, uint32_t seq) const = 0;
  virtual void clear(uint32_t seq) = 0;
  // Fills tokens, bytes_reserved and the per-component byte counts; the C layer derives
  // bytes_used, bytes_fp16_equivalent and bits_per_number from them.
  virtual void stats(qjlkv_stats &out) const = 0;
  virtual void set_stream(void *stream) = 0;

 private:
  qjlkv::CacheSpec spec_;
};

namespace qjlkv {

std::unique_ptr<qjlkv_cache> make_cpu_cache(CacheSpec spec);
// Throws Error(UNSUPPORTED) in builds without CUDA or without a usable device.
std::unique_ptr<qjlkv_cache> make_cuda_cache(CacheSpec spec);

}  // namespace qjlkv
