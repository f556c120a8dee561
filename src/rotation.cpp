#include "rotation.hpp"

#include <cmath>

#include "sketch.hpp"

namespace qjlkv {

uint32_t rotation_block(uint32_t d, uint32_t start) {
  uint32_t n = 1;
  while (2 * n <= d - start) n *= 2;
  return n;
}

std::vector<float> value_rotation_signs(uint32_t d, uint64_t seed, uint32_t layer) {
  const Philox4x32 philox{{uint32_t(seed), uint32_t(seed >> 32)}};
  std::vector<float> signs(d);
  for (uint32_t j = 0; j < d; ++j) {
    const uint32_t counter[4] = {j, 0, layer, 0x56524F54u /* "VROT" */};
    uint32_t r[4];
    philox(counter, r);
    signs[j] = r[0] & 1u ? -1.0f : 1.0f;
  }
  return signs;
}

namespace {
// In place: the normalized Walsh-Hadamard transform of every power-of-two block of y.
void hadamard_blocks(uint32_t d, float *y) {
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
    const float norm = float(1.0 / std::sqrt(double(n)));
    for (uint32_t j = 0; j < n; ++j) b[j] *= norm;
    start += n;
  }
}
}  // namespace

void rotate_forward(const float *signs, uint32_t d, const float *x, float *y) {
  for (uint32_t j = 0; j < d; ++j) y[j] = signs[j] * x[j];
  hadamard_blocks(d, y);
}

void rotate_inverse(const float *signs, uint32_t d, const float *y, float *x) {
  if (x != y)
    for (uint32_t j = 0; j < d; ++j) x[j] = y[j];
  hadamard_blocks(d, x);
  for (uint32_t j = 0; j < d; ++j) x[j] *= signs[j];
}

}  // namespace qjlkv
