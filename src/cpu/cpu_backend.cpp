// The CPU backend: per (layer, sequence) state, the block/tail rule of SPEC §6, all-or-nothing
// appends, and fused decode attention (scores, online softmax and the value product per block).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "../cache.hpp"
#include "../error.hpp"
#include "../threads.hpp"
#include "kernels.hpp"

namespace qjlkv::cpu {
namespace {

// OTT's full-precision outlier tokens of one (sequence, kv head): slots [0, P) are the pool,
// [P, P + spill) the spill area. Allocated whole when the sequence is created, so tracing
// never allocates.
struct OutlierTokens {
  std::vector<uint8_t> keys, values;  // [P + spill][d], I/O dtype
  std::vector<uint32_t> positions;    // [P + spill]
  std::vector<float> norms;           // [P]: key L2 norms of the pool
  uint32_t pool = 0, spilled = 0;
  bool tracing = true;  // false once the spill area could not take an evicted token
};

struct Sequence {
  uint64_t length = 0;
  uint32_t blocks = 0;       // quantized blocks (per head)
  uint32_t tail_tokens = 0;  // full-precision tokens after the blocks
  std::vector<std::vector<uint8_t>> heads;  // per kv head: blocks * stride bytes
  std::vector<uint8_t> tail_keys, tail_values;  // [tail_tokens][Hkv][d], I/O dtype
  std::vector<OutlierTokens> outliers;          // per kv head, OTT-traced layers only
};

// Everything an append needs, allocated before anything visible changes.
struct AppendPlan {
  Sequence *seq = nullptr;
  bool created = false;
  uint32_t new_blocks = 0;
  uint32_t new_tail_tokens = 0;
  std::vector<std::vector<uint8_t>> grown_heads;  // replacement buffers (old bytes copied) or empty
  bool rebuild_tail = false;
  std::vector<uint8_t> new_tail_keys, new_tail_values;  // complete new tail when rebuilt
};

class CpuCache final : public qjlkv_cache {
 public:
  explicit CpuCache(CacheSpec spec)
      : qjlkv_cache(std::move(spec)), pool_(this->spec().cfg.num_threads), layers_(this->spec().cfg.num_layers) {
    const qjlkv_config &cfg = this->spec().cfg;
    token_elems_ = size_t(cfg.num_kv_heads) * cfg.head_dim;
    token_bytes_ = token_elems_ * this->spec().tail_elem;
  }

  void append(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t tokens_per_seq, const void *keys,
              const void *values) override;
  void attend(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t queries_per_seq, const void *queries,
              float scale, void *out) override;
  void scores(uint32_t layer, uint32_t seq, const void *query, float *out) override;
  void reconstruct(uint32_t layer, uint32_t seq, uint64_t first, uint64_t count, float *keys,
                   float *values) override;
  uint64_t length(uint32_t layer, uint32_t seq) const override {
    const auto &map = layers_[layer];
    const auto it = map.find(seq);
    return it == map.end() ? 0 : it->second.length;
  }
  void clear(uint32_t seq) override {
    for (auto &map : layers_) map.erase(seq);
  }
  void stats(qjlkv_stats &out) const override;
  void set_stream(void *stream) override {
    if (stream) fail(QJLKV_ERROR_UNSUPPORTED, "cuda_stream must be NULL on a CPU cache (config.device = -1)");
  }

 private:
  void check_data(const char *name, const void *data, size_t elems, bool fp16_range) const;
  void check_key_norms(const void *keys, size_t tokens) const;
  // Fills plan (whose seq is set) with the blocks to quantize and every buffer they need.
  void plan_append(AppendPlan &plan, uint32_t layer, uint32_t n_new, const uint8_t *keys,
                   const uint8_t *values) const;
  void create_heads(Sequence &seq, uint32_t layer) const;
  // OTT (SPEC §5) on one block of one head, before it is quantized: updates the pool and spill
  // area, replaces the keys/values of tokens entering the pool by the mean of the others and
  // marks their slots in `mask`.
  void trace_outliers(OutlierTokens &ott, uint64_t first_position, float *keys, float *values,
                      uint8_t *mask) const;
  // Folds the pool and spill tokens of one head into the attention rows.
  // One (sequence, kv head): quantize the plan's new blocks from the stream (old tail ++ input).
  void quantize_head(uint32_t layer, AppendPlan &plan, uint32_t head, const uint8_t *keys, const uint8_t *values,
                     float *scratch) const;
  // One (sequence, kv head) of attention: rows = queries_per_seq * group query rows.
  void attend_head(uint32_t layer, const Sequence &seq, uint32_t head, uint32_t queries_per_seq,
                   const uint8_t *queries, float scale, uint8_t *out, float *scratch) const;
  void score_block(const LayerSpec &ls, const uint8_t *block, const float *q, const float *sq, uint32_t rows,
                   float *out, float *scratch) const;
  size_t attend_scratch_floats(uint32_t layer, uint32_t rows) const;

