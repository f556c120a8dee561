# CUDA backend selection: QJLKV_CUDA = ON | OFF | AUTO (ON when nvcc is found).
# Defines qjlkv_add_cuda_backend(target) and sets QJLKV_HAVE_CUDA.
set(QJLKV_HAVE_CUDA FALSE)
if(QJLKV_CUDA STREQUAL "AUTO")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(QJLKV_HAVE_CUDA TRUE)
  endif()
elseif(QJLKV_CUDA)
  set(QJLKV_HAVE_CUDA TRUE)
endif()

if(QJLKV_HAVE_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    # sm_80 and sm_90 machine code, plus PTX for newer GPUs.
    set(CMAKE_CUDA_ARCHITECTURES 80-real 90-real 90-virtual)
  endif()
  enable_language(CUDA)
  # C++17: CMake 3.25 (the minimum) knows no C++20 flag for nvcc; the kernels need no C++20.
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
endif()

function(qjlkv_add_cuda_backend target)
  if(QJLKV_HAVE_CUDA)
    file(GLOB _cuda_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/cuda/*.cu ${PROJECT_SOURCE_DIR}/cuda/*.cpp)
    target_sources(${target} PRIVATE ${_cuda_sources})
    target_compile_definitions(${target} PUBLIC QJLKV_HAVE_CUDA=1)
    target_link_libraries(${target} PUBLIC CUDA::cudart_static)
    # The quantizers reproduce the CPU backend's fp32 arithmetic exactly: no contraction into FMA.
    set_source_files_properties(${PROJECT_SOURCE_DIR}/cuda/append.cu PROPERTIES COMPILE_OPTIONS "--fmad=false")
    # Kernel sources are compiled once per architecture; keep the diagnostics of the host pass.
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
  else()
    target_sources(${target} PRIVATE ${PROJECT_SOURCE_DIR}/src/cuda_unavailable.cpp)
  endif()
endfunction()
