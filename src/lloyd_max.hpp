// Rotated Lloyd-Max values (docs/DESIGN.md, "Rotated Lloyd-Max values"): the randomized Hadamard
// rotation and the per-token encoder, QJLKV_HD so that the CPU backend (src/rotation.cpp, the
// reference kernels) and the CUDA quantizer run the same fp32 operations in the same order and
// store the same bytes. The Lloyd-Max levels and the nearest-level rule are in quant_math.hpp.
#pragma once
#include <cmath>
#include <cstdint>

#include "half.hpp"
#include "hd.hpp"
#include "quant_math.hpp"

namespace qjlkv {

// The size of the power-of-two block that starts at channel `start`: the largest power of two
// <= d - start (blocks are taken greedily from channel 0: d = 96 -> 64 + 32).
QJLKV_HD uint32_t rotation_block(uint32_t d, uint32_t start) {
  uint32_t n = 1;
  while (2 * n <= d - start) n *= 2;
  return n;
}

// In place: the normalized Walsh-Hadamard transform of every power-of-two block of y (the
// butterflies y[j], y[j+h] = y[j] + y[j+h], y[j] - y[j+h] for h = 1, 2, 4, .., then a
// multiplication by the fp32 of 1/sqrt(block size)).
QJLKV_HD void hadamard_blocks(uint32_t d, float *y) {
  for (uint32_t start = 0; start < d;) {
    const uint32_t n = rotation_block(d, start);
    float *b = y + start;
    for (uint32_t h = 1; h < n; h *= 2)
      for (uint32_t i = 0; i < n; i += 2 * h)
        for (uint32_t j = i; j < i + h; ++j) {
          const float a = b[j], c = b[j + h];
          b[j] = a + c;
          b[j + h] = a - c;
        }
    const float norm = float(1.0 / sqrt(double(n)));
    for (uint32_t j = 0; j < n; ++j) b[j] *= norm;
    start += n;
  }
}

// y = H·diag(s)·x and its inverse x = diag(s)·H·y (H is symmetric and orthonormal); x and y may
// be the same array.
QJLKV_HD void rotate_forward(const float *signs, uint32_t d, const float *x, float *y) {
  for (uint32_t j = 0; j < d; ++j) y[j] = signs[j] * x[j];
  hadamard_blocks(d, y);
}
QJLKV_HD void rotate_inverse(const float *signs, uint32_t d, const float *y, float *x) {
  if (x != y)
    for (uint32_t j = 0; j < d; ++j) x[j] = y[j];
  hadamard_blocks(d, x);
  for (uint32_t j = 0; j < d; ++j) x[j] *= signs[j];
}

// One token of one kv head: the codes of its rotated vector into `codes` (d·bits/8 bytes,
// zeroed) and its fp16 scale (norm correction: the decoded vector has the input's norm up to
// the fp16 rounding). y: d floats of scratch.
QJLKV_HD void lloyd_max_encode_token(const float *signs, uint32_t d, uint32_t bits, const float *x, float *y,
                                     uint8_t *codes, uint16_t *scale) {
  rotate_forward(signs, d, x, y);
  float norm2 = 0.0f;
  for (uint32_t j = 0; j < d; ++j) norm2 += y[j] * y[j];
  const float norm = sqrtf(norm2);
  if (norm == 0.0f) {  // codes 0, scale 0: decodes to zeros
    *scale = 0;
    return;
  }
  const float sqrt_d = sqrtf(float(d));
  float level_norm2 = 0.0f;
  for (uint32_t j = 0; j < d; ++j) {
    const uint32_t code = lloyd_max_code(y[j] / norm * sqrt_d, bits);
    pack_code(codes, j, bits, code);
    const float level = lloyd_max_level(bits, code);
    level_norm2 += level * level;
  }
  *scale = float_to_half(norm / sqrtf(level_norm2));
}

}  // namespace qjlkv
