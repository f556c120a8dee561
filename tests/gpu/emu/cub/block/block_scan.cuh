// CPU stand-in for cub::BlockScan (see block_radix_sort.cuh beside this file).
#pragma once
#include "../../cuda_runtime.h"

namespace cub {

template <class T, int THREADS>
class BlockScan {
 public:
  struct TempStorage {
    T values[THREADS];
  };
  explicit BlockScan(TempStorage &storage) : storage_(storage) {}

  void ExclusiveSum(T input, T &output) {
    const unsigned tid = threadIdx.x;
    storage_.values[tid] = input;
    __syncthreads();
    if (tid == 0) {
      T running{};
      for (int i = 0; i < THREADS; ++i) {
        const T x = storage_.values[i];
        storage_.values[i] = running;
        running = running + x;
      }
    }
    __syncthreads();
    output = storage_.values[tid];
    __syncthreads();
  }

 private:
  TempStorage &storage_;
};

}  // namespace cub
