// The C ABI: checks every argument that needs no tensor data, then calls the backend; every
// exception becomes a status plus the thread-local message.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <vector>

#include "cache.hpp"
#include "config.hpp"
#include "error.hpp"
#include "positions.hpp"
#include "qjlkv/qjlkv.h"
#include "threads.hpp"

using qjlkv::fail;
using qjlkv::guarded;

namespace {

#define QJLKV_STR2(x) #x
#define QJLKV_STR(x) QJLKV_STR2(x)
constexpr const char kVersionString[] =
    QJLKV_STR(QJLKV_VERSION_MAJOR) "." QJLKV_STR(QJLKV_VERSION_MINOR) "." QJLKV_STR(QJLKV_VERSION_PATCH);

void require_pointer(const void *p, const char *name) {
  QJLKV_REQUIRE(p != nullptr, "%s is NULL", name);
}

void require_layer(const qjlkv_cache *c, uint32_t layer) {
  QJLKV_REQUIRE(layer < c->spec().cfg.num_layers, "layer is %u, the cache has %u layers (0..%u)", layer,
                c->spec().cfg.num_layers, c->spec().cfg.num_layers - 1);
}

// Elements of `count` items of `per_item` elements, refusing sizes whose byte count overflows.
size_t checked_elements(const char *what, uint64_t count, uint64_t per_item, size_t elem_bytes) {
  const uint64_t limit = uint64_t(PTRDIFF_MAX) / elem_bytes;
  if (per_item != 0 && count > limit / per_item)
    fail(QJLKV_ERROR_INVALID_ARGUMENT, "%s: %llu x %llu elements overflow the address space", what,
         (unsigned long long)count, (unsigned long long)per_item);
  return size_t(count * per_item);
}

// A sequence holds at most 2^32 - 1 positions (positions are 32-bit in the kernels).
void require_room(const qjlkv_cache *c, uint32_t layer, uint32_t seq, uint32_t n_tokens) {
  const uint64_t length = c->length(layer, seq);
  QJLKV_REQUIRE(length + n_tokens <= UINT32_MAX,
                "n_tokens is %u: seq %u of layer %u would exceed 2^32 - 1 tokens (it holds %llu)", n_tokens, seq,
                layer, (unsigned long long)length);
}

// Every size of qjlkv_stats that a release shipped, oldest first (see qjlkv_config's in config.cpp).
constexpr uint32_t kStatsSizes[] = {QJLKV_STATS_SIZE_0_1, uint32_t(sizeof(qjlkv_stats))};
static_assert(offsetof(qjlkv_stats, bytes_rollback) == QJLKV_STATS_SIZE_0_1, "0.4's fields start after 0.3's struct");

// The most positions any layer of seq holds.
uint64_t longest_layer(const qjlkv_cache *c, uint32_t seq) {
  uint64_t longest = 0;
  for (uint32_t l = 0; l < c->spec().cfg.num_layers; ++l) longest = std::max(longest, c->length(l, seq));
  return longest;
}

// Sliding windows free the leading blocks of a record (qjlkv.h, "Attention variants of a
// layer"): blocks [0, blocks), positions [first, end) = [sink_tokens, sink_tokens + blocks·B) of
// (layer, seq), are no longer stored; all 0 when none are.
struct FreedRange {
  uint64_t first = 0, end = 0;
  uint32_t blocks = 0;
};
FreedRange freed_range(const qjlkv_cache *c, uint32_t layer, uint32_t seq) {
  const qjlkv_config &cfg = c->spec().cfg;
  if (c->attention(layer).window == 0) return {};  // only a window frees (and it stays while tokens are held)
  const uint32_t freed = c->length(layer, seq) > 0 ? c->portable_counts(layer, seq).freed_blocks : 0;
  if (freed == 0) return {};
  return {cfg.sink_tokens, cfg.sink_tokens + uint64_t(freed) * cfg.block_tokens, freed};
}

// Refuses queries of seq whose first one (at position length - queries_per_seq) would see a freed
// position through the layer's window; a count beyond the length is left to the backend's check.
void require_window_held(const qjlkv_cache *c, uint32_t layer, uint32_t seq, uint32_t queries_per_seq,
                         const char *argument) {
  const FreedRange freed = freed_range(c, layer, seq);
  const uint64_t length = c->length(layer, seq);
  if (freed.end == 0 || queries_per_seq > length) return;
  const uint64_t first_query = length - queries_per_seq;
  const uint64_t start = qjlkv::window_start(first_query, c->attention(layer).window);
  QJLKV_REQUIRE(start >= freed.end,
                "%s: the window of the query at position %llu of seq %u starts at %llu, but layer %u's window "
                "freed positions [%llu, %llu) of that sequence",
                argument, (unsigned long long)first_query, seq, (unsigned long long)start, layer,
                (unsigned long long)freed.first, (unsigned long long)freed.end);
}

// Refuses a truncate (or fork) of seq to `length` positions that would reopen a freed block or
// whose next query (at position length) would see a freed position through the window.
void require_cut_held(const qjlkv_cache *c, uint32_t seq, uint64_t length, const char *argument) {
  if (length == 0) return;  // empties the sequence
  for (uint32_t l = 0; l < c->spec().cfg.num_layers; ++l) {
    const FreedRange freed = freed_range(c, l, seq);
    if (freed.end == 0 || c->length(l, seq) <= length) continue;
    QJLKV_REQUIRE(qjlkv::blocks_at(c->spec().cfg, length) >= freed.blocks,
                  "%s is %llu: it would reopen positions [%llu, %llu) of seq %u that layer %u's window freed", argument,
                  (unsigned long long)length, (unsigned long long)freed.first, (unsigned long long)freed.end, seq, l);
    const uint64_t start = qjlkv::window_start(length, c->attention(l).window);
    QJLKV_REQUIRE(start >= freed.end,
                  "%s is %llu: the next query's window would start at %llu, but layer %u's window freed positions "
                  "[%llu, %llu) of seq %u",
                  argument, (unsigned long long)length, (unsigned long long)start, l, (unsigned long long)freed.first,
                  (unsigned long long)freed.end, seq);
  }
}

float resolve_scale(const qjlkv_cache *c, float scale) {
  QJLKV_REQUIRE(std::isfinite(scale), "scale is %g, must be finite (<= 0 selects 1/sqrt(head_dim))", double(scale));
  return scale > 0.0f ? scale : 1.0f / std::sqrt(float(c->spec().cfg.head_dim));
}

}  // namespace

