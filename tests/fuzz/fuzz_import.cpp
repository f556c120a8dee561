// Fuzz harness 3: qjlkv_cache_import and qjlkv_cache_import_stream on arbitrary bytes.
//
// Input: byte 0 picks a config of import_configs.hpp, byte 1 bit 0 asks the harness to repair
// both checksums of the stream (so that mutations reach the checks behind them), the rest is the
// stream. Seeds (tests/fuzz/corpus/import, from make_import_seeds.cpp) are valid streams.
// Checked for every input:
//   - import returns OK, CORRUPT_DATA or INVALID_ARGUMENT (never anything else) with a message;
//     a refused import leaves the destination as it was (its lengths and statistics);
//   - import_stream (a reader handing out odd-sized pieces) accepts whatever import accepts and
//     then holds the same sequence;
//   - an accepted stream is canonical: exporting the imported sequence gives the input back,
//     byte for byte, apart from the writer's library version and the two checksums over it (an
//     input of format version 1 or 2 comes back as version 3, with the same sections; a version
//     1 header grows by value_method and sink_tokens, both 0; mixed-bit keys come back as
//     version 4, and a version-4 stream of any other cache, whose key_token_bits is 0, as
//     version 3; a version-5 stream, whose layers have blocks their window freed, as version 5);
//   - except that version 1 and 2 streams of QJL caches with outlier channels store the outlier
//     sign bits that version 3 replaced by corrections: their re-export, as version 3, keeps the
//     header's layers and config and is canonical itself (imported again, it exports as it is);
//   - the imported sequence is usable: attention and scores give no NaN, and one more token
//     (crossing into a new block where the tail is full) appends.
#include <qjlkv/qjlkv.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "crc32c.hpp"
#include "fuzz_input.hpp"
#include "import_configs.hpp"

