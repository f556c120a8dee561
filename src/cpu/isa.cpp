#include "isa.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "../error.hpp"
#include "../methods/mixed/mixed_keys.hpp"
#include "simd.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

namespace qjlkv::cpu {

const char *isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
    case Isa::Avx512Vnni: return "avx512vnni";
  }
  unreachable();
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
namespace {
// F16C by CPUID (not every compiler's __builtin_cpu_supports knows it); the OS saves the YMM
// state whenever __builtin_cpu_supports reports AVX2.
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
}
}  // namespace
#endif

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return true;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    // The AVX2 kernels also use FMA and F16C; the AVX-512 ones F, BW, DQ and VL.
    case Isa::Avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    case Isa::Avx512:
      return isa_supported(Isa::Avx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    // The integer kernels add VNNI (vpdpbusd) and VBMI (vpermb, vpmultishiftqb).
    case Isa::Avx512Vnni:
      return isa_supported(Isa::Avx512) && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
#endif
    default: return false;
  }
}

Isa best_isa() {
  for (Isa isa : {Isa::Avx512Vnni, Isa::Avx512, Isa::Avx2})
    if (isa_supported(isa)) return isa;
  return Isa::Scalar;
}

Isa select_isa() {
  const char *forced = std::getenv("QJLKV_CPU_ISA");
  if (!forced || !*forced) return best_isa();
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni}) {
    if (std::strcmp(forced, isa_name(isa)) != 0) continue;
    if (!isa_supported(isa))
      fail(QJLKV_ERROR_UNSUPPORTED, "QJLKV_CPU_ISA is \"%s\", but this CPU (or build) cannot run the %s kernels",
           forced, isa_name(isa));
    return isa;
  }
  fail(QJLKV_ERROR_INVALID_ARGUMENT, "QJLKV_CPU_ISA is \"%.32s\", must be scalar, avx2, avx512 or avx512vnni (or unset)", forced);
}

}  // namespace qjlkv::cpu

