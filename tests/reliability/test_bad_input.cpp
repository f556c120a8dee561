// The bad-input table: every public function x every class of bad argument (NULL, zero, huge,
// inconsistent, wrong struct_size, NaN/Inf data, data beyond the fp16 range, unknown preset,
// out-of-range layer or sequence, sizes that overflow). For each row:
//   - the status is the documented one and the message is fresh and names the argument;
//   - the cache is unchanged (lengths, statistics, scores and attention outputs bit for bit);
//   - the call reads and writes only what its arguments allow: every tensor and output buffer
//     ends at a PROT_NONE page, so reading or writing past it crashes;
//   - handles that a failed create would return are NULL; a failed config_init leaves *cfg as
//     it was.
// Each row runs in a forked child, so that a crash fails that row alone and names it.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "half.hpp"
#include "c_caller.h"
#include "reliability.hpp"

namespace qjlkv_test {
namespace {

// Bytes that end exactly at an inaccessible page.
class GuardedBuffer {
 public:
  explicit GuardedBuffer(size_t bytes) : bytes_(bytes) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    mapped_ = (bytes + page - 1) / page * page + page;
    void *p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) std::abort();
    base_ = static_cast<uint8_t *>(p);
    if (mprotect(base_ + mapped_ - page, page, PROT_NONE) != 0) std::abort();
    data_ = base_ + mapped_ - page - bytes;
  }
  GuardedBuffer(const std::vector<uint8_t> &content) : GuardedBuffer(content.size()) {
    std::memcpy(data_, content.data(), content.size());
  }
  ~GuardedBuffer() { munmap(base_, mapped_); }
  GuardedBuffer(const GuardedBuffer &) = delete;
  GuardedBuffer &operator=(const GuardedBuffer &) = delete;
  uint8_t *data() { return data_; }
  template <class T>
  T *as() {
    return reinterpret_cast<T *>(data_);
  }
  size_t size() const { return bytes_; }

 private:
  size_t bytes_, mapped_;
  uint8_t *base_, *data_;
};

void encode(float x, qjlkv_dtype t, uint8_t *p) {
  if (t == QJLKV_DTYPE_F32) {
    std::memcpy(p, &x, 4);
  } else {
    const uint16_t h = t == QJLKV_DTYPE_F16 ? qjlkv::float_to_half(x) : qjlkv::float_to_bf16(x);
    std::memcpy(p, &h, 2);
  }
}

constexpr uint32_t kLayers = 2, kSeq = 1, kOtherLayerSeq = 2, kUnknownSeq = 77;

// A cache with seq 1 in layer 0 (quantized blocks and a tail) and seq 2 in layer 1 only.
struct World {
  qjlkv_config cfg;
  Cache cache;
  uint32_t length = 0;  // of seq 1 in layer 0
  size_t io = 4, token_elems = 0, query_elems = 0;
  std::string post_failure;  // set by a row's call when something beyond the status is wrong

  // Valid tensors of n tokens / n queries in guarded buffers.
  std::unique_ptr<GuardedBuffer> token_buffer(uint32_t n, uint64_t seed) const {
    return std::make_unique<GuardedBuffer>(tokens(cfg, n, seed));
  }
  std::unique_ptr<GuardedBuffer> query_buffer(uint32_t n, uint64_t seed = 5) const {
    return std::make_unique<GuardedBuffer>(queries(cfg, n, seed));
  }
  std::unique_ptr<GuardedBuffer> output_buffer(uint32_t n_queries) const {
    return std::make_unique<GuardedBuffer>(size_t(n_queries) * query_elems * io);
  }
  void poke(GuardedBuffer &b, size_t element, float x) const { encode(x, qt::dtype_of(cfg), b.data() + element * io); }
};

const std::vector<Stream> kStreams = {{0, kSeq}, {1, kSeq}, {0, kOtherLayerSeq}, {1, kOtherLayerSeq},
                                      {0, kUnknownSeq}, {1, 50}};

struct Row {
  std::string function;  // the API function
  std::string what;      // the argument class
  std::function<qjlkv_status(World &)> call;
  std::vector<qjlkv_status> expected;  // acceptable statuses (one, except where builds differ)
  std::vector<std::string> names;      // the message must name one of these (failures only)
  bool mutates = false;                // a successful call may change the cache
};

// Sets a known message, so that a call that fails without setting its own is caught.
std::string provoke_stale_message() {
  qjlkv_sketch *ignored = nullptr;
  (void)qjlkv_sketch_create(8, 8, 0, 0xdead0000u, &ignored);
  return qjlkv_last_error_message();
}

// Runs one row in the current process; returns "" or what was wrong.
std::string check_row(World &w, const Row &row) {
  const Snapshot before = snapshot(w.cache.get(), kStreams);
  const std::string stale = provoke_stale_message();
  const qjlkv_status s = row.call(w);
  const std::string message = qjlkv_last_error_message();
  std::string problems;
  bool status_ok = false;
  for (qjlkv_status e : row.expected) status_ok = status_ok || s == e;
  if (!status_ok)
    problems += "status " + std::string(qjlkv_status_string(s)) + ", expected " +
                qjlkv_status_string(row.expected[0]) + "; ";
  if (s != QJLKV_OK) {
    if (message == stale) problems += "the call set no message of its own; ";
    bool named = false;
    for (const std::string &n : row.names) named = named || names_identifier(message, n);
    if (!named) problems += "the message names none of the expected arguments (" + row.names[0] + "); ";
  }
  if (!w.post_failure.empty()) problems += w.post_failure + "; ";
  if (!(s == QJLKV_OK && row.mutates) && !(snapshot(w.cache.get(), kStreams) == before))
    problems += "the cache changed; ";
  if (!problems.empty()) problems += "message: \"" + message + "\"";
  return problems;
}

// Runs a row in a forked child; a crash or a sanitizer report fails the row.
std::string run_isolated(World &w, const Row &row) {
  int fds[2];
  if (pipe(fds) != 0) return "pipe failed";
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    close(fds[0]);
    const std::string result = check_row(w, row);
    const ssize_t written = write(fds[1], result.data(), result.size());
    _exit(written == ssize_t(result.size()) ? 0 : 3);
  }
  close(fds[1]);
  std::string result;
  char buffer[512];
  for (ssize_t n; (n = read(fds[0], buffer, sizeof buffer)) > 0;) result.append(buffer, size_t(n));
  close(fds[0]);
  int wstatus = 0;
  waitpid(pid, &wstatus, 0);
  if (WIFSIGNALED(wstatus))
    return "crashed with signal " + std::to_string(WTERMSIG(wstatus)) +
           " (a read or write past a buffer the arguments describe?)";
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0)
    return "the child exited with status " + std::to_string(WEXITSTATUS(wstatus)) + " (sanitizer report?)";
  return result;
}

constexpr qjlkv_status kInvalid = QJLKV_ERROR_INVALID_ARGUMENT;

