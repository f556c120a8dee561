// The QJL sketch (SPEC §2): Philox normals, float64 Householder QR per block of d rows.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace qjlkv {

// Philox4x32-10 (Salmon et al., SC'11): a counter-based generator, so every backend and every
// thread can draw entry i of a stream without drawing the ones before it.
struct Philox4x32 {
  uint32_t key[2];
  void operator()(const uint32_t counter[4], uint32_t out[4]) const;
};

// Entry `index` of the N(0,1) stream (seed, stream): Box-Muller in float64 on two 53-bit uniforms.
double gaussian_entry(uint64_t seed, uint32_t stream, uint64_t index);

// The unbiasing constant c_d of SPEC §3 for rows of norm sqrt(d) uniform on the sphere
// (orthogonal) or i.i.d. Gaussian rows.
double qjl_constant(uint32_t head_dim, bool orthogonal);

// An immutable m x d row-major float32 matrix: exactly what the kernels multiply with.
struct SketchMatrix {
  uint32_t rows = 0, cols = 0;
  bool orthogonal = false;
  std::vector<float> data;
  const float *row(uint32_t i) const { return data.data() + size_t(i) * cols; }
};

SketchMatrix make_sketch(uint32_t head_dim, uint32_t sketch_dim, uint64_t seed, uint32_t stream,
                         bool orthogonal);

}  // namespace qjlkv

// The public opaque handle wraps the matrix.
struct qjlkv_sketch {
  qjlkv::SketchMatrix matrix;
};
