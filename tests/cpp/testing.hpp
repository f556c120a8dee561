// Shared helpers of the C API tests: RAII handles, status checks, tensors in every dtype, and
// reference math written from SPEC §3-§6 and docs/DESIGN.md, independently of src/ (only the
// fp16/bf16 conversions of src/half.hpp are used; test_half.cpp checks them bit for bit).
#pragma once

#include <gtest/gtest.h>
#include <qjlkv/qjlkv.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <numbers>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "half.hpp"

namespace qt {

// The dtype field of a config the library accepted, as the enum (the field is uint32_t).
inline qjlkv_dtype dtype_of(const qjlkv_config &cfg) { return static_cast<qjlkv_dtype>(cfg.dtype); }

// ---------------------------------------------------------------------------------------------
// Handles and statuses
// ---------------------------------------------------------------------------------------------
struct CacheDeleter {
  void operator()(qjlkv_cache *c) const noexcept { qjlkv_cache_destroy(c); }
};
using Cache = std::unique_ptr<qjlkv_cache, CacheDeleter>;
struct SketchDeleter {
  void operator()(qjlkv_sketch *s) const noexcept { qjlkv_sketch_destroy(s); }
};
using Sketch = std::unique_ptr<qjlkv_sketch, SketchDeleter>;

inline std::string describe(qjlkv_status s) {
  return std::string(qjlkv_status_string(s)) + " (" + qjlkv_last_error_message() + ")";
}

#define QT_ASSERT_OK(expr)                                                            \
  do {                                                                                \
    const qjlkv_status qt_status_ = (expr);                                           \
    ASSERT_EQ(qt_status_, QJLKV_OK) << #expr << " -> " << ::qt::describe(qt_status_); \
  } while (0)
#define QT_EXPECT_OK(expr)                                                            \
  do {                                                                                \
    const qjlkv_status qt_status_ = (expr);                                           \
    EXPECT_EQ(qt_status_, QJLKV_OK) << #expr << " -> " << ::qt::describe(qt_status_); \
  } while (0)

inline bool is_identifier_char(char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; }

// Whether `message` mentions `name` as a whole identifier ("out" does not match "out_len").
inline bool names_identifier(const std::string &message, const std::string &name) {
  for (size_t at = message.find(name); at != std::string::npos; at = message.find(name, at + 1)) {
    const bool starts = at == 0 || !is_identifier_char(message[at - 1]);
    const size_t end = at + name.size();
    const bool ends = end == message.size() || !is_identifier_char(message[end]);
    if (starts && ends) return true;
  }
  return false;
}

// Provokes a known failure so that the thread's message is a known, unrelated text: a call that
// fails without setting its own message is then caught (its message equals this one).
inline std::string stale_error_message() {
  qjlkv_sketch *ignored = nullptr;
  (void)qjlkv_sketch_create(64, 64, 0, 0xdead0000u, &ignored);
  return qjlkv_last_error_message();
}

// A failing call: the expected status, and a fresh message that names one of `names`.
inline ::testing::AssertionResult fails_naming(qjlkv_status got, qjlkv_status expected, const std::string &stale,
                                               std::initializer_list<const char *> names) {
  const std::string message = qjlkv_last_error_message();
  if (got != expected)
    return ::testing::AssertionFailure() << "status " << qjlkv_status_string(got) << ", expected "
                                         << qjlkv_status_string(expected) << "; message: \"" << message << "\"";
  if (message == stale) return ::testing::AssertionFailure() << "the call did not set an error message";
  for (const char *name : names)
    if (names_identifier(message, name)) return ::testing::AssertionSuccess();
  auto failure = ::testing::AssertionFailure() << "message \"" << message << "\" names none of:";
  for (const char *name : names) failure << " " << name;
  return failure;
}

#define QT_EXPECT_FAIL(expr, status, ...)                                                    \
  do {                                                                                       \
    const std::string qt_stale_ = ::qt::stale_error_message();                               \
    const qjlkv_status qt_got_ = (expr);                                                     \
    EXPECT_TRUE(::qt::fails_naming(qt_got_, (status), qt_stale_, {__VA_ARGS__})) << "  call: " #expr; \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Dtypes
// ---------------------------------------------------------------------------------------------
inline size_t dtype_bytes(qjlkv_dtype t) { return t == QJLKV_DTYPE_F32 ? 4 : 2; }
inline const char *dtype_name(qjlkv_dtype t) {
  return t == QJLKV_DTYPE_F32 ? "f32" : t == QJLKV_DTYPE_F16 ? "f16" : "bf16";
}

inline float fp16_value(float x) { return qjlkv::half_to_float(qjlkv::float_to_half(x)); }
inline float bf16_value(float x) { return qjlkv::bf16_to_float(qjlkv::float_to_bf16(x)); }

// The value the library sees when x is passed in dtype t.
inline float representable(float x, qjlkv_dtype t) {
  return t == QJLKV_DTYPE_F32 ? x : t == QJLKV_DTYPE_F16 ? fp16_value(x) : bf16_value(x);
}
inline void make_representable(std::vector<float> &x, qjlkv_dtype t) {
  for (float &v : x) v = representable(v, t);
}

inline std::vector<uint8_t> encode(const std::vector<float> &x, qjlkv_dtype t) {
  std::vector<uint8_t> bytes(x.size() * dtype_bytes(t));
  for (size_t i = 0; i < x.size(); ++i) {
    if (t == QJLKV_DTYPE_F32) {
      std::memcpy(&bytes[4 * i], &x[i], 4);
    } else {
      const uint16_t h = t == QJLKV_DTYPE_F16 ? qjlkv::float_to_half(x[i]) : qjlkv::float_to_bf16(x[i]);
      std::memcpy(&bytes[2 * i], &h, 2);
    }
  }
  return bytes;
}

inline std::vector<float> decode(const void *data, size_t n, qjlkv_dtype t) {
  std::vector<float> x(n);
  const auto *bytes = static_cast<const uint8_t *>(data);
  for (size_t i = 0; i < n; ++i) {
    if (t == QJLKV_DTYPE_F32) {
      std::memcpy(&x[i], bytes + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, bytes + 2 * i, 2);
      x[i] = t == QJLKV_DTYPE_F16 ? qjlkv::half_to_float(h) : qjlkv::bf16_to_float(h);
    }
  }
  return x;
}

// 16-bit exact storage (DESIGN.md): fp16 for fp32/fp16 inputs, bf16 for bf16 inputs.
inline float stored16(float x, qjlkv_dtype t) { return t == QJLKV_DTYPE_BF16 ? bf16_value(x) : fp16_value(x); }

// ---------------------------------------------------------------------------------------------
// Random data
// ---------------------------------------------------------------------------------------------
class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  float normal() { return normal_(engine_); }
  std::vector<float> normals(size_t n, float sd = 1.0f) {
    std::vector<float> x(n);
    for (float &v : x) v = sd * normal_(engine_);
    return x;
  }
  double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(engine_); }
  uint32_t below(uint32_t n) { return std::uniform_int_distribution<uint32_t>(0, n - 1)(engine_); }
  std::mt19937_64 &engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
  std::normal_distribution<float> normal_{0.0f, 1.0f};
};

