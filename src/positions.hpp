// Where the positions of one (layer, sequence) live (SPEC §6, docs/DESIGN.md "Cache
// semantics"): the sinks [0, S), the quantized blocks, then the tail. The rules are written here
// once; each backend says where it keeps the rows.
#pragma once
#include <algorithm>
#include <cstdint>

#include "config.hpp"
#include "cpu/kernels.hpp"
#include "methods/methods.hpp"

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
inline uint64_t rollback_floor_after(const qjlkv_config &cfg, uint64_t floor, uint64_t new_length) {
  const uint64_t D = cfg.rollback_tokens;
  return std::max(floor, new_length > D ? new_length - D : 0);
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
          if (k) cpu::load_row(row_of(false), size_t(h) * d, d, dtype, k);
          if (v) cpu::load_row(row_of(true), size_t(h) * d, d, dtype, v);
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
            if (k) cpu::load_row(o.keys, size_t(slot) * d, d, dtype, k);
            if (v) cpu::load_row(o.values, size_t(slot) * d, d, dtype, v);
          }
          continue;
        }
        if (k) keys.dequantize_token(spec, ls, block, t, k);
        if (v) values.dequantize_token(spec, ls, block, t, v);
      }
    }
  });
}

}  // namespace qjlkv
