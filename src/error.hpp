// Errors inside the library are exceptions carrying a status; the C layer turns them into a
// status code plus the thread-local message (the only mutable global state).
#pragma once
#include <cstddef>
#include <cstdint>
#include <exception>
#include <new>
#include <string>

#include "qjlkv/qjlkv.h"

namespace qjlkv {

class Error : public std::exception {
 public:
  Error(qjlkv_status status, std::string message) : status_(status), message_(std::move(message)) {}
  qjlkv_status status() const noexcept { return status_; }
  const char *what() const noexcept override { return message_.c_str(); }

 private:
  qjlkv_status status_;
  std::string message_;
};

// printf-style message; throws Error(status, message).
[[noreturn]] void fail(qjlkv_status status, const char *format, ...) __attribute__((format(printf, 2, 3)));

#define QJLKV_REQUIRE(cond, ...) \
  do {                           \
    if (!(cond)) ::qjlkv::fail(QJLKV_ERROR_INVALID_ARGUMENT, __VA_ARGS__); \
  } while (0)

// After a switch that handles every enumerator of a value the library validated (switches over
// library enums have no `default:`, so that -Wswitch names a new enumerator's missing case).
[[noreturn]] inline void unreachable() { __builtin_unreachable(); }

// The struct_size rule of qjlkv.h ("Growing structs"): `size` must be one of the sizes that
// releases shipped for `type` (oldest first; the last is this header's sizeof).
template <size_t N>
void require_shipped_size(const char *field, uint32_t size, const uint32_t (&shipped)[N], const char *type) {
  for (uint32_t s : shipped)
    if (size == s) return;
  std::string sizes;
  for (uint32_t s : shipped) sizes += (sizes.empty() ? "" : ", ") + std::to_string(s);
  fail(QJLKV_ERROR_INVALID_ARGUMENT, "%s is %u, must be a size a release shipped (%s): set it to sizeof(%s) first",
       field, size, sizes.c_str(), type);
}

void set_last_error(const char *message) noexcept;
const char *last_error_message() noexcept;

// Runs body(), mapping exceptions to statuses and recording the message.
template <class Body>
qjlkv_status guarded(Body &&body) noexcept {
  try {
    body();
    return QJLKV_OK;
  } catch (const Error &e) {
    set_last_error(e.what());
    return e.status();
  } catch (const std::bad_alloc &) {
    set_last_error("out of memory");
    return QJLKV_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception &e) {
    set_last_error(e.what());
    return QJLKV_ERROR_INTERNAL;
  } catch (...) {
    set_last_error("unknown internal error");
    return QJLKV_ERROR_INTERNAL;
  }
}

}  // namespace qjlkv