// ---- the table ------------------------------------------------------------------------------
void add_sketch_rows(std::vector<Row> &t) {
  const auto create = [](uint32_t d, uint32_t m, uint32_t flags) {
    return [=](World &w) {
      qjlkv_sketch *out = reinterpret_cast<qjlkv_sketch *>(&w);
      const qjlkv_status s = qjlkv_sketch_create(d, m, 0, flags, &out);
      if (s != QJLKV_OK && out != nullptr) w.post_failure = "*out is not NULL after a failure";
      if (s == QJLKV_OK) qjlkv_sketch_destroy(out);
      return s;
    };
  };
  const std::string f = "qjlkv_sketch_create";
  t.push_back({f, "out NULL", [](World &) { return qjlkv_sketch_create(16, 16, 0, 0, nullptr); }, {kInvalid}, {"out"}});
  t.push_back({f, "head_dim 0", create(0, 16, 1), {kInvalid}, {"head_dim"}});
  t.push_back({f, "head_dim 1025", create(1025, 16, 1), {kInvalid}, {"head_dim"}});
  t.push_back({f, "head_dim UINT32_MAX", create(UINT32_MAX, 16, 1), {kInvalid}, {"head_dim"}});
  t.push_back({f, "sketch_dim 0", create(16, 0, 1), {kInvalid}, {"sketch_dim"}});
  t.push_back({f, "sketch_dim 12", create(16, 12, 1), {kInvalid}, {"sketch_dim"}});
  t.push_back({f, "sketch_dim 65544", create(16, 65544, 1), {kInvalid}, {"sketch_dim"}});
  t.push_back({f, "sketch_dim UINT32_MAX - 7", create(16, UINT32_MAX - 7, 1), {kInvalid}, {"sketch_dim"}});
  t.push_back({f, "flags 2", create(16, 16, 2), {kInvalid}, {"flags"}});
  t.push_back({f, "flags UINT32_MAX", create(16, 16, UINT32_MAX), {kInvalid}, {"flags"}});
  t.push_back({f, "head_dim 1 (edge, valid)", create(1, 8, 1), {QJLKV_OK}, {}});

  const auto with_sketch = [](std::function<qjlkv_status(World &, qjlkv_sketch *)> body) {
    return [body](World &w) {
      qjlkv_sketch *s = nullptr;
      if (qjlkv_sketch_create(16, 24, 0, 1, &s) != QJLKV_OK) return QJLKV_ERROR_INTERNAL;
      const qjlkv_status status = body(w, s);
      qjlkv_sketch_destroy(s);
      return status;
    };
  };
  const std::string m = "qjlkv_sketch_matrix";
  t.push_back({m, "s NULL", [](World &) {
                 float x[1];
                 return qjlkv_sketch_matrix(nullptr, x, 1);
               }, {kInvalid}, {"s"}});
  t.push_back({m, "out NULL", with_sketch([](World &, qjlkv_sketch *s) { return qjlkv_sketch_matrix(s, nullptr, 384); }),
               {kInvalid}, {"out"}});
  for (size_t len : {size_t(0), size_t(1), size_t(383)})
    t.push_back({m, "out_len " + std::to_string(len) + " < 24 x 16", with_sketch([len](World &, qjlkv_sketch *s) {
                   GuardedBuffer out(len * sizeof(float));
                   return qjlkv_sketch_matrix(s, out.as<float>(), len);
                 }),
                 {kInvalid}, {"out_len"}});
  t.push_back({m, "out_len exact (edge, valid)", with_sketch([](World &, qjlkv_sketch *s) {
                 GuardedBuffer out(384 * sizeof(float));
                 return qjlkv_sketch_matrix(s, out.as<float>(), 384);
               }),
               {QJLKV_OK}, {}});
  const std::string sh = "qjlkv_sketch_shape";
  t.push_back({sh, "s NULL", [](World &) {
                 uint32_t r, c;
                 return qjlkv_sketch_shape(nullptr, &r, &c);
               }, {kInvalid}, {"s"}});
  t.push_back({sh, "rows NULL", with_sketch([](World &, qjlkv_sketch *s) {
                 uint32_t c;
                 return qjlkv_sketch_shape(s, nullptr, &c);
               }), {kInvalid}, {"rows"}});
  t.push_back({sh, "cols NULL", with_sketch([](World &, qjlkv_sketch *s) {
                 uint32_t r;
                 return qjlkv_sketch_shape(s, &r, nullptr);
               }), {kInvalid}, {"cols"}});
  t.push_back({"qjlkv_sketch_destroy", "NULL (a no-op)", [](World &) {
                 qjlkv_sketch_destroy(nullptr);
                 return QJLKV_OK;
               }, {QJLKV_OK}, {}});
}

void add_config_init_rows(std::vector<Row> &t) {
  const auto init = [](const char *preset, uint32_t l, uint32_t hq, uint32_t hkv, uint32_t d) {
    return [=](World &w) {
      qjlkv_config cfg;
      std::memset(&cfg, 0x5A, sizeof cfg);
      cfg.struct_size = sizeof cfg;
      const qjlkv_config before = cfg;
      const qjlkv_status s = qjlkv_config_init(&cfg, preset, l, hq, hkv, d);
      if (s != QJLKV_OK && std::memcmp(&cfg, &before, sizeof cfg) != 0) w.post_failure = "*cfg changed on failure";
      return s;
    };
  };
  static const std::string long_name(1000, 'q');
  const std::string f = "qjlkv_config_init";
  t.push_back({f, "cfg NULL", [](World &) { return qjlkv_config_init(nullptr, "qjl", 1, 1, 1, 16); }, {kInvalid},
               {"cfg"}});
  t.push_back({f, "unknown preset", init("qjl2", 1, 1, 1, 16), {kInvalid}, {"preset"}});
  t.push_back({f, "unknown preset, 1000 characters", init(long_name.c_str(), 1, 1, 1, 16), {kInvalid}, {"preset"}});
  t.push_back({f, "preset in capitals", init("KIVI", 1, 1, 1, 16), {kInvalid}, {"preset"}});
  t.push_back({f, "num_layers 0", init("qjl", 0, 1, 1, 16), {kInvalid}, {"num_layers"}});
  t.push_back({f, "num_layers UINT32_MAX", init("qjl", UINT32_MAX, 1, 1, 16), {kInvalid}, {"num_layers"}});
  t.push_back({f, "num_q_heads 0", init("qjl", 1, 0, 1, 16), {kInvalid}, {"num_q_heads"}});
  t.push_back({f, "num_kv_heads 0", init("qjl", 1, 4, 0, 16), {kInvalid}, {"num_kv_heads"}});
  t.push_back({f, "num_q_heads not a multiple of num_kv_heads", init("kivi", 1, 6, 4, 16), {kInvalid},
               {"num_q_heads", "num_kv_heads"}});
  t.push_back({f, "num_kv_heads > num_q_heads", init("kivi", 1, 2, 4, 16), {kInvalid},
               {"num_q_heads", "num_kv_heads"}});
  t.push_back({f, "num_q_heads UINT32_MAX", init("qjl", 1, UINT32_MAX, 1, 16), {kInvalid}, {"num_q_heads"}});
  for (uint32_t d : {0u, 4u, 12u, 264u, UINT32_MAX})
    t.push_back({f, "head_dim " + std::to_string(d), init("exact", 1, 1, 1, d), {kInvalid}, {"head_dim"}});
  t.push_back({f, "NULL preset (the default, valid)", init(nullptr, 1, 1, 1, 16), {QJLKV_OK}, {}});
}

// One config field set to a bad value, checked by validate and by create.
struct FieldCase {
  std::string what;
  const char *preset;
  std::function<void(qjlkv_config &)> edit;
  std::vector<std::string> names;
};

