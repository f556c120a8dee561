# Run by ctest after the tests of a CUDA build (CTEST_CUSTOM_POST_TEST of the CTestCustom.cmake that
# tests/gpu/CMakeLists.txt writes): qjlkv_gpu_probe's line (-DPROBE=<its path>), or that it is not
# built, without failing ctest over it.
if(EXISTS "${PROBE}")
  execute_process(COMMAND "${PROBE}")
else()
  message("qjlkv GPU probe: not built (target qjlkv_gpu_probe); a skipped device test prints its reason in its own output")
endif()
