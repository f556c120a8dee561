// Sliding windows (qjlkv_layer_attention's window_tokens): which positions a query sees, and
// which quantized blocks no query of an attend sees. Both backends and the CUDA kernels use these.
#pragma once
#include <cstdint>

#include "hd.hpp"

namespace qjlkv {

// The first position the query at `position` sees under a window of `window` tokens (0: all).
QJLKV_HD uint64_t window_start(uint64_t position, uint32_t window) {
  return window > 0 && position + 1 > window ? position + 1 - window : 0;
}

// How many leading blocks of a sequence (blocks of B positions from position `sinks`, `blocks` of
// them) end before `start`: an attend whose first query sees from `start` does not read them.
QJLKV_HD uint32_t blocks_before(uint64_t start, uint32_t sinks, uint32_t block_tokens, uint32_t blocks) {
  if (start <= sinks) return 0;
  const uint64_t before = (start - sinks) / block_tokens;
  return before < blocks ? uint32_t(before) : blocks;
}

}  // namespace qjlkv