// Multiplies the listed channels of every [.. ][d] row by `factor`: the per-channel outliers
// that QJL's outlier sketch exists for.
inline void amplify_channels(std::vector<float> &x, uint32_t d, std::initializer_list<uint32_t> channels,
                             float factor) {
  for (size_t row = 0; row < x.size() / d; ++row)
    for (uint32_t ch : channels) x[row * d + ch] *= factor;
}

inline double dot(const float *a, const float *b, uint32_t n) {
  double s = 0.0;
  for (uint32_t i = 0; i < n; ++i) s += double(a[i]) * double(b[i]);
  return s;
}
inline double norm(const float *a, uint32_t n) { return std::sqrt(dot(a, a, n)); }

// ---------------------------------------------------------------------------------------------
// Configs and caches
// ---------------------------------------------------------------------------------------------
// A preset config; one worker thread keeps the many small caches of the tests cheap.
inline qjlkv_config make_config(const char *preset, uint32_t layers, uint32_t hq, uint32_t hkv, uint32_t d) {
  qjlkv_config cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.struct_size = sizeof cfg;
  const qjlkv_status s = qjlkv_config_init(&cfg, preset, layers, hq, hkv, d);
  EXPECT_EQ(s, QJLKV_OK) << "qjlkv_config_init(" << (preset ? preset : "NULL") << ") -> " << describe(s);
  cfg.num_threads = 1;
  return cfg;
}

// QJL caches run on the fp32 (scalar) kernels here unless QJLKV_CPU_ISA is set: these tests
// hold QJL scores to the formula within kScoreRelTol, which the integer QJL scores (avx2, avx512,
// avx512vnni) do not meet per element; tests/cpu_paths holds those paths to SPEC §9's error
// budget instead.
inline Cache make_cache(const qjlkv_config &cfg) {
  qjlkv_cache *c = nullptr;
  qjlkv_status s;
  if (cfg.key_method == QJLKV_KEYS_QJL && cfg.backend == QJLKV_BACKEND_CPU && std::getenv("QJLKV_CPU_ISA") == nullptr) {
    setenv("QJLKV_CPU_ISA", "scalar", 1);
    s = qjlkv_cache_create(&cfg, &c);
    unsetenv("QJLKV_CPU_ISA");
  } else {
    s = qjlkv_cache_create(&cfg, &c);
  }
  EXPECT_EQ(s, QJLKV_OK) << "qjlkv_cache_create -> " << describe(s);
  return Cache(c);
}

