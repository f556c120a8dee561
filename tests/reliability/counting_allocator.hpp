// A replacement of the global operator new/delete (every form: plain, array, aligned, nothrow,
// sized) for the test executables that link counting_allocator.cpp. It counts live allocations
// and bytes, and can be armed to make the n-th allocation from now on fail (throw
// std::bad_alloc, or return nullptr for the nothrow forms). The library is linked statically,
// so its allocations go through these operators too.
#pragma once
#include <cstddef>
#include <cstdint>

namespace qjlkv_test {

struct AllocationCounts {
  int64_t live_allocations;
  int64_t live_bytes;
  friend bool operator==(const AllocationCounts &, const AllocationCounts &) = default;
};

// Live allocations and bytes of the whole process right now.
AllocationCounts allocation_counts();

// Allocations made since the process started (never decreases).
uint64_t allocations_made();

// From now on, the n-th allocation (n >= 1) of any thread fails; later ones succeed again.
void fail_nth_allocation(uint64_t n);
// Stops the countdown; returns whether an allocation was made to fail since arming.
bool disarm_allocation_failure();

}  // namespace qjlkv_test
