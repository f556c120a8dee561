// qjlkv._qjlkv: the thin pybind11 layer over the C ABI of include/qjlkv/qjlkv.h.
//
// Tensors come in as numpy arrays (read through numpy's own array interface, which also
// covers ml_dtypes' bfloat16) or as any DLPack producer (torch tensors on CPU or CUDA).
// Their data pointer is handed to the C library as is: nothing is ever copied, so an input
// whose dtype, shape, layout or device does not fit is an error, not a conversion.
// Every call that touches tensor data runs with the GIL released, so each cache handle has a
// mutex of its own (see Handle): calls on one cache from several Python threads run one after
// another, and close() waits for the call in flight.
#include <pybind11/native_enum.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qjlkv/qjlkv.h"

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------------------
// Errors: a status from the C library, or a check of this layer, becomes an instance of
// qjlkv.Error's subclass for that status, with the message and the status attached.
// ---------------------------------------------------------------------------
struct StatusError {
  qjlkv_status status;
  std::string message;
  bool type_error = false;  // wrong Python type or dtype: raised as qjlkv.InvalidType (a TypeError)
};

[[noreturn]] void fail_argument(std::string message) {
  throw StatusError{QJLKV_ERROR_INVALID_ARGUMENT, std::move(message), false};
}
[[noreturn]] void fail_type(std::string message) {
  throw StatusError{QJLKV_ERROR_INVALID_ARGUMENT, std::move(message), true};
}

void check(qjlkv_status status) {
  if (status != QJLKV_OK) throw StatusError{status, qjlkv_last_error_message(), false};
}

// Runs a C call with the GIL released; the thread-local error message is read afterwards on
// the same thread.
template <class Call>
void call_nogil(Call &&call) {
  qjlkv_status status;
  {
    py::gil_scoped_release release;
    status = call();
  }
  check(status);
}

// A cache handle shared by the Python Cache and the sketches it lends. `lock` is held for the
// whole of a call on the handle (argument checks done), so calls from several Python threads
// are serialized; it is only ever waited for with the GIL released, so a thread that holds it
// and needs the GIL (to allocate an output, or after the C call) cannot deadlock with one that
// waits. `cache` is null once closed; it is read and written under `lock` only.
struct Handle {
  std::mutex lock;
  qjlkv_cache *cache = nullptr;
};

// Holds a handle's lock for one call; fails (nothing locked) if the cache is closed.
class Session {
 public:
  Session(Handle &handle, const char *closed_message = "the cache is closed") : handle_(handle) {
    if (!handle_.lock.try_lock()) {
      py::gil_scoped_release release;
      handle_.lock.lock();
    }
    if (!handle_.cache) {
      handle_.lock.unlock();
      fail_argument(closed_message);
    }
  }
  Session(const Session &) = delete;
  Session &operator=(const Session &) = delete;
  ~Session() { handle_.lock.unlock(); }
  qjlkv_cache *cache() const { return handle_.cache; }

 private:
  Handle &handle_;
};

struct ErrorClasses {
  py::object base, invalid_argument, invalid_type, out_of_memory, unsupported, device, corrupt_data, internal,
      memory_budget;
};
ErrorClasses *g_errors = nullptr;  // module lifetime; created once in PYBIND11_MODULE

py::object error_class(const StatusError &e) {
  if (e.type_error) return g_errors->invalid_type;
  switch (e.status) {
    case QJLKV_ERROR_INVALID_ARGUMENT: return g_errors->invalid_argument;
    case QJLKV_ERROR_OUT_OF_MEMORY: return g_errors->out_of_memory;
    case QJLKV_ERROR_UNSUPPORTED: return g_errors->unsupported;
    case QJLKV_ERROR_DEVICE: return g_errors->device;
    case QJLKV_ERROR_CORRUPT_DATA: return g_errors->corrupt_data;
    case QJLKV_ERROR_INTERNAL: return g_errors->internal;
    case QJLKV_ERROR_MEMORY_BUDGET: return g_errors->memory_budget;
    default: return g_errors->base;
  }
}

py::object make_error_class(py::module_ &m, const char *name, const char *doc, std::vector<py::object> bases) {
  py::tuple base_tuple(bases.size());
  for (size_t i = 0; i < bases.size(); ++i) base_tuple[i] = bases[i];
  const std::string qualified = std::string("qjlkv.") + name;
  PyObject *cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, base_tuple.ptr(), nullptr);
  if (!cls) throw py::error_already_set();
  py::object obj = py::reinterpret_steal<py::object>(cls);
  m.attr(name) = obj;
  return obj;
}

// ---------------------------------------------------------------------------
// Names
// ---------------------------------------------------------------------------
std::string type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

const char *dtype_name(qjlkv_dtype d) {
  switch (d) {
    case QJLKV_DTYPE_F32: return "float32";
    case QJLKV_DTYPE_F16: return "float16";
    case QJLKV_DTYPE_BF16: return "bfloat16";
  }
  return "unknown";
}

std::string device_name(int device) { return device < 0 ? "cpu" : "cuda:" + std::to_string(device); }

