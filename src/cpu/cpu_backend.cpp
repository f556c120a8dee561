// The CPU backend: per (layer, sequence) state, the block/tail rule of SPEC §6, all-or-nothing
// appends, and fused decode attention (scores, online softmax and the value product per block).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../cache.hpp"
#include "../error.hpp"
#include "../methods/methods.hpp"
#include "../methods/ott_tracing.hpp"
#include "../positions.hpp"
#include "../threads.hpp"
#include "codec.hpp"
#include "kernels.hpp"
#include "method_kernels.hpp"
#include "simd.hpp"

namespace qjlkv::cpu {
namespace {

// OTT tracing: a token that may enter the pool (a pool slot, or pool + block token), ordered by
// ott::candidate_key.
struct TraceCandidate {
  uint64_t key;
  uint32_t index;
};
static_assert(sizeof(TraceCandidate) % sizeof(float) == 0 && alignof(TraceCandidate) <= 16);

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

// Quantized blocks live in pages of [Hkv][capacity][stride] bytes, so that a head's consecutive
// blocks lie next to each other (the kernels prefetch the next block past the one they read).
// Forked sequences share pages: holders[s] counts the sequences whose blocks include slot s. A
// sequence writes a new block into its last page only at the slot after its own last block and
// only when nobody holds that slot, so nothing shared is ever rewritten.
struct BlockPage {
  BlockPage(uint32_t slots, size_t slot_bytes) : bytes(new uint8_t[slots * slot_bytes]), capacity(slots), holders(slots, 0) {}
  std::unique_ptr<uint8_t[]> bytes;
  uint32_t capacity;
  std::vector<uint32_t> holders;
  mutable uint64_t counted = 0;  // the stats call that counted it last (stats allocates nothing)
};
struct BlockRef {
  std::shared_ptr<BlockPage> page;
  uint32_t slot = 0;
  const uint8_t *head(uint32_t h, size_t stride) const {
    return page->bytes.get() + (size_t(h) * page->capacity + slot) * stride;
  }
};

// OTT's pool of one kv head as it was before a block was traced: enough to undo the block.
struct PoolSnapshot {
  uint32_t pool = 0, spilled = 0;
  bool tracing = true;
  std::vector<uint8_t> keys, values;  // [P][d], I/O dtype
  std::vector<uint32_t> positions;    // [P]
  std::vector<float> norms;           // [P]
};

// The exact rows of a quantized block, kept while a truncate may reopen it (config.rollback_tokens):
// its keys and values as appended, before OTT's tracing, [B][Hkv][d] in the I/O dtype, and (traced
// layers) each head's pool as it was before the block. Immutable once its append commits; forks
// share it.
struct BlockHistory {
  std::vector<uint8_t> keys, values;
  std::vector<PoolSnapshot> pools;  // per kv head
  mutable uint64_t counted = 0;     // as BlockPage::counted
};

struct Sequence {
  uint64_t length = 0;
  uint64_t rollback_floor = 0;  // qjlkv.h, "Sequence operations"
  uint32_t sink_tokens = 0;  // exact tokens at positions [0, sink_tokens), before the blocks
  uint32_t tail_tokens = 0;  // full-precision tokens after the blocks
  uint32_t freed_blocks = 0;  // blocks [0, freed_blocks) left the window and were released
  std::vector<BlockRef> blocks;  // blocks [freed_blocks, block_count())
  uint32_t first_history = 0;  // history[i] holds the rows of block first_history + i
  std::vector<std::shared_ptr<const BlockHistory>> history;  // to the last block
  std::vector<uint8_t> tail_keys, tail_values;  // [tail_tokens][Hkv][d], I/O dtype
  std::vector<uint8_t> sink_keys, sink_values;  // [sink_tokens][Hkv][d], I/O dtype
  std::vector<OutlierTokens> outliers;          // per kv head, OTT-traced layers only
  uint32_t block_count() const { return freed_blocks + uint32_t(blocks.size()); }
  const BlockRef &block(uint64_t b) const { return blocks[b - freed_blocks]; }
};

// OTT's pool of one head, saved before a block is traced and put back when a truncate reopens it.
void save_pool(const OutlierTokens &ott, PoolSnapshot &saved) {
  saved.pool = ott.pool;
  saved.spilled = ott.spilled;
  saved.tracing = ott.tracing;
  std::copy_n(ott.keys.begin(), saved.keys.size(), saved.keys.begin());
  std::copy_n(ott.values.begin(), saved.values.size(), saved.values.begin());
  std::copy_n(ott.positions.begin(), saved.positions.size(), saved.positions.begin());
  std::copy_n(ott.norms.begin(), saved.norms.size(), saved.norms.begin());
}

void restore_pool(const PoolSnapshot &saved, OutlierTokens &ott) {
  ott.pool = saved.pool;
  ott.spilled = saved.spilled;  // the spill area only grows: its first `spilled` slots are as they were
  ott.tracing = saved.tracing;
  std::copy(saved.keys.begin(), saved.keys.end(), ott.keys.begin());
  std::copy(saved.values.begin(), saved.values.end(), ott.values.begin());
  std::copy(saved.positions.begin(), saved.positions.end(), ott.positions.begin());
  std::copy(saved.norms.begin(), saved.norms.end(), ott.norms.begin());
}

// Where reconstruct_positions finds the rows of one sequence of this backend.
struct SequenceRows {
  const Sequence &seq;
  size_t stride, token_bytes;
  uint32_t pool_tokens;
  const uint8_t *sink(uint64_t p, bool values) const {
    return (values ? seq.sink_values : seq.sink_keys).data() + size_t(p) * token_bytes;
  }
  const uint8_t *tail(uint64_t i, bool values) const {
    return (values ? seq.tail_values : seq.tail_keys).data() + size_t(i) * token_bytes;
  }
  const uint8_t *block(uint64_t b, uint32_t h) const { return seq.block(b).head(h, stride); }
  OutlierRows outliers(uint32_t h) const {
    const OutlierTokens &ott = seq.outliers[h];
    return {ott.pool, ott.spilled, pool_tokens, ott.positions.data(), ott.keys.data(), ott.values.data()};
  }
};

// One attend call: per (sequence, kv head) its query rows (and projected queries), split into
// tasks that each fold a run of blocks, or the head's exact tokens, into a partial softmax state.
struct AttendTask {
  uint32_t head_index;  // sequence index * Hkv + kv head
  uint32_t first_block, blocks;
  bool exact;           // the tail, OTT pool and spill tokens instead of blocks
};
struct AttendCall {
  const std::vector<const Sequence *> *seqs;
  uint32_t rows, queries_per_seq;
  float scale;
  const float *heads;   // per head: q [rows][padded d], then (QJL) S·q [rows][projected_stride]
  size_t head_floats;
};

// Runs of blocks per attend task: a fixed count (never the thread count), so that results do not
// depend on the number of threads, small enough to spread one long sequence over every core.
constexpr uint32_t kTaskTokens = 2048;

// Everything an append needs, allocated before anything visible changes.
struct AppendPlan {
  Sequence *seq = nullptr;
  bool created = false;
  uint32_t new_sinks = 0;  // the first new_sinks input tokens become sinks; the rest follow SPEC §6
  std::vector<uint8_t> new_sink_keys, new_sink_values;  // complete new sinks when new_sinks > 0
  uint32_t new_blocks = 0;
  uint32_t new_tail_tokens = 0;
  std::vector<BlockRef> new_refs;  // the slots of the new blocks, claimed (holders 1) by the plan
  // Rollback copies of the new blocks from block first_history_after on ([new_blocks - n, new_blocks)).
  uint32_t first_history_after = 0;
  std::vector<std::shared_ptr<BlockHistory>> new_history;
  bool rebuild_tail = false;
  std::vector<uint8_t> new_tail_keys, new_tail_values;  // complete new tail when rebuilt
  uint64_t growth = 0;  // of bytes_used
};

class CpuCache final : public qjlkv_cache {
 public:
  explicit CpuCache(CacheSpec spec)
      : qjlkv_cache(std::move(spec)),
        kernels_(&kernel_table(select_isa())),
        own_pool_(this->spec().cfg.num_threads, "config.num_threads"),
        pool_(&own_pool_),
        layers_(this->spec().cfg.num_layers) {
    const qjlkv_config &cfg = this->spec().cfg;
    token_elems_ = size_t(cfg.num_kv_heads) * cfg.head_dim;
    token_bytes_ = token_elems_ * this->spec().tail_elem;
    make_layer_kernels();
  }

  void append(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t tokens_per_seq, const void *keys,
              const void *values) override;
  void attend(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t queries_per_seq, const void *queries,
              float scale, void *out) override;
  void scores(uint32_t layer, uint32_t seq, const void *query, float *out) override;
  void reconstruct(uint32_t layer, uint32_t seq, uint64_t first, uint64_t count, float *keys,
                   float *values) override;
  bool layer_holds_tokens(uint32_t layer) const override { return !layers_[layer].empty(); }
  uint64_t length(uint32_t layer, uint32_t seq) const override {
    const auto &map = layers_[layer];
    const auto it = map.find(seq);
    return it == map.end() ? 0 : it->second.length;
  }
  void clear(uint32_t seq) override;
  void truncate(uint32_t seq, uint64_t length) override;
  void fork(uint32_t src, uint32_t dst, uint64_t length) override;
  uint64_t bytes_needed(uint32_t seq, uint32_t n_tokens) const override;
  void sequence_bytes(uint32_t seq, uint64_t &bytes, uint64_t &shared) const override;
  uint64_t bytes_used() const override { return used_; }
  void stats(qjlkv_stats &out) const override;
  void set_stream(void *stream) override {
    if (stream) fail(QJLKV_ERROR_UNSUPPORTED, "cuda_stream must be NULL on a CPU cache (config.backend = QJLKV_BACKEND_CPU)");
  }
  void set_workers(std::shared_ptr<ThreadPool> workers) override {
    shared_pool_ = std::move(workers);
    pool_ = shared_pool_ ? shared_pool_.get() : &own_pool_;
  }
  PortableCounts portable_counts(uint32_t layer, uint32_t seq) const override;
  void read_block(uint32_t layer, uint32_t seq, uint32_t block, uint32_t head, uint8_t *out) const override;
  void read_exact(uint32_t layer, uint32_t seq, ExactRows which, uint32_t first, uint32_t count, bool values,
                  uint8_t *out) const override;
  void read_outliers(uint32_t layer, uint32_t seq, uint32_t head, PortableOutliers &out) const override;
  std::unique_ptr<PortableImport> begin_import(uint32_t seq) override;

