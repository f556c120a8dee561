// Marks functions that both backends compile: plain inline in C++, __host__ __device__ under nvcc.
#pragma once
#if defined(__CUDACC__)
#define QJLKV_HD __host__ __device__ __forceinline__
#else
#define QJLKV_HD inline
#endif