inline uint64_t length_of(const qjlkv_cache *c, uint32_t layer, uint32_t seq) {
  uint64_t n = ~uint64_t(0);
  const qjlkv_status s = qjlkv_cache_length(c, layer, seq, &n);
  EXPECT_EQ(s, QJLKV_OK) << describe(s);
  return n;
}

inline qjlkv_stats stats_of(const qjlkv_cache *c) {
  qjlkv_stats st;
  std::memset(&st, 0, sizeof st);
  st.struct_size = sizeof st;
  const qjlkv_status s = qjlkv_cache_stats(c, &st);
  EXPECT_EQ(s, QJLKV_OK) << describe(s);
  return st;
}

// The exported stream of seq's layers [0, num_layers): the stored bytes, for comparing caches.
inline std::vector<uint8_t> exported(const qjlkv_cache *c, uint32_t seq, uint32_t num_layers) {
  uint64_t size = 0;
  EXPECT_EQ(qjlkv_cache_export_size(c, seq, 0, num_layers, &size), QJLKV_OK) << qjlkv_last_error_message();
  std::vector<uint8_t> bytes(size);
  EXPECT_EQ(qjlkv_cache_export(c, seq, 0, num_layers, bytes.data(), size), QJLKV_OK) << qjlkv_last_error_message();
  return bytes;
}

// Positions of a sequence of `length` tokens held in quantized blocks (DESIGN.md "Cache
// semantics": the tail is quantized B at a time while it holds >= R + B tokens).
inline uint64_t quantized_positions(uint64_t length, uint32_t block, uint32_t residual) {
  if (length < uint64_t(residual) + block) return 0;
  return (length - residual) / block * block;
}

// The library's raw scores of one query ([Hq][d] in cfg.dtype) against (layer, seq): [Hq][len].
inline void library_scores(qjlkv_cache *c, uint32_t layer, uint32_t seq, const std::vector<uint8_t> &query,
                           std::vector<float> *out) {
  qjlkv_config cfg;
  cfg.struct_size = sizeof cfg;
  QT_ASSERT_OK(qjlkv_cache_config(c, &cfg));
  uint64_t len = 0;
  QT_ASSERT_OK(qjlkv_cache_length(c, layer, seq, &len));
  out->assign(size_t(cfg.num_q_heads) * len, std::nanf(""));
  QT_ASSERT_OK(qjlkv_cache_scores(c, layer, seq, query.data(), out->data(), out->size()));
}

// ---------------------------------------------------------------------------------------------
// Reference math
// ---------------------------------------------------------------------------------------------
// c_d of SPEC §3: E|<s,k>| for rows of norm sqrt(d) uniform on the sphere, or Gaussian rows.
inline double qjl_constant(uint32_t d, bool orthogonal) {
  if (!orthogonal) return std::sqrt(std::numbers::pi / 2.0);
  const double dd = d;
  return std::sqrt(std::numbers::pi) * std::exp(std::lgamma((dd + 1.0) / 2.0) - std::lgamma(dd / 2.0)) /
         std::sqrt(dd);
}

// fp16 neighbours of a finite fp16 value, by bit pattern.
inline uint16_t fp16_bits_below(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x8001u;  // +-0 -> the negative subnormal closest to zero
  return (h & 0x8000u) ? uint16_t(h + 1) : uint16_t(h - 1);
}
inline uint16_t fp16_bits_above(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x0001u;
  return (h & 0x8000u) ? uint16_t(h - 1) : uint16_t(h + 1);
}
// The largest fp16 <= x and the smallest fp16 >= x (x finite, within the fp16 range).
inline float fp16_floor(float x) {
  uint16_t h = qjlkv::float_to_half(x);
  if (qjlkv::half_to_float(h) > x) h = fp16_bits_below(h);
  return qjlkv::half_to_float(h);
}
inline float fp16_ceil(float x) {
  uint16_t h = qjlkv::float_to_half(x);
  if (qjlkv::half_to_float(h) < x) h = fp16_bits_above(h);
  return qjlkv::half_to_float(h);
}

