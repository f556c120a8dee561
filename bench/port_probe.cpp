// VectorPorts/<instruction>: how many operations on the vector ports one AVX-512 instruction
// takes on this CPU, which is what the integer kernels' speed is counted in (docs/PERFORMANCE.md).
// Intel cores run 512-bit instructions on two ports (0 and 5), and some instructions take more
// than one operation there (vpermw two, vpermt2b three, a masked load one besides the load):
// tables of instruction costs differ between cores, so the probe measures them. A loop of groups
// "four vpaddd + the instruction" runs against one of groups "four vpaddd" (two cycles a group:
// the adds alone fill both ports); the instruction's operations are 4·(t_with/t_adds) − 4, the
// clock frequency cancelling. Destinations it would accumulate into are zeroed first (a zero
// idiom, no port), so that no group waits for another.
// VectorPorts/port5/<instruction> asks which of those operations need port 5, where Intel runs
// every shuffle: groups "four vpermb + the instruction" (the vpermb fill port 5 alone, four cycles
// a group) against "four vpermb"; what the instruction adds, 4·(t_with/t_shuffles) − 4, is its
// operations that could not go to port 0.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <initializer_list>
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
// The same with four vpermb (port 5 only; each its own destination, no chains).
#define QJLKV_SHUFFLES(i)                                   \
  "vpermb %%zmm30, %%zmm29, %%zmm" #i "\n"                 \
  "vpermb %%zmm30, %%zmm27, %%zmm" #i "\n"                 \
  "vpermb %%zmm30, %%zmm26, %%zmm" #i "\n"                 \
  "vpermb %%zmm29, %%zmm26, %%zmm" #i "\n"
#define QJLKV_GROUPS_OF(base, op)                                                                                  \
  base(0) op base(1) op base(2) op base(3) op base(4) op base(5) op base(6) op base(7) op base(8) op base(9) op     \
  base(10) op base(11) op base(12) op base(13) op base(14) op base(15) op
#define QJLKV_GROUPS(op) QJLKV_GROUPS_OF(QJLKV_ADDS, op)

// Runs `loops` iterations of 16 groups; the memory operand is 64 bytes at `buffer`.
#define QJLKV_PROBE(name, op) QJLKV_PROBE_OF(name, QJLKV_ADDS, op)
#define QJLKV_PROBE_OF(name, base, op)                                                                 \
  __attribute__((target("avx512f,avx512vbmi"))) void name(long loops, const void *buffer) {            \
    asm volatile("kxnorq %%k1, %%k1, %%k1\n"                                                            \
                 "1:\n" QJLKV_GROUPS_OF(base, op) "sub $1, %0\n"                                        \
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
QJLKV_PROBE(probe_broadcast_load, "vbroadcasti32x4 (%1), %%zmm28\n")

#define QJLKV_PORT5_PROBE(name, op) QJLKV_PROBE_OF(name, QJLKV_SHUFFLES, op)
QJLKV_PORT5_PROBE(shuffles_only, "")
QJLKV_PORT5_PROBE(port5_vpaddd, "vpaddd %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PORT5_PROBE(port5_vpermw, "vpermw %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PORT5_PROBE(port5_vpmultishiftqb, "vpmultishiftqb %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PORT5_PROBE(port5_vshufi64x2, "vshufi64x2 $0x44, %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PORT5_PROBE(port5_vpsrlw, "vpsrlw $4, %%zmm30, %%zmm28\n")
QJLKV_PORT5_PROBE(port5_vpdpbusd, "vpxord %%zmm28, %%zmm28, %%zmm28\n vpdpbusd %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PORT5_PROBE(port5_vpdpwssd, "vpxord %%zmm28, %%zmm28, %%zmm28\n vpdpwssd %%zmm30, %%zmm31, %%zmm28\n")
QJLKV_PORT5_PROBE(port5_insert_load, "vinserti64x4 $1, (%1), %%zmm30, %%zmm28\n")

using Probe = void (*)(long, const void *);

void bm_port_probe(benchmark::State &state, Probe base, Probe probe) {
  alignas(64) static const uint8_t buffer[64] = {};
  constexpr long kLoops = 20000;
  const auto seconds = [&](Probe p) {
    const auto start = std::chrono::steady_clock::now();
    p(kLoops, buffer);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  double adds = 0.0, with = 0.0;
  for (auto _ : state) {  // alternated, so that a change of clock hits both alike
    adds += seconds(base);
    with += seconds(probe);
  }
  state.counters[base == adds_only ? "vector_port_ops" : "port5_ops"] = 4.0 * with / adds - 4.0;
  state.counters["ns_per_group"] = 1e9 * adds / (double(state.iterations()) * kLoops * 16);
}

}  // namespace

void register_port_benchmarks() {
  // The instructions probed are those of the avx512vnni kernels.
  if (!qjlkv::cpu::isa_supported(qjlkv::cpu::Isa::Avx512Vnni)) return;
  struct Named {
    const char *name;
    Probe probe;
  };
  const auto register_probes = [](const char *prefix, Probe base, std::initializer_list<Named> probes) {
    for (const Named &p : probes)
      benchmark::RegisterBenchmark((std::string(prefix) + p.name).c_str(), bm_port_probe, base, p.probe);
  };
  register_probes("VectorPorts/", adds_only,
               {{"vpermb", probe_vpermb},
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
                {"vinserti64x4_load", probe_insert_load},
                {"vbroadcasti32x4_load", probe_broadcast_load}});
  register_probes("VectorPorts/port5/", shuffles_only,
               {{"vpaddd", port5_vpaddd},
                {"vpermw", port5_vpermw},
                {"vpmultishiftqb", port5_vpmultishiftqb},
                {"vshufi64x2", port5_vshufi64x2},
                {"vpsrlw_imm", port5_vpsrlw},
                {"vpdpbusd", port5_vpdpbusd},
                {"vpdpwssd", port5_vpdpwssd},
                {"vinserti64x4_load", port5_insert_load}});
}

#else

void register_port_benchmarks() {}

#endif
