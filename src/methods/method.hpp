// What every key and value method provides (docs/DESIGN.md, "Methods"). A method is a policy type
// with static members only, one folder per method here (exact/, qjl/, kivi/, mixed/, uniform_values/,
// lloyd_max_values/, each with its policy header); methods.hpp lists them and dispatches a
// configuration to its types once per call (per block at most, never per token).
//
// Definition (config.cpp and both backends' host code):
//   validate(cfg)                  throws INVALID_ARGUMENT naming the first wrong field it reads
//   copy_fields(from, to)          the config fields the method reads (the others stay 0)
//   kSketched / kSeeded            whether it reads config.seed (and, keys, config.sketch_flags)
//   init_layers(cfg, layers)       per-layer state of the method (sketches, tracing)
//   layout(cfg, layer, at, l)      its arrays of one block of one kv head (BlockLayout)
//   element_limit(cfg, stored)     the largest |x| an input element may have
//   norm_limit(cfg), fail_norm(..) the largest L2 norm of one input vector (0: none) and its message
//   check_stored(spec, layer, block, check)  an imported block's arrays (check: serialize.cpp's
//                                  halves(offset, n, non_negative, stored, what) and fail(format, ...))
// Reading stored blocks (both backends' reconstruct, the reference kernels):
//   moved(layout, block, t)        keys: token t left the block (OTT's pool holds it)
//   dequantize_token(..)           the dense fp32 key (value) of token t of a block
// The CPU's reference kernels (src/cpu/kernels.cpp), values:
//   quantize_block(cfg, stored, layout, signs, values, block)  a block's B tokens, reference rules
//   unrotate(signs, d, x)          a decoded token back to channel order (rotated methods)
// No policy includes a backend's header. The backends' entries of each method live apart: CPU
// (the method folder's cpu_* files: its MethodKernels row with per-layer kernel arguments and
// scratch sizes, and its fast kernels, checked against the reference kernels of
// src/cpu/kernels.hpp); CUDA (the policy types in each method's cuda_keys.cuh / cuda_values.cuh, listed by cuda/keys.cuh
// and cuda/values.cuh).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "../config.hpp"
#include "../elements.hpp"
#include "../error.hpp"
#include "../quant_math.hpp"

namespace qjlkv {

// Hands out the byte offsets of a block's arrays in order.
struct LayoutCursor {
  size_t at = 0;
  size_t take(size_t bytes) {
    const size_t offset = at;
    at += bytes;
    return offset;
  }
};

// The defaults of a key method: what a method without the feature does.
struct KeyMethodDefaults {
  static constexpr bool kSketched = false;  // reads config.seed and config.sketch_flags
  static void copy_fields(const qjlkv_config &, qjlkv_config &) {}
  static void init_layers(const qjlkv_config &, std::vector<LayerSpec> &) {}
  static float element_limit(const qjlkv_config &, qjlkv_dtype) { return kHalfMax; }
  static double norm_limit(const qjlkv_config &) { return 0.0; }
  [[noreturn]] static void fail_norm(const qjlkv_config &, size_t, double) { unreachable(); }
  static bool moved(const BlockLayout &, const uint8_t *, uint32_t) { return false; }
};

struct ValueMethodDefaults {
  static constexpr bool kSeeded = false;  // reads config.seed
  static void unrotate(const float *, uint32_t, float *) {}  // decoded tokens are in channel order
  static void copy_fields(const qjlkv_config &, qjlkv_config &) {}
  static void init_layers(const qjlkv_config &, std::vector<LayerSpec> &) {}
  static float element_limit(const qjlkv_config &, qjlkv_dtype) { return kHalfMax; }
  static double norm_limit(const qjlkv_config &) { return 0.0; }
  [[noreturn]] static void fail_norm(const qjlkv_config &, size_t, double) { unreachable(); }
};

}  // namespace qjlkv
