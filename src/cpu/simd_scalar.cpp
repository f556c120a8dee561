// Portable kernels (one lane): the path of CPUs without AVX2, and the check of the others.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "simd.hpp"

namespace qjlkv::cpu::scalar {
namespace {

struct V {
  static constexpr uint32_t W = 1, kScoreRows = 4, kValueRows = 4, kValueVectors = 4;
  static constexpr bool kFusedTables = false;  // tables stored once per block, shared by all its tokens
  using F = float;
  using I = uint32_t;
  static F zero() { return 0.0f; }
  static F set1(float x) { return x; }
  static F load(const float *p) { return *p; }
  static void store(float *p, F v) { *p = v; }
  static F loadn(const float *p, uint32_t n, float fill) { return n ? *p : fill; }
  static I loadi(const uint32_t *p) { return *p; }
  static void storei(uint32_t *p, I v) { *p = v; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { return a * b + c; }
  // x86 semantics: min(a, b) = a < b ? a : b, max(a, b) = a > b ? a : b (b on ties).
  static F min(F a, F b) { return a < b ? a : b; }
  static F max(F a, F b) { return a > b ? a : b; }
  static F div(F a, F b) { return a / b; }
  static F one_where_greater(F a, F b) { return a > b ? 1.0f : 0.0f; }  // 1 where a > b, else 0 (NaN: 0)
  static F round_even(F x) { return std::rint(x); }
  static I to_int(F x) { return uint32_t(x); }
  static bool all_within(F x, F bound) { return std::fabs(x) <= bound; }
  using M = bool;
  static M equal(F a, F b) { return a == b; }
  static I zero_where(I v, M m) { return m ? 0u : v; }
  template <uint32_t BITS>
  static void pack_codes(I code, uint8_t *row, uint32_t first) { pack_code(row, first, BITS, code); }
  static float hsum(F a) { return a; }
  static float hmax(F a) { return a; }
  static float hmin(F a) { return a; }
  static void hsum4(F a, F b, F c, F d, float *out) {
    out[0] = a;
    out[1] = b;
    out[2] = c;
    out[3] = d;
  }
  static F exp(F x) { return std::exp(x); }
  static F load_f16(const uint16_t *p) { return half_to_float(*p); }
  static F load_bf16(const uint16_t *p) { return bf16_to_float(*p); }
  static void store_f16(uint16_t *p, F v) { *p = float_to_half(v); }
  static void store_bf16(uint16_t *p, F v) { *p = float_to_bf16(v); }
  static uint32_t positive_bits(F p) { return p > 0.0f; }
  static F permute(F table, I) { return table; }
  template <uint32_t BITS>
  static F codes(const uint8_t *row, uint32_t first) { return float(unpack_code(row, first, BITS)); }
  // table[code] for the codes codes<BITS> reads; table has 16 entries, entry e = level(e mod 2^BITS).
  template <uint32_t BITS>
  static F code_levels(const float *table, const uint8_t *row, uint32_t first) {
    return table[unpack_code(row, first, BITS)];
  }
  static I lookup_index(I i) { return i & 15u; }
  static F lookup16(const float *table, I i) { return table[i]; }
  static I srl4(I i) { return i >> 4; }
  // table[e] = Σ_k ±x_k (+ where bit k of e is set), built by doubling.
  static void table_signs(const float *x, float *table) {
    table[0] = -x[0] - x[1] - x[2] - x[3];
    for (uint32_t k = 0; k < 4; ++k)
      for (uint32_t e = 0; e < (1u << k); ++e) table[e | 1u << k] = table[e] + 2.0f * x[k];
  }
  struct Table {
    float entries[16];
  };
  static Table signs_table(const float *x) {
    Table t;
    table_signs(x, t.entries);
    return t;
  }
  static F lookup(const Table &t, I i) { return t.entries[i]; }
  static I gather_words(const uint8_t *rows, uint32_t row_words, uint32_t k, uint32_t t, uint32_t n) {
    uint32_t word = 0;
    if (t < n) std::memcpy(&word, rows + 4 * (size_t(t) * row_words + k), 4);
    return word;
  }
  static void table_codes2(float a, float b, float *table) {
    for (uint32_t e = 0; e < 16; ++e) table[e] = a * float(e & 3u) + b * float(e >> 2);
  }
  static void table_linear(float a, float *table) {
    for (uint32_t e = 0; e < 16; ++e) table[e] = a * float(e);
  }
};

#include "simd_impl.inc"

}  // namespace
}  // namespace qjlkv::cpu::scalar

namespace qjlkv::cpu {
const KernelTable &scalar_kernels() {
  static constexpr KernelTable table = scalar::make_table(Isa::Scalar);
  return table;
}
}  // namespace qjlkv::cpu