namespace qjlkv::cpu {

// ---- kernel tables ------------------------------------------------------------------------------

const KernelTable &kernel_table(Isa isa) {
  switch (isa) {
    case Isa::Avx512Vnni: return avx512_vnni_kernels();
    case Isa::Avx512: return avx512_kernels();
    case Isa::Avx2: return avx2_kernels();
    case Isa::Scalar: return scalar_kernels();
  }
  unreachable();
}

namespace {
// The fields of a config that the reference quantizers read.
qjlkv_config reference_config(const CodesArgs &a, qjlkv_value_method value_method = QJLKV_VALUES_UNIFORM) {
  qjlkv_config cfg{};
  cfg.block_tokens = a.block_tokens;
  cfg.head_dim = a.head_dim;
  cfg.key_bits = a.bits;
  cfg.value_bits = a.bits;
  cfg.value_group_size = a.group;
  cfg.value_method = value_method;
  return cfg;
}
}  // namespace

void uniform_values_quantize_reference(const CodesArgs &a, const float *values, uint8_t *block) {
  values_quantize_block(reference_config(a, QJLKV_VALUES_UNIFORM), a.stored, *a.layout, a.signs, values, block);
}

void lloyd_max_values_quantize_reference(const CodesArgs &a, const float *values, uint8_t *block) {
  values_quantize_block(reference_config(a, QJLKV_VALUES_ROTATED_LLOYD_MAX), a.stored, *a.layout, a.signs, values,
                        block);
}

void kivi_quantize_block_reference(const CodesArgs &a, const float *keys, uint8_t *block) {
  kivi_quantize_block(reference_config(a), *a.layout, keys, block);
}

void mixed_quantize_block_reference(const CodesArgs &a, const float *keys, uint8_t *block) {
  qjlkv_config cfg = reference_config(a);
  cfg.key_token_bits = uint32_t(a.layout->key_bytes_per_token_codes * 8);
  MixedKeys::quantize_block(cfg, *a.layout, keys, block);
}

void mixed_choose_widths(uint32_t d, uint32_t token_bits, const float *range, uint32_t *width) {
  MixedKeys::choose_widths(d, token_bits, range, width);
}

QjlArgs make_qjl_args(const CacheSpec &spec, const LayerSpec &layer, QjlTables &tables) {
  const qjlkv_config &cfg = spec.cfg;
  const uint32_t d = cfg.head_dim;
  const size_t stride = padded_sketch_rows(layer.sketch_rows);
  const float *S = layer.sketch->matrix.data.data();  // [sketch_rows][d]
  tables.sketch_t.assign(d * stride, 0.0f);
  for (uint32_t i = 0; i < layer.sketch_rows; ++i)
    for (uint32_t j = 0; j < d; ++j) tables.sketch_t[j * stride + i] = S[size_t(i) * d + j];
  QjlArgs a;
  a.layout = &layer.layout;
  a.block_tokens = cfg.block_tokens;
  a.head_dim = d;
  a.m = layer.m;
  a.m_out = layer.m_out;
  a.sketch_t = tables.sketch_t.data();
  a.sketch_t_stride = stride;
  a.projected_stride = stride + 2 * padded_sketch_rows(layer.m) + 16;
  a.outlier_channels = layer.m_out ? cfg.outlier_channels : 0;
  a.in_factor = spec.qjl_constant / float(layer.m);
  return a;
}

size_t kernel_scratch_floats(const qjlkv_config &cfg, uint32_t m, uint32_t m_out) {
  const size_t Bp = padded_tokens(cfg.block_tokens), d = cfg.head_dim, slack = 16;
  const auto words = [Bp](size_t bytes) { return (bytes + 3) / 4 * Bp + slack; };
  // The fp32 QJL kernel: the transposed sign words, n_in + n_out, the corrections as floats, 4
  // rows of nibble tables and of sums.
  const size_t c = m_out ? cfg.outlier_channels : 0;
  const size_t qjl = words(m / 8) + (2 + c) * (Bp + slack) + 4 * 16 * size_t(m / 4) + slack + 4 * Bp + slack;
  // The integer QJL kernels: the span's sign bytes (avx512vnni: as dwords; avx2: as two index
  // vectors per byte), 32 floats of scaled corrections per outlier channel, one pass's sums (16 zmm).
  const size_t qjl_integer = 2 * size_t(m) + 32 * c + 256 + slack;
  // key_bits is unvalidated (and ignored) unless the keys are KIVI/OTT: size from it only then.
  const bool kivi_keys = cfg.key_method == QJLKV_KEYS_KIVI || cfg.key_method == QJLKV_KEYS_OTT;
  const size_t kivi = kivi_keys ? words(d * cfg.key_bits / 8) + 2 * (d + slack) + 4 * 16 * (d * cfg.key_bits / 4) +
                                      slack + 4 * Bp + slack
                                : 0;
  // Mixed-bit keys (key_token_bits unvalidated otherwise): the nibble-table kernel's transposed
  // rows, ranges, per-bit channels and weights, 4 rows of tables and sums; or the integer kernels'
  // tables and query codes (avx512vnni: 464 floats per 64 channels; avx2: under 8 per channel).
  const size_t bits = cfg.key_method == QJLKV_KEYS_MIXED ? cfg.key_token_bits : 0;
  const size_t mixed_tables = words(bits / 8) + 2 * (d + slack) + 3 * (bits + slack) + 4 * 16 * (bits / 4) + slack +
                              4 * Bp + slack;
  const size_t mixed_integer = 464 * ((d + 63) / 64) + 8 * (d + 16) + 8 * slack;
  const size_t mixed = bits ? std::max(mixed_tables, mixed_integer) : 0;
  const size_t groups = cfg.value_method == QJLKV_VALUES_ROTATED_LLOYD_MAX ? 1
                        : cfg.value_bits == 16                              ? 0
                                                                            : d / cfg.value_group_size;
  // Rotated Lloyd-Max values: B scales, then 4 rows of weights times scales (fp32; the integer
  // kernels take 4 rows of int16 weights); uniform ones 4 rows of B·groups int16 weights
  // (rounded up to 32), 4×16 sums of minima and 4 rows of the fp32 products.
  const size_t values = cfg.value_method == QJLKV_VALUES_ROTATED_LLOYD_MAX
                            ? 5 * Bp + 2 * slack
                            : 6 * (size_t(cfg.block_tokens) * groups + 32) + 64 + slack;
  return std::max({qjl, qjl_integer, kivi, mixed, values});
}

}  // namespace qjlkv::cpu
