// A C++ engine's use of the installed C header: RAII handles, std::vector buffers, and the
// header compiled as C++ under -Wall -Wextra -Werror -pedantic. On 100 random tokens
// (2 layers, 8 query heads, 2 kv heads, d 64) each query head asks for one cached token (its
// query is twice that token's key); the "qjl" cache must return that token's value up to
// quantization, like the "exact" cache does.
#include <qjlkv/qjlkv.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

namespace {

constexpr uint32_t kLayers = 2, kQHeads = 8, kKvHeads = 2, kHeadDim = 64, kTokens = 100;
constexpr double kTolerance = 0.6;  // relative L2 distance between the qjl and exact outputs

struct CacheDeleter {
  void operator()(qjlkv_cache *cache) const { qjlkv_cache_destroy(cache); }
};
using Cache = std::unique_ptr<qjlkv_cache, CacheDeleter>;

void require_ok(qjlkv_status status, const char *what) {
  if (status != QJLKV_OK) {
    std::fprintf(stderr, "%s returned %s: %s\n", what, qjlkv_status_string(status),
                 qjlkv_last_error_message());
    std::exit(1);
  }
}

Cache make_cache(const char *preset) {
  qjlkv_config cfg{};
  cfg.struct_size = sizeof cfg;
  require_ok(qjlkv_config_init(&cfg, preset, kLayers, kQHeads, kKvHeads, kHeadDim), "qjlkv_config_init");
  qjlkv_cache *raw = nullptr;
  require_ok(qjlkv_cache_create(&cfg, &raw), "qjlkv_cache_create");
  return Cache(raw);
}

size_t kv_offset(uint32_t token, uint32_t kv_head) { return (size_t{token} * kKvHeads + kv_head) * kHeadDim; }

// The cached token whose value is nearest to head h's output.
uint32_t nearest_token(const std::vector<float> &values, const std::vector<float> &out, uint32_t head) {
  const uint32_t kv_head = head / (kQHeads / kKvHeads);
  uint32_t best = 0;
  double best_distance = INFINITY;
  for (uint32_t t = 0; t < kTokens; ++t) {
    double distance = 0.0;
    for (uint32_t i = 0; i < kHeadDim; ++i) {
      const double diff = double(out[head * kHeadDim + i]) - values[kv_offset(t, kv_head) + i];
      distance += diff * diff;
    }
    if (distance < best_distance) best_distance = distance, best = t;
  }
  return best;
}

}  // namespace

int main() {
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  auto random_vector = [&](size_t n) {
    std::vector<float> v(n);
    for (float &x : v) x = normal(rng);
    return v;
  };

  Cache qjl = make_cache("qjl"), exact = make_cache("exact");
  int failures = 0;
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    const std::vector<float> keys = random_vector(size_t{kTokens} * kKvHeads * kHeadDim);
    const std::vector<float> values = random_vector(keys.size());
    std::vector<float> query(size_t{kQHeads} * kHeadDim);
    std::vector<uint32_t> wanted(kQHeads);
    for (uint32_t h = 0; h < kQHeads; ++h) {
      wanted[h] = (h * 29 + layer * 11 + 5) % kTokens;
      for (uint32_t i = 0; i < kHeadDim; ++i)
        query[h * kHeadDim + i] = 2.0f * keys[kv_offset(wanted[h], h / (kQHeads / kKvHeads)) + i];
    }
    std::vector<float> out_qjl(query.size()), out_exact(query.size());
    for (qjlkv_cache *cache : {qjl.get(), exact.get()}) {
      require_ok(qjlkv_cache_append(cache, layer, 0, kTokens, keys.data(), values.data()), "qjlkv_cache_append");
    }
    require_ok(qjlkv_cache_attend(qjl.get(), layer, 0, 1, query.data(), 0.0f, out_qjl.data()), "qjlkv_cache_attend");
    require_ok(qjlkv_cache_attend(exact.get(), layer, 0, 1, query.data(), 0.0f, out_exact.data()), "qjlkv_cache_attend");

    double diff = 0.0, norm = 0.0;
    bool finite = true;
    for (size_t i = 0; i < query.size(); ++i) {
      finite = finite && std::isfinite(out_qjl[i]) && std::isfinite(out_exact[i]);
      diff += (double(out_qjl[i]) - out_exact[i]) * (double(out_qjl[i]) - out_exact[i]);
      norm += double(out_exact[i]) * out_exact[i];
    }
    const double relative = std::sqrt(diff / norm);
    std::printf("  layer %u: qjl vs exact relative error %.4f\n", layer, relative);
    if (!finite || !(relative < kTolerance)) {
      std::fprintf(stderr, "layer %u: finite=%d, relative error %g (limit %g)\n", layer, finite, relative, kTolerance);
      ++failures;
    }
    for (uint32_t h = 0; h < kQHeads; ++h) {
      for (const auto *out : {&out_qjl, &out_exact}) {
        const uint32_t got = nearest_token(values, *out, h);
        if (got != wanted[h]) {
          std::fprintf(stderr, "layer %u head %u (%s): returned token %u, asked for %u\n", layer, h,
                       out == &out_qjl ? "qjl" : "exact", got, wanted[h]);
          ++failures;
        }
      }
    }
  }
  std::printf("qjlkv %s (C++ consumer): %s\n", qjlkv_version_string(), failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
