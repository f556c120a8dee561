// Elements as both backends' host code reads and writes them: rows in the I/O dtype to and from
// fp32, the 16-bit stored forms (fp16, or bf16 for bf16 inputs), and typed views of a block's bytes.
#pragma once
#include <cstddef>
#include <cstdint>

#include "error.hpp"
#include "half.hpp"
#include "qjlkv/qjlkv.h"

namespace qjlkv {

inline float load_element(const void *base, size_t index, qjlkv_dtype dtype) {
  switch (dtype) {
    case QJLKV_DTYPE_F32: return static_cast<const float *>(base)[index];
    case QJLKV_DTYPE_F16: return half_to_float(static_cast<const uint16_t *>(base)[index]);
    case QJLKV_DTYPE_BF16: return bf16_to_float(static_cast<const uint16_t *>(base)[index]);
  }
  unreachable();
}
inline void load_row(const void *base, size_t first, size_t n, qjlkv_dtype dtype, float *out) {
  for (size_t i = 0; i < n; ++i) out[i] = load_element(base, first + i, dtype);
}
inline void store_row(const float *in, size_t n, qjlkv_dtype dtype, void *base, size_t first) {
  for (size_t i = 0; i < n; ++i) {
    switch (dtype) {
      case QJLKV_DTYPE_F32: static_cast<float *>(base)[first + i] = in[i]; break;
      case QJLKV_DTYPE_F16: static_cast<uint16_t *>(base)[first + i] = float_to_half(in[i]); break;
      case QJLKV_DTYPE_BF16: static_cast<uint16_t *>(base)[first + i] = float_to_bf16(in[i]); break;
    }
  }
}
inline uint16_t to_16bit(float x, qjlkv_dtype stored) {
  return stored == QJLKV_DTYPE_BF16 ? float_to_bf16(x) : float_to_half(x);
}
inline float from_16bit(uint16_t x, qjlkv_dtype stored) {
  return stored == QJLKV_DTYPE_BF16 ? bf16_to_float(x) : half_to_float(x);
}

template <class T>
inline T *at(uint8_t *block, size_t offset) {
  return reinterpret_cast<T *>(block + offset);
}
template <class T>
inline const T *at(const uint8_t *block, size_t offset) {
  return reinterpret_cast<const T *>(block + offset);
}

}  // namespace qjlkv
