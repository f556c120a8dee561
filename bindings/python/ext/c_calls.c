/* Calls that only C can make: C converts any int to an enum type, while C++ cannot hold an
 * out-of-range value in one (loading it is undefined behaviour). */
#include <qjlkv/qjlkv.h>

const char *qjlkv_py_status_string(int status);

const char *qjlkv_py_status_string(int status) { return qjlkv_status_string((qjlkv_status)status); }