std::vector<FieldCase> bad_fields() {
  std::vector<FieldCase> v = {
      {"struct_size 0", "qjl", [](qjlkv_config &c) { c.struct_size = 0; }, {"struct_size"}},
      {"struct_size too small", "qjl", [](qjlkv_config &c) { c.struct_size = sizeof(qjlkv_config) - 4; },
       {"struct_size"}},
      {"struct_size too large", "qjl", [](qjlkv_config &c) { c.struct_size = sizeof(qjlkv_config) + 4; },
       {"struct_size"}},
      {"num_layers 0", "qjl", [](qjlkv_config &c) { c.num_layers = 0; }, {"num_layers"}},
      {"num_kv_heads 0", "kivi", [](qjlkv_config &c) { c.num_kv_heads = 0; }, {"num_kv_heads"}},
      {"num_q_heads inconsistent", "kivi", [](qjlkv_config &c) { c.num_q_heads = 3; }, {"num_q_heads"}},
      {"head_dim 20", "qjl", [](qjlkv_config &c) { c.head_dim = 20; }, {"head_dim"}},
      {"struct_size of 0.1 + 4", "qjl", [](qjlkv_config &c) { c.struct_size = QJLKV_CONFIG_SIZE_0_1 + 4; },
       {"struct_size"}},
      {"struct_size of 0.3 + 8", "q3", [](qjlkv_config &c) { c.struct_size = QJLKV_CONFIG_SIZE_0_3 + 8; },
       {"struct_size"}},
      {"rollback_tokens above the limit", "q3",
       [](qjlkv_config &c) { c.rollback_tokens = QJLKV_MAX_ROLLBACK_TOKENS + 1; }, {"rollback_tokens"}},
      {"dtype 3", "qjl", [](qjlkv_config &c) { c.dtype = 3; }, {"dtype"}},
      {"dtype 2^32 - 1", "qjl", [](qjlkv_config &c) { c.dtype = UINT32_MAX; }, {"dtype"}},
      {"backend 2", "qjl", [](qjlkv_config &c) { c.backend = 2; }, {"backend"}},
      {"backend 2^32 - 1", "qjl", [](qjlkv_config &c) { c.backend = UINT32_MAX; }, {"backend"}},
      {"CPU device_ordinal 1", "qjl", [](qjlkv_config &c) { c.device_ordinal = 1; }, {"device_ordinal"}},
      {"0.1-sized config, device -2", "qjl",
       [](qjlkv_config &c) {
         c.struct_size = QJLKV_CONFIG_SIZE_0_1;
         const int32_t device = -2;  // 0.1's int32_t device, where device_ordinal is now
         std::memcpy(&c.device_ordinal, &device, sizeof device);
       },
       {"device"}},
      {"sketch_flags 2", "qjl", [](qjlkv_config &c) { c.sketch_flags = 2; }, {"sketch_flags"}},
      {"key_method 5", "qjl", [](qjlkv_config &c) { c.key_method = 5; }, {"key_method"}},
      {"key_method 2^32 - 1", "qjl", [](qjlkv_config &c) { c.key_method = UINT32_MAX; }, {"key_method"}},
      {"key_token_bits 12", "q2", [](qjlkv_config &c) { c.key_token_bits = 12; }, {"key_token_bits"}},
      {"key_token_bits above 4 a channel", "q2", [](qjlkv_config &c) { c.key_token_bits = 4 * c.head_dim + 8; },
       {"key_token_bits"}},
      {"block_tokens 0", "qjl", [](qjlkv_config &c) { c.block_tokens = 0; }, {"block_tokens"}},
      {"block_tokens 12", "kivi", [](qjlkv_config &c) { c.block_tokens = 12; }, {"block_tokens"}},
      {"block_tokens 4104", "qjl", [](qjlkv_config &c) { c.block_tokens = 4104; }, {"block_tokens"}},
      {"residual_tokens 65537", "qjl", [](qjlkv_config &c) { c.residual_tokens = 65537; }, {"residual_tokens"}},
      {"key_sketch_dim 0", "qjl", [](qjlkv_config &c) { c.key_sketch_dim = 0; }, {"key_sketch_dim"}},
      {"key_sketch_dim 12", "qjl", [](qjlkv_config &c) { c.key_sketch_dim = 12; }, {"key_sketch_dim"}},
      {"key_sketch_dim 65544", "qjl", [](qjlkv_config &c) { c.key_sketch_dim = 65544; }, {"key_sketch_dim"}},
      {"outlier_channels = head_dim", "qjl", [](qjlkv_config &c) { c.outlier_channels = c.head_dim; },
       {"outlier_channels"}},
      {"outlier_sketch_dim 12", "qjl", [](qjlkv_config &c) { c.outlier_sketch_dim = 12; }, {"outlier_sketch_dim"}},
      {"outlier_sketch_dim 0 with outlier channels", "qjl",
       [](qjlkv_config &c) {
         c.outlier_channels = 4;
         c.outlier_sketch_dim = 0;
       },
       {"outlier_sketch_dim"}},
      {"initial_layers > num_layers", "qjl", [](qjlkv_config &c) { c.initial_layers = c.num_layers + 1; },
       {"initial_layers"}},
      {"initial_key_sketch_dim 0", "qjl",
       [](qjlkv_config &c) {
         c.initial_layers = 1;
         c.initial_key_sketch_dim = 0;
       },
       {"initial_key_sketch_dim"}},
      {"initial_outlier_sketch_dim 0 with outlier channels", "qjl",
       [](qjlkv_config &c) {
         c.initial_layers = 1;
         c.outlier_channels = 2;
         c.initial_outlier_sketch_dim = 0;
       },
       {"initial_outlier_sketch_dim"}},
      {"key_bits 5", "kivi", [](qjlkv_config &c) { c.key_bits = 5; }, {"key_bits"}},
      {"key_bits 16", "ott", [](qjlkv_config &c) { c.key_bits = 16; }, {"key_bits"}},
      {"outlier_tokens > block_tokens", "ott", [](qjlkv_config &c) { c.outlier_tokens = c.block_tokens + 1; },
       {"outlier_tokens"}},
      {"outlier_spill_tokens 4097", "ott", [](qjlkv_config &c) { c.outlier_spill_tokens = 4097; },
       {"outlier_spill_tokens"}},
      {"outlier_skip_layers > num_layers", "ott", [](qjlkv_config &c) { c.outlier_skip_layers = c.num_layers + 1; },
       {"outlier_skip_layers"}},
      {"value_bits 0", "qjl", [](qjlkv_config &c) { c.value_bits = 0; }, {"value_bits"}},
      {"value_bits 5", "exact", [](qjlkv_config &c) { c.value_bits = 5; }, {"value_bits"}},
      {"value_bits 32", "kivi", [](qjlkv_config &c) { c.value_bits = 32; }, {"value_bits"}},
      {"value_group_size 0", "qjl", [](qjlkv_config &c) { c.value_group_size = 0; }, {"value_group_size"}},
      {"value_group_size 3", "qjl", [](qjlkv_config &c) { c.value_group_size = 3; }, {"value_group_size"}},
      {"value_group_size > head_dim", "qjl", [](qjlkv_config &c) { c.value_group_size = 2 * c.head_dim; },
       {"value_group_size"}},
      {"num_threads 1025", "qjl", [](qjlkv_config &c) { c.num_threads = 1025; }, {"num_threads"}},
  };
  return v;
}

void add_config_rows(std::vector<Row> &t) {
  t.push_back({"qjlkv_config_validate", "cfg NULL", [](World &) { return qjlkv_config_validate(nullptr); },
               {kInvalid}, {"cfg"}});
  t.push_back({"qjlkv_cache_create", "cfg NULL", [](World &w) {
                 qjlkv_cache *c = reinterpret_cast<qjlkv_cache *>(&w);
                 const qjlkv_status s = qjlkv_cache_create(nullptr, &c);
                 if (c != nullptr) w.post_failure = "*out is not NULL after a failure";
                 return s;
               }, {kInvalid}, {"cfg"}});
  t.push_back({"qjlkv_cache_create", "out NULL", [](World &w) { return qjlkv_cache_create(&w.cfg, nullptr); },
               {kInvalid}, {"out"}});
  for (const FieldCase &fc : bad_fields()) {
    const auto edited = [fc](World &w) {
      qjlkv_config cfg = small_config(fc.preset, qt::dtype_of(w.cfg));
      fc.edit(cfg);
      return cfg;
    };
    t.push_back({"qjlkv_config_validate", fc.what, [edited](World &w) {
                   const qjlkv_config cfg = edited(w);
                   return qjlkv_config_validate(&cfg);
                 }, {kInvalid}, fc.names});
    t.push_back({"qjlkv_cache_create", fc.what, [edited](World &w) {
                   const qjlkv_config cfg = edited(w);
                   qjlkv_cache *c = reinterpret_cast<qjlkv_cache *>(&w);
                   const qjlkv_status s = qjlkv_cache_create(&cfg, &c);
                   if (s != QJLKV_OK && c != nullptr) w.post_failure = "*out is not NULL after a failure";
                   if (s == QJLKV_OK) qjlkv_cache_destroy(c);
                   return s;
                 }, {kInvalid}, fc.names});
  }
  // A CUDA ordinal that no machine has: UNSUPPORTED in CPU builds; CUDA builds may say DEVICE
  // or INVALID_ARGUMENT. Either way the message names the device.
  t.push_back({"qjlkv_cache_create", "device 1000000", [](World &w) {
                 qjlkv_config cfg = w.cfg;
                 cfg.backend = QJLKV_BACKEND_CUDA;
                 cfg.device_ordinal = 1000000;
                 qjlkv_cache *c = reinterpret_cast<qjlkv_cache *>(&w);
                 const qjlkv_status s = qjlkv_cache_create(&cfg, &c);
                 if (s != QJLKV_OK && c != nullptr) w.post_failure = "*out is not NULL after a failure";
                 if (s == QJLKV_OK) qjlkv_cache_destroy(c);
                 return s;
               }, {QJLKV_ERROR_UNSUPPORTED, QJLKV_ERROR_DEVICE, kInvalid}, {"device_ordinal"}});
  t.push_back({"qjlkv_cache_destroy", "NULL (a no-op)", [](World &) {
                 qjlkv_cache_destroy(nullptr);
                 return QJLKV_OK;
               }, {QJLKV_OK}, {}});
  t.push_back({"qjlkv_cache_config", "c NULL", [](World &) {
                 qjlkv_config out;
                 out.struct_size = sizeof out;
                 return qjlkv_cache_config(nullptr, &out);
               }, {kInvalid}, {"c"}});
  t.push_back({"qjlkv_cache_config", "out NULL", [](World &w) { return qjlkv_cache_config(w.cache.get(), nullptr); },
               {kInvalid}, {"out"}});
  t.push_back({"qjlkv_cache_set_stream", "c NULL", [](World &) { return qjlkv_cache_set_stream(nullptr, nullptr); },
               {kInvalid}, {"c"}});
  t.push_back({"qjlkv_cache_set_stream", "a stream on a CPU cache", [](World &w) {
                 int not_a_stream = 0;
                 return qjlkv_cache_set_stream(w.cache.get(), &not_a_stream);
               }, {QJLKV_ERROR_UNSUPPORTED}, {"cuda_stream"}});
  t.push_back({"qjlkv_cache_set_stream", "NULL on a CPU cache (valid)",
               [](World &w) { return qjlkv_cache_set_stream(w.cache.get(), nullptr); }, {QJLKV_OK}, {}});
}

