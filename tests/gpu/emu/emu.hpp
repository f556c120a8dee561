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
}  // namespace emu
