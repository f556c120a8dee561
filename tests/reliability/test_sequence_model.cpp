// Model-based test of the sequence operations: random interleavings of append, append_batch,
// attend, fork, truncate, clear, export and import over several sequences, each checked against a
// simple model of what every sequence holds (its tokens, its rollback floor). A sequence whose
// history stayed exact must export exactly what a fresh cache fed its tokens exports; every
// refusal must leave every export as it was. Runs under ASan+UBSan and TSan with the rest of the
// reliability suite.
#include <map>
#include <optional>

#include "testing.hpp"

namespace {

constexpr uint32_t kLayers = 2, kHq = 4, kHkv = 2, kD = 32, kSeqs = 6;

struct Model {
  std::vector<uint8_t> keys, values;  // every token fed, [n][Hkv][d], cache dtype
  uint64_t floor = 0;                 // qjlkv.h, "Sequence operations"
  bool exact = true;                  // no truncate ever went below the floor
};

class Harness {
 public:
  Harness(const char *preset, qjlkv_dtype dtype, uint64_t seed) : rng_(seed) {
    cfg_ = qt::make_config(preset, kLayers, kHq, kHkv, kD);
    cfg_.dtype = dtype;
    cfg_.outlier_skip_layers = std::min(cfg_.outlier_skip_layers, 1u);  // OTT: layer 1 traced
    cfg_.num_threads = 2;  // TSan sees the workers too
    token_bytes_ = size_t(kHkv) * kD * qt::dtype_bytes(dtype);
    cache_ = qt::make_cache(cfg_);
  }

  void step() {
    switch (rng_.below(10)) {
      case 0: case 1: case 2: append(); break;
      case 3: append_batch(); break;
      case 4: truncate(); break;
      case 5: fork(); break;
      case 6: clear(); break;
      case 7: roundtrip(); break;
      case 8: attend(); break;
      default: refuse(); break;
    }
    check_lengths();
  }

  // Every exact sequence exports what a fresh cache fed its tokens exports.
  void check_exports() {
    for (uint32_t s = 0; s < kSeqs; ++s) {
      const Model &m = models_[s];
      if (!m.exact || m.keys.empty()) continue;
      qt::Cache fresh = qt::make_cache(cfg_);
      const uint32_t n = uint32_t(m.keys.size() / token_bytes_);
      for (uint32_t l = 0; l < kLayers; ++l)
        QT_ASSERT_OK(qjlkv_cache_append(fresh.get(), l, s, n, m.keys.data(), m.values.data()));
      ASSERT_EQ(exported(cache_.get(), s), exported(fresh.get(), s)) << "seq " << s << " after " << ops_ << " ops";
    }
    // bytes_used agrees with a full count (stats checks it) and with what the sequences hold.
    const qjlkv_stats st = qt::stats_of(cache_.get());
    uint64_t unshared = 0;
    for (uint32_t s = 0; s < kSeqs; ++s) {
      uint64_t held = 0, shared = 0;
      QT_ASSERT_OK(qjlkv_cache_sequence_bytes(cache_.get(), s, &held, &shared));
      EXPECT_LE(shared, held);
      unshared += held - shared;
    }
    EXPECT_LE(unshared, st.bytes_used);
    EXPECT_LE(st.bytes_shared, st.bytes_used);
  }

  uint64_t ops() const { return ops_; }

 private:
  uint64_t length(uint32_t s) const { return models_[s].keys.size() / token_bytes_; }
  uint32_t any_seq() { return rng_.below(kSeqs); }
  std::optional<uint32_t> seq_where(bool holding) {
    for (uint32_t tries = 0; tries < 16; ++tries) {
      const uint32_t s = any_seq();
      if ((length(s) > 0) == holding) return s;
    }
    return std::nullopt;
  }
  std::vector<uint8_t> tokens(size_t n) {
    return qt::encode(rng_.normals(n * kHkv * kD), qt::dtype_of(cfg_));
  }
  void record_append(Model &m, const uint8_t *k, const uint8_t *v, size_t n) {
    m.keys.insert(m.keys.end(), k, k + n * token_bytes_);
    m.values.insert(m.values.end(), v, v + n * token_bytes_);
    const uint64_t len = m.keys.size() / token_bytes_;
    m.floor = std::max(m.floor, len > cfg_.rollback_tokens ? len - cfg_.rollback_tokens : 0);
  }
  void keep(Model &m, uint64_t n) {
    if (n < m.floor) {
      m.exact = false;
      m.floor = n;
    }
    m.keys.resize(n * token_bytes_);
    m.values.resize(m.keys.size());
    if (n == 0) m = Model{};
  }

