# Install rules, the exported CMake package, the pkg-config file and CPack for libqjlkv.
# Everything installed is relocatable: the CMake files locate themselves with
# CMAKE_CURRENT_LIST_DIR and the .pc file with ${pcfiledir}. The policy behind the
# version numbers and the SONAME is packaging/VERSIONING.md.

# The layout the project documents is <prefix>/lib, also on distributions whose
# GNUInstallDirs default is lib64 or a multiarch directory; -DCMAKE_INSTALL_LIBDIR overrides.
# Inside another project, that project's choice stands.
if(PROJECT_IS_TOP_LEVEL AND NOT DEFINED CMAKE_INSTALL_LIBDIR)
  set(CMAKE_INSTALL_LIBDIR lib CACHE PATH "Object code libraries (LIBDIR)")
endif()
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(QJLKV_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/qjlkv" CACHE STRING
    "Directory, relative to the prefix, of qjlkvConfig.cmake")
set(QJLKV_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_LIBDIR}/pkgconfig" CACHE STRING
    "Directory, relative to the prefix, of qjlkv.pc")
foreach(_qjlkv_dir CMAKE_INSTALL_LIBDIR CMAKE_INSTALL_INCLUDEDIR QJLKV_INSTALL_CMAKEDIR QJLKV_INSTALL_PKGCONFIGDIR)
  if(IS_ABSOLUTE "${${_qjlkv_dir}}")
    message(FATAL_ERROR "${_qjlkv_dir} (${${_qjlkv_dir}}) must be relative to the install prefix "
                        "so that the installed package stays relocatable")
  endif()
endforeach()

# ---------------------------------------------------------------------------
# What the libraries promise their consumers
# ---------------------------------------------------------------------------
# On Windows the header picks dllimport unless QJLKV_STATIC is defined.
target_compile_definitions(qjlkv_static INTERFACE QJLKV_STATIC)

# The C++ runtime that the static library needs but a C consumer's link does not bring:
# what the C++ compiler links implicitly beyond what the C compiler does (stdc++ and m
# with GCC). pkg-config consumers get it through Libs.private.
set(_qjlkv_cxx_runtime ${CMAKE_CXX_IMPLICIT_LINK_LIBRARIES})
if(CMAKE_C_IMPLICIT_LINK_LIBRARIES)
  list(REMOVE_ITEM _qjlkv_cxx_runtime ${CMAKE_C_IMPLICIT_LINK_LIBRARIES})
endif()
list(REMOVE_DUPLICATES _qjlkv_cxx_runtime)
# A consumer that links with the C++ driver gets it already; one that links with the C
# driver (a C-only project) needs it spelled out.
foreach(_qjlkv_lib IN LISTS _qjlkv_cxx_runtime)
  target_link_libraries(qjlkv_static INTERFACE "$<$<NOT:$<LINK_LANGUAGE:CXX>>:${_qjlkv_lib}>")
endforeach()

# Libs.private in link order: the CUDA runtime, then the C++ runtime, then threads.
set(_qjlkv_libs_private "")
if(QJLKV_HAVE_CUDA)
  # The CUDA objects reach the libraries through $<BUILD_INTERFACE:qjlkv_cuda_objects>, which the
  # export drops; restate the static library's CUDA runtime so that it is exported as
  # $<LINK_ONLY:CUDA::cudart_static> (the shared library carries it inside).
  target_link_libraries(qjlkv_static PRIVATE CUDA::cudart_static)
  string(APPEND _qjlkv_libs_private " -L${CUDAToolkit_LIBRARY_DIR} -lcudart_static -ldl -lrt")
  set(QJLKV_CONFIG_HAVE_CUDA TRUE)
else()
  set(QJLKV_CONFIG_HAVE_CUDA FALSE)
endif()
foreach(_qjlkv_lib IN LISTS _qjlkv_cxx_runtime)
  string(APPEND _qjlkv_libs_private " -l${_qjlkv_lib}")
endforeach()
if(CMAKE_THREAD_LIBS_INIT)
  string(APPEND _qjlkv_libs_private " ${CMAKE_THREAD_LIBS_INIT}")
elseif(CMAKE_USE_PTHREADS_INIT)
  # glibc >= 2.34 has pthreads in libc; -lpthread is still what older C libraries need.
  string(APPEND _qjlkv_libs_private " -lpthread")