  const Sequence &find(uint32_t layer, uint32_t seq) const {
    const auto it = layers_[layer].find(seq);
    if (it == layers_[layer].end() || it->second.length == 0)
      fail(QJLKV_ERROR_INVALID_ARGUMENT, "seq %u holds no tokens in layer %u", seq, layer);
    return it->second;
  }

  ThreadPool pool_;
  std::vector<std::unordered_map<uint32_t, Sequence>> layers_;
  size_t token_elems_ = 0;  // Hkv * d
  size_t token_bytes_ = 0;  // one token of keys (or values) in the tail
};

void CpuCache::check_data(const char *name, const void *data, size_t elems, bool fp16_range) const {
  const qjlkv_dtype dtype = spec().cfg.dtype;
  const float limit = fp16_range ? kHalfMax : std::numeric_limits<float>::max();
  for (size_t i = 0; i < elems; ++i) {
    const float x = load_element(data, i, dtype);
    if (!std::isfinite(x))
      fail(QJLKV_ERROR_INVALID_ARGUMENT, "%s[%zu] is %g: keys, values and queries must be finite", name, i, double(x));
    if (std::fabs(x) > limit)
      fail(QJLKV_ERROR_INVALID_ARGUMENT,
           "%s[%zu] is %g, outside the fp16 range (|x| <= 65504) that this configuration stores", name, i, double(x));
  }
}

void CpuCache::check_key_norms(const void *keys, size_t tokens) const {
  const uint32_t d = spec().cfg.head_dim;
  for (size_t v = 0; v < tokens * spec().cfg.num_kv_heads; ++v) {
    double norm2 = 0.0;
    for (uint32_t j = 0; j < d; ++j) {
      const double x = load_element(keys, v * d + j, spec().cfg.dtype);
      norm2 += x * x;
    }
    if (std::sqrt(norm2) > kHalfMax)
      fail(QJLKV_ERROR_INVALID_ARGUMENT, "keys: the key vector of token %zu, kv head %zu has L2 norm %g > 65504, "
           "which QJL cannot store (norms are fp16)", v / spec().cfg.num_kv_heads, v % spec().cfg.num_kv_heads,
           std::sqrt(norm2));
  }
}

void CpuCache::create_heads(Sequence &seq, uint32_t layer) const {
  const qjlkv_config &cfg = spec().cfg;
  seq.heads.resize(cfg.num_kv_heads);
  if (!spec().layers[layer].traced) return;
  const size_t slots = size_t(cfg.outlier_tokens) + cfg.outlier_spill_tokens;
  seq.outliers.resize(cfg.num_kv_heads);
  for (OutlierTokens &ott : seq.outliers) {
    ott.keys.resize(slots * cfg.head_dim * spec().io_elem);
    ott.values.resize(slots * cfg.head_dim * spec().io_elem);
    ott.positions.resize(slots);
    ott.norms.resize(cfg.outlier_tokens);
  }
}

void CpuCache::trace_outliers(OutlierTokens &ott, uint64_t first_position, float *keys, float *values,
                              uint8_t *mask) const {
  const qjlkv_config &cfg = spec().cfg;
  const uint32_t B = cfg.block_tokens, d = cfg.head_dim, P = cfg.outlier_tokens;
  // Candidates: the pool (c < pool) then the block's tokens; keep the P smallest key norms,
  // ties going to the older position.
  struct Candidate {
    float norm;
    uint64_t position;
    uint32_t index;  // < pool: pool slot; else pool + block token
  };
  Candidate candidates[4096 + 4096];
  uint32_t n = 0;
  for (uint32_t i = 0; i < ott.pool; ++i) candidates[n++] = {ott.norms[i], ott.positions[i], i};
  for (uint32_t t = 0; t < B; ++t)
    candidates[n++] = {std::sqrt(dot(keys + size_t(t) * d, keys + size_t(t) * d, d)), first_position + t, ott.pool + t};
  std::partial_sort(candidates, candidates + P, candidates + n, [](const Candidate &a, const Candidate &b) {
    return a.norm < b.norm || (a.norm == b.norm && a.position < b.position);
  });
  bool kept[4096] = {};
  uint32_t entering = 0;
  for (uint32_t i = 0; i < P; ++i) {
    if (candidates[i].index < ott.pool) kept[candidates[i].index] = true;
    else ++entering;
  }
  const uint32_t evicted = ott.pool - (P - entering);
  if (ott.spilled + evicted > cfg.outlier_spill_tokens) {
    ott.tracing = false;  // the spill area is full: this block and later ones are plain KIVI
    return;
  }
  const size_t row_bytes = size_t(d) * spec().io_elem;
  const auto copy_slot = [&](uint32_t from, uint32_t to) {
    std::memcpy(ott.keys.data() + to * row_bytes, ott.keys.data() + from * row_bytes, row_bytes);
    std::memcpy(ott.values.data() + to * row_bytes, ott.values.data() + from * row_bytes, row_bytes);
    ott.positions[to] = ott.positions[from];
  };
  // Evicted pool tokens move to the spill area; kept ones are compacted to the front.
  uint32_t kept_count = 0;
  for (uint32_t i = 0; i < ott.pool; ++i) {
    if (!kept[i]) {
      copy_slot(i, P + ott.spilled++);
      continue;
    }
    ott.norms[kept_count] = ott.norms[i];
    copy_slot(i, kept_count++);
  }
  // Entering block tokens join the pool with their original keys and values.
  bool enters[4096] = {};
  for (uint32_t i = 0; i < P; ++i) {
    if (candidates[i].index < ott.pool) continue;
    const uint32_t t = candidates[i].index - ott.pool;
    enters[t] = true;
    store_row(keys + size_t(t) * d, d, cfg.dtype, ott.keys.data(), size_t(kept_count) * d);
    store_row(values + size_t(t) * d, d, cfg.dtype, ott.values.data(), size_t(kept_count) * d);
    ott.positions[kept_count] = uint32_t(first_position + t);
    ott.norms[kept_count] = candidates[i].norm;
    ++kept_count;
  }
  ott.pool = kept_count;
  if (entering == 0) return;
  // Their slots get the per-channel mean of the block's other tokens and are masked out.
  float mean_key[256] = {}, mean_value[256] = {};
  for (uint32_t t = 0; t < B; ++t) {
    if (enters[t]) continue;
    for (uint32_t j = 0; j < d; ++j) {
      mean_key[j] += keys[size_t(t) * d + j];
      mean_value[j] += values[size_t(t) * d + j];
    }
  }
  const float inverse = 1.0f / float(B - entering);
  for (uint32_t t = 0; t < B; ++t) {
    if (!enters[t]) continue;
    for (uint32_t j = 0; j < d; ++j) {
      keys[size_t(t) * d + j] = mean_key[j] * inverse;
      values[size_t(t) * d + j] = mean_value[j] * inverse;
    }
    mask[t / 8] = uint8_t(mask[t / 8] | (1u << (t % 8)));
  }
}

void CpuCache::plan_append(AppendPlan &plan, uint32_t layer, uint32_t n_new, const uint8_t *keys,
                           const uint8_t *values) const {
  const qjlkv_config &cfg = spec().cfg;
  const size_t stride = spec().layers[layer].layout.stride;
  const Sequence &seq = *plan.seq;
  const uint64_t total = uint64_t(seq.tail_tokens) + n_new;
  const uint64_t blocks = total >= uint64_t(cfg.residual_tokens) + cfg.block_tokens
                              ? (total - cfg.residual_tokens) / cfg.block_tokens
                              : 0;
  plan.new_blocks = uint32_t(blocks);
  plan.new_tail_tokens = uint32_t(total - blocks * cfg.block_tokens);
  if (blocks > 0) {
    const size_t needed = (size_t(seq.blocks) + blocks) * stride;
    plan.grown_heads.resize(cfg.num_kv_heads);
    for (uint32_t h = 0; h < cfg.num_kv_heads; ++h) {
      const std::vector<uint8_t> &old = seq.heads[h];
      if (old.capacity() >= needed) continue;
      std::vector<uint8_t> &grown = plan.grown_heads[h];
      grown.reserve(std::max(needed, 2 * old.capacity()));
      grown.assign(old.begin(), old.end());
    }
  }
  const size_t tail_bytes = size_t(plan.new_tail_tokens) * token_bytes_;
  plan.rebuild_tail = blocks > 0 || seq.tail_keys.capacity() < tail_bytes;
  if (plan.rebuild_tail) {
    // The new tail is the end of the stream (old tail ++ input) after the quantized blocks.
    const size_t capacity = std::max(tail_bytes, size_t(cfg.residual_tokens + cfg.block_tokens) * token_bytes_);
    const size_t first = size_t(blocks) * cfg.block_tokens;  // stream index of the first tail token
    for (auto [dst, old, input] : {std::tuple{&plan.new_tail_keys, &seq.tail_keys, keys},
                                   std::tuple{&plan.new_tail_values, &seq.tail_values, values}}) {
      dst->reserve(capacity);
      if (first < seq.tail_tokens) dst->assign(old->begin() + ptrdiff_t(first * token_bytes_), old->end());
      const size_t skip = first > seq.tail_tokens ? first - seq.tail_tokens : 0;
      dst->insert(dst->end(), input + skip * token_bytes_, input + size_t(n_new) * token_bytes_);
    }
  }
}

void CpuCache::quantize_head(uint32_t layer, AppendPlan &plan, uint32_t head, const uint8_t *keys,
                             const uint8_t *values, float *scratch) const {
  const qjlkv_config &cfg = spec().cfg;
  const LayerSpec &ls = spec().layers[layer];
  const BlockLayout &layout = ls.layout;
  const uint32_t B = cfg.block_tokens, d = cfg.head_dim;
  Sequence &seq = *plan.seq;
  std::vector<uint8_t> &bytes = seq.heads[head];
  if (plan.grown_heads[head].capacity()) bytes.swap(plan.grown_heads[head]);
  const size_t old_size = size_t(seq.blocks) * layout.stride;
  bytes.resize(old_size + size_t(plan.new_blocks) * layout.stride);  // within capacity: cannot throw
  float *block_keys = scratch;                      // [B][d]
  float *block_values = block_keys + size_t(B) * d;  // [B][d]
  float *kernel_scratch = block_values + size_t(B) * d;
  for (uint32_t b = 0; b < plan.new_blocks; ++b) {
    for (uint32_t t = 0; t < B; ++t) {
      const size_t stream_index = size_t(b) * B + t;
      const bool from_tail = stream_index < seq.tail_tokens;
      const size_t token = from_tail ? stream_index : stream_index - seq.tail_tokens;
      const size_t first = token * token_elems_ + size_t(head) * d;
      load_row(from_tail ? seq.tail_keys.data() : keys, first, d, cfg.dtype, block_keys + size_t(t) * d);
      load_row(from_tail ? seq.tail_values.data() : values, first, d, cfg.dtype, block_values + size_t(t) * d);
    }
    uint8_t *block = bytes.data() + old_size + size_t(b) * layout.stride;
    std::memset(block, 0, layout.stride);
    if (ls.traced && seq.outliers[head].tracing)
      trace_outliers(seq.outliers[head], (uint64_t(seq.blocks) + b) * B, block_keys, block_values,
                     block + layout.key_mask);
    switch (cfg.key_method) {
      case QJLKV_KEYS_QJL: qjl_quantize_block(ls, cfg, block_keys, block, kernel_scratch); break;
      case QJLKV_KEYS_KIVI:
      case QJLKV_KEYS_OTT: kivi_quantize_block(cfg, layout, block_keys, block); break;
      case QJLKV_KEYS_EXACT: exact_keys_store_block(cfg, spec().stored_dtype, layout, block_keys, block); break;
    }
    values_quantize_block(cfg, spec().stored_dtype, layout, block_values, block);
  }
}

void CpuCache::append(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t tokens_per_seq,
                      const void *keys, const void *values) {
  const qjlkv_config &cfg = spec().cfg;
  const size_t tokens = size_t(n_seqs) * tokens_per_seq;
  check_data("keys", keys, tokens * token_elems_, spec().keys_need_fp16_range);
  check_data("values", values, tokens * token_elems_, spec().values_need_fp16_range);
  if (cfg.key_method == QJLKV_KEYS_QJL) check_key_norms(keys, tokens);

  const auto *key_bytes = static_cast<const uint8_t *>(keys);
  const auto *value_bytes = static_cast<const uint8_t *>(values);
  const size_t seq_input_bytes = size_t(tokens_per_seq) * token_bytes_;
  auto &map = layers_[layer];
  std::vector<AppendPlan> plans;
  std::vector<float> scratch;
  try {
    plans.reserve(n_seqs);
    for (uint32_t i = 0; i < n_seqs; ++i) {
      auto [it, created] = map.try_emplace(seqs[i]);
      AppendPlan &plan = plans.emplace_back();  // reserved: records the creation before anything can throw
      plan.seq = &it->second;
      plan.created = created;
      if (created) create_heads(it->second, layer);
      plan_append(plan, layer, tokens_per_seq, key_bytes + i * seq_input_bytes, value_bytes + i * seq_input_bytes);
    }
    const size_t per_worker = 2 * size_t(cfg.block_tokens) * cfg.head_dim + 3 * size_t(cfg.head_dim);
    scratch.resize(per_worker * pool_.size());
  } catch (...) {
    for (uint32_t i = 0; i < plans.size(); ++i)
      if (plans[i].created) map.erase(seqs[i]);
    throw;
  }

  // From here on nothing can fail: quantize every (sequence, head) in parallel, then commit.
  const size_t per_worker = scratch.size() / pool_.size();
  pool_.parallel_for(size_t(n_seqs) * cfg.num_kv_heads, [&](size_t index, unsigned worker) {
    const uint32_t i = uint32_t(index / cfg.num_kv_heads), head = uint32_t(index % cfg.num_kv_heads);
    if (plans[i].new_blocks == 0) return;
    quantize_head(layer, plans[i], head, key_bytes + i * seq_input_bytes, value_bytes + i * seq_input_bytes,
                  scratch.data() + worker * per_worker);
  });
  for (uint32_t i = 0; i < n_seqs; ++i) {
    AppendPlan &plan = plans[i];
    Sequence &seq = *plan.seq;
    if (plan.rebuild_tail) {
      seq.tail_keys.swap(plan.new_tail_keys);
      seq.tail_values.swap(plan.new_tail_values);
    } else {  // fits the capacity: appending cannot reallocate
      seq.tail_keys.insert(seq.tail_keys.end(), key_bytes + i * seq_input_bytes,
                           key_bytes + (i + 1) * seq_input_bytes);
      seq.tail_values.insert(seq.tail_values.end(), value_bytes + i * seq_input_bytes,
                             value_bytes + (i + 1) * seq_input_bytes);
    }
    seq.length += tokens_per_seq;
    seq.blocks += plan.new_blocks;
    seq.tail_tokens = plan.new_tail_tokens;
  }
}

void CpuCache::score_block(const LayerSpec &ls, const uint8_t *block, const float *q, const float *sq,
                           uint32_t rows, float *out, float *scratch) const {
  const qjlkv_config &cfg = spec().cfg;
  switch (cfg.key_method) {
    case QJLKV_KEYS_QJL: qjl_score_block(ls, cfg, spec().qjl_constant, block, q, sq, rows, out, scratch); break;
    case QJLKV_KEYS_KIVI:
    case QJLKV_KEYS_OTT: kivi_score_block(cfg, ls.layout, block, q, rows, out, scratch); break;
    case QJLKV_KEYS_EXACT:
      exact_keys_score_block(cfg, spec().stored_dtype, ls.layout, block, q, rows, out, scratch);
      break;
  }
  if (cfg.key_method != QJLKV_KEYS_OTT) return;
  // Slots whose token moved to the outlier pool must not be counted twice.
  const uint8_t *mask = block + ls.layout.key_mask;
  for (uint32_t t = 0; t < cfg.block_tokens; ++t)
    if (mask[t / 8] >> (t % 8) & 1u)
      for (uint32_t r = 0; r < rows; ++r) out[size_t(r) * cfg.block_tokens + t] = kNegInf;
}

size_t CpuCache::attend_scratch_floats(uint32_t layer, uint32_t rows) const {
  const qjlkv_config &cfg = spec().cfg;
  const size_t d = cfg.head_dim, B = cfg.block_tokens, m = spec().layers[layer].sketch_rows;
  // queries, projected queries, scores/weights, accumulators, softmax state, kernel scratch
  return rows * (d + m + B + d + 2) + 2 * m + d;
}

void CpuCache::attend_head(uint32_t layer, const Sequence &seq, uint32_t head, uint32_t queries_per_seq,
                           const uint8_t *queries, float scale, uint8_t *out, float *scratch) const {
  const qjlkv_config &cfg = spec().cfg;
  const LayerSpec &ls = spec().layers[layer];
  const uint32_t d = cfg.head_dim, B = cfg.block_tokens, G = spec().group_size, m = ls.sketch_rows;
  const uint32_t rows = queries_per_seq * G;
  float *q = scratch;                                // [rows][d]
  float *sq = q + size_t(rows) * d;                  // [rows][m]
  float *weights = sq + size_t(rows) * m;            // [rows][B]
  float *acc = weights + size_t(rows) * B;           // [rows][d]
  auto *state = reinterpret_cast<SoftmaxRow *>(acc + size_t(rows) * d);  // [rows]
  float *kernel_scratch = reinterpret_cast<float *>(state + rows);
  const size_t q_row_elems = size_t(cfg.num_q_heads) * d;
  // Row r = (query i, head h of the group); query i sits at position length - queries_per_seq + i.
  for (uint32_t i = 0; i < queries_per_seq; ++i)
    for (uint32_t g = 0; g < G; ++g) {
      const uint32_t r = i * G + g;
      load_row(queries, i * q_row_elems + size_t(head * G + g) * d, d, cfg.dtype, q + size_t(r) * d);
      if (cfg.key_method == QJLKV_KEYS_QJL) qjl_project_query(ls, d, q + size_t(r) * d, sq + size_t(r) * m);
      state[r] = SoftmaxRow{};
    }
  std::fill(acc, acc + size_t(rows) * d, 0.0f);
  const uint64_t first_query_position = seq.length - queries_per_seq;
  // Scales the raw scores of n tokens and masks those after each row's query (causal).
  const auto mask_and_scale = [&](uint32_t n, auto position_of) {
    for (uint32_t r = 0; r < rows; ++r) {
      const uint64_t query_position = first_query_position + r / G;
      for (uint32_t t = 0; t < n; ++t) {
        float &s = weights[size_t(r) * B + t];
        s = position_of(t) <= query_position ? s * scale : kNegInf;
      }
    }
  };
  const auto fold = [&](uint32_t n) {
    bool any = false;
    for (uint32_t r = 0; r < rows; ++r)
      any |= softmax_fold(state[r], weights + size_t(r) * B, n, acc + size_t(r) * d, d);
    return any;
  };
  const uint8_t *blocks = seq.heads[head].data();
  for (uint32_t b = 0; b < seq.blocks; ++b) {
    const uint8_t *block = blocks + size_t(b) * ls.layout.stride;
    score_block(ls, block, q, sq, rows, weights, kernel_scratch);
    mask_and_scale(B, [first = uint64_t(b) * B](uint32_t t) { return first + t; });
    if (fold(B)) values_accumulate_block(cfg, spec().stored_dtype, ls.layout, block, weights, rows, acc);
  }
  // Exact tokens, in chunks of B: row t of `keys`/`values` starts at element t * row_stride.
  float *v = kernel_scratch;
  const auto fold_exact = [&](const uint8_t *keys, const uint8_t *values, size_t row_stride, uint32_t count,
                              auto position_of) {
    for (uint32_t start = 0; start < count; start += B) {
      const uint32_t n = std::min(B, count - start);
      for (uint32_t t = 0; t < n; ++t) {
        load_row(keys, (start + t) * row_stride, d, cfg.dtype, v);
        for (uint32_t r = 0; r < rows; ++r) weights[size_t(r) * B + t] = dot(q + size_t(r) * d, v, d);
      }
      mask_and_scale(n, [&](uint32_t t) { return position_of(start + t); });
      if (!fold(n)) continue;
      for (uint32_t t = 0; t < n; ++t) {
        load_row(values, (start + t) * row_stride, d, cfg.dtype, v);
        for (uint32_t r = 0; r < rows; ++r) {
          const float w = weights[size_t(r) * B + t];
          float *a = acc + size_t(r) * d;
          for (uint32_t j = 0; j < d; ++j) a[j] += w * v[j];
        }
      }
    }
  };
  const size_t head_offset_bytes = size_t(head) * d * spec().io_elem;
  const uint64_t tail_start = uint64_t(seq.blocks) * B;
  fold_exact(seq.tail_keys.data() + head_offset_bytes, seq.tail_values.data() + head_offset_bytes, token_elems_,
             seq.tail_tokens, [tail_start](uint32_t t) { return tail_start + t; });
  if (!seq.outliers.empty()) {
    // OTT: the pool (slots [0, pool)) and the spill area (slots [P, P + spilled)).
    const OutlierTokens &ott = seq.outliers[head];
    const uint32_t P = cfg.outlier_tokens;
    const size_t spill_offset = size_t(P) * d * spec().io_elem;
    fold_exact(ott.keys.data(), ott.values.data(), d, ott.pool, [&](uint32_t t) { return uint64_t(ott.positions[t]); });
    fold_exact(ott.keys.data() + spill_offset, ott.values.data() + spill_offset, d, ott.spilled,
               [&](uint32_t t) { return uint64_t(ott.positions[P + t]); });
  }
  for (uint32_t r = 0; r < rows; ++r) {
    float *a = acc + size_t(r) * d;
    const float inverse = 1.0f / state[r].sum;  // every query sees at least its own position
    for (uint32_t j = 0; j < d; ++j) a[j] *= inverse;
    const uint32_t i = r / G, g = r % G;
    store_row(a, d, cfg.dtype, out, i * q_row_elems + size_t(head * G + g) * d);
  }
}

void CpuCache::attend(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t queries_per_seq,
                      const void *queries, float scale, void *out) {
  const qjlkv_config &cfg = spec().cfg;
  const size_t q_seq_elems = size_t(queries_per_seq) * cfg.num_q_heads * cfg.head_dim;
  check_data("queries", queries, n_seqs * q_seq_elems, false);
  std::vector<const Sequence *> found(n_seqs);
  for (uint32_t i = 0; i < n_seqs; ++i) {
    found[i] = &find(layer, seqs[i]);
    QJLKV_REQUIRE(queries_per_seq <= found[i]->length, "n_queries is %u, but seq %u holds only %llu tokens",
                  queries_per_seq, seqs[i], (unsigned long long)found[i]->length);
  }
  const size_t per_worker = attend_scratch_floats(layer, queries_per_seq * spec().group_size);
  std::vector<float> scratch(per_worker * pool_.size());
  const size_t q_seq_bytes = q_seq_elems * spec().io_elem;
  pool_.parallel_for(size_t(n_seqs) * cfg.num_kv_heads, [&](size_t index, unsigned worker) {
    const uint32_t i = uint32_t(index / cfg.num_kv_heads), head = uint32_t(index % cfg.num_kv_heads);
    attend_head(layer, *found[i], head, queries_per_seq, static_cast<const uint8_t *>(queries) + i * q_seq_bytes,
                scale, static_cast<uint8_t *>(out) + i * q_seq_bytes, scratch.data() + worker * per_worker);
  });
}

void CpuCache::scores(uint32_t layer, uint32_t seq_id, const void *query, float *out) {
  const qjlkv_config &cfg = spec().cfg;
  const LayerSpec &ls = spec().layers[layer];
  const uint32_t d = cfg.head_dim, B = cfg.block_tokens, G = spec().group_size, m = ls.sketch_rows;
  check_data("query", query, size_t(cfg.num_q_heads) * d, false);
  const Sequence &seq = find(layer, seq_id);
  const size_t L = seq.length;
  std::vector<float> q(size_t(G) * d), sq(size_t(G) * m), block_scores(size_t(G) * B), scratch(2 * m + d),
      key(d);
  for (uint32_t head = 0; head < cfg.num_kv_heads; ++head) {
    for (uint32_t g = 0; g < G; ++g) {
      load_row(query, size_t(head * G + g) * d, d, cfg.dtype, q.data() + size_t(g) * d);
      if (cfg.key_method == QJLKV_KEYS_QJL) qjl_project_query(ls, d, q.data() + size_t(g) * d, sq.data() + size_t(g) * m);
    }
    for (uint32_t b = 0; b < seq.blocks; ++b) {
      score_block(ls, seq.heads[head].data() + size_t(b) * ls.layout.stride, q.data(), sq.data(), G,
                  block_scores.data(), scratch.data());
      for (uint32_t g = 0; g < G; ++g)
        std::copy_n(block_scores.data() + size_t(g) * B, B, out + size_t(head * G + g) * L + size_t(b) * B);
    }
    for (uint32_t t = 0; t < seq.tail_tokens; ++t) {
      load_row(seq.tail_keys.data(), size_t(t) * token_elems_ + size_t(head) * d, d, cfg.dtype, key.data());
      for (uint32_t g = 0; g < G; ++g)
        out[size_t(head * G + g) * L + size_t(seq.blocks) * B + t] = dot(q.data() + size_t(g) * d, key.data(), d);
    }
  }
}

void CpuCache::reconstruct(uint32_t layer, uint32_t seq_id, uint64_t first, uint64_t count, float *keys_out,
                           float *values_out) {
  const qjlkv_config &cfg = spec().cfg;
  const LayerSpec &ls = spec().layers[layer];
  const uint32_t d = cfg.head_dim, B = cfg.block_tokens, Hkv = cfg.num_kv_heads;
  const Sequence &seq = find(layer, seq_id);
  const uint64_t quantized = uint64_t(seq.blocks) * B;
  for (uint64_t p = first; p < first + count; ++p) {
    for (uint32_t h = 0; h < Hkv; ++h) {
      float *k = keys_out ? keys_out + ((p - first) * Hkv + h) * d : nullptr;
      float *v = values_out ? values_out + ((p - first) * Hkv + h) * d : nullptr;
      if (p >= quantized) {
        const size_t element = size_t(p - quantized) * token_elems_ + size_t(h) * d;
        if (k) load_row(seq.tail_keys.data(), element, d, cfg.dtype, k);
        if (v) load_row(seq.tail_values.data(), element, d, cfg.dtype, v);
        continue;
      }
      const uint8_t *block = seq.heads[h].data() + size_t(p / B) * ls.layout.stride;
      const uint32_t t = uint32_t(p % B);
      if (cfg.key_method == QJLKV_KEYS_OTT && (block[ls.layout.key_mask + t / 8] >> (t % 8) & 1u)) {
        // The token lives on, exact, in the pool or the spill area.
        const OutlierTokens &ott = seq.outliers[h];
        const uint32_t P = cfg.outlier_tokens;
        for (uint32_t slot = 0; slot < P + ott.spilled; ++slot) {
          if (slot >= ott.pool && slot < P) continue;
          if (ott.positions[slot] != p) continue;
          if (k) load_row(ott.keys.data(), size_t(slot) * d, d, cfg.dtype, k);
          if (v) load_row(ott.values.data(), size_t(slot) * d, d, cfg.dtype, v);
        }
        continue;
      }
      if (k) {
        switch (cfg.key_method) {
          case QJLKV_KEYS_QJL: qjl_reconstruct_key(ls, cfg, spec().qjl_constant, block, t, k); break;
          case QJLKV_KEYS_KIVI:
          case QJLKV_KEYS_OTT: kivi_dequantize_token(cfg, ls.layout, block, t, k); break;
          case QJLKV_KEYS_EXACT:
            for (uint32_t j = 0; j < d; ++j)
              k[j] = from_16bit(at<uint16_t>(block, ls.layout.key_codes)[size_t(t) * d + j], spec().stored_dtype);
            break;
        }
      }
      if (v) values_dequantize_token(cfg, spec().stored_dtype, ls.layout, block, t, v);
    }
  }
}

void CpuCache::stats(qjlkv_stats &out) const {
  const qjlkv_config &cfg = spec().cfg;
  const uint64_t Hkv = cfg.num_kv_heads;
  uint64_t tokens = 0, keys_q = 0, values_q = 0, full = 0, meta = 0, padding = 0, allocated = 0;
  for (uint32_t l = 0; l < cfg.num_layers; ++l) {
    const BlockLayout &layout = spec().layers[l].layout;
    for (const auto &[id, seq] : layers_[l]) {
      tokens += seq.length;
      keys_q += uint64_t(seq.blocks) * Hkv * layout.key_bytes;
      values_q += uint64_t(seq.blocks) * Hkv * layout.value_bytes;
      full += 2 * uint64_t(seq.tail_tokens) * token_bytes_;
      padding += uint64_t(seq.blocks) * Hkv * (layout.stride - layout.key_bytes - layout.value_bytes);
      meta += sizeof(Sequence) + Hkv * sizeof(std::vector<uint8_t>);  // the record and its buffer headers
      for (const auto &h : seq.heads) allocated += h.capacity();
      allocated += seq.tail_keys.capacity() + seq.tail_values.capacity();
      for (const OutlierTokens &ott : seq.outliers) {
        const uint64_t per_token = 2 * token_bytes_ / Hkv + sizeof(uint32_t);  // K, V and position
        full += uint64_t(ott.pool + ott.spilled) * per_token + uint64_t(ott.pool) * sizeof(float);
        allocated += ott.keys.capacity() + ott.values.capacity() + ott.positions.capacity() * sizeof(uint32_t) +
                     ott.norms.capacity() * sizeof(float);
        meta += sizeof(OutlierTokens);
      }
    }
  }
  out.tokens = tokens;
  out.bytes_keys_quantized = keys_q;
  out.bytes_values_quantized = values_q;
  out.bytes_full_precision = full;
  out.bytes_metadata = meta + padding;  // block padding is stored, so it counts
  out.bytes_used = keys_q + values_q + full + meta + padding;
  out.bytes_reserved = allocated + meta;  // every allocated byte, used or not
  const uint64_t numbers = tokens * Hkv * cfg.head_dim * 2;
  out.bytes_fp16_equivalent = numbers * 2;
  out.bits_per_number = numbers ? double(out.bytes_used) * 8.0 / double(numbers) : 0.0;
}

}  // namespace
}  // namespace qjlkv::cpu

namespace qjlkv {
std::unique_ptr<qjlkv_cache> make_cpu_cache(CacheSpec spec) { return std::make_unique<cpu::CpuCache>(std::move(spec)); }
}  // namespace qjlkv