// One token's value vector as the cache reconstructs it (SPEC §4 with DESIGN.md's directed fp16
// rounding of minimum and scale; fp32 arithmetic). `scales`, when given, receives each group's
// scale (one per channel).
inline void dequantize_values(const float *x, uint32_t d, uint32_t group, uint32_t bits, float *x_hat,
                              float *scales = nullptr) {
  const float levels = float((1u << bits) - 1u);
  for (uint32_t g0 = 0; g0 < d; g0 += group) {
    float mn = x[g0], mx = x[g0];
    for (uint32_t j = g0; j < g0 + group; ++j) {
      mn = std::min(mn, x[j]);
      mx = std::max(mx, x[j]);
    }
    const float min16 = fp16_floor(mn);
    const float scale16 = mx == mn ? 0.0f : fp16_ceil((mx - min16) / levels);
    for (uint32_t j = g0; j < g0 + group; ++j) {
      float code = 0.0f;
      if (scale16 != 0.0f) code = std::clamp(std::rint((x[j] - min16) / scale16), 0.0f, levels);
      x_hat[j] = code * scale16 + min16;
      if (scales) scales[j] = scale16;
    }
  }
}

// One layer's QJL sketch and sizes, read through the public API.
struct QjlLayer {
  uint32_t d = 0, rows = 0, m = 0, m_out = 0, c = 0;
  double c_d = 0.0;
  std::vector<double> S;  // rows x d
  const double *row(uint32_t i) const { return S.data() + size_t(i) * d; }
};

inline void load_qjl_layer(const qjlkv_cache *cache, uint32_t layer, QjlLayer *out) {
  qjlkv_config cfg;
  cfg.struct_size = sizeof cfg;
  QT_ASSERT_OK(qjlkv_cache_config(cache, &cfg));
  ASSERT_EQ(cfg.key_method, QJLKV_KEYS_QJL);
  const bool initial = layer < cfg.initial_layers;
  out->d = cfg.head_dim;
  out->c = cfg.outlier_channels;
  out->m = initial ? cfg.initial_key_sketch_dim : cfg.key_sketch_dim;
  out->m_out = cfg.outlier_channels == 0 ? 0 : initial ? cfg.initial_outlier_sketch_dim : cfg.outlier_sketch_dim;
  out->c_d = qjl_constant(cfg.head_dim, cfg.sketch_flags & QJLKV_SKETCH_ORTHOGONAL);
  const qjlkv_sketch *sketch = nullptr;
  QT_ASSERT_OK(qjlkv_cache_sketch(cache, layer, &sketch));
  uint32_t cols = 0;
  QT_ASSERT_OK(qjlkv_sketch_shape(sketch, &out->rows, &cols));
  ASSERT_EQ(cols, cfg.head_dim);
  ASSERT_EQ(out->rows, std::max(out->m, out->m_out)) << "layer sketch rows must be max(m, m_out)";
  std::vector<float> matrix(size_t(out->rows) * cols);
  QT_ASSERT_OK(qjlkv_sketch_matrix(sketch, matrix.data(), matrix.size()));
  out->S.assign(matrix.begin(), matrix.end());
}

// An expected score: `value`, and `slack` = how far float rounding could legitimately move the
// library's result (a projection within rounding of zero may take either sign bit; a norm at an
// fp16 midpoint may round either way). `magnitude` = ||q||·||k|| sets the tolerance scale.
struct Estimate {
  double value = 0.0, slack = 0.0, magnitude = 0.0;
  double stored = 0.0;  // bound of the error the stored fp16 outlier corrections add
  bool skip = false;  // the outlier channels of the block are a near tie: not comparable
};

// The c channels of largest sum of squares over a block (ties: lower index). `fragile` when the
// c-th and (c+1)-th sums are within float rounding of each other.
inline std::vector<bool> outlier_mask(const std::vector<const float *> &block_keys, uint32_t d, uint32_t c,
                                      bool *fragile) {
  std::vector<double> energy(d, 0.0);
  for (const float *k : block_keys)
    for (uint32_t j = 0; j < d; ++j) energy[j] += double(k[j]) * k[j];
  std::vector<uint32_t> order(d);
  for (uint32_t j = 0; j < d; ++j) order[j] = j;
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return energy[a] > energy[b]; });
  std::vector<bool> mask(d, false);
  for (uint32_t i = 0; i < c; ++i) mask[order[i]] = true;
  *fragile = c > 0 && c < d && energy[order[c - 1]] - energy[order[c]] <= 1e-5 * energy[order[c - 1]];
  return mask;
}

// The stored corrections τ_o (quant_math.hpp's qjl_correction) are rounded to fp16: what that
// can add to q·k̂, Σ_o |q_o|·|τ_o|·(n_in + n_out)·2^-11, bounded with
// |τ_o|·(n_in + n_out) <= c_d/m·n_in·Σ_i |S_io| + c_d/m_out·n_out·Σ_i |S_io|.
inline double qjl_correction_rounding(const QjlLayer &L, const float *q, const std::vector<bool> &mask,
                                      double norm_in, double norm_out) {
  if (L.m_out == 0) return 0.0;
  double bound = 0.0;
  for (uint32_t o = 0; o < L.d; ++o) {
    if (!mask[o]) continue;
    double in = 0.0, out = 0.0;
    for (uint32_t i = 0; i < std::max(L.m, L.m_out); ++i) {
      if (i < L.m) in += std::abs(L.row(i)[o]);
      if (i < L.m_out) out += std::abs(L.row(i)[o]);
    }
    bound += std::abs(double(q[o])) * (L.c_d / L.m * norm_in * in + L.c_d / L.m_out * norm_out * out);
  }
  return bound * 1.001 / 2048.0;
}

