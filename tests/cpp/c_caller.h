/* tests/cpp/c_caller.c: calls of the C API made from C. */
#ifndef QJLKV_TEST_C_CALLER_H
#define QJLKV_TEST_C_CALLER_H
#ifdef __cplusplus
extern "C" {
#endif

/* qjlkv_status_string(status) with an int that may lie outside the enum. */
const char *qjlkv_test_status_string_of_int(int status);

#ifdef __cplusplus
}
#endif
#endif