void add_append_rows(std::vector<Row> &t, const World &world) {
  const std::string f = "qjlkv_cache_append";
  using Edit = std::function<void(const World &, GuardedBuffer &keys, GuardedBuffer &values)>;
  const auto append = [](uint32_t layer, uint32_t seq, uint32_t n, uint32_t data_tokens, Edit edit) {
    return [=](World &w) {
      auto k = w.token_buffer(data_tokens, 11), v = w.token_buffer(data_tokens, 12);
      if (edit) edit(w, *k, *v);
      return qjlkv_cache_append(w.cache.get(), layer, seq, n, k->data(), v->data());
    };
  };
  t.push_back({f, "c NULL", [](World &w) {
                 auto k = w.token_buffer(1, 1);
                 return qjlkv_cache_append(nullptr, 0, kSeq, 1, k->data(), k->data());
               }, {kInvalid}, {"c"}});
  t.push_back({f, "keys NULL", [](World &w) {
                 auto v = w.token_buffer(1, 1);
                 return qjlkv_cache_append(w.cache.get(), 0, kSeq, 1, nullptr, v->data());
               }, {kInvalid}, {"keys"}});
  t.push_back({f, "values NULL", [](World &w) {
                 auto k = w.token_buffer(1, 1);
                 return qjlkv_cache_append(w.cache.get(), 0, kSeq, 1, k->data(), nullptr);
               }, {kInvalid}, {"values"}});
  t.push_back({f, "layer = num_layers", append(kLayers, kSeq, 1, 1, nullptr), {kInvalid}, {"layer"}});
  t.push_back({f, "layer UINT32_MAX", append(UINT32_MAX, kSeq, 1, 1, nullptr), {kInvalid}, {"layer"}});
  t.push_back({f, "n_tokens 0", append(0, kSeq, 0, 1, nullptr), {kInvalid}, {"n_tokens"}});
  t.push_back({f, "n_tokens 0 on a new sequence", append(0, 50, 0, 1, nullptr), {kInvalid}, {"n_tokens"}});
  // 2^32 - 1 more positions than fit: refused before a byte of the (one-token) data is read.
  t.push_back({f, "n_tokens UINT32_MAX onto a non-empty sequence (overflow)", append(0, kSeq, UINT32_MAX, 1, nullptr),
               {kInvalid}, {"n_tokens"}});
  const size_t last = 3 * world.token_elems - 1;  // the very last element of three tokens
  const auto poke = [](size_t element, float x, bool keys) -> Edit {
    return [=](const World &w, GuardedBuffer &k, GuardedBuffer &v) { w.poke(keys ? k : v, element, x); };
  };
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (uint32_t seq : {kSeq, 50u}) {  // an existing and a new sequence
    const std::string where = seq == kSeq ? " (existing sequence)" : " (new sequence)";
    t.push_back({f, "NaN in the last key" + where, append(0, seq, 3, 3, poke(last, nan, true)), {kInvalid}, {"keys"}});
    t.push_back({f, "+Inf in the first key" + where, append(0, seq, 3, 3, poke(0, inf, true)), {kInvalid}, {"keys"}});
    t.push_back({f, "-Inf in a value" + where, append(0, seq, 3, 3, poke(17, -inf, false)), {kInvalid}, {"values"}});
    t.push_back({f, "NaN in the last value" + where, append(0, seq, 3, 3, poke(last, nan, false)), {kInvalid},
                 {"values"}});
  }
  // A prefill that quantizes blocks, poisoned in its last token only.
  const uint32_t long_n = world.cfg.residual_tokens + 2 * world.cfg.block_tokens;
  t.push_back({f, "NaN in the last value of a prefill that quantizes blocks",
               append(0, 50, long_n, long_n, poke(size_t(long_n) * world.token_elems - 1, nan, false)), {kInvalid},
               {"values"}});
  // Beyond the fp16 range: refused where stored as fp16 (quantized, or 16-bit exact for
  // fp32/fp16 inputs); bf16 inputs of the exact preset are stored as bf16 and accepted.
  if (world.cfg.dtype != QJLKV_DTYPE_F16) {
    const bool exact_bf16 = world.cfg.dtype == QJLKV_DTYPE_BF16 && world.cfg.key_method == QJLKV_KEYS_EXACT;
    const bool values_bf16 = world.cfg.dtype == QJLKV_DTYPE_BF16 && world.cfg.value_bits == 16;
    t.push_back({f, "a key of 70000", append(0, kSeq, 3, 3, poke(5, 70000.0f, true)),
                 {exact_bf16 ? QJLKV_OK : kInvalid}, {"keys"}, true});
    t.push_back({f, "a value of -70000", append(0, kSeq, 3, 3, poke(5, -70000.0f, false)),
                 {values_bf16 ? QJLKV_OK : kInvalid}, {"values"}, true});
  }
  if (world.cfg.key_method == QJLKV_KEYS_QJL) {
    // Every element within fp16, the key's L2 norm (4 x 40000) beyond it: QJL stores norms as fp16.
    t.push_back({f, "a QJL key whose norm exceeds 65504",
                 append(0, kSeq, 2, 2,
                        [](const World &w, GuardedBuffer &k, GuardedBuffer &) {
                          for (size_t j = 0; j < 4; ++j) w.poke(k, w.token_elems + j, 40000.0f);
                        }),
                 {kInvalid}, {"keys"}});
  }
}