endif()

string(STRIP "${_qjlkv_libs_private}" QJLKV_PC_LIBS_PRIVATE)

# ---------------------------------------------------------------------------
# Libraries and header
# ---------------------------------------------------------------------------
install(TARGETS qjlkv qjlkv_static
  EXPORT qjlkvTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    COMPONENT runtime NAMELINK_COMPONENT development
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/qjlkv
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT development
  FILES_MATCHING PATTERN "*.h")

# ---------------------------------------------------------------------------
# CMake package: find_package(qjlkv 0.1 CONFIG REQUIRED)
# ---------------------------------------------------------------------------
install(EXPORT qjlkvTargets
  NAMESPACE qjlkv::
  DESTINATION ${QJLKV_INSTALL_CMAKEDIR}
  COMPONENT development)
configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/packaging/qjlkvConfig.cmake.in
  ${PROJECT_BINARY_DIR}/packaging/qjlkvConfig.cmake
  INSTALL_DESTINATION ${QJLKV_INSTALL_CMAKEDIR})
# One SONAME per major version, so any 0.x satisfies a request for 0.1 when x >= 1.
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/packaging/qjlkvConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMajorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/packaging/qjlkvConfig.cmake
  ${PROJECT_BINARY_DIR}/packaging/qjlkvConfigVersion.cmake
  DESTINATION ${QJLKV_INSTALL_CMAKEDIR}
  COMPONENT development)

# ---------------------------------------------------------------------------
# pkg-config: prefix derived from the .pc file's own location
# ---------------------------------------------------------------------------
file(RELATIVE_PATH QJLKV_PC_PREFIX_FROM_PCFILEDIR
  "/prefix/${QJLKV_INSTALL_PKGCONFIGDIR}" "/prefix")
string(REGEX REPLACE "/$" "" QJLKV_PC_PREFIX_FROM_PCFILEDIR "${QJLKV_PC_PREFIX_FROM_PCFILEDIR}")
configure_file(${PROJECT_SOURCE_DIR}/packaging/qjlkv.pc.in
  ${PROJECT_BINARY_DIR}/packaging/qjlkv.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/packaging/qjlkv.pc
  DESTINATION ${QJLKV_INSTALL_PKGCONFIGDIR}
  COMPONENT development)

# ---------------------------------------------------------------------------
# CPack: .tar.gz and .deb of the runtime and development components
# ---------------------------------------------------------------------------
if(PROJECT_IS_TOP_LEVEL)
  set(CPACK_PACKAGE_NAME "libqjlkv")
  set(CPACK_PACKAGE_VENDOR "libqjlkv")
  set(CPACK_PACKAGE_CONTACT "libqjlkv maintainers")
  set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
      "Compressed LLM key/value cache with attention on the compressed form (C ABI)")
  set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
  set(CPACK_GENERATOR "TGZ;DEB")
  set(CPACK_PACKAGE_FILE_NAME "libqjlkv-${PROJECT_VERSION}-${CMAKE_SYSTEM_NAME}-${CMAKE_SYSTEM_PROCESSOR}")
  # Only the library's own components, so that a subproject's install rules (a test
  # framework, say) never end up in the packages.
  set(CPACK_INSTALL_CMAKE_PROJECTS
    "${PROJECT_BINARY_DIR};qjlkv;runtime;/"
    "${PROJECT_BINARY_DIR};qjlkv;development;/")
  set(CPACK_SOURCE_GENERATOR TGZ)
  set(CPACK_SOURCE_IGNORE_FILES "/\\.git/" "/build[^/]*/" "/target/" "__pycache__" "\\.egg-info/")
  set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
  set(CPACK_DEBIAN_PACKAGE_SECTION libdevel)
  find_program(QJLKV_DPKG_SHLIBDEPS dpkg-shlibdeps)
  mark_as_advanced(QJLKV_DPKG_SHLIBDEPS)
  if(QJLKV_DPKG_SHLIBDEPS)
    set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
  else()
    set(CPACK_DEBIAN_PACKAGE_DEPENDS "libc6, libstdc++6, libgcc-s1")
  endif()
  include(CPack)
endif()
