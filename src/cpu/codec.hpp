// What the CPU entries of a key or value method (src/methods/) see of one layer: the kernel
// table chosen for the cache and the layer's precomputed kernel arguments.
#pragma once
#include <vector>

#include "../config.hpp"
#include "simd.hpp"

namespace qjlkv::cpu {

// Built once per layer when the cache is created (the methods' prepare()).
struct LayerKernels {
  std::vector<float> sketch_t;  // QJL: the sketch transposed, [d][qjl.sketch_t_stride]
  QjlArgs qjl;
  CodesArgs keys, values;
};

struct CpuLayer {
  const KernelTable &kernels;
  const CacheSpec &spec;
  const LayerSpec &layer;
  const LayerKernels &args;
};

}  // namespace qjlkv::cpu