  void append() {
    ++ops_;
    const uint32_t s = any_seq(), B = cfg_.block_tokens, R = cfg_.residual_tokens;
    const uint32_t sizes[] = {1, 1, 1, 2, 3, B - 1, B, R + B, 2 * B + 5};
    const uint32_t n = sizes[rng_.below(9)];
    const std::vector<uint8_t> k = tokens(n), v = tokens(n);
    for (uint32_t l = 0; l < kLayers; ++l) QT_ASSERT_OK(qjlkv_cache_append(cache_.get(), l, s, n, k.data(), v.data()));
    record_append(models_[s], k.data(), v.data(), n);
  }
  void append_batch() {
    ++ops_;
    std::vector<uint32_t> ids;
    for (uint32_t s = 0; s < kSeqs; ++s)
      if (rng_.below(2)) ids.push_back(s);
    if (ids.empty()) return;
    const std::vector<uint8_t> k = tokens(ids.size()), v = tokens(ids.size());
    for (uint32_t l = 0; l < kLayers; ++l)
      QT_ASSERT_OK(qjlkv_cache_append_batch(cache_.get(), l, uint32_t(ids.size()), ids.data(), k.data(), v.data()));
    for (size_t i = 0; i < ids.size(); ++i)
      record_append(models_[ids[i]], k.data() + i * token_bytes_, v.data() + i * token_bytes_, 1);
  }
  void truncate() {
    ++ops_;
    const auto s = seq_where(true);
    if (!s) return;
    Model &m = models_[*s];
    const uint64_t len = length(*s);
    // Mostly within the floor, as speculative decoding does; sometimes deeper.
    const uint64_t lowest = rng_.below(5) == 0 ? 0 : m.floor;
    const uint64_t n = lowest + rng_.below(uint32_t(len - lowest + 1));
    QT_ASSERT_OK(qjlkv_cache_truncate(cache_.get(), *s, n));
    keep(m, n);
  }
  void fork() {
    ++ops_;
    const auto src = seq_where(true), dst = seq_where(false);
    if (!src || !dst) return;
    const uint64_t len = length(*src);
    const uint64_t n = rng_.below(2) ? len : rng_.below(uint32_t(len + 1));
    QT_ASSERT_OK(qjlkv_cache_fork(cache_.get(), *src, *dst, n));
    models_[*dst] = models_[*src];
    keep(models_[*dst], n);
  }
  void clear() {
    ++ops_;
    const uint32_t s = any_seq();
    QT_ASSERT_OK(qjlkv_cache_clear_sequence(cache_.get(), s));
    models_[s] = Model{};
  }
  // Export, clear, import into an empty id: the stream carries no rollback copies, so the floor
  // becomes the length.
  void roundtrip() {
    ++ops_;
    const auto src = seq_where(true), dst = seq_where(false);
    if (!src || !dst) return;
    const std::vector<uint8_t> stream = exported(cache_.get(), *src);
    QT_ASSERT_OK(qjlkv_cache_clear_sequence(cache_.get(), *src));
    QT_ASSERT_OK(qjlkv_cache_import(cache_.get(), *dst, stream.data(), stream.size()));
    models_[*dst] = models_[*src];
    models_[*dst].floor = length(*dst);
    models_[*src] = Model{};
  }
  void attend() {
    ++ops_;
    const auto s = seq_where(true);
    if (!s) return;
    const std::vector<uint8_t> q = qt::encode(rng_.normals(size_t(kHq) * kD), qt::dtype_of(cfg_));
    std::vector<uint8_t> out(q.size());
    for (uint32_t l = 0; l < kLayers; ++l) {
      QT_ASSERT_OK(qjlkv_cache_attend(cache_.get(), l, *s, 1, q.data(), 0.0f, out.data()));
      for (float x : qt::decode(out.data(), size_t(kHq) * kD, qt::dtype_of(cfg_))) ASSERT_TRUE(std::isfinite(x));
    }
  }
  // Calls that must fail and change nothing.
  void refuse() {
    ++ops_;
    std::vector<std::vector<uint8_t>> before;
    for (uint32_t s = 0; s < kSeqs; ++s) before.push_back(length(s) ? exported(cache_.get(), s) : std::vector<uint8_t>{});
    const uint64_t used = qt::stats_of(cache_.get()).bytes_used;
    const auto full = seq_where(true), empty = seq_where(false);
    if (full) {
      EXPECT_EQ(qjlkv_cache_truncate(cache_.get(), *full, length(*full) + 1), QJLKV_ERROR_INVALID_ARGUMENT);
      EXPECT_EQ(qjlkv_cache_fork(cache_.get(), *full, *full, 1), QJLKV_ERROR_INVALID_ARGUMENT);
      if (empty) {
        EXPECT_EQ(qjlkv_cache_fork(cache_.get(), *full, *empty, length(*full) + 1), QJLKV_ERROR_INVALID_ARGUMENT);
      }
      const auto other = seq_where(true);
      if (other && *other != *full) {
        EXPECT_EQ(qjlkv_cache_fork(cache_.get(), *full, *other, 1), QJLKV_ERROR_INVALID_ARGUMENT);
      }
      const std::vector<uint8_t> stream = exported(cache_.get(), *full);
      EXPECT_EQ(qjlkv_cache_import(cache_.get(), *full, stream.data(), stream.size()), QJLKV_ERROR_INVALID_ARGUMENT);
    }
    for (uint32_t s = 0; s < kSeqs; ++s) {
      if (length(s) == 0) continue;
      EXPECT_EQ(exported(cache_.get(), s), before[s]) << "a refused call changed seq " << s;
    }
    EXPECT_EQ(qt::stats_of(cache_.get()).bytes_used, used);
  }