// est(q, k) of SPEC §3 for a key whose block has the given outlier mask.
inline Estimate qjl_estimate(const QjlLayer &L, const float *k, const float *q, const std::vector<bool> &mask) {
  const uint32_t d = L.d;
  Estimate e;
  e.magnitude = norm(q, d) * norm(k, d);
  double norm_in = 0.0, norm_out = 0.0;
  const auto part = [&](bool outlier, uint32_t rows) {
    if (rows == 0) return;
    std::vector<double> kp(d), qp(d);
    double nk2 = 0.0;
    for (uint32_t j = 0; j < d; ++j) {
      const bool take = mask[j] == outlier;
      kp[j] = take ? k[j] : 0.0;
      qp[j] = take ? q[j] : 0.0;
      nk2 += kp[j] * kp[j];
    }
    const double nk = std::sqrt(nk2);
    const float norm16 = fp16_value(float(nk));
    double signed_sum = 0.0, abs_sum = 0.0, flip_slack = 0.0;
    for (uint32_t i = 0; i < rows; ++i) {
      double pk = 0.0, pq = 0.0, pk_abs = 0.0;
      for (uint32_t j = 0; j < d; ++j) {
        pk += L.row(i)[j] * kp[j];
        pk_abs += std::abs(L.row(i)[j] * kp[j]);
        pq += L.row(i)[j] * qp[j];
      }
      signed_sum += pk > 0.0 ? pq : -pq;
      abs_sum += std::abs(pq);
      // fp32 accumulation of S_i·k may differ from the exact sum by ~d·eps·sum|S_ij k_j|.
      if (std::abs(pk) <= 4e-7 * d * pk_abs + 1e-30) flip_slack += 2.0 * std::abs(pq);
    }
    const double factor = L.c_d / rows;
    (outlier ? norm_out : norm_in) = norm16;
    e.value += factor * norm16 * signed_sum;
    e.slack += factor * norm16 * flip_slack;
    // The fp32 norm lies within rounding of an fp16 midpoint: either neighbour is right.
    const float lo = fp16_floor(float(nk)), hi = fp16_ceil(float(nk));
    if (lo != hi && std::abs(nk - 0.5 * (double(lo) + double(hi))) <= 1e-5 * nk)
      e.slack += factor * (double(hi) - double(lo)) * abs_sum;
  };
  part(false, L.m);
  part(true, L.m_out);
  e.stored = qjl_correction_rounding(L, q, mask, norm_in, norm_out);
  return e;
}

// The dense k̂ of SPEC §3, whose dot product with any query is est(q, k):
// k̂ = c_d/m·‖k_in‖·M_in Sᵀ(±bits_in) + c_d/m_out·‖k_out‖·M_out S_outᵀ(±bits_out).
// `ambiguous` is set when float rounding could legitimately change a sign bit or a norm;
// stored[j] (when given) is what the fp16 corrections may add to channel j (qjl_correction_rounding).
inline std::vector<double> qjl_dense_key(const QjlLayer &L, const float *k, const std::vector<bool> &mask,
                                         bool *ambiguous, std::vector<double> *stored = nullptr) {
  const uint32_t d = L.d;
  std::vector<double> k_hat(d, 0.0);
  double norm_in = 0.0, norm_out = 0.0;
  const auto part = [&](bool outlier, uint32_t rows) {
    if (rows == 0) return;
    std::vector<double> kp(d);
    double nk2 = 0.0;
    for (uint32_t j = 0; j < d; ++j) {
      kp[j] = mask[j] == outlier ? k[j] : 0.0;
      nk2 += kp[j] * kp[j];
    }
    const double nk = std::sqrt(nk2);
    const float lo = fp16_floor(float(nk)), hi = fp16_ceil(float(nk));
    if (lo != hi && std::abs(nk - 0.5 * (double(lo) + double(hi))) <= 1e-5 * nk) *ambiguous = true;
    (outlier ? norm_out : norm_in) = fp16_value(float(nk));
    const double factor = L.c_d / rows * fp16_value(float(nk));
    for (uint32_t i = 0; i < rows; ++i) {
      double pk = 0.0, pk_abs = 0.0;
      for (uint32_t j = 0; j < d; ++j) {
        pk += L.row(i)[j] * kp[j];
        pk_abs += std::abs(L.row(i)[j] * kp[j]);
      }
      if (nk > 0.0 && std::abs(pk) <= 4e-7 * d * pk_abs) *ambiguous = true;
      const double sign = pk > 0.0 ? 1.0 : -1.0;
      for (uint32_t j = 0; j < d; ++j)
        if (mask[j] == outlier) k_hat[j] += factor * sign * L.row(i)[j];
    }
  };
  part(false, L.m);
  part(true, L.m_out);
  if (stored) {
    stored->assign(d, 0.0);
    std::vector<float> unit(d, 0.0f);
    for (uint32_t j = 0; j < d; ++j) {
      unit[j] = 1.0f;
      (*stored)[j] = qjl_correction_rounding(L, unit.data(), mask, norm_in, norm_out);
      unit[j] = 0.0f;
    }
  }
  return k_hat;
}