void add_append_batch_rows(std::vector<Row> &t) {
  const std::string f = "qjlkv_cache_append_batch";
  const auto batch = [](uint32_t layer, std::vector<uint32_t> seqs, uint32_t n, int poison_value_token) {
    return [=](World &w) {
      const auto count = uint32_t(seqs.size());
      GuardedBuffer ids(count * sizeof(uint32_t));
      std::memcpy(ids.data(), seqs.data(), ids.size());
      auto k = w.token_buffer(count, 21), v = w.token_buffer(count, 22);
      if (poison_value_token >= 0)
        w.poke(*v, size_t(poison_value_token) * w.token_elems + 3, std::numeric_limits<float>::quiet_NaN());
      return qjlkv_cache_append_batch(w.cache.get(), layer, n, ids.as<uint32_t>(), k->data(), v->data());
    };
  };
  t.push_back({f, "c NULL", [](World &w) {
                 const uint32_t seq = kSeq;
                 auto k = w.token_buffer(1, 1);
                 return qjlkv_cache_append_batch(nullptr, 0, 1, &seq, k->data(), k->data());
               }, {kInvalid}, {"c"}});
  t.push_back({f, "seqs NULL", [](World &w) {
                 auto k = w.token_buffer(1, 1);
                 return qjlkv_cache_append_batch(w.cache.get(), 0, 1, nullptr, k->data(), k->data());
               }, {kInvalid}, {"seqs"}});
  t.push_back({f, "keys NULL", [](World &w) {
                 const uint32_t seq = kSeq;
                 auto v = w.token_buffer(1, 1);
                 return qjlkv_cache_append_batch(w.cache.get(), 0, 1, &seq, nullptr, v->data());
               }, {kInvalid}, {"keys"}});
  t.push_back({f, "values NULL", [](World &w) {
                 const uint32_t seq = kSeq;
                 auto k = w.token_buffer(1, 1);
                 return qjlkv_cache_append_batch(w.cache.get(), 0, 1, &seq, k->data(), nullptr);
               }, {kInvalid}, {"values"}});
  t.push_back({f, "layer = num_layers", batch(kLayers, {kSeq, 50}, 2, -1), {kInvalid}, {"layer"}});
  t.push_back({f, "n_seqs 0", batch(0, {kSeq}, 0, -1), {kInvalid}, {"n_seqs"}});
  t.push_back({f, "a duplicate id", batch(0, {50, kSeq, 51, kSeq}, 4, -1), {kInvalid}, {"seqs"}});
  t.push_back({f, "NaN in the value of the last sequence (all-or-nothing)", batch(0, {kSeq, 50, 51}, 3, 2), {kInvalid},
               {"values"}});
}

void add_attend_rows(std::vector<Row> &t, const World &world) {
  const std::string f = "qjlkv_cache_attend";
  const auto attend = [](uint32_t layer, uint32_t seq, uint32_t n, uint32_t data_queries, float scale,
                         long poison_element) {
    return [=](World &w) {
      auto q = w.query_buffer(data_queries);
      auto out = w.output_buffer(data_queries);
      if (poison_element >= 0) w.poke(*q, size_t(poison_element), std::numeric_limits<float>::quiet_NaN());
      return qjlkv_cache_attend(w.cache.get(), layer, seq, n, q->data(), scale, out->data());
    };
  };
  t.push_back({f, "c NULL", [](World &w) {
                 auto q = w.query_buffer(1);
                 auto out = w.output_buffer(1);
                 return qjlkv_cache_attend(nullptr, 0, kSeq, 1, q->data(), 0.0f, out->data());
               }, {kInvalid}, {"c"}});
  t.push_back({f, "queries NULL", [](World &w) {
                 auto out = w.output_buffer(1);
                 return qjlkv_cache_attend(w.cache.get(), 0, kSeq, 1, nullptr, 0.0f, out->data());
               }, {kInvalid}, {"queries"}});
  t.push_back({f, "out NULL", [](World &w) {
                 auto q = w.query_buffer(1);
                 return qjlkv_cache_attend(w.cache.get(), 0, kSeq, 1, q->data(), 0.0f, nullptr);
               }, {kInvalid}, {"out"}});
  t.push_back({f, "layer = num_layers", attend(kLayers, kSeq, 1, 1, 0.0f, -1), {kInvalid}, {"layer"}});
  t.push_back({f, "layer UINT32_MAX", attend(UINT32_MAX, kSeq, 1, 1, 0.0f, -1), {kInvalid}, {"layer"}});
  t.push_back({f, "unknown sequence", attend(0, kUnknownSeq, 1, 1, 0.0f, -1), {kInvalid}, {"seq"}});
  t.push_back({f, "a sequence that exists in another layer only", attend(0, kOtherLayerSeq, 1, 1, 0.0f, -1),
               {kInvalid}, {"seq"}});
  t.push_back({f, "n_queries 0", attend(0, kSeq, 0, 1, 0.0f, -1), {kInvalid}, {"n_queries"}});
  t.push_back({f, "n_queries = length + 1", attend(0, kSeq, world.length + 1, world.length + 1, 0.0f, -1), {kInvalid},
               {"n_queries"}});
  // The library knows the length: it must refuse before reading 2^32 - 1 queries.
  t.push_back({f, "n_queries UINT32_MAX with one query's buffer", attend(0, kSeq, UINT32_MAX, 1, 0.0f, -1), {kInvalid},
               {"n_queries"}});
  t.push_back({f, "n_queries = length (edge, valid)", attend(0, kSeq, world.length, world.length, 0.0f, -1),
               {QJLKV_OK}, {}});
  t.push_back({f, "scale NaN", attend(0, kSeq, 1, 1, std::numeric_limits<float>::quiet_NaN(), -1), {kInvalid},
               {"scale"}});
  t.push_back({f, "scale +Inf", attend(0, kSeq, 1, 1, std::numeric_limits<float>::infinity(), -1), {kInvalid},
               {"scale"}});
  t.push_back({f, "scale -Inf", attend(0, kSeq, 1, 1, -std::numeric_limits<float>::infinity(), -1), {kInvalid},
               {"scale"}});
  t.push_back({f, "scale -1 (selects the default, valid)", attend(0, kSeq, 1, 1, -1.0f, -1), {QJLKV_OK}, {}});
  t.push_back({f, "NaN in the last query element", attend(0, kSeq, 2, 2, 0.0f, long(2 * world.query_elems - 1)),
               {kInvalid}, {"queries"}});

  const std::string b = "qjlkv_cache_attend_batch";
  const auto attend_batch = [](uint32_t layer, std::vector<uint32_t> seqs, uint32_t n, float scale, long poison) {
    return [=](World &w) {
      const auto count = uint32_t(seqs.size());
      GuardedBuffer ids(count * sizeof(uint32_t));
      std::memcpy(ids.data(), seqs.data(), ids.size());
      auto q = w.query_buffer(count);
      auto out = w.output_buffer(count);
      if (poison >= 0) w.poke(*q, size_t(poison), std::numeric_limits<float>::quiet_NaN());
      return qjlkv_cache_attend_batch(w.cache.get(), layer, n, ids.as<uint32_t>(), q->data(), scale, out->data());
    };
  };
  t.push_back({b, "c NULL", [](World &w) {
                 const uint32_t seq = kSeq;
                 auto q = w.query_buffer(1);
                 auto out = w.output_buffer(1);
                 return qjlkv_cache_attend_batch(nullptr, 0, 1, &seq, q->data(), 0.0f, out->data());
               }, {kInvalid}, {"c"}});
  t.push_back({b, "seqs NULL", [](World &w) {
                 auto q = w.query_buffer(1);
                 auto out = w.output_buffer(1);
                 return qjlkv_cache_attend_batch(w.cache.get(), 0, 1, nullptr, q->data(), 0.0f, out->data());
               }, {kInvalid}, {"seqs"}});
  t.push_back({b, "queries NULL", [](World &w) {
                 const uint32_t seq = kSeq;
                 auto out = w.output_buffer(1);
                 return qjlkv_cache_attend_batch(w.cache.get(), 0, 1, &seq, nullptr, 0.0f, out->data());
               }, {kInvalid}, {"queries"}});
  t.push_back({b, "out NULL", [](World &w) {
                 const uint32_t seq = kSeq;
                 auto q = w.query_buffer(1);
                 return qjlkv_cache_attend_batch(w.cache.get(), 0, 1, &seq, q->data(), 0.0f, nullptr);
               }, {kInvalid}, {"out"}});
  t.push_back({b, "layer = num_layers", attend_batch(kLayers, {kSeq}, 1, 0.0f, -1), {kInvalid}, {"layer"}});
  t.push_back({b, "n_seqs 0", attend_batch(0, {kSeq}, 0, 0.0f, -1), {kInvalid}, {"n_seqs"}});
  t.push_back({b, "an unknown sequence among known ones", attend_batch(0, {kSeq, kUnknownSeq, kSeq}, 3, 0.0f, -1),
               {kInvalid}, {"seq", "seqs"}});
  t.push_back({b, "scale NaN", attend_batch(0, {kSeq}, 1, std::numeric_limits<float>::quiet_NaN(), -1), {kInvalid},
               {"scale"}});
  t.push_back({b, "NaN in the second query", attend_batch(0, {kSeq, kSeq}, 2, 0.0f, long(world.query_elems + 1)),
               {kInvalid}, {"queries"}});
  t.push_back({b, "a repeated sequence (valid)", attend_batch(0, {kSeq, kSeq}, 2, 0.0f, -1), {QJLKV_OK}, {}});
}

