// CPU stand-in for cub::BlockRadixSort (the emulator's fibers, see ../../cuda_runtime.h): the
// block's keys meet in shared memory and one thread sorts them. Blocked arrangement, like CUB:
// thread i ends up with keys [i * ITEMS, (i + 1) * ITEMS) of the sorted sequence.
#pragma once
#include <algorithm>
#include <functional>

#include "../../cuda_runtime.h"

namespace cub {

template <class Key, int THREADS, int ITEMS>
class BlockRadixSort {
 public:
  struct TempStorage {
    Key keys[THREADS * ITEMS];
  };
  explicit BlockRadixSort(TempStorage &storage) : storage_(storage) {}

  void Sort(Key (&keys)[ITEMS]) { sort(keys, std::less<Key>()); }
  void SortDescending(Key (&keys)[ITEMS]) { sort(keys, std::greater<Key>()); }

 private:
  template <class Compare>
  void sort(Key (&keys)[ITEMS], Compare compare) {
    const unsigned tid = threadIdx.x;
    for (int i = 0; i < ITEMS; ++i) storage_.keys[tid * ITEMS + i] = keys[i];
    __syncthreads();
    if (tid == 0) std::stable_sort(storage_.keys, storage_.keys + THREADS * ITEMS, compare);
    __syncthreads();
    for (int i = 0; i < ITEMS; ++i) keys[i] = storage_.keys[tid * ITEMS + i];
    __syncthreads();
  }
  TempStorage &storage_;
};

}  // namespace cub
