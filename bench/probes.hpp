// Pieces of qjlkv_bench compiled apart: the GEMM probe (built for this machine's full
// instruction set) and the white-box kernel benchmarks (built like the library).
#pragma once
#include <cstddef>
#include <memory>

// One fp32 product [rows x inner] · [inner x cols] per thread, with Eigen.
class GemmProbe {
 public:
  GemmProbe(unsigned threads, size_t rows, size_t inner, size_t cols);
  ~GemmProbe();
  void run();
  double flops() const;  // per run()

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Kernels/<isa>/<preset>: one block's scores, softmax and value sums on hot data, per
// instruction set this CPU supports.
void register_kernel_benchmarks();

// VectorPorts/<instruction>: the vector-port operations of AVX-512 instructions (port_probe.cpp),
// where the CPU runs the avx512vnni kernels.
void register_port_benchmarks();
