/* Calls made the way a C program makes them. C converts any int to an enum type, which C++
 * cannot express (there an out-of-range enum value is undefined behaviour, and UBSan reports
 * its load), so the tests reach the library's enum arguments through these. */
#include <qjlkv/qjlkv.h>

#include "c_caller.h"

const char *qjlkv_test_status_string_of_int(int status) {
  return qjlkv_status_string((qjlkv_status)status);
}
