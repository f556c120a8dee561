// Writes the seed corpus of the import harness: for every config of import_configs.hpp, valid
// streams (this library's format versions: 4 for config 8's mixed-bit keys, 3 for the others)
// of the sequences of kSeedLengths (sinks and a tail; sinks, blocks and a tail; a layer range;
// fewer tokens than the sinks), each prefixed with the harness's two control bytes (config
// index; 0 = keep the checksums as they are). The v1_* and v2_* seeds beside them are streams of
// the format-1 and format-2 writers of the same sequences, kept as they were written
// (v2_seed_0_*: QJL records with outlier sign bits, which import converts). The seed_* streams
// of configs 0-7 hold the writer version (an informational header field) of the release that
// wrote them; rewriting them changes that field and the checksums only. The v5_seed_* streams
// (format version 5) hold layer 0 of a sequence whose window (kImportWindow) freed blocks.
//   c++ -std=c++20 -Iinclude -Itests/fuzz tests/fuzz/make_import_seeds.cpp build/libqjlkv.a -lpthread \
//     -o make_import_seeds && ./make_import_seeds tests/fuzz/corpus/import
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
    for (uint32_t seq = 0; seq < qjlkv_fuzz::kSeedSequences; ++seq) {
      for (uint32_t layer = 0; layer < 2; ++layer) {
        const uint32_t n = qjlkv_fuzz::kSeedLengths[seq][layer];
        if (n == 0) continue;
        std::vector<uint8_t> k, v;
        qjlkv_fuzz::seed_tokens(cfg, seq, layer, k, v);
        if (qjlkv_cache_append(c, layer, seq, n, k.data(), v.data()) != QJLKV_OK) {
          std::fprintf(stderr, "append: %s\n", qjlkv_last_error_message());
          return 1;
        }
      }
      const uint32_t first = qjlkv_fuzz::seed_first_layer(seq), count = qjlkv_fuzz::seed_num_layers(seq);
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
  for (const uint32_t index : {1u, 2u, 8u}) {  // no sinks, OTT, sinks with mixed-bit keys
    const qjlkv_config cfg = qjlkv_fuzz::import_config(index);
    qjlkv_cache *c = nullptr;
    if (qjlkv_cache_create(&cfg, &c) != QJLKV_OK) return 1;
    qjlkv_layer_attention window{};
    window.struct_size = sizeof window;
    window.window_tokens = qjlkv_fuzz::kImportWindow;
    if (qjlkv_cache_set_layer_attention(c, 0, &window) != QJLKV_OK) return 1;
    std::vector<uint8_t> k, v;
    qjlkv_fuzz::seed_tokens(cfg, 1, 0, k, v);  // 29 tokens, appended twice
    const size_t token = k.size() / qjlkv_fuzz::kSeedLengths[1][0];
    for (uint32_t t = 0; t < qjlkv_fuzz::kFreedSeedTokens; ++t) {
      const size_t at = (t % qjlkv_fuzz::kSeedLengths[1][0]) * token;
      if (qjlkv_cache_append(c, 0, 0, 1, k.data() + at, v.data() + at) != QJLKV_OK) return 1;
    }
    uint64_t size = 0;
    if (qjlkv_cache_export_size(c, 0, 0, 1, &size) != QJLKV_OK) return 1;
    std::vector<uint8_t> out(2 + size);
    out[0] = uint8_t(index);
    out[1] = 0;
    if (qjlkv_cache_export(c, 0, 0, 1, out.data() + 2, size) != QJLKV_OK) return 1;
    const std::string path = std::string(argv[1]) + "/v5_seed_" + std::to_string(index);
    FILE *f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(out.data(), 1, out.size(), f) != out.size() || std::fclose(f) != 0) return 1;
    ++written;
    qjlkv_cache_destroy(c);
  }
  std::printf("%d seeds written\n", written);
  return 0;
}
