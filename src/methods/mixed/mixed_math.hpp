// The per-element rules of mixed-bit keys (mixed_keys.hpp), shared by the CPU's reference kernels
// and the CUDA policy so that both backends store the same bytes.
//
// Per block and kv head, channel j has the fp16 range [lo_j, hi_j] of its tokens (minimum rounded
// down, maximum rounded up) and a width w_j of 0 to 4 bits. The widths spend the token's
// key_token_bits where the ranges are: bit b of channel j removes r_j²·¾·4^-b of squared error
// (r_j = hi_j − lo_j, midrise levels), and the widths take the key_token_bits largest of these
// gains, that is of the priorities r_j·2^-b (b = 0..3), ties to the lower channel, then the lower
// b. A code is the cell of [lo, hi] cut into 2^w equal cells, decoded to the cell's centre
// (midrise); 0 bits decode to the middle of the range.
#pragma once
#include <cmath>
#include <cstdint>

#include "../../half.hpp"
#include "../../hd.hpp"

namespace qjlkv::mixed {

inline constexpr uint32_t kMaxWidth = 4;    // bits of one channel's code
inline constexpr uint32_t kWidthBits = 3;   // bits that store one width

// The priority of channel j's bit b (b < kMaxWidth): exact in fp32 (a power-of-two scaling).
QJLKV_HD float bit_priority(float range, uint32_t b) { return ldexpf(range, -int(b)); }
// Whether candidate bit (priority p, index i = kMaxWidth·j + b) is taken before (q, k).
QJLKV_HD bool taken_before(float p, uint32_t i, float q, uint32_t k) { return p > q || (p == q && i < k); }

// The cell width of a channel of range r and w bits.
QJLKV_HD float cell(float range, uint32_t width) { return ldexpf(range, -int(width)); }
// The code of x in a channel [lo, lo + range] of w bits (cell = cell(range, w)).
QJLKV_HD uint32_t code_of(float x, float lo, float cell_width, uint32_t width) {
  if (width == 0 || cell_width == 0.0f) return 0;
  const float top = float((1u << width) - 1u);
  return uint32_t(fminf(fmaxf(floorf((x - lo) / cell_width), 0.0f), top));
}
QJLKV_HD float decode(uint32_t code, float lo, float cell_width) { return lo + (float(code) + 0.5f) * cell_width; }

// The w-bit field at bit `bit` of an LSB-first row (bit i is bit i % 8 of byte i / 8); a field may
// cross one byte boundary. Rows are whole bytes and fields never run past them.
QJLKV_HD uint32_t get_field(const uint8_t *row, uint32_t bit, uint32_t width) {
  const uint32_t byte = bit >> 3, shift = bit & 7u;
  uint32_t window = row[byte];
  if (shift + width > 8u) window |= uint32_t(row[byte + 1]) << 8;
  return (window >> shift) & ((1u << width) - 1u);
}
QJLKV_HD void put_field(uint8_t *row, uint32_t bit, uint32_t width, uint32_t code) {  // row bytes start zeroed
  if (width == 0) return;
  const uint32_t byte = bit >> 3, shift = bit & 7u;
  row[byte] = uint8_t(row[byte] | (code << shift));
  if (shift + width > 8u) row[byte + 1] = uint8_t(row[byte + 1] | (code >> (8u - shift)));
}

}  // namespace qjlkv::mixed