// A mirror of one (layer, sequence) stream of a cache: what it holds and what it must compute.
class ReferenceSequence {
 public:
  // `qjl` is required when cfg.key_method is QJLKV_KEYS_QJL.
  ReferenceSequence(const qjlkv_config &cfg, const QjlLayer *qjl) : cfg_(cfg), qjl_(qjl) {}

  // keys, values: [n][Hkv][d], already representable in cfg.dtype.
  void append(const float *keys, const float *values, uint32_t n) {
    const size_t count = size_t(n) * cfg_.num_kv_heads * cfg_.head_dim;
    keys_.insert(keys_.end(), keys, keys + count);
    values_.insert(values_.end(), values, values + count);
    value_hats_.resize(values_.size());
    for (size_t row = values_.size() / cfg_.head_dim - count / cfg_.head_dim; row < values_.size() / cfg_.head_dim;
         ++row) {
      const float *v = &values_[row * cfg_.head_dim];
      float *v_hat = &value_hats_[row * cfg_.head_dim];
      if (cfg_.value_bits == 16) {
        for (uint32_t j = 0; j < cfg_.head_dim; ++j) v_hat[j] = stored16(v[j], qt::dtype_of(cfg_));
      } else {
        dequantize_values(v, cfg_.head_dim, cfg_.value_group_size, cfg_.value_bits, v_hat);
      }
    }
  }
  void append(const std::vector<float> &keys, const std::vector<float> &values) {
    append(keys.data(), values.data(), uint32_t(keys.size() / (size_t(cfg_.num_kv_heads) * cfg_.head_dim)));
  }

  uint64_t length() const { return keys_.size() / (size_t(cfg_.num_kv_heads) * cfg_.head_dim); }
  uint64_t quantized() const { return quantized_positions(length(), cfg_.block_tokens, cfg_.residual_tokens); }
  const float *key(uint64_t t, uint32_t kv) const { return &keys_[(t * cfg_.num_kv_heads + kv) * cfg_.head_dim]; }
  const float *value(uint64_t t, uint32_t kv) const {
    return &values_[(t * cfg_.num_kv_heads + kv) * cfg_.head_dim];
  }
  // The value vector attention uses at position t: dequantized inside blocks, exact in the tail.
  const float *value_used(uint64_t t, uint32_t kv) const {
    return t < quantized() ? &value_hats_[(t * cfg_.num_kv_heads + kv) * cfg_.head_dim] : value(t, kv);
  }

  // The key qjlkv_cache_reconstruct must return at position t: the dense QJL form inside QJL
  // blocks, the 16-bit copy inside EXACT blocks, the key itself in the tail. stored: see
  // qjl_dense_key (left empty outside QJL blocks).
  std::vector<double> key_hat(uint64_t t, uint32_t kv, bool *ambiguous, std::vector<double> *stored = nullptr) const {
    const uint32_t d = cfg_.head_dim;
    const float *k = key(t, kv);
    if (t >= quantized()) return std::vector<double>(k, k + d);
    if (cfg_.key_method == QJLKV_KEYS_EXACT) {
      std::vector<double> k16(d);
      for (uint32_t j = 0; j < d; ++j) k16[j] = stored16(k[j], qt::dtype_of(cfg_));
      return k16;
    }
    const uint64_t b0 = t / cfg_.block_tokens * cfg_.block_tokens;
    std::vector<const float *> block;
    for (uint64_t u = b0; u < b0 + cfg_.block_tokens; ++u) block.push_back(key(u, kv));
    bool fragile = false;
    const std::vector<bool> mask = outlier_mask(block, d, qjl_->m_out ? qjl_->c : 0, &fragile);
    if (fragile) *ambiguous = true;
    return qjl_dense_key(*qjl_, k, mask, ambiguous, stored);
  }

