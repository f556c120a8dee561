// The backend interface: qjlkv_cache is an abstract class that the CPU backend (src/cpu/) and the
// CUDA backend (cuda/) implement. The C layer (api.cpp) checks everything that needs no tensor
// data before calling into a backend; backends check the data and keep every call all-or-nothing.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "window.hpp"

namespace qjlkv {

class ThreadPool;

// Serialization (src/serialize.cpp, docs/FORMAT.md) sees one (layer, seq) of a backend through
// these: the portable state, independent of how a backend stores it.
// Blocks [0, freed_blocks) were freed by the layer's sliding window (positions.hpp,
// window_freed_blocks): block numbering stays, only blocks [freed_blocks, blocks) are stored.
struct PortableCounts {
  uint64_t length = 0;
  uint32_t blocks = 0, tail_tokens = 0;
  uint32_t sink_tokens = 0;  // min(length, config.sink_tokens)
  uint32_t freed_blocks = 0;
};
// The tokens a sequence keeps exact in the I/O dtype, keys (or values) [tokens][Hkv][d] each: the
// attention sinks (positions [0, sink_tokens)) and the tail (after the blocks).
enum class ExactRows { sinks, tail };
// OTT's exact outlier tokens of one (sequence, kv head): the pool's tokens, then the spill
// area's, in slot order; keys/values [pool + spilled][head_dim] in the I/O dtype.
struct PortableOutliers {
  uint32_t pool = 0, spilled = 0;
  bool tracing = true;
  std::vector<uint32_t> positions;  // [pool + spilled]
  std::vector<float> norms;         // [pool]: the pool's key L2 norms
  std::vector<uint8_t> keys, values;
};

// An import of one sequence in progress: storage the cache does not see until commit().
class PortableImport {
 public:
  virtual ~PortableImport() = default;
  // Creates the storage of (layer, seq) for `counts` (called once per layer, in order, before its
  // writes); throws OUT_OF_MEMORY leaving nothing changed.
  virtual void add_layer(uint32_t layer, const PortableCounts &counts) = 0;
  // Block b (>= counts.freed_blocks) of kv head h of the layer added last: BlockLayout::stride bytes.
  virtual void write_block(uint32_t block, uint32_t head, const uint8_t *bytes) = 0;
  // Sink or tail tokens [first, first + count) of the layer added last: keys (or values)
  // [count][Hkv][d].
  virtual void write_exact(ExactRows which, uint32_t first, uint32_t count, bool values, const uint8_t *rows) = 0;
  // OTT-traced layers: the outlier tokens of kv head h of the layer added last.
  virtual void write_outliers(uint32_t head, const PortableOutliers &outliers) = 0;
  // Waits for the writes a backend copies asynchronously (their buffers were copied already);
  // throws like the writes. Called once, after the last write and before commit().
  virtual void flush() {}
  // The growth of bytes_used that commit() will bring (the budget check of an import).
  virtual uint64_t bytes_added() const = 0;
  // Makes every added layer of the sequence visible; the target layers must still be empty.
  virtual void commit() noexcept = 0;
};

// The per-layer records (a backend's Record type) of one imported sequence, each in a map node of
// its own, so that commit() only links nodes into maps whose buckets the backend reserved
// beforehand: it cannot allocate, hence cannot fail. Both backends' PortableImport keep theirs here.
template <class Record>
class StagedLayers {
 public:
  using Map = std::unordered_map<uint32_t, Record>;
  struct Layer {
    uint32_t layer;
    typename Map::node_type node;
  };
  explicit StagedLayers(uint32_t seq) : seq_(seq) {}

  // A new, default record of the sequence for `layer`: back() from now on.
  Record &add(uint32_t layer) {
    Map holder;
    holder.try_emplace(seq_);
    layers_.push_back({layer, holder.extract(seq_)});
    return layers_.back().node.mapped();
  }
  // The layer added last, and every added one.
  Layer &back() { return layers_.back(); }
  auto begin() { return layers_.begin(); }
  auto end() { return layers_.end(); }
  auto begin() const { return layers_.begin(); }
  auto end() const { return layers_.end(); }
  // map_of(layer): the backend's map of that layer, with a bucket reserved for the record. An
  // empty record of the sequence there is replaced (the C layer checked that it holds no tokens).
  template <class MapOf>
  void commit(MapOf map_of) noexcept {
    for (Layer &staged : layers_) {
      Map &map = map_of(staged.layer);
      map.erase(seq_);
      map.insert(std::move(staged.node));
    }
    layers_.clear();
  }

 private:
  uint32_t seq_;
  std::vector<Layer> layers_;
};

}  // namespace qjlkv

namespace qjlkv {

// A layer's attention variant (qjlkv_cache_set_layer_attention), validated: the default is plain
// softmax attention.
struct LayerAttention {
  float softcap = 0.0f;            // > 0: logits s become softcap·tanh(s / softcap)
  std::vector<float> sink_logits;  // empty, or one per query head: exp(sink) joins the denominator
  uint32_t window = 0;             // > 0: the query at position p sees positions [p − window + 1, p]
};

}  // namespace qjlkv