extern "C" {

unsigned qjlkv_version_number(void) { return QJLKV_VERSION_NUMBER; }
const char *qjlkv_version_string(void) { return kVersionString; }

const char *qjlkv_status_string(qjlkv_status status) {
  // A C caller may pass any int: read it as one, since loading an out-of-range value as the C++
  // enum is undefined behaviour.
  int s;
  static_assert(sizeof s == sizeof status);
  std::memcpy(&s, &status, sizeof s);
  switch (s) {
    case QJLKV_OK: return "QJLKV_OK";
    case QJLKV_ERROR_INVALID_ARGUMENT: return "QJLKV_ERROR_INVALID_ARGUMENT";
    case QJLKV_ERROR_OUT_OF_MEMORY: return "QJLKV_ERROR_OUT_OF_MEMORY";
    case QJLKV_ERROR_UNSUPPORTED: return "QJLKV_ERROR_UNSUPPORTED";
    case QJLKV_ERROR_DEVICE: return "QJLKV_ERROR_DEVICE";
    case QJLKV_ERROR_CORRUPT_DATA: return "QJLKV_ERROR_CORRUPT_DATA";
    case QJLKV_ERROR_INTERNAL: return "QJLKV_ERROR_INTERNAL";
    case QJLKV_ERROR_MEMORY_BUDGET: return "QJLKV_ERROR_MEMORY_BUDGET";
  }
  return "unknown status";
}

const char *qjlkv_last_error_message(void) { return qjlkv::last_error_message(); }

qjlkv_status qjlkv_sketch_create(uint32_t head_dim, uint32_t sketch_dim, uint64_t seed, uint32_t flags,
                                 qjlkv_sketch **out) {
  if (out) *out = nullptr;
  return guarded([&] {
    require_pointer(out, "out");
    QJLKV_REQUIRE(head_dim >= 1 && head_dim <= QJLKV_MAX_SKETCH_HEAD_DIM, "head_dim is %u, must be in [1, %u]",
                  head_dim, QJLKV_MAX_SKETCH_HEAD_DIM);
    QJLKV_REQUIRE(sketch_dim >= 8 && sketch_dim <= QJLKV_MAX_SKETCH_DIM && sketch_dim % 8 == 0,
                  "sketch_dim is %u, must be a multiple of 8 in [8, %u]", sketch_dim, QJLKV_MAX_SKETCH_DIM);
    QJLKV_REQUIRE((flags & ~QJLKV_SKETCH_ORTHOGONAL) == 0,
                  "flags is 0x%x, only QJLKV_SKETCH_ORTHOGONAL (0x1) is defined", flags);
    *out = new qjlkv_sketch{
        qjlkv::make_sketch(head_dim, sketch_dim, seed, 0, (flags & QJLKV_SKETCH_ORTHOGONAL) != 0)};
  });
}

qjlkv_status qjlkv_sketch_matrix(const qjlkv_sketch *s, float *out, size_t out_len) {
  return guarded([&] {
    require_pointer(s, "s");
    require_pointer(out, "out");
    const size_t needed = s->matrix.data.size();
    QJLKV_REQUIRE(out_len >= needed, "out_len is %zu, the %u x %u sketch needs %zu floats", out_len,
                  s->matrix.rows, s->matrix.cols, needed);
    std::copy(s->matrix.data.begin(), s->matrix.data.end(), out);
  });
}

qjlkv_status qjlkv_sketch_shape(const qjlkv_sketch *s, uint32_t *rows, uint32_t *cols) {
  return guarded([&] {
    require_pointer(s, "s");
    require_pointer(rows, "rows");
    require_pointer(cols, "cols");
    *rows = s->matrix.rows;
    *cols = s->matrix.cols;
  });
}

void qjlkv_sketch_destroy(qjlkv_sketch *s) { delete s; }

qjlkv_status qjlkv_config_init(qjlkv_config *cfg, const char *preset, uint32_t num_layers, uint32_t num_q_heads,
                               uint32_t num_kv_heads, uint32_t head_dim) {
  return guarded([&] {
    require_pointer(cfg, "cfg");
    qjlkv::init_preset(*cfg, preset, num_layers, num_q_heads, num_kv_heads, head_dim);
  });
}

qjlkv_status qjlkv_config_validate(const qjlkv_config *cfg) {
  return guarded([&] {
    require_pointer(cfg, "cfg");
    qjlkv::validate_config(*cfg);
  });
}

qjlkv_status qjlkv_cache_create(const qjlkv_config *cfg, qjlkv_cache **out) {
  if (out) *out = nullptr;
  return guarded([&] {
    require_pointer(out, "out");
    require_pointer(cfg, "cfg");
    qjlkv::CacheSpec spec = qjlkv::make_cache_spec(*cfg);
    std::unique_ptr<qjlkv_cache> cache;
    switch (qjlkv::backend_of(spec.cfg)) {
      case QJLKV_BACKEND_CPU: cache = qjlkv::make_cpu_cache(std::move(spec)); break;
      case QJLKV_BACKEND_CUDA: cache = qjlkv::make_cuda_cache(std::move(spec)); break;
    }
    *out = cache.release();
  });
}

void qjlkv_cache_destroy(qjlkv_cache *c) { delete c; }

qjlkv_status qjlkv_cache_config(const qjlkv_cache *c, qjlkv_config *out) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(out, "out");
    qjlkv::write_caller_config(*out, c->spec().created_with);
  });
}

