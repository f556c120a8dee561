// The CUDA backend: the cache lives on one GPU, tensor pointers are device pointers, and all work
// is ordered on the cache's stream (qjlkv_cache_set_stream).
//
// Memory. Per layer, quantized blocks (all kv heads of a block in one slot, each head in the CPU
// backend's BlockLayout) and per-sequence tail rings come from slot pools that grow geometrically
// in a private stream-ordered memory pool; per-sequence block tables grow by doubling. A tail ring
// holds residual_tokens + block_tokens tokens: position p sits in slot p % ring, so appending
// never moves tokens. Growth is the only allocation on the append path; attend allocates nothing
// once its scratch buffer has reached the size the calls need.
//
// Sequence operations (qjlkv.h). Block slots and rollback copies (CopyLayout: the exact rows of
// a recently quantized block and the OTT pools from before it) are reference counted on the host
// (SlotPool): a fork copies the block table and holds the same slots, and an append writes its
// blocks into fresh slots only, so nothing shared is ever rewritten. Sinks, tail rings and OTT
// states are per sequence (a fork copies them on the device). A truncate that reopens blocks
// builds the new tail in a fresh ring and the pools in the other OTT side, and switches to them
// only once everything is enqueued: every operation stays all-or-nothing.
//
// Synchronization. append validates the data on the device (finite, within the fp16 range where
// stored quantized, QJL key norms) and must read the verdict before committing, to stay
// all-or-nothing: that is one host synchronization per append, overlapped with the quantization
// of the new blocks (which only write slots nobody sees until the commit). attend and
// attend_batch never synchronize the host: they do not reject non-finite queries (that would need
// a read-back); such queries give NaN outputs for the heads they reach. scores() synchronizes (it
// writes host memory) and rejects non-finite queries like the CPU backend.
//
// Launch counts. append / append_batch: 1 memset, 1 upload, validate + quantize + commit kernels,
// 1 read-back. attend / attend_batch: 1 upload, the split kernel and the reduction kernel. Neither
// depends on the number of sequences.
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

#include "cache.hpp"
#include "elements.hpp"
#include "device_memory.hpp"
#include "error.hpp"
#include "kernels.hpp"
#include "methods/methods.hpp"
#include "positions.hpp"

namespace qjlkv::cuda {
namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct SeqState {
  uint32_t length = 0, blocks = 0;
  uint32_t sinks = 0;           // min(length, config.sink_tokens): positions [0, sinks)
  uint32_t rollback_floor = 0;  // qjlkv.h, "Sequence operations"
  uint8_t *sink = nullptr;      // sinks: keys [S][Hkv][d], then values, in the input dtype
  // Blocks [0, freed_blocks) left the layer's window and went back to the pool: their host table
  // entries are 0, the device table's stale or 0; the kernels start at freed_blocks and never
  // read them.
  uint32_t freed_blocks = 0;
  std::vector<uint64_t> table;  // host copy of the block table: slot addresses
  DeviceBuffer table_dev;       // the block table the kernels read
  uint32_t first_copy = 0;      // copies[i]: the rollback copy of block first_copy + i, to the last block
  std::vector<uint8_t *> copies;
  uint8_t *ring = nullptr;      // tail ring: keys [ring][Hkv][d], then values, in the input dtype
  // OTT-traced layers: two outlier states ([Hkv] heads each); `ott_side` is the committed one,
  // valid once a block was traced (ott_ready).
  uint8_t *ott = nullptr;
  uint32_t ott_side = 0;
  bool ott_ready = false;
};

struct LayerState {
  KernelShape shape{};
  uint32_t max_rows = 1;  // query rows per attention CTA that fit the device's shared memory
  DeviceBuffer sketch_t;
  DeviceBuffer value_signs;  // rotated Lloyd-Max values: the rotation's signs [d]
  // The sink logits of the layer's attention variant, [Hq] (allocated by the first variant that has
  // them, rewritten in stream order by later ones; read while attention(layer) has sinks).
  DeviceBuffer sink_logits;
  std::unique_ptr<SlotPool> blocks, rings, otts, sinks;  // otts: traced layers only; sinks: sink_tokens > 0
  std::unique_ptr<SlotPool> copies;                      // rollback copies (CopyLayout)
  std::unordered_map<uint32_t, SeqState> seqs;
  size_t key_bytes = 0, value_bytes = 0;  // BlockLayout sizes, for the statistics
};

// What an append reserves before anything becomes visible (CudaCache::plan_append).
struct AppendPlan {
  struct Seq {
    uint32_t id = 0;
    SeqState *seq = nullptr;
    bool created = false;
    uint32_t new_sinks = 0;   // the first new_sinks input tokens become sinks ...
    uint32_t n_after = 0;     // ... the other n_after follow the tail rule
    uint32_t new_blocks = 0;
    size_t first_slot = 0;     // into `slots`
    // Rollback copies kept after the append: of blocks [first_copy_after, blocks); the new blocks
    // among them get copies[first_copy, first_copy + new_copies).
    uint32_t first_copy_after = 0;
    size_t first_copy = 0, new_copies = 0;
    DeviceBuffer grown_table;  // replaces seq->table_dev when the table must grow
  };
  std::vector<Seq> seqs;
  std::vector<uint8_t *> slots, copies;  // the new blocks' slots and rollback copies
  size_t quant_jobs = 0, ott_jobs = 0;
  // The job lists, uploaded in one copy: quantize jobs, commit jobs, new table entries, OTT jobs.
  size_t commit_offset = 0, entries_offset = 0, ott_offset = 0, blob_bytes = 0;
  uint8_t *blob_host = nullptr;  // in the pinned upload ring
  uint8_t *blob_dev = nullptr;   // in the scratch buffer
};

int device_attribute(cudaDeviceAttr attribute, int device, const char *what) {
  int value = 0;
  check_cuda(cudaDeviceGetAttribute(&value, attribute, device), what);
  return value;
}

class CudaCache final : public qjlkv_cache {
 public:
  explicit CudaCache(CacheSpec spec);
  ~CudaCache() override { release_all(); }

