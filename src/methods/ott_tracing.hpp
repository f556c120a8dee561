// OTT's outlier-token tracing (SPEC §5), the rules both backends follow: the CPU backend
// (CpuCache::trace_outliers) walks one block of one kv head in a single thread, the CUDA OTT
// quantizer (cuda/append.cu) spreads the same steps over a CTA. Each step is written here once,
// rounding alike on host and device, so both backends keep the same pools and store the same
// blocks.
//
// A traced block: its tokens and the pool's compete by key norm; the P smallest (ties: older
// position) make the pool; evicted pool tokens move to the spill area (tracing stops for good when
// it cannot take them), block tokens entering the pool leave their slot, which is masked and
// quantized as the per-channel mean of the block's other tokens.
#pragma once
#include <cmath>
#include <cstdint>

#include "../half.hpp"
#include "../hd.hpp"

namespace qjlkv::ott {

// x + y and x·y rounded each on its own: nvcc would contract them into an FMA, the CPU never does.
QJLKV_HD float add(float x, float y) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(x, y);
#else
  return x + y;
#endif
}
QJLKV_HD float mul(float x, float y) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(x, y);
#else
  return x * y;
#endif
}

// The L2 norm of a token's key: squares summed in channel order. key(j) reads channel j.
template <class Key>
QJLKV_HD float key_norm(const Key &key, uint32_t d) {
  float sum = 0.0f;
  for (uint32_t j = 0; j < d; ++j) {
    const float x = key(j);
    sum = add(sum, mul(x, x));
  }
  return sqrtf(sum);
}

// The order in which candidates stay in the pool, as one integer: smaller key norm first, then the
// older position (positions are unique). Norms are never negative, so their bits order like them.
QJLKV_HD uint64_t candidate_key(float norm, uint32_t position) {
  return (uint64_t(float_bits(norm)) << 32) | position;
}

// What tracing a block does to a pool of `pool` tokens when `entering` of the block's tokens are
// among the P kept: the pool's `kept` stay, `evicted` leave for the spill area.
struct PoolChange {
  uint32_t entering, kept, evicted;
};
QJLKV_HD PoolChange pool_change(uint32_t pool, uint32_t pool_tokens, uint32_t entering) {
  const uint32_t kept = pool_tokens - entering;
  return {entering, kept, pool - kept};
}
// Whether the spill area (spill_tokens slots, `spilled` taken) takes the evicted tokens; when it
// does not, the block and all later ones of the head are plain KIVI.
QJLKV_HD bool spill_takes(uint32_t spilled, uint32_t evicted, uint32_t spill_tokens) {
  return spilled + evicted <= spill_tokens;
}

// Where the pool's slots go, taken in slot order: kept ones to the front, evicted ones after the
// spill area's tokens (slots [P, P + spilled)).
struct PoolCompaction {
  uint32_t front, spill_end;
  QJLKV_HD PoolCompaction(uint32_t pool_tokens, uint32_t spilled) : front(0), spill_end(pool_tokens + spilled) {}
  QJLKV_HD uint32_t next(bool kept) { return kept ? front++ : spill_end++; }
};
// The pool slot of an entering block token of candidate rank `rank` (0: smallest key), when
// `kept_below` of the kept pool tokens rank below it: entering tokens follow the kept ones, in
// candidate order.
QJLKV_HD uint32_t entering_slot(uint32_t kept, uint32_t rank, uint32_t kept_below) {
  return kept + (rank - kept_below);
}

// The per-channel mean of the block's tokens that stay: x(t) reads token t's channel, moved(t)
// says whether token t entered the pool. Summed in token order, then scaled.
template <class X, class Moved>
QJLKV_HD float mean_of_others(const X &x, const Moved &moved, uint32_t block_tokens, uint32_t entering) {
  float sum = 0.0f;
  for (uint32_t t = 0; t < block_tokens; ++t)
    if (!moved(t)) sum = add(sum, x(t));
  return mul(sum, 1.0f / float(block_tokens - entering));
}

// The block's mask (B/8 bytes, bit t % 8 of byte t / 8: token t moved to the pool), one byte from
// the eight flags moved[0..7] of its tokens; and reading it back.
QJLKV_HD uint8_t mask_byte(const uint8_t *moved) {
  uint32_t bits = 0;
  for (uint32_t k = 0; k < 8; ++k) bits |= uint32_t(moved[k] != 0) << k;
  return uint8_t(bits);
}
QJLKV_HD bool is_moved(const uint8_t *mask, uint32_t t) { return (mask[t / 8] >> (t % 8)) & 1u; }

}  // namespace qjlkv::ott
