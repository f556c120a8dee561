// Linked instead of cuda/ when the library is built without CUDA.
#include "cache.hpp"
#include "error.hpp"

namespace qjlkv {

std::unique_ptr<qjlkv_cache> make_cuda_cache(CacheSpec spec) {
  fail(QJLKV_ERROR_UNSUPPORTED,
       "config.backend is QJLKV_BACKEND_CUDA (config.device_ordinal %u), but this libqjlkv was built without CUDA "
       "(configure with -DQJLKV_CUDA=ON)",
       spec.cfg.device_ordinal);
}

}  // namespace qjlkv