struct qjlkv_cache {
  explicit qjlkv_cache(qjlkv::CacheSpec spec)
      : spec_(std::move(spec)), attention_(spec_.cfg.num_layers) {}
  virtual ~qjlkv_cache() = default;
  qjlkv_cache(const qjlkv_cache &) = delete;
  qjlkv_cache &operator=(const qjlkv_cache &) = delete;

  const qjlkv::CacheSpec &spec() const { return spec_; }
  const qjlkv::LayerAttention &attention(uint32_t layer) const { return attention_[layer]; }
  // Whether any sequence holds tokens in the layer (a window changes only while none does).
  virtual bool layer_holds_tokens(uint32_t layer) const = 0;
  // A backend that keeps a copy of the variant elsewhere (CUDA: the sink logits on the device)
  // prepares it first and then calls this, which cannot fail.
  virtual void set_attention(uint32_t layer, qjlkv::LayerAttention attention) {
    attention_[layer] = std::move(attention);
  }

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
  // Sequence operations (qjlkv.h, "Sequence operations"); the C layer checked the ids and that
  // `length` is within the sequence's longest layer (fork: dst holds nothing, dst != src).
  virtual void truncate(uint32_t seq, uint64_t length) = 0;
  virtual void fork(uint32_t src, uint32_t dst, uint64_t length) = 0;
  // The growth of bytes_used when n_tokens are appended to seq in every layer.
  virtual uint64_t bytes_needed(uint32_t seq, uint32_t n_tokens) const = 0;
  // What seq holds in all layers, shared blocks included, and the part of it others hold too.
  virtual void sequence_bytes(uint32_t seq, uint64_t &bytes, uint64_t &shared) const = 0;
  // stats' bytes_used, kept current by every operation (the budget checks read it per call).
  virtual uint64_t bytes_used() const = 0;
  // Fills tokens, bytes_reserved and the per-component byte counts; the C layer derives
  // bytes_used, bytes_fp16_equivalent and bits_per_number from them.
  virtual void stats(qjlkv_stats &out) const = 0;
  virtual void set_stream(void *stream) = 0;
  // CPU caches: run the parallel work of later calls on `workers` (null: the cache's own threads).
  virtual void set_workers(std::shared_ptr<qjlkv::ThreadPool> workers) = 0;

  // Serialization (src/serialize.cpp): the portable view of (layer, seq); both backends have it.
  virtual qjlkv::PortableCounts portable_counts(uint32_t layer, uint32_t seq) const = 0;
  // Block b (a stored one: b >= freed_blocks) of kv head h of (layer, seq): BlockLayout::stride
  // bytes into out.
  virtual void read_block(uint32_t layer, uint32_t seq, uint32_t block, uint32_t head, uint8_t *out) const = 0;
  // Blocks [first, first + count) of every kv head: [count][Hkv][BlockLayout::stride] bytes into
  // out. A backend whose reads synchronize (CUDA) reads the run at once.
  virtual void read_blocks(uint32_t layer, uint32_t seq, uint32_t first, uint32_t count, uint8_t *out) const {
    const size_t stride = spec().layers[layer].layout.stride, heads = spec().cfg.num_kv_heads;
    for (uint32_t b = 0; b < count; ++b)
      for (uint32_t h = 0; h < heads; ++h) read_block(layer, seq, first + b, h, out + (b * heads + h) * stride);
  }
  // Sink or tail tokens [first, first + count) of (layer, seq): keys (or values) [count][Hkv][d]
  // into out.
  virtual void read_exact(uint32_t layer, uint32_t seq, qjlkv::ExactRows which, uint32_t first, uint32_t count,
                          bool values, uint8_t *out) const = 0;
  // OTT-traced layers: the outlier tokens of kv head h of (layer, seq).
  virtual void read_outliers(uint32_t layer, uint32_t seq, uint32_t head, qjlkv::PortableOutliers &out) const = 0;
  virtual std::unique_ptr<qjlkv::PortableImport> begin_import(uint32_t seq) = 0;

 private:
  qjlkv::CacheSpec spec_;
  std::vector<qjlkv::LayerAttention> attention_;  // per layer
};

namespace qjlkv {

// Refuses, with QJLKV_ERROR_MEMORY_BUDGET, an operation that would take bytes_used above the
// config's memory_budget by adding `added` bytes.
inline void require_budget(const qjlkv_cache &c, uint64_t added, const char *what) {
  const uint64_t budget = c.spec().cfg.memory_budget, used = c.bytes_used();
  if (budget != 0 && added > 0 && (used > budget || added > budget - used))
    fail(QJLKV_ERROR_MEMORY_BUDGET,
         "%s needs %llu more bytes; the cache holds %llu of its memory_budget of %llu bytes", what,
         (unsigned long long)added, (unsigned long long)used, (unsigned long long)budget);
}

std::unique_ptr<qjlkv_cache> make_cpu_cache(CacheSpec spec);
// Throws Error(UNSUPPORTED) in builds without CUDA or without a usable device.
std::unique_ptr<qjlkv_cache> make_cuda_cache(CacheSpec spec);

}  // namespace qjlkv
