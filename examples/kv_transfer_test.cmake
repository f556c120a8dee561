# ctest script: kv_transfer "both" vs "prefill" then "decode" in separate processes.
#   cmake -DPROGRAM=... -DPRESET=... -DFILE=... -P kv_transfer_test.cmake
set(TOKENS 40)
execute_process(COMMAND ${PROGRAM} both ${TOKENS} ${PRESET} OUTPUT_VARIABLE one_process RESULT_VARIABLE rc1)
execute_process(COMMAND ${PROGRAM} prefill ${FILE} ${PRESET} OUTPUT_VARIABLE sizes RESULT_VARIABLE rc2)
execute_process(COMMAND ${PROGRAM} decode ${FILE} ${TOKENS} ${PRESET} OUTPUT_VARIABLE two_processes RESULT_VARIABLE rc3)
message("${PRESET}: ${sizes}one process:   ${one_process}two processes: ${two_processes}")
if(NOT rc1 EQUAL 0 OR NOT rc2 EQUAL 0 OR NOT rc3 EQUAL 0)
  message(FATAL_ERROR "kv_transfer failed: ${rc1} ${rc2} ${rc3}")
endif()
if(NOT one_process STREQUAL two_processes OR one_process STREQUAL "")
  message(FATAL_ERROR "the decoded tokens differ")
endif()