 private:
  friend class CpuImport;
  // Refuses non-finite elements and those beyond `limit` (a CacheSpec limit, or FLT_MAX).
  void check_data(const char *name, const void *data, size_t elems, float limit) const;
  // Refuses vectors of `tokens` tokens whose L2 norm exceeds the method's norm_limit (0: none)
  // with the method's fail_norm.
  template <class Method>
  void check_norms(Method method, const void *data, size_t tokens) const;
  // What the methods' CPU entries see of one layer.
  CpuLayer layer_context(uint32_t layer) const {
    return CpuLayer{*kernels_, spec(), spec().layers[layer], layer_kernels_[layer]};
  }
  // Fills plan (whose seq, new_blocks and new_tail_tokens are set) with every buffer the new
  // blocks and tail need.
  void plan_append(AppendPlan &plan, uint32_t layer, uint32_t n_new, const uint8_t *keys,
                   const uint8_t *values) const;
  // A traced layer's OTT pools and spill areas, allocated whole when the sequence is created.
  void create_outliers(Sequence &seq, uint32_t layer) const;
  // n free page slots for the next blocks of seq, marked held (holders 1).
  void claim_slots(uint32_t layer, const Sequence &seq, uint32_t n, std::vector<BlockRef> &refs) const;

  // ---- memory accounting: used_ is bytes_used, kept current by every change -------------------
  // One block of every kv head; one rollback copy; what a record holds that nobody shares.
  size_t slot_bytes(uint32_t layer) const { return block_slot_bytes(spec(), layer); }
  size_t history_bytes(uint32_t layer) const { return rollback_copy_bytes(spec(), layer); }
  uint64_t own_bytes(uint32_t layer, const Sequence &seq) const;
  // The change of bytes_used that appending n tokens to seq (null: a new sequence) brings.
  int64_t append_growth(uint32_t layer, const Sequence *seq, uint32_t n) const;
  void release_block(uint32_t layer, BlockRef &ref);
  void release_history(uint32_t layer, std::shared_ptr<const BlockHistory> &copy);
  // Drops the rollback copies of the blocks before `first` (the floor rose).
  void keep_history_from(uint32_t layer, Sequence &seq, uint32_t first);
  // Releases the blocks the layer's window leaves behind once an append took seq from
  // previous_length positions to its length (window_freed_blocks).
  void free_window_blocks(uint32_t layer, Sequence &seq, uint64_t previous_length);

  // ---- rollback (qjlkv.h, "Sequence operations") ---------------------------------------------
  uint32_t blocks_at(uint64_t length) const { return qjlkv::blocks_at(spec().cfg, length); }
  uint64_t rollback_floor_after(const Sequence &seq, uint64_t new_length) const {
    return qjlkv::rollback_floor_after(spec().cfg, seq.rollback_floor, new_length);
  }
  // A truncate of one record to `length` positions, planned (allocating) before it is applied
  // (not allocating, not failing).
  struct Cut {
    uint64_t length = 0, floor = 0;
    uint32_t blocks = 0, sinks = 0, tail_tokens = 0;
    bool shrink_tail = false;                     // no block reopens: the tail keeps its first tokens
    std::vector<uint8_t> tail_keys, tail_values;  // otherwise the complete new tail
    const BlockHistory *restore = nullptr;        // exact: the pools from before the first reopened block
  };
  void plan_cut(uint32_t layer, const Sequence &seq, uint64_t length, Cut &cut) const;
  // held: seq is in the cache, so what it lets go is released (a fork's staged copy holds nothing yet).
  void apply_cut(uint32_t layer, Sequence &seq, Cut &cut, bool held) noexcept;
  // Positions [first, first + count) of seq as the attention sees them, stored in the I/O dtype
  // (clamped to the range append accepts) into keys/values rows [count][Hkv][d].
  void store_reconstruction(uint32_t layer, const Sequence &seq, uint64_t first, uint32_t count, uint8_t *keys,
                            uint8_t *values) const;
  // OTT (SPEC §5) on one block of one head, before it is quantized: updates the pool and spill
  // area, replaces the keys/values of tokens entering the pool by the mean of the others and
  // marks their slots in `mask`.
  // scratch: trace_scratch_floats(), 16-byte aligned (a worker's stack may be too small for it).
  void trace_outliers(OutlierTokens &ott, uint64_t first_position, float *keys, float *values,
                      uint8_t *mask, float *scratch) const;
  size_t trace_scratch_floats() const;
  // One (sequence, kv head): quantize the plan's new blocks from the stream (old tail ++ input).
  void quantize_head(uint32_t layer, AppendPlan &plan, uint32_t head, const uint8_t *keys, const uint8_t *values,
                     float *scratch) const;
  size_t quantize_scratch_floats() const;
  void make_layer_kernels();
  // The query rows r = i * G + g (query i, head g of the group) of one kv head, zero-padded to
  // padded_dim(d), and for QJL their projections.
  void load_queries(uint32_t layer, const uint8_t *queries, uint32_t queries_per_seq, uint32_t head, float *q,
                    float *sq) const;
  size_t head_query_floats(uint32_t layer, uint32_t rows) const;
  size_t attend_worker_floats(uint32_t layer, uint32_t rows) const;
  // One task into its partial state: acc [rows][padded d], then the rows' SoftmaxRow.
  void attend_task(uint32_t layer, const AttendCall &call, const AttendTask &task, float *partial,
                   float *scratch) const;

  const Sequence &find(uint32_t layer, uint32_t seq) const {
    const auto it = layers_[layer].find(seq);
    if (it == layers_[layer].end() || it->second.length == 0)
      fail(QJLKV_ERROR_INVALID_ARGUMENT, "seq %u holds no tokens in layer %u", seq, layer);
    return it->second;
  }

