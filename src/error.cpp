#include "error.hpp"

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <new>

namespace qjlkv {

namespace {
// Fixed-size so that recording an error (out of memory included) never allocates.
thread_local char last_error[1024] = "";
}  // namespace

void set_last_error(const char *message) noexcept {
  std::snprintf(last_error, sizeof last_error, "%s", message);
}

const char *last_error_message() noexcept { return last_error; }

void fail(qjlkv_status status, const char *format, ...) {
  char buffer[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buffer, sizeof buffer, format, args);
  va_end(args);
  throw Error(status, buffer);
}

}  // namespace qjlkv