qjlkv_status qjlkv_cache_set_stream(qjlkv_cache *c, void *cuda_stream) {
  return guarded([&] {
    require_pointer(c, "c");
    c->set_stream(cuda_stream);
  });
}

qjlkv_status qjlkv_workers_create(uint32_t num_threads, qjlkv_workers **out) {
  if (out) *out = nullptr;
  return guarded([&] {
    require_pointer(out, "out");
    QJLKV_REQUIRE(num_threads <= QJLKV_MAX_THREADS, "num_threads is %u, must be <= %u (0 = cores available)",
                  num_threads, QJLKV_MAX_THREADS);
    auto workers = std::make_unique<qjlkv_workers>();
    workers->pool = std::make_shared<qjlkv::ThreadPool>(num_threads, "num_threads");
    *out = workers.release();
  });
}

void qjlkv_workers_destroy(qjlkv_workers *workers) { delete workers; }

qjlkv_status qjlkv_cache_set_workers(qjlkv_cache *c, qjlkv_workers *workers) {
  return guarded([&] {
    require_pointer(c, "c");
    c->set_workers(workers ? workers->pool : nullptr);
  });
}

// This header's struct (QJLKV_LAYER_ATTENTION_SIZE_0_5 on 64-bit targets, smaller on 32-bit ones).
constexpr uint32_t kLayerAttentionSizes[] = {uint32_t(sizeof(qjlkv_layer_attention))};
static_assert(sizeof(void *) != 8 || sizeof(qjlkv_layer_attention) == QJLKV_LAYER_ATTENTION_SIZE_0_5,
              "0.5's qjlkv_layer_attention on 64-bit targets");

