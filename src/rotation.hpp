// The randomized Hadamard rotation of rotated Lloyd-Max values (docs/DESIGN.md, "Rotated
// Lloyd-Max values"): y = H·diag(s)·x, with H block-diagonal over the power-of-two blocks of the
// head (d = 96 -> 64 + 32) and each block a normalized Sylvester Walsh-Hadamard matrix. The
// rotation itself (rotate_forward, rotate_inverse) is in lloyd_max.hpp, shared with CUDA.
#pragma once
#include <cstdint>
#include <vector>

#include "lloyd_max.hpp"

namespace qjlkv {

// s_j = ±1.0f for j < d: -1 where bit 0 of word 0 of Philox4x32-10 keyed by the seed, counter
// (j, 0, layer, 0x56524F54 "VROT"), is 1.
std::vector<float> value_rotation_signs(uint32_t d, uint64_t seed, uint32_t layer);

}  // namespace qjlkv
