#include "rotation.hpp"

#include "sketch.hpp"

namespace qjlkv {

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

}  // namespace qjlkv
