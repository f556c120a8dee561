// Fuzz harness 2: random sequences of API calls on a small cache, checked against a model of
// what the cache holds.
//
// Bytes choose a config (any preset, dtype, shape, block/residual sizes, bits, threads), then a
// program of calls: append (lengths 0, 1, block-sized, UINT32_MAX; data of any magnitude, with
// NaN/Inf or out-of-fp16-range numbers), append_batch (duplicate ids too), attend (n_queries 0
// up to length + 1; NaN/Inf/negative scales), attend_batch, scores, clear, truncate and fork
// (lengths 0 up to length + 1, a fork into itself or a sequence that holds tokens), and
// set_layer_attention (soft-caps from tiny to large, negative, NaN or infinite; sink logits of
// any magnitude, some not finite; wrong struct_size or reserved), on valid and invalid layers and
// sequences. After every call:
//   - the status is the one the header prescribes (OK, or INVALID_ARGUMENT for the bad input),
//     a failure names its argument and leaves lengths and statistics unchanged;
//   - lengths equal the model's; stats: tokens = sum of lengths, bytes_used = the sum of its
//     components <= bytes_reserved, fp16 equivalent and bits per number as documented, the
//     full-precision tails exactly as the tail rule gives (all presets but OTT), and nothing
//     used or reserved once every sequence is cleared;
//   - attention outputs are finite and, per channel, within the range of the values they
//     average (quantized values stay within their group's range up to fp16 rounding); for the
//     "exact" preset they equal a float64 softmax reference on the 16-bit stored keys and
//     values within a bound derived from fp32 rounding, with the layer's soft-cap and sinks as
//     the model holds them (a refused variant leaves the layer's as it was; sinks let the
//     output shrink toward 0);
//   - scores are finite (OTT: -inf marks a token moved to the pool); for "exact" they equal the
//     reference products;
//   - reconstructions write only their outputs, are finite, keep values within their group's
//     range (exact where stored exact), and their keys reproduce the scores.
#include <qjlkv/qjlkv.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "fuzz_input.hpp"
#include "half.hpp"

