# cmake -DNM=<nm> -DLIBRARY=<libqjlkv.so> -DHEADER=<qjlkv.h> -P check_exports.cmake
# Fails unless the dynamic symbol table defines exactly qjlkv_* symbols, including every
# function that the header declares with QJLKV_API.
cmake_minimum_required(VERSION 3.25)  # script mode starts with old policies (IN_LIST needs CMP0057)
foreach(var NM LIBRARY HEADER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_exports.cmake: -D${var}=... is required")
  endif()
endforeach()

execute_process(COMMAND ${NM} -D --defined-only ${LIBRARY}
  OUTPUT_VARIABLE nm_output ERROR_VARIABLE nm_error RESULT_VARIABLE nm_result)
if(NOT nm_result EQUAL 0)
  message(FATAL_ERROR "${NM} -D --defined-only ${LIBRARY} failed (${nm_result}): ${nm_error}")
endif()

set(exported "")
set(foreign "")
string(REPLACE "\n" ";" nm_lines "${nm_output}")
foreach(line IN LISTS nm_lines)
  # "<address> <type> <name>[@version]"; the address is blank for absolute symbols.
  if(line MATCHES "^[0-9a-fA-F]* *[A-Za-z] ([^ @]+)")
    set(symbol "${CMAKE_MATCH_1}")
    if(symbol MATCHES "^qjlkv_")
      list(APPEND exported "${symbol}")
    else()
      list(APPEND foreign "${symbol}")
    endif()
  endif()
endforeach()

file(READ ${HEADER} header_text)
string(REGEX MATCHALL "QJLKV_API[^(;\n]*\\(" declarations "${header_text}")
set(declared "")
foreach(declaration IN LISTS declarations)
  if(declaration MATCHES "(qjlkv_[A-Za-z0-9_]+) *\\($")
    list(APPEND declared "${CMAKE_MATCH_1}")
  endif()
endforeach()
list(LENGTH declared declared_count)
if(declared_count LESS 10)
  message(FATAL_ERROR "found only ${declared_count} QJLKV_API functions in ${HEADER}: parser out of date?")
endif()

set(missing "")
foreach(function IN LISTS declared)
  if(NOT function IN_LIST exported)
    list(APPEND missing "${function}")
  endif()
endforeach()

if(foreign OR missing)
  message(FATAL_ERROR "${LIBRARY}:\n  exported symbols outside qjlkv_*: ${foreign}\n"
                      "  declared in the header but not exported: ${missing}")
endif()
list(LENGTH exported exported_count)
message(STATUS "${exported_count} symbols exported, all qjlkv_*; ${declared_count} header functions present")