void add_query_rows(std::vector<Row> &t, const World &world) {
  const std::string f = "qjlkv_cache_scores";
  const size_t needed = size_t(world.cfg.num_q_heads) * world.length;
  const auto scores = [](uint32_t layer, uint32_t seq, size_t out_len, long poison) {
    return [=](World &w) {
      auto q = w.query_buffer(1);
      if (poison >= 0) w.poke(*q, size_t(poison), std::numeric_limits<float>::infinity());
      GuardedBuffer out(out_len * sizeof(float));
      return qjlkv_cache_scores(w.cache.get(), layer, seq, q->data(), out.as<float>(), out_len);
    };
  };
  t.push_back({f, "c NULL", [](World &w) {
                 auto q = w.query_buffer(1);
                 float out[64];
                 return qjlkv_cache_scores(nullptr, 0, kSeq, q->data(), out, 64);
               }, {kInvalid}, {"c"}});
  t.push_back({f, "query NULL", [needed](World &w) {
                 std::vector<float> out(needed);
                 return qjlkv_cache_scores(w.cache.get(), 0, kSeq, nullptr, out.data(), out.size());
               }, {kInvalid}, {"query"}});
  t.push_back({f, "out NULL", [needed](World &w) {
                 auto q = w.query_buffer(1);
                 return qjlkv_cache_scores(w.cache.get(), 0, kSeq, q->data(), nullptr, needed);
               }, {kInvalid}, {"out"}});
  t.push_back({f, "layer = num_layers", scores(kLayers, kSeq, needed, -1), {kInvalid}, {"layer"}});
  t.push_back({f, "unknown sequence", scores(0, kUnknownSeq, needed, -1), {kInvalid}, {"seq"}});
  t.push_back({f, "out_len one short", scores(0, kSeq, needed - 1, -1), {kInvalid}, {"out_len"}});
  t.push_back({f, "out_len 0", scores(0, kSeq, 0, -1), {kInvalid}, {"out_len"}});
  t.push_back({f, "Inf in the query", scores(0, kSeq, needed, long(world.query_elems - 1)), {kInvalid}, {"query"}});
  t.push_back({f, "out_len exact (edge, valid)", scores(0, kSeq, needed, -1), {QJLKV_OK}, {}});

  const std::string r = "qjlkv_cache_reconstruct";
  // Outputs of exactly `buffer_tokens` tokens end at a guard page: nothing may be written past them.
  const auto reconstruct = [](uint32_t layer, uint32_t seq, uint64_t first, uint64_t count, uint32_t buffer_tokens,
                              bool keys, bool values) {
    return [=](World &w) {
      GuardedBuffer k(buffer_tokens * w.token_elems * sizeof(float)), v(buffer_tokens * w.token_elems * sizeof(float));
      return qjlkv_cache_reconstruct(w.cache.get(), layer, seq, first, count, keys ? k.as<float>() : nullptr,
                                     values ? v.as<float>() : nullptr);
    };
  };
  const uint64_t len = world.length;
  t.push_back({r, "c NULL", [](World &) {
                 float k[1024];
                 return qjlkv_cache_reconstruct(nullptr, 0, kSeq, 0, 1, k, nullptr);
               }, {kInvalid}, {"c"}});
  t.push_back({r, "keys_out and values_out NULL", reconstruct(0, kSeq, 0, 1, 1, false, false), {kInvalid},
               {"keys_out", "values_out"}});
  t.push_back({r, "layer = num_layers", reconstruct(kLayers, kSeq, 0, 1, 1, true, true), {kInvalid}, {"layer"}});
  t.push_back({r, "count 0", reconstruct(0, kSeq, 0, 0, 1, true, true), {kInvalid}, {"count"}});
  t.push_back({r, "first = length", reconstruct(0, kSeq, len, 1, 1, true, true), {kInvalid}, {"first", "count"}});
  t.push_back({r, "first + count = length + 1", reconstruct(0, kSeq, 1, len, 1, true, true), {kInvalid},
               {"first", "count"}});
  t.push_back({r, "unknown sequence", reconstruct(0, kUnknownSeq, 0, 1, 1, true, true), {kInvalid},
               {"first", "count", "seq"}});
  t.push_back({r, "first UINT64_MAX (overflow)", reconstruct(0, kSeq, UINT64_MAX, 2, 1, true, true), {kInvalid},
               {"first", "count"}});
  t.push_back({r, "count UINT64_MAX (overflow)", reconstruct(0, kSeq, 1, UINT64_MAX, 1, true, false), {kInvalid},
               {"first", "count"}});
  t.push_back({r, "the last position, values only (edge, valid)", reconstruct(0, kSeq, len - 1, 1, 1, false, true),
               {QJLKV_OK}, {}});
  t.push_back({r, "every position, keys only (edge, valid)", reconstruct(0, kSeq, 0, len, world.length, true, false),
               {QJLKV_OK}, {}});

  const std::string l = "qjlkv_cache_length";
  t.push_back({l, "c NULL", [](World &) {
                 uint64_t n;
                 return qjlkv_cache_length(nullptr, 0, kSeq, &n);
               }, {kInvalid}, {"c"}});
  t.push_back({l, "out NULL", [](World &w) { return qjlkv_cache_length(w.cache.get(), 0, kSeq, nullptr); },
               {kInvalid}, {"out"}});
  t.push_back({l, "layer = num_layers", [](World &w) {
                 uint64_t n;
                 return qjlkv_cache_length(w.cache.get(), kLayers, kSeq, &n);
               }, {kInvalid}, {"layer"}});
  t.push_back({l, "unknown sequence (valid: 0)", [](World &w) {
                 uint64_t n = 99;
                 const qjlkv_status s = qjlkv_cache_length(w.cache.get(), 0, kUnknownSeq, &n);
                 if (n != 0) w.post_failure = "length of an unknown sequence is not 0";
                 return s;
               }, {QJLKV_OK}, {}});

  const std::string sk = "qjlkv_cache_sketch";
  const bool qjl = world.cfg.key_method == QJLKV_KEYS_QJL;
  t.push_back({sk, "c NULL", [](World &) {
                 const qjlkv_sketch *s;
                 return qjlkv_cache_sketch(nullptr, 0, &s);
               }, {kInvalid}, {"c"}});
  t.push_back({sk, "out NULL", [](World &w) { return qjlkv_cache_sketch(w.cache.get(), 0, nullptr); }, {kInvalid},
               {"out"}});
  t.push_back({sk, "layer = num_layers", [](World &w) {
                 const qjlkv_sketch *s;
                 return qjlkv_cache_sketch(w.cache.get(), kLayers, &s);
               }, {kInvalid}, {"layer"}});
  t.push_back({sk, qjl ? "layer 1 (valid)" : "a cache without a sketch", [](World &w) {
                 const qjlkv_sketch *s;
                 return qjlkv_cache_sketch(w.cache.get(), 1, &s);
               }, {qjl ? QJLKV_OK : QJLKV_ERROR_UNSUPPORTED}, {"key_method"}});

  t.push_back({"qjlkv_cache_clear_sequence", "c NULL", [](World &) { return qjlkv_cache_clear_sequence(nullptr, 1); },
               {kInvalid}, {"c"}});
  t.push_back({"qjlkv_cache_clear_sequence", "unknown sequence (valid, a no-op)",
               [](World &w) { return qjlkv_cache_clear_sequence(w.cache.get(), kUnknownSeq); }, {QJLKV_OK}, {}});

  const std::string st = "qjlkv_cache_stats";
  const auto stats = [](uint32_t struct_size, size_t buffer) {
    return [=](World &w) {
      GuardedBuffer out(buffer);
      std::memset(out.data(), 0, buffer);
      std::memcpy(out.data(), &struct_size, sizeof struct_size);
      return qjlkv_cache_stats(w.cache.get(), out.as<qjlkv_stats>());
    };
  };
  // 0.1's draft of the struct stopped after bits_per_number; no release shipped that size.
  constexpr uint32_t kDraftSize = offsetof(qjlkv_stats, bytes_keys_quantized);
  t.push_back({st, "c NULL", [](World &) {
                 qjlkv_stats out{};
                 out.struct_size = sizeof out;
                 return qjlkv_cache_stats(nullptr, &out);
               }, {kInvalid}, {"c"}});
  t.push_back({st, "out NULL", [](World &w) { return qjlkv_cache_stats(w.cache.get(), nullptr); }, {kInvalid},
               {"out"}});
  t.push_back({st, "struct_size 0", stats(0, sizeof(qjlkv_stats)), {kInvalid}, {"struct_size"}});
  t.push_back({st, "struct_size of a draft that never shipped", stats(kDraftSize, sizeof(qjlkv_stats)), {kInvalid},
               {"struct_size"}});
  t.push_back({st, "struct_size larger than the library's", stats(sizeof(qjlkv_stats) + 8, sizeof(qjlkv_stats) + 8),
               {kInvalid}, {"struct_size"}});
  t.push_back({st, "struct_size of 0.1 (valid)", stats(QJLKV_STATS_SIZE_0_1, QJLKV_STATS_SIZE_0_1), {QJLKV_OK}, {}});

  t.push_back({"qjlkv_status_string", "a value outside the enum", [](World &w) {
                 const char *s = qjlkv_status_string(static_cast<qjlkv_status>(6));
                 if (std::string(s) != "QJLKV_ERROR_INTERNAL") w.post_failure = "status 6 is not QJLKV_ERROR_INTERNAL";
                 s = qjlkv_test_status_string_of_int(1000);  // from C: an int outside the enum
                 if (s == nullptr || std::string(s) != "unknown status") w.post_failure = "status 1000 is not unknown";
                 return QJLKV_OK;
               }, {QJLKV_OK}, {}});
}