  void append(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t tokens_per_seq, const void *keys,
              const void *values) override;
  void attend(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t queries_per_seq, const void *queries,
              float scale, void *out) override {
    DeviceGuard guard(device_);
    run_attention(layer, seqs, n_seqs, queries_per_seq, queries, scale, out, nullptr);
  }
  void scores(uint32_t layer, uint32_t seq, const void *query, float *out) override;
  void reconstruct(uint32_t layer, uint32_t seq, uint64_t first, uint64_t count, float *keys,
                   float *values) override;
  bool layer_holds_tokens(uint32_t layer) const override { return !layers_[layer].seqs.empty(); }
  uint64_t length(uint32_t layer, uint32_t seq) const override {
    const auto &map = layers_[layer].seqs;
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
  void set_stream(void *stream) override;
  void set_attention(uint32_t layer, LayerAttention attention) override;
  void set_workers(std::shared_ptr<ThreadPool> workers) override {
    if (workers)
      fail(QJLKV_ERROR_UNSUPPORTED, "workers must be NULL on a CUDA cache (config.backend = QJLKV_BACKEND_CUDA): "
           "its work runs on the device");
  }

  // Serialization (src/serialize.cpp writes and reads the stream): the stored bytes come to the
  // host and go back as they are.
  PortableCounts portable_counts(uint32_t layer, uint32_t seq) const override;
  void read_block(uint32_t layer, uint32_t seq, uint32_t block, uint32_t head, uint8_t *out) const override;
  void read_blocks(uint32_t layer, uint32_t seq, uint32_t first, uint32_t count, uint8_t *out) const override;
  void read_exact(uint32_t layer, uint32_t seq, ExactRows which, uint32_t first, uint32_t count, bool values,
                  uint8_t *out) const override;
  void read_outliers(uint32_t layer, uint32_t seq, uint32_t head, PortableOutliers &out) const override;
  std::unique_ptr<PortableImport> begin_import(uint32_t seq) override;

 private:
  friend class CudaImport;
  void init();
  void release_all() noexcept;
  void init_layer(uint32_t l, size_t smem_optin);
  unsigned long long *device_flags() const { return static_cast<unsigned long long *>(scratch_.data); }
  // One sequence's sinks of keys (or values): config.sink_tokens tokens.
  size_t sink_bytes() const { return size_t(spec().cfg.sink_tokens) * token_bytes_; }
  // The outlier state of side `side` of a sequence ([Hkv] heads).
  uint8_t *ott_state(const LayerState &layer, const SeqState &seq, uint32_t side) const {
    return seq.ott + size_t(side) * layer.shape.Hkv * layer.shape.ott.bytes;
  }
  // The committed outlier state of a sequence (downloaded): [Hkv][ott.bytes], empty if none.
  std::vector<uint8_t> download_ott(const LayerState &layer, const SeqState &seq) const;
  // Device-to-host copy ordered after the cache's work, then a wait (error and diagnostic paths).
  void download(void *host, const void *device, size_t bytes) const;
  // Element `index` of a device tensor in the I/O dtype (error paths only).
  float read_element(const void *tensor, size_t index) const;
  [[noreturn]] void fail_data(const char *name, const void *tensor, unsigned long long index, float limit) const;
  void run_attention(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t queries_per_seq,
                     const void *queries, float scale, void *out, float *scores_host);
  // append, step by step: plan_append reserves everything (nothing visible changes),
  // write_append_jobs fills the job lists, validate_and_quantize checks the data and quantizes into
  // the reserved slots (the host sync), commit_append makes the result visible; rollback_append
  // gives back what plan_append reserved when a step before the commit fails.
  void plan_append(uint32_t layer, const uint32_t *seqs, uint32_t n_seqs, uint32_t tokens_per_seq, AppendPlan &plan);
  void write_append_jobs(const LayerState &layer, const AppendPlan &plan, uint32_t tokens_per_seq, const void *keys,
                         const void *values) const;
  void validate_and_quantize(const LayerState &layer, const AppendPlan &plan, uint32_t tokens_per_seq,
                             const void *keys, const void *values);
  void commit_append(uint32_t layer, AppendPlan &plan, uint32_t tokens_per_seq);
  void rollback_append(LayerState &layer, AppendPlan &plan) noexcept;
  const SeqState &find(uint32_t layer, uint32_t seq) const {
    const auto it = layers_[layer].seqs.find(seq);
    if (it == layers_[layer].seqs.end() || it->second.length == 0)
      fail(QJLKV_ERROR_INVALID_ARGUMENT, "seq %u holds no tokens in layer %u", seq, layer);
    return it->second;
  }

  // Positions [first, first + count) after the sinks in tail ring `ring`: their keys (or values)
  // are in ring slots (first + i) % ring; fn(device pointer, count, index of the first) per
  // contiguous run of slots (at most two).
  template <class Fn>
  void for_ring_runs(const LayerState &layer, uint8_t *ring, uint32_t first, uint32_t count, bool values,
                     Fn fn) const {
    const uint32_t capacity = layer.shape.ring;
    uint8_t *base = ring + (values ? ring_bytes_ / 2 : 0);
    for (uint32_t done = 0; done < count;) {
      const uint32_t slot = (first + done) % capacity;
      const uint32_t run = std::min(count - done, capacity - slot);
      fn(base + size_t(slot) * token_bytes_, run, done);
      done += run;
    }
  }
  // Tail tokens [first, first + count) after the blocks of seq.
  template <class Fn>
  void for_tail_runs(const LayerState &layer, const SeqState &seq, uint32_t first, uint32_t count, bool values,
                     Fn fn) const {
    for_ring_runs(layer, seq.ring, seq.blocks * layer.shape.B + first, count, values, fn);
  }
  // Host to device through the pinned upload ring: `host` is copied when this returns, the device
  // copy runs asynchronously (the ring waits only when a whole ring is in flight).
  void upload(void *device, const void *host, size_t bytes) const;
  void copy_on_device(void *to, const void *from, size_t bytes) const {
    check_cuda(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync (on the device)");
  }

  // Host copies of what reconstruct_positions reads of one sequence (the methods' CPU decoders
  // read the stored bytes): the sinks and the tail ring where [first, first + count) needs them,
  // the committed outlier state, and one block slot (all kv heads) at a time.
  struct HostRows {
    const CudaCache &cache;
    const LayerState &layer;
    const SeqState &seq;
    std::vector<uint8_t> sinks, ring, slot, ott;
    uint64_t slot_block = ~0ull;
    const uint8_t *sink(uint64_t p, bool values) const {  // keys [S][Hkv][d], then values
      return sinks.data() + (values ? cache.sink_bytes() : 0) + size_t(p) * cache.token_bytes_;
    }
    const uint8_t *tail(uint64_t i, bool values) const {  // ring slot (blocks·B + i) % ring; values half a ring later
      const uint64_t slot_index = (uint64_t(seq.blocks) * layer.shape.B + i) % layer.shape.ring;
      return ring.data() + (values ? cache.ring_bytes_ / 2 : 0) + size_t(slot_index) * cache.token_bytes_;
    }
    const uint8_t *block(uint64_t b, uint32_t h) {
      if (b != slot_block) {
        slot_block = b;
        cache.download(slot.data(), reinterpret_cast<const void *>(seq.table[b]), slot.size());
      }
      return slot.data() + size_t(h) * layer.shape.head_stride;
    }
    OutlierRows outliers(uint32_t h) const {
      const OttLayout &o = layer.shape.ott;
      const uint8_t *state = ott.data() + size_t(h) * o.bytes;
      const auto *header = reinterpret_cast<const uint32_t *>(state);
      return {header[0], header[1], layer.shape.ott_pool, reinterpret_cast<const uint32_t *>(state + o.positions),
              state + o.keys, state + o.values};
    }
  };
  HostRows host_rows(const LayerState &layer, const SeqState &seq, uint64_t first, uint64_t count) const;

  // ---- memory accounting: used_ is bytes_used, kept current by every change -------------------
  // The sizes the CPU backend counts (positions.hpp); a record takes sizeof(SeqState).
  size_t slot_bytes(uint32_t layer) const { return block_slot_bytes(spec(), layer); }
  size_t copy_bytes(uint32_t layer) const { return rollback_copy_bytes(spec(), layer); }
  uint32_t tail_tokens(const SeqState &seq) const { return seq.length - seq.sinks - seq.blocks * spec().cfg.block_tokens; }
  uint64_t own_bytes(uint32_t layer, const SeqState &seq) const {
    return sizeof(SeqState) + exact_row_bytes(spec(), layer, seq.sinks, tail_tokens(seq));
  }
  RecordCounts counts_of(const SeqState &seq) const {
    return {seq.length, seq.rollback_floor, seq.sinks, tail_tokens(seq), seq.blocks, seq.first_copy, seq.freed_blocks};
  }
  // The change of bytes_used that appending n tokens to seq (null: a new sequence) brings.
  int64_t append_growth(uint32_t layer, const SeqState *seq, uint32_t n) const;
  void release_block(uint32_t layer, uint64_t slot) noexcept {
    if (layers_[layer].blocks->give(reinterpret_cast<const uint8_t *>(slot))) used_ -= slot_bytes(layer);
  }
  void release_copy(uint32_t layer, const uint8_t *copy) noexcept {
    if (layers_[layer].copies->give(copy)) used_ -= copy_bytes(layer);
  }
  // Drops the rollback copies of the blocks before `first` (the floor rose).
  void keep_copies_from(uint32_t layer, SeqState &seq, uint32_t first) noexcept;
  // Releases the blocks the layer's window leaves behind once an append took seq from
  // previous_length positions to its length (window_freed_blocks).
  void free_window_blocks(uint32_t layer, SeqState &seq, uint32_t previous_length) noexcept;
  // The storage a record holds alone (sinks, ring, OTT states, device table) back to the pools.
  void give_own_storage(LayerState &layer, SeqState &seq) noexcept;
  // Everything a record in the cache holds, released (its blocks and copies once no one holds them).
  void release_record(uint32_t layer, SeqState &seq) noexcept;

  // ---- rollback (qjlkv.h, "Sequence operations") ---------------------------------------------
  // A truncate of one record to `length` positions: planned (allocating, enqueuing device copies
  // into storage nobody sees) before it is applied (not allocating, not failing).
  struct Cut {
    uint32_t length = 0, floor = 0, blocks = 0, sinks = 0;
    uint8_t *ring = nullptr;    // a fresh tail ring holding the new tail, or null: the ring stays
    bool other_ott = false;     // the other OTT side holds the pools after the cut
  };
  void plan_cut(uint32_t layer, const SeqState &seq, uint32_t length, Cut &cut);
  // held: seq is in the cache, so what it lets go is released (a fork's staged copy holds nothing yet).
  void apply_cut(uint32_t layer, SeqState &seq, const Cut &cut, bool held) noexcept;

  uint64_t used_ = 0;  // bytes_used (stats checks it against a full count)
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t switch_event_ = nullptr;
  unsigned long long *flags_host_ = nullptr;  // pinned: the validation verdict
  uint32_t sm_count_ = 1;
  size_t token_bytes_ = 0;  // one token of keys (or values), all kv heads, input dtype
  size_t ring_bytes_ = 0;   // one tail ring slot: keys then values
  std::unique_ptr<DevicePool> pool_;
  std::unique_ptr<UploadRing> upload_;
  DeviceBuffer scratch_;  // per call: validation flags, job lists, descriptors, partial results
  std::vector<LayerState> layers_;
};

CudaCache::CudaCache(CacheSpec spec) : qjlkv_cache(std::move(spec)) {
  device_ = int(this->spec().cfg.device_ordinal);  // below the device count: make_cuda_cache checked
  try {
    init();
  } catch (...) {
    release_all();
    throw;
  }
}

void CudaCache::init() {
  DeviceGuard guard(device_);
  const qjlkv_config &cfg = spec().cfg;
  const int major = device_attribute(cudaDevAttrComputeCapabilityMajor, device_, "cudaDeviceGetAttribute");
  const int minor = device_attribute(cudaDevAttrComputeCapabilityMinor, device_, "cudaDeviceGetAttribute");
  if (major < 8)
    fail(QJLKV_ERROR_UNSUPPORTED,
         "config.device_ordinal %d has compute capability %d.%d; the CUDA backend needs 8.0 or newer", device_, major, minor);
  const cudaError_t probe = probe_kernels();
  if (probe != cudaSuccess) {
    (void)cudaGetLastError();
    fail(QJLKV_ERROR_UNSUPPORTED, "config.device_ordinal %d (compute capability %d.%d) cannot run this build's kernels: %s (%s)",
         device_, major, minor, cudaGetErrorName(probe), cudaGetErrorString(probe));
  }
  if (!device_attribute(cudaDevAttrMemoryPoolsSupported, device_, "cudaDeviceGetAttribute"))
    fail(QJLKV_ERROR_UNSUPPORTED, "config.device_ordinal %d does not support stream-ordered memory pools", device_);
  sm_count_ = uint32_t(device_attribute(cudaDevAttrMultiProcessorCount, device_, "cudaDeviceGetAttribute"));
  const size_t smem_optin =
      size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device_, "cudaDeviceGetAttribute"));

