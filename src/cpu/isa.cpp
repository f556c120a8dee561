#include "isa.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "../error.hpp"
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
qjlkv_config reference_config(const CodesArgs &a) {
  qjlkv_config cfg{};
  cfg.block_tokens = a.block_tokens;
  cfg.head_dim = a.head_dim;
  cfg.key_bits = a.bits;
  cfg.value_bits = a.bits;
  cfg.value_group_size = a.group;
  cfg.value_method = a.method;
  return cfg;
}
}  // namespace

void values_quantize_block_reference(const CodesArgs &a, const float *values, uint8_t *block) {
  values_quantize_block(reference_config(a), a.stored, *a.layout, a.signs, values, block);
}

void kivi_quantize_block_reference(const CodesArgs &a, const float *keys, uint8_t *block) {
  kivi_quantize_block(reference_config(a), *a.layout, keys, block);
}

namespace {
// The tables (SignTable, in `layout`) of `bytes` sign bytes (an even count) from the codes x of
// their 8·bytes rows.
void sign_tables(const int32_t *x, uint32_t bytes, QjlCodes layout, SignTable *out) {
  for (uint32_t b = 0; b < bytes; ++b)
    for (uint32_t nibble = 0; nibble < 2; ++nibble)
      for (uint32_t e = 0; e < 16; ++e) {
        int32_t sum = 0;
        for (uint32_t bit = 0; bit < 4; ++bit)
          if (e >> bit & 1) sum += x[8 * b + 4 * nibble + bit];
        if (layout == QjlCodes::QuadBytes) {
          const uint32_t pair = b & ~1u, entry = 16 * (2 * (b % 2) + nibble) + e;
          out[pair].bytes[entry] = uint8_t(uint32_t(sum) & 255u);
          out[pair + 1].bytes[entry] = uint8_t(uint32_t(sum >> 8) & 255u);  // sum >> 8: the signed high byte
        } else {
          const auto biased = uint32_t(sum + kQjlSplitBias);
          out[b].split[nibble][e] = uint8_t(biased & 255u);
          out[b].split[2 + nibble][e] = uint8_t(biased >> 8);
        }
      }
}

// QjlArgs' column codes: Y_ij = round(S_ij / step), step = max |S| / kQjlCodeMax.
void make_column_codes(const LayerSpec &layer, uint32_t d, QjlCodes layout, QjlTables &tables, QjlArgs &a) {
  const uint32_t rows = layer.sketch_rows, bytes = rows / 8;
  const float *S = layer.sketch->matrix.data.data();  // [sketch_rows][d]
  float largest = 0.0f;
  for (size_t i = 0; i < size_t(rows) * d; ++i) largest = std::max(largest, std::fabs(S[i]));
  const CodeScale code = code_scale(largest, kQjlCodeMax);
  tables.columns.assign(size_t(d) * bytes, SignTable{});
  tables.column_sums.assign(2 * size_t(d), 0);
  std::vector<int32_t> Y(rows);
  for (uint32_t j = 0; j < d; ++j) {
    for (uint32_t i = 0; i < rows; ++i) {
      Y[i] = int32_t(std::nearbyint(S[size_t(i) * d + j] * code.prescale * code.factor));
      if (i < layer.m) tables.column_sums[2 * j] += Y[i];
      if (i < layer.m_out) tables.column_sums[2 * j + 1] += Y[i];
    }
    sign_tables(Y.data(), bytes, layout, &tables.columns[size_t(j) * bytes]);
  }
  a.column_tables = tables.columns.data();
  a.column_table_stride = bytes;
  a.column_sums = tables.column_sums.data();
  a.column_step = largest / kQjlCodeMax;
}
}  // namespace

QjlArgs make_qjl_args(const CacheSpec &spec, const LayerSpec &layer, QjlTables &tables, QjlCodes codes) {
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
  a.outlier_channels = cfg.outlier_channels;
  a.sketch_t = tables.sketch_t.data();
  a.sketch_t_stride = stride;
  a.projected_stride = stride + 2 * padded_sketch_rows(layer.m) + 16;
  a.in_factor = spec.qjl_constant / float(layer.m);
  a.out_factor = layer.m_out ? spec.qjl_constant / float(layer.m_out) : 0.0f;
  const bool outliers = layer.m_out && cfg.outlier_channels;
  if (codes != QjlCodes::None && outliers && qjl_integer_rows(layer.m) && qjl_integer_rows(layer.m_out))
    make_column_codes(layer, d, codes, tables, a);
  return a;
}

size_t kernel_scratch_floats(const qjlkv_config &cfg, uint32_t m, uint32_t m_out, uint32_t sketch_rows) {
  const size_t Bp = padded_tokens(cfg.block_tokens), d = cfg.head_dim, slack = 16;
  const auto words = [Bp](size_t bytes) { return (bytes + 3) / 4 * Bp + slack; };
  const size_t qjl = words(m / 8) + words(m_out / 8) + 2 * (Bp + slack) + 8 * (padded_sketch_rows(sketch_rows) + slack) +
                     4 * 16 * size_t(m / 4 + m_out / 4) + 2 * slack + 8 * Bp + 2 * slack;
  // The integer QJL kernels: the span's sign bytes (avx512vnni: as dwords; avx2: as two index
  // vectors per byte), 32 floats per column, one pass's sums (16 zmm).
  const size_t qjl_integer = 2 * size_t(m + m_out) + 32 * size_t(cfg.outlier_channels) + 256 + slack;
  // key_bits is unvalidated (and ignored) unless the keys are KIVI/OTT: size from it only then.
  const bool kivi_keys = cfg.key_method == QJLKV_KEYS_KIVI || cfg.key_method == QJLKV_KEYS_OTT;
  const size_t kivi = kivi_keys ? words(d * cfg.key_bits / 8) + 2 * (d + slack) + 4 * 16 * (d * cfg.key_bits / 4) +
                                      slack + 4 * Bp + slack
                                : 0;
  const size_t groups = cfg.value_method == QJLKV_VALUES_ROTATED_LLOYD_MAX ? 1
                        : cfg.value_bits == 16                              ? 0
                                                                            : d / cfg.value_group_size;
  // Rotated Lloyd-Max values: B scales, then 4 rows of weights times scales (fp32; the integer
  // kernels take 4 rows of int16 weights); uniform ones 4 rows of B·groups int16 weights
  // (rounded up to 32), 4×16 sums of minima and 4 rows of the fp32 products.
  const size_t values = cfg.value_method == QJLKV_VALUES_ROTATED_LLOYD_MAX
                            ? 5 * Bp + 2 * slack
                            : 6 * (size_t(cfg.block_tokens) * groups + 32) + 64 + slack;
  return std::max({qjl, qjl_integer, kivi, values});
}

}  // namespace qjlkv::cpu
