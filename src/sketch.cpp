#include "sketch.hpp"

#include <algorithm>
#include <cmath>
#include <math.h>  // lgamma_r (POSIX)
#include <numbers>

namespace qjlkv {

void Philox4x32::operator()(const uint32_t counter[4], uint32_t out[4]) const {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(kMul0) * c0, p1 = uint64_t(kMul1) * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c0 = n0;
    c1 = uint32_t(p1);
    c2 = n2;
    c3 = uint32_t(p0);
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

double gaussian_entry(uint64_t seed, uint32_t stream, uint64_t index) {
  // One Philox call yields two uniforms, hence two normals (cos and sin branch of Box-Muller).
  const uint64_t pair = index >> 1;
  const Philox4x32 philox{{uint32_t(seed), uint32_t(seed >> 32)}};
  const uint32_t counter[4] = {uint32_t(pair), uint32_t(pair >> 32), stream, 0x514A4Cu /* "QJL" */};
  uint32_t r[4];
  philox(counter, r);
  const auto uniform53 = [](uint32_t hi, uint32_t lo) {
    return double((uint64_t(hi) << 21) ^ (lo >> 11)) * 0x1p-53;  // [0, 1)
  };
  const double u1 = 1.0 - uniform53(r[0], r[1]);  // (0, 1]: log is finite
  const double u2 = uniform53(r[2], r[3]);
  const double radius = std::sqrt(-2.0 * std::log(u1));
  const double angle = 2.0 * std::numbers::pi * u2;
  return (index & 1) ? radius * std::sin(angle) : radius * std::cos(angle);
}

double qjl_constant(uint32_t head_dim, bool orthogonal) {
  if (!orthogonal) return std::sqrt(std::numbers::pi / 2.0);
  const double d = head_dim;
  // lgamma_r, not std::lgamma: lgamma writes the global signgam, a data race when threads create
  // caches at once (ThreadSanitizer found it); both return the same value.
  int sign = 0;
  return std::sqrt(std::numbers::pi) * std::exp(lgamma_r((d + 1.0) / 2.0, &sign) - lgamma_r(d / 2.0, &sign)) /
         std::sqrt(d);
}

namespace {

// Orthonormalizes the r rows of `block` (r x d, row-major, r <= d) in float64: Householder QR of
// the d x r matrix A = blockᵀ, then block = Qᵀ with column signs fixed so that diag(R) > 0.
void orthonormalize_rows(std::vector<double> &block, uint32_t r, uint32_t d) {
  // a(i, j) = A[i][j] = block[j][i]; the Householder vectors are stored in place below the diagonal.
  auto a = [&](uint32_t i, uint32_t j) -> double & { return block[size_t(j) * d + i]; };
  std::vector<double> beta(r), diag_sign(r);
  for (uint32_t k = 0; k < r; ++k) {
    double norm2 = 0.0;
    for (uint32_t i = k; i < d; ++i) norm2 += a(i, k) * a(i, k);
    const double norm = std::sqrt(norm2);
    const double alpha = a(k, k) >= 0.0 ? -norm : norm;  // R[k][k] = alpha, sign chosen for stability
    const double v0 = a(k, k) - alpha;
    const double vnorm2 = norm2 - a(k, k) * a(k, k) + v0 * v0;
    a(k, k) = v0;
    beta[k] = vnorm2 > 0.0 ? 2.0 / vnorm2 : 0.0;
    diag_sign[k] = alpha >= 0.0 ? 1.0 : -1.0;
    for (uint32_t j = k + 1; j < r; ++j) {
      double dot = 0.0;
      for (uint32_t i = k; i < d; ++i) dot += a(i, k) * a(i, j);
      const double f = beta[k] * dot;
      for (uint32_t i = k; i < d; ++i) a(i, j) -= f * a(i, k);
    }
  }
  // Q = H_0 H_1 ... H_{r-1} applied to the first r columns of the identity.
  std::vector<double> q(size_t(d) * r, 0.0);  // column-major d x r
  for (uint32_t j = 0; j < r; ++j) q[size_t(j) * d + j] = 1.0;
  for (uint32_t k = r; k-- > 0;) {
    for (uint32_t j = 0; j < r; ++j) {
      double *col = &q[size_t(j) * d];
      double dot = 0.0;
      for (uint32_t i = k; i < d; ++i) dot += a(i, k) * col[i];
      const double f = beta[k] * dot;
      for (uint32_t i = k; i < d; ++i) col[i] -= f * a(i, k);
    }
  }
  // Row j of the block = column j of Q, flipped where R[j][j] < 0 so that diag(R) > 0.
  for (uint32_t j = 0; j < r; ++j)
    for (uint32_t i = 0; i < d; ++i) block[size_t(j) * d + i] = diag_sign[j] * q[size_t(j) * d + i];
}

}  // namespace

SketchMatrix make_sketch(uint32_t head_dim, uint32_t sketch_dim, uint64_t seed, uint32_t stream,
                         bool orthogonal) {
  SketchMatrix s;
  s.rows = sketch_dim;
  s.cols = head_dim;
  s.orthogonal = orthogonal;
  s.data.resize(size_t(sketch_dim) * head_dim);
  const double row_norm = std::sqrt(double(head_dim));
  std::vector<double> block;
  for (uint32_t first = 0; first < sketch_dim; first += head_dim) {
    const uint32_t r = std::min(head_dim, sketch_dim - first);
    block.resize(size_t(r) * head_dim);
    for (size_t e = 0; e < block.size(); ++e)
      block[e] = gaussian_entry(seed, stream, size_t(first) * head_dim + e);
    if (orthogonal) {
      orthonormalize_rows(block, r, head_dim);
      for (double &x : block) x *= row_norm;
    }
    std::transform(block.begin(), block.end(), s.data.begin() + ptrdiff_t(size_t(first) * head_dim),
                   [](double x) { return float(x); });
  }
  return s;
}

}  // namespace qjlkv
