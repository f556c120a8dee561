// Byte layout of one quantized block of one kv head, the format both backends store. A plain
// struct without CUDA or standard-library containers, so that the CUDA kernels read it as it is.
#pragma once
#include <cstddef>

namespace qjlkv {

// Keys then values, each a few arrays. 16-bit arrays come first so every array stays 2-byte
// aligned; the stride is padded to 8.
struct BlockLayout {
  // keys
  size_t key_norm_in = 0, key_norm_out = 0;  // QJL: fp16[B] each
  size_t key_corrections = 0;                // QJL: fp16[c][B], the outlier corrections τ
  size_t key_bits_in = 0;                    // QJL: [B][m/8]
  size_t key_outlier_idx = 0;                // QJL: uint8[c]
  size_t key_scale = 0, key_min = 0;         // KIVI/OTT: fp16[d] each; MIXED: key_min fp16[d]
  size_t key_max = 0;                        // MIXED: fp16[d]
  size_t key_widths = 0;                     // MIXED: 3-bit widths [d*3/8]
  size_t key_codes = 0;                      // KIVI/OTT: [B][d*key_bits/8]; EXACT: 16-bit[B][d];
                                             // MIXED: [B][key_token_bits/8]
  size_t key_mask = 0;                       // OTT: [B/8] bit t set = slot t moved to the pool
  size_t key_bytes_per_token_bits_in = 0, key_bytes_per_token_codes = 0;
  // values
  size_t value_scale = 0, value_min = 0;     // fp16[B][d/g] each (b-bit values); rotated Lloyd-Max:
                                             // value_scale fp16[B], no minima
  size_t value_codes = 0;                    // [B][d*b/8], or 16-bit[B][d] when value_bits == 16
  size_t value_bytes_per_token_codes = 0;
  size_t key_bytes = 0, value_bytes = 0;     // unpadded sizes: statistics, export records, prefetching
  size_t values_offset = 0;                  // where the values' arrays start (keys start at 0)
  size_t stride = 0;                         // bytes of one block of one head
};

}  // namespace qjlkv