qjlkv_status qjlkv_cache_set_layer_attention(qjlkv_cache *c, uint32_t layer, const qjlkv_layer_attention *attention) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(attention, "attention");
    qjlkv::require_shipped_size("attention->struct_size", attention->struct_size, kLayerAttentionSizes,
                                "qjlkv_layer_attention");
    require_layer(c, layer);
    const float cap = attention->logit_softcap;
    QJLKV_REQUIRE(std::isfinite(cap) && cap >= 0.0f,
                  "attention->logit_softcap is %g, must be finite and >= 0 (0 = no soft-capping)", double(cap));
    const uint32_t window = attention->window_tokens;
    QJLKV_REQUIRE(window == c->attention(layer).window || !c->layer_holds_tokens(layer),
                  "attention->window_tokens is %u, layer %u's is %u: a window changes only while the layer holds no "
                  "tokens",
                  window, layer, c->attention(layer).window);
    qjlkv::LayerAttention variant;
    variant.softcap = cap;
    variant.window = window;
    if (attention->sink_logits) {
      const uint32_t heads = c->spec().cfg.num_q_heads;
      variant.sink_logits.assign(attention->sink_logits, attention->sink_logits + heads);
      for (uint32_t h = 0; h < heads; ++h)
        QJLKV_REQUIRE(std::isfinite(variant.sink_logits[h]), "attention->sink_logits[%u] is %g, must be finite", h,
                      double(variant.sink_logits[h]));
    }
    c->set_attention(layer, std::move(variant));
  });
}

qjlkv_status qjlkv_cache_append(qjlkv_cache *c, uint32_t layer, uint32_t seq, uint32_t n_tokens, const void *keys,
                                const void *values) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(keys, "keys");
    require_pointer(values, "values");
    require_layer(c, layer);
    QJLKV_REQUIRE(n_tokens > 0, "n_tokens is 0, must be >= 1");
    const qjlkv_config &cfg = c->spec().cfg;
    checked_elements("n_tokens", n_tokens, uint64_t(cfg.num_kv_heads) * cfg.head_dim, c->spec().io_elem);
    require_room(c, layer, seq, n_tokens);
    c->append(layer, &seq, 1, n_tokens, keys, values);
  });
}

qjlkv_status qjlkv_cache_append_batch(qjlkv_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
                                      const void *keys, const void *values) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(seqs, "seqs");
    require_pointer(keys, "keys");
    require_pointer(values, "values");
    require_layer(c, layer);
    QJLKV_REQUIRE(n_seqs > 0, "n_seqs is 0, must be >= 1");
    const qjlkv_config &cfg = c->spec().cfg;
    checked_elements("n_seqs", n_seqs, uint64_t(cfg.num_kv_heads) * cfg.head_dim, c->spec().io_elem);
    std::vector<uint32_t> sorted(seqs, seqs + n_seqs);
    std::sort(sorted.begin(), sorted.end());
    const auto duplicate = std::adjacent_find(sorted.begin(), sorted.end());
    QJLKV_REQUIRE(duplicate == sorted.end(), "seqs lists sequence %u twice: a batch appends one token per sequence",
                  duplicate == sorted.end() ? 0u : *duplicate);
    for (uint32_t i = 0; i < n_seqs; ++i) require_room(c, layer, seqs[i], 1);
    c->append(layer, seqs, n_seqs, 1, keys, values);
  });
}