// Sequence operations: truncate, fork, bytes_needed, sequence_bytes.
void add_sequence_rows(std::vector<Row> &t, const World &world) {
  const std::string tr = "qjlkv_cache_truncate", fk = "qjlkv_cache_fork", bn = "qjlkv_cache_bytes_needed",
                    sb = "qjlkv_cache_sequence_bytes";
  const uint64_t length = world.length;
  t.push_back({tr, "c NULL", [](World &) { return qjlkv_cache_truncate(nullptr, kSeq, 1); }, {kInvalid}, {"c"}});
  t.push_back({tr, "length above the sequence's", [length](World &w) {
                 return qjlkv_cache_truncate(w.cache.get(), kSeq, length + 1);
               }, {kInvalid}, {"length"}});
  t.push_back({tr, "length UINT64_MAX", [](World &w) { return qjlkv_cache_truncate(w.cache.get(), kSeq, UINT64_MAX); },
               {kInvalid}, {"length"}});
  t.push_back({tr, "unknown sequence, length 1", [](World &w) {
                 return qjlkv_cache_truncate(w.cache.get(), kUnknownSeq, 1);
               }, {kInvalid}, {"length"}});
  t.push_back({tr, "its own length (valid, a no-op)", [length](World &w) {
                 return qjlkv_cache_truncate(w.cache.get(), kSeq, length);
               }, {QJLKV_OK}, {}});
  t.push_back({fk, "c NULL", [](World &) { return qjlkv_cache_fork(nullptr, kSeq, kUnknownSeq, 1); }, {kInvalid},
               {"c"}});
  t.push_back({fk, "dst_seq == src_seq", [](World &w) { return qjlkv_cache_fork(w.cache.get(), kSeq, kSeq, 1); },
               {kInvalid}, {"src_seq", "dst_seq"}});
  t.push_back({fk, "dst_seq holds tokens", [](World &w) {
                 return qjlkv_cache_fork(w.cache.get(), kSeq, kOtherLayerSeq, 1);
               }, {kInvalid}, {"dst_seq"}});
  t.push_back({fk, "length above src_seq's", [length](World &w) {
                 return qjlkv_cache_fork(w.cache.get(), kSeq, kUnknownSeq, length + 1);
               }, {kInvalid}, {"length"}});
  t.push_back({fk, "unknown src_seq", [](World &w) { return qjlkv_cache_fork(w.cache.get(), 99, kUnknownSeq, 1); },
               {kInvalid}, {"length"}});
  t.push_back({fk, "length 0 (valid, a no-op)", [](World &w) {
                 return qjlkv_cache_fork(w.cache.get(), kSeq, kUnknownSeq, 0);
               }, {QJLKV_OK}, {}});
  t.push_back({bn, "c NULL", [](World &) {
                 uint64_t out;
                 return qjlkv_cache_bytes_needed(nullptr, kSeq, 1, &out);
               }, {kInvalid}, {"c"}});
  t.push_back({bn, "out NULL", [](World &w) { return qjlkv_cache_bytes_needed(w.cache.get(), kSeq, 1, nullptr); },
               {kInvalid}, {"out"}});
  t.push_back({bn, "n_tokens beyond 2^32 - 1 positions", [](World &w) {
                 GuardedBuffer out(sizeof(uint64_t));
                 return qjlkv_cache_bytes_needed(w.cache.get(), kSeq, UINT32_MAX, out.as<uint64_t>());
               }, {kInvalid}, {"n_tokens"}});
  t.push_back({bn, "n_tokens 0 (valid: 0 bytes)", [](World &w) {
                 GuardedBuffer out(sizeof(uint64_t));
                 const qjlkv_status s = qjlkv_cache_bytes_needed(w.cache.get(), kSeq, 0, out.as<uint64_t>());
                 if (*out.as<uint64_t>() != 0) w.post_failure = "0 tokens need bytes";
                 return s;
               }, {QJLKV_OK}, {}});
  t.push_back({sb, "c NULL", [](World &) {
                 uint64_t bytes, shared;
                 return qjlkv_cache_sequence_bytes(nullptr, kSeq, &bytes, &shared);
               }, {kInvalid}, {"c"}});
  t.push_back({sb, "both outputs NULL (valid)", [](World &w) {
                 return qjlkv_cache_sequence_bytes(w.cache.get(), kSeq, nullptr, nullptr);
               }, {QJLKV_OK}, {}});
  t.push_back({sb, "unknown sequence (valid: 0 and 0)", [](World &w) {
                 GuardedBuffer out(2 * sizeof(uint64_t));
                 std::memset(out.data(), 0xff, out.size());
                 const qjlkv_status s =
                     qjlkv_cache_sequence_bytes(w.cache.get(), kUnknownSeq, out.as<uint64_t>(), out.as<uint64_t>() + 1);
                 if (out.as<uint64_t>()[0] != 0 || out.as<uint64_t>()[1] != 0) w.post_failure = "not 0 and 0";
                 return s;
               }, {QJLKV_OK}, {}});
}

// Export and import (docs/FORMAT.md): every argument class; the import rows use a valid stream
// of seq 1, exported when the row runs.
std::vector<uint8_t> stream_of(World &w, uint32_t seq) {
  uint64_t size = 0;
  if (qjlkv_cache_export_size(w.cache.get(), seq, 0, kLayers, &size) != QJLKV_OK) return {};
  std::vector<uint8_t> bytes(size);
  if (qjlkv_cache_export(w.cache.get(), seq, 0, kLayers, bytes.data(), size) != QJLKV_OK) return {};
  return bytes;
}

