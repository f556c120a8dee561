// Attention kernels for bf16 inputs (one translation unit per dtype so the build compiles them in parallel).
#include "attend.cuh"

namespace qjlkv::cuda {

cudaError_t configure_attend_bf16(const KernelShape &shape, size_t smem_limit) {
  return configure_io<IoBF16>(shape, smem_limit);
}
cudaError_t launch_attend_bf16(const AttendArgs &args, uint32_t rows, cudaStream_t stream) {
  const cudaError_t e = launch_io<IoBF16>(args, rows, stream);
  if (e != cudaSuccess || args.scores) return e;
  return launch_reduce_io<IoBF16>(args, stream);
}

}  // namespace qjlkv::cuda
