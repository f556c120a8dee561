// Device memory of one CUDA cache: a private stream-ordered memory pool, fixed-size slot pools
// that grow geometrically, and a pinned host ring for uploads. Nothing here synchronizes the host
// except where a comment says so.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace qjlkv::cuda {

// Throws Error: OUT_OF_MEMORY for allocation failures, DEVICE (naming `what` and the CUDA
// error) for everything else.
void check_cuda(cudaError_t status, const char *what);

// Makes `device` current for the lifetime of the guard and restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard &) = delete;
  DeviceGuard &operator=(const DeviceGuard &) = delete;

 private:
  int previous_ = -1;
  bool restore_ = false;
};

// Stream-ordered allocations from a pool private to the cache (never the device's default pool,
// whose settings belong to the application). Freed memory stays in the pool for reuse.
class DevicePool {
 public:
  explicit DevicePool(int device);
  ~DevicePool();
  DevicePool(const DevicePool &) = delete;
  DevicePool &operator=(const DevicePool &) = delete;
  void *allocate(size_t bytes, cudaStream_t stream);  // throws OUT_OF_MEMORY / DEVICE
  void release(void *p, cudaStream_t stream) noexcept;

 private:
  cudaMemPool_t pool_ = nullptr;
};

// Equal slots carved from chunks that never move; each new chunk holds as many slots as all the
// earlier ones together (at least `min_chunk_slots`), so growth is geometric and its cost amortized.
// Slots are reference counted on the host: a slot that several sequences hold (forks share blocks
// and rollback copies) returns to the free list when the last of them gives it back.
class SlotPool {
 public:
  SlotPool(size_t slot_bytes, size_t min_chunk_slots) : slot_bytes_(slot_bytes), min_chunk_slots_(min_chunk_slots) {}
  // Makes at least n slots free (may allocate a chunk: the only allocation on the append path).
  void reserve(size_t n, DevicePool &pool, cudaStream_t stream);
  uint8_t *take() {  // after reserve(): cannot fail; the caller holds the slot
    uint8_t *p = free_.back();
    free_.pop_back();
    holders_[index_of(p)] = 1;
    return p;
  }
  void hold(const uint8_t *p) { ++holders_[index_of(p)]; }  // one more holder of a taken slot
  // One holder fewer; the slot is free again (returns true) when it was the last. Capacity
  // reserved by reserve(): cannot fail.
  bool give(const uint8_t *p) {
    if (--holders_[index_of(p)] > 0) return false;
    free_.push_back(const_cast<uint8_t *>(p));
    return true;
  }
  uint32_t holders(const uint8_t *p) const { return holders_[index_of(p)]; }
  size_t slots_held() const { return total_slots_ - free_.size(); }
  size_t slots_shared() const;  // held more than once
  void release_all(DevicePool &pool, cudaStream_t stream) noexcept;
  size_t slot_bytes() const { return slot_bytes_; }
  size_t bytes_reserved() const { return total_slots_ * slot_bytes_; }

 private:
  struct Chunk {
    uint8_t *base;
    size_t first, slots;  // slot indices [first, first + slots)
  };
  size_t index_of(const uint8_t *p) const;  // chunks double: a search of O(log slots) of them

  size_t slot_bytes_, min_chunk_slots_;
  size_t total_slots_ = 0;
  std::vector<Chunk> chunks_;
  std::vector<uint8_t *> free_;
  std::vector<uint32_t> holders_;  // per slot index
};

// Pinned host memory for host-to-device uploads (job lists, descriptors), used as a ring of
// segments. A segment is reused only after the event recorded when the ring left it has
// completed: the host waits only when it runs a whole ring ahead of the GPU (back-pressure, like a
// full launch queue). A request larger than a segment grows the ring: that waits for the stream
// (amortized, as the ring doubles).
class UploadRing {
 public:
  UploadRing();
  ~UploadRing();
  UploadRing(const UploadRing &) = delete;
  UploadRing &operator=(const UploadRing &) = delete;
  // Host memory for `bytes` bytes, valid until the next call; copy it with cudaMemcpyAsync on stream.
  uint8_t *acquire(size_t bytes, cudaStream_t stream);
  size_t bytes_reserved() const { return segment_bytes_ * kSegments; }

 private:
  static constexpr int kSegments = 8;
  uint8_t *host_ = nullptr;
  size_t segment_bytes_ = 0;
  size_t used_ = 0;
  int segment_ = 0;
  cudaEvent_t done_[kSegments] = {};
};

// A device buffer that only grows (stream-ordered): per-call scratch and per-sequence tables.
struct DeviceBuffer {
  void *data = nullptr;
  size_t bytes = 0;
  // Grows to at least `needed` bytes (doubling); the old contents are not kept.
  void ensure(size_t needed, DevicePool &pool, cudaStream_t stream);
  void release(DevicePool &pool, cudaStream_t stream) noexcept;
};

}  // namespace qjlkv::cuda