  uint64_t used_ = 0;           // bytes_used (stats checks it against a full count)
  mutable uint64_t stats_epoch_ = 0;  // numbers the stats calls (BlockPage::counted)
  const KernelTable *kernels_;  // the instruction set chosen when the cache was created
  ThreadPool own_pool_;                      // config.num_threads threads
  std::shared_ptr<ThreadPool> shared_pool_;  // qjlkv_cache_set_workers, or null
  ThreadPool *pool_;                         // the one that runs the parallel work
  std::vector<std::unordered_map<uint32_t, Sequence>> layers_;
  std::vector<LayerKernels> layer_kernels_;
  size_t token_elems_ = 0;  // Hkv * d
  size_t token_bytes_ = 0;  // one token of keys (or values) in the tail
  // Buffers of attend, kept between calls (a cache is used by one thread at a time).
  std::vector<AttendTask> attend_tasks_;
  std::vector<const Sequence *> attend_found_;  // the attend call's sequences
  std::vector<uint32_t> attend_first_task_;  // per head index, and the end
  std::vector<float> attend_heads_, attend_partials_, attend_scratch_;
};

// 64-byte aligned storage for n floats inside v.
float *aligned_floats(std::vector<float> &v, size_t n) {
  v.resize(n + 16);
  const auto address = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((64 - address % 64) % 64) / sizeof(float);
}

void CpuCache::check_data(const char *name, const void *data, size_t elems, float limit) const {
  const qjlkv_dtype dtype = dtype_of(spec().cfg);
  for (size_t i = kernels_->first_invalid(data, dtype, elems, limit); i < elems; ++i) {
    const float x = load_element(data, i, dtype);
    if (!std::isfinite(x) || std::fabs(x) > limit) fail_bad_element(name, i, x, limit);
  }
}

template <class Method>
void CpuCache::check_norms(Method method, const void *data, size_t tokens) const {
  const qjlkv_config &cfg = spec().cfg;
  const double limit = method.norm_limit(cfg);
  if (limit == 0.0) return;
  const uint32_t d = cfg.head_dim;
  const float clearly_within = float(0.98 * limit * limit);  // far beyond the float sum's rounding error
  for (size_t v = 0; v < tokens * cfg.num_kv_heads; ++v) {
    if (kernels_->sum_squares(data, dtype_of(cfg), v * d, d) < clearly_within) continue;
    double norm2 = 0.0;
    for (uint32_t j = 0; j < d; ++j) {
      const double x = load_element(data, v * d + j, dtype_of(cfg));
      norm2 += x * x;
    }
    if (std::sqrt(norm2) > limit) method.fail_norm(cfg, v, std::sqrt(norm2));
  }
}

void CpuCache::create_outliers(Sequence &seq, uint32_t layer) const {
  const qjlkv_config &cfg = spec().cfg;
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
                              uint8_t *mask, float *scratch) const {
  const qjlkv_config &cfg = spec().cfg;
  const uint32_t B = cfg.block_tokens, d = cfg.head_dim, P = cfg.outlier_tokens;
  // Candidates: the pool (index < pool) then the block's tokens, the P first in candidate order
  // found by a partial sort. They and two flag arrays live in the call's scratch.
  auto *candidates = reinterpret_cast<TraceCandidate *>(scratch);
  float *block_norms = reinterpret_cast<float *>(candidates + ott.pool + B);  // [B]
  uint32_t n = 0;
  for (uint32_t i = 0; i < ott.pool; ++i)
    new (candidates + n++) TraceCandidate{ott::candidate_key(ott.norms[i], ott.positions[i]), i};
  for (uint32_t t = 0; t < B; ++t) {
    const float *key = keys + size_t(t) * d;
    block_norms[t] = ott::key_norm([&](uint32_t j) { return key[j]; }, d);
    const uint64_t order = ott::candidate_key(block_norms[t], uint32_t(first_position + t));
    new (candidates + n++) TraceCandidate{order, ott.pool + t};
  }
  std::partial_sort(candidates, candidates + P, candidates + n,
                    [](const TraceCandidate &a, const TraceCandidate &b) { return a.key < b.key; });
  uint8_t *kept = reinterpret_cast<uint8_t *>(block_norms + B);  // [pool]: the slot stays in the pool
  uint8_t *enters = kept + ott.pool;                             // [B]: the block token enters it
  std::memset(kept, 0, size_t(ott.pool) + B);
  uint32_t entering = 0;
  for (uint32_t i = 0; i < P; ++i) {
    if (candidates[i].index < ott.pool) kept[candidates[i].index] = 1;
    else ++entering;
  }
  const ott::PoolChange change = ott::pool_change(ott.pool, P, entering);
  if (!ott::spill_takes(ott.spilled, change.evicted, cfg.outlier_spill_tokens)) {
    ott.tracing = false;
    return;
  }
  const size_t row_bytes = size_t(d) * spec().io_elem;
  ott::PoolCompaction compaction(P, ott.spilled);
  for (uint32_t i = 0; i < ott.pool; ++i) {
    const uint32_t to = compaction.next(kept[i]);
    if (kept[i]) ott.norms[to] = ott.norms[i];
    std::memcpy(ott.keys.data() + to * row_bytes, ott.keys.data() + i * row_bytes, row_bytes);
    std::memcpy(ott.values.data() + to * row_bytes, ott.values.data() + i * row_bytes, row_bytes);
    ott.positions[to] = ott.positions[i];
  }
  ott.spilled += change.evicted;
  // Entering block tokens join the pool with their original keys and values, in candidate order.
  for (uint32_t rank = 0, kept_below = 0; rank < P; ++rank) {
    if (candidates[rank].index < ott.pool) {
      ++kept_below;
      continue;
    }
    const uint32_t t = candidates[rank].index - ott.pool;
    const uint32_t slot = ott::entering_slot(change.kept, rank, kept_below);
    enters[t] = 1;
    store_row(keys + size_t(t) * d, d, dtype_of(cfg), ott.keys.data(), size_t(slot) * d);
    store_row(values + size_t(t) * d, d, dtype_of(cfg), ott.values.data(), size_t(slot) * d);
    ott.positions[slot] = uint32_t(first_position + t);
    ott.norms[slot] = block_norms[t];
  }
  ott.pool = P;
  if (entering == 0) return;
  const auto moved = [&](uint32_t t) { return enters[t] != 0; };
  for (uint32_t j = 0; j < d; ++j) {
    const auto key = [&](uint32_t t) { return keys[size_t(t) * d + j]; };
    const auto value = [&](uint32_t t) { return values[size_t(t) * d + j]; };
    const float mean_key = ott::mean_of_others(key, moved, B, entering);
    const float mean_value = ott::mean_of_others(value, moved, B, entering);
    for (uint32_t t = 0; t < B; ++t)
      if (enters[t]) {
        keys[size_t(t) * d + j] = mean_key;
        values[size_t(t) * d + j] = mean_value;
      }
  }
  for (uint32_t byte = 0; byte < B / 8; ++byte) mask[byte] = ott::mask_byte(enters + 8 * byte);
}

void CpuCache::claim_slots(uint32_t layer, const Sequence &seq, uint32_t n, std::vector<BlockRef> &refs) const {
  refs.reserve(n);
  if (!seq.blocks.empty()) {  // the free slots right after the sequence's last block
    const BlockRef &last = seq.blocks.back();
    for (uint32_t s = last.slot + 1; refs.size() < n && s < last.page->capacity && last.page->holders[s] == 0; ++s)
      refs.push_back({last.page, s});
  }
  const uint32_t largest = std::max(1u, kTaskTokens / spec().cfg.block_tokens);
  while (refs.size() < n) {  // pages grow with the sequence, up to an attend task's run of blocks
    const uint32_t missing = n - uint32_t(refs.size());
    const uint32_t held = uint32_t(seq.blocks.size() + refs.size());
    const uint32_t capacity = std::min(largest, std::max(missing, held));
    auto page = std::make_shared<BlockPage>(std::max(1u, capacity), slot_bytes(layer));
    for (uint32_t s = 0; s < page->capacity && refs.size() < n; ++s) refs.push_back({page, s});
  }
  for (const BlockRef &ref : refs) ref.page->holders[ref.slot] = 1;
}

void CpuCache::plan_append(AppendPlan &plan, uint32_t layer, uint32_t n_new, const uint8_t *keys,
                           const uint8_t *values) const {
  const qjlkv_config &cfg = spec().cfg;
  const Sequence &seq = *plan.seq;
  const uint64_t blocks = plan.new_blocks;
  // Token i of the stream that the new blocks and tail come from: the old tail, then the input.
  const auto stream_row = [&](size_t i, bool value_rows) {
    if (i < seq.tail_tokens) return (value_rows ? seq.tail_values : seq.tail_keys).data() + i * token_bytes_;
    return (value_rows ? values : keys) + (i - seq.tail_tokens) * token_bytes_;
  };
  // The rollback copies kept after the append: of the blocks a truncate to the new floor may reopen.
  plan.first_history_after = blocks_at(rollback_floor_after(seq, seq.length + plan.new_sinks + n_new));
  if (blocks > 0) {
    plan.seq->blocks.reserve(seq.blocks.size() + blocks);  // capacity only: nothing visible changes
    const uint32_t first_copied = std::max(plan.first_history_after, seq.block_count());
    const uint32_t end = seq.block_count() + plan.new_blocks;
    plan.seq->history.reserve(end - std::min(plan.first_history_after, end));
    const uint32_t B = cfg.block_tokens, P = cfg.outlier_tokens;
    const size_t row = size_t(cfg.head_dim) * spec().io_elem;
    for (uint32_t b = first_copied; b < end; ++b) {
      auto copy = std::make_shared<BlockHistory>();
      copy->keys.resize(size_t(B) * token_bytes_);
      copy->values.resize(size_t(B) * token_bytes_);
      for (uint32_t t = 0; t < B; ++t) {
        const size_t i = size_t(b - seq.block_count()) * B + t;
        std::memcpy(copy->keys.data() + t * token_bytes_, stream_row(i, false), token_bytes_);
        std::memcpy(copy->values.data() + t * token_bytes_, stream_row(i, true), token_bytes_);
      }
      if (spec().layers[layer].traced) {
        copy->pools.resize(cfg.num_kv_heads);
        for (PoolSnapshot &pool : copy->pools) {
          pool.keys.resize(P * row);
          pool.values.resize(P * row);
          pool.positions.resize(P);
          pool.norms.resize(P);
        }
      }
      plan.new_history.push_back(std::move(copy));
    }
    claim_slots(layer, seq, plan.new_blocks, plan.new_refs);  // last: it marks the slots held
  }
  const size_t tail_bytes = size_t(plan.new_tail_tokens) * token_bytes_;
  plan.rebuild_tail = blocks > 0 || seq.tail_keys.capacity() < tail_bytes;
  if (plan.rebuild_tail) {
    // The new tail is the end of the stream after the quantized blocks.
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

void CpuCache::make_layer_kernels() {
  const qjlkv_config &cfg = spec().cfg;
  const uint32_t d = cfg.head_dim;
  layer_kernels_.resize(cfg.num_layers);
  for (uint32_t l = 0; l < cfg.num_layers; ++l) {
    const LayerSpec &ls = spec().layers[l];
    LayerKernels &lk = layer_kernels_[l];
    lk.values = CodesArgs{&ls.layout,          cfg.block_tokens, d, cfg.value_bits, cfg.value_group_size,
                          spec().stored_dtype, ls.value_signs.data()};
    with_key_method(cfg.key_method, [&](auto key_method) { kernels_of(key_method).prepare(spec(), ls, *kernels_, lk); });
  }
}

size_t CpuCache::trace_scratch_floats() const {
  const size_t n = size_t(spec().cfg.outlier_tokens) + spec().cfg.block_tokens;  // pool <= P
  // candidates, the block's key norms, then the two flag arrays
  return n * (sizeof(TraceCandidate) / sizeof(float)) + spec().cfg.block_tokens +
         (n + sizeof(float) - 1) / sizeof(float);
}

size_t CpuCache::quantize_scratch_floats() const {
  const qjlkv_config &cfg = spec().cfg;
  const size_t B = cfg.block_tokens, d = cfg.head_dim;
  // block keys and values, then the key method's quantizer or OTT's tracing; a multiple of 16
  // floats keeps every worker's part 64-byte aligned.
  const size_t keys = with_key_method(cfg.key_method, [&](auto key_method) {
    return kernels_of(key_method).quantize_scratch_floats(cfg);
  });
  const size_t kernel = std::max(keys, trace_scratch_floats());
  return (2 * B * d + kernel + 15) / 16 * 16;
}

void CpuCache::quantize_head(uint32_t layer, AppendPlan &plan, uint32_t head, const uint8_t *keys,
                             const uint8_t *values, float *scratch) const {
  const qjlkv_config &cfg = spec().cfg;
  const LayerSpec &ls = spec().layers[layer];
  const BlockLayout &layout = ls.layout;
  const uint32_t B = cfg.block_tokens, d = cfg.head_dim;
  const CpuLayer context = layer_context(layer);
  Sequence &seq = *plan.seq;
  float *block_keys = scratch;                      // [B][d]
  float *block_values = block_keys + size_t(B) * d;  // [B][d]
  float *kernel_scratch = block_values + size_t(B) * d;
  const uint32_t first_copied = plan.new_blocks - uint32_t(plan.new_history.size());
  for (uint32_t b = 0; b < plan.new_blocks; ++b) {
    for (uint32_t t = 0; t < B; ++t) {
      const size_t stream_index = size_t(b) * B + t;
      const bool from_tail = stream_index < seq.tail_tokens;
      const size_t token = from_tail ? stream_index : stream_index - seq.tail_tokens;
      const size_t first = token * token_elems_ + size_t(head) * d;
      kernels_->load_floats(from_tail ? seq.tail_keys.data() : keys, dtype_of(cfg), first, d, block_keys + size_t(t) * d);
      kernels_->load_floats(from_tail ? seq.tail_values.data() : values, dtype_of(cfg), first, d,
                            block_values + size_t(t) * d);
    }
    // The slot was claimed for this append alone: writing it changes nothing another sequence sees.
    uint8_t *block = const_cast<uint8_t *>(plan.new_refs[b].head(head, layout.stride));
    std::memset(block, 0, layout.stride);
    if (ls.traced) {
      OutlierTokens &ott = seq.outliers[head];
      if (b >= first_copied) save_pool(ott, plan.new_history[b - first_copied]->pools[head]);
      if (ott.tracing)
        trace_outliers(ott, cfg.sink_tokens + (uint64_t(seq.block_count()) + b) * B, block_keys, block_values,
                       block + layout.key_mask, kernel_scratch);
    }
    with_methods(cfg, [&](auto key_method, auto value_method) {
      kernels_of(key_method).quantize(context, block_keys, block, kernel_scratch);
      kernels_of(value_method).quantize(context, block_values, block);
    });
  }
}

void CpuCache::append(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t tokens_per_seq,
                      const void *keys, const void *values) {
  const qjlkv_config &cfg = spec().cfg;
  const size_t tokens = size_t(n_seqs) * tokens_per_seq;
  check_data("keys", keys, tokens * token_elems_, spec().key_limit);
  check_data("values", values, tokens * token_elems_, spec().value_limit);
  with_methods(cfg, [&](auto key_method, auto value_method) {
    check_norms(key_method, keys, tokens);
    check_norms(value_method, values, tokens);
  });

  const auto *key_bytes = static_cast<const uint8_t *>(keys);
  const auto *value_bytes = static_cast<const uint8_t *>(values);
  const size_t seq_input_bytes = size_t(tokens_per_seq) * token_bytes_;
  auto &map = layers_[layer];
  std::vector<AppendPlan> plans;
  std::vector<float> scratch;
  ThreadPool::Task quantize;  // built before the commit: a std::function may allocate
  try {
    plans.reserve(n_seqs);
    int64_t growth = 0;
    for (uint32_t i = 0; i < n_seqs; ++i) {
      const auto existing = map.find(seqs[i]);
      growth += append_growth(layer, existing == map.end() ? nullptr : &existing->second, tokens_per_seq);
      auto [it, created] = map.try_emplace(seqs[i]);
      AppendPlan &plan = plans.emplace_back();  // reserved: records the creation before anything can throw
      plan.seq = &it->second;
      plan.created = created;
      if (created) create_outliers(it->second, layer);
      const Sequence &seq = it->second;
      const AppendSplit split = split_append(cfg, seq.sink_tokens, seq.tail_tokens, tokens_per_seq);
      plan.new_sinks = split.new_sinks;
      plan.new_blocks = uint32_t(split.new_blocks);
      plan.new_tail_tokens = uint32_t(split.tail_tokens);
      if (plan.new_sinks) {
        const size_t bytes = size_t(plan.new_sinks) * token_bytes_;
        for (auto [dst, old, input] : {std::tuple{&plan.new_sink_keys, &seq.sink_keys, key_bytes},
                                       std::tuple{&plan.new_sink_values, &seq.sink_values, value_bytes}}) {
          dst->reserve(old->size() + bytes);
          dst->assign(old->begin(), old->end());
          dst->insert(dst->end(), input + i * seq_input_bytes, input + i * seq_input_bytes + bytes);
        }
      }
      const size_t skip = size_t(plan.new_sinks) * token_bytes_;
      plan_append(plan, layer, tokens_per_seq - plan.new_sinks, key_bytes + i * seq_input_bytes + skip,
                  value_bytes + i * seq_input_bytes + skip);
    }
    if (growth > 0) require_budget(*this, uint64_t(growth), n_seqs > 1 ? "append_batch" : "append");
    // Most decode appends quantize nothing: they need no scratch and no workers.
    if (std::any_of(plans.begin(), plans.end(), [](const AppendPlan &p) { return p.new_blocks > 0; })) {
      scratch.resize(quantize_scratch_floats() * pool_->size());
      quantize = [&, per_worker = scratch.size() / pool_->size()](size_t index, unsigned worker) {
        const uint32_t i = uint32_t(index / cfg.num_kv_heads), head = uint32_t(index % cfg.num_kv_heads);
        if (plans[i].new_blocks == 0) return;
        const size_t skip = size_t(plans[i].new_sinks) * token_bytes_;
        quantize_head(layer, plans[i], head, key_bytes + i * seq_input_bytes + skip,
                      value_bytes + i * seq_input_bytes + skip, scratch.data() + worker * per_worker);
      };
    }
  } catch (...) {
    for (uint32_t i = 0; i < plans.size(); ++i) {
      for (const BlockRef &ref : plans[i].new_refs) ref.page->holders[ref.slot] = 0;  // unclaimed
      if (plans[i].created) map.erase(seqs[i]);
    }
    throw;
  }

  // From here on nothing can fail: quantize every (sequence, head) in parallel, then commit.
  if (quantize) pool_->parallel_for(size_t(n_seqs) * cfg.num_kv_heads, quantize);
  for (uint32_t i = 0; i < n_seqs; ++i) {
    AppendPlan &plan = plans[i];
    Sequence &seq = *plan.seq;
    const uint64_t own_before = plan.created ? 0 : own_bytes(layer, seq);
    const size_t skip = size_t(plan.new_sinks) * token_bytes_;
    if (plan.new_sinks) {
      seq.sink_keys.swap(plan.new_sink_keys);
      seq.sink_values.swap(plan.new_sink_values);
      seq.sink_tokens += plan.new_sinks;
    }
    if (plan.rebuild_tail) {
      seq.tail_keys.swap(plan.new_tail_keys);
      seq.tail_values.swap(plan.new_tail_values);
    } else {  // fits the capacity: appending cannot reallocate
      seq.tail_keys.insert(seq.tail_keys.end(), key_bytes + i * seq_input_bytes + skip,
                           key_bytes + (i + 1) * seq_input_bytes);
      seq.tail_values.insert(seq.tail_values.end(), value_bytes + i * seq_input_bytes + skip,
                             value_bytes + (i + 1) * seq_input_bytes);
    }
    const uint64_t previous_length = seq.length;
    seq.length += tokens_per_seq;
    seq.rollback_floor = rollback_floor_after(seq, seq.length);
    seq.tail_tokens = plan.new_tail_tokens;
    for (BlockRef &ref : plan.new_refs) seq.blocks.push_back(std::move(ref));  // reserved; held since the plan
    used_ += uint64_t(plan.new_blocks) * slot_bytes(layer);
    keep_history_from(layer, seq, plan.first_history_after);
    for (auto &copy : plan.new_history) seq.history.push_back(std::move(copy));  // reserved
    used_ += plan.new_history.size() * history_bytes(layer);
    used_ += own_bytes(layer, seq) - own_before;
    free_window_blocks(layer, seq, previous_length);
  }
}

// ---- memory accounting ---------------------------------------------------------------------------
uint64_t CpuCache::own_bytes(uint32_t layer, const Sequence &seq) const {
  return sizeof(Sequence) + exact_row_bytes(spec(), layer, seq.sink_tokens, seq.tail_tokens);
}

int64_t CpuCache::append_growth(uint32_t layer, const Sequence *seq, uint32_t n) const {
  RecordCounts counts;
  if (seq)
    counts = {seq->length,      seq->rollback_floor, seq->sink_tokens,
              seq->tail_tokens, seq->block_count(),  seq->first_history, seq->freed_blocks};
  return qjlkv::append_growth(
      spec(), layer, sizeof(Sequence), seq ? &counts : nullptr, n, attention(layer).window,
      [&](uint32_t b) { return seq->history[b - seq->first_history].use_count() == 1; },
      [&](uint32_t b) { return seq->block(b).page->holders[seq->block(b).slot] == 1; });
}

void CpuCache::release_block(uint32_t layer, BlockRef &ref) {
  if (--ref.page->holders[ref.slot] == 0) used_ -= slot_bytes(layer);
  ref.page.reset();
}

void CpuCache::release_history(uint32_t layer, std::shared_ptr<const BlockHistory> &copy) {
  if (copy.use_count() == 1) used_ -= history_bytes(layer);
  copy.reset();
}

void CpuCache::keep_history_from(uint32_t layer, Sequence &seq, uint32_t first) {
  if (first <= seq.first_history) return;
  const size_t drop = std::min(size_t(first - seq.first_history), seq.history.size());
  for (size_t i = 0; i < drop; ++i) release_history(layer, seq.history[i]);
  seq.history.erase(seq.history.begin(), seq.history.begin() + ptrdiff_t(drop));
  seq.first_history = first;
}

void CpuCache::free_window_blocks(uint32_t layer, Sequence &seq, uint64_t previous_length) {
  const uint32_t freed = std::max(
      seq.freed_blocks, window_freed_blocks(spec().cfg, attention(layer).window, previous_length, seq.length));
  if (freed == seq.freed_blocks) return;
  const auto released = seq.blocks.begin() + ptrdiff_t(freed - seq.freed_blocks);
  for (auto ref = seq.blocks.begin(); ref != released; ++ref) release_block(layer, *ref);
  seq.blocks.erase(seq.blocks.begin(), released);  // moves the live refs: no allocation
  seq.freed_blocks = freed;
}

uint64_t CpuCache::bytes_needed(uint32_t seq_id, uint32_t n_tokens) const {
  int64_t growth = 0;
  for (uint32_t l = 0; l < spec().cfg.num_layers; ++l) {
    const auto it = layers_[l].find(seq_id);
    growth += append_growth(l, it == layers_[l].end() ? nullptr : &it->second, n_tokens);
  }
  return growth > 0 ? uint64_t(growth) : 0;
}

void CpuCache::sequence_bytes(uint32_t seq_id, uint64_t &bytes, uint64_t &shared) const {
  bytes = shared = 0;
  for (uint32_t l = 0; l < spec().cfg.num_layers; ++l) {
    const auto it = layers_[l].find(seq_id);
    if (it == layers_[l].end()) continue;
    const Sequence &seq = it->second;
    bytes += own_bytes(l, seq);
    for (const BlockRef &ref : seq.blocks) {
      bytes += slot_bytes(l);
      if (ref.page->holders[ref.slot] > 1) shared += slot_bytes(l);
    }
    for (const auto &copy : seq.history) {
      bytes += history_bytes(l);
      if (copy.use_count() > 1) shared += history_bytes(l);
    }
  }
}

// ---- sequence operations -------------------------------------------------------------------------

void CpuCache::store_reconstruction(uint32_t layer, const Sequence &seq, uint64_t first, uint32_t count,
                                    uint8_t *keys, uint8_t *values) const {
  SequenceRows rows{seq, spec().layers[layer].layout.stride, token_bytes_, spec().cfg.outlier_tokens};
  qjlkv::store_reconstruction(spec(), layer, seq.sink_tokens, seq.block_count(), first, count, rows, keys, values);
}

void CpuCache::plan_cut(uint32_t layer, const Sequence &seq, uint64_t length, Cut &cut) const {
  const qjlkv_config &cfg = spec().cfg;
  const uint32_t B = cfg.block_tokens;
  cut.length = length;
  if (length == 0) return;
  cut.floor = std::min(seq.rollback_floor, length);
  cut.sinks = uint32_t(std::min<uint64_t>(length, seq.sink_tokens));
  cut.blocks = blocks_at(length);
  if (cut.blocks < seq.block_count() && cut.blocks >= seq.first_history)
    cut.restore = seq.history[cut.blocks - seq.first_history].get();
  if (length <= cut.sinks) return;
  const uint64_t tail_start = cfg.sink_tokens + uint64_t(cut.blocks) * B;
  const uint64_t old_tail_start = cfg.sink_tokens + uint64_t(seq.block_count()) * B;
  cut.tail_tokens = uint32_t(length - tail_start);
  cut.shrink_tail = cut.blocks == seq.block_count();  // the usual rollback: the tail only gets shorter
  if (cut.shrink_tail) return;
  const size_t capacity = std::max(size_t(cut.tail_tokens), size_t(cfg.residual_tokens + B)) * token_bytes_;
  cut.tail_keys.reserve(capacity);
  cut.tail_values.reserve(capacity);
  cut.tail_keys.resize(size_t(cut.tail_tokens) * token_bytes_);
  cut.tail_values.resize(cut.tail_keys.size());
  // Reopened blocks without a rollback copy (a truncate below the floor): their reconstruction.
  const uint64_t copied_start = cfg.sink_tokens + uint64_t(seq.first_history) * B;
  if (tail_start < std::min(copied_start, old_tail_start))
    store_reconstruction(layer, seq, tail_start, uint32_t(std::min({copied_start, old_tail_start, length}) - tail_start),
                         cut.tail_keys.data(), cut.tail_values.data());
  for (uint64_t p = std::max(tail_start, std::min(copied_start, old_tail_start)); p < length; ++p) {
    const size_t to = size_t(p - tail_start) * token_bytes_;
    if (p >= old_tail_start) {
      const size_t from = size_t(p - old_tail_start) * token_bytes_;
      std::memcpy(cut.tail_keys.data() + to, seq.tail_keys.data() + from, token_bytes_);
      std::memcpy(cut.tail_values.data() + to, seq.tail_values.data() + from, token_bytes_);
      continue;
    }
    const uint64_t b = (p - cfg.sink_tokens) / B, t = (p - cfg.sink_tokens) % B;
    const BlockHistory &copy = *seq.history[b - seq.first_history];
    std::memcpy(cut.tail_keys.data() + to, copy.keys.data() + t * token_bytes_, token_bytes_);
    std::memcpy(cut.tail_values.data() + to, copy.values.data() + t * token_bytes_, token_bytes_);
  }
}

void CpuCache::apply_cut(uint32_t layer, Sequence &seq, Cut &cut, bool held) noexcept {
  const qjlkv_config &cfg = spec().cfg;
  const uint32_t old_blocks = seq.block_count();
  if (cut.blocks < old_blocks && spec().layers[layer].traced) {
    const uint64_t reopened_from = cfg.sink_tokens + uint64_t(cut.blocks) * cfg.block_tokens;
    for (uint32_t h = 0; h < cfg.num_kv_heads; ++h) {
      OutlierTokens &ott = seq.outliers[h];
      if (cut.restore) {
        restore_pool(cut.restore->pools[h], ott);
        continue;
      }
      // No copy of the pool from then: the reopened blocks' tokens leave it (their rows are in the tail).
      drop_outliers_from(reopened_from, cfg.outlier_tokens, ott.pool, ott.spilled, ott.positions.data(),
                         ott.norms.data(), ott.keys.data(), ott.values.data(), size_t(cfg.head_dim) * spec().io_elem);
    }
  }
  // The C layer refuses cuts that would reopen a freed block: cut.blocks >= freed_blocks.
  const auto kept_end = seq.blocks.begin() + ptrdiff_t(cut.blocks - seq.freed_blocks);
  if (held)
    for (auto ref = kept_end; ref != seq.blocks.end(); ++ref) release_block(layer, *ref);
  seq.blocks.erase(kept_end, seq.blocks.end());
  const size_t kept_copies = cut.blocks > seq.first_history ? std::min(size_t(cut.blocks - seq.first_history), seq.history.size()) : 0;
  for (size_t i = kept_copies; i < seq.history.size(); ++i)
    if (held) release_history(layer, seq.history[i]);
  seq.history.erase(seq.history.begin() + ptrdiff_t(kept_copies), seq.history.end());
  seq.first_history = std::min(seq.first_history, cut.blocks);
  seq.sink_keys.resize(size_t(cut.sinks) * token_bytes_);  // shrinks: no allocation
  seq.sink_values.resize(seq.sink_keys.size());
  seq.sink_tokens = cut.sinks;
  if (cut.shrink_tail) {  // no allocation: the vectors only shrink
    seq.tail_keys.resize(size_t(cut.tail_tokens) * token_bytes_);
    seq.tail_values.resize(seq.tail_keys.size());
  } else {
    seq.tail_keys.swap(cut.tail_keys);
    seq.tail_values.swap(cut.tail_values);
  }
  seq.tail_tokens = cut.tail_tokens;
  seq.length = cut.length;
  seq.rollback_floor = cut.floor;
}

void CpuCache::clear(uint32_t seq_id) {
  for (uint32_t l = 0; l < spec().cfg.num_layers; ++l) {
    const auto it = layers_[l].find(seq_id);
    if (it == layers_[l].end()) continue;
    Sequence &seq = it->second;
    used_ -= own_bytes(l, seq);
    for (BlockRef &ref : seq.blocks) release_block(l, ref);
    for (auto &copy : seq.history) release_history(l, copy);
    layers_[l].erase(it);
  }
}

void CpuCache::truncate(uint32_t seq_id, uint64_t length) {
  if (length == 0) return clear(seq_id);  // allocates nothing, so it cannot fail
  std::vector<std::pair<uint32_t, Cut>> cuts;
  for (uint32_t l = 0; l < spec().cfg.num_layers; ++l) {
    const auto it = layers_[l].find(seq_id);
    if (it == layers_[l].end() || it->second.length <= length) continue;
    plan_cut(l, it->second, length, cuts.emplace_back(l, Cut{}).second);
  }
  for (auto &[l, cut] : cuts) {  // nothing fails from here on
    Sequence &seq = layers_[l].find(seq_id)->second;
    const uint64_t own_before = own_bytes(l, seq);
    apply_cut(l, seq, cut, true);
    used_ += own_bytes(l, seq) - own_before;
  }
}

void CpuCache::fork(uint32_t src_id, uint32_t dst_id, uint64_t length) {
  using Map = std::unordered_map<uint32_t, Sequence>;
  struct Staged {
    uint32_t layer;
    Map::node_type node;
  };
  std::vector<Staged> staged;
  uint64_t growth = 0;
  for (uint32_t l = 0; l < spec().cfg.num_layers; ++l) {
    const auto it = layers_[l].find(src_id);
    if (it == layers_[l].end()) continue;
    Map holder;
    holder.try_emplace(dst_id, it->second);  // shares the blocks and rollback copies, copies the exact rows
    Sequence &copy = holder.begin()->second;
    if (length < copy.length) {
      Cut cut;
      plan_cut(l, copy, length, cut);
      apply_cut(l, copy, cut, false);
    }
    growth += own_bytes(l, copy);
    layers_[l].reserve(layers_[l].size() + 1);  // so that the commit's insert cannot allocate
    staged.push_back({l, holder.extract(dst_id)});
  }
  require_budget(*this, growth, "fork");
  for (Staged &s : staged) {  // nothing fails from here on
    const Sequence &copy = s.node.mapped();
    for (const BlockRef &ref : copy.blocks) ++ref.page->holders[ref.slot];  // src holds them too: no new bytes
    used_ += own_bytes(s.layer, copy);
    layers_[s.layer].insert(std::move(s.node));
  }
}

size_t CpuCache::head_query_floats(uint32_t layer, uint32_t rows) const {
  const size_t sq = with_key_method(spec().cfg.key_method, [&](auto key_method) {
    return kernels_of(key_method).projected_query_floats(layer_kernels_[layer]);
  });
  return size_t(rows) * (padded_dim(spec().cfg.head_dim) + sq);
}

void CpuCache::load_queries(uint32_t layer, const uint8_t *queries, uint32_t queries_per_seq, uint32_t head,
                            float *q, float *sq) const {
  const qjlkv_config &cfg = spec().cfg;
  const uint32_t d = cfg.head_dim, dp = padded_dim(d), G = spec().group_size;
  const size_t q_row_elems = size_t(cfg.num_q_heads) * d;
  for (uint32_t i = 0; i < queries_per_seq; ++i)
    for (uint32_t g = 0; g < G; ++g) {
      float *row = q + size_t(i * G + g) * dp;
      load_row(queries, i * q_row_elems + size_t(head * G + g) * d, d, dtype_of(cfg), row);
      std::fill(row + d, row + dp, 0.0f);
    }
  with_key_method(cfg.key_method, [&](auto key_method) {
    kernels_of(key_method).project_queries(layer_context(layer), q, queries_per_seq * G, sq);
  });
}

size_t CpuCache::attend_worker_floats(uint32_t layer, uint32_t rows) const {
  const LayerSpec &ls = spec().layers[layer];
  const size_t weights = size_t(rows) * padded_tokens(spec().cfg.block_tokens);
  const size_t merged = 2 * size_t(padded_dim(spec().cfg.head_dim));  // exact part, rotated part
  return weights + std::max(kernel_scratch_floats(spec().cfg, ls.m, ls.m_out), merged) + 16;
}

void CpuCache::attend_task(uint32_t layer, const AttendCall &call, const AttendTask &task, float *partial,
                           float *scratch) const {
  const qjlkv_config &cfg = spec().cfg;
  const LayerKernels &lk = layer_kernels_[layer];
  const KernelTable &K = *kernels_;
  const uint32_t d = cfg.head_dim, dp = padded_dim(d), B = cfg.block_tokens, G = spec().group_size;
  const uint32_t rows = call.rows, Bp = padded_tokens(B), head = task.head_index % cfg.num_kv_heads;
  const Sequence &seq = *(*call.seqs)[task.head_index / cfg.num_kv_heads];
  const float *q = call.heads + task.head_index * call.head_floats;
  const float *sq = q + size_t(rows) * dp;
  float *acc = partial;
  auto *state = reinterpret_cast<SoftmaxRow *>(partial + size_t(rows) * dp);
  std::fill(acc, acc + size_t(rows) * dp, 0.0f);
  std::fill(state, state + rows, SoftmaxRow{});
  float *weights = scratch;  // [rows][Bp]
  float *kernel_scratch = weights + size_t(rows) * Bp;
  const uint64_t first_query_position = seq.length - call.queries_per_seq;
  // Soft-capping (qjlkv_layer_attention): the logits scale·s become cap·tanh(scale·s/cap) as the
  // scores of n tokens are made, and the fold then takes them unscaled.
  const float softcap = attention(layer).softcap, fold_scale = softcap > 0.0f ? 1.0f : call.scale;
  const auto cap_scores = [&](uint32_t n) {
    if (softcap == 0.0f) return;
    const float inside = call.scale / softcap;
    for (uint32_t r = 0; r < rows; ++r)
      for (uint32_t t = 0; t < n; ++t) {
        float &w = weights[size_t(r) * Bp + t];
        w = w == kNegInf ? kNegInf : softcap * std::tanh(inside * w);
      }
  };
  // Causal masking of n scored tokens, for the rows whose query comes before some of them, and
  // the window's: positions before a row's window start.
  const uint32_t window = attention(layer).window;
  const auto mask_causal = [&](uint32_t n, auto position_of) {
    for (uint32_t r = 0; r < rows; ++r) {
      const uint64_t query_position = first_query_position + r / G, start = window_start(query_position, window);
      for (uint32_t t = 0; t < n; ++t)
        if (const uint64_t p = position_of(t); p > query_position || p < start) weights[size_t(r) * Bp + t] = kNegInf;
    }
  };
  if (!task.exact) {
    const size_t stride = lk.values.layout->stride;
    const uint32_t end = task.first_block + task.blocks;
    const CpuLayer context = layer_context(layer);
    with_methods(cfg, [&](auto key_method, auto value_method) {
      for (uint32_t b = task.first_block; b < end; ++b) {
        const uint8_t *block = seq.block(b).head(head, stride);  // the kernels prefetch the next one (simd.hpp)
        kernels_of(key_method).score(context, block, q, sq, rows, weights, Bp, kernel_scratch);
        cap_scores(B);
        const uint64_t first = seq.sink_tokens + uint64_t(b) * B;
        if (first + B - 1 > first_query_position || first < window_start(seq.length - 1, window))
          mask_causal(B, [first](uint32_t t) { return first + t; });
        if (K.softmax_fold(state, weights, Bp, rows, B, fold_scale, acc, d))
          kernels_of(value_method).accumulate(context, block, weights, Bp, rows, acc, kernel_scratch);
      }
      kernels_of(value_method).in_channel_order(context, rows, acc);
    });
    return;
  }
  // Exact tokens in chunks of B: row t of keys/values starts at element t * row_stride.
  const size_t io = spec().io_elem;
  const auto fold_exact = [&](const uint8_t *keys, const uint8_t *values, size_t row_stride, uint32_t count,
                              auto position_of) {
    for (uint32_t start = 0; start < count; start += B) {
      const uint32_t n = std::min(B, count - start);
      const size_t offset = start * row_stride * io;
      K.dense.scores(keys + offset, dtype_of(cfg), row_stride, n, d, q, rows, weights, Bp);
      cap_scores(n);
      mask_causal(n, [&](uint32_t t) { return position_of(start + t); });
      if (K.softmax_fold(state, weights, Bp, rows, n, fold_scale, acc, d))
        K.dense.values(values + offset, dtype_of(cfg), row_stride, n, d, weights, Bp, rows, acc);
    }
  };
  const size_t head_offset_bytes = size_t(head) * d * io;
  // An empty sink store or tail may have no buffer: no offset from its null data().
  if (seq.sink_tokens > 0)
    fold_exact(seq.sink_keys.data() + head_offset_bytes, seq.sink_values.data() + head_offset_bytes, token_elems_,
               seq.sink_tokens, [](uint32_t t) { return uint64_t(t); });
  const uint64_t tail_start = seq.sink_tokens + uint64_t(seq.block_count()) * B;
  if (seq.tail_tokens > 0)
    fold_exact(seq.tail_keys.data() + head_offset_bytes, seq.tail_values.data() + head_offset_bytes, token_elems_,
               seq.tail_tokens, [tail_start](uint32_t t) { return tail_start + t; });
  if (!seq.outliers.empty()) {
    // OTT: the pool (slots [0, pool)) and the spill area (slots [P, P + spilled)).
    const OutlierTokens &ott = seq.outliers[head];
    const uint32_t P = cfg.outlier_tokens;
    const size_t spill_offset = size_t(P) * d * io;
    fold_exact(ott.keys.data(), ott.values.data(), d, ott.pool, [&](uint32_t t) { return uint64_t(ott.positions[t]); });
    fold_exact(ott.keys.data() + spill_offset, ott.values.data() + spill_offset, d, ott.spilled,
               [&](uint32_t t) { return uint64_t(ott.positions[P + t]); });
  }
}

void CpuCache::attend(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t queries_per_seq,
                      const void *queries, float scale, void *out) {
  const qjlkv_config &cfg = spec().cfg;
  const size_t q_seq_elems = size_t(queries_per_seq) * cfg.num_q_heads * cfg.head_dim;
  std::vector<const Sequence *> &found = attend_found_;  // reused: no allocation once it is large enough
  found.resize(n_seqs);
  for (uint32_t i = 0; i < n_seqs; ++i) {
    found[i] = &find(layer, seqs[i]);
    QJLKV_REQUIRE(queries_per_seq <= found[i]->length, "n_queries is %u, but seq %u holds only %llu tokens",
                  queries_per_seq, seqs[i], (unsigned long long)found[i]->length);
  }
  check_data("queries", queries, n_seqs * q_seq_elems, std::numeric_limits<float>::max());  // only once their count is known to be sane
  const uint32_t Hkv = cfg.num_kv_heads, d = cfg.head_dim, dp = padded_dim(d), G = spec().group_size;
  const uint32_t rows = queries_per_seq * G, run = std::max(1u, kTaskTokens / cfg.block_tokens);
  const uint32_t heads = n_seqs * Hkv;
  attend_tasks_.clear();
  attend_first_task_.clear();
  const uint32_t window = attention(layer).window;
  for (uint32_t index = 0; index < heads; ++index) {
    attend_first_task_.push_back(uint32_t(attend_tasks_.size()));
    const Sequence &seq = *found[index / Hkv];
    const uint32_t blocks = seq.block_count();
    // The blocks that end before the first query's window starts take no part.
    const uint32_t first =
        blocks_before(window_start(seq.length - queries_per_seq, window), seq.sink_tokens, cfg.block_tokens, blocks);
    // The C layer refused queries whose window reaches a freed block.
    if (first < seq.freed_blocks) fail(QJLKV_ERROR_INTERNAL, "attend: a query's window reaches a freed block");
    for (uint32_t b = first; b < blocks; b += run) attend_tasks_.push_back({index, b, std::min(run, blocks - b), false});
    attend_tasks_.push_back({index, 0, 0, true});
  }
  attend_first_task_.push_back(uint32_t(attend_tasks_.size()));
  const size_t head_floats = head_query_floats(layer, rows);
  const size_t partial_floats = (size_t(rows) * (dp + 2) + 15) / 16 * 16;
  const size_t worker_floats = (attend_worker_floats(layer, rows) + 15) / 16 * 16;
  float *head_buffers = aligned_floats(attend_heads_, head_floats * heads);
  float *partials = aligned_floats(attend_partials_, partial_floats * attend_tasks_.size());
  float *worker_scratch = aligned_floats(attend_scratch_, worker_floats * pool_->size());
  const auto *query_bytes = static_cast<const uint8_t *>(queries);
  const size_t q_seq_bytes = q_seq_elems * spec().io_elem;
  // 1: queries (and projections) per head; 2: the tasks; 3: per head, merge the tasks in order.
  // The workers stay awake from one phase to the next (another_follows).
  pool_->parallel_for(
      heads,
      [&](size_t index, unsigned) {
        float *q = head_buffers + index * head_floats;
        load_queries(layer, query_bytes + (index / Hkv) * q_seq_bytes, queries_per_seq, uint32_t(index % Hkv), q,
                     q + size_t(rows) * dp);
      },
      true);
  const AttendCall call{&found, rows, queries_per_seq, scale, head_buffers, head_floats};
  pool_->parallel_for(
      attend_tasks_.size(),
      [&](size_t index, unsigned worker) {
        attend_task(layer, call, attend_tasks_[index], partials + index * partial_floats,
                    worker_scratch + worker * worker_floats);
      },
      true);
  const size_t q_row_elems = size_t(cfg.num_q_heads) * d;
  // Logits beyond the float range (huge queries or scale) give inf − inf: refuse rather than
  // return NaN, naming the first such row.
  std::atomic<uint64_t> overflow{~uint64_t(0)};
  pool_->parallel_for(heads, [&](size_t index, unsigned worker) {
    float *merged = worker_scratch + worker * worker_floats;
    float *merged_rotated = merged + dp;  // rotated Lloyd-Max values: Σ p·v̂_rot, rotated back once
    const bool rotated = with_value_method(cfg.value_method, [](auto value_method) { return value_method.kRotated; });
    const uint32_t head = uint32_t(index % Hkv), first = attend_first_task_[index], end = attend_first_task_[index + 1];
    const std::vector<float> &sinks = attention(layer).sink_logits;
    for (uint32_t r = 0; r < rows; ++r) {
      float top = kNegInf;
      for (uint32_t t = first; t < end; ++t)
        top = std::max(top, reinterpret_cast<const SoftmaxRow *>(partials + t * partial_floats + size_t(rows) * dp)[r].max);
      // A learned sink logit: one more term of the denominator, attending to no value.
      const float sink = sinks.empty() ? kNegInf : sinks[head * G + r % G];
      top = std::max(top, sink);
      float sum = sink == kNegInf ? 0.0f : std::exp(sink - top);
      std::fill(merged, merged + d, 0.0f);
      std::fill(merged_rotated, merged_rotated + d, 0.0f);
      for (uint32_t t = first; t < end; ++t) {
        const float *acc = partials + t * partial_floats;
        const SoftmaxRow &part = reinterpret_cast<const SoftmaxRow *>(acc + size_t(rows) * dp)[r];
        if (part.max == kNegInf) continue;
        const float factor = std::exp(part.max - top);
        sum += part.sum * factor;
        float *into = rotated && !attend_tasks_[t].exact ? merged_rotated : merged;
        for (uint32_t j = 0; j < d; ++j) into[j] += factor * acc[size_t(r) * dp + j];
      }
      if (rotated) {
        kernels_->rotate_inverse(spec().layers[layer].value_signs.data(), d, merged_rotated);
        for (uint32_t j = 0; j < d; ++j) merged[j] += merged_rotated[j];
      }
      if (!std::isfinite(top) || !std::isfinite(sum)) {
        const uint64_t row_id = uint64_t(index) * rows + r;
        for (uint64_t seen = overflow.load(); row_id < seen && !overflow.compare_exchange_weak(seen, row_id);) {
        }
        continue;
      }
      const float inverse = 1.0f / sum;  // every query sees at least its own position
      for (uint32_t j = 0; j < d; ++j) merged[j] *= inverse;
      const uint32_t i = r / G, g = r % G;
      uint8_t *row_out = static_cast<uint8_t *>(out) + (index / Hkv) * q_seq_bytes +
                         (i * q_row_elems + size_t(head * G + g) * d) * spec().io_elem;
      if (dtype_of(cfg) == QJLKV_DTYPE_F32) std::memcpy(row_out, merged, d * sizeof(float));
      else kernels_->store_16bit(merged, d, dtype_of(cfg), reinterpret_cast<uint16_t *>(row_out));  // inf stays inf
    }
  });
  if (const uint64_t row_id = overflow.load(); row_id != ~uint64_t(0)) {
    const uint64_t index = row_id / rows;
    const uint32_t r = uint32_t(row_id % rows);
    fail(QJLKV_ERROR_INVALID_ARGUMENT,
         "queries, scale: the attention logits of seq %u, query %u, query head %u exceed the float range "
         "(scale %g); scale the queries or the scale down",
         seqs[index / Hkv], r / G, uint32_t(index % Hkv) * G + r % G, double(scale));
  }
}

void CpuCache::scores(uint32_t layer, uint32_t seq_id, const void *query, float *out) {
  const qjlkv_config &cfg = spec().cfg;
  const uint32_t d = cfg.head_dim, dp = padded_dim(d), B = cfg.block_tokens, G = spec().group_size;
  const uint32_t Bp = padded_tokens(B);
  check_data("query", query, size_t(cfg.num_q_heads) * d, std::numeric_limits<float>::max());
  const Sequence &seq = find(layer, seq_id);
  const size_t L = seq.length;
  std::vector<float> q_storage, scratch_storage;
  float *q = aligned_floats(q_storage, head_query_floats(layer, G));
  float *weights = aligned_floats(scratch_storage, attend_worker_floats(layer, G));
  float *kernel_scratch = weights + size_t(G) * Bp;
  for (uint32_t head = 0; head < cfg.num_kv_heads; ++head) {
    load_queries(layer, static_cast<const uint8_t *>(query), 1, head, q, q + size_t(G) * dp);
    float *head_out = out + size_t(head) * G * L;
    if (seq.sink_tokens > 0)
      kernels_->dense.scores(seq.sink_keys.data() + size_t(head) * d * spec().io_elem, dtype_of(cfg), token_elems_,
                             seq.sink_tokens, d, q, G, head_out, L);
    float *blocks_out = head_out + seq.sink_tokens;
    with_key_method(cfg.key_method, [&](auto key_method) {
      const size_t stride = spec().layers[layer].layout.stride;
      const CpuLayer context = layer_context(layer);
      for (uint32_t g = 0; g < G; ++g)  // freed blocks: no score
        std::fill_n(blocks_out + g * L, size_t(seq.freed_blocks) * B, kNegInf);
      for (uint32_t b = seq.freed_blocks; b < seq.block_count(); ++b) {
        kernels_of(key_method).score(context, seq.block(b).head(head, stride), q, q + size_t(G) * dp, G, weights, Bp,
                         kernel_scratch);
        for (uint32_t g = 0; g < G; ++g) std::copy_n(weights + size_t(g) * Bp, B, blocks_out + g * L + size_t(b) * B);
      }
    });
    if (seq.tail_tokens > 0)
      kernels_->dense.scores(seq.tail_keys.data() + size_t(head) * d * spec().io_elem, dtype_of(cfg), token_elems_,
                             seq.tail_tokens, d, q, G, blocks_out + size_t(seq.block_count()) * B, L);
  }
}

void CpuCache::reconstruct(uint32_t layer, uint32_t seq_id, uint64_t first, uint64_t count, float *keys_out,
                           float *values_out) {
  const Sequence &seq = find(layer, seq_id);
  SequenceRows rows{seq, spec().layers[layer].layout.stride, token_bytes_, spec().cfg.outlier_tokens};
  reconstruct_positions(spec(), layer, seq.sink_tokens, seq.block_count(), first, count, rows, keys_out, values_out);
}

void CpuCache::stats(qjlkv_stats &out) const {
  const qjlkv_config &cfg = spec().cfg;
  const uint64_t Hkv = cfg.num_kv_heads;
  uint64_t tokens = 0, keys_q = 0, values_q = 0, full = 0, meta = 0, padding = 0, rollback = 0, shared = 0,
           allocated = 0;
  // Pages and rollback copies are counted once, however many sequences hold them.
  const uint64_t epoch = ++stats_epoch_;
  for (uint32_t l = 0; l < cfg.num_layers; ++l) {
    const BlockLayout &layout = spec().layers[l].layout;
    for (const auto &[id, seq] : layers_[l]) {
      tokens += seq.length - uint64_t(seq.freed_blocks) * cfg.block_tokens;  // freed positions are not held
      const uint64_t own = own_bytes(l, seq);
      meta += sizeof(Sequence);
      full += own - sizeof(Sequence);
      allocated += sizeof(Sequence);  // the block and copy lists are bookkeeping, not cache data
      allocated += seq.tail_keys.capacity() + seq.tail_values.capacity();
      allocated += seq.sink_keys.capacity() + seq.sink_values.capacity();
      for (const OutlierTokens &ott : seq.outliers)
        allocated += ott.keys.capacity() + ott.values.capacity() + ott.positions.capacity() * sizeof(uint32_t) +
                     ott.norms.capacity() * sizeof(float);
      for (const BlockRef &ref : seq.blocks) {
        if (std::exchange(ref.page->counted, epoch) == epoch) continue;
        allocated += uint64_t(ref.page->capacity) * slot_bytes(l) + sizeof(BlockPage) +
                     ref.page->capacity * sizeof(uint32_t);
        for (uint32_t holders : ref.page->holders) {
          if (holders == 0) continue;
          keys_q += Hkv * layout.key_bytes;
          values_q += Hkv * layout.value_bytes;
          padding += Hkv * (layout.stride - layout.key_bytes - layout.value_bytes);
          if (holders > 1) shared += slot_bytes(l);
        }
      }
      for (const auto &copy : seq.history) {
        if (std::exchange(copy->counted, epoch) == epoch) continue;
        rollback += history_bytes(l);
        allocated += history_bytes(l) + sizeof(BlockHistory);
        if (copy.use_count() > 1) shared += history_bytes(l);
      }
    }
  }
  out.tokens = tokens;
  out.bytes_keys_quantized = keys_q;
  out.bytes_values_quantized = values_q;
  out.bytes_full_precision = full;
  out.bytes_metadata = meta + padding;  // block padding is stored, so it counts
  out.bytes_rollback = rollback;
  out.bytes_shared = shared;
  out.bytes_reserved = allocated;  // every allocated byte, used or not
}

// ---- serialization (src/serialize.cpp) --------------------------------------------------------
PortableCounts CpuCache::portable_counts(uint32_t layer, uint32_t seq_id) const {
  const auto it = layers_[layer].find(seq_id);
  if (it == layers_[layer].end()) return {};
  const Sequence &seq = it->second;
  return {seq.length, seq.block_count(), seq.tail_tokens, seq.sink_tokens, seq.freed_blocks};
}

void CpuCache::read_block(uint32_t layer, uint32_t seq_id, uint32_t block, uint32_t head, uint8_t *out) const {
  const size_t stride = spec().layers[layer].layout.stride;
  std::memcpy(out, find(layer, seq_id).block(block).head(head, stride), stride);
}

// The buffer of one kind of exact rows of a sequence.
template <class S>
auto &exact_rows(S &seq, ExactRows which, bool values) {
  if (which == ExactRows::sinks) return values ? seq.sink_values : seq.sink_keys;
  return values ? seq.tail_values : seq.tail_keys;
}

void CpuCache::read_exact(uint32_t layer, uint32_t seq_id, ExactRows which, uint32_t first, uint32_t count,
                          bool values, uint8_t *out) const {
  const std::vector<uint8_t> &rows = exact_rows(find(layer, seq_id), which, values);
  std::memcpy(out, rows.data() + size_t(first) * token_bytes_, size_t(count) * token_bytes_);
}

void CpuCache::read_outliers(uint32_t layer, uint32_t seq_id, uint32_t head, PortableOutliers &out) const {
  const OutlierTokens &ott = find(layer, seq_id).outliers[head];
  const size_t row = size_t(spec().cfg.head_dim) * spec().io_elem, P = spec().cfg.outlier_tokens;
  out.pool = ott.pool;
  out.spilled = ott.spilled;
  out.tracing = ott.tracing;
  out.norms.assign(ott.norms.begin(), ott.norms.begin() + ott.pool);
  out.positions.assign(ott.positions.begin(), ott.positions.begin() + ott.pool);
  out.positions.insert(out.positions.end(), ott.positions.begin() + P, ott.positions.begin() + P + ott.spilled);
  for (auto [dst, src] : {std::pair{&out.keys, &ott.keys}, std::pair{&out.values, &ott.values}}) {
    dst->assign(src->begin(), src->begin() + ptrdiff_t(ott.pool * row));
    dst->insert(dst->end(), src->begin() + ptrdiff_t(P * row), src->begin() + ptrdiff_t((P + ott.spilled) * row));
  }
}

// The layers of one imported sequence, staged (StagedLayers) until commit().
class CpuImport final : public PortableImport {
 public:
  CpuImport(CpuCache &cache, uint32_t seq) : cache_(cache), layers_(seq) {}

  void add_layer(uint32_t layer, const PortableCounts &counts) override {
    const CacheSpec &spec = cache_.spec();
    Sequence &seq = layers_.add(layer);
    seq.length = counts.length;
    seq.rollback_floor = counts.length;  // no rollback copies travel in a stream
    seq.first_history = counts.blocks;
    seq.tail_tokens = counts.tail_tokens;
    seq.sink_tokens = counts.sink_tokens;
    seq.freed_blocks = counts.freed_blocks;
    cache_.create_outliers(seq, layer);
    if (const uint32_t stored = counts.blocks - counts.freed_blocks; stored > 0) {  // one page, held by this sequence alone
      auto page = std::make_shared<BlockPage>(stored, cache_.slot_bytes(layer));
      seq.blocks.reserve(stored);
      for (uint32_t b = 0; b < stored; ++b) {
        page->holders[b] = 1;
        seq.blocks.push_back({page, b});
      }
    }
    // The capacity an append leaves, so that the next appends allocate as they would have.
    const size_t tail_bytes = size_t(counts.tail_tokens) * cache_.token_bytes_;
    const size_t capacity =
        std::max(tail_bytes, size_t(spec.cfg.residual_tokens + spec.cfg.block_tokens) * cache_.token_bytes_);
    for (auto *tail : {&seq.tail_keys, &seq.tail_values}) {
      tail->reserve(capacity);
      tail->resize(tail_bytes);
    }
    // Sinks are allocated exactly, as appends leave them.
    seq.sink_keys.resize(size_t(counts.sink_tokens) * cache_.token_bytes_);
    seq.sink_values.resize(seq.sink_keys.size());
    cache_.layers_[layer].reserve(cache_.layers_[layer].size() + 1);
  }
  void write_block(uint32_t block, uint32_t head, const uint8_t *bytes) override {
    const size_t stride = cache_.spec().layers[layers_.back().layer].layout.stride;
    std::memcpy(const_cast<uint8_t *>(current().block(block).head(head, stride)), bytes, stride);
  }
  void write_exact(ExactRows which, uint32_t first, uint32_t count, bool values, const uint8_t *rows) override {
    const size_t token = cache_.token_bytes_;
    std::memcpy(exact_rows(current(), which, values).data() + size_t(first) * token, rows, size_t(count) * token);
  }
  void write_outliers(uint32_t head, const PortableOutliers &in) override {
    OutlierTokens &ott = current().outliers[head];
    const size_t row = size_t(cache_.spec().cfg.head_dim) * cache_.spec().io_elem;
    const uint32_t P = cache_.spec().cfg.outlier_tokens;
    ott.pool = in.pool;
    ott.spilled = in.spilled;
    ott.tracing = in.tracing;
    std::copy_n(in.norms.begin(), in.pool, ott.norms.begin());
    std::copy_n(in.positions.begin(), in.pool, ott.positions.begin());
    std::copy_n(in.positions.begin() + in.pool, in.spilled, ott.positions.begin() + P);
    for (auto [dst, src] : {std::pair{&ott.keys, &in.keys}, std::pair{&ott.values, &in.values}}) {
      std::copy_n(src->begin(), in.pool * row, dst->begin());
      std::copy_n(src->begin() + ptrdiff_t(in.pool * row), in.spilled * row, dst->begin() + ptrdiff_t(P * row));
    }
  }
  uint64_t bytes_added() const override {
    uint64_t bytes = 0;
    for (const auto &staged : layers_) {
      const Sequence &seq = staged.node.mapped();
      bytes += cache_.own_bytes(staged.layer, seq) + seq.blocks.size() * cache_.slot_bytes(staged.layer);
    }
    return bytes;
  }
  void commit() noexcept override {
    cache_.used_ += bytes_added();  // the layers it fills hold nothing (the C layer checked)
    layers_.commit([this](uint32_t layer) -> auto & { return cache_.layers_[layer]; });
  }

 private:
  Sequence &current() { return layers_.back().node.mapped(); }

  CpuCache &cache_;
  StagedLayers<Sequence> layers_;
};

std::unique_ptr<PortableImport> CpuCache::begin_import(uint32_t seq) { return std::make_unique<CpuImport>(*this, seq); }

}  // namespace
}  // namespace qjlkv::cpu

namespace qjlkv {
std::unique_ptr<qjlkv_cache> make_cpu_cache(CacheSpec spec) { return std::make_unique<cpu::CpuCache>(std::move(spec)); }
}  // namespace qjlkv