  // Expected raw scores of q ([Hq][d]) against every position: [Hq][length].
  std::vector<Estimate> scores(const float *q) const {
    const uint32_t d = cfg_.head_dim, hq = cfg_.num_q_heads, group = hq / cfg_.num_kv_heads;
    const uint64_t len = length(), quant = quantized();
    std::vector<Estimate> out(size_t(hq) * len);
    for (uint32_t h = 0; h < hq; ++h) {
      const uint32_t kv = h / group;
      const float *qh = q + size_t(h) * d;
      for (uint64_t b0 = 0; b0 < quant; b0 += cfg_.block_tokens) {
        std::vector<bool> mask(d, false);
        bool fragile = false;
        if (cfg_.key_method == QJLKV_KEYS_QJL) {
          std::vector<const float *> block;
          for (uint64_t t = b0; t < b0 + cfg_.block_tokens; ++t) block.push_back(key(t, kv));
          mask = outlier_mask(block, d, qjl_->m_out ? qjl_->c : 0, &fragile);
        }
        for (uint64_t t = b0; t < b0 + cfg_.block_tokens; ++t) {
          Estimate &e = out[h * len + t];
          if (cfg_.key_method == QJLKV_KEYS_QJL) {
            e = qjl_estimate(*qjl_, key(t, kv), qh, mask);
            e.skip = fragile;
          } else {  // QJLKV_KEYS_EXACT: 16-bit keys
            std::vector<float> k16(d);
            for (uint32_t j = 0; j < d; ++j) k16[j] = stored16(key(t, kv)[j], qt::dtype_of(cfg_));
            e.value = dot(qh, k16.data(), d);
            e.magnitude = norm(qh, d) * norm(k16.data(), d);
          }
        }
      }
      for (uint64_t t = quant; t < len; ++t) {
        Estimate &e = out[h * len + t];
        e.value = dot(qh, key(t, kv), d);
        e.magnitude = norm(qh, d) * norm(key(t, kv), d);
      }
    }
    return out;
  }

  // softmax(scale·scores[h][0, visible)) · values actually used, per query head: [Hq][d].
  std::vector<double> attend(const std::vector<float> &scores, uint64_t visible, float scale) const {
    const uint32_t d = cfg_.head_dim, hq = cfg_.num_q_heads, group = hq / cfg_.num_kv_heads;
    const uint64_t len = length();
    std::vector<double> out(size_t(hq) * d, 0.0);
    for (uint32_t h = 0; h < hq; ++h) {
      const float *s = &scores[h * len];
      double mx = -INFINITY;
      for (uint64_t t = 0; t < visible; ++t) mx = std::max(mx, double(scale) * s[t]);
      double total = 0.0;
      for (uint64_t t = 0; t < visible; ++t) {
        const double w = std::exp(double(scale) * s[t] - mx);
        total += w;
        const float *v = value_used(t, h / group);
        for (uint32_t j = 0; j < d; ++j) out[size_t(h) * d + j] += w * v[j];
      }
      for (uint32_t j = 0; j < d; ++j) out[size_t(h) * d + j] /= total;
    }
    return out;
  }

  // Exact attention on the unquantized keys and values (SPEC §6 with nothing compressed).
  std::vector<double> exact_attend(const float *q, uint64_t visible, float scale) const {
    const uint32_t d = cfg_.head_dim, hq = cfg_.num_q_heads, group = hq / cfg_.num_kv_heads;
    const uint64_t len = length();
    std::vector<float> s(size_t(hq) * len);
    for (uint32_t h = 0; h < hq; ++h)
      for (uint64_t t = 0; t < len; ++t) s[h * len + t] = float(dot(q + size_t(h) * d, key(t, h / group), d));
    std::vector<double> out(size_t(hq) * d, 0.0);
    for (uint32_t h = 0; h < hq; ++h) {
      double mx = -INFINITY;
      for (uint64_t t = 0; t < visible; ++t) mx = std::max(mx, double(scale) * s[h * len + t]);
      double total = 0.0;
      for (uint64_t t = 0; t < visible; ++t) {
        const double w = std::exp(double(scale) * s[h * len + t] - mx);
        total += w;
        const float *v = value(t, h / group);
        for (uint32_t j = 0; j < d; ++j) out[size_t(h) * d + j] += w * v[j];
      }
      for (uint32_t j = 0; j < d; ++j) out[size_t(h) * d + j] /= total;
    }
    return out;
  }

 private:
  qjlkv_config cfg_;
  const QjlLayer *qjl_;
  std::vector<float> keys_, values_, value_hats_;
};

// Tolerance of a QJL score, relative to ||q||·||k||. The library and the reference compute the
// same formula in fp32 and float64 (measured differences ~3e-7); 1e-5 still catches a wrong c_d
// (0.2-0.4 %), an fp32 instead of fp16 norm (~2e-4) or a flipped sign convention.
inline constexpr double kScoreRelTol = 1e-5;