  void check_lengths() {
    for (uint32_t s = 0; s < kSeqs; ++s)
      for (uint32_t l = 0; l < kLayers; ++l) ASSERT_EQ(qt::length_of(cache_.get(), l, s), length(s)) << "seq " << s;
  }

  static std::vector<uint8_t> exported(const qjlkv_cache *c, uint32_t seq) { return qt::exported(c, seq, kLayers); }

  qjlkv_config cfg_;
  size_t token_bytes_ = 0;
  qt::Rng rng_;
  qt::Cache cache_;
  Model models_[kSeqs];
  uint64_t ops_ = 0;
};

using Case = std::tuple<const char *, qjlkv_dtype>;
class SequenceModel : public ::testing::TestWithParam<Case> {};

TEST_P(SequenceModel, RandomInterleavingsMatchTheModel) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    Harness h(std::get<0>(GetParam()), std::get<1>(GetParam()), seed);
    for (int i = 0; i < 400; ++i) {
      ASSERT_NO_FATAL_FAILURE(h.step());
      if (i % 15 == 14) {
        ASSERT_NO_FATAL_FAILURE(h.check_exports());
      }
    }
    ASSERT_NO_FATAL_FAILURE(h.check_exports());
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, SequenceModel,
                         ::testing::Values(Case{"q2", QJLKV_DTYPE_BF16}, Case{"q3", QJLKV_DTYPE_F16}, Case{"q4", QJLKV_DTYPE_BF16},
                                           Case{"qjl", QJLKV_DTYPE_F16}, Case{"kivi", QJLKV_DTYPE_F32},
                                           Case{"ott", QJLKV_DTYPE_F16}, Case{"exact", QJLKV_DTYPE_F16}),
                         [](const auto &info) {
                           return std::string(std::get<0>(info.param)) + "_" + qt::dtype_name(std::get<1>(info.param));
                         });

}  // namespace
