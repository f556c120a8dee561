// VectorPorts/<instruction>: how many operations on the vector ports one AVX-512 instruction
// takes on this CPU, which is what the integer kernels' speed is counted in (docs/PERFORMANCE.md).
// Intel cores run 512-bit instructions on two ports (0 and 5), and some instructions take more
// than one operation there (vpermw two, vpermt2b three, a masked load one besides the load):
// tables of instruction costs differ between cores, so the probe measures them. A loop of groups
// "four vpaddd + the instruction" runs against one of groups "four vpaddd" (two cycles a group:
// the adds alone fill both ports); the instruction's operations are 4·(t_with/t_adds) − 4, the
// clock frequency cancelling. Destinations it would accumulate into are zeroed first (a zero
// idiom, no port), so that no group waits for another.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "cpu/isa.hpp"
#include "probes.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

namespace {

// 16 groups, on zmm0..zmm15: four dependent adds each (chains that never wait on one another).
#define QJLKV_ADDS(i)                         \
  "vpaddd %%zmm30, %%zmm" #i ", %%zmm" #i "\n" \
  "vpaddd %%zmm29, %%zmm" #i ", %%zmm" #i "\n" \
  "vpaddd %%zmm27, %%zmm" #i ", %%zmm" #i "\n" \
  "vpaddd %%zmm26, %%zmm" #i ", %%zmm" #i "\n"
#define QJLKV_GROUPS(op)                                                                                          \
  QJLKV_ADDS(0) op QJLKV_ADDS(1) op QJLKV_ADDS(2) op QJLKV_ADDS(3) op QJLKV_ADDS(4) op QJLKV_ADDS(5) op          \
  QJLKV_ADDS(6) op QJLKV_ADDS(7) op QJLKV_ADDS(8) op QJLKV_ADDS(9) op QJLKV_ADDS(10) op QJLKV_ADDS(11) op       \
  QJLKV_ADDS(12) op QJLKV_ADDS(13) op QJLKV_ADDS(14) op QJLKV_ADDS(15) op

// Runs `loops` iterations of 16 groups; the memory operand is 64 bytes at `buffer`.
#define QJLKV_PROBE(name, op)                                                                          \
  __attribute__((target("avx512f"))) void name(long loops, const void *buffer) {                       \
    asm volatile("kxnorq %%k1, %%k1, %%k1\n"                                                            \
                 "1:\n" QJLKV_GROUPS(op) "sub $1, %0\n"                                                 \
                 "jnz 1b\n"                                                                              \
                 : "+r"(loops)                                                                           \
                 : "r"(buffer)                                                                           \
                 : "memory", "k1", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", \
                   "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm28");             \
  }

QJLKV_PROBE(adds_only, "")
QJLKV_PROBE(probe_vpermb, "vpermb %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PROBE(probe_vpermw, "vpermw %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PROBE(probe_vpermt2b, "vpxord %%zmm28, %%zmm28, %%zmm28\n vpermt2b %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PROBE(probe_vpermi2w, "vpxord %%zmm28, %%zmm28, %%zmm28\n vpermi2w %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PROBE(probe_vpmultishiftqb, "vpmultishiftqb %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PROBE(probe_vshufi64x2, "vshufi64x2 $0x44, %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PROBE(probe_vpsrlw, "vpsrlw $4, %%zmm30, %%zmm28\n")
QJLKV_PROBE(probe_vpdpbusd, "vpxord %%zmm28, %%zmm28, %%zmm28\n vpdpbusd %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PROBE(probe_vpdpwssd, "vpxord %%zmm28, %%zmm28, %%zmm28\n vpdpwssd %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PROBE(probe_vcvtdq2ps, "vcvtdq2ps %%zmm30, %%zmm28\n")
QJLKV_PROBE(probe_load, "vmovdqu64 (%1), %%zmm28\n")
QJLKV_PROBE(probe_masked_load, "vmovdqu8 (%1), %%zmm28%{%%k1%}%{z%}\n")
QJLKV_PROBE(probe_insert_load, "vinserti64x4 $1, (%1), %%zmm30, %%zmm28\n")

using Probe = void (*)(long, const void *);

void bm_port_probe(benchmark::State &state, Probe probe) {
  alignas(64) static const uint8_t buffer[64] = {};
  constexpr long kLoops = 20000;
  const auto seconds = [&](Probe p) {
    const auto start = std::chrono::steady_clock::now();
    p(kLoops, buffer);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  double adds = 0.0, with = 0.0;
  for (auto _ : state) {  // alternated, so that a change of clock hits both alike
    adds += seconds(adds_only);
    with += seconds(probe);
  }
  state.counters["vector_port_ops"] = 4.0 * with / adds - 4.0;
  state.counters["ns_per_group_adds"] = 1e9 * adds / (double(state.iterations()) * kLoops * 16);
}

}  // namespace

void register_port_benchmarks() {
  // The instructions probed are those of the avx512vnni kernels.
  if (!qjlkv::cpu::isa_supported(qjlkv::cpu::Isa::Avx512Vnni)) return;
  const struct {
    const char *name;
    Probe probe;
  } probes[] = {{"vpermb", probe_vpermb},
                {"vpermw", probe_vpermw},
                {"vpermt2b", probe_vpermt2b},
                {"vpermi2w", probe_vpermi2w},
                {"vpmultishiftqb", probe_vpmultishiftqb},
                {"vshufi64x2", probe_vshufi64x2},
                {"vpsrlw_imm", probe_vpsrlw},
                {"vpdpbusd", probe_vpdpbusd},
                {"vpdpwssd", probe_vpdpwssd},
                {"vcvtdq2ps", probe_vcvtdq2ps},
                {"load", probe_load},
                {"masked_load", probe_masked_load},
                {"vinserti64x4_load", probe_insert_load}};
  for (const auto &p : probes)
    benchmark::RegisterBenchmark((std::string("VectorPorts/") + p.name).c_str(), bm_port_probe, p.probe);
}

#else

void register_port_benchmarks() {}

#endif