  check_cuda(cudaEventCreateWithFlags(&switch_event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  void *flags = nullptr;
  check_cuda(cudaHostAlloc(&flags, 4 * sizeof(unsigned long long), cudaHostAllocDefault), "cudaHostAlloc");
  flags_host_ = static_cast<unsigned long long *>(flags);
  pool_ = std::make_unique<DevicePool>(device_);
  upload_ = std::make_unique<UploadRing>();

  token_bytes_ = size_t(cfg.num_kv_heads) * cfg.head_dim * spec().io_elem;
  ring_bytes_ = 2 * size_t(cfg.residual_tokens + cfg.block_tokens) * token_bytes_;
  layers_.resize(cfg.num_layers);
  for (uint32_t l = 0; l < cfg.num_layers; ++l) init_layer(l, smem_optin);
  check_cuda(cudaStreamSynchronize(stream_), "uploading the sketches");
}

void CudaCache::init_layer(uint32_t l, size_t smem_optin) {
  const qjlkv_config &cfg = spec().cfg;
  const LayerSpec &ls = spec().layers[l];
  const BlockLayout &b = ls.layout;
  LayerState &layer = layers_[l];
  KernelShape &k = layer.shape;
  k.dtype = dtype_of(cfg);
  k.stored_bf16 = spec().stored_dtype == QJLKV_DTYPE_BF16;
  k.key_method = key_method_of(cfg);
  k.d = cfg.head_dim;
  k.Hkv = cfg.num_kv_heads;
  k.Hq = cfg.num_q_heads;
  k.G = spec().group_size;
  k.B = cfg.block_tokens;
  k.ring = cfg.residual_tokens + cfg.block_tokens;
  k.key_bits = cfg.key_bits;
  k.key_token_bits = cfg.key_token_bits;
  k.value_method = static_cast<qjlkv_value_method>(cfg.value_method);
  k.value_bits = cfg.value_bits;
  k.sinks = cfg.sink_tokens;
  k.value_group = cfg.value_group_size;
  k.m = ls.m;
  k.m_out = ls.m_out;
  k.sketch_rows = ls.sketch_rows;
  k.outlier_channels = ls.m_out ? cfg.outlier_channels : 0;
  k.qjl_constant = spec().qjl_constant;
  k.layout = b;
  k.head_stride = uint32_t((b.stride + 15) / 16 * 16);
  k.traced = ls.traced;
  k.ott_pool = cfg.outlier_tokens;
  k.ott_spill = cfg.outlier_spill_tokens;
  k.ott = ott_layout(k.ott_pool, k.ott_spill, k.d, uint32_t(spec().io_elem));
  k.ott_saved = ott_layout(k.ott_pool, 0, k.d, uint32_t(spec().io_elem));
  k.copy = copy_layout(k.B, k.Hkv, k.d, uint32_t(spec().io_elem), k.traced ? k.ott_saved.bytes : 0);
  layer.key_bytes = b.key_bytes;
  layer.value_bytes = b.value_bytes;

  // The largest number of query rows per attention CTA whose shared memory fits the device.
  layer.max_rows = 0;
  for (uint32_t rows = 8; rows >= 1 && layer.max_rows == 0; rows /= 2)
    if (attend_smem(attend_shape(k, rows)).total <= smem_optin) layer.max_rows = rows;
  if (layer.max_rows == 0)
    fail(QJLKV_ERROR_UNSUPPORTED,
         "layer %u: the CUDA attention kernel needs %u bytes of shared memory for this configuration "
         "(key_sketch_dim %u, head_dim %u), the device offers %zu; use smaller sketches or the CPU backend",
         l, attend_smem(attend_shape(k, 1)).total, k.m, k.d, smem_optin);
  check_cuda(configure_attend(k, smem_optin), "cudaFuncSetAttribute");

  layer.blocks = std::make_unique<SlotPool>(size_t(k.head_stride) * k.Hkv, 16);
  layer.rings = std::make_unique<SlotPool>(align_up(ring_bytes_), 4);
  if (cfg.sink_tokens) layer.sinks = std::make_unique<SlotPool>(align_up(2 * sink_bytes()), 4);
  layer.copies = std::make_unique<SlotPool>(align_up(k.copy.bytes), 4);
  size_t quantize_limit = 0;
  check_cuda(configure_quantize(k, smem_optin, &quantize_limit), "cudaFuncSetAttribute");
  if (quantize_smem(k) > quantize_limit)
    fail(QJLKV_ERROR_UNSUPPORTED,
         "layer %u: the key quantizer needs %zu bytes of shared memory (QJL: the sign bits of an outlier sketch of "
         "%u rows), the device offers %zu; use smaller outlier sketches or the CPU backend",
         l, quantize_smem(k), k.m_out, quantize_limit);
  if (k.traced) {
    size_t max_dynamic = 0;
    check_cuda(configure_ott_quantize(k, smem_optin, &max_dynamic), "cudaFuncSetAttribute");
    const size_t need = ott_quantize_smem(k);
    if (need > max_dynamic)
      fail(QJLKV_ERROR_UNSUPPORTED,
           "layer %u: OTT tracing of blocks of %u tokens with %u outlier tokens needs %zu bytes of shared memory, "
           "the device offers %zu; use smaller config.block_tokens or config.outlier_tokens",
           l, k.B, k.ott_pool, need, max_dynamic);
    layer.otts = std::make_unique<SlotPool>(2 * size_t(k.Hkv) * k.ott.bytes, 4);
  }

  if (ls.sketch) {
    // Uploaded once, transposed to [d][rows] so that thread i reading row i is coalesced.
    const SketchMatrix &matrix = ls.sketch->matrix;
    std::vector<float> transposed(size_t(matrix.rows) * matrix.cols);
    for (uint32_t i = 0; i < matrix.rows; ++i)
      for (uint32_t j = 0; j < matrix.cols; ++j) transposed[size_t(j) * matrix.rows + i] = matrix.row(i)[j];
    layer.sketch_t.ensure(transposed.size() * sizeof(float), *pool_, stream_);
    check_cuda(cudaMemcpyAsync(layer.sketch_t.data, transposed.data(), transposed.size() * sizeof(float),
                               cudaMemcpyHostToDevice, stream_),
               "uploading the sketch");
    check_cuda(cudaStreamSynchronize(stream_), "uploading the sketch");  // `transposed` dies here
    k.sketch_t = static_cast<const float *>(layer.sketch_t.data);
  }
  if (!ls.value_signs.empty()) {
    const std::vector<float> &signs = ls.value_signs;
    layer.value_signs.ensure(signs.size() * sizeof(float), *pool_, stream_);
    check_cuda(cudaMemcpyAsync(layer.value_signs.data, signs.data(), signs.size() * sizeof(float),
                               cudaMemcpyHostToDevice, stream_),
               "uploading the value rotation");
    k.value_signs = static_cast<const float *>(layer.value_signs.data);  // spec() keeps `signs` alive
  }
}

void CudaCache::release_all() noexcept {
  if (!pool_) {
    if (switch_event_) (void)cudaEventDestroy(switch_event_);
    if (flags_host_) (void)cudaFreeHost(flags_host_);
    switch_event_ = nullptr;
    flags_host_ = nullptr;
    return;
  }
  int previous = -1;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
                        cudaSetDevice(device_) == cudaSuccess;
  for (LayerState &layer : layers_) {
    for (auto &[id, seq] : layer.seqs) seq.table_dev.release(*pool_, stream_);
    if (layer.blocks) layer.blocks->release_all(*pool_, stream_);
    if (layer.rings) layer.rings->release_all(*pool_, stream_);
    if (layer.otts) layer.otts->release_all(*pool_, stream_);
    if (layer.sinks) layer.sinks->release_all(*pool_, stream_);
    if (layer.copies) layer.copies->release_all(*pool_, stream_);
    layer.sketch_t.release(*pool_, stream_);
    layer.value_signs.release(*pool_, stream_);
    layer.sink_logits.release(*pool_, stream_);
  }
  layers_.clear();
  scratch_.release(*pool_, stream_);
  (void)cudaStreamSynchronize(stream_);  // the stream must still exist: see qjlkv_cache_set_stream
  pool_.reset();
  upload_.reset();
  if (switch_event_) (void)cudaEventDestroy(switch_event_);
  if (flags_host_) (void)cudaFreeHost(flags_host_);
  switch_event_ = nullptr;
  flags_host_ = nullptr;
  if (switched) (void)cudaSetDevice(previous);
}

void CudaCache::set_stream(void *stream) {
  DeviceGuard guard(device_);
  auto *next = static_cast<cudaStream_t>(stream);
  if (next == stream_) return;
  // Work already enqueued on the old stream comes before anything enqueued on the new one.
  check_cuda(cudaEventRecord(switch_event_, stream_), "cudaEventRecord (set_stream)");
  check_cuda(cudaStreamWaitEvent(next, switch_event_, 0), "cudaStreamWaitEvent (set_stream)");
  stream_ = next;
}

// The sink logits go to the layer's device buffer on the cache's stream, so attends enqueued
// before read the old ones and later ones the new; the buffer is allocated (once) before anything
// changes, so a failure leaves the layer's variant as it was. The window is read by each attend.
void CudaCache::set_attention(uint32_t layer_index, LayerAttention attention) {
  if (!attention.sink_logits.empty()) {
    DeviceGuard guard(device_);
    DeviceBuffer &sinks = layers_[layer_index].sink_logits;
    const size_t bytes = attention.sink_logits.size() * sizeof(float);
    sinks.ensure(bytes, *pool_, stream_);
    upload(sinks.data, attention.sink_logits.data(), bytes);
  }
  qjlkv_cache::set_attention(layer_index, std::move(attention));
}

void CudaCache::download(void *host, const void *device, size_t bytes) const {
  check_cuda(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (to the host)");
  check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (to the host)");
}

float CudaCache::read_element(const void *tensor, size_t index) const {
  const size_t elem = spec().io_elem;
  uint32_t bits = 0;
  download(&bits, static_cast<const uint8_t *>(tensor) + index * elem, elem);
  return load_element(&bits, 0, dtype_of(spec().cfg));
}

void CudaCache::fail_data(const char *name, const void *tensor, unsigned long long index, float limit) const {
  fail_bad_element(name, size_t(index), read_element(tensor, size_t(index)), limit);
}

void CudaCache::append(uint32_t layer_index, const uint32_t *seqs, uint32_t n_seqs, uint32_t tokens_per_seq,
                       const void *keys, const void *values) {
  DeviceGuard guard(device_);
  LayerState &layer = layers_[layer_index];
  AppendPlan plan;
  try {
    plan_append(layer_index, seqs, n_seqs, tokens_per_seq, plan);
    write_append_jobs(layer, plan, tokens_per_seq, keys, values);
    validate_and_quantize(layer, plan, tokens_per_seq, keys, values);
  } catch (...) {
    rollback_append(layer, plan);
    throw;
  }
  commit_append(layer_index, plan, tokens_per_seq);
}

void CudaCache::plan_append(uint32_t layer_index, const uint32_t *seqs, uint32_t n_seqs, uint32_t tokens_per_seq,
                            AppendPlan &plan) {
  const qjlkv_config &cfg = spec().cfg;
  LayerState &layer = layers_[layer_index];
  const uint32_t B = cfg.block_tokens;
  int64_t growth = 0;
  for (uint32_t i = 0; i < n_seqs; ++i) {
    const auto it = layer.seqs.find(seqs[i]);
    growth += append_growth(layer_index, it == layer.seqs.end() ? nullptr : &it->second, tokens_per_seq);
  }
  if (growth > 0) require_budget(*this, uint64_t(growth), n_seqs > 1 ? "append_batch" : "append");
  size_t copy_jobs = 0, created = 0;
  plan.seqs.reserve(n_seqs);
  for (uint32_t i = 0; i < n_seqs; ++i) {
    auto [it, is_new] = layer.seqs.try_emplace(seqs[i]);
    AppendPlan::Seq &p = plan.seqs.emplace_back();  // reserved: cannot throw, so every creation is recorded
    p.id = seqs[i];
    p.seq = &it->second;
    p.created = is_new;
    created += is_new;
    const AppendSplit split =
        split_append(cfg, p.seq->sinks, p.seq->length - p.seq->sinks - p.seq->blocks * B, tokens_per_seq);
    p.new_sinks = split.new_sinks;
    p.n_after = tokens_per_seq - p.new_sinks;
    p.new_blocks = uint32_t(split.new_blocks);
    p.first_slot = plan.quant_jobs;
    plan.quant_jobs += p.new_blocks;
    const SeqState &seq = *p.seq;
    p.first_copy_after = blocks_at(cfg, rollback_floor_after(cfg, seq.rollback_floor, seq.length + tokens_per_seq));
    const uint32_t end = seq.blocks + p.new_blocks;
    p.first_copy = copy_jobs;
    p.new_copies = end - std::min(end, std::max(p.first_copy_after, seq.blocks));
    copy_jobs += p.new_copies;
  }
  const bool traced = layer.shape.traced;
  layer.blocks->reserve(plan.quant_jobs, *pool_, stream_);
  layer.copies->reserve(copy_jobs, *pool_, stream_);
  layer.rings->reserve(created, *pool_, stream_);
  if (traced) layer.otts->reserve(created, *pool_, stream_);
  if (layer.sinks) layer.sinks->reserve(created, *pool_, stream_);
  plan.slots.reserve(plan.quant_jobs);
  plan.copies.reserve(copy_jobs);
  for (AppendPlan::Seq &p : plan.seqs) {
    if (p.created) p.seq->ring = layer.rings->take();
    if (p.created && traced) p.seq->ott = layer.otts->take();
    if (p.created && layer.sinks) p.seq->sink = layer.sinks->take();
    if (traced && p.new_blocks) ++plan.ott_jobs;
    for (uint32_t b = 0; b < p.new_blocks; ++b) plan.slots.push_back(layer.blocks->take());
    for (size_t c = 0; c < p.new_copies; ++c) plan.copies.push_back(layer.copies->take());
    const size_t needed = p.seq->blocks + p.new_blocks;
    p.seq->table.reserve(needed);  // the commit appends within capacity
    p.seq->copies.reserve(p.seq->copies.size() + p.new_copies);
    if (needed * sizeof(uint64_t) > p.seq->table_dev.bytes)
      p.grown_table.ensure(std::max(needed, size_t(16)) * sizeof(uint64_t) * 2, *pool_, stream_);
  }

  // The job lists, uploaded in one copy: quantize jobs, commit jobs, new table entries, OTT jobs.
  plan.commit_offset = align_up(plan.quant_jobs * sizeof(QuantJob));
  plan.entries_offset = plan.commit_offset + align_up(n_seqs * sizeof(CommitJob));
  plan.ott_offset = plan.entries_offset + align_up(plan.quant_jobs * sizeof(uint64_t));
  plan.blob_bytes = plan.ott_offset + plan.ott_jobs * sizeof(OttJob);
  scratch_.ensure(kAlign + plan.blob_bytes, *pool_, stream_);
  plan.blob_host = upload_->acquire(plan.blob_bytes, stream_);
  plan.blob_dev = static_cast<uint8_t *>(scratch_.data) + kAlign;
}

void CudaCache::write_append_jobs(const LayerState &layer, const AppendPlan &plan, uint32_t tokens_per_seq,
                                  const void *keys, const void *values) const {
  const uint32_t B = spec().cfg.block_tokens;
  const size_t seq_input_bytes = size_t(tokens_per_seq) * token_bytes_;
  const auto *key_bytes = static_cast<const uint8_t *>(keys);
  const auto *value_bytes = static_cast<const uint8_t *>(values);
  auto *quant = reinterpret_cast<QuantJob *>(plan.blob_host);
  auto *commit = reinterpret_cast<CommitJob *>(plan.blob_host + plan.commit_offset);
  auto *entries = reinterpret_cast<uint64_t *>(plan.blob_host + plan.entries_offset);
  const auto *entries_dev = reinterpret_cast<const uint64_t *>(plan.blob_dev + plan.entries_offset);
  auto *ott = reinterpret_cast<OttJob *>(plan.blob_host + plan.ott_offset);
  const auto *quant_dev = reinterpret_cast<const QuantJob *>(plan.blob_dev);
  const size_t ring_half = ring_bytes_ / 2;
  for (size_t i = 0, ott_job = 0; i < plan.seqs.size(); ++i) {
    const AppendPlan::Seq &p = plan.seqs[i];
    const SeqState &seq = *p.seq;
    if (layer.shape.traced && p.new_blocks)
      ott[ott_job++] = OttJob{quant_dev + p.first_slot, p.new_blocks, !seq.ott_ready,
                              ott_state(layer, seq, seq.ott_side), ott_state(layer, seq, 1 - seq.ott_side)};
    const size_t skip = size_t(p.new_sinks) * token_bytes_;
    const uint8_t *in_k = key_bytes + i * seq_input_bytes + skip, *in_v = value_bytes + i * seq_input_bytes + skip;
    const uint32_t old_length = seq.length - seq.sinks;  // positions after the sinks
    const uint32_t first_copied = p.new_blocks - uint32_t(p.new_copies);  // the new blocks' first with a copy
    for (uint32_t b = 0; b < p.new_blocks; ++b) {
      QuantJob &job = quant[p.first_slot + b];
      job.slot = plan.slots[p.first_slot + b];
      job.copy = b >= first_copied ? plan.copies[p.first_copy + (b - first_copied)] : nullptr;
      job.ring_k = seq.ring;
      job.ring_v = seq.ring + ring_half;
      job.in_k = in_k;
      job.in_v = in_v;
      job.first_pos = (seq.blocks + b) * B;
      job.old_length = old_length;
      entries[p.first_slot + b] = reinterpret_cast<uint64_t>(job.slot);
    }
    // The new tail: positions from max(old length, end of the new blocks) come from the input.
    const uint32_t end = old_length + p.n_after;
    const uint32_t tail_start = std::max(old_length, (seq.blocks + p.new_blocks) * B);
    CommitJob &job = commit[i];
    job.table = static_cast<uint64_t *>(p.grown_table.data ? p.grown_table.data : seq.table_dev.data);
    job.old_table = p.grown_table.data ? static_cast<const uint64_t *>(seq.table_dev.data) : nullptr;
    job.entries = entries_dev + p.first_slot;
    job.n_old = seq.blocks;  // new entries go after the committed ones; copied only into a grown table
    job.n_new = p.new_blocks;
    job.ring_k = seq.ring;
    job.ring_v = seq.ring + ring_half;
    job.in_k = in_k;
    job.in_v = in_v;
    job.first_token = tail_start - old_length;
    job.n_tokens = end - tail_start;
    job.first_pos = tail_start;
    job.sink_k = seq.sink;
    job.sink_v = seq.sink ? seq.sink + sink_bytes() : nullptr;
    job.sink_in_k = key_bytes + i * seq_input_bytes;
    job.sink_in_v = value_bytes + i * seq_input_bytes;
    job.first_sink = seq.sinks;
    job.n_sinks = p.new_sinks;
  }
}

void CudaCache::validate_and_quantize(const LayerState &layer, const AppendPlan &plan, uint32_t tokens_per_seq,
                                      const void *keys, const void *values) {
  const qjlkv_config &cfg = spec().cfg;
  const KernelShape &k = layer.shape;
  const size_t elements = plan.seqs.size() * tokens_per_seq * cfg.num_kv_heads * cfg.head_dim;
  unsigned long long *flags = device_flags();
  check_cuda(cudaMemsetAsync(flags, 0xff, 4 * sizeof(unsigned long long), stream_), "cudaMemsetAsync");
  check_cuda(cudaMemcpyAsync(plan.blob_dev, plan.blob_host, plan.blob_bytes, cudaMemcpyHostToDevice, stream_),
             "uploading the append jobs");
  check_cuda(launch_validate(k, keys, values, elements, spec().key_limit, spec().value_limit,
                             qjlkv::key_norm_limit(cfg), qjlkv::value_norm_limit(cfg), flags, stream_),
             "the validation kernel");
  if (k.traced)
    check_cuda(launch_ott_quantize(k, reinterpret_cast<const OttJob *>(plan.blob_dev + plan.ott_offset),
                                   uint32_t(plan.ott_jobs), stream_),
               "the OTT quantization kernel");
  else
    check_cuda(launch_quantize(k, reinterpret_cast<const QuantJob *>(plan.blob_dev), uint32_t(plan.quant_jobs),
                               stream_),
               "the quantization kernel");
  check_cuda(cudaMemcpyAsync(flags_host_, flags, 4 * sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream_),
             "reading the validation result");
  check_cuda(cudaStreamSynchronize(stream_), "append (validation and quantization)");
  constexpr unsigned long long kNone = ~0ull;
  if (flags_host_[0] != kNone) fail_data("keys", keys, flags_host_[0], spec().key_limit);
  if (flags_host_[1] != kNone) fail_data("values", values, flags_host_[1], spec().value_limit);
  const auto norm = [&](const void *tensor, size_t vector) {  // L2 norm of one [head_dim] device vector
    double norm2 = 0.0;
    for (uint32_t j = 0; j < cfg.head_dim; ++j) {
      const double x = read_element(tensor, vector * cfg.head_dim + j);
      norm2 += x * x;
    }
    return std::sqrt(norm2);
  };
  // The methods' messages (src/methods/), as the CPU backend reports them.
  if (flags_host_[2] != kNone) fail_key_norm(cfg, size_t(flags_host_[2]), norm(keys, size_t(flags_host_[2])));
  if (flags_host_[3] != kNone) fail_value_norm(cfg, size_t(flags_host_[3]), norm(values, size_t(flags_host_[3])));
}

void CudaCache::rollback_append(LayerState &layer, AppendPlan &plan) noexcept {
  for (AppendPlan::Seq &p : plan.seqs) p.grown_table.release(*pool_, stream_);
  for (uint8_t *slot : plan.slots) layer.blocks->give(slot);
  for (uint8_t *copy : plan.copies) layer.copies->give(copy);
  for (AppendPlan::Seq &p : plan.seqs)
    if (p.created) {
      if (p.seq->ring) layer.rings->give(p.seq->ring);
      if (p.seq->ott) layer.otts->give(p.seq->ott);
      if (p.seq->sink) layer.sinks->give(p.seq->sink);
      layer.seqs.erase(p.id);
    }
}

void CudaCache::commit_append(uint32_t layer_index, AppendPlan &plan, uint32_t tokens_per_seq) {
  const qjlkv_config &cfg = spec().cfg;
  const KernelShape &k = layers_[layer_index].shape;
  check_cuda(launch_commit(k, reinterpret_cast<const CommitJob *>(plan.blob_dev + plan.commit_offset),
                           uint32_t(plan.seqs.size()), stream_),
             "the commit kernel");
  for (AppendPlan::Seq &p : plan.seqs) {
    SeqState &seq = *p.seq;
    const uint64_t own_before = p.created ? 0 : own_bytes(layer_index, seq);
    if (p.grown_table.data) {
      seq.table_dev.release(*pool_, stream_);  // stream-ordered after the commit kernel's copy
      seq.table_dev = p.grown_table;
      p.grown_table = DeviceBuffer{};
    }
    for (uint32_t b = 0; b < p.new_blocks; ++b)
      seq.table.push_back(reinterpret_cast<uint64_t>(plan.slots[p.first_slot + b]));
    if (k.traced && p.new_blocks) {  // the state this append wrote becomes the committed one
      seq.ott_side = 1 - seq.ott_side;
      seq.ott_ready = true;
    }
    seq.length += tokens_per_seq;
    seq.rollback_floor = uint32_t(rollback_floor_after(cfg, seq.rollback_floor, seq.length));
    seq.sinks += p.new_sinks;
    seq.blocks += p.new_blocks;
    used_ += uint64_t(p.new_blocks) * slot_bytes(layer_index);
    keep_copies_from(layer_index, seq, p.first_copy_after);
    for (size_t c = 0; c < p.new_copies; ++c) seq.copies.push_back(plan.copies[p.first_copy + c]);  // reserved
    used_ += p.new_copies * copy_bytes(layer_index);
    used_ += own_bytes(layer_index, seq) - own_before;
    free_window_blocks(layer_index, seq, seq.length - tokens_per_seq);
  }
}

void CudaCache::free_window_blocks(uint32_t layer_index, SeqState &seq, uint32_t previous_length) noexcept {
  const uint32_t freed = std::max(
      seq.freed_blocks, window_freed_blocks(spec().cfg, attention(layer_index).window, previous_length, seq.length));
  for (uint32_t b = seq.freed_blocks; b < freed; ++b) {  // stream order keeps enqueued readers ahead of reuse
    release_block(layer_index, seq.table[b]);
    seq.table[b] = 0;
  }
  seq.freed_blocks = freed;
}

void CudaCache::run_attention(uint32_t layer_index, const uint32_t *seqs, uint32_t n_seqs, uint32_t queries_per_seq,
                              const void *queries, float scale, void *out, float *scores_host) {
  const qjlkv_config &cfg = spec().cfg;
  LayerState &layer = layers_[layer_index];
  const KernelShape &k = layer.shape;
  // scores() returns raw logits of every position: no variant, no window.
  const uint32_t window = scores_host ? 0 : attention(layer_index).window;
  // The first block read: none before the first query's window, and never a freed one (scores
  // read every stored block).
  const auto first_block = [&](const SeqState &seq) {
    return std::max(seq.freed_blocks,
                    blocks_before(window_start(seq.length - queries_per_seq, window), seq.sinks, k.B, seq.blocks));
  };
  uint32_t max_units = 0;
  for (uint32_t i = 0; i < n_seqs; ++i) {
    const SeqState &seq = find(layer_index, seqs[i]);
    QJLKV_REQUIRE(queries_per_seq <= seq.length, "n_queries is %u, but seq %u holds only %llu tokens",
                  queries_per_seq, seqs[i], (unsigned long long)seq.length);
    max_units = std::max(max_units, attend_units(seq.length - seq.sinks, seq.blocks, k.B) - first_block(seq) +
                                        div_up(seq.sinks, k.B));
  }
  // OTT: at most P + S outlier tokens per head (the kernel reads the actual counts).
  if (k.traced) max_units += div_up(k.ott_pool + k.ott_spill, k.B);
  const uint64_t rows_total = uint64_t(queries_per_seq) * k.G;
  const uint32_t rows = pick_rows(rows_total, layer.max_rows);
  const uint64_t row_tiles = (rows_total + rows - 1) / rows;
  const uint64_t base_ctas = uint64_t(n_seqs) * k.Hkv * row_tiles;
  // About 8 CTAs of 128 threads per SM in flight.
  const SplitPlan plan = plan_splits(max_units, base_ctas, uint64_t(sm_count_) * 8);
  if (base_ctas * plan.splits > 0x7fffffffu || row_tiles > 0xffffffffu)
    fail(QJLKV_ERROR_UNSUPPORTED, "n_queries (%u) x num_q_heads x sequences is too large for one CUDA attention call",
         queries_per_seq);

  const size_t out_rows = size_t(n_seqs) * queries_per_seq * cfg.num_q_heads;
  const size_t desc_bytes = align_up(n_seqs * sizeof(AttendSeq));
  const size_t ml_bytes = align_up(out_rows * plan.splits * 2 * sizeof(float));
  const size_t acc_bytes = align_up(out_rows * plan.splits * cfg.head_dim * sizeof(float));
  const uint64_t length0 = scores_host ? find(layer_index, seqs[0]).length : 0;
  const size_t scores_bytes = align_up(size_t(length0) * cfg.num_q_heads * sizeof(float));
  scratch_.ensure(kAlign + desc_bytes + ml_bytes + acc_bytes + scores_bytes, *pool_, stream_);
  uint8_t *base = static_cast<uint8_t *>(scratch_.data) + kAlign;

  auto *desc_host = reinterpret_cast<AttendSeq *>(upload_->acquire(n_seqs * sizeof(AttendSeq), stream_));
  const size_t ring_half = ring_bytes_ / 2;
  for (uint32_t i = 0; i < n_seqs; ++i) {
    const SeqState &seq = layer.seqs.find(seqs[i])->second;
    desc_host[i] = AttendSeq{static_cast<const uint64_t *>(seq.table_dev.data),
                             seq.ring,
                             seq.ring + ring_half,
                             seq.ott_ready ? ott_state(layer, seq, seq.ott_side) : nullptr,
                             seq.sink,
                             seq.sink ? seq.sink + sink_bytes() : nullptr,
                             seq.length,
                             seq.blocks,
                             seq.sinks,
                             first_block(seq)};
  }
  check_cuda(cudaMemcpyAsync(base, desc_host, n_seqs * sizeof(AttendSeq), cudaMemcpyHostToDevice, stream_),
             "uploading the attention descriptors");

  AttendArgs args{};
  args.shape = k;
  args.smem = attend_smem(attend_shape(k, rows));
  args.seqs = reinterpret_cast<const AttendSeq *>(base);
  args.n_seqs = n_seqs;
  args.queries = queries;
  args.qps = queries_per_seq;
  args.row_tiles = uint32_t(row_tiles);
  args.split = plan;
  args.scale = scale;
  const LayerAttention &variant = attention(layer_index);
  args.window = window;
  if (!scores_host) {
    args.softcap = variant.softcap;
    args.softcap_inside = variant.softcap > 0.0f ? scale / variant.softcap : 0.0f;
    args.sink_logits = variant.sink_logits.empty() ? nullptr : static_cast<const float *>(layer.sink_logits.data);
  }
  args.part_ml = reinterpret_cast<float *>(base + desc_bytes);
  args.part_acc = reinterpret_cast<float *>(base + desc_bytes + ml_bytes);
  args.scores = scores_host ? reinterpret_cast<float *>(base + desc_bytes + ml_bytes + acc_bytes) : nullptr;
  args.out = out;
  check_cuda(launch_attend(args, rows, stream_), "the attention kernels");
  if (scores_host)
    check_cuda(cudaMemcpyAsync(scores_host, args.scores, size_t(length0) * cfg.num_q_heads * sizeof(float),
                               cudaMemcpyDeviceToHost, stream_),
               "reading the scores");
}

void CudaCache::scores(uint32_t layer, uint32_t seq, const void *query, float *out) {
  DeviceGuard guard(device_);
  const qjlkv_config &cfg = spec().cfg;
  const SeqState &state = find(layer, seq);
  scratch_.ensure(kAlign, *pool_, stream_);
  unsigned long long *flags = device_flags();
  check_cuda(cudaMemsetAsync(flags, 0xff, 3 * sizeof(unsigned long long), stream_), "cudaMemsetAsync");
  check_cuda(launch_validate(layers_[layer].shape, query, nullptr, size_t(cfg.num_q_heads) * cfg.head_dim, FLT_MAX,
                             FLT_MAX, 0.0, 0.0, flags, stream_),
             "the validation kernel");
  check_cuda(cudaMemcpyAsync(flags_host_, flags, sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream_),
             "reading the validation result");
  check_cuda(cudaStreamSynchronize(stream_), "scores (validation)");
  if (flags_host_[0] != ~0ull) fail_data("query", query, flags_host_[0], FLT_MAX);
  run_attention(layer, &seq, 1, 1, query, 1.0f, nullptr, out);
  check_cuda(cudaStreamSynchronize(stream_), "scores");
  // Positions the window freed have no score (the kernel did not read them).
  const uint64_t freed = uint64_t(state.freed_blocks) * cfg.block_tokens;
  for (uint32_t h = 0; h < cfg.num_q_heads; ++h)
    std::fill_n(out + size_t(h) * state.length + state.sinks, freed, -INFINITY);
}

std::vector<uint8_t> CudaCache::download_ott(const LayerState &layer, const SeqState &seq) const {
  std::vector<uint8_t> state;
  if (!layer.shape.traced || !seq.ott_ready) return state;
  state.resize(size_t(layer.shape.Hkv) * layer.shape.ott.bytes);
  download(state.data(), ott_state(layer, seq, seq.ott_side), state.size());
  return state;
}

CudaCache::HostRows CudaCache::host_rows(const LayerState &layer, const SeqState &seq, uint64_t first,
                                         uint64_t count) const {
  HostRows rows{*this, layer, seq, {}, {}, std::vector<uint8_t>(size_t(layer.shape.head_stride) * layer.shape.Hkv),
                download_ott(layer, seq)};
  if (first + count > seq.sinks + uint64_t(seq.blocks) * layer.shape.B) {
    rows.ring.resize(ring_bytes_);
    download(rows.ring.data(), seq.ring, ring_bytes_);
  }
  if (first < seq.sinks) {
    rows.sinks.resize(2 * sink_bytes());
    download(rows.sinks.data(), seq.sink, rows.sinks.size());
  }
  return rows;
}

// Not a fast path: the stored bytes come to the host and the methods' decoders read them
// (reconstruct_positions), so the reconstruction of equal bytes is equal on both backends.
void CudaCache::reconstruct(uint32_t layer_index, uint32_t seq_id, uint64_t first, uint64_t count, float *keys_out,
                            float *values_out) {
  DeviceGuard guard(device_);
  const SeqState &seq = find(layer_index, seq_id);
  HostRows rows = host_rows(layers_[layer_index], seq, first, count);
  reconstruct_positions(spec(), layer_index, seq.sinks, seq.blocks, first, count, rows, keys_out, values_out);
}

void CudaCache::upload(void *device, const void *host, size_t bytes) const {
  if (bytes == 0) return;  // host may be the NULL data() of an empty vector
  uint8_t *pinned = upload_->acquire(bytes, stream_);
  std::memcpy(pinned, host, bytes);
  check_cuda(cudaMemcpyAsync(device, pinned, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (to the device)");
}

// ---- memory accounting ---------------------------------------------------------------------------
int64_t CudaCache::append_growth(uint32_t layer_index, const SeqState *seq, uint32_t n) const {
  const RecordCounts counts = seq ? counts_of(*seq) : RecordCounts{};
  const SlotPool &pool = *layers_[layer_index].copies;
  const SlotPool &blocks = *layers_[layer_index].blocks;
  return qjlkv::append_growth(
      spec(), layer_index, sizeof(SeqState), seq ? &counts : nullptr, n, attention(layer_index).window,
      [&](uint32_t b) { return pool.holders(seq->copies[b - seq->first_copy]) == 1; },
      [&](uint32_t b) { return blocks.holders(reinterpret_cast<const uint8_t *>(seq->table[b])) == 1; });
}

void CudaCache::keep_copies_from(uint32_t layer_index, SeqState &seq, uint32_t first) noexcept {
  if (first <= seq.first_copy) return;
  const size_t drop = std::min(size_t(first - seq.first_copy), seq.copies.size());
  for (size_t i = 0; i < drop; ++i) release_copy(layer_index, seq.copies[i]);
  seq.copies.erase(seq.copies.begin(), seq.copies.begin() + ptrdiff_t(drop));
  seq.first_copy = first;
}

void CudaCache::give_own_storage(LayerState &layer, SeqState &seq) noexcept {
  // Stream order keeps kernels already enqueued on these slots ahead of their next writer.
  if (seq.ring) layer.rings->give(seq.ring);
  if (seq.ott) layer.otts->give(seq.ott);
  if (seq.sink) layer.sinks->give(seq.sink);
  seq.ring = seq.ott = seq.sink = nullptr;
  seq.table_dev.release(*pool_, stream_);
}

void CudaCache::release_record(uint32_t layer_index, SeqState &seq) noexcept {
  used_ -= own_bytes(layer_index, seq);
  for (uint32_t b = seq.freed_blocks; b < seq.blocks; ++b) release_block(layer_index, seq.table[b]);
  for (const uint8_t *copy : seq.copies) release_copy(layer_index, copy);
  give_own_storage(layers_[layer_index], seq);
}

uint64_t CudaCache::bytes_needed(uint32_t seq_id, uint32_t n_tokens) const {
  int64_t growth = 0;
  for (uint32_t l = 0; l < spec().cfg.num_layers; ++l) {
    const auto &map = layers_[l].seqs;
    const auto it = map.find(seq_id);
    growth += append_growth(l, it == map.end() ? nullptr : &it->second, n_tokens);
  }
  return growth > 0 ? uint64_t(growth) : 0;
}

void CudaCache::sequence_bytes(uint32_t seq_id, uint64_t &bytes, uint64_t &shared) const {
  bytes = shared = 0;
  for (uint32_t l = 0; l < spec().cfg.num_layers; ++l) {
    const LayerState &layer = layers_[l];
    const auto it = layer.seqs.find(seq_id);
    if (it == layer.seqs.end()) continue;
    const SeqState &seq = it->second;
    bytes += own_bytes(l, seq);
    for (uint32_t b = seq.freed_blocks; b < seq.blocks; ++b) {
      bytes += slot_bytes(l);
      if (layer.blocks->holders(reinterpret_cast<const uint8_t *>(seq.table[b])) > 1) shared += slot_bytes(l);
    }
    for (const uint8_t *copy : seq.copies) {
      bytes += copy_bytes(l);
      if (layer.copies->holders(copy) > 1) shared += copy_bytes(l);
    }
  }
}

// ---- sequence operations -------------------------------------------------------------------------
void CudaCache::plan_cut(uint32_t layer_index, const SeqState &seq, uint32_t length, Cut &cut) {
  const qjlkv_config &cfg = spec().cfg;
  LayerState &layer = layers_[layer_index];
  const KernelShape &k = layer.shape;
  const uint32_t B = cfg.block_tokens;
  cut.length = length;
  if (length == 0) return;
  cut.floor = std::min(seq.rollback_floor, length);
  cut.sinks = std::min(length, seq.sinks);
  cut.blocks = blocks_at(cfg, length);
  if (cut.blocks == seq.blocks) return;  // only the tail shortens: its ring slots stay as they are
  // Blocks [cut.blocks, seq.blocks) reopen. Positions here count from the sinks (all present).
  const uint32_t tail_start = cut.blocks * B, old_tail_start = seq.blocks * B;
  const uint32_t end = length > seq.sinks ? length - seq.sinks : 0;
  const uint32_t copied_start = seq.first_copy * B;
  const uint32_t rebuilt_end = std::min(old_tail_start, end);  // the rows that are not in the ring
  if (tail_start < rebuilt_end) {
    layer.rings->reserve(1, *pool_, stream_);
    cut.ring = layer.rings->take();  // given back by the caller if anything below fails
    copy_on_device(cut.ring, seq.ring, ring_bytes_);
    // Reopened blocks without a rollback copy (a truncate below the floor): their reconstruction.
    const uint32_t reconstructed_end = std::min(copied_start, rebuilt_end);
    if (tail_start < reconstructed_end) {
      const uint32_t count = reconstructed_end - tail_start;
      std::vector<uint8_t> keys(size_t(count) * token_bytes_), values(keys.size());
      HostRows rows = host_rows(layer, seq, seq.sinks + tail_start, count);
      store_reconstruction(spec(), layer_index, seq.sinks, seq.blocks, seq.sinks + tail_start, count, rows,
                           keys.data(), values.data());
      for (auto [rows_of, value_rows] : {std::pair{&keys, false}, std::pair{&values, true}})
        for_ring_runs(layer, cut.ring, tail_start, count, value_rows, [&](uint8_t *device, uint32_t run, uint32_t done) {
          upload(device, rows_of->data() + size_t(done) * token_bytes_, size_t(run) * token_bytes_);
        });
    }
    // The others from their copies, as appended.
    for (uint32_t p = std::max(tail_start, reconstructed_end); p < rebuilt_end;) {
      const uint32_t b = p / B, t = p % B, count = std::min(rebuilt_end, (b + 1) * B) - p;
      const uint8_t *copy = seq.copies[b - seq.first_copy];
      for (auto [offset, value_rows] : {std::pair{size_t(0), false}, std::pair{size_t(k.copy.values), true}})
        for_ring_runs(layer, cut.ring, p, count, value_rows, [&](uint8_t *device, uint32_t run, uint32_t done) {
          copy_on_device(device, copy + offset + size_t(t + done) * token_bytes_, size_t(run) * token_bytes_);
        });
      p += count;
    }
  }
  if (!k.traced || !seq.ott_ready) return;
  // The pools after the cut go to the other side of the outlier state, the committed one first.
  const OttLayout &o = k.ott;
  uint8_t *other = ott_state(layer, seq, 1 - seq.ott_side);
  copy_on_device(other, ott_state(layer, seq, seq.ott_side), size_t(k.Hkv) * o.bytes);
  cut.other_ott = true;
  if (cut.blocks >= seq.first_copy) {  // exact: the pools from before the first reopened block
    const uint8_t *saved = seq.copies[cut.blocks - seq.first_copy] + k.copy.pools;
    const OttLayout &so = k.ott_saved;
    const size_t row = size_t(k.d) * spec().io_elem, P = k.ott_pool;
    for (auto [to, from, bytes] : {std::tuple{size_t(0), size_t(0), size_t(16)},
                                   std::tuple{size_t(o.positions), size_t(so.positions), 4 * P},
                                   std::tuple{size_t(o.norms), size_t(so.norms), 4 * P},
                                   std::tuple{size_t(o.keys), size_t(so.keys), P * row},
                                   std::tuple{size_t(o.values), size_t(so.values), P * row}})
      check_cuda(cudaMemcpy2DAsync(other + to, o.bytes, saved + from, so.bytes, bytes, k.Hkv,
                                   cudaMemcpyDeviceToDevice, stream_),
                 "cudaMemcpy2DAsync (restoring the outlier pools)");
    return;
  }
  // No copy of the pools from then: the reopened blocks' tokens leave them (their rows are in the tail).
  std::vector<uint8_t> state = download_ott(layer, seq);
  for (uint32_t h = 0; h < k.Hkv; ++h) {
    uint8_t *head = state.data() + size_t(h) * o.bytes;
    auto *header = reinterpret_cast<uint32_t *>(head);
    drop_outliers_from(seq.sinks + uint64_t(tail_start), k.ott_pool, header[0], header[1],
                       reinterpret_cast<uint32_t *>(head + o.positions), reinterpret_cast<float *>(head + o.norms),
                       head + o.keys, head + o.values, size_t(k.d) * spec().io_elem);
  }
  upload(other, state.data(), state.size());
}

void CudaCache::apply_cut(uint32_t layer_index, SeqState &seq, const Cut &cut, bool held) noexcept {
  LayerState &layer = layers_[layer_index];
  if (cut.other_ott) seq.ott_side = 1 - seq.ott_side;
  if (cut.ring) {
    layer.rings->give(seq.ring);
    seq.ring = cut.ring;
  }
  for (uint32_t b = cut.blocks; b < seq.blocks; ++b)
    if (held) release_block(layer_index, seq.table[b]);
  seq.table.resize(cut.blocks);  // shrinks: no allocation; the device table keeps its first entries
  const size_t kept_copies =
      cut.blocks > seq.first_copy ? std::min(size_t(cut.blocks - seq.first_copy), seq.copies.size()) : 0;
  for (size_t i = kept_copies; i < seq.copies.size(); ++i)
    if (held) release_copy(layer_index, seq.copies[i]);
  seq.copies.resize(kept_copies);
  seq.first_copy = std::min(seq.first_copy, cut.blocks);
  seq.blocks = cut.blocks;
  seq.sinks = cut.sinks;  // the sink slot keeps its bytes; the next appends write after cut.sinks
  seq.length = cut.length;
  seq.rollback_floor = cut.floor;
}

void CudaCache::truncate(uint32_t seq_id, uint64_t length) {
  DeviceGuard guard(device_);
  std::vector<std::pair<uint32_t, Cut>> cuts;
  try {
    for (uint32_t l = 0; l < spec().cfg.num_layers; ++l) {
      const auto it = layers_[l].seqs.find(seq_id);
      if (it == layers_[l].seqs.end() || it->second.length <= length) continue;
      plan_cut(l, it->second, uint32_t(length), cuts.emplace_back(l, Cut{}).second);
    }
  } catch (...) {
    for (auto &[l, cut] : cuts)
      if (cut.ring) layers_[l].rings->give(cut.ring);
    throw;
  }
  for (auto &[l, cut] : cuts) {  // nothing fails from here on
    const auto it = layers_[l].seqs.find(seq_id);
    SeqState &seq = it->second;
    if (cut.length == 0) {
      release_record(l, seq);
      layers_[l].seqs.erase(it);
      continue;
    }
    const uint64_t own_before = own_bytes(l, seq);
    apply_cut(l, seq, cut, true);
    used_ += own_bytes(l, seq) - own_before;
  }
}

void CudaCache::fork(uint32_t src_id, uint32_t dst_id, uint64_t length) {
  DeviceGuard guard(device_);
  const qjlkv_config &cfg = spec().cfg;
  // What dst will hold: src's records cut to `length`; only its own rows are new bytes.
  uint64_t growth = 0;
  for (uint32_t l = 0; l < cfg.num_layers; ++l) {
    const auto it = layers_[l].seqs.find(src_id);
    if (it == layers_[l].seqs.end()) continue;
    const SeqState &src = it->second;
    if (length >= src.length) {
      growth += own_bytes(l, src);
      continue;
    }
    const uint32_t sinks = std::min(uint32_t(length), src.sinks), blocks = blocks_at(cfg, length);
    growth += sizeof(SeqState) + exact_row_bytes(spec(), l, sinks, length - sinks - uint64_t(blocks) * cfg.block_tokens);
  }
  require_budget(*this, growth, "fork");

  using Map = std::unordered_map<uint32_t, SeqState>;
  struct Staged {
    uint32_t layer;
    Map::node_type node;
    Cut cut;
    bool cut_needed;
  };
  std::vector<Staged> staged;
  try {
    staged.reserve(cfg.num_layers);
    for (uint32_t l = 0; l < cfg.num_layers; ++l) {
      LayerState &layer = layers_[l];
      const auto it = layer.seqs.find(src_id);
      if (it == layer.seqs.end()) continue;
      const SeqState &src = it->second;
      Map holder;
      holder.try_emplace(dst_id);
      Staged &s = staged.emplace_back(Staged{l, holder.extract(dst_id), Cut{}, length < src.length});
      SeqState &dst = s.node.mapped();  // from here on the cleanup below gives back what it takes
      dst.length = src.length;
      dst.blocks = src.blocks;
      dst.sinks = src.sinks;
      dst.rollback_floor = src.rollback_floor;
      dst.first_copy = src.first_copy;
      dst.freed_blocks = src.freed_blocks;
      dst.table = src.table;    // the same slots: held at the commit
      dst.copies = src.copies;  // the same rollback copies, likewise
      layer.rings->reserve(1, *pool_, stream_);
      if (layer.otts) layer.otts->reserve(1, *pool_, stream_);
      if (layer.sinks) layer.sinks->reserve(1, *pool_, stream_);
      dst.table_dev.ensure(std::max(size_t(src.blocks), size_t(16)) * sizeof(uint64_t) * 2, *pool_, stream_);
      layer.seqs.reserve(layer.seqs.size() + 1);  // so that the commit's insert cannot allocate
      dst.ring = layer.rings->take();
      if (layer.otts) dst.ott = layer.otts->take();
      if (layer.sinks) dst.sink = layer.sinks->take();
      // Copies of the rows that are src's own: the tail ring, the sinks, the committed outlier state.
      if (src.blocks) copy_on_device(dst.table_dev.data, src.table_dev.data, size_t(src.blocks) * sizeof(uint64_t));
      copy_on_device(dst.ring, src.ring, ring_bytes_);
      if (dst.sink) copy_on_device(dst.sink, src.sink, 2 * sink_bytes());
      if (src.ott_ready) {
        copy_on_device(ott_state(layer, dst, 0), ott_state(layer, src, src.ott_side),
                       size_t(layer.shape.Hkv) * layer.shape.ott.bytes);
        dst.ott_ready = true;
      }
      if (s.cut_needed) plan_cut(l, dst, uint32_t(length), s.cut);
    }
  } catch (...) {
    for (Staged &s : staged) {
      if (s.cut.ring) layers_[s.layer].rings->give(s.cut.ring);
      give_own_storage(layers_[s.layer], s.node.mapped());
    }
    throw;
  }
  for (Staged &s : staged) {  // nothing fails from here on
    LayerState &layer = layers_[s.layer];
    SeqState &dst = s.node.mapped();
    if (s.cut_needed) apply_cut(s.layer, dst, s.cut, false);
    for (uint32_t b = dst.freed_blocks; b < dst.blocks; ++b)  // src holds them too: no new bytes
      layer.blocks->hold(reinterpret_cast<const uint8_t *>(dst.table[b]));
    for (const uint8_t *copy : dst.copies) layer.copies->hold(copy);
    used_ += own_bytes(s.layer, dst);
    layer.seqs.insert(std::move(s.node));
  }
}

void CudaCache::clear(uint32_t seq_id) {
  DeviceGuard guard(device_);
  for (uint32_t l = 0; l < spec().cfg.num_layers; ++l) {
    const auto it = layers_[l].seqs.find(seq_id);
    if (it == layers_[l].seqs.end()) continue;
    release_record(l, it->second);
    layers_[l].seqs.erase(it);
  }
}

// ---- serialization (src/serialize.cpp) --------------------------------------------------------
PortableCounts CudaCache::portable_counts(uint32_t layer_index, uint32_t seq_id) const {
  const auto &map = layers_[layer_index].seqs;
  const auto it = map.find(seq_id);
  if (it == map.end()) return {};
  const SeqState &seq = it->second;
  return {seq.length, seq.blocks, seq.length - seq.sinks - seq.blocks * spec().cfg.block_tokens, seq.sinks,
          seq.freed_blocks};
}

void CudaCache::read_block(uint32_t layer_index, uint32_t seq_id, uint32_t block, uint32_t head, uint8_t *out) const {
  DeviceGuard guard(device_);
  const LayerState &layer = layers_[layer_index];
  const SeqState &seq = find(layer_index, seq_id);
  const auto *slot = reinterpret_cast<const uint8_t *>(seq.table[block]);
  download(out, slot + size_t(head) * layer.shape.head_stride, spec().layers[layer_index].layout.stride);
}

// A run of blocks in one synchronization: one strided copy per block (its Hkv heads) into pinned
// memory borrowed from the upload ring (read only after the wait), then to the caller's buffer.
void CudaCache::read_blocks(uint32_t layer_index, uint32_t seq_id, uint32_t first, uint32_t count, uint8_t *out) const {
  DeviceGuard guard(device_);
  const LayerState &layer = layers_[layer_index];
  const SeqState &seq = find(layer_index, seq_id);
  const size_t stride = spec().layers[layer_index].layout.stride, heads = layer.shape.Hkv;
  const size_t bytes = size_t(count) * heads * stride;
  uint8_t *pinned = upload_->acquire(bytes, stream_);
  for (uint32_t b = 0; b < count; ++b)
    check_cuda(cudaMemcpy2DAsync(pinned + size_t(b) * heads * stride, stride,
                                 reinterpret_cast<const void *>(seq.table[first + b]), layer.shape.head_stride, stride,
                                 heads, cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpy2DAsync (export)");
  check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (export)");
  std::memcpy(out, pinned, bytes);
}

void CudaCache::read_exact(uint32_t layer_index, uint32_t seq_id, ExactRows which, uint32_t first, uint32_t count,
                           bool values, uint8_t *out) const {
  DeviceGuard guard(device_);
  const LayerState &layer = layers_[layer_index];
  const SeqState &seq = find(layer_index, seq_id);
  if (which == ExactRows::sinks) {
    download(out, seq.sink + (values ? sink_bytes() : 0) + size_t(first) * token_bytes_, size_t(count) * token_bytes_);
    return;
  }
  for_tail_runs(layer, seq, first, count, values, [&](const uint8_t *device, uint32_t run, uint32_t done) {
    download(out + size_t(done) * token_bytes_, device, size_t(run) * token_bytes_);
  });
}

void CudaCache::read_outliers(uint32_t layer_index, uint32_t seq_id, uint32_t head, PortableOutliers &out) const {
  DeviceGuard guard(device_);
  const LayerState &layer = layers_[layer_index];
  const SeqState &seq = find(layer_index, seq_id);
  out = PortableOutliers{};  // no traced block yet: an empty pool, tracing
  if (!seq.ott_ready) return;
  const OttLayout &o = layer.shape.ott;
  std::vector<uint8_t> state(o.bytes);
  download(state.data(), ott_state(layer, seq, seq.ott_side) + size_t(head) * o.bytes, o.bytes);
  const auto *header = reinterpret_cast<const uint32_t *>(state.data());
  const auto *positions = reinterpret_cast<const uint32_t *>(state.data() + o.positions);
  const auto *norms = reinterpret_cast<const float *>(state.data() + o.norms);
  const size_t row = size_t(spec().cfg.head_dim) * spec().io_elem, P = layer.shape.ott_pool;
  out.pool = header[0];
  out.spilled = header[1];
  out.tracing = header[2] != 0;
  out.norms.assign(norms, norms + out.pool);
  out.positions.assign(positions, positions + out.pool);
  out.positions.insert(out.positions.end(), positions + P, positions + P + out.spilled);
  for (auto [dst, offset] : {std::pair{&out.keys, o.keys}, std::pair{&out.values, o.values}}) {
    const uint8_t *rows = state.data() + offset;
    dst->assign(rows, rows + out.pool * row);
    dst->insert(dst->end(), rows + P * row, rows + (P + out.spilled) * row);
  }
}

// The layers of one imported sequence, staged in slots of the cache's pools that no sequence
// refers to, and in map nodes of their own: commit() links the nodes into maps whose buckets were
// reserved beforehand, so it cannot fail. Until then the destructor gives everything back.
class CudaImport final : public PortableImport {
 public:
  CudaImport(CudaCache &cache, uint32_t seq) : cache_(cache), layers_(seq) {}
  ~CudaImport() override {
    for (StagedLayer &staged : layers_) {
      LayerState &layer = cache_.layers_[staged.layer];
      SeqState &seq = staged.node.mapped();
      for (uint64_t slot : seq.table)
        if (slot) layer.blocks->give(reinterpret_cast<uint8_t *>(slot));  // 0: a freed block
      cache_.give_own_storage(layer, seq);
    }
  }
  CudaImport(const CudaImport &) = delete;
  CudaImport &operator=(const CudaImport &) = delete;

  void add_layer(uint32_t layer_index, const PortableCounts &counts) override {
    if (counts.length > UINT32_MAX)
      fail(QJLKV_ERROR_UNSUPPORTED, "layer %u: the stream holds %llu tokens; a CUDA cache holds at most %u per sequence",
           layer_index, (unsigned long long)counts.length, UINT32_MAX);
    DeviceGuard guard(cache_.device_);
    LayerState &layer = cache_.layers_[layer_index];
    const KernelShape &k = layer.shape;
    SeqState &seq = layers_.add(layer_index);  // from here on the destructor frees what it holds
    seq.length = uint32_t(counts.length);
    seq.blocks = counts.blocks;
    seq.sinks = counts.sink_tokens;
    seq.rollback_floor = seq.length;  // no rollback copies travel in a stream
    seq.first_copy = seq.blocks;
    seq.freed_blocks = counts.freed_blocks;
    const uint32_t stored = counts.blocks - counts.freed_blocks;
    layer.blocks->reserve(stored, *cache_.pool_, cache_.stream_);
    layer.rings->reserve(1, *cache_.pool_, cache_.stream_);
    if (layer.otts) layer.otts->reserve(1, *cache_.pool_, cache_.stream_);
    if (layer.sinks) layer.sinks->reserve(1, *cache_.pool_, cache_.stream_);
    seq.table.reserve(counts.blocks);
    seq.table_dev.ensure(std::max(size_t(counts.blocks), size_t(16)) * sizeof(uint64_t) * 2, *cache_.pool_,
                         cache_.stream_);
    cache_.layers_[layer_index].seqs.reserve(cache_.layers_[layer_index].seqs.size() + 1);
    // Cannot fail from here (reserved).
    seq.ring = layer.rings->take();
    if (layer.otts) seq.ott = layer.otts->take();
    if (layer.sinks) seq.sink = layer.sinks->take();
    seq.table.assign(counts.freed_blocks, 0);  // within the reserved capacity
    for (uint32_t b = 0; b < stored; ++b) seq.table.push_back(reinterpret_cast<uint64_t>(layer.blocks->take()));
    // Blocks zeroed (padding included, as the quantizer leaves them), then the table (its freed
    // entries 0: the kernels never read them).
    for (uint32_t b = seq.freed_blocks; b < seq.blocks; ++b)
      check_cuda(cudaMemsetAsync(reinterpret_cast<void *>(seq.table[b]), 0, size_t(k.head_stride) * k.Hkv,
                                 cache_.stream_),
                 "cudaMemsetAsync");
    upload(seq.table_dev.data, seq.table.data(), seq.table.size() * sizeof(uint64_t));
  }
  void write_block(uint32_t block, uint32_t head, const uint8_t *bytes) override {
    DeviceGuard guard(cache_.device_);
    const uint32_t l = layers_.back().layer;
    auto *slot = reinterpret_cast<uint8_t *>(current().table[block]);
    upload(slot + size_t(head) * cache_.layers_[l].shape.head_stride, bytes, cache_.spec().layers[l].layout.stride);
  }
  void write_exact(ExactRows which, uint32_t first, uint32_t count, bool values, const uint8_t *rows) override {
    DeviceGuard guard(cache_.device_);
    const SeqState &seq = current();
    const size_t token = cache_.token_bytes_;
    if (which == ExactRows::sinks) {
      upload(seq.sink + (values ? cache_.sink_bytes() : 0) + size_t(first) * token, rows, size_t(count) * token);
      return;
    }
    cache_.for_tail_runs(cache_.layers_[layers_.back().layer], seq, first, count, values,
                         [&](uint8_t *device, uint32_t run, uint32_t done) {
                           upload(device, rows + size_t(done) * token, size_t(run) * token);
                         });
  }
  void write_outliers(uint32_t head, const PortableOutliers &in) override {
    DeviceGuard guard(cache_.device_);
    const KernelShape &k = cache_.layers_[layers_.back().layer].shape;
    const OttLayout &o = k.ott;
    const size_t row = size_t(k.d) * cache_.spec().io_elem, P = k.ott_pool;
    std::vector<uint8_t> state(o.bytes);  // the device layout of layout.hpp's OttLayout
    // An empty pool comes with empty vectors, whose data() may be NULL: memcpy must not see it.
    const auto copy = [&](size_t offset, const void *src, size_t bytes) {
      if (bytes) std::memcpy(state.data() + offset, src, bytes);
    };
    const uint32_t header[4] = {in.pool, in.spilled, in.tracing ? 1u : 0u, 0u};
    copy(0, header, sizeof header);
    copy(o.positions, in.positions.data(), size_t(in.pool) * 4);
    copy(o.positions + 4 * P, in.positions.data() + in.pool, size_t(in.spilled) * 4);
    copy(o.norms, in.norms.data(), size_t(in.pool) * 4);
    for (auto [src, offset] : {std::pair{&in.keys, o.keys}, std::pair{&in.values, o.values}}) {
      copy(offset, src->data(), in.pool * row);
      copy(offset + P * row, src->data() + in.pool * row, in.spilled * row);
    }
    SeqState &seq = current();
    seq.ott_side = 0;
    seq.ott_ready = true;
    upload(cache_.ott_state(cache_.layers_[layers_.back().layer], seq, 0) + size_t(head) * o.bytes, state.data(),
           state.size());
  }
  void flush() override {
    DeviceGuard guard(cache_.device_);
    check_cuda(cudaStreamSynchronize(cache_.stream_), "cudaStreamSynchronize (import)");
  }
  uint64_t bytes_added() const override {
    uint64_t bytes = 0;
    for (const auto &staged : layers_) {
      const SeqState &seq = staged.node.mapped();
      const uint64_t stored = seq.blocks - seq.freed_blocks;
      bytes += cache_.own_bytes(staged.layer, seq) + stored * cache_.slot_bytes(staged.layer);
    }
    return bytes;
  }
  // The C layer checked that the layers hold no tokens: no record with slots is replaced.
  void commit() noexcept override {
    cache_.used_ += bytes_added();
    layers_.commit([this](uint32_t layer) -> auto & { return cache_.layers_[layer].seqs; });
  }

 private:
  using StagedLayer = StagedLayers<SeqState>::Layer;
  SeqState &current() { return layers_.back().node.mapped(); }
  // The cache's asynchronous upload; flush() waits for all of them.
  void upload(void *device, const void *host, size_t bytes) const { cache_.upload(device, host, bytes); }

  CudaCache &cache_;
  StagedLayers<SeqState> layers_;
};

std::unique_ptr<PortableImport> CudaCache::begin_import(uint32_t seq) { return std::make_unique<CudaImport>(*this, seq); }

void CudaCache::stats(qjlkv_stats &out) const {
  const qjlkv_config &cfg = spec().cfg;
  const uint64_t Hkv = cfg.num_kv_heads;
  uint64_t tokens = 0, keys_q = 0, values_q = 0, full = 0, meta = 0, padding = 0, rollback = 0, shared = 0,
           allocated = 0;
  for (uint32_t l = 0; l < cfg.num_layers; ++l) {
    const LayerState &layer = layers_[l];
    const BlockLayout &b = spec().layers[l].layout;
    // Slots and rollback copies are counted once, however many sequences hold them. The bytes that
    // align each head's block to 16 (head_stride > stride) are allocation, as the CPU's page slack.
    const uint64_t held = layer.blocks->slots_held(), copies = layer.copies->slots_held();
    keys_q += held * Hkv * b.key_bytes;
    values_q += held * Hkv * b.value_bytes;
    padding += held * Hkv * (b.stride - b.key_bytes - b.value_bytes);
    rollback += copies * copy_bytes(l);
    shared += layer.blocks->slots_shared() * slot_bytes(l) + layer.copies->slots_shared() * copy_bytes(l);
    allocated += layer.blocks->bytes_reserved() + layer.rings->bytes_reserved() + layer.copies->bytes_reserved();
    if (layer.otts) allocated += layer.otts->bytes_reserved();
    if (layer.sinks) allocated += layer.sinks->bytes_reserved();
    for (const auto &[id, seq] : layer.seqs) {
      tokens += seq.length - uint64_t(seq.freed_blocks) * cfg.block_tokens;  // freed positions are not held
      meta += sizeof(SeqState);
      full += own_bytes(l, seq) - sizeof(SeqState);
      allocated += sizeof(SeqState) + seq.table_dev.bytes + seq.table.capacity() * sizeof(uint64_t) +
                   seq.copies.capacity() * sizeof(uint8_t *);
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

}  // namespace
}  // namespace qjlkv::cuda

namespace qjlkv {

std::unique_ptr<qjlkv_cache> make_cuda_cache(CacheSpec spec) {
  const uint32_t device = spec.cfg.device_ordinal;
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    fail(QJLKV_ERROR_UNSUPPORTED,
         "config.device_ordinal is %u, but no CUDA device is usable: cudaGetDeviceCount failed with %s (%s)", device,
         cudaGetErrorName(status), cudaGetErrorString(status));
  }
  if (count <= 0 || device >= uint32_t(count))
    fail(QJLKV_ERROR_UNSUPPORTED, "config.device_ordinal is %u, but this machine has %d CUDA device(s)", device,
         count);
  return std::make_unique<cuda::CudaCache>(std::move(spec));
}

}  // namespace qjlkv
