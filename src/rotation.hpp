// The randomized Hadamard rotation of rotated Lloyd-Max values (docs/DESIGN.md, "Rotated
// Lloyd-Max values"): y = H·diag(s)·x, with H block-diagonal over the power-of-two blocks of the
// head (d = 96 -> 64 + 32) and each block a normalized Sylvester Walsh-Hadamard matrix.
#pragma once
#include <cstdint>
#include <vector>

namespace qjlkv {

// The size of the power-of-two block that starts at channel `start`: the largest power of two
// <= d - start (blocks are taken greedily from channel 0).
uint32_t rotation_block(uint32_t d, uint32_t start);

// s_j = ±1.0f for j < d: -1 where bit 0 of word 0 of Philox4x32-10 keyed by the seed, counter
// (j, 0, layer, 0x56524F54 "VROT"), is 1.
std::vector<float> value_rotation_signs(uint32_t d, uint64_t seed, uint32_t layer);

// y = H·diag(s)·x and its inverse x = diag(s)·H·y (H is symmetric and orthonormal), in fp32 in a
// fixed order: the in-place butterflies y[j], y[j+h] = y[j] + y[j+h], y[j] - y[j+h] for h = 1,
// 2, 4, .. within each block, then a multiplication by the fp32 of 1/sqrt(block size).
// x and y may be the same array.
void rotate_forward(const float *signs, uint32_t d, const float *x, float *y);
void rotate_inverse(const float *signs, uint32_t d, const float *y, float *x);

}  // namespace qjlkv