void add_serialize_rows(std::vector<Row> &t) {
  const std::string es = "qjlkv_cache_export_size", ex = "qjlkv_cache_export", xs = "qjlkv_cache_export_stream";
  const std::string im = "qjlkv_cache_import", is = "qjlkv_cache_import_stream";
  const auto size_of = [](uint32_t seq, uint32_t first, uint32_t count) {
    return [=](World &w) {
      uint64_t size;
      return qjlkv_cache_export_size(w.cache.get(), seq, first, count, &size);
    };
  };
  t.push_back({es, "c NULL", [](World &) {
                 uint64_t size;
                 return qjlkv_cache_export_size(nullptr, kSeq, 0, 1, &size);
               }, {kInvalid}, {"c"}});
  t.push_back({es, "size NULL", [](World &w) { return qjlkv_cache_export_size(w.cache.get(), kSeq, 0, 1, nullptr); },
               {kInvalid}, {"size"}});
  t.push_back({es, "num_layers 0", size_of(kSeq, 0, 0), {kInvalid}, {"num_layers"}});
  t.push_back({es, "first_layer + num_layers > num_layers", size_of(kSeq, 1, kLayers), {kInvalid}, {"first_layer"}});
  t.push_back({es, "first_layer + num_layers overflowing", size_of(kSeq, 1, UINT32_MAX), {kInvalid}, {"first_layer"}});
  t.push_back({es, "unknown sequence", size_of(kUnknownSeq, 0, kLayers), {kInvalid}, {"seq"}});
  t.push_back({es, "a layer range where the sequence is empty", size_of(kOtherLayerSeq, 0, 1), {kInvalid}, {"seq"}});
  t.push_back({es, "a range with one empty layer (valid)", size_of(kOtherLayerSeq, 0, kLayers), {QJLKV_OK}, {}});
  t.push_back({ex, "buf NULL", [](World &w) { return qjlkv_cache_export(w.cache.get(), kSeq, 0, 1, nullptr, 1 << 30); },
               {kInvalid}, {"buf"}});
  t.push_back({ex, "buf_size one byte short", [](World &w) {
                 uint64_t size = 0;
                 (void)qjlkv_cache_export_size(w.cache.get(), kSeq, 0, kLayers, &size);
                 GuardedBuffer out(size - 1);
                 return qjlkv_cache_export(w.cache.get(), kSeq, 0, kLayers, out.data(), size - 1);
               }, {kInvalid}, {"buf_size"}});
  t.push_back({xs, "write NULL", [](World &w) {
                 return qjlkv_cache_export_stream(w.cache.get(), kSeq, 0, kLayers, nullptr, nullptr);
               }, {kInvalid}, {"write"}});
  t.push_back({xs, "a write callback that refuses", [](World &w) {
                 return qjlkv_cache_export_stream(
                     w.cache.get(), kSeq, 0, kLayers, [](void *, const void *, size_t) -> size_t { return 0; }, nullptr);
               }, {kInvalid}, {"write"}});
  t.push_back({im, "c NULL", [](World &w) {
                 const std::vector<uint8_t> s = stream_of(w, kSeq);
                 return qjlkv_cache_import(nullptr, kUnknownSeq, s.data(), s.size());
               }, {kInvalid}, {"c"}});
  t.push_back({im, "buf NULL", [](World &w) { return qjlkv_cache_import(w.cache.get(), kUnknownSeq, nullptr, 128); },
               {kInvalid}, {"buf"}});
  t.push_back({im, "not a stream", [](World &w) {
                 GuardedBuffer junk(200);
                 std::memset(junk.data(), 0x5a, 200);
                 return qjlkv_cache_import(w.cache.get(), kUnknownSeq, junk.data(), 200);
               }, {QJLKV_ERROR_CORRUPT_DATA}, {"magic"}});
  t.push_back({im, "a sequence that holds tokens", [](World &w) {
                 const std::vector<uint8_t> s = stream_of(w, kSeq);
                 return qjlkv_cache_import(w.cache.get(), kSeq, s.data(), s.size());
               }, {kInvalid}, {"seq"}});
  t.push_back({im, "size one byte short", [](World &w) {
                 const std::vector<uint8_t> s = stream_of(w, kSeq);
                 return qjlkv_cache_import(w.cache.get(), kUnknownSeq, s.data(), s.size() - 1);
               }, {QJLKV_ERROR_CORRUPT_DATA}, {"truncated"}});
  t.push_back({im, "a new sequence (valid)", [](World &w) {
                 const std::vector<uint8_t> s = stream_of(w, kSeq);
                 return qjlkv_cache_import(w.cache.get(), kUnknownSeq, s.data(), s.size());
               }, {QJLKV_OK}, {}, true});
  t.push_back({is, "read NULL", [](World &w) {
                 return qjlkv_cache_import_stream(w.cache.get(), kUnknownSeq, nullptr, nullptr);
               }, {kInvalid}, {"read"}});
  t.push_back({is, "a stream that ends at once", [](World &w) {
                 return qjlkv_cache_import_stream(
                     w.cache.get(), kUnknownSeq, [](void *, void *, size_t) -> size_t { return 0; }, nullptr);
               }, {QJLKV_ERROR_CORRUPT_DATA}, {"truncated"}});
}

std::vector<Row> table(const World &world) {
  std::vector<Row> t;
  add_sketch_rows(t);
  add_config_init_rows(t);
  add_config_rows(t);
  add_append_rows(t, world);
  add_append_batch_rows(t);
  add_attend_rows(t, world);
  add_query_rows(t, world);
  add_serialize_rows(t);
  add_sequence_rows(t, world);
  return t;
}

// ---- the tests -------------------------------------------------------------------------------
struct Variant {
  const char *preset;
  qjlkv_dtype dtype;
  friend void PrintTo(const Variant &v, std::ostream *os) { *os << v.preset << ", dtype " << int(v.dtype); }
};

class BadInput : public ::testing::TestWithParam<Variant> {};

TEST_P(BadInput, EveryFunctionEveryArgumentClass) {
  World w;
  w.cfg = small_config(GetParam().preset, GetParam().dtype);
  qjlkv_cache *c = nullptr;
  QT_ASSERT_OK(qjlkv_cache_create(&w.cfg, &c));
  w.cache.reset(c);
  w.io = dtype_bytes(qt::dtype_of(w.cfg));
  w.token_elems = size_t(w.cfg.num_kv_heads) * w.cfg.head_dim;
  w.query_elems = size_t(w.cfg.num_q_heads) * w.cfg.head_dim;
  w.length = w.cfg.residual_tokens + 2 * w.cfg.block_tokens + 3;  // blocks and a tail
  QT_ASSERT_OK(append_tokens(c, w.cfg, 0, kSeq, w.length, 1));
  QT_ASSERT_OK(append_tokens(c, w.cfg, 1, kOtherLayerSeq, 4, 2));

  const std::vector<Row> rows = table(w);
  size_t failures = 0;
  for (const Row &row : rows) {
    const std::string problem = run_isolated(w, row);
    if (!problem.empty()) {
      ++failures;
      ADD_FAILURE() << row.function << " / " << row.what << ": " << problem;
    }
  }
  // The table itself must have had rows of every public function.
  std::set<std::string> functions;
  for (const Row &row : rows) functions.insert(row.function);
  EXPECT_GE(functions.size(), 30u);
  std::printf("%zu rows, %zu failed, %zu functions\n", rows.size(), failures, functions.size());
}

INSTANTIATE_TEST_SUITE_P(Presets, BadInput,
                         ::testing::Values(Variant{"qjl", QJLKV_DTYPE_F32}, Variant{"qjl", QJLKV_DTYPE_BF16},
                                           Variant{"kivi", QJLKV_DTYPE_F32}, Variant{"ott", QJLKV_DTYPE_F16},
                                           Variant{"exact", QJLKV_DTYPE_F32}, Variant{"exact", QJLKV_DTYPE_BF16}),
                         [](const ::testing::TestParamInfo<Variant> &info) {
                           const qjlkv_dtype t = info.param.dtype;
                           return std::string(info.param.preset) + "_" +
                                  (t == QJLKV_DTYPE_F32 ? "f32" : t == QJLKV_DTYPE_F16 ? "f16" : "bf16");
                         });

}  // namespace
}  // namespace qjlkv_test
