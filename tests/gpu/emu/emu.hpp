// What tests can ask the CPU emulator of the CUDA runtime (cuda_runtime.h beside this file).
#pragma once
#include <cstddef>

namespace emu {
// The first emulation error ("" when none): divergent barriers, shared memory overruns, bad frees,
// leaked pool allocations.
const char *first_error();
void clear_error();
// Device allocations alive now (cudaMalloc and memory pools).
size_t live_allocations();
// Out-of-memory injection: the device and pinned host allocations after the next `successes` fail
// with cudaErrorMemoryAllocation, until called again; a negative count lets every one succeed.
void fail_allocations_after(long successes);
}  // namespace emu
