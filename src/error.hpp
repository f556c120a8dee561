// Errors inside the library are exceptions carrying a status; the C layer turns them into a
// status code plus the thread-local message (the only mutable global state).
#pragma once
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