std::string shape_string(const std::vector<int64_t> &shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// ---------------------------------------------------------------------------
// Tensor views
// ---------------------------------------------------------------------------
// The minimal DLPack ABI (dlpack.h v0.8, "dltensor" capsules), declared here to avoid a
// build dependency; it is stable by design.
struct DLDevice { int32_t device_type; int32_t device_id; };
struct DLDataType { uint8_t code; uint8_t bits; uint16_t lanes; };
struct DLTensor {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(DLManagedTensor *self);
};
constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;
constexpr uint8_t kDLFloat = 2, kDLBfloat = 4;

// A borrowed, dense, row-major tensor: the pointer the C library receives.
struct TensorView {
  void *data = nullptr;
  qjlkv_dtype dtype = QJLKV_DTYPE_F32;
  std::vector<int64_t> shape;
  int device = -1;     // -1 = host memory, >= 0 = CUDA device ordinal
  py::object keep;     // the array or DLPack capsule that owns the memory during the call
};

bool is_row_major(const std::vector<int64_t> &shape, const int64_t *strides, int64_t elem_size, bool in_bytes) {
  if (!strides) return true;
  for (int64_t extent : shape)
    if (extent == 0) return true;  // empty: nothing is read (numpy gives such arrays zero strides)
  int64_t expected = in_bytes ? elem_size : 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

TensorView view_numpy(const py::array &arr, const char *name, bool writable) {
  TensorView v;
  const py::dtype dt = arr.dtype();
  const std::string dt_name = py::str(dt.attr("name"));
  if (dt_name == "float32") v.dtype = QJLKV_DTYPE_F32;
  else if (dt_name == "float16") v.dtype = QJLKV_DTYPE_F16;
  else if (dt_name == "bfloat16" && dt.itemsize() == 2) v.dtype = QJLKV_DTYPE_BF16;
  else fail_type(std::string(name) + " has dtype " + dt_name + "; expected float32, float16 or bfloat16");
  v.shape.assign(arr.shape(), arr.shape() + arr.ndim());
  if (!is_row_major(v.shape, arr.strides(), static_cast<int64_t>(dt.itemsize()), true))
    fail_argument(std::string(name) + " is not C-contiguous (shape " + shape_string(v.shape) +
                  "); pass a contiguous array, e.g. numpy.ascontiguousarray(" + name + ")");
  if (writable && !arr.writeable()) fail_argument(std::string(name) + " is a read-only array");
  v.data = const_cast<void *>(arr.data());
  v.device = -1;
  v.keep = arr;
  return v;
}

TensorView view_dlpack(py::handle obj, const char *name, py::object stream) {
  TensorView v;
  py::object capsule;
  try {
    const py::tuple dev = obj.attr("__dlpack_device__")();
    const int device_type = dev[0].cast<int>();
    // A CUDA producer orders its pending work before the consumer's stream.
    capsule = device_type == kDLCUDA || device_type == kDLCUDAManaged
                  ? obj.attr("__dlpack__")(py::arg("stream") = stream)
                  : obj.attr("__dlpack__")();
  } catch (py::error_already_set &e) {
    fail_argument(std::string(name) + " cannot be exported through DLPack: " + type_name(e.value()) + ": " +
                  std::string(py::str(e.value())));
  }
  auto *managed = static_cast<DLManagedTensor *>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (!managed) {
    PyErr_Clear();
    fail_argument(std::string(name) + ": __dlpack__() did not return a \"dltensor\" capsule");
  }
  const DLTensor &t = managed->dl_tensor;
  if (t.dtype.lanes == 1 && t.dtype.code == kDLFloat && t.dtype.bits == 32) v.dtype = QJLKV_DTYPE_F32;
  else if (t.dtype.lanes == 1 && t.dtype.code == kDLFloat && t.dtype.bits == 16) v.dtype = QJLKV_DTYPE_F16;
  else if (t.dtype.lanes == 1 && t.dtype.code == kDLBfloat && t.dtype.bits == 16) v.dtype = QJLKV_DTYPE_BF16;
  else
    fail_type(std::string(name) + " has DLPack dtype (code " + std::to_string(t.dtype.code) + ", bits " +
              std::to_string(t.dtype.bits) + ", lanes " + std::to_string(t.dtype.lanes) +
              "); expected float32, float16 or bfloat16");
  v.shape.assign(t.shape, t.shape + t.ndim);
  if (!is_row_major(v.shape, t.strides, 1, false))
    fail_argument(std::string(name) + " is not contiguous (shape " + shape_string(v.shape) +
                  "); pass a contiguous tensor, e.g. " + name + ".contiguous()");
  switch (t.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost: v.device = -1; break;
    case kDLCUDA:
    case kDLCUDAManaged: v.device = t.device.device_id; break;
    default:
      fail_argument(std::string(name) + " lives on DLPack device type " + std::to_string(t.device.device_type) +
                    "; only CPU and CUDA memory are supported");
  }
  v.data = static_cast<char *>(t.data) + t.byte_offset;
  v.keep = capsule;  // the capsule's destructor releases the producer's reference
  return v;
}

TensorView view_of(py::handle obj, const char *name, bool writable = false, py::object stream = py::none()) {
  if (py::isinstance<py::array>(obj)) return view_numpy(py::reinterpret_borrow<py::array>(obj), name, writable);
  if (py::hasattr(obj, "__dlpack__") && py::hasattr(obj, "__dlpack_device__")) return view_dlpack(obj, name, stream);
  fail_type(std::string(name) + " is a " + type_name(obj) +
            "; expected a numpy array or a DLPack tensor (e.g. torch.Tensor)");
}

// ---------------------------------------------------------------------------
// Integers
// ---------------------------------------------------------------------------
// Python integers (and numpy integers) only: bool, float and str are type errors.
long long to_integer(py::handle obj, const std::string &name, long long lo, long long hi) {
  if (PyBool_Check(obj.ptr()) || !PyIndex_Check(obj.ptr()))
    fail_type(name + " must be an integer, got " + type_name(obj));
  const py::int_ value = py::reinterpret_steal<py::int_>(PyNumber_Index(obj.ptr()));
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (overflow || v < lo || v > hi)
    fail_argument(name + " is " + std::string(py::str(value)) + ", must be in [" + std::to_string(lo) + ", " +
                  std::to_string(hi) + "]");
  return v;
}

uint32_t to_u32(py::handle obj, const std::string &name) {
  return static_cast<uint32_t>(to_integer(obj, name, 0, UINT32_MAX));
}

uint64_t to_u64(py::handle obj, const std::string &name) {
  if (PyBool_Check(obj.ptr()) || !PyIndex_Check(obj.ptr()))
    fail_type(name + " must be an integer, got " + type_name(obj));
  const py::int_ value = py::reinterpret_steal<py::int_>(PyNumber_Index(obj.ptr()));
  const unsigned long long v = PyLong_AsUnsignedLongLong(value.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    fail_argument(name + " is " + std::string(py::str(value)) + ", must be in [0, 18446744073709551615]");
  }
  return v;
}

// The attention scale argument: None is 1/sqrt(head_dim) (the C library's 0), anything else
// must be a finite number > 0.
float scale_of(py::handle obj) {
  if (obj.is_none()) return 0.0f;
  if (PyBool_Check(obj.ptr()) || !(PyFloat_Check(obj.ptr()) || PyIndex_Check(obj.ptr()) ||
                                   py::hasattr(obj, "__float__")))
    fail_type("scale must be a number or None, got " + type_name(obj));
  const double value = PyFloat_AsDouble(obj.ptr());
  if (value == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  const auto scale = static_cast<float>(value);
  if (!(scale > 0.0f) || !std::isfinite(scale))
    fail_argument("scale is " + std::string(py::str(obj)) +
                  ", must be a finite number > 0 (None means 1/sqrt(head_dim))");
  return scale;
}

std::vector<uint32_t> to_u32_list(py::handle obj, const char *name) {
  if (py::isinstance<py::str>(obj) || !py::isinstance<py::iterable>(obj))
    fail_type(std::string(name) + " must be a sequence of integers");
  std::vector<uint32_t> out;
  size_t i = 0;
  for (py::handle item : obj) {
    out.push_back(to_u32(item, std::string(name) + "[" + std::to_string(i++) + "]"));
  }
  return out;
}

// ---------------------------------------------------------------------------
// Config and stats: tables of the C structs' fields, so the Python side sees plain dicts.
// ---------------------------------------------------------------------------
enum class Kind { U32, U64, ENUM, DEVICE };
struct Field {
  const char *name;
  size_t offset;
  Kind kind;
};
#define QJLKV_FIELD(f, kind) Field{#f, offsetof(qjlkv_config, f), Kind::kind}
const Field kConfigFields[] = {
    QJLKV_FIELD(num_layers, U32),
    QJLKV_FIELD(num_q_heads, U32),
    QJLKV_FIELD(num_kv_heads, U32),
    QJLKV_FIELD(head_dim, U32),
    QJLKV_FIELD(dtype, ENUM),
    // Python's `device` (-1 = CPU, >= 0 = CUDA ordinal, as torch says "cpu" / "cuda:N") stands for
    // the C fields backend and device_ordinal.
    {"device", offsetof(qjlkv_config, device_ordinal), Kind::DEVICE},
    QJLKV_FIELD(seed, U64),
    QJLKV_FIELD(sketch_flags, U32),
    QJLKV_FIELD(key_method, ENUM),
    QJLKV_FIELD(block_tokens, U32),
    QJLKV_FIELD(residual_tokens, U32),
    QJLKV_FIELD(key_sketch_dim, U32),
    QJLKV_FIELD(outlier_channels, U32),
    QJLKV_FIELD(outlier_sketch_dim, U32),
    QJLKV_FIELD(initial_layers, U32),
    QJLKV_FIELD(initial_key_sketch_dim, U32),
    QJLKV_FIELD(initial_outlier_sketch_dim, U32),
    QJLKV_FIELD(key_bits, U32),
    QJLKV_FIELD(outlier_tokens, U32),
    QJLKV_FIELD(outlier_spill_tokens, U32),
    QJLKV_FIELD(outlier_skip_layers, U32),
    QJLKV_FIELD(value_bits, U32),
    QJLKV_FIELD(value_group_size, U32),
    QJLKV_FIELD(num_threads, U32),
    QJLKV_FIELD(value_method, U32),
    QJLKV_FIELD(sink_tokens, U32),
    QJLKV_FIELD(memory_budget, U64),
    QJLKV_FIELD(rollback_tokens, U32),
    QJLKV_FIELD(key_token_bits, U32),
};
#undef QJLKV_FIELD
// Fails to compile when the header grows qjlkv_config: the table above must list the new field.
constexpr size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
static_assert(sizeof(qjlkv_config) ==
                  round_up(offsetof(qjlkv_config, key_token_bits) + sizeof(uint32_t), alignof(qjlkv_config)),
              "qjlkv_config has fields that kConfigFields does not list");

py::dict config_to_dict(const qjlkv_config &cfg) {
  py::dict d;
  const auto *base = reinterpret_cast<const char *>(&cfg);
  for (const Field &f : kConfigFields) {
    const char *p = base + f.offset;
    switch (f.kind) {
      case Kind::U32: { uint32_t v; std::memcpy(&v, p, sizeof v); d[f.name] = v; break; }
      case Kind::U64: { uint64_t v; std::memcpy(&v, p, sizeof v); d[f.name] = v; break; }
      case Kind::ENUM: { uint32_t v; std::memcpy(&v, p, sizeof v); d[f.name] = v; break; }
      case Kind::DEVICE:
        d[f.name] = cfg.backend == QJLKV_BACKEND_CUDA ? static_cast<long long>(cfg.device_ordinal) : -1LL;
        break;
    }
  }
  return d;
}

// Every field must be present: the Python Config always starts from qjlkv_config_init.
qjlkv_config config_from_dict(const py::dict &d) {
  qjlkv_config cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.struct_size = sizeof cfg;
  auto *base = reinterpret_cast<char *>(&cfg);
  for (const Field &f : kConfigFields) {
    const std::string name = std::string("config.") + f.name;
    if (!d.contains(f.name)) fail_argument(name + " is missing");
    const py::handle value = d[f.name];
    char *p = base + f.offset;
    switch (f.kind) {
      case Kind::U32: { const auto v = static_cast<uint32_t>(to_integer(value, name, 0, UINT32_MAX)); std::memcpy(p, &v, sizeof v); break; }
      case Kind::U64: { const uint64_t v = to_u64(value, name); std::memcpy(p, &v, sizeof v); break; }
      // Any int a caller writes, as C would store it (the library names the field if it is wrong).
      case Kind::ENUM: { const auto v = static_cast<uint32_t>(to_integer(value, name, INT32_MIN, UINT32_MAX)); std::memcpy(p, &v, sizeof v); break; }
      case Kind::DEVICE: {
        const long long device = to_integer(value, name, INT32_MIN, INT32_MAX);
        if (device < -1) fail_argument(name + " is " + std::to_string(device) + ", must be -1 (CPU) or a CUDA device ordinal >= 0");
        cfg.backend = device < 0 ? QJLKV_BACKEND_CPU : QJLKV_BACKEND_CUDA;
        cfg.device_ordinal = device < 0 ? 0u : static_cast<uint32_t>(device);
        break;
      }
    }
  }
  return cfg;
}

py::dict stats_to_dict(const qjlkv_stats &s) {
  py::dict d;
  d["tokens"] = s.tokens;
  d["bytes_used"] = s.bytes_used;
  d["bytes_reserved"] = s.bytes_reserved;
  d["bytes_fp16_equivalent"] = s.bytes_fp16_equivalent;
  d["bits_per_number"] = s.bits_per_number;
  d["bytes_keys_quantized"] = s.bytes_keys_quantized;
  d["bytes_values_quantized"] = s.bytes_values_quantized;
  d["bytes_full_precision"] = s.bytes_full_precision;
  d["bytes_metadata"] = s.bytes_metadata;
  d["bytes_rollback"] = s.bytes_rollback;
  d["bytes_shared"] = s.bytes_shared;
  return d;
}
static_assert(sizeof(qjlkv_stats) == round_up(offsetof(qjlkv_stats, bytes_shared) + sizeof(uint64_t), 8),
              "qjlkv_stats has fields that stats_to_dict does not list");

// ---------------------------------------------------------------------------
// Sketch
// ---------------------------------------------------------------------------
// qjlkv_workers: worker threads several caches can share (Cache.set_workers). The library keeps
// them alive for every cache that uses them, so this object may go first.
class Workers {
 public:
  explicit Workers(py::handle num_threads_obj) {
    const uint32_t num_threads = to_u32(num_threads_obj, "num_threads");
    qjlkv_workers *w = nullptr;
    call_nogil([&] { return qjlkv_workers_create(num_threads, &w); });
    workers_ = w;
  }
  Workers(const Workers &) = delete;
  Workers &operator=(const Workers &) = delete;
  ~Workers() { qjlkv_workers_destroy(workers_); }
  qjlkv_workers *get() const { return workers_; }

 private:
  qjlkv_workers *workers_ = nullptr;
};

class Sketch {
 public:
  Sketch(py::handle head_dim_obj, py::handle sketch_dim_obj, py::handle seed_obj, bool orthogonal) {
    const uint32_t head_dim = to_u32(head_dim_obj, "head_dim"), sketch_dim = to_u32(sketch_dim_obj, "sketch_dim");
    const uint64_t seed = to_u64(seed_obj, "seed");
    qjlkv_sketch *s = nullptr;
    call_nogil([&] {
      return qjlkv_sketch_create(head_dim, sketch_dim, seed, orthogonal ? QJLKV_SKETCH_ORTHOGONAL : 0u, &s);
    });
    sketch_ = s;
    owned_ = true;
    init_shape();
  }
  // A cache's borrowed sketch: `owner` keeps the cache object alive as long as this one, and
  // `handle` makes its calls wait for the cache's and fail once the cache is closed.
  Sketch(const qjlkv_sketch *borrowed, std::shared_ptr<Handle> handle, py::object owner)
      : sketch_(borrowed), handle_(std::move(handle)), owner_(std::move(owner)) {
    const Session session(*handle_, "the cache that lent this sketch is closed");
    init_shape();
  }
  Sketch(const Sketch &) = delete;
  Sketch &operator=(const Sketch &) = delete;
  ~Sketch() {
    if (owned_) qjlkv_sketch_destroy(const_cast<qjlkv_sketch *>(sketch_));
  }

  py::array_t<float> matrix() const {
    py::array_t<float> out({static_cast<py::ssize_t>(rows_), static_cast<py::ssize_t>(cols_)});
    float *data = out.mutable_data();
    const size_t len = static_cast<size_t>(rows_) * cols_;
    // A lent sketch lives in its cache: holding the cache's lock keeps it from being freed.
    std::optional<Session> session;
    if (handle_) session.emplace(*handle_, "the cache that lent this sketch is closed");
    call_nogil([&] { return qjlkv_sketch_matrix(sketch_, data, len); });
    return out;
  }
  py::tuple shape() const { return py::make_tuple(rows_, cols_); }
  bool owned() const { return owned_; }

 private:
  void init_shape() { check(qjlkv_sketch_shape(sketch_, &rows_, &cols_)); }
  const qjlkv_sketch *sketch_ = nullptr;
  bool owned_ = false;
  std::shared_ptr<Handle> handle_;  // null for an owned sketch
  py::object owner_;
  uint32_t rows_ = 0, cols_ = 0;
};

// ---------------------------------------------------------------------------
// Python files as the C library's stream callbacks (qjlkv_write_fn, qjlkv_read_fn)
// ---------------------------------------------------------------------------
// Calls write(bytes) for each piece; an exception it raises is kept, the piece counts as
// unwritten (which stops the export), and rethrow() raises it after the call.
class PythonWriter {
 public:
  explicit PythonWriter(py::object write) : write_(std::move(write)) {}
  static size_t callback(void *user, const void *data, size_t size) {
    auto *self = static_cast<PythonWriter *>(user);
    py::gil_scoped_acquire gil;
    try {
      const py::object taken = self->write_(py::bytes(static_cast<const char *>(data), size));
      // file.write returns the count (or None for some streams, meaning all of it).
      const size_t count = taken.is_none() ? size : taken.cast<size_t>();
      self->written_ += count;
      return count;
    } catch (py::error_already_set &e) {
      self->error_ = std::make_unique<py::error_already_set>(std::move(e));
      return 0;
    }
  }
  void rethrow() {
    if (error_) throw std::move(*error_);
  }
  uint64_t written() const { return written_; }

 private:
  py::object write_;
  uint64_t written_ = 0;
  std::unique_ptr<py::error_already_set> error_;
};

// Fills each request through reader.readinto(memoryview), or reader.read(n), until it is full or
// the file ends; an exception is kept like PythonWriter's.
class PythonReader {
 public:
  explicit PythonReader(const py::object &reader) {
    if (py::hasattr(reader, "readinto")) readinto_ = reader.attr("readinto");
    else if (py::hasattr(reader, "read")) read_ = reader.attr("read");
    else fail_type("file is a " + type_name(reader) + "; expected an object with readinto() or read()");
  }
  static size_t callback(void *user, void *data, size_t size) {
    auto *self = static_cast<PythonReader *>(user);
    py::gil_scoped_acquire gil;
    size_t done = 0;
    try {
      while (done < size) {
        const size_t got = self->read_some(static_cast<char *>(data) + done, size - done);
        if (got == 0) break;  // end of file
        done += got;
      }
    } catch (py::error_already_set &e) {
      self->error_ = std::make_unique<py::error_already_set>(std::move(e));
      return 0;
    }
    return done;
  }
  void rethrow() {
    if (error_) throw std::move(*error_);
  }

 private:
  size_t read_some(char *data, size_t size) {
    if (readinto_) {
      py::object view =
          py::reinterpret_steal<py::object>(PyMemoryView_FromMemory(data, Py_ssize_t(size), PyBUF_WRITE));
      if (!view) throw py::error_already_set();
      const py::object n = readinto_(view);
      view.attr("release")();
      return n.is_none() ? 0 : n.cast<size_t>();
    }
    const py::bytes chunk = read_(size);
    const std::string_view bytes = chunk;
    const size_t got = std::min(bytes.size(), size);
    std::memcpy(data, bytes.data(), got);
    return got;
  }

  py::object readinto_, read_;
  std::unique_ptr<py::error_already_set> error_;
};

// ---------------------------------------------------------------------------
// Cache
// ---------------------------------------------------------------------------
class Cache {
 public:
  explicit Cache(const py::dict &config) {
    const qjlkv_config cfg = config_from_dict(config);
    qjlkv_cache *c = nullptr;
    call_nogil([&] { return qjlkv_cache_create(&cfg, &c); });
    handle_->cache = c;
    cfg_.struct_size = sizeof cfg_;
    check(qjlkv_cache_config(c, &cfg_));
  }
  Cache(const Cache &) = delete;
  Cache &operator=(const Cache &) = delete;
  // No call can be in flight: each holds a reference to this object.
  ~Cache() { qjlkv_cache_destroy(handle_->cache); }

  // Waits for a call in flight on another thread, then frees the cache; later calls raise.
  void close() {
    py::gil_scoped_release release;
    const std::lock_guard<std::mutex> guard(handle_->lock);
    qjlkv_cache_destroy(handle_->cache);
    handle_->cache = nullptr;
  }
  bool closed() const {
    py::gil_scoped_release release;
    const std::lock_guard<std::mutex> guard(handle_->lock);
    return handle_->cache == nullptr;
  }

  py::dict config() const { return config_to_dict(cfg_); }

  // stream: an integer cudaStream_t (0 = default stream) or None.
  void set_stream(py::object stream) {
    uintptr_t handle = 0;
    if (!stream.is_none()) {
      handle = static_cast<uintptr_t>(to_u64(stream, "stream"));
    }
    const Session session(*handle_);
    check(qjlkv_cache_set_stream(session.cache(), reinterpret_cast<void *>(handle)));
    // DLPack wants the consumer's stream: 1 stands for the legacy default stream.
    dlpack_stream_ = handle == 0 ? py::object(py::int_(1)) : py::object(py::int_(handle));
  }

  // workers: a Workers object or None (the cache's own threads). The argument keeps the object,
  // hence the handle, alive while the cache's lock is awaited.
  void set_workers(py::object workers) {
    if (!workers.is_none() && !py::isinstance<Workers>(workers))
      fail_type("workers must be a qjlkv.Workers or None, got " + type_name(workers));
    qjlkv_workers *w = workers.is_none() ? nullptr : workers.cast<const Workers &>().get();
    const Session session(*handle_);
    check(qjlkv_cache_set_workers(session.cache(), w));
  }

  // qjlkv_cache_set_layer_attention. logit_softcap: a number (the library checks its range);
  // sink_logits: None or a 1-D float32 numpy array of num_q_heads (qjlkv.Cache converts any
  // array-like first), copied by the library during the call.
  void set_layer_attention(py::handle layer, py::handle softcap_obj, py::handle sinks_obj, py::handle window_obj) {
    const uint32_t l = to_u32(layer, "layer"), window = to_u32(window_obj, "window_tokens");
    if (PyBool_Check(softcap_obj.ptr()) || !(PyFloat_Check(softcap_obj.ptr()) || PyIndex_Check(softcap_obj.ptr()) ||
                                             py::hasattr(softcap_obj, "__float__")))
      fail_type("logit_softcap must be a number, got " + type_name(softcap_obj));
    const double softcap = PyFloat_AsDouble(softcap_obj.ptr());
    if (softcap == -1.0 && PyErr_Occurred()) throw py::error_already_set();
    py::array_t<float> sinks;
    if (!sinks_obj.is_none()) {
      if (!py::isinstance<py::array>(sinks_obj))
        fail_type("sink_logits is a " + type_name(sinks_obj) + "; expected None or a numpy float32 array");
      const auto arr = py::reinterpret_borrow<py::array>(sinks_obj);
      const std::string dt_name = py::str(arr.dtype().attr("name"));
      if (dt_name != "float32" || !arr.dtype().attr("isnative").cast<bool>())
        fail_type("sink_logits has dtype " + std::string(py::str(arr.dtype())) + "; expected native float32");
      const std::vector<int64_t> shape(arr.shape(), arr.shape() + arr.ndim());
      if (shape != std::vector<int64_t>{cfg_.num_q_heads})
        fail_argument("sink_logits has shape " + shape_string(shape) + ", expected (num_q_heads,) = (" +
                      std::to_string(cfg_.num_q_heads) + ",)");
      if (!is_row_major(shape, arr.strides(), sizeof(float), true))
        fail_argument("sink_logits is not contiguous; pass numpy.ascontiguousarray(sink_logits)");
      sinks = py::reinterpret_borrow<py::array_t<float>>(arr);
    }
    qjlkv_layer_attention attention;
    std::memset(&attention, 0, sizeof attention);
    attention.struct_size = sizeof attention;
    // A double beyond the float range becomes an infinity, which the library refuses by name.
    constexpr float kInf = std::numeric_limits<float>::infinity();
    attention.logit_softcap = std::fabs(softcap) > double(std::numeric_limits<float>::max())
                                  ? (softcap > 0 ? kInf : -kInf)
                                  : static_cast<float>(softcap);
    attention.sink_logits = sinks_obj.is_none() ? nullptr : sinks.data();
    attention.window_tokens = window;
    const Session session(*handle_);
    qjlkv_cache *c = session.cache();
    call_nogil([&] { return qjlkv_cache_set_layer_attention(c, l, &attention); });
  }

  void append(py::handle layer, py::handle seq, py::handle keys, py::handle values) {
    const uint32_t l = to_u32(layer, "layer"), s = to_u32(seq, "seq");
    const TensorView k = input(keys, "keys"), v = input(values, "values");
    const uint32_t n = tokens_of(k, cfg_.num_kv_heads, "keys", "num_kv_heads");
    expect_shape(v, n, cfg_.num_kv_heads, k.shape.size() == 2, "values", "keys");
    const Session session(*handle_);
    qjlkv_cache *c = session.cache();
    call_nogil([&] { return qjlkv_cache_append(c, l, s, n, k.data, v.data); });
  }

  void attend(py::handle layer, py::handle seq, py::handle queries, py::handle scale_obj, py::handle out) {
    const uint32_t l = to_u32(layer, "layer"), s = to_u32(seq, "seq");
    const float scale = scale_of(scale_obj);
    const TensorView q = input(queries, "queries");
    const uint32_t n = tokens_of(q, cfg_.num_q_heads, "queries", "num_q_heads");
    const TensorView o = input(out, "out", true);
    expect_shape(o, n, cfg_.num_q_heads, q.shape.size() == 2, "out", "queries");
    const Session session(*handle_);
    qjlkv_cache *c = session.cache();
    call_nogil([&] { return qjlkv_cache_attend(c, l, s, n, q.data, scale, o.data); });
  }

  void append_batch(py::handle layer, py::handle seqs, py::handle keys, py::handle values) {
    const uint32_t l = to_u32(layer, "layer");
    const std::vector<uint32_t> ids = to_u32_list(seqs, "seqs");
    const TensorView k = input(keys, "keys"), v = input(values, "values");
    expect_batch_shape(k, ids.size(), cfg_.num_kv_heads, "keys", "num_kv_heads");
    expect_batch_shape(v, ids.size(), cfg_.num_kv_heads, "values", "num_kv_heads");
    const Session session(*handle_);
    qjlkv_cache *c = session.cache();
    const auto n = static_cast<uint32_t>(ids.size());
    call_nogil([&] { return qjlkv_cache_append_batch(c, l, n, ids.data(), k.data, v.data); });
  }

  void attend_batch(py::handle layer, py::handle seqs, py::handle queries, py::handle scale_obj, py::handle out) {
    const uint32_t l = to_u32(layer, "layer");
    const float scale = scale_of(scale_obj);
    const std::vector<uint32_t> ids = to_u32_list(seqs, "seqs");
    const TensorView q = input(queries, "queries");
    expect_batch_shape(q, ids.size(), cfg_.num_q_heads, "queries", "num_q_heads");
    const TensorView o = input(out, "out", true);
    expect_batch_shape(o, ids.size(), cfg_.num_q_heads, "out", "num_q_heads");
    const Session session(*handle_);
    qjlkv_cache *c = session.cache();
    const auto n = static_cast<uint32_t>(ids.size());
    call_nogil([&] { return qjlkv_cache_attend_batch(c, l, n, ids.data(), q.data, scale, o.data); });
  }

  py::array_t<float> scores(py::handle layer, py::handle seq, py::handle query) {
    const uint32_t l = to_u32(layer, "layer"), s = to_u32(seq, "seq");
    const TensorView q = input(query, "query");
    const bool one_token = q.shape.size() == 3 && q.shape[0] == 1;
    if (!(q.shape.size() == 2 || one_token) || q.shape[q.shape.size() - 2] != cfg_.num_q_heads ||
        q.shape.back() != cfg_.head_dim)
      fail_argument("query has shape " + shape_string(q.shape) + ", expected (num_q_heads, head_dim) = (" +
                    std::to_string(cfg_.num_q_heads) + ", " + std::to_string(cfg_.head_dim) + ")");
    // Held from the length to the scores, so another thread's append cannot come in between.
    const Session session(*handle_);
    qjlkv_cache *c = session.cache();
    const uint64_t len = length_of(c, l, s);
    py::array_t<float> out({static_cast<py::ssize_t>(cfg_.num_q_heads), static_cast<py::ssize_t>(len)});
    float *data = out.mutable_data();
    const size_t out_len = static_cast<size_t>(cfg_.num_q_heads) * len;
    call_nogil([&] { return qjlkv_cache_scores(c, l, s, q.data, data, out_len); });
    return out;
  }

  // Positions [first, first + count) as float32 host arrays (count, num_kv_heads, head_dim);
  // count None = up to the end. Either output can be skipped (returned as None).
  py::tuple reconstruct(py::handle layer, py::handle seq, py::handle first_obj, py::handle count_obj, bool want_keys,
                        bool want_values) {
    const uint32_t l = to_u32(layer, "layer"), s = to_u32(seq, "seq");
    const uint64_t first = to_u64(first_obj, "first");
    const bool to_end = count_obj.is_none();
    const uint64_t count_arg = to_end ? 0 : to_u64(count_obj, "count");
    // Held from the length to the reconstruction, so another thread's append cannot come in between.
    const Session session(*handle_);
    qjlkv_cache *c = session.cache();
    const uint64_t len = length_of(c, l, s);
    const uint64_t count = to_end ? (first < len ? len - first : 0) : count_arg;
    const std::vector<py::ssize_t> shape = {static_cast<py::ssize_t>(count), static_cast<py::ssize_t>(cfg_.num_kv_heads),
                                            static_cast<py::ssize_t>(cfg_.head_dim)};
    // The range is checked here too, since the outputs are allocated before the call.
    if (first >= len || count > len - first)
      fail_argument("positions [first, first + count) = [" + std::to_string(first) + ", " + std::to_string(first) +
                    " + " + std::to_string(count) + ") are outside seq " + std::to_string(s) + " of layer " +
                    std::to_string(l) + ", which holds " + std::to_string(len) + " tokens");
    if (count == 0) fail_argument("count is 0, must be >= 1");
    py::object keys = py::none(), values = py::none();
    float *k = nullptr, *v = nullptr;
    if (want_keys) {
      py::array_t<float> a(shape);
      k = a.mutable_data();
      keys = a;
    }
    if (want_values) {
      py::array_t<float> a(shape);
      v = a.mutable_data();
      values = a;
    }
    call_nogil([&] { return qjlkv_cache_reconstruct(c, l, s, first, count, k, v); });
    return py::make_tuple(keys, values);
  }

  uint64_t length(py::handle layer, py::handle seq) const {
    const uint32_t l = to_u32(layer, "layer"), s = to_u32(seq, "seq");
    const Session session(*handle_);
    return length_of(session.cache(), l, s);
  }

  void clear(py::handle seq) {
    const uint32_t s = to_u32(seq, "seq");
    const Session session(*handle_);
    qjlkv_cache *c = session.cache();
    call_nogil([&] { return qjlkv_cache_clear_sequence(c, s); });
  }

  // ---- sequence operations (qjlkv_cache_truncate, _fork, _bytes_needed, _sequence_bytes) ----
  void truncate(py::handle seq, py::handle length) {
    const uint32_t s = to_u32(seq, "seq");
    const uint64_t n = to_u64(length, "length");
    const Session session(*handle_);
    qjlkv_cache *c = session.cache();
    call_nogil([&] { return qjlkv_cache_truncate(c, s, n); });
  }

  // length None: the whole of src_seq (its longest layer).
  void fork(py::handle src_seq, py::handle dst_seq, py::handle length) {
    const uint32_t src = to_u32(src_seq, "src_seq"), dst = to_u32(dst_seq, "dst_seq");
    const bool whole = length.is_none();
    const uint64_t n = whole ? UINT64_MAX : to_u64(length, "length");
    const Session session(*handle_);
    qjlkv_cache *c = session.cache();
    uint64_t count = n;
    if (whole) {
      count = 0;
      for (uint32_t l = 0; l < cfg_.num_layers; ++l) count = std::max(count, length_of(c, l, src));
    }
    call_nogil([&] { return qjlkv_cache_fork(c, src, dst, count); });
  }

  uint64_t bytes_needed(py::handle seq, py::handle n_tokens) const {
    const uint32_t s = to_u32(seq, "seq"), n = to_u32(n_tokens, "n_tokens");
    const Session session(*handle_);
    uint64_t out = 0;
    check(qjlkv_cache_bytes_needed(session.cache(), s, n, &out));
    return out;
  }

  py::tuple sequence_bytes(py::handle seq) const {
    const uint32_t s = to_u32(seq, "seq");
    const Session session(*handle_);
    uint64_t bytes = 0, shared = 0;
    check(qjlkv_cache_sequence_bytes(session.cache(), s, &bytes, &shared));
    return py::make_tuple(bytes, shared);
  }

  py::dict stats() const {
    qjlkv_stats s;
    std::memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    const Session session(*handle_);
    check(qjlkv_cache_stats(session.cache(), &s));
    return stats_to_dict(s);
  }

  // ---- export / import (qjlkv_cache_export*, qjlkv_cache_import*) ----
  py::bytes export_bytes(py::handle seq, py::handle first_layer, py::handle num_layers) const {
    const uint32_t s = to_u32(seq, "seq"), f = to_u32(first_layer, "first_layer"), n = to_u32(num_layers, "num_layers");
    const Session session(*handle_);
    const qjlkv_cache *c = session.cache();
    uint64_t size = 0;
    call_nogil([&] { return qjlkv_cache_export_size(c, s, f, n, &size); });
    if (size > uint64_t(PY_SSIZE_T_MAX)) throw std::bad_alloc();
    PyObject *raw = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(size));
    if (!raw) throw py::error_already_set();
    py::bytes out = py::reinterpret_steal<py::bytes>(raw);
    char *data = PyBytes_AS_STRING(raw);
    call_nogil([&] { return qjlkv_cache_export(c, s, f, n, data, size); });
    return out;
  }

  // Hands the stream to write(bytes) in pieces; returns the bytes written. An exception raised
  // by write() stops the export and propagates.
  uint64_t export_to(py::handle seq, py::handle first_layer, py::handle num_layers, py::object write) const {
    const uint32_t s = to_u32(seq, "seq"), f = to_u32(first_layer, "first_layer"), n = to_u32(num_layers, "num_layers");
    PythonWriter sink(std::move(write));
    const Session session(*handle_);
    const qjlkv_cache *c = session.cache();
    qjlkv_status status;
    {
      py::gil_scoped_release release;
      status = qjlkv_cache_export_stream(c, s, f, n, PythonWriter::callback, &sink);
    }
    sink.rethrow();
    check(status);
    return sink.written();
  }

  // Any C-contiguous buffer (bytes, bytearray, memoryview, numpy uint8, mmap): read in place.
  void import_bytes(py::handle seq, py::handle data) {
    const uint32_t s = to_u32(seq, "seq");
    if (!PyObject_CheckBuffer(data.ptr()))
      fail_type("data is a " + type_name(data) + "; expected bytes or another object with the buffer protocol");
    Py_buffer view;
    if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
    struct Release {
      Py_buffer *v;
      ~Release() { PyBuffer_Release(v); }
    } release{&view};
    const Session session(*handle_);
    qjlkv_cache *c = session.cache();
    const void *bytes = view.buf ? view.buf : static_cast<const void *>("");
    const uint64_t size = uint64_t(view.len);
    call_nogil([&] { return qjlkv_cache_import(c, s, bytes, size); });
  }

  // Reads one stream through reader.readinto(memoryview) (or reader.read(n)): exactly the
  // stream's bytes, so several streams can follow each other in one file.
  void import_from(py::handle seq, py::object reader) {
    const uint32_t s = to_u32(seq, "seq");
    PythonReader source(reader);
    const Session session(*handle_);
    qjlkv_cache *c = session.cache();
    qjlkv_status status;
    {
      py::gil_scoped_release release;
      status = qjlkv_cache_import_stream(c, s, PythonReader::callback, &source);
    }
    source.rethrow();
    check(status);
  }

  const qjlkv_sketch *sketch(py::handle layer) const {
    const uint32_t l = to_u32(layer, "layer");
    const qjlkv_sketch *s = nullptr;
    const Session session(*handle_);
    check(qjlkv_cache_sketch(session.cache(), l, &s));
    return s;
  }
  const std::shared_ptr<Handle> &handle() const { return handle_; }

  // The pointer this layer would pass to the C library for `obj` (tests use it to show that
  // inputs are never copied).
  static uintptr_t data_pointer(py::handle obj) { return reinterpret_cast<uintptr_t>(view_of(obj, "tensor").data); }

 private:
  static uint64_t length_of(qjlkv_cache *c, uint32_t layer, uint32_t seq) {
    uint64_t n = 0;
    check(qjlkv_cache_length(c, layer, seq, &n));
    return n;
  }

  TensorView input(py::handle obj, const char *name, bool writable = false) const {
    TensorView v = view_of(obj, name, writable, dlpack_stream_);
    if (v.dtype != cfg_.dtype)
      fail_type(std::string(name) + " has dtype " + dtype_name(v.dtype) + ", the cache's dtype (config.dtype) is " +
                dtype_name(static_cast<qjlkv_dtype>(cfg_.dtype)));
    const int device = cfg_.backend == QJLKV_BACKEND_CUDA ? static_cast<int>(cfg_.device_ordinal) : -1;
    if (v.device != device)
      fail_argument(std::string(name) + " is on " + device_name(v.device) + ", the cache is on " +
                    device_name(device) + " (config.device = " + std::to_string(device) + ")");
    return v;
  }

  // Accepts (n, heads, head_dim), or (heads, head_dim) for a single token; returns n.
  uint32_t tokens_of(const TensorView &v, uint32_t heads, const char *name, const char *heads_name) const {
    const auto &s = v.shape;
    const bool ok = (s.size() == 3 && s[1] == heads && s[2] == cfg_.head_dim && s[0] >= 1 && s[0] <= UINT32_MAX) ||
                    (s.size() == 2 && s[0] == heads && s[1] == cfg_.head_dim);
    if (!ok)
      fail_argument(std::string(name) + " has shape " + shape_string(s) + ", expected (n_tokens, " + heads_name +
                    ", head_dim) = (n, " + std::to_string(heads) + ", " + std::to_string(cfg_.head_dim) +
                    ") with n >= 1, or (" + heads_name + ", head_dim) for one token");
    return s.size() == 3 ? static_cast<uint32_t>(s[0]) : 1u;
  }

  void expect_shape(const TensorView &v, uint32_t n, uint32_t heads, bool single, const char *name,
                    const char *like) const {
    const std::vector<int64_t> want = single ? std::vector<int64_t>{heads, cfg_.head_dim}
                                             : std::vector<int64_t>{n, heads, cfg_.head_dim};
    if (v.shape != want)
      fail_argument(std::string(name) + " has shape " + shape_string(v.shape) + ", expected " + shape_string(want) +
                    " to match " + like);
  }

  void expect_batch_shape(const TensorView &v, size_t n_seqs, uint32_t heads, const char *name,
                          const char *heads_name) const {
    const std::vector<int64_t> want{static_cast<int64_t>(n_seqs), heads, cfg_.head_dim};
    if (v.shape != want)
      fail_argument(std::string(name) + " has shape " + shape_string(v.shape) + ", expected (len(seqs), " +
                    heads_name + ", head_dim) = " + shape_string(want));
  }

  std::shared_ptr<Handle> handle_ = std::make_shared<Handle>();
  qjlkv_config cfg_{};
  py::object dlpack_stream_ = py::int_(1);
};

}  // namespace

// ext/c_calls.c: qjlkv_status_string of any int, converted to the enum in C.
extern "C" const char *qjlkv_py_status_string(int status);

// A library older than the header this module was compiled with lacks functions, fields or
// enumerators the module uses: refuse it at import, before any call.
void require_library_version(unsigned runtime) {
  if (runtime >= QJLKV_VERSION_NUMBER) return;
  throw py::import_error("qjlkv: the libqjlkv loaded at run time has version number " + std::to_string(runtime) +
                         ", older than the " + std::to_string(QJLKV_VERSION_NUMBER) +
                         " (MAJOR*10000 + MINOR*100 + PATCH) of the header this module was built with; "
                         "install a libqjlkv at least that new, or rebuild the module against the one you have");
}

PYBIND11_MODULE(_qjlkv, m) {
  m.doc() = "Low-level bindings of the libqjlkv C ABI; use the qjlkv package instead.";
  require_library_version(qjlkv_version_number());
  m.def("_require_library_version", &require_library_version, py::arg("runtime"),
        "The import-time check, for tests: raises ImportError when runtime < HEADER_VERSION_NUMBER.");

  // Error classes are created here so C++ can raise them; qjlkv/__init__.py re-exports them.
  static ErrorClasses errors;
  const py::object builtins = py::module_::import("builtins");
  errors.base = make_error_class(m, "Error", "Base class of every error raised by qjlkv; .status is a qjlkv.Status.",
                                 {builtins.attr("Exception")});
  errors.invalid_argument = make_error_class(
      m, "InvalidArgument", "A bad argument: size, range, shape, layout, device, config field or data.",
      {errors.base, builtins.attr("ValueError")});
  errors.invalid_type = make_error_class(m, "InvalidType", "An argument of the wrong Python type or dtype.",
                                         {errors.invalid_argument, builtins.attr("TypeError")});
  errors.out_of_memory =
      make_error_class(m, "OutOfMemory", "An allocation failed; nothing changed.", {errors.base, builtins.attr("MemoryError")});
  errors.unsupported =
      make_error_class(m, "Unsupported", "Valid, but not available in this build or on this machine.",
                       {errors.base, builtins.attr("NotImplementedError")});
  errors.device = make_error_class(m, "DeviceError", "The CUDA runtime reported an error.",
                                   {errors.base, builtins.attr("RuntimeError")});
  errors.corrupt_data = make_error_class(m, "CorruptData", "Internal state failed a consistency check.",
                                         {errors.base, builtins.attr("RuntimeError")});
  errors.internal = make_error_class(m, "InternalError", "A bug in libqjlkv: please report it.",
                                     {errors.base, builtins.attr("RuntimeError")});
  errors.memory_budget = make_error_class(
      m, "MemoryBudgetError",
      "The call would take the cache above config.memory_budget; nothing changed. Not an allocation "
      "failure: free sequences (preempt) and retry.",
      {errors.base});
  g_errors = &errors;

  py::native_enum<qjlkv_status>(m, "Status", "enum.IntEnum", "qjlkv_status: the C library's status codes.")
      .value("OK", QJLKV_OK)
      .value("INVALID_ARGUMENT", QJLKV_ERROR_INVALID_ARGUMENT)
      .value("OUT_OF_MEMORY", QJLKV_ERROR_OUT_OF_MEMORY)
      .value("UNSUPPORTED", QJLKV_ERROR_UNSUPPORTED)
      .value("DEVICE", QJLKV_ERROR_DEVICE)
      .value("CORRUPT_DATA", QJLKV_ERROR_CORRUPT_DATA)
      .value("INTERNAL", QJLKV_ERROR_INTERNAL)
      .value("MEMORY_BUDGET", QJLKV_ERROR_MEMORY_BUDGET)
      .finalize();
  py::native_enum<qjlkv_dtype>(m, "DType", "enum.IntEnum", "qjlkv_dtype")
      .value("F32", QJLKV_DTYPE_F32)
      .value("F16", QJLKV_DTYPE_F16)
      .value("BF16", QJLKV_DTYPE_BF16)
      .finalize();
  py::native_enum<qjlkv_key_method>(m, "KeyMethod", "enum.IntEnum", "qjlkv_key_method")
      .value("QJL", QJLKV_KEYS_QJL)
      .value("KIVI", QJLKV_KEYS_KIVI)
      .value("OTT", QJLKV_KEYS_OTT)
      .value("EXACT", QJLKV_KEYS_EXACT)
      .value("MIXED", QJLKV_KEYS_MIXED)
      .finalize();
  py::native_enum<qjlkv_value_method>(m, "ValueMethod", "enum.IntEnum", "qjlkv_value_method (config.value_method)")
      .value("UNIFORM", QJLKV_VALUES_UNIFORM)
      .value("ROTATED_LLOYD_MAX", QJLKV_VALUES_ROTATED_LLOYD_MAX)
      .finalize();

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError &e) {
      const py::object cls = error_class(e);
      py::object instance = cls(e.message);
      instance.attr("status") = py::cast(e.status);
      PyErr_SetObject(cls.ptr(), instance.ptr());
    }
  });

  m.attr("SKETCH_ORTHOGONAL") = QJLKV_SKETCH_ORTHOGONAL;
  m.attr("HEADER_VERSION_NUMBER") = QJLKV_VERSION_NUMBER;
  m.attr("CONFIG_FIELDS") = [] {
    py::list names;
    for (const Field &f : kConfigFields) names.append(f.name);
    return py::tuple(names);
  }();

  m.def("version_number", &qjlkv_version_number, "qjlkv_version_number(): MAJOR*10000 + MINOR*100 + PATCH.");
  m.def("version_string", &qjlkv_version_string, "qjlkv_version_string(): \"MAJOR.MINOR.PATCH\".");
  m.def("status_string", &qjlkv_py_status_string, py::arg("status"),
        "qjlkv_status_string(): the constant name of a status.");
  m.def("last_error_message", &qjlkv_last_error_message,
        "qjlkv_last_error_message(): the reason for this thread's last failed call.");
  m.def(
      "config_init",
      [](py::object preset, py::handle num_layers, py::handle num_q_heads, py::handle num_kv_heads,
         py::handle head_dim) {
        std::string name;
        const bool has_name = !preset.is_none();
        if (has_name) {
          if (!py::isinstance<py::str>(preset)) fail_type("preset must be a string or None");
          name = preset.cast<std::string>();
        }
        const uint32_t l = to_u32(num_layers, "num_layers"), hq = to_u32(num_q_heads, "num_q_heads"),
                       hkv = to_u32(num_kv_heads, "num_kv_heads"), d = to_u32(head_dim, "head_dim");
        qjlkv_config cfg;
        cfg.struct_size = sizeof cfg;
        check(qjlkv_config_init(&cfg, has_name ? name.c_str() : nullptr, l, hq, hkv, d));
        return config_to_dict(cfg);
      },
      py::arg("preset"), py::arg("num_layers"), py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
      "qjlkv_config_init(): the preset's fields as a dict (dtype and key_method as integers).");
  m.def(
      "config_validate", [](const py::dict &config) {
        const qjlkv_config cfg = config_from_dict(config);
        check(qjlkv_config_validate(&cfg));
      },
      py::arg("config"), "qjlkv_config_validate(): raises qjlkv.InvalidArgument naming the first wrong field.");
  m.def("data_pointer", &Cache::data_pointer, py::arg("tensor"),
        "The address this module passes to the C library for a tensor (no copy is ever made).");

  py::class_<Sketch>(m, "Sketch",
                    "Sketch(head_dim, sketch_dim, seed=0, orthogonal=True): the QJL sketch (qjlkv_sketch).\n\n"
                    ".matrix is the m x d float32 matrix the kernels use (a fresh numpy array), .shape is\n"
                    "(m, d). A cache's layer l uses stream l of the same generator: Cache.sketch(l).")
      .def(py::init<py::handle, py::handle, py::handle, bool>(), py::arg("head_dim"), py::arg("sketch_dim"),
           py::arg("seed") = 0, py::arg("orthogonal") = true)
      .def_property_readonly("matrix", &Sketch::matrix, "The matrix the kernels use: numpy float32 (m, d).")
      .def_property_readonly("shape", &Sketch::shape, "(m, d).")
      .def_property_readonly("owned", &Sketch::owned, "False for a cache's borrowed layer sketch.");

  py::class_<Workers>(m, "Workers",
                     "Workers(num_threads=0): CPU worker threads that several caches can share\n"
                     "(qjlkv_workers_create; 0 = the cores available). Pass it to Cache.set_workers; each\n"
                     "cache keeps the threads alive as long as it uses them.")
      .def(py::init<py::handle>(), py::arg("num_threads") = 0);

  py::class_<Cache>(m, "Cache", "qjlkv_cache: low-level handle; see qjlkv.Cache.")
      .def(py::init<const py::dict &>(), py::arg("config"))
      .def("close", &Cache::close)
      .def_property_readonly("closed", &Cache::closed)
      .def("config", &Cache::config)
      .def("set_stream", &Cache::set_stream, py::arg("stream"))
      .def("set_workers", &Cache::set_workers, py::arg("workers"))
      .def("set_layer_attention", &Cache::set_layer_attention, py::arg("layer"), py::arg("logit_softcap"),
           py::arg("sink_logits"), py::arg("window_tokens"))
      .def("append", &Cache::append, py::arg("layer"), py::arg("seq"), py::arg("keys"), py::arg("values"))
      .def("attend", &Cache::attend, py::arg("layer"), py::arg("seq"), py::arg("queries"), py::arg("scale"),
           py::arg("out"))
      .def("append_batch", &Cache::append_batch, py::arg("layer"), py::arg("seqs"), py::arg("keys"),
           py::arg("values"))
      .def("attend_batch", &Cache::attend_batch, py::arg("layer"), py::arg("seqs"), py::arg("queries"),
           py::arg("scale"), py::arg("out"))
      .def("scores", &Cache::scores, py::arg("layer"), py::arg("seq"), py::arg("query"))
      .def("reconstruct", &Cache::reconstruct, py::arg("layer"), py::arg("seq"), py::arg("first"), py::arg("count"),
           py::arg("keys"), py::arg("values"))
      .def("length", &Cache::length, py::arg("layer"), py::arg("seq"))
      .def("clear", &Cache::clear, py::arg("seq"))
      .def("stats", &Cache::stats)
      .def("truncate", &Cache::truncate, py::arg("seq"), py::arg("length"))
      .def("fork", &Cache::fork, py::arg("src_seq"), py::arg("dst_seq"), py::arg("length"))
      .def("bytes_needed", &Cache::bytes_needed, py::arg("seq"), py::arg("n_tokens"))
      .def("sequence_bytes", &Cache::sequence_bytes, py::arg("seq"))
      .def("export_bytes", &Cache::export_bytes, py::arg("seq"), py::arg("first_layer"), py::arg("num_layers"))
      .def("export_to", &Cache::export_to, py::arg("seq"), py::arg("first_layer"), py::arg("num_layers"),
           py::arg("write"))
      .def("import_bytes", &Cache::import_bytes, py::arg("seq"), py::arg("data"))
      .def("import_from", &Cache::import_from, py::arg("seq"), py::arg("file"))
      .def(
          "sketch",
          [](py::object self, py::handle layer) {
            const Cache &cache = self.cast<Cache &>();
            return std::make_unique<Sketch>(cache.sketch(layer), cache.handle(), self);
          },
          py::arg("layer"));
}
