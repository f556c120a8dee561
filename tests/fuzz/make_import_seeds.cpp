// Writes the seed corpus of the import harness: for every config of import_configs.hpp, valid
// streams (format version 2) of a few states (sinks and a tail; sinks, blocks and a tail; a
// layer range; fewer tokens than the sinks), each prefixed with the harness's two control bytes
// (config index; 0 = keep the checksums as they are). The v1_* seeds beside them are streams of
// the format-1 writer, kept as they were written.
//   c++ -std=c++20 -Iinclude -Itests/fuzz tests/fuzz/make_import_seeds.cpp build/libqjlkv.a -lpthread \
//     -o make_import_seeds && ./make_import_seeds tests/fuzz/corpus/import
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "import_configs.hpp"

int main(int argc, char **argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT_DIRECTORY\n", argv[0]);
    return 2;
  }
  int written = 0;
  for (uint32_t index = 0; index < qjlkv_fuzz::kImportConfigs; ++index) {
    const qjlkv_config cfg = qjlkv_fuzz::import_config(index);
    qjlkv_cache *c = nullptr;
    if (qjlkv_cache_create(&cfg, &c) != QJLKV_OK) return 1;
    const size_t elem = cfg.dtype == QJLKV_DTYPE_F32 ? 4 : 2;
    // Four sequences: 5 tokens (tail only, or 4 sinks and a tail of 1), 29 tokens (3 blocks, or
    // 2 after 4 sinks: OTT's pool and spill move), 12 tokens in layer 1 only, and 2 and 3
    // tokens (fewer than the sinks).
    const uint32_t lengths[4][2] = {{5, 5}, {29, 21}, {0, 12}, {2, 3}};
    for (uint32_t seq = 0; seq < 4; ++seq) {
      for (uint32_t layer = 0; layer < 2; ++layer) {
        const uint32_t n = lengths[seq][layer];
        if (n == 0) continue;
        std::vector<uint8_t> k(size_t(n) * cfg.head_dim * elem), v(k.size());
        for (size_t i = 0; i < size_t(n) * cfg.head_dim; ++i) {
          const float x = std::sin(float(i * 7 + seq + layer)) * (i % 5 == 0 ? 0.1f : 1.0f);
          const float y = std::cos(float(i * 3 + seq));
          if (elem == 4) {
            std::memcpy(&k[4 * i], &x, 4);
            std::memcpy(&v[4 * i], &y, 4);
          } else {  // fp16 or bf16 bits of a value in [-1, 1]: exact in both as multiples of 1/64
            const float xs = std::round(x * 64) / 64, ys = std::round(y * 64) / 64;
            uint32_t xb, yb;
            std::memcpy(&xb, &xs, 4);
            std::memcpy(&yb, &ys, 4);
            // bf16: the top half; fp16 via the library's conversion is not public, so use bf16
            // bits for bf16 caches and a tiny exact fp16 encoder for fp16 ones.
            auto fp16 = [](float f) -> uint16_t {
              if (f == 0.0f) return std::signbit(f) ? 0x8000 : 0;
              int e;
              const float m = std::frexp(std::fabs(f), &e);  // f = m * 2^e, m in [0.5, 1)
              const uint16_t sign = f < 0 ? 0x8000 : 0;
              return uint16_t(sign | uint16_t((e + 14) << 10) | uint16_t((m * 2048.0f - 1024.0f)));
            };
            const uint16_t kh = cfg.dtype == QJLKV_DTYPE_BF16 ? uint16_t(xb >> 16) : fp16(xs);
            const uint16_t vh = cfg.dtype == QJLKV_DTYPE_BF16 ? uint16_t(yb >> 16) : fp16(ys);
            std::memcpy(&k[2 * i], &kh, 2);
            std::memcpy(&v[2 * i], &vh, 2);
          }
        }
        if (qjlkv_cache_append(c, layer, seq, n, k.data(), v.data()) != QJLKV_OK) {
          std::fprintf(stderr, "append: %s\n", qjlkv_last_error_message());
          return 1;
        }
      }
      const uint32_t first = seq == 2 ? 1 : 0, count = seq == 2 ? 1 : 2;
      uint64_t size = 0;
      if (qjlkv_cache_export_size(c, seq, first, count, &size) != QJLKV_OK) return 1;
      std::vector<uint8_t> out(2 + size);
      out[0] = uint8_t(index);
      out[1] = 0;
      if (qjlkv_cache_export(c, seq, first, count, out.data() + 2, size) != QJLKV_OK) return 1;
      const std::string path = std::string(argv[1]) + "/seed_" + std::to_string(index) + "_" + std::to_string(seq);
      FILE *f = std::fopen(path.c_str(), "wb");
      if (!f || std::fwrite(out.data(), 1, out.size(), f) != out.size() || std::fclose(f) != 0) return 1;
      ++written;
    }
    qjlkv_cache_destroy(c);
  }
  std::printf("%d seeds written\n", written);
  return 0;
}