// Compares library scores with expected ones: |lib - ref| <= rel_tol·||q||·||k|| + slack.
// Returns how many comparisons needed the slack (projections within rounding of zero).
struct ScoreCheck {
  size_t compared = 0, used_slack = 0, skipped = 0;
  double max_rel_error = 0.0;
};
inline ScoreCheck check_scores(const std::vector<float> &lib, const std::vector<Estimate> &ref, double rel_tol,
                               const std::string &what) {
  ScoreCheck r;
  EXPECT_EQ(lib.size(), ref.size()) << what;
  size_t reported = 0;
  for (size_t i = 0; i < std::min(lib.size(), ref.size()); ++i) {
    if (ref[i].skip) {
      ++r.skipped;
      continue;
    }
    ++r.compared;
    const double err = std::abs(double(lib[i]) - ref[i].value);
    const double tol = rel_tol * ref[i].magnitude + ref[i].stored + 1e-30;
    r.max_rel_error = std::max(r.max_rel_error, err / (ref[i].magnitude + 1e-30));
    if (err > tol) {
      if (err <= tol + ref[i].slack) {
        ++r.used_slack;
      } else if (reported++ < 8) {
        ADD_FAILURE() << what << ": score " << i << " is " << lib[i] << ", expected " << ref[i].value
                      << " (|q||k| = " << ref[i].magnitude << ", slack " << ref[i].slack << ")";
      }
    }
  }
  EXPECT_EQ(reported, 0u) << what << ": mismatching scores";
  return r;
}

// Elementwise |got - want| <= atol + rtol·|want|.
inline void expect_near_all(const std::vector<float> &got, const std::vector<double> &want, double atol, double rtol,
                            const std::string &what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double(got[i]) - want[i]);
    if (!(err <= atol + rtol * std::abs(want[i])) && bad++ < 8)
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", expected " << want[i] << " (error "
                    << err << ")";
  }
  EXPECT_EQ(bad, 0u) << what << ": elements out of tolerance";
}

// SPEC §9's output budget: rms(got − want) / rms(want) <= 1e-3. The fast CPU paths may compute
// attention in integers within it (the fp32 ones sit near 1e-6).
inline void expect_within_output_budget(const std::vector<float> &got, const std::vector<double> &want,
                                        const std::string &what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double error = 0.0, size = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    error += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    size += want[i] * want[i];
  }
  EXPECT_LE(std::sqrt(error / size), 1e-3) << what << ": rms error relative to the rms output";
}

inline double max_abs(const std::vector<float> &x) {
  double m = 0.0;
  for (float v : x) m = std::max(m, double(std::abs(v)));
  return m;
}

// Everything a failed call must leave unchanged: lengths, statistics, and the scores of a fixed
// query against every listed (layer, seq).
struct Snapshot {
  std::vector<uint64_t> lengths;
  std::vector<uint64_t> stat_fields;
  std::vector<std::vector<float>> scores;
};

inline void take_snapshot(qjlkv_cache *c, const std::vector<std::pair<uint32_t, uint32_t>> &layer_seqs,
                          const std::vector<uint8_t> &query, Snapshot *out) {
  *out = Snapshot{};
  for (auto [layer, seq] : layer_seqs) {
    uint64_t len = 0;
    QT_ASSERT_OK(qjlkv_cache_length(c, layer, seq, &len));
    out->lengths.push_back(len);
    std::vector<float> s;
    if (len > 0) {
      ASSERT_NO_FATAL_FAILURE(library_scores(c, layer, seq, query, &s));
    }
    out->scores.push_back(std::move(s));
  }
  const qjlkv_stats st = stats_of(c);
  out->stat_fields = {st.tokens,
                      st.bytes_used,
                      st.bytes_reserved,
                      st.bytes_fp16_equivalent,
                      st.bytes_keys_quantized,
                      st.bytes_values_quantized,
                      st.bytes_full_precision,
                      st.bytes_metadata};
}

inline void expect_same_snapshot(const Snapshot &before, const Snapshot &after, const std::string &what) {
  EXPECT_EQ(before.lengths, after.lengths) << what << ": lengths changed";
  EXPECT_EQ(before.stat_fields, after.stat_fields) << what << ": statistics changed";
  ASSERT_EQ(before.scores.size(), after.scores.size());
  for (size_t i = 0; i < before.scores.size(); ++i) {
    const std::vector<float> &a = before.scores[i], &b = after.scores[i];
    // Bitwise (NaN and -0 included); memcmp of empty vectors' null data() would be undefined.
    EXPECT_TRUE(a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0))
        << what << ": scores of stream " << i << " changed";
  }
}

}  // namespace qt
