// Where the positions of one (layer, sequence) live (SPEC §6, docs/DESIGN.md "Cache
// semantics"): the sinks [0, S), the quantized blocks, then the tail. The rules are written here
// once; each backend says where it keeps the rows.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "config.hpp"
#include "elements.hpp"
#include "methods/methods.hpp"
#include "window.hpp"

namespace qjlkv {

// What an append of n tokens does to a sequence holding `sinks` sinks and a tail of
// `tail_tokens` tokens: the first new_sinks tokens become sinks, the others join the tail, and
// the oldest new_blocks·B tokens of that tail (T tokens) are quantized: floor((T − R)/B)
// blocks once T >= R + B.
struct AppendSplit {
  uint32_t new_sinks = 0;
  uint64_t new_blocks = 0;
  uint64_t tail_tokens = 0;  // after the append
};
inline AppendSplit split_append(const qjlkv_config &cfg, uint32_t sinks, uint64_t tail_tokens, uint32_t n) {
  AppendSplit s;
  s.new_sinks = std::min(cfg.sink_tokens - sinks, n);
  const uint64_t total = tail_tokens + (n - s.new_sinks);
  const uint64_t R = cfg.residual_tokens, B = cfg.block_tokens;
  s.new_blocks = total >= R + B ? (total - R) / B : 0;
  s.tail_tokens = total - s.new_blocks * B;
  return s;
}

// Blocks a sequence of `length` positions holds: the tail rule above, applied from scratch.
inline uint32_t blocks_at(const qjlkv_config &cfg, uint64_t length) {
  const uint64_t past_sinks = length > cfg.sink_tokens ? length - cfg.sink_tokens : 0;
  const uint64_t R = cfg.residual_tokens, B = cfg.block_tokens;
  return past_sinks >= R + B ? uint32_t((past_sinks - R) / B) : 0;
}

// The rollback floor (qjlkv.h, "Sequence operations") after an append takes a sequence whose floor
// is `floor` to new_length positions. The backends keep exact copies of blocks
// [blocks_at(floor), blocks) of every sequence.
// Blocks of 16-bit keys and values read back exactly what a 16-bit input appended: a truncate can
// reopen them from the blocks themselves, so such caches need no copies (their floor is the length).
inline uint64_t rollback_floor_after(const qjlkv_config &cfg, uint64_t floor, uint64_t new_length) {
  const bool lossless = cfg.key_method == QJLKV_KEYS_EXACT && cfg.value_bits == 16 && cfg.dtype != QJLKV_DTYPE_F32;
  const uint64_t D = lossless ? 0 : cfg.rollback_tokens;
  return std::max(floor, new_length > D ? new_length - D : 0);
}

// Sliding windows (qjlkv.h, "Attention variants of a layer"): how many leading blocks of a
// record are freed once an append takes it from previous_length to new_length positions. The
// queries of that append sit at positions >= previous_length; those of any append after a
// truncate to n >= new_length − rollback_tokens (what speculative decoding does, and every
// truncate to the rollback floor or above) at positions >= n. Each sees from window_start() of
// its position on: the blocks that end before min(previous_length, new_length − rollback_tokens)
// − W + 1 are freed, except those such a truncate would reopen (it stays exact). Caches without
// rollback copies (16-bit exact blocks, whose floor is their length) free by the same rule, so
// that speculative decoding on them is never refused either. Sinks, the tail and OTT's pools are
// kept (they are bounded). A record frees max(what it freed before, this).
inline uint32_t window_freed_blocks(const qjlkv_config &cfg, uint32_t window, uint64_t previous_length,
                                    uint64_t new_length) {
  if (window == 0) return 0;
  const uint64_t reopenable_from = new_length > cfg.rollback_tokens ? new_length - cfg.rollback_tokens : 0;
  const uint32_t kept_for_truncates = blocks_at(cfg, reopenable_from);
  return blocks_before(window_start(std::min(previous_length, reopenable_from), window), cfg.sink_tokens,
                       cfg.block_tokens, kept_for_truncates);
}

// Bytes both backends count alike (qjlkv_cache_stats): one block of every kv head; one rollback
// copy (the block's exact keys and values, and on traced layers each head's OTT pool from before
// it); the exact rows of a record (sinks, tail, and a traced layer's whole pool and spill area).
inline size_t block_slot_bytes(const CacheSpec &spec, uint32_t layer) {
  return spec.layers[layer].layout.stride * spec.cfg.num_kv_heads;
}
inline size_t rollback_copy_bytes(const CacheSpec &spec, uint32_t layer) {
  const qjlkv_config &cfg = spec.cfg;
  const size_t token = size_t(cfg.num_kv_heads) * cfg.head_dim * spec.tail_elem;
  const size_t rows = 2 * size_t(cfg.block_tokens) * token;
  if (!spec.layers[layer].traced) return rows;
  const size_t slot = 2 * size_t(cfg.head_dim) * spec.io_elem + sizeof(uint32_t) + sizeof(float);
  return rows + size_t(cfg.num_kv_heads) * cfg.outlier_tokens * slot;
}
inline uint64_t exact_row_bytes(const CacheSpec &spec, uint32_t layer, uint64_t sinks, uint64_t tail_tokens) {
  const qjlkv_config &cfg = spec.cfg;
  const uint64_t token = uint64_t(cfg.num_kv_heads) * cfg.head_dim * spec.tail_elem;
  uint64_t bytes = 2 * (sinks + tail_tokens) * token;
  if (spec.layers[layer].traced) {  // K, V and position per slot, a norm per pool slot
    const uint64_t slots = uint64_t(cfg.outlier_tokens) + cfg.outlier_spill_tokens;
    bytes += cfg.num_kv_heads * (slots * (2 * uint64_t(cfg.head_dim) * spec.io_elem + sizeof(uint32_t)) +
                                 uint64_t(cfg.outlier_tokens) * sizeof(float));
  }
  return bytes;
}

// What a (layer, sequence) record holds, as the byte counts need it: its rollback copies cover
// blocks [first_copy, blocks).
// blocks [0, freed_blocks) are freed by a sliding window (window_freed_blocks).
struct RecordCounts {
  uint64_t length = 0, rollback_floor = 0;
  uint64_t sinks = 0, tail_tokens = 0;
  uint32_t blocks = 0, first_copy = 0, freed_blocks = 0;
};

// The change of bytes_used that appending n tokens brings to a record (null: a new one) of a
// layer with a window of `window` tokens (0: none), where a record itself takes record_bytes,
// sole_holder(b) says whether the record is the only holder of the rollback copy of block b and
// sole_block_holder(b) whether it is of block b itself (what a fork shares is not freed when one
// holder drops it).
template <class SoleHolder, class SoleBlockHolder>
int64_t append_growth(const CacheSpec &spec, uint32_t layer, size_t record_bytes, const RecordCounts *record,
                      uint32_t n, uint32_t window, SoleHolder sole_holder, SoleBlockHolder sole_block_holder) {
  const RecordCounts r = record ? *record : RecordCounts{};
  const int64_t token = int64_t(spec.cfg.num_kv_heads) * spec.cfg.head_dim * int64_t(spec.tail_elem);
  const AppendSplit split = split_append(spec.cfg, uint32_t(r.sinks), r.tail_tokens, n);
  int64_t growth = record ? 0 : int64_t(record_bytes + exact_row_bytes(spec, layer, 0, 0));
  growth += 2 * token * (int64_t(split.new_sinks) + int64_t(split.tail_tokens) - int64_t(r.tail_tokens));
  growth += int64_t(split.new_blocks * block_slot_bytes(spec, layer));
  const uint32_t end = r.blocks + uint32_t(split.new_blocks);
  const uint32_t keep_from = blocks_at(spec.cfg, rollback_floor_after(spec.cfg, r.rollback_floor, r.length + n));
  const int64_t copy = int64_t(rollback_copy_bytes(spec, layer));
  growth += int64_t(end - std::min(end, std::max(keep_from, r.blocks))) * copy;
  for (uint32_t b = r.first_copy; b < std::min(keep_from, r.blocks); ++b)
    if (sole_holder(b)) growth -= copy;
  // Blocks the window frees: never ones with a copy (they lie below blocks_at(floor)); new blocks
  // among them are held by the record alone.
  const uint32_t freed = std::max(r.freed_blocks, window_freed_blocks(spec.cfg, window, r.length, r.length + n));
  const int64_t slot = int64_t(block_slot_bytes(spec, layer));
  for (uint32_t b = r.freed_blocks; b < freed; ++b)
    if (b >= r.blocks || sole_block_holder(b)) growth -= slot;
  return growth;
}

// OTT's exact outlier tokens of one (sequence, kv head) as a backend keeps them: slots
// [0, pool) are the pool, [pool_tokens, pool_tokens + spilled) the spill area.
struct OutlierRows {
  uint32_t pool = 0, spilled = 0, pool_tokens = 0;
  const uint32_t *positions = nullptr;             // [slots]
  const uint8_t *keys = nullptr, *values = nullptr;  // [slots][d], I/O dtype
};

// The dense float32 keys and values of positions [first, first + count) of one (layer, sequence)
// with `sinks` sinks and `blocks` blocks, [count][Hkv][d] each (either may be null): sinks and
// tail rows as stored, OTT's moved tokens from their outlier slot, the rest dequantized by the
// methods. `rows` says where the backend keeps them:
//   const uint8_t *sink(uint64_t p, bool values)   token p's [Hkv][d] row of the sinks
//   const uint8_t *tail(uint64_t i, bool values)   the row of the i-th tail token
//   const uint8_t *block(uint64_t b, uint32_t h)   block b of kv head h (called in block order)
//   OutlierRows outliers(uint32_t h)               OTT-traced layers only
template <class Rows>
void reconstruct_positions(const CacheSpec &spec, uint32_t layer, uint64_t sinks, uint64_t blocks, uint64_t first,
                           uint64_t count, Rows &rows, float *keys_out, float *values_out) {
  const qjlkv_config &cfg = spec.cfg;
  const LayerSpec &ls = spec.layers[layer];
  const uint32_t d = cfg.head_dim, B = cfg.block_tokens, Hkv = cfg.num_kv_heads;
  const qjlkv_dtype dtype = dtype_of(cfg);
  const uint64_t quantized = sinks + blocks * B;
  with_methods(cfg, [&](auto keys, auto values) {
    for (uint64_t p = first; p < first + count; ++p) {
      for (uint32_t h = 0; h < Hkv; ++h) {
        float *k = keys_out ? keys_out + ((p - first) * Hkv + h) * d : nullptr;
        float *v = values_out ? values_out + ((p - first) * Hkv + h) * d : nullptr;
        const auto exact = [&](const auto &row_of) {
          if (k) load_row(row_of(false), size_t(h) * d, d, dtype, k);
          if (v) load_row(row_of(true), size_t(h) * d, d, dtype, v);
        };
        if (p < sinks) {
          exact([&](bool value_rows) { return rows.sink(p, value_rows); });
          continue;
        }
        if (p >= quantized) {
          exact([&](bool value_rows) { return rows.tail(p - quantized, value_rows); });
          continue;
        }
        const uint8_t *block = rows.block((p - sinks) / B, h);
        const uint32_t t = uint32_t((p - sinks) % B);
        if (keys.moved(ls.layout, block, t)) {  // the token lives on, exact, in its outlier slot
          const OutlierRows o = rows.outliers(h);
          for (uint32_t i = 0; i < o.pool + o.spilled; ++i) {
            const uint32_t slot = i < o.pool ? i : o.pool_tokens + (i - o.pool);
            if (o.positions[slot] != p) continue;
            if (k) load_row(o.keys, size_t(slot) * d, d, dtype, k);
            if (v) load_row(o.values, size_t(slot) * d, d, dtype, v);
          }
          continue;
        }
        if (k) keys.dequantize_token(spec, ls, block, t, k);
        if (v) values.dequantize_token(spec, ls, block, t, v);
      }
    }
  });
}

// Positions [first, first + count) of a record as the attention sees them (reconstruct_positions,
// `rows` as there), stored in the I/O dtype into keys/values rows [count][Hkv][d]: what a truncate
// below the rollback floor keeps of reopened blocks. Clamped to the range append accepts (a QJL
// key's reconstruction can lie beyond the keys appended) and to the dtype's finite range.
template <class Rows>
void store_reconstruction(const CacheSpec &spec, uint32_t layer, uint64_t sinks, uint64_t blocks, uint64_t first,
                          uint64_t count, Rows &rows, uint8_t *keys, uint8_t *values) {
  const qjlkv_dtype dtype = dtype_of(spec.cfg);
  const float dtype_max = dtype == QJLKV_DTYPE_F16 ? 65504.0f : std::numeric_limits<float>::max();
  std::vector<float> k(size_t(count) * spec.cfg.num_kv_heads * spec.cfg.head_dim), v(k.size());
  reconstruct_positions(spec, layer, sinks, blocks, first, count, rows, k.data(), v.data());
  for (auto [x, limit, out] : {std::tuple{&k, std::min(spec.key_limit, dtype_max), keys},
                               std::tuple{&v, std::min(spec.value_limit, dtype_max), values}}) {
    for (float &e : *x) e = std::clamp(e, -limit, limit);
    store_row(x->data(), x->size(), dtype, out, 0);
  }
}

// A truncate that reopens blocks without a copy of the OTT pool from before them: the outlier
// tokens at positions >= reopened_from leave the pool and the spill area (their rows are in the
// tail again), the others keep their order. The slots are laid out as in OutlierRows, rows of
// row_bytes bytes; norms [pool_tokens] belong to the pool's slots.
inline void drop_outliers_from(uint64_t reopened_from, uint32_t pool_tokens, uint32_t &pool, uint32_t &spilled,
                               uint32_t *positions, float *norms, uint8_t *keys, uint8_t *values, size_t row_bytes) {
  const auto keep = [&](uint32_t first, uint32_t count, bool in_pool) {
    uint32_t kept = first;
    for (uint32_t i = first; i < first + count; ++i) {
      if (positions[i] >= reopened_from) continue;
      std::memmove(keys + size_t(kept) * row_bytes, keys + size_t(i) * row_bytes, row_bytes);
      std::memmove(values + size_t(kept) * row_bytes, values + size_t(i) * row_bytes, row_bytes);
      positions[kept] = positions[i];
      if (in_pool) norms[kept] = norms[i];
      ++kept;
    }
    return kept - first;
  };
  pool = keep(0, pool, true);
  spilled = keep(pool_tokens, spilled, false);
}

}  // namespace qjlkv
