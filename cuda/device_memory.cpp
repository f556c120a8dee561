#include "device_memory.hpp"

#include <algorithm>

#include "error.hpp"

namespace qjlkv::cuda {

void check_cuda(cudaError_t status, const char *what) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();  // clears the error unless it is sticky
  if (status == cudaErrorMemoryAllocation)
    fail(QJLKV_ERROR_OUT_OF_MEMORY, "CUDA out of memory in %s (%s)", what, cudaGetErrorString(status));
  fail(QJLKV_ERROR_DEVICE, "CUDA error in %s: %s (%s)", what, cudaGetErrorName(status), cudaGetErrorString(status));
}

DeviceGuard::DeviceGuard(int device) {
  check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) {
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    restore_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (restore_) (void)cudaSetDevice(previous_);
}

DevicePool::DevicePool(int device) {
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  check_cuda(cudaMemPoolCreate(&pool_, &props), "cudaMemPoolCreate");
  // Keep freed memory for reuse by this cache instead of returning it at every synchronization.
  uint64_t keep = UINT64_MAX;
  const cudaError_t e = cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep);
  if (e != cudaSuccess) {
    (void)cudaMemPoolDestroy(pool_);
    pool_ = nullptr;
    check_cuda(e, "cudaMemPoolSetAttribute");
  }
}

DevicePool::~DevicePool() {
  if (pool_) (void)cudaMemPoolDestroy(pool_);
}

void *DevicePool::allocate(size_t bytes, cudaStream_t stream) {
  void *p = nullptr;
  check_cuda(cudaMallocFromPoolAsync(&p, std::max<size_t>(bytes, 16), pool_, stream), "cudaMallocFromPoolAsync");
  return p;
}

void DevicePool::release(void *p, cudaStream_t stream) noexcept {
  if (p) (void)cudaFreeAsync(p, stream);
}

void SlotPool::reserve(size_t n, DevicePool &pool, cudaStream_t stream) {
  if (free_.size() >= n) return;
  const size_t slots = std::max({n - free_.size(), total_slots_, min_chunk_slots_});
  auto *chunk = static_cast<uint8_t *>(pool.allocate(slots * slot_bytes_, stream));
  try {
    chunks_.push_back({chunk, total_slots_, slots});
  } catch (...) {
    pool.release(chunk, stream);
    throw;
  }
  try {
    free_.reserve(total_slots_ + slots);  // give() never reallocates
    holders_.resize(total_slots_ + slots, 0);
  } catch (...) {
    chunks_.pop_back();
    pool.release(chunk, stream);
    throw;
  }
  for (size_t i = 0; i < slots; ++i) free_.push_back(chunk + i * slot_bytes_);
  total_slots_ += slots;
}

size_t SlotPool::index_of(const uint8_t *p) const {
  for (const Chunk &chunk : chunks_)
    if (p >= chunk.base && p < chunk.base + chunk.slots * slot_bytes_)
      return chunk.first + size_t(p - chunk.base) / slot_bytes_;
  unreachable();
}

size_t SlotPool::slots_shared() const {
  return size_t(std::count_if(holders_.begin(), holders_.end(), [](uint32_t n) { return n > 1; }));
}

void SlotPool::release_all(DevicePool &pool, cudaStream_t stream) noexcept {
  for (const Chunk &chunk : chunks_) pool.release(chunk.base, stream);
  chunks_.clear();
  free_.clear();
  holders_.clear();
  total_slots_ = 0;
}

UploadRing::UploadRing() {
  for (cudaEvent_t &e : done_) {
    const cudaError_t status = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (status != cudaSuccess) {
      e = nullptr;
      for (cudaEvent_t &created : done_)
        if (created) (void)cudaEventDestroy(created);
      check_cuda(status, "cudaEventCreateWithFlags");
    }
  }
}

UploadRing::~UploadRing() {
  if (host_) (void)cudaFreeHost(host_);
  for (cudaEvent_t e : done_)
    if (e) (void)cudaEventDestroy(e);
}

uint8_t *UploadRing::acquire(size_t bytes, cudaStream_t stream) {
  const size_t need = (std::max<size_t>(bytes, 1) + 15) / 16 * 16;
  if (need > segment_bytes_) {
    // Growth: every copy out of the old ring must be done before it is freed.
    if (host_) {
      check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (growing the upload ring)");
      (void)cudaFreeHost(host_);
      host_ = nullptr;
      segment_bytes_ = 0;
    }
    const size_t segment = std::max({need, 2 * segment_bytes_, size_t(64) << 10});
    void *p = nullptr;
    check_cuda(cudaHostAlloc(&p, segment * kSegments, cudaHostAllocDefault), "cudaHostAlloc");
    host_ = static_cast<uint8_t *>(p);
    segment_bytes_ = segment;
    segment_ = 0;
    used_ = 0;
  } else if (used_ + need > segment_bytes_) {
    check_cuda(cudaEventRecord(done_[segment_], stream), "cudaEventRecord");
    segment_ = (segment_ + 1) % kSegments;
    // Completed long ago unless the host runs a whole ring ahead of the GPU.
    check_cuda(cudaEventSynchronize(done_[segment_]), "cudaEventSynchronize");
    used_ = 0;
  }
  uint8_t *p = host_ + size_t(segment_) * segment_bytes_ + used_;
  used_ += need;
  return p;
}

void DeviceBuffer::ensure(size_t needed, DevicePool &pool, cudaStream_t stream) {
  if (needed <= bytes) return;
  const size_t grown = std::max(needed, 2 * bytes);
  void *p = pool.allocate(grown, stream);
  pool.release(data, stream);  // stream-ordered: after every kernel already enqueued that reads it
  data = p;
  bytes = grown;
}

void DeviceBuffer::release(DevicePool &pool, cudaStream_t stream) noexcept {
  pool.release(data, stream);
  data = nullptr;
  bytes = 0;
}

}  // namespace qjlkv::cuda
