// CPU stand-in for the fp16 conversions the kernels use (see cuda_runtime.h beside this file).
// Round-to-nearest-even like the hardware, through libqjlkv's own conversions.
#pragma once
#include <cstdint>

#include "cuda_runtime.h"
#include "half.hpp"

struct __half {
  uint16_t bits;
};
inline __half __ushort_as_half(unsigned short v) { return __half{v}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline float __half2float(__half h) { return qjlkv::half_to_float(h.bits); }
inline __half __float2half_rn(float f) { return __half{qjlkv::float_to_half(f)}; }
