// Run by ctest after the tests of a CUDA build (CTEST_CUSTOM_POST_TEST, tests/gpu/CMakeLists.txt):
// one line saying whether the tests labelled `device` ran on a GPU or skipped, and why. ctest
// shows a skipped test only as "***Skipped"; the reason each test prints is in its own output.
#include <cuda_runtime.h>

#include <cstdio>

int main() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    std::printf("qjlkv GPU probe: no CUDA device (cudaGetDeviceCount failed with %s: %s): the tests labelled "
                "'device' skip here\n",
                cudaGetErrorName(status), cudaGetErrorString(status));
    return 0;
  }
  if (count == 0) {
    std::printf("qjlkv GPU probe: no CUDA device (cudaGetDeviceCount found none): the tests labelled 'device' skip "
                "here\n");
    return 0;
  }
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
    std::printf("qjlkv GPU probe: the tests labelled 'device' run on device 0 of %d: %s (sm_%d%d)\n", count, prop.name,
                prop.major, prop.minor);
  return 0;
}
