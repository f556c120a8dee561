// Turns fuzzer bytes into values. When the bytes run out every read returns 0, so any input,
// the empty one included, is a complete program for the harnesses. Also the check macro that
// the harnesses use instead of assert() (which NDEBUG builds would drop).
#pragma once
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace qjlkv_fuzz {

class Input {
 public:
  Input(const uint8_t *data, size_t size) : data_(data), size_(size) {}

  bool empty() const { return at_ >= size_; }

  uint8_t byte() { return at_ < size_ ? data_[at_++] : 0; }
  uint16_t u16() { return uint16_t(byte() | byte() << 8); }
  uint32_t u32() { return uint32_t(u16()) | uint32_t(u16()) << 16; }
  uint64_t u64() { return uint64_t(u32()) | uint64_t(u32()) << 32; }
  bool flag() { return byte() & 1; }
  // Uniform-ish in [lo, hi].
  uint32_t range(uint32_t lo, uint32_t hi) { return lo + uint32_t(u32() % (uint64_t(hi) - lo + 1)); }
  template <class T, size_t N>
  T pick(const T (&options)[N]) {
    return options[byte() % N];
  }

 private:
  const uint8_t *data_;
  size_t size_;
  size_t at_ = 0;
};

// QJLKV_FUZZ_TRACE=1 in the environment prints every call a harness makes (to reproduce a crash).
inline bool tracing() {
  static const bool on = std::getenv("QJLKV_FUZZ_TRACE") != nullptr;
  return on;
}

// Whether `message` mentions `name` as a whole identifier ("out" does not match "out_len").
inline bool names(const std::string &message, const std::string &name) {
  const auto identifier_char = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
  for (size_t at = message.find(name); at != std::string::npos; at = message.find(name, at + 1)) {
    const size_t end = at + name.size();
    if ((at == 0 || !identifier_char(message[at - 1])) && (end == message.size() || !identifier_char(message[end])))
      return true;
  }
  return false;
}

}  // namespace qjlkv_fuzz

#define FUZZ_TRACE(...)                                        \
  do {                                                         \
    if (::qjlkv_fuzz::tracing()) std::fprintf(stderr, __VA_ARGS__); \
  } while (0)

// A violated invariant: print what and where, then abort so that libFuzzer records the input
// (and the corpus replay test fails).
#define FUZZ_CHECK(cond, ...)                                                       \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n  ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                            \
      std::fprintf(stderr, "\n  last error message: %s\n", qjlkv_last_error_message()); \
      std::abort();                                                                 \
    }                                                                               \
  } while (0)
