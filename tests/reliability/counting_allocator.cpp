#include "counting_allocator.hpp"

#include <atomic>
#include <cstdlib>
#include <new>

namespace qjlkv_test {
namespace {

// Constant-initialized, so allocations made before main() (static constructors) count too.
std::atomic<int64_t> live_allocations{0};
std::atomic<int64_t> live_bytes{0};
std::atomic<uint64_t> made{0};
std::atomic<uint64_t> countdown{0};  // 0 = disarmed; otherwise the allocation that makes it 0 fails
std::atomic<bool> failed{false};

// Every block carries this header just before the pointer handed out, so that every form of
// delete (sized or not, aligned or not) can find the size and the start of the block.
struct alignas(16) Header {
  size_t size;
  void *base;
};
static_assert(sizeof(Header) == 16);

bool should_fail() {
  uint64_t left = countdown.load();
  while (left != 0 && !countdown.compare_exchange_weak(left, left - 1)) {
  }
  if (left != 1) return false;
  failed.store(true);
  return true;
}

void *allocate(size_t size, size_t alignment) noexcept {
  if (should_fail()) return nullptr;
  const size_t offset = alignment > sizeof(Header) ? alignment : sizeof(Header);
  const size_t total = (size + offset + offset - 1) / offset * offset;
  if (total < size) return nullptr;  // overflow
  void *base = offset > sizeof(Header) ? std::aligned_alloc(offset, total) : std::malloc(total);
  if (!base) return nullptr;
  auto *user = static_cast<unsigned char *>(base) + offset;
  auto *header = reinterpret_cast<Header *>(user) - 1;
  header->size = size;
  header->base = base;
  live_allocations.fetch_add(1);
  live_bytes.fetch_add(int64_t(size));
  made.fetch_add(1);
  return user;
}

void release(void *p) noexcept {
  if (!p) return;
  const Header *header = static_cast<Header *>(p) - 1;
  live_allocations.fetch_sub(1);
  live_bytes.fetch_sub(int64_t(header->size));
  std::free(header->base);
}

void *allocate_or_throw(size_t size, size_t alignment) {
  void *p = allocate(size, alignment);
  if (!p) throw std::bad_alloc();
  return p;
}

}  // namespace

AllocationCounts allocation_counts() { return {live_allocations.load(), live_bytes.load()}; }

uint64_t allocations_made() { return made.load(); }

void fail_nth_allocation(uint64_t n) {
  failed.store(false);
  countdown.store(n);
}

bool disarm_allocation_failure() {
  countdown.store(0);
  return failed.exchange(false);
}

}  // namespace qjlkv_test

using qjlkv_test::allocate;
using qjlkv_test::allocate_or_throw;
using qjlkv_test::release;

constexpr size_t kDefaultAlignment = __STDCPP_DEFAULT_NEW_ALIGNMENT__;

void *operator new(size_t size) { return allocate_or_throw(size, kDefaultAlignment); }
void *operator new[](size_t size) { return allocate_or_throw(size, kDefaultAlignment); }
void *operator new(size_t size, std::align_val_t al) { return allocate_or_throw(size, size_t(al)); }
void *operator new[](size_t size, std::align_val_t al) { return allocate_or_throw(size, size_t(al)); }
void *operator new(size_t size, const std::nothrow_t &) noexcept { return allocate(size, kDefaultAlignment); }
void *operator new[](size_t size, const std::nothrow_t &) noexcept { return allocate(size, kDefaultAlignment); }
void *operator new(size_t size, std::align_val_t al, const std::nothrow_t &) noexcept {
  return allocate(size, size_t(al));
}
void *operator new[](size_t size, std::align_val_t al, const std::nothrow_t &) noexcept {
  return allocate(size, size_t(al));
}

void operator delete(void *p) noexcept { release(p); }
void operator delete[](void *p) noexcept { release(p); }
void operator delete(void *p, size_t) noexcept { release(p); }
void operator delete[](void *p, size_t) noexcept { release(p); }
void operator delete(void *p, std::align_val_t) noexcept { release(p); }
void operator delete[](void *p, std::align_val_t) noexcept { release(p); }
void operator delete(void *p, size_t, std::align_val_t) noexcept { release(p); }
void operator delete[](void *p, size_t, std::align_val_t) noexcept { release(p); }
void operator delete(void *p, const std::nothrow_t &) noexcept { release(p); }
void operator delete[](void *p, const std::nothrow_t &) noexcept { release(p); }
void operator delete(void *p, std::align_val_t, const std::nothrow_t &) noexcept { release(p); }
void operator delete[](void *p, std::align_val_t, const std::nothrow_t &) noexcept { release(p); }
