// Host/device arithmetic of the CUDA backend that needs no CUDA header: tile sizes, the shared
// memory carve-up of the attention kernel, the split plan, and the per-element tricks of the
// kernels. Everything is QJLKV_HD so the CPU tests in tests/gpu check it without a GPU.
#pragma once
#include <cstdint>

#include "half.hpp"
#include "hd.hpp"
#include "qjlkv/qjlkv.h"

namespace qjlkv::cuda {

// Attention CTAs: 4 warps; a tile is 32 positions (one per lane); the score phase splits each
// token's bytes over the 4 warps ("parts").
inline constexpr uint32_t kAttendThreads = 128;
inline constexpr uint32_t kTile = 32;
inline constexpr uint32_t kParts = kAttendThreads / kTile;
// The value phase gives each thread 8 channels ("a slice") of a token.
inline constexpr uint32_t kSliceChannels = 8;
inline constexpr uint32_t kQuantizeThreads = 256;  // one channel per thread: head_dim <= 256
inline constexpr uint32_t kQuantizeChunk = 8;      // tokens projected together by the QJL quantizer

// The number of Lloyd-Max levels of the largest supported code width (4 bits).
inline constexpr uint32_t kMaxLevels = 16;

QJLKV_HD uint32_t round_up(uint32_t x, uint32_t to) { return (x + to - 1) / to * to; }
QJLKV_HD uint32_t div_up(uint32_t x, uint32_t by) { return (x + by - 1) / by; }

// A staged row of `bytes` bytes takes an odd number of 4-byte words, so 32 lanes reading the
// same word of 32 consecutive rows hit 32 different shared-memory banks.
QJLKV_HD uint32_t padded_row_words(uint32_t bytes) {
  const uint32_t words = div_up(bytes, 4);
  return words | 1u;
}

// MIXED keys (src/methods/mixed/cuda_keys.cuh) score a token row in field groups: channels
// [8g, 8g + 8), at most 32 bits (4 a channel) from the group's first bit, read as one 32-bit window
// whose two halves of 4 channels are spread into words of four 8-bit codes for dp4a. A group's
// descriptor (mixed_group) is kMixedGroupWords words per block in shared memory.
inline constexpr uint32_t kMixedGroupWords = 12;
// The block setup's scratch (the stage's space): int Q [rows][d32], then float lo, cell and
// uint32 widths [d32] each.
QJLKV_HD uint32_t mixed_setup_floats(uint32_t rows, uint32_t d) { return (rows + 3) * round_up(d, 32); }

// What the attention kernel needs to know about a layer to lay out its shared memory.
struct AttendShape {
  qjlkv_key_method key_method = QJLKV_KEYS_QJL;
  uint32_t rows = 1;  // query rows per CTA (1, 2, 4 or 8)
  uint32_t d = 0;
  uint32_t m = 0, outlier_channels = 0;        // QJL
  uint32_t key_bits = 0;                       // KIVI, OTT
  uint32_t key_token_bits = 0;                 // MIXED: the bits of one token's codes
  qjlkv_value_method value_method = QJLKV_VALUES_UNIFORM;
  uint32_t value_bits = 0, value_groups = 0;   // value_groups = d / g (uniform codes)
  uint32_t io_elem = 4;                        // bytes of a tail element
};

// How a block stores its values (one policy type each in values.cuh): per-token groups of uniform
// codes with fp16 scale and minimum, 16-bit numbers (the uniform method's value_bits 16), or
// rotated Lloyd-Max codes with one fp16 scale per token.
QJLKV_HD bool uniform_value_codes(const AttendShape &s) {
  return s.value_method == QJLKV_VALUES_UNIFORM && s.value_bits != 16;
}

// Byte offsets into the dynamic shared memory of one attention CTA. Arrays of floats per query
// row are padded to 32 entries (zeros) so whole 32-bit words of bits or codes can be consumed.
struct AttendSmem {
  uint32_t q = 0;          // float [rows][d32]: the queries
  uint32_t sq = 0;         // QJL float [rows][m32]: S·q over the inlier sketch rows
  uint32_t outlier = 0;    // QJL uint32 [c]: outlier channels of the current block
  uint32_t qdigits = 0;    // KIVI {hi, lo} int8x4 words [rows][d32 / 4]: the current block's query digits
  uint32_t koff = 0;       // KIVI float [2][rows]: the current block's score offset, then its step
  uint32_t kgroups = 0;    // MIXED uint32 [d/8][kMixedGroupWords]: the current block's field groups
  uint32_t scores = 0;     // float [rows][kTile]: scores, then softmax weights
  uint32_t red = 0;        // float [2][kParts][rows][kTile]: partial dot products
  uint32_t state = 0;      // float [3][rows]: running max, running sum, rescale factor
  uint32_t levels = 0;     // rotated Lloyd-Max values: float [kMaxLevels], code c's level
  uint32_t stage_k = 0;    // staged key bytes of a tile
  uint32_t stage_v = 0;    // staged value bytes of a tile
  uint32_t final_buf = 0;  // float [lanes][rows][d] at the end (aliases the stage); KIVI/MIXED setup scratch
  uint32_t total = 0;
  // Inside stage_k, for QJL blocks: the tile's norms, outlier corrections fp16 [c][kTile] and sign bits.
  uint32_t k_norm_in = 0, k_norm_out = 0, k_corrections = 0, k_bits_in = 0;
  // Inside stage_v, for quantized values: scales, minima (uniform only), codes.
  uint32_t v_scale = 0, v_min = 0, v_codes = 0;
};

QJLKV_HD AttendSmem attend_smem(const AttendShape &s) {
  AttendSmem o;
  uint32_t at = 0;
  const auto take = [&at](uint32_t bytes) {
    const uint32_t offset = at;
    at = round_up(at + bytes, 16);
    return offset;
  };
  const uint32_t d32 = round_up(s.d, 32);
  o.q = take(4 * s.rows * d32);
  switch (s.key_method) {  // what the scorer keeps for the whole CTA or one block
    case QJLKV_KEYS_QJL:
      o.sq = take(4 * s.rows * round_up(s.m, 32));
      o.outlier = take(4 * (s.outlier_channels + 1));
      break;
    case QJLKV_KEYS_KIVI:
    case QJLKV_KEYS_OTT:
      o.qdigits = take(2 * s.rows * d32);
      o.koff = take(4 * 2 * s.rows);
      break;
    case QJLKV_KEYS_MIXED:
      o.qdigits = take(2 * s.rows * d32);
      o.koff = take(4 * 2 * s.rows);
      o.kgroups = take(4 * kMixedGroupWords * (s.d / 8));
      break;
    case QJLKV_KEYS_EXACT: break;
  }
  o.scores = take(4 * s.rows * kTile);
  o.red = take(4 * 2 * kParts * s.rows * kTile);
  o.state = take(4 * 3 * s.rows);
  if (s.value_method == QJLKV_VALUES_ROTATED_LLOYD_MAX) o.levels = take(4 * kMaxLevels);

  // Key stage: the largest of the block layout (per method) and the full-precision tail rows.
  uint32_t key_stage = 0;
  switch (s.key_method) {
    case QJLKV_KEYS_QJL:
      o.k_norm_in = 0;
      o.k_norm_out = round_up(2 * kTile + 16, 16);
      o.k_corrections = o.k_norm_out + round_up(2 * kTile + 16, 16);
      o.k_bits_in = o.k_corrections + round_up(2 * kTile * s.outlier_channels, 16);
      key_stage = o.k_bits_in + round_up(kTile * s.m / 8 + 16, 16);
      break;
    case QJLKV_KEYS_KIVI:
    case QJLKV_KEYS_OTT:  // + 16: 3-bit rows are read in whole 12-byte groups
      key_stage = round_up(kTile * s.d * s.key_bits / 8 + 16, 16);
      break;
    case QJLKV_KEYS_MIXED:  // + 4: a field group's window reads the word after the last row's
      key_stage = 4 * kTile * padded_row_words(s.key_token_bits / 8) + 4;
      break;
    case QJLKV_KEYS_EXACT: key_stage = 4 * kTile * padded_row_words(2 * s.d); break;
  }
  const uint32_t tail_key_stage = 4 * kTile * padded_row_words(s.d * s.io_elem);
  if (tail_key_stage > key_stage) key_stage = tail_key_stage;

  uint32_t value_stage = 0;
  if (s.value_method == QJLKV_VALUES_ROTATED_LLOYD_MAX) {
    o.v_scale = 0;
    o.v_codes = round_up(kTile * 2 + 16, 16);
    value_stage = o.v_codes + round_up(kTile * s.d * s.value_bits / 8 + 16, 16);
  } else if (uniform_value_codes(s)) {
    o.v_scale = 0;
    o.v_min = round_up(kTile * s.value_groups * 2 + 16, 16);
    o.v_codes = o.v_min + round_up(kTile * s.value_groups * 2 + 16, 16);
    value_stage = o.v_codes + round_up(kTile * s.d * s.value_bits / 8 + 16, 16);
  } else {  // 16-bit values
    value_stage = kTile * 2 * s.d;
  }
  const uint32_t tail_value_stage = kTile * s.d * s.io_elem;
  if (tail_value_stage > value_stage) value_stage = tail_value_stage;

  // The end-of-CTA reduction buffer (and the KIVI block setup scratch) reuse the stage.
  o.stage_k = at;
  o.stage_v = round_up(o.stage_k + key_stage, 16);
  uint32_t end = round_up(o.stage_v + value_stage, 16);
  o.final_buf = o.stage_k;
  const uint32_t lanes = kAttendThreads / (s.d / kSliceChannels);
  uint32_t final_floats = s.rows * (lanes * s.d > d32 ? lanes * s.d : d32);
  if (s.key_method == QJLKV_KEYS_MIXED && mixed_setup_floats(s.rows, s.d) > final_floats)
    final_floats = mixed_setup_floats(s.rows, s.d);
  if (o.final_buf + 4 * final_floats > end) end = round_up(o.final_buf + 4 * final_floats, 16);
  o.total = end;
  return o;
}


// ---- per-element tricks of the kernels -------------------------------------------------------
// ±1.0f for sketch row i of a 32-bit word of sign bits: +1 where the bit is 1 (projection > 0),
// -1 where it is 0; two integer operations instead of a branch.
QJLKV_HD float sign_factor(uint32_t word, uint32_t i) {
  return bits_float(0x3f800000u | ((~word << (31u - i)) & 0x80000000u));
}

// float(code) for code < 2^23 with an OR and a subtraction (2^23 + code is exact in fp32).
QJLKV_HD float code_to_float(uint32_t code) { return bits_float(0x4b000000u | code) - 8388608.0f; }

// KIVI/OTT key scores in integers (docs/DESIGN.md, "Integer decode paths"): per block and query
// row, q'_c = q_c·scale_c becomes Q_c = round(q'_c/step), step = max_c |q'_c|/kQueryCodeMax, in
// two int8 digits Q = 256·hi + lo; dp4a sums them against the codes. A row's codes are read in
// groups (a 32-bit word of 2/4/8-bit codes, or 12 bytes of 32 3-bit codes), each unpacked into
// words of four 8-bit codes: byte i of unpacked word u of group g holds the code of channel
// kivi_unpacked_channel(bits, g, u, i); the digit words follow the same order.
inline constexpr float kQueryCodeMax = 127.0f * 256.0f;
QJLKV_HD constexpr uint32_t kivi_group_codes(uint32_t bits) { return bits == 3 ? 32 : 32 / bits; }
QJLKV_HD uint32_t kivi_unpacked_channel(uint32_t bits, uint32_t g, uint32_t u, uint32_t i) {
  switch (bits) {
    case 8: return 4 * g + i;
    case 4: return 8 * g + 2 * i + u;               // low nibbles, then high nibbles
    case 2: return 16 * g + 4 * i + u;              // bits 2u.. of each byte
    default: return 32 * g + 8 * (u / 2) + 2 * i + u % 2;  // 3 bits: per 24-bit chunk, even codes then odd
  }
}
// Four 3-bit codes at bits 0, 6, 12, 18 of x into the four bytes of a word.
QJLKV_HD uint32_t spread3(uint32_t x) {
  return (x & 7u) | (x >> 6 & 7u) << 8 | (x >> 12 & 7u) << 16 | (x >> 18 & 7u) << 24;
}

// The descriptor of a MIXED field group from its 8 widths and its first bit in the row: word 0
// that bit; 1 the first bit of the second half, counted from the group's; 2, 3 each half's mask
// (byte k: the low w bits of channel k's byte); 4..6 and 7..9 each half's left shifts of channels
// 1..3 (channel k's first bit moves to bit 8k; k = 0 needs none); 10, 11 padding.
QJLKV_HD void mixed_group(const uint32_t *widths, uint32_t first_bit, uint32_t *out) {
  out[0] = first_bit;
  uint32_t bit = 0;
  for (uint32_t h = 0; h < 2; ++h) {
    const uint32_t half = bit;
    if (h == 1) out[1] = half;
    uint32_t mask = 0;
    for (uint32_t k = 0; k < 4; ++k) {
      const uint32_t width = widths[4 * h + k];
      mask |= ((1u << width) - 1u) << (8 * k);
      if (k > 0) out[4 + 3 * h + k - 1] = 8 * k - (bit - half);  // >= 4k: widths are at most 4
      bit += width;
    }
    out[2 + h] = mask;
  }
  out[10] = out[11] = 0;
}
// The four codes of one half (window: 32 bits from the half's first bit) as the bytes of a word.
QJLKV_HD uint32_t mixed_spread(uint32_t window, uint32_t shift1, uint32_t shift2, uint32_t shift3, uint32_t mask) {
  return ((window & 0xffu) | (window << shift1 & 0xff00u) | (window << shift2 & 0xff0000u) |
          (window << shift3 & 0xff000000u)) &
         mask;
}

// Outlier channel selection sorts these keys in descending order: larger energy first, and for
// equal energies the lower channel (larger complement) first — the CPU backend's order. Energies
// are sums of squares (>= +0), whose IEEE bits order like the values. Padding entries are 0.
QJLKV_HD uint64_t outlier_sort_key(float energy, uint32_t channel) {
  return (uint64_t(float_bits(energy)) << 32) | uint64_t(0xffffffffu - channel);
}
QJLKV_HD uint32_t outlier_sort_channel(uint64_t key) { return 0xffffffffu - uint32_t(key); }

// The CPU backend's min/max rules, which matter for ±0: KIVI channels use std::min / std::max
// (first of equals wins for both), value groups use std::minmax_element (first smallest, last
// largest). The stored fp16 minimum keeps the sign of the zero it is given.
QJLKV_HD void kivi_minmax_step(float x, float &lo, float &hi) {
  lo = x < lo ? x : lo;
  hi = hi < x ? x : hi;
}
QJLKV_HD void group_minmax_step(float x, float &lo, float &hi) {
  if (x < lo) lo = x;
  if (!(x < hi)) hi = x;
}

// ---- work split of one attention call ------------------------------------------------------------
// A sequence's positions are "units": its quantized blocks, then its tail cut into pieces of B.
QJLKV_HD uint32_t attend_units(uint32_t length, uint32_t blocks, uint32_t block_tokens) {
  return blocks + div_up(length - blocks * block_tokens, block_tokens);
}

struct SplitPlan {
  uint32_t splits = 1;           // CTAs along the positions of one (sequence, kv head, row tile)
  uint32_t units_per_split = 1;
};

// Enough CTAs to fill the GPU (target_ctas) without splitting finer than one unit per CTA.
QJLKV_HD SplitPlan plan_splits(uint32_t max_units, uint64_t base_ctas, uint64_t target_ctas) {
  SplitPlan p;
  if (max_units == 0) return p;
  uint64_t want = base_ctas >= target_ctas ? 1 : (target_ctas + base_ctas - 1) / base_ctas;
  if (want > max_units) want = max_units;
  p.units_per_split = div_up(max_units, uint32_t(want));
  p.splits = div_up(max_units, p.units_per_split);
  return p;
}

// Query rows per CTA: the smallest of 1, 2, 4, 8 that covers all rows of a kv head (at most 8),
// but no more than `max_rows` (the largest count whose shared memory fits the device).
QJLKV_HD uint32_t pick_rows(uint64_t rows_total, uint32_t max_rows) {
  uint32_t rows = 1;
  while (rows < 8 && rows < rows_total && rows * 2 <= max_rows) rows *= 2;
  return rows;
}

// ---- OTT: the outlier tokens of one (sequence, kv head) on the device ----------------------------
// header {pool, spilled, tracing, 0}, positions [P + S], pool key norms [P], then keys and values
// [P + S][d] in the input dtype. Slots [0, pool) are the pool, [P, P + spilled) the spill area,
// as in the CPU backend. Each sequence holds two copies per head (the committed one and the one an
// append writes), so that a rejected append leaves the committed one untouched.
struct OttLayout {
  uint32_t positions = 0, norms = 0, keys = 0, values = 0, bytes = 0;
};
QJLKV_HD OttLayout ott_layout(uint32_t pool_tokens, uint32_t spill_tokens, uint32_t d, uint32_t io_elem) {
  OttLayout o;
  const uint32_t slots = pool_tokens + spill_tokens;
  o.positions = 16;
  o.norms = round_up(o.positions + 4 * slots, 16);
  o.keys = round_up(o.norms + 4 * pool_tokens, 16);
  o.values = round_up(o.keys + slots * d * io_elem, 16);
  o.bytes = round_up(o.values + slots * d * io_elem, 16);
  return o;
}
// A rollback copy of one block (what a truncate needs to reopen it exactly): its keys [B][Hkv][d]
// as appended, then its values, in the input dtype; on traced layers then, per kv head, the OTT
// pool from before the block: an OttLayout without spill area (header, positions, norms, keys,
// values of P slots).
struct CopyLayout {
  uint32_t values = 0, pools = 0, bytes = 0;
};
QJLKV_HD CopyLayout copy_layout(uint32_t block_tokens, uint32_t kv_heads, uint32_t d, uint32_t io_elem,
                                uint32_t saved_pool_bytes) {
  CopyLayout c;
  const uint32_t rows = block_tokens * kv_heads * d * io_elem;
  c.values = rows;
  c.pools = round_up(2 * rows, 16);
  c.bytes = c.pools + kv_heads * saved_pool_bytes;
  return c;
}
// Outlier token o of [0, pool + spilled) lives in slot o (pool) or P + o - pool (spill area).
QJLKV_HD uint32_t ott_slot(uint32_t o, uint32_t pool, uint32_t pool_tokens) {
  return o < pool ? o : pool_tokens + (o - pool);
}

// Dynamic shared memory of the OTT quantizer for blocks of B tokens, pool P, head_dim d: token key
// norms [B], candidate keys [P + B] (uint64), their ranks [P + B], the moved-token flags [B], and
// the mean key and value [d].
struct OttSmem {
  uint32_t norms = 0, keys = 0, ranks = 0, moved = 0, mean_key = 0, mean_value = 0, total = 0;
};
QJLKV_HD OttSmem ott_smem(uint32_t block_tokens, uint32_t pool_tokens, uint32_t d) {
  OttSmem o;
  const uint32_t candidates = pool_tokens + block_tokens;
  o.keys = 0;
  o.norms = round_up(8 * candidates, 16);
  o.ranks = round_up(o.norms + 4 * block_tokens, 16);
  o.moved = round_up(o.ranks + 4 * candidates, 16);
  o.mean_key = round_up(o.moved + block_tokens, 16);
  o.mean_value = round_up(o.mean_key + 4 * d, 16);
  o.total = round_up(o.mean_value + 4 * d, 16);
  return o;
}

}  // namespace qjlkv::cuda
