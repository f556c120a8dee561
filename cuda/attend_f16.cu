// Attention kernels for f16 inputs (one translation unit per dtype so the build compiles them in parallel).
#include "attend.cuh"

namespace qjlkv::cuda {

cudaError_t configure_attend_f16(const KernelShape &shape, size_t smem_limit) {
  return configure_io<IoF16>(shape, smem_limit);
}
cudaError_t launch_attend_f16(const AttendArgs &args, uint32_t rows, cudaStream_t stream) {
  const cudaError_t e = launch_io<IoF16>(args, rows, stream);
  if (e != cudaSuccess || args.scores) return e;
  return launch_reduce_io<IoF16>(args, stream);
}

}  // namespace qjlkv::cuda