qjlkv_status qjlkv_cache_attend(qjlkv_cache *c, uint32_t layer, uint32_t seq, uint32_t n_queries,
                                const void *queries, float scale, void *out) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(queries, "queries");
    require_pointer(out, "out");
    require_layer(c, layer);
    QJLKV_REQUIRE(n_queries > 0, "n_queries is 0, must be >= 1");
    const qjlkv_config &cfg = c->spec().cfg;
    checked_elements("n_queries", n_queries, uint64_t(cfg.num_q_heads) * cfg.head_dim, c->spec().io_elem);
    require_window_held(c, layer, seq, n_queries, "n_queries");
    c->attend(layer, &seq, 1, n_queries, queries, resolve_scale(c, scale), out);
  });
}

qjlkv_status qjlkv_cache_attend_batch(qjlkv_cache *c, uint32_t layer, uint32_t n_seqs, const uint32_t *seqs,
                                      const void *queries, float scale, void *out) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(seqs, "seqs");
    require_pointer(queries, "queries");
    require_pointer(out, "out");
    require_layer(c, layer);
    QJLKV_REQUIRE(n_seqs > 0, "n_seqs is 0, must be >= 1");
    const qjlkv_config &cfg = c->spec().cfg;
    checked_elements("n_seqs", n_seqs, uint64_t(cfg.num_q_heads) * cfg.head_dim, c->spec().io_elem);
    for (uint32_t i = 0; i < n_seqs; ++i) require_window_held(c, layer, seqs[i], 1, "seqs");
    c->attend(layer, seqs, n_seqs, 1, queries, resolve_scale(c, scale), out);
  });
}

qjlkv_status qjlkv_cache_scores(qjlkv_cache *c, uint32_t layer, uint32_t seq, const void *query, float *out,
                                size_t out_len) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(query, "query");
    require_pointer(out, "out");
    require_layer(c, layer);
    const uint64_t length = c->length(layer, seq);
    QJLKV_REQUIRE(length > 0, "seq %u holds no tokens in layer %u", seq, layer);
    const uint64_t needed = length * c->spec().cfg.num_q_heads;
    QJLKV_REQUIRE(out_len >= needed, "out_len is %zu, need num_q_heads (%u) x length (%llu) = %llu floats", out_len,
                  c->spec().cfg.num_q_heads, (unsigned long long)length, (unsigned long long)needed);
    c->scores(layer, seq, query, out);
    // A finite query whose products overflow float gives inf - inf somewhere: refuse, as attend does.
    const float *nan = std::find_if(out, out + needed, [](float x) { return std::isnan(x); });
    if (nan != out + needed) {
      const size_t i = size_t(nan - out);
      fail(QJLKV_ERROR_INVALID_ARGUMENT,
           "query: the logit of query head %zu at position %zu of seq %u overflows the float range; "
           "scale the query down",
           i / length, i % length, seq);
    }
  });
}

qjlkv_status qjlkv_cache_reconstruct(qjlkv_cache *c, uint32_t layer, uint32_t seq, uint64_t first, uint64_t count,
                                     float *keys_out, float *values_out) {
  return guarded([&] {
    require_pointer(c, "c");
    QJLKV_REQUIRE(keys_out || values_out, "keys_out and values_out are both NULL: nothing to reconstruct");
    require_layer(c, layer);
    QJLKV_REQUIRE(count > 0, "count is 0, must be >= 1");
    const uint64_t length = c->length(layer, seq);
    QJLKV_REQUIRE(first < length && count <= length - first,
                  "first (%llu) + count (%llu) exceed the length (%llu) of seq %u in layer %u",
                  (unsigned long long)first, (unsigned long long)count, (unsigned long long)length, seq, layer);
    const FreedRange freed = freed_range(c, layer, seq);
    QJLKV_REQUIRE(first >= freed.end || first + count <= freed.first,
                  "first (%llu), count (%llu): positions [%llu, %llu) of seq %u in layer %u were freed by the layer's "
                  "window",
                  (unsigned long long)first, (unsigned long long)count, (unsigned long long)freed.first,
                  (unsigned long long)freed.end, seq, layer);
    c->reconstruct(layer, seq, first, count, keys_out, values_out);
  });
}

qjlkv_status qjlkv_cache_length(const qjlkv_cache *c, uint32_t layer, uint32_t seq, uint64_t *out) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(out, "out");
    require_layer(c, layer);
    *out = c->length(layer, seq);
  });
}

