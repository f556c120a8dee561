// What the CPU entries of a key or value method (src/methods/) see of one layer: the kernel
// table chosen for the cache and the layer's precomputed kernel arguments.
#pragma once
#include <vector>

#include "../config.hpp"
#include "simd.hpp"

namespace qjlkv::cpu {

// Built once per layer when the cache is created (the methods' prepare()).
struct LayerKernels {
  QjlTables qjl_tables;  // QJL: what `qjl` points into (the sketch transposed)
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