namespace {

constexpr uint32_t kSeq = 77, kOtherSeq = 3;

struct Piecewise {
  const uint8_t *data;
  size_t size, at;
  static size_t read(void *user, void *out, size_t n) {
    auto *p = static_cast<Piecewise *>(user);
    size_t done = 0;
    while (done < n && p->at < p->size) {  // pieces of 1..13 bytes, as a socket might deliver
      const size_t piece = std::min({n - done, p->size - p->at, size_t(1 + p->at % 13)});
      std::memcpy(static_cast<uint8_t *>(out) + done, p->data + p->at, piece);
      p->at += piece;
      done += piece;
    }
    return done;
  }
};

struct State {
  std::vector<uint64_t> lengths;
  qjlkv_stats stats;
};

State state_of(qjlkv_cache *c, const qjlkv_config &cfg) {
  State s{};
  for (uint32_t l = 0; l < cfg.num_layers; ++l)
    for (uint32_t seq : {kSeq, kOtherSeq}) {
      uint64_t n = 0;
      FUZZ_CHECK(qjlkv_cache_length(c, l, seq, &n) == QJLKV_OK, "length");
      s.lengths.push_back(n);
    }
  std::memset(&s.stats, 0, sizeof s.stats);
  s.stats.struct_size = sizeof s.stats;
  FUZZ_CHECK(qjlkv_cache_stats(c, &s.stats) == QJLKV_OK, "stats");
  return s;
}

bool same(const State &a, const State &b) {
  return a.lengths == b.lengths && std::memcmp(&a.stats, &b.stats, sizeof a.stats) == 0;
}

// docs/FORMAT.md: the header is 128 bytes in version 1, 136 in versions 2 and 3, 140 in versions
// 4 and 5 (key_token_bits); its CRC ends it. The writer writes version 5 for streams with freed
// blocks (an accepted version-5 stream has them), else version 4 for mixed-bit keys only.
size_t header_bytes_of(uint32_t version) { return version == 1 ? 128 : version >= 4 ? 140 : 136; }
uint32_t written_version(const qjlkv_config &cfg, uint32_t stream_version) {
  return stream_version == 5 ? 5 : cfg.key_method == QJLKV_KEYS_MIXED ? 4 : 3;
}

// A destination that already holds another sequence, as a serving process's cache would, with a
// window on every layer (so that streams with freed blocks import).
qjlkv_cache *make_destination(const qjlkv_config &cfg) {
  qjlkv_cache *c = nullptr;
  FUZZ_CHECK(qjlkv_cache_create(&cfg, &c) == QJLKV_OK, "create");
  qjlkv_layer_attention window{};
  window.struct_size = sizeof window;
  window.window_tokens = qjlkv_fuzz::kImportWindow;
  for (uint32_t l = 0; l < cfg.num_layers; ++l)
    FUZZ_CHECK(qjlkv_cache_set_layer_attention(c, l, &window) == QJLKV_OK, "set_layer_attention");
  const size_t elems = size_t(3) * cfg.num_kv_heads * cfg.head_dim;
  std::vector<uint8_t> zeros(elems * 4, 0);
  FUZZ_CHECK(qjlkv_cache_append(c, 0, kOtherSeq, 3, zeros.data(), zeros.data()) == QJLKV_OK, "append");
  return c;
}

void check_usable(qjlkv_cache *c, const qjlkv_config &cfg) {
  const size_t io = cfg.dtype == QJLKV_DTYPE_F32 ? 4 : 2;
  std::vector<uint8_t> q(size_t(cfg.num_q_heads) * cfg.head_dim * io, 0);
  for (size_t i = 0; i < q.size(); i += io) q[i + io - 1] = 0x3c;  // 1.0 in the top byte (fp16, bf16 ~1, f32 ~0.01)
  for (uint32_t l = 0; l < cfg.num_layers; ++l) {
    uint64_t n = 0;
    FUZZ_CHECK(qjlkv_cache_length(c, l, kSeq, &n) == QJLKV_OK, "length");
    if (n == 0) continue;
    std::vector<uint8_t> out(q.size());
    const qjlkv_status s = qjlkv_cache_attend(c, l, kSeq, 1, q.data(), 0.0f, out.data());
    FUZZ_CHECK(s == QJLKV_OK || s == QJLKV_ERROR_INVALID_ARGUMENT, "attend: %s", qjlkv_status_string(s));
    std::vector<float> scores(size_t(cfg.num_q_heads) * n);
    const qjlkv_status ss = qjlkv_cache_scores(c, l, kSeq, q.data(), scores.data(), scores.size());
    FUZZ_CHECK(ss == QJLKV_OK || ss == QJLKV_ERROR_INVALID_ARGUMENT, "scores: %s", qjlkv_status_string(ss));
    if (ss == QJLKV_OK)
      for (float x : scores) FUZZ_CHECK(!std::isnan(x), "a NaN score in layer %u", l);
    const std::vector<uint8_t> token(size_t(cfg.num_kv_heads) * cfg.head_dim * io, 0);
    FUZZ_CHECK(qjlkv_cache_append(c, l, kSeq, 1, token.data(), token.data()) == QJLKV_OK, "append after import");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  qjlkv_fuzz::Input in(data, size);
  const qjlkv_config cfg = qjlkv_fuzz::import_config(in.byte());
  const bool repair = in.byte() & 1;
  std::vector<uint8_t> stream(data + std::min<size_t>(size, 2), data + size);
  uint32_t version = 0;
  if (stream.size() >= 12) std::memcpy(&version, stream.data() + 8, 4);
  const size_t header_bytes = header_bytes_of(version);
  if (repair && stream.size() >= header_bytes + 4) {
    const uint32_t header = qjlkv::crc32c(stream.data(), header_bytes - 4);
    std::memcpy(stream.data() + header_bytes - 4, &header, 4);
    const uint32_t all = qjlkv::crc32c(stream.data(), stream.size() - 4);
    std::memcpy(stream.data() + stream.size() - 4, &all, 4);
  }
  const uint8_t empty = 0;
  const uint8_t *bytes = stream.empty() ? &empty : stream.data();
  FUZZ_TRACE("import of %zu bytes, config %u, repair %d\n", stream.size(), unsigned(data[0]), int(repair));

  qjlkv_cache *c = make_destination(cfg);
  const State before = state_of(c, cfg);
  const qjlkv_status s = qjlkv_cache_import(c, kSeq, bytes, stream.size());
  FUZZ_CHECK(s == QJLKV_OK || s == QJLKV_ERROR_CORRUPT_DATA || s == QJLKV_ERROR_INVALID_ARGUMENT, "import: %s",
             qjlkv_status_string(s));
  qjlkv_cache *streamed = make_destination(cfg);
  Piecewise reader{bytes, stream.size(), 0};
  const qjlkv_status ss = qjlkv_cache_import_stream(streamed, kSeq, &Piecewise::read, &reader);
  FUZZ_CHECK(ss == QJLKV_OK || ss == QJLKV_ERROR_CORRUPT_DATA || ss == QJLKV_ERROR_INVALID_ARGUMENT,
             "import_stream: %s", qjlkv_status_string(ss));
  if (s != QJLKV_OK) {
    FUZZ_CHECK(qjlkv_last_error_message()[0] != '\0', "a refusal without a message");
    FUZZ_CHECK(same(state_of(c, cfg), before), "a refused import changed the destination");
  } else {
    FUZZ_CHECK(ss == QJLKV_OK, "import accepted what import_stream refused");
    FUZZ_CHECK(reader.at == stream.size(), "import_stream read %zu of %zu bytes", reader.at, stream.size());
    FUZZ_CHECK(same(state_of(c, cfg), state_of(streamed, cfg)), "import and import_stream differ");
    uint32_t first = 0, layers = 0;
    std::memcpy(&first, bytes + 24, 4);
    std::memcpy(&layers, bytes + 28, 4);
    std::vector<uint8_t> again;
    uint64_t again_size = 0;
    const qjlkv_status es = qjlkv_cache_export_size(c, kSeq, first, layers, &again_size);
    // A stream of empty layers is valid, but there is nothing to export then.
    if (es == QJLKV_OK) {
      again.resize(again_size);
      FUZZ_CHECK(qjlkv_cache_export(c, kSeq, first, layers, again.data(), again.size()) == QJLKV_OK, "export");
      uint32_t again_version = 0, newer_fields[2] = {1, 1};
      std::memcpy(&again_version, again.data() + 8, 4);
      std::memcpy(newer_fields, again.data() + 124, 8);
      FUZZ_CHECK(again_version == written_version(cfg, version), "re-exported as version %u", again_version);
      const size_t again_header = header_bytes_of(again_version);
      FUZZ_CHECK(version != 1 || (newer_fields[0] == 0 && newer_fields[1] == 0),
                 "a version 1 stream re-exported with value_method %u, sink_tokens %u", newer_fields[0],
                 newer_fields[1]);
      const bool converted = version < 3 && cfg.key_method == QJLKV_KEYS_QJL && cfg.outlier_channels > 0;
      if (converted) {
        // The layer range [24, 32) and the config fields [40, 124) stay; the payload size may not.
        FUZZ_CHECK(std::memcmp(again.data() + 24, stream.data() + 24, 8) == 0 &&
                       std::memcmp(again.data() + 40, stream.data() + 40, 124 - 40) == 0,
                   "a converted stream re-exported with another layer range or config");
        qjlkv_cache *reimported = make_destination(cfg);
        FUZZ_CHECK(qjlkv_cache_import(reimported, kSeq, again.data(), again.size()) == QJLKV_OK,
                   "the re-export of a converted stream does not import: %s", qjlkv_last_error_message());
        FUZZ_CHECK(same(state_of(reimported, cfg), state_of(c, cfg)), "the re-export imports another sequence");
        std::vector<uint8_t> twice(again.size());
        FUZZ_CHECK(qjlkv_cache_export(reimported, kSeq, first, layers, twice.data(), twice.size()) == QJLKV_OK,
                   "export of the re-import");
        FUZZ_CHECK(twice == again, "the re-export of a converted stream is not canonical");
        qjlkv_cache_destroy(reimported);
      } else {
        // Same payload; the headers share their config fields, and a field only one of them has
        // is 0 (the fields version 1 lacks; key_token_bits of a version-4 stream re-exported as
        // version 3). The version [8, 12), the header bytes [12, 16), the writer's library
        // version [16, 20) and the CRCs may differ.
        FUZZ_CHECK(again_size - again_header == stream.size() - header_bytes,
                   "export size %llu (header %zu), the stream had %zu (header %zu)", (unsigned long long)again_size,
                   again_header, stream.size(), header_bytes);
        const size_t common = std::min(header_bytes, again_header) - 4;
        for (size_t i = 0; i < common; ++i)
          FUZZ_CHECK((i >= 8 && i < 20) || again[i] == stream[i], "re-exported header differs at byte %zu", i);
        for (size_t i = common; i < again_header - 4; ++i)
          FUZZ_CHECK(again[i] == 0, "re-exported header byte %zu is %u, a field the stream lacks", i, again[i]);
        for (size_t i = common; i < header_bytes - 4; ++i)
          FUZZ_CHECK(stream[i] == 0, "the stream's header byte %zu (%u) is lost in the re-export", i, stream[i]);
        for (size_t i = header_bytes; i < stream.size() - 4; ++i)
          FUZZ_CHECK(again[i - header_bytes + again_header] == stream[i], "re-export differs at payload byte %zu",
                     i - header_bytes);
      }
    }
    check_usable(c, cfg);
  }
  qjlkv_cache_destroy(streamed);
  qjlkv_cache_destroy(c);
  return 0;
}