namespace {

using qjlkv_fuzz::Input;
using qjlkv_fuzz::names;

constexpr float kHalfMax = 65504.0f;
constexpr double kEps32 = 0x1p-24;

// ---- tensors in the cache's dtype --------------------------------------------------------------
struct Tensor {
  std::vector<uint8_t> bytes;
  std::vector<float> values;  // what the library reads
  bool finite = true;
  float max_abs = 0.0f;       // of the finite elements
};

float decode_one(const uint8_t *p, qjlkv_dtype t) {
  if (t == QJLKV_DTYPE_F32) {
    float x;
    std::memcpy(&x, p, 4);
    return x;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t == QJLKV_DTYPE_F16 ? qjlkv::half_to_float(h) : qjlkv::bf16_to_float(h);
}

void encode_one(float x, qjlkv_dtype t, uint8_t *p) {
  if (t == QJLKV_DTYPE_F32) {
    std::memcpy(p, &x, 4);
    return;
  }
  const uint16_t h = t == QJLKV_DTYPE_F16 ? qjlkv::float_to_half(x) : qjlkv::float_to_bf16(x);
  std::memcpy(p, &h, 2);
}

// n elements: a PRNG stream of a fuzzed shape and magnitude (zero, constant, tiny, ordinary,
// near and beyond the fp16 limit), optionally with one poisoned element.
Tensor make_tensor(Input &in, size_t n, qjlkv_dtype t, bool allow_huge) {
  static const float kMagnitudes[] = {0.0f, 1e-3f, 1.0f, 1.0f, 4.0f, 8.0f, 100.0f, 3000.0f};
  const uint8_t shape = in.byte();
  float magnitude = in.pick(kMagnitudes);
  if (allow_huge && shape % 16 == 15) magnitude = 1e5f;  // beyond fp16 for most elements
  const bool constant = shape % 8 == 7;
  std::mt19937 rng(in.u32());
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  const size_t io = t == QJLKV_DTYPE_F32 ? 4 : 2;
  Tensor out;
  out.bytes.resize(n * io);
  out.values.resize(n);
  const float first = magnitude * unit(rng);
  for (size_t i = 0; i < n; ++i) encode_one(constant ? first : magnitude * unit(rng), t, &out.bytes[i * io]);
  const uint8_t poison = in.byte();
  if (n > 0 && poison % 8 == 0) {
    static const float kPoisons[] = {NAN, INFINITY, -INFINITY, 65520.0f, -70000.0f, 3e38f};
    encode_one(kPoisons[(poison / 8) % 6], t, &out.bytes[(in.u16() % n) * io]);
  }
  FUZZ_TRACE("  tensor of %zu: magnitude %g%s%s\n", n, double(magnitude), constant ? ", constant" : "",
             n > 0 && poison % 8 == 0 ? ", poisoned" : "");
  for (size_t i = 0; i < n; ++i) {
    const float x = decode_one(&out.bytes[i * io], t);
    out.values[i] = x;
    out.finite = out.finite && std::isfinite(x);
    if (std::isfinite(x)) out.max_abs = std::max(out.max_abs, std::fabs(x));
  }
  return out;
}

// ---- the model --------------------------------------------------------------------------------
struct Stream {
  std::vector<float> keys, values;  // [tokens][Hkv][d], as the library read them
};

// A layer's attention variant (qjlkv_cache_set_layer_attention) as the library accepted it.
struct Variant {
  float softcap = 0.0f;       // > 0: logits s become softcap·tanh(s / softcap)
  std::vector<float> sinks;   // empty, or one logit per query head
};

class Harness {
 public:
  Harness(Input &in) : in_(in) {}
  ~Harness() { qjlkv_cache_destroy(cache_); }

  bool setup();
  void step();

 private:
  uint32_t tokens_of(const Stream &s) const { return uint32_t(s.keys.size() / token_elems_); }
  uint64_t model_length(uint32_t layer, uint32_t seq) const {
    const auto it = streams_.find({layer, seq});
    return it == streams_.end() ? 0 : tokens_of(it->second);
  }
  // Positions held in quantized blocks: [S, S + quantized_count(length)), S = sink_tokens.
  uint64_t quantized_count(uint64_t length) const {
    const uint32_t B = cfg_.block_tokens, R = cfg_.residual_tokens, S = cfg_.sink_tokens;
    const uint64_t after_sinks = length > S ? length - S : 0;
    return after_sinks < uint64_t(R) + B ? 0 : (after_sinks - R) / B * B;
  }
  bool quantized_at(uint64_t length, uint64_t t) const {
    return t >= cfg_.sink_tokens && t - cfg_.sink_tokens < quantized_count(length);
  }
  bool rotated_values() const { return cfg_.value_method == QJLKV_VALUES_ROTATED_LLOYD_MAX; }
  // The top code of b-bit values (0 for 16-bit values).
  uint32_t value_levels() const { return cfg_.value_bits == 16 ? 0 : (1u << cfg_.value_bits) - 1; }
  float stored16(float x) const {
    return cfg_.dtype == QJLKV_DTYPE_BF16 ? qjlkv::bf16_to_float(qjlkv::float_to_bf16(x))
                                          : qjlkv::half_to_float(qjlkv::float_to_half(x));
  }
  uint32_t pick_layer() { return in_.byte() % 16 == 15 ? cfg_.num_layers + in_.byte() % 2 * 1000 : in_.byte() % cfg_.num_layers; }
  uint32_t pick_seq() {
    static const uint32_t kSeqs[] = {0, 1, 2, 3, 0, 1, 0xffffffffu};
    return in_.pick(kSeqs);
  }
  // Adds "keys" and/or "values" when appending them must be refused.
  void bad_data(const Tensor &k, const Tensor &v, std::vector<const char *> &wrong) const;
  std::string snapshot() const;
  // A call with wrong arguments (any of `wrong`: the library may report whichever it checks
  // first) must fail, name one of them, and change nothing.
  void expect_failure(qjlkv_status s, const std::string &before, const char *what,
                      const std::vector<const char *> &wrong);
  void check_state();
  // Whether every partial sum of the logit of query head h at position t stays within fp32:
  // |estimate| <= sqrt(d)·|q|·|k| (QJL's c_d < 2), and QJL's sign sums of S·q. Beyond, a logit
  // is +-inf, or NaN and refused.
  bool logit_representable(const Stream &stream, const std::vector<float> &q, uint32_t h, uint64_t t) const;
  bool logits_representable(const Stream &stream, const std::vector<float> &q, uint64_t length) const;
  // QJL: the most sketch rows (key and outlier sketches) a score sums over.
  double sketch_rows() const {
    return double(std::max(cfg_.key_sketch_dim, cfg_.initial_key_sketch_dim)) +
           double(std::max(cfg_.outlier_sketch_dim, cfg_.initial_outlier_sketch_dim));
  }
  bool logits_may_overflow(uint32_t layer, const std::vector<uint32_t> &seqs, const std::vector<float> &queries,
                           float scale) const;
  void check_output(uint32_t layer, uint32_t seq, uint32_t n_queries, const std::vector<float> &queries, float scale,
                    const uint8_t *out);

  void do_append();
  void do_append_batch();
  void do_attend(bool batch);
  void do_scores();
  void do_reconstruct();
  void do_clear();
  void do_set_attention();
  void do_truncate();
  void do_fork();
  uint64_t longest(uint32_t seq) const {
    uint64_t n = 0;
    for (uint32_t l = 0; l < cfg_.num_layers; ++l) n = std::max(n, model_length(l, seq));
    return n;
  }
  uint64_t pick_length(uint64_t longest) {
    const uint64_t kLengths[] = {0, 1, longest / 2, longest > 0 ? longest - 1 : 0, longest, longest, longest + 1,
                                 in_.byte()};
    return in_.pick(kLengths);
  }
  // After a truncate or fork: the model keeps the first `length` tokens of every layer, and takes
  // the rows the library now keeps exact (the tail, which a truncate below the rollback floor
  // fills with reconstructions) from qjlkv_cache_reconstruct.
  void keep_prefix(uint32_t seq, uint64_t length);

  Input &in_;
  qjlkv_config cfg_{};
  qjlkv_cache *cache_ = nullptr;
  size_t io_ = 4, token_elems_ = 0, query_elems_ = 0;
  std::map<std::pair<uint32_t, uint32_t>, Stream> streams_;  // (layer, seq); absent = empty
  std::vector<Variant> variants_;                            // per layer
};

bool Harness::setup() {
  static const char *const kPresets[] = {"qjl", "kivi", "ott", "exact", "q3", "q4", "q2"};
  static const qjlkv_dtype kDtypes[] = {QJLKV_DTYPE_F32, QJLKV_DTYPE_F16, QJLKV_DTYPE_BF16};
  static const uint32_t kDims[] = {8, 16, 32};
  const char *preset = in_.pick(kPresets);
  const uint32_t layers = 1 + in_.byte() % 2, hkv = 1 + in_.byte() % 2, group = 1 + in_.byte() % 3;
  const uint32_t d = in_.pick(kDims);
  cfg_.struct_size = sizeof cfg_;
  if (qjlkv_config_init(&cfg_, preset, layers, hkv * group, hkv, d) != QJLKV_OK) return false;
  cfg_.dtype = in_.pick(kDtypes);
  cfg_.block_tokens = 8 * (1 + in_.byte() % 2);
  cfg_.residual_tokens = in_.byte() % 13;
  cfg_.num_threads = in_.byte() % 4 == 3 ? 2 : 1;
  cfg_.seed = in_.u16();
  if (cfg_.key_method != QJLKV_KEYS_EXACT) {
    static const uint32_t kBits[] = {2, 3, 4, 8};
    static const uint32_t kValueBits[] = {2, 3, 4, 8, 16};
    cfg_.key_bits = in_.pick(kBits);
    cfg_.value_bits = in_.pick(kValueBits);
    cfg_.value_group_size = in_.flag() ? 8 : d;
    cfg_.value_method = QJLKV_VALUES_UNIFORM;
    if (in_.byte() % 4 == 3) {
      cfg_.value_method = QJLKV_VALUES_ROTATED_LLOYD_MAX;
      cfg_.value_bits = 2 + in_.byte() % 3;
    }
  }
  cfg_.sink_tokens = in_.byte() % 4 == 3 ? 1 + in_.byte() % 5 : 0;
  if (cfg_.key_method == QJLKV_KEYS_QJL) {
    static const uint32_t kSketch[] = {8, 16, 32, 64};
    cfg_.key_sketch_dim = in_.pick(kSketch);
    cfg_.outlier_channels = std::min(d - 1, uint32_t(in_.byte() % 4 == 0 ? 0 : 1 + in_.byte() % 8));
    cfg_.outlier_sketch_dim = cfg_.outlier_channels ? in_.pick(kSketch) : 0;
    cfg_.initial_layers = in_.byte() % (layers + 1);
    cfg_.initial_key_sketch_dim = in_.pick(kSketch);
    cfg_.initial_outlier_sketch_dim = cfg_.outlier_channels ? in_.pick(kSketch) : 0;
  }
  if (cfg_.key_method == QJLKV_KEYS_MIXED)  // a multiple of 8 in [8, 4d]
    cfg_.key_token_bits = in_.flag() ? cfg_.key_token_bits : 8 * (1 + in_.byte() % (d / 2));
  if (cfg_.key_method == QJLKV_KEYS_OTT) {
    cfg_.outlier_tokens = in_.byte() % 4;
    cfg_.outlier_spill_tokens = in_.byte() % 5;
    cfg_.outlier_skip_layers = in_.byte() % (layers + 1);
  }
  FUZZ_CHECK(qjlkv_config_validate(&cfg_) == QJLKV_OK, "harness config does not validate");
  const qjlkv_status s = qjlkv_cache_create(&cfg_, &cache_);
  FUZZ_CHECK(s == QJLKV_OK, "create: %s", qjlkv_status_string(s));
  FUZZ_TRACE("config: key_method %d, dtype %d, layers %u, Hq %u, Hkv %u, d %u, B %u, R %u, threads %u, key_bits %u, "
             "value_bits %u, group %u, m %u, c %u, m_out %u, initial %u (%u, %u), P %u, spill %u, skip %u, "
             "key_token_bits %u\n",
             int(cfg_.key_method), int(cfg_.dtype), cfg_.num_layers, cfg_.num_q_heads, cfg_.num_kv_heads,
             cfg_.head_dim, cfg_.block_tokens, cfg_.residual_tokens, cfg_.num_threads, cfg_.key_bits, cfg_.value_bits,
             cfg_.value_group_size, cfg_.key_sketch_dim, cfg_.outlier_channels, cfg_.outlier_sketch_dim,
             cfg_.initial_layers, cfg_.initial_key_sketch_dim, cfg_.initial_outlier_sketch_dim, cfg_.outlier_tokens,
             cfg_.outlier_spill_tokens, cfg_.outlier_skip_layers, cfg_.key_token_bits);
  io_ = cfg_.dtype == QJLKV_DTYPE_F32 ? 4 : 2;
  variants_.assign(cfg_.num_layers, Variant{});
  token_elems_ = size_t(cfg_.num_kv_heads) * cfg_.head_dim;
  query_elems_ = size_t(cfg_.num_q_heads) * cfg_.head_dim;
  return true;
}

void Harness::bad_data(const Tensor &k, const Tensor &v, std::vector<const char *> &wrong) const {
  // 16-bit exact storage in bf16 has no fp16 limit; such values must keep attention's sums finite.
  const bool bf16 = cfg_.dtype == QJLKV_DTYPE_BF16;
  bool keys_bad = !k.finite || (k.max_abs > kHalfMax && !(cfg_.key_method == QJLKV_KEYS_EXACT && bf16));
  const float value_limit = cfg_.value_bits == 16 && bf16 ? 0x1p95f : kHalfMax;
  bool values_bad = !v.finite || v.max_abs > value_limit;
  if (rotated_values() && !values_bad) {
    // The fp16 scale ‖v‖/‖levels‖ must stay finite: ‖v‖ <= 65504·sqrt(d)·(smallest |level|).
    const double smallest = cfg_.value_bits == 2 ? 0.4528 : cfg_.value_bits == 3 ? 0.2451 : 0.1284;
    const double limit = double(kHalfMax) * std::sqrt(double(cfg_.head_dim)) *
                         double(float(smallest));
    for (size_t row = 0; row < v.values.size() / cfg_.head_dim; ++row) {
      double norm2 = 0.0;
      for (uint32_t j = 0; j < cfg_.head_dim; ++j) norm2 += double(v.values[row * cfg_.head_dim + j]) * v.values[row * cfg_.head_dim + j];
      values_bad = values_bad || std::sqrt(norm2) > limit;
    }
  }
  if (cfg_.key_method == QJLKV_KEYS_QJL) {
    for (size_t row = 0; row < k.values.size() / cfg_.head_dim; ++row) {
      double norm2 = 0.0;
      for (uint32_t j = 0; j < cfg_.head_dim; ++j) {
        const double x = k.values[row * cfg_.head_dim + j];
        norm2 += x * x;
      }
      keys_bad = keys_bad || std::sqrt(norm2) > kHalfMax;
    }
  }
  if (keys_bad) wrong.push_back("keys");
  if (values_bad) wrong.push_back("values");
}

// Lengths of every stream the harness can touch, and the statistics, as bytes.
std::string Harness::snapshot() const {
  std::string snap;
  for (uint32_t l = 0; l < cfg_.num_layers; ++l)
    for (uint32_t seq : {0u, 1u, 2u, 3u, 0xffffffffu}) {
      uint64_t n = ~0ull;
      (void)qjlkv_cache_length(cache_, l, seq, &n);
      snap.append(reinterpret_cast<const char *>(&n), sizeof n);
    }
  qjlkv_stats st;
  std::memset(&st, 0, sizeof st);
  st.struct_size = sizeof st;
  (void)qjlkv_cache_stats(cache_, &st);
  snap.append(reinterpret_cast<const char *>(&st), sizeof st);
  return snap;
}

void Harness::expect_failure(qjlkv_status s, const std::string &before, const char *what,
                             const std::vector<const char *> &wrong) {
  FUZZ_CHECK(s == QJLKV_ERROR_INVALID_ARGUMENT, "%s with wrong %s: expected INVALID_ARGUMENT, got %s", what,
             wrong[0], qjlkv_status_string(s));
  const std::string message = qjlkv_last_error_message();
  bool named = false;
  for (const char *a : wrong) named = named || names(message, a);
  FUZZ_CHECK(named, "%s: the message does not name the wrong argument (%s...)", what, wrong[0]);
  FUZZ_CHECK(snapshot() == before, "%s failed but changed lengths or statistics", what);
}

void Harness::check_state() {
  uint64_t tokens = 0, full_precision = 0;
  for (const auto &[key, stream] : streams_) {
    const uint64_t n = tokens_of(stream);
    uint64_t got = ~0ull;
    FUZZ_CHECK(qjlkv_cache_length(cache_, key.first, key.second, &got) == QJLKV_OK && got == n,
               "length of (layer %u, seq %u) is %llu, the model has %llu", key.first, key.second,
               (unsigned long long)got, (unsigned long long)n);
    tokens += n;
    full_precision += 2 * (n - quantized_count(n)) * token_elems_ * io_;
  }
  qjlkv_stats st;
  std::memset(&st, 0, sizeof st);
  st.struct_size = sizeof st;
  FUZZ_CHECK(qjlkv_cache_stats(cache_, &st) == QJLKV_OK, "stats");
  FUZZ_CHECK(st.tokens == tokens, "stats.tokens %llu, model %llu", (unsigned long long)st.tokens,
             (unsigned long long)tokens);
  FUZZ_CHECK(st.bytes_used <= st.bytes_reserved, "bytes_used %llu > bytes_reserved %llu",
             (unsigned long long)st.bytes_used, (unsigned long long)st.bytes_reserved);
  FUZZ_CHECK(st.bytes_used == st.bytes_keys_quantized + st.bytes_values_quantized + st.bytes_full_precision +
                                  st.bytes_metadata + st.bytes_rollback,
             "bytes_used is not the sum of its components");
  FUZZ_CHECK(st.bytes_fp16_equivalent == tokens * token_elems_ * 4, "bytes_fp16_equivalent");
  if (tokens == 0) {
    FUZZ_CHECK(st.bytes_used == 0 && st.bytes_reserved == 0 && st.bits_per_number == 0.0,
               "an empty cache reports %llu bytes used, %llu reserved", (unsigned long long)st.bytes_used,
               (unsigned long long)st.bytes_reserved);
  } else {
    const double expected_bits = double(st.bytes_used) * 8.0 / double(tokens * token_elems_ * 2);
    FUZZ_CHECK(std::fabs(st.bits_per_number - expected_bits) <= 1e-9 * expected_bits, "bits_per_number %g vs %g",
               st.bits_per_number, expected_bits);
  }
  // OTT keeps pool and spill tokens in full precision too; every other preset holds exactly the
  // tails that the tail rule leaves.
  if (cfg_.key_method != QJLKV_KEYS_OTT)
    FUZZ_CHECK(st.bytes_full_precision == full_precision, "bytes_full_precision %llu, the tail rule gives %llu",
               (unsigned long long)st.bytes_full_precision, (unsigned long long)full_precision);
}

void Harness::do_append() {
  const uint32_t layer = pick_layer(), seq = pick_seq();
  const uint64_t length = layer < cfg_.num_layers ? model_length(layer, seq) : 0;
  const uint32_t B = cfg_.block_tokens, R = cfg_.residual_tokens;
  const uint32_t kLengths[] = {0, 1, 1, 1, 2, 3, B - 1, B, R + B, R + 2 * B + 1, 40, 0xffffffffu};
  uint32_t n = in_.pick(kLengths);
  // UINT32_MAX more tokens must be refused before the data is read (it would overflow the
  // 32-bit position limit); on an empty sequence it would be a legal call with 4G tokens.
  const bool huge = n == 0xffffffffu && length > 0 && layer < cfg_.num_layers;
  if (n == 0xffffffffu && !huge) n = 1;
  // Real buffers even for n = 0 (NULL would be a different error).
  const size_t data_tokens = huge || n == 0 ? 1 : n;
  const Tensor k = make_tensor(in_, data_tokens * token_elems_, qjlkv_dtype(cfg_.dtype), true);
  const Tensor v = make_tensor(in_, data_tokens * token_elems_, qjlkv_dtype(cfg_.dtype), true);
  const std::string before = snapshot();
  const qjlkv_status s = qjlkv_cache_append(cache_, layer, seq, n, k.bytes.data(), v.bytes.data());
  FUZZ_TRACE("append(layer %u, seq %u, n %u) -> %s\n", layer, seq, n, qjlkv_status_string(s));
  std::vector<const char *> wrong;
  if (layer >= cfg_.num_layers) wrong.push_back("layer");
  if (n == 0 || huge) wrong.push_back("n_tokens");
  bad_data(k, v, wrong);
  if (!wrong.empty()) return expect_failure(s, before, "append", wrong);
  FUZZ_CHECK(s == QJLKV_OK, "append of %u tokens to (%u, %u): %s", n, layer, seq, qjlkv_status_string(s));
  Stream &stream = streams_[{layer, seq}];
  stream.keys.insert(stream.keys.end(), k.values.begin(), k.values.end());
  stream.values.insert(stream.values.end(), v.values.begin(), v.values.end());
}

void Harness::do_append_batch() {
  const uint32_t layer = pick_layer();
  const uint32_t n = 1 + in_.byte() % 4;
  std::vector<uint32_t> seqs(n);
  for (uint32_t &s : seqs) s = pick_seq();
  std::vector<uint32_t> sorted = seqs;
  std::sort(sorted.begin(), sorted.end());
  const bool duplicate = std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end();
  const Tensor k = make_tensor(in_, n * token_elems_, qjlkv_dtype(cfg_.dtype), true);
  const Tensor v = make_tensor(in_, n * token_elems_, qjlkv_dtype(cfg_.dtype), true);
  const std::string before = snapshot();
  const qjlkv_status s = qjlkv_cache_append_batch(cache_, layer, n, seqs.data(), k.bytes.data(), v.bytes.data());
  FUZZ_TRACE("append_batch(layer %u, seqs %u %u %u %u (first %u)) -> %s\n", layer, seqs[0], n > 1 ? seqs[1] : 0,
             n > 2 ? seqs[2] : 0, n > 3 ? seqs[3] : 0, n, qjlkv_status_string(s));
  std::vector<const char *> wrong;
  if (layer >= cfg_.num_layers) wrong.push_back("layer");
  if (duplicate) wrong.push_back("seqs");
  bad_data(k, v, wrong);
  if (!wrong.empty()) return expect_failure(s, before, "append_batch", wrong);
  FUZZ_CHECK(s == QJLKV_OK, "append_batch: %s", qjlkv_status_string(s));
  for (uint32_t i = 0; i < n; ++i) {
    Stream &stream = streams_[{layer, seqs[i]}];
    const size_t first = i * token_elems_;
    stream.keys.insert(stream.keys.end(), k.values.begin() + first, k.values.begin() + first + token_elems_);
    stream.values.insert(stream.values.end(), v.values.begin() + first, v.values.begin() + first + token_elems_);
  }
}

void Harness::do_attend(bool batch) {
  const uint32_t layer = pick_layer();
  std::vector<uint32_t> seqs(batch ? 1 + in_.byte() % 3 : 1);
  for (uint32_t &s : seqs) s = pick_seq();
  uint64_t shortest = ~0ull;
  for (uint32_t s : seqs) shortest = std::min(shortest, layer < cfg_.num_layers ? model_length(layer, s) : 0);
  uint32_t n_queries = 1;
  if (!batch) {
    const uint8_t choice = in_.byte() % 6;
    n_queries = choice == 0 ? 0 : choice == 1 ? uint32_t(std::min<uint64_t>(shortest, 40))
                : choice == 2 ? uint32_t(std::min<uint64_t>(shortest + 1, 41)) : 1 + choice % 3;
  }
  static const float kScales[] = {0.0f, 0.0f, -1.0f, 0.25f, 1.0f, NAN, INFINITY, 3.0f};
  const float scale = in_.pick(kScales);
  const size_t rows = size_t(n_queries) * seqs.size();
  const Tensor q = make_tensor(in_, std::max<size_t>(rows, 1) * query_elems_, qjlkv_dtype(cfg_.dtype), false);
  std::vector<uint8_t> out(q.bytes.size() + 1, 0xEE);  // one canary byte past the end
  const std::string before = snapshot();
  const qjlkv_status s =
      batch ? qjlkv_cache_attend_batch(cache_, layer, uint32_t(seqs.size()), seqs.data(), q.bytes.data(), scale,
                                       out.data())
            : qjlkv_cache_attend(cache_, layer, seqs[0], n_queries, q.bytes.data(), scale, out.data());
  FUZZ_TRACE("%s(layer %u, seqs %u %u %u (first %zu), n_queries %u, scale %g) -> %s\n",
             batch ? "attend_batch" : "attend", layer, seqs[0], seqs.size() > 1 ? seqs[1] : 0,
             seqs.size() > 2 ? seqs[2] : 0, seqs.size(), n_queries, double(scale), qjlkv_status_string(s));
  FUZZ_CHECK(out.back() == 0xEE, "attend wrote past the end of out");
  const char *what = batch ? "attend_batch" : "attend";
  std::vector<const char *> wrong;
  if (layer >= cfg_.num_layers) wrong.push_back("layer");
  if (n_queries == 0 || n_queries > shortest) wrong.push_back("n_queries");
  if (shortest == 0) {
    wrong.push_back("seq");
    wrong.push_back("seqs");
  }
  if (!std::isfinite(scale)) wrong.push_back("scale");
  if (!q.finite) wrong.push_back("queries");
  if (!wrong.empty()) return expect_failure(s, before, what, wrong);
  // Logits that may leave the fp32 range can be refused (naming queries or scale) instead of
  // computed; anything else must succeed.
  if (s != QJLKV_OK && logits_may_overflow(layer, seqs, q.values, scale))
    return expect_failure(s, before, what, {"queries", "scale"});
  FUZZ_CHECK(s == QJLKV_OK, "%s: %s", what, qjlkv_status_string(s));
  FUZZ_CHECK(snapshot() == before, "%s changed the cache", what);
  for (size_t i = 0; i < seqs.size(); ++i) {
    const size_t first = i * n_queries * query_elems_;
    const std::vector<float> qi(q.values.begin() + first, q.values.begin() + first + n_queries * query_elems_);
    check_output(layer, seqs[i], n_queries, qi, scale, out.data() + first * io_);
  }
}

// Whether some logit scale·q·k of these queries could exceed 2^126 (|estimate| <= sqrt(d)·|q|·|k|
// for every key method, QJL included).
bool Harness::logits_may_overflow(uint32_t layer, const std::vector<uint32_t> &seqs,
                                  const std::vector<float> &queries, float scale) const {
  const uint32_t d = cfg_.head_dim;
  const double used_scale = scale > 0.0f ? double(scale) : 1.0 / std::sqrt(double(d));
  double q_max = 0.0, k_max = 0.0;
  for (size_t row = 0; row < queries.size() / d; ++row) {
    double q2 = 0.0;
    for (uint32_t j = 0; j < d; ++j) q2 += double(queries[row * d + j]) * queries[row * d + j];
    q_max = std::max(q_max, std::sqrt(q2));
  }
  for (uint32_t seq : seqs) {
    const Stream &stream = streams_.at({layer, seq});
    for (size_t row = 0; row < stream.keys.size() / d; ++row) {
      double k2 = 0.0;
      for (uint32_t j = 0; j < d; ++j) k2 += double(stream.keys[row * d + j]) * stream.keys[row * d + j];
      k_max = std::max(k_max, std::sqrt(k2));
    }
  }
  if (2.0 * (std::sqrt(double(d)) + 1.0) * used_scale * q_max * k_max >= 0x1p126) return true;
  // QJL: the sign sums of S·q (see logit_representable), before or after the scale.
  return cfg_.key_method == QJLKV_KEYS_QJL &&
         4.0 * sketch_rows() * std::sqrt(double(d)) * std::max(1.0, used_scale) * q_max >= 0x1p126;
}

// Output of n_queries queries against (layer, seq): finite, within the values' range, and for
// the exact preset equal to a float64 reference within fp32 rounding.
void Harness::check_output(uint32_t layer, uint32_t seq, uint32_t n_queries, const std::vector<float> &queries,
                           float scale, const uint8_t *out) {
  const Stream &stream = streams_.at({layer, seq});
  const uint32_t d = cfg_.head_dim, Hq = cfg_.num_q_heads, Hkv = cfg_.num_kv_heads, G = Hq / Hkv;
  const uint64_t length = tokens_of(stream);
  const double used_scale = scale > 0.0f ? double(scale) : 1.0 / std::sqrt(double(d));
  const bool exact = cfg_.key_method == QJLKV_KEYS_EXACT;
  const uint32_t g = cfg_.value_group_size;
  const Variant &variant = variants_[layer];
  const double cap = variant.softcap;
  for (uint32_t i = 0; i < n_queries; ++i) {
    const uint64_t position = length - n_queries + i;
    for (uint32_t h = 0; h < Hq; ++h) {
      const uint32_t kv = h / G;
      const float *q = &queries[(size_t(i) * Hq + h) * d];
      std::vector<double> logits(position + 1);
      const bool sink = !variant.sinks.empty();
      double max_logit = sink ? double(variant.sinks[h]) : -INFINITY, logit_error = 0.0, v_abs_max = 0.0;
      for (uint64_t t = 0; t <= position; ++t) {
        const float *k = &stream.keys[(t * Hkv + kv) * d];
        double dot = 0.0, abs_dot = 0.0;
        for (uint32_t j = 0; j < d; ++j) {
          const double kj = quantized_at(length, t) ? stored16(k[j]) : k[j];
          dot += double(q[j]) * kj;
          abs_dot += std::fabs(double(q[j]) * kj);
        }
        logits[t] = used_scale * dot;
        // The cap's slope is at most 1, so it never grows a logit's error; its own fp32 rounding
        // (s / c, tanh, the product) adds a few ulps of c.
        if (cap > 0.0) logits[t] = cap * std::tanh(logits[t] / cap);
        max_logit = std::max(max_logit, logits[t]);
        logit_error = std::max(logit_error, used_scale * abs_dot * (d + 4) * kEps32 * 2 + cap * 8 * kEps32);
        for (uint32_t j = 0; j < d; ++j) v_abs_max = std::max(v_abs_max, double(std::fabs(stream.values[(t * Hkv + kv) * d + j])));
      }
      // The sink's term joins the denominator and attends to no value.
      double sum = sink ? std::exp(double(variant.sinks[h]) - max_logit) : 0.0;
      for (double &l : logits) sum += (l = std::exp(l - max_logit));
      for (uint32_t j = 0; j < d; ++j) {
        const float got = decode_one(out + ((size_t(i) * Hq + h) * d + j) * io_, qjlkv_dtype(cfg_.dtype));
        FUZZ_CHECK(std::isfinite(got), "attend output (query %u, head %u, channel %u) is %g", i, h, j, double(got));
        // The values this output averages: each token's group range bounds its reconstruction.
        // Rotated Lloyd-Max values keep each token's norm, not its channels' range: every
        // coordinate of a reconstruction lies within ±‖v‖ (plus the fp16 scale's rounding).
        double lo = INFINITY, hi = -INFINITY, reference = 0.0;
        for (uint64_t t = 0; t <= position; ++t) {
          const float *v = &stream.values[(t * Hkv + kv) * d];
          if (rotated_values()) {
            double norm2 = 0.0;
            for (uint32_t c = 0; c < d; ++c) norm2 += double(v[c]) * v[c];
            const double bound = std::sqrt(norm2) * (1.0 + 0x1p-10) + 4 * std::sqrt(double(d)) * 0x1p-24;
            lo = std::min(lo, -bound);
            hi = std::max(hi, bound);
          } else {
            const uint32_t g0 = j / g * g;
            for (uint32_t c = g0; c < g0 + g; ++c) {
              lo = std::min(lo, double(v[c]));
              hi = std::max(hi, double(v[c]));
            }
          }
          reference += logits[t] / sum * (quantized_at(length, t) ? stored16(v[j]) : v[j]);
        }
        if (sink) {  // the weights sum to less than 1: the output lies between 0 and the values
          lo = std::min(lo, 0.0);
          hi = std::max(hi, 0.0);
        }
        // Rounding of a 16-bit output: relative, plus fp16's subnormal spacing near zero.
        const double out_rounding = cfg_.dtype == QJLKV_DTYPE_F32 ? 0.0 : cfg_.dtype == QJLKV_DTYPE_F16 ? 0x1p-10 : 0x1p-7;
        const double out_subnormal = cfg_.dtype == QJLKV_DTYPE_F16 ? 0x1p-24 : 0.0;
        // fp16 rounding of a group's minimum and scale: up to 2^-10 of the range, but the top
        // code (2^b - 1) times fp16's subnormal spacing for tiny scales; fp32 accumulation; the
        // rounding of a 16-bit output.
        const double slack = 0x1p-7 * v_abs_max + out_rounding * v_abs_max + (value_levels() + 4) * 0x1p-24;
        FUZZ_CHECK(got >= lo - slack && got <= hi + slack,
                   "attend output (query %u, head %u, channel %u) = %g outside the values' range [%g, %g]", i, h, j,
                   double(got), lo, hi);
        if (exact) {
          // A logit error e moves each softmax weight by a factor within exp(+-2e).
          const double weights_error = v_abs_max > 0.0 ? std::expm1(std::min(2 * logit_error, 700.0)) : 0.0;
          const double bound = weights_error * v_abs_max + double(position + 8) * 4 * kEps32 * v_abs_max +
                               out_rounding * std::fabs(reference) + out_subnormal + 1e-30;
          FUZZ_CHECK(std::fabs(got - reference) <= bound,
                     "exact preset: attend output (query %u, head %u, channel %u) = %.9g, reference %.9g (bound %g)",
                     i, h, j, double(got), reference, bound);
        }
      }
    }
  }
}

bool Harness::logit_representable(const Stream &stream, const std::vector<float> &q, uint32_t h, uint64_t t) const {
  const uint32_t d = cfg_.head_dim, G = cfg_.num_q_heads / cfg_.num_kv_heads;
  const float *k = &stream.keys[(t * cfg_.num_kv_heads + h / G) * d];
  double q2 = 0.0, k2 = 0.0;
  for (uint32_t j = 0; j < d; ++j) {
    q2 += double(q[size_t(h) * d + j]) * q[size_t(h) * d + j];
    k2 += double(k[j]) * k[j];
  }
  if (2.0 * (std::sqrt(double(d)) + 1.0) * std::sqrt(q2 * k2) >= 0x1p126) return false;
  // QJL sums signed entries of S·q before the key's norm scales them: up to sketch_rows() of
  // them, each at most |S row|·|q| (rows of norm about sqrt(d)), whatever the key.
  return cfg_.key_method != QJLKV_KEYS_QJL || 4.0 * sketch_rows() * std::sqrt(double(d)) * std::sqrt(q2) < 0x1p126;
}

bool Harness::logits_representable(const Stream &stream, const std::vector<float> &q, uint64_t length) const {
  for (uint32_t h = 0; h < cfg_.num_q_heads; ++h)
    for (uint64_t t = 0; t < length; ++t)
      if (!logit_representable(stream, q, h, t)) return false;
  return true;
}

void Harness::do_scores() {
  const uint32_t layer = pick_layer(), seq = pick_seq();
  const uint64_t length = layer < cfg_.num_layers ? model_length(layer, seq) : 0;
  const Tensor q = make_tensor(in_, query_elems_, qjlkv_dtype(cfg_.dtype), false);
  const uint8_t size_choice = in_.byte() % 8;
  const size_t needed = size_t(cfg_.num_q_heads) * length;
  const size_t out_len = size_choice == 0 && needed > 0 ? needed - 1 : needed;
  std::vector<float> out(out_len + 1, -1.25f);  // one canary past the end
  const std::string before = snapshot();
  const qjlkv_status s = qjlkv_cache_scores(cache_, layer, seq, q.bytes.data(), out.data(), out_len);
  FUZZ_TRACE("scores(layer %u, seq %u, out_len %zu) -> %s\n", layer, seq, out_len, qjlkv_status_string(s));
  FUZZ_CHECK(out.back() == -1.25f, "scores wrote past out_len");
  std::vector<const char *> wrong;
  if (layer >= cfg_.num_layers) wrong.push_back("layer");
  if (length == 0) wrong.push_back("seq");
  if (out_len < needed) wrong.push_back("out_len");
  if (!q.finite) wrong.push_back("query");
  if (!wrong.empty()) return expect_failure(s, before, "scores", wrong);
  const Stream &stream = streams_.at({layer, seq});
  const uint32_t d = cfg_.head_dim, G = cfg_.num_q_heads / cfg_.num_kv_heads;
  const auto representable = [&](uint32_t h, uint64_t t) { return logit_representable(stream, q.values, h, t); };
  if (s != QJLKV_OK) {
    FUZZ_CHECK(!logits_representable(stream, q.values, length), "scores: %s although every logit fits fp32",
               qjlkv_status_string(s));
    return expect_failure(s, before, "scores", {"query"});
  }
  for (uint32_t h = 0; h < cfg_.num_q_heads; ++h)
    for (uint64_t t = 0; t < length; ++t) {
      const float got = out[h * length + t];
      if (cfg_.key_method == QJLKV_KEYS_OTT && got == -INFINITY) continue;  // moved to the pool
      const float *k = &stream.keys[(t * cfg_.num_kv_heads + h / G) * d];
      FUZZ_CHECK(std::isfinite(got) || (!representable(h, t) && !std::isnan(got)),
                 "score (head %u, position %llu) is %g", h, (unsigned long long)t, double(got));
      if (cfg_.key_method != QJLKV_KEYS_EXACT || !std::isfinite(got)) continue;  // +-inf: checked just above
      double dot = 0.0, abs_dot = 0.0;
      for (uint32_t j = 0; j < d; ++j) {
        const double kj = quantized_at(length, t) ? stored16(k[j]) : k[j];
        dot += double(q.values[size_t(h) * d + j]) * kj;
        abs_dot += std::fabs(double(q.values[size_t(h) * d + j]) * kj);
      }
      FUZZ_CHECK(std::fabs(got - dot) <= abs_dot * (d + 2) * kEps32 + 1e-30,
                 "exact preset: score (head %u, position %llu) = %.9g, reference %.9g", h, (unsigned long long)t,
                 double(got), dot);
    }
}

// Reconstruction of a range of positions: argument checks, no write past the outputs, finite
// numbers; values within their token's group range; for "exact" the stored 16-bit numbers; and
// keys whose dot product with a query is the score the cache reports for it.
void Harness::do_reconstruct() {
  const uint32_t layer = pick_layer(), seq = pick_seq();
  const uint64_t length = layer < cfg_.num_layers ? model_length(layer, seq) : 0;
  const uint64_t firsts[] = {0, 0, length / 2, length ? length - 1 : 0, length, ~0ull};
  const uint64_t first = in_.pick(firsts);
  const uint64_t rest = first < length ? length - first : 0;
  const uint64_t counts[] = {rest, rest, 1, 0, rest + 1, ~0ull};
  const uint64_t count = in_.pick(counts);
  const uint8_t outputs = 1 + in_.byte() % 4;  // bit 0: keys, bit 1: values; 4 = neither
  const bool valid_range = count > 0 && first < length && count <= length - first;
  const size_t floats = size_t(valid_range ? count : 1) * token_elems_;
  std::vector<float> keys(floats + 1, -1.25f), values(floats + 1, -1.25f);  // one canary each
  const std::string before = snapshot();
  const qjlkv_status s = qjlkv_cache_reconstruct(cache_, layer, seq, first, count,
                                                 outputs & 1 ? keys.data() : nullptr,
                                                 outputs & 2 ? values.data() : nullptr);
  FUZZ_TRACE("reconstruct(layer %u, seq %u, first %llu, count %llu, outputs %u) -> %s\n", layer, seq,
             (unsigned long long)first, (unsigned long long)count, outputs, qjlkv_status_string(s));
  FUZZ_CHECK(keys.back() == -1.25f && values.back() == -1.25f, "reconstruct wrote past its outputs");
  std::vector<const char *> wrong;
  if (layer >= cfg_.num_layers) wrong.push_back("layer");
  if (!(outputs & 3)) {
    wrong.push_back("keys_out");
    wrong.push_back("values_out");
  }
  if (!valid_range) {
    wrong.push_back("first");
    wrong.push_back("count");
  }
  if (!wrong.empty()) return expect_failure(s, before, "reconstruct", wrong);
  FUZZ_CHECK(s == QJLKV_OK, "reconstruct: %s", qjlkv_status_string(s));
  FUZZ_CHECK(snapshot() == before, "reconstruct changed the cache");
  const Stream &stream = streams_.at({layer, seq});
  const uint32_t d = cfg_.head_dim, g = cfg_.value_group_size;
  for (uint64_t t = first; t < first + count; ++t)
    for (size_t e = 0; e < token_elems_; ++e) {
      const size_t at = (t - first) * token_elems_ + e, in = t * token_elems_ + e;
      const bool exact_here = cfg_.key_method == QJLKV_KEYS_EXACT || !quantized_at(length, t);
      if (outputs & 1) {
        FUZZ_CHECK(std::isfinite(keys[at]), "reconstructed key (position %llu, element %zu) is %g",
                   (unsigned long long)t, e, double(keys[at]));
        const float expected = quantized_at(length, t) ? stored16(stream.keys[in]) : stream.keys[in];
        // OTT: a quantized position whose token moved to the pool reconstructs that token exactly.
        if (exact_here && (cfg_.key_method != QJLKV_KEYS_OTT || !quantized_at(length, t)))
          FUZZ_CHECK(keys[at] == expected, "reconstructed key (position %llu, element %zu) = %g, stored %g",
                     (unsigned long long)t, e, double(keys[at]), double(expected));
      }
      if (outputs & 2) {
        const float got = values[at];
        FUZZ_CHECK(std::isfinite(got), "reconstructed value (position %llu, element %zu) is %g",
                   (unsigned long long)t, e, double(got));
        if (cfg_.value_bits == 16 || !quantized_at(length, t)) {
          const float expected = quantized_at(length, t) ? stored16(stream.values[in]) : stream.values[in];
          if (cfg_.key_method != QJLKV_KEYS_OTT || !quantized_at(length, t))
            FUZZ_CHECK(got == expected, "reconstructed value (position %llu, element %zu) = %g, stored %g",
                       (unsigned long long)t, e, double(got), double(expected));
        } else if (rotated_values()) {
          // Norm correction: ‖v̂‖ = ‖v‖ up to the fp16 scale's rounding (2^-11, or fp16's
          // subnormal spacing times ‖levels‖ <= 2.8·sqrt(d)) and fp32 rotations.
          if (e % d == 0) {
            double n_got = 0.0, n_in = 0.0;
            for (uint32_t c = 0; c < d; ++c) {
              n_got += double(values[at + c]) * values[at + c];
              n_in += double(stream.values[in + c]) * stream.values[in + c];
            }
            n_got = std::sqrt(n_got);
            n_in = std::sqrt(n_in);
            const double slack = (0x1p-11 + 1e-5) * n_in + 3 * std::sqrt(double(d)) * 0x1p-24;
            FUZZ_CHECK(std::fabs(n_got - n_in) <= slack,
                       "reconstructed rotated value (position %llu, kv head %zu) has norm %g, the input %g",
                       (unsigned long long)t, e / d, n_got, n_in);
          }
        } else {
          const size_t g0 = in / g * g;  // the group of this element (groups never cross heads: g | d)
          float lo = stream.values[g0], hi = lo, v_abs = 0.0f;
          for (size_t c = g0; c < g0 + g; ++c) {
            lo = std::min(lo, stream.values[c]);
            hi = std::max(hi, stream.values[c]);
            v_abs = std::max(v_abs, std::fabs(stream.values[c]));
          }
          const float slack = 0x1p-8f * v_abs + float(value_levels() + 2) * 0x1p-24f;  // as in check_output
          FUZZ_CHECK(got >= lo - slack && got <= hi + slack,
                     "reconstructed value (position %llu, element %zu) = %g outside its group's range [%g, %g]",
                     (unsigned long long)t, e, double(got), double(lo), double(hi));
        }
      }
    }
  // The reconstructed keys reproduce the scores (SPEC §3's dense form for QJL).
  if (!(outputs & 1) || first != 0 || count != length) return;
  const Tensor q = make_tensor(in_, query_elems_, qjlkv_dtype(cfg_.dtype), false);
  if (!q.finite) return;
  std::vector<float> scores(size_t(cfg_.num_q_heads) * length);
  const qjlkv_status scored = qjlkv_cache_scores(cache_, layer, seq, q.bytes.data(), scores.data(), scores.size());
  // A logit beyond fp32 may be NaN and refused (do_scores checks that case).
  if (scored == QJLKV_ERROR_INVALID_ARGUMENT && !logits_representable(stream, q.values, length)) return;
  FUZZ_CHECK(scored == QJLKV_OK, "scores after reconstruct: %s", qjlkv_status_string(scored));
  const uint32_t G = cfg_.num_q_heads / cfg_.num_kv_heads;
  const double m = cfg_.key_method == QJLKV_KEYS_QJL ? double(std::max(cfg_.key_sketch_dim, cfg_.initial_key_sketch_dim)) : 0.0;
  const bool codes_keys = cfg_.key_method == QJLKV_KEYS_KIVI || cfg_.key_method == QJLKV_KEYS_OTT ||
                          cfg_.key_method == QJLKV_KEYS_MIXED;
  for (uint32_t h = 0; h < cfg_.num_q_heads; ++h)
    for (uint64_t t = 0; t < length; ++t) {
      const float score = scores[h * length + t];
      // OTT: -inf marks a token moved to the pool; an inf logit is do_scores' business.
      if (!std::isfinite(score)) continue;
      const float *k = &keys[(t * cfg_.num_kv_heads + h / G) * d];
      const float *kin = &stream.keys[(t * cfg_.num_kv_heads + h / G) * d];
      const float *qh = &q.values[size_t(h) * d];
      double dot = 0.0, q2 = 0.0, k2 = 0.0, kin2 = 0.0;
      for (uint32_t j = 0; j < d; ++j) {
        dot += double(qh[j]) * k[j];
        q2 += double(qh[j]) * qh[j];
        k2 += double(k[j]) * k[j];
        kin2 += double(kin[j]) * kin[j];
      }
      // KIVI/OTT (and mixed-bit) scores sum q·(code·scale) and q·min separately: their rounding follows the
      // terms' size (up to 3× the block's largest |k| per channel), not |k̂|, which cancels to
      // near 0 for a token at the middle of its channels' ranges.
      double terms2 = 0.0;
      if (codes_keys && quantized_at(length, t)) {
        const uint64_t S = cfg_.sink_tokens;
        const uint64_t block_first = S + (t - S) / cfg_.block_tokens * cfg_.block_tokens;
        for (uint32_t j = 0; j < d; ++j) {
          double channel_max = 0.0;
          for (uint64_t u = block_first; u < block_first + cfg_.block_tokens; ++u) {
            const float x = stream.keys[(u * cfg_.num_kv_heads + h / G) * d + j];
            channel_max = std::max(channel_max, std::fabs(double(x)));
          }
          terms2 += 9.0 * channel_max * channel_max;
        }
      }
      const double tol =
          1e-5 * (m + d + 8) * std::sqrt(q2) * (std::sqrt(k2) + std::sqrt(kin2) + std::sqrt(terms2)) + 1e-30;
      FUZZ_CHECK(std::fabs(score - dot) <= tol,
                 "score (head %u, position %llu) = %.9g, but the reconstructed key gives %.9g (tolerance %g)", h,
                 (unsigned long long)t, double(score), dot, tol);
    }
}

void Harness::do_clear() {
  const uint32_t seq = pick_seq();
  FUZZ_CHECK(qjlkv_cache_clear_sequence(cache_, seq) == QJLKV_OK, "clear");
  FUZZ_TRACE("clear(seq %u)\n", seq);
  for (uint32_t l = 0; l < cfg_.num_layers; ++l) streams_.erase({l, seq});
}

// set_layer_attention with fuzzed arguments: accepted, the model's variant of the layer follows;
// refused (INVALID_ARGUMENT naming the field), the layer keeps the variant it had, which the
// attends after it check.
void Harness::do_set_attention() {
  const uint32_t layer = pick_layer();
  static const float kCaps[] = {0.0f, 0.0f, 0.5f, 1.0f, 5.0f, 50.0f, 1e4f, 1e-30f, -0.0f, -1.0f, NAN, INFINITY};
  const float cap = in_.pick(kCaps);
  const uint8_t sink_choice = in_.byte();
  std::vector<float> sinks;
  bool sinks_finite = true;
  if (sink_choice % 3 != 0) {
    static const float kSinks[] = {0.0f, -1.0f, 1.0f, 3.0f, 10.0f, -10.0f, 80.0f, -80.0f, 1e4f, -1e30f};
    sinks.resize(cfg_.num_q_heads);
    for (float &x : sinks) x = in_.pick(kSinks);
    if (sink_choice % 16 == 1) {  // one poisoned head
      static const float kPoisons[] = {NAN, INFINITY, -INFINITY};
      sinks[in_.byte() % sinks.size()] = in_.pick(kPoisons);
      sinks_finite = false;
    }
  }
  qjlkv_layer_attention a;
  std::memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.logit_softcap = cap;
  a.sink_logits = sinks.empty() ? nullptr : sinks.data();
  const uint8_t broken = in_.byte() % 16;
  if (broken == 14) a.struct_size = in_.flag() ? 0 : sizeof a + 8;
  // A window changes only while the layer is empty; the model has no windows, so the fuzzer
  // asks for one only where the library must refuse it.
  bool holds_tokens = false;
  for (const auto &[key, stream] : streams_) holds_tokens = holds_tokens || (key.first == layer && tokens_of(stream) > 0);
  if (broken == 15 && holds_tokens) a.window_tokens = 1 + in_.byte();
  const std::string before = snapshot();
  const qjlkv_status s = qjlkv_cache_set_layer_attention(cache_, layer, &a);
  FUZZ_TRACE("set_layer_attention(layer %u, struct_size %u, softcap %g, %s sinks, window %u) -> %s\n", layer,
             a.struct_size, double(cap), sinks.empty() ? "no" : sinks_finite ? "finite" : "poisoned", a.window_tokens,
             qjlkv_status_string(s));
  std::vector<const char *> wrong;
  if (a.struct_size != sizeof a) wrong.push_back("struct_size");
  if (layer >= cfg_.num_layers) wrong.push_back("layer");
  if (!(std::isfinite(cap) && cap >= 0.0f)) wrong.push_back("logit_softcap");
  if (a.window_tokens != 0 && layer < cfg_.num_layers) wrong.push_back("window_tokens");
  if (!sinks_finite) wrong.push_back("sink_logits");
  if (!wrong.empty()) return expect_failure(s, before, "set_layer_attention", wrong);
  FUZZ_CHECK(s == QJLKV_OK, "set_layer_attention: %s", qjlkv_last_error_message());
  FUZZ_CHECK(snapshot() == before, "set_layer_attention changed lengths or statistics");
  variants_[layer] = Variant{cap > 0.0f ? cap : 0.0f, sinks};
}

void Harness::keep_prefix(uint32_t seq, uint64_t length) {
  for (uint32_t l = 0; l < cfg_.num_layers; ++l) {
    const auto it = streams_.find({l, seq});
    if (it == streams_.end()) continue;
    Stream &stream = it->second;
    const uint64_t n = std::min<uint64_t>(length, tokens_of(stream));
    if (n == 0) {
      streams_.erase(it);
      continue;
    }
    stream.keys.resize(n * token_elems_);
    stream.values.resize(n * token_elems_);
    const uint64_t tail = cfg_.sink_tokens + quantized_count(n);
    if (tail >= n) continue;
    std::vector<float> k((n - tail) * token_elems_), v(k.size());
    FUZZ_CHECK(qjlkv_cache_reconstruct(cache_, l, seq, tail, n - tail, k.data(), v.data()) == QJLKV_OK,
               "reconstruct after truncate: %s", qjlkv_last_error_message());
    std::copy(k.begin(), k.end(), stream.keys.begin() + ptrdiff_t(tail * token_elems_));
    std::copy(v.begin(), v.end(), stream.values.begin() + ptrdiff_t(tail * token_elems_));
  }
}

void Harness::do_truncate() {
  const uint32_t seq = pick_seq();
  const uint64_t held = longest(seq), length = pick_length(held);
  const std::string before = snapshot();
  const qjlkv_status s = qjlkv_cache_truncate(cache_, seq, length);
  FUZZ_TRACE("truncate(seq %u, length %llu) -> %s\n", seq, (unsigned long long)length, qjlkv_status_string(s));
  if (length > held) return expect_failure(s, before, "truncate", {"length"});
  FUZZ_CHECK(s == QJLKV_OK, "truncate(seq %u, %llu): %s", seq, (unsigned long long)length, qjlkv_last_error_message());
  keep_prefix(seq, length);
}

void Harness::do_fork() {
  const uint32_t src = pick_seq(), dst = pick_seq();
  const uint64_t held = longest(src), length = pick_length(held);
  const std::string before = snapshot();
  const qjlkv_status s = qjlkv_cache_fork(cache_, src, dst, length);
  FUZZ_TRACE("fork(src %u, dst %u, length %llu) -> %s\n", src, dst, (unsigned long long)length,
             qjlkv_status_string(s));
  std::vector<const char *> wrong;
  if (src == dst) wrong = {"src_seq", "dst_seq"};
  else if (longest(dst) > 0) wrong = {"dst_seq"};
  else if (length > held) wrong = {"length"};
  if (!wrong.empty()) return expect_failure(s, before, "fork", wrong);
  FUZZ_CHECK(s == QJLKV_OK, "fork(%u -> %u, %llu): %s", src, dst, (unsigned long long)length,
             qjlkv_last_error_message());
  for (uint32_t l = 0; l < cfg_.num_layers; ++l)
    if (const auto it = streams_.find({l, src}); it != streams_.end() && length > 0) streams_[{l, dst}] = it->second;
  keep_prefix(dst, length);
}

void Harness::step() {
  // Operation bytes 242-255 set a layer's attention variant; the others keep the operations
  // the corpus was grown with.
  const uint8_t op = in_.byte();
  if (op >= 242) {
    do_set_attention();
    check_state();
    return;
  }
  switch (op % 11) {
    case 0:
    case 1: do_append(); break;
    case 2: do_append_batch(); break;
    case 3:
    case 4: do_attend(false); break;
    case 5: do_attend(true); break;
    case 6: do_scores(); break;
    case 7: do_reconstruct(); break;
    case 8: do_truncate(); break;
    case 9: do_fork(); break;
    default: do_clear(); break;
  }
  check_state();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  Input in(data, size);
  Harness harness(in);
  if (!harness.setup()) return 0;
  for (int steps = 0; steps < 64 && !in.empty(); ++steps) harness.step();
  return 0;
}