qjlkv_status qjlkv_cache_sketch(const qjlkv_cache *c, uint32_t layer, const qjlkv_sketch **out) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(out, "out");
    require_layer(c, layer);
    const qjlkv_sketch *sketch = c->spec().layers[layer].sketch.get();
    if (!sketch) fail(QJLKV_ERROR_UNSUPPORTED, "the cache's key_method is not QJL: it has no sketch");
    *out = sketch;
  });
}

qjlkv_status qjlkv_cache_clear_sequence(qjlkv_cache *c, uint32_t seq) {
  return guarded([&] {
    require_pointer(c, "c");
    c->clear(seq);
  });
}

qjlkv_status qjlkv_cache_truncate(qjlkv_cache *c, uint32_t seq, uint64_t length) {
  return guarded([&] {
    require_pointer(c, "c");
    const uint64_t longest = longest_layer(c, seq);
    QJLKV_REQUIRE(length <= longest, "length is %llu, but seq %u holds at most %llu positions in a layer",
                  (unsigned long long)length, seq, (unsigned long long)longest);
    require_cut_held(c, seq, length, "length");
    if (length < longest) c->truncate(seq, length);
  });
}

qjlkv_status qjlkv_cache_fork(qjlkv_cache *c, uint32_t src_seq, uint32_t dst_seq, uint64_t length) {
  return guarded([&] {
    require_pointer(c, "c");
    QJLKV_REQUIRE(src_seq != dst_seq, "src_seq and dst_seq are both %u: a sequence cannot be forked into itself",
                  src_seq);
    const uint64_t dst_length = longest_layer(c, dst_seq);
    QJLKV_REQUIRE(dst_length == 0, "dst_seq %u holds %llu positions: fork needs an empty sequence", dst_seq,
                  (unsigned long long)dst_length);
    const uint64_t longest = longest_layer(c, src_seq);
    QJLKV_REQUIRE(length <= longest, "length is %llu, but src_seq %u holds at most %llu positions in a layer",
                  (unsigned long long)length, src_seq, (unsigned long long)longest);
    require_cut_held(c, src_seq, length, "length");
    if (length > 0) c->fork(src_seq, dst_seq, length);
  });
}

qjlkv_status qjlkv_cache_bytes_needed(const qjlkv_cache *c, uint32_t seq, uint32_t n_tokens, uint64_t *out) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(out, "out");
    QJLKV_REQUIRE(longest_layer(c, seq) + n_tokens <= UINT32_MAX,
                  "n_tokens is %u: seq %u would exceed 2^32 - 1 positions", n_tokens, seq);
    *out = n_tokens == 0 ? 0 : c->bytes_needed(seq, n_tokens);
  });
}

qjlkv_status qjlkv_cache_sequence_bytes(const qjlkv_cache *c, uint32_t seq, uint64_t *bytes, uint64_t *shared) {
  return guarded([&] {
    require_pointer(c, "c");
    uint64_t held = 0, held_by_others_too = 0;
    c->sequence_bytes(seq, held, held_by_others_too);
    if (bytes) *bytes = held;
    if (shared) *shared = held_by_others_too;
  });
}

qjlkv_status qjlkv_cache_stats(const qjlkv_cache *c, qjlkv_stats *out) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(out, "out");
    const uint32_t size = out->struct_size;
    qjlkv::require_shipped_size("out->struct_size", size, kStatsSizes, "qjlkv_stats");
    qjlkv_stats full{};
    c->stats(full);
    full.bytes_used = full.bytes_keys_quantized + full.bytes_values_quantized + full.bytes_full_precision +
                      full.bytes_metadata + full.bytes_rollback;
    // The running count that the budget checks read must be what a full count gives.
    if (full.bytes_used != c->bytes_used())
      fail(QJLKV_ERROR_INTERNAL, "the cache counts %llu bytes used, its contents hold %llu",
           (unsigned long long)c->bytes_used(), (unsigned long long)full.bytes_used);
    const uint64_t numbers = full.tokens * c->spec().cfg.num_kv_heads * c->spec().cfg.head_dim * 2;  // K and V
    full.bytes_fp16_equivalent = numbers * 2;
    full.bits_per_number = numbers ? double(full.bytes_used) * 8.0 / double(numbers) : 0.0;
    full.struct_size = size;
    std::memcpy(out, &full, size);
  });
}

}  // extern "C"
