// Export and import of one sequence: the byte stream of docs/FORMAT.md. The backends show their
// state through the portable view of cache.hpp; everything about the format lives here.
//
// Import is all-or-nothing: the backend stages the sequence in storage the cache does not see,
// every byte is checked as it arrives (sizes, counts, the numbers the kernels rely on), and the
// staging is committed only once the trailing checksum matched.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cache.hpp"
#include "config.hpp"
#include "crc32c.hpp"
#include "error.hpp"
#include "half.hpp"
#include "methods/methods.hpp"
#include "qjlkv/qjlkv.h"
#include "quant_math.hpp"

static_assert(std::endian::native == std::endian::little,
              "the stream is little-endian and copied as is: a big-endian port must swap its fields");

namespace qjlkv {
namespace {

// ---- the format's constants (docs/FORMAT.md) ----------------------------------------------------
constexpr char kMagic[8] = {'Q', 'J', 'L', 'K', 'V', 'S', 'E', 'Q'};
// Written: version 5 when a layer of the stream has blocks its sliding window freed, else 4 when
// the config has a field version 3 lacks (key_token_bits), else 3, so that what 0.4 could store
// stays readable by it; versions 1 to 5 are read.
constexpr uint32_t kFormatVersion = 5;
constexpr uint32_t kCorrectionsVersion = 3;  // QJL outlier corrections replace the outlier sign bits
constexpr uint32_t kFreedBlocksVersion = 5;   // layer sections carry freed_blocks
constexpr uint32_t kSectionHeaderBytes = 16;  // tag, reserved, body bytes
// The fixed fields that open a layer section; version 5 adds freed_blocks and a reserved field.
constexpr uint32_t layer_field_bytes(uint32_t version) { return version >= kFreedBlocksVersion ? 40 : 32; }
constexpr uint32_t kMaxLayerFieldBytes = layer_field_bytes(kFreedBlocksVersion);
constexpr uint32_t kOutlierFieldBytes = 16;   // pool, spilled, tracing, reserved
constexpr uint32_t kTrailerBytes = 4;         // CRC-32C of everything before it
constexpr uint32_t kLayerTag = 1;

// The header's config fields (docs/FORMAT.md): what determines the stored bytes, in stream order.
// Each version stores the first config_fields(version); a field a version predates has its
// implied value there (kImpliedFields, from field kConfigFieldsV1 on).
constexpr const char *kConfigFieldNames[] = {
    "dtype",          "key_method",     "num_kv_heads",          "head_dim",
    "block_tokens",   "residual_tokens", "sketch_flags",         "key_sketch_dim",
    "outlier_channels", "outlier_sketch_dim", "initial_layers",  "initial_key_sketch_dim",
    "initial_outlier_sketch_dim", "key_bits", "outlier_tokens",  "outlier_spill_tokens",
    "outlier_skip_layers", "value_bits", "value_group_size", "value_method", "sink_tokens", "key_token_bits"};
constexpr size_t kConfigFieldsV1 = 19, kValueMethodField = 19;
constexpr uint32_t kImpliedFields[] = {QJLKV_VALUES_UNIFORM, 0, 0};  // value_method, sink_tokens, key_token_bits
constexpr size_t config_fields(uint32_t version) {
  return version == 1 ? kConfigFieldsV1 : version < 4 ? kConfigFieldsV1 + 2 : std::size(kConfigFieldNames);  // 5: as 4
}
constexpr uint32_t header_bytes_of(uint32_t version) { return uint32_t(48 + 4 * config_fields(version) + 4); }
constexpr uint32_t kMaxHeaderBytes = header_bytes_of(kFormatVersion);
struct StoredConfig {
  uint64_t seed;
  std::array<uint32_t, std::size(kConfigFieldNames)> fields;
};

// From a cache's spec().cfg, whose fields of other key or value methods are already zero. The
// seed matters to sketched keys (QJL) and seeded values (the rotation's signs), the sketch
// flags only to sketched keys.
StoredConfig stored_config(const qjlkv_config &cfg) {
  const bool sketched = with_key_method(cfg.key_method, [](auto keys) { return keys.kSketched; });
  const bool seeded = sketched || with_value_method(cfg.value_method, [](auto values) { return values.kSeeded; });
  return {seeded ? cfg.seed : 0,
          {uint32_t(cfg.dtype), uint32_t(cfg.key_method), cfg.num_kv_heads, cfg.head_dim, cfg.block_tokens,
           cfg.residual_tokens, sketched ? cfg.sketch_flags : 0, cfg.key_sketch_dim, cfg.outlier_channels,
           cfg.outlier_sketch_dim, cfg.initial_layers, cfg.initial_key_sketch_dim, cfg.initial_outlier_sketch_dim,
           cfg.key_bits, cfg.outlier_tokens, cfg.outlier_spill_tokens, cfg.outlier_skip_layers, cfg.value_bits,
           cfg.value_group_size, cfg.value_method, cfg.sink_tokens, cfg.key_token_bits}};
}
static_assert(header_bytes_of(1) == 128 && header_bytes_of(3) == 136 && header_bytes_of(4) == 140 &&
                  kMaxHeaderBytes == 140 &&
                  kConfigFieldsV1 + std::size(kImpliedFields) == std::size(kConfigFieldNames),
              "the header sizes of docs/FORMAT.md");

// The oldest version that holds every field of this config that differs from its implied value
// (versions 3 and up: 1 and 2 are never written), and freed blocks when `freed` says a layer has
// them.
uint32_t written_version(const qjlkv_config &cfg, bool freed) {
  if (freed) return kFreedBlocksVersion;
  const StoredConfig sc = stored_config(cfg);
  for (uint32_t version = 3; version < 4; ++version) {
    bool implied = true;
    for (size_t i = config_fields(version); i < sc.fields.size(); ++i)
      implied = implied && sc.fields[i] == kImpliedFields[i - kConfigFieldsV1];
    if (implied) return version;
  }
  return 4;
}

// ---- little-endian fields ------------------------------------------------------------------------
void put32(uint8_t *p, uint32_t v) { std::memcpy(p, &v, 4); }
void put64(uint8_t *p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t get32(const uint8_t *p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t get64(const uint8_t *p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// ---- sizes ---------------------------------------------------------------------------------------
struct LayerShape {
  PortableCounts counts;
  std::vector<uint32_t> outlier_tokens;  // per kv head: pool + spilled (traced layers)
  std::vector<uint32_t> pool_tokens;     // per kv head: pool
};

size_t record_bytes(const BlockLayout &layout) { return layout.key_bytes + layout.value_bytes; }

// Format versions 1 and 2 stored a QJL block with outlier channels with the outlier part's sign
// bits where version 3 stores their corrections: norm_in fp16[B], norm_out fp16[B], bits_in
// [B][m/8], bits_out [B][m_out/8], outlier channels uint8[c]. Without outlier channels the two
// layouts are the same.
struct SignBitsLayout {
  size_t norm_in, norm_out, bits_in, bits_out, outlier_idx, key_bytes;
  size_t bytes_per_token_bits_out;
};

bool stores_sign_bits(const CacheSpec &spec, const LayerSpec &layer, uint32_t version) {
  return version < kCorrectionsVersion && key_method_of(spec.cfg) == QJLKV_KEYS_QJL && layer.m_out > 0;
}

SignBitsLayout sign_bits_layout(const qjlkv_config &cfg, const LayerSpec &layer) {
  const size_t B = cfg.block_tokens;
  SignBitsLayout old{};
  old.bytes_per_token_bits_out = layer.m_out / 8;
  old.norm_in = 0;
  old.norm_out = 2 * B;
  old.bits_in = 4 * B;
  old.bits_out = old.bits_in + B * (layer.m / 8);
  old.outlier_idx = old.bits_out + B * old.bytes_per_token_bits_out;
  old.key_bytes = old.outlier_idx + cfg.outlier_channels;
  return old;
}

// The block record bytes of a layer in a stream of this format version.
size_t stream_record_bytes(const CacheSpec &spec, uint32_t layer, uint32_t version) {
  const LayerSpec &ls = spec.layers[layer];
  if (!stores_sign_bits(spec, ls, version)) return record_bytes(ls.layout);
  return sign_bits_layout(spec.cfg, ls).key_bytes + ls.layout.value_bytes;
}

// Bytes of a layer section's body (after its section header) in a stream of format `version`
// whose block records take `record` bytes each; only blocks [freed_blocks, blocks) are stored.
// Overflow-checked: a stream's counts are untrusted (freed_blocks <= blocks checked before).
uint64_t layer_body_bytes(const CacheSpec &spec, const LayerShape &shape, size_t record, uint32_t version) {
  const qjlkv_config &cfg = spec.cfg;
  const uint64_t token = uint64_t(cfg.num_kv_heads) * cfg.head_dim * spec.io_elem;
  const uint64_t row = uint64_t(cfg.head_dim) * spec.io_elem;
  // blocks < 2^29 (B >= 8, length < 2^32), Hkv <= 2^12, a record < 2^23 bytes, the sinks and the
  // tail < 2^40 bytes: the sum stays below 2^64.
  const uint64_t stored_blocks = shape.counts.blocks - shape.counts.freed_blocks;
  uint64_t bytes = layer_field_bytes(version) + stored_blocks * cfg.num_kv_heads * record;
  bytes += 2 * (uint64_t(shape.counts.sink_tokens) + shape.counts.tail_tokens) * token;
  for (size_t h = 0; h < shape.outlier_tokens.size(); ++h)
    bytes += kOutlierFieldBytes + uint64_t(shape.outlier_tokens[h]) * (4 + 2 * row) +
             4 * uint64_t(shape.pool_tokens[h]);
  return bytes;
}

// ---- output ----------------------------------------------------------------------------------------
// Coalesces small writes into pieces of up to kPiece bytes for the sink and keeps the running CRC.
class Writer {
 public:
  static constexpr size_t kPiece = 1 << 16;
  Writer(qjlkv_write_fn write, void *user) : write_(write), user_(user) { buffer_.reserve(kPiece); }

  void bytes(const void *data, size_t size) {
    if (size == 0) return;  // data may be the NULL of an empty vector
    crc_ = crc32c_update(crc_, data, size);
    written_ += size;
    const auto *p = static_cast<const uint8_t *>(data);
    while (size > 0) {
      if (buffer_.empty() && size >= kPiece) {  // large pieces go out directly
        emit(p, size);
        return;
      }
      const size_t n = std::min(size, kPiece - buffer_.size());
      buffer_.insert(buffer_.end(), p, p + n);
      p += n;
      size -= n;
      if (buffer_.size() == kPiece) flush();
    }
  }
  void u32(uint32_t v) {
    uint8_t b[4];
    put32(b, v);
    bytes(b, 4);
  }
  void finish() {
    const uint32_t crc = crc_ ^ 0xFFFFFFFFu;
    u32(crc);
    flush();
  }
  uint64_t written() const { return written_; }

 private:
  void flush() {
    if (buffer_.empty()) return;
    emit(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  void emit(const uint8_t *p, size_t size) {
    const size_t taken = write_(user_, p, size);
    if (taken != size)
      fail(QJLKV_ERROR_INVALID_ARGUMENT, "write: the callback took %zu of %zu bytes at stream offset %llu; export "
           "stopped", taken, size, (unsigned long long)(written_ - size));
  }

  qjlkv_write_fn write_;
  void *user_;
  std::vector<uint8_t> buffer_;
  uint32_t crc_ = 0xFFFFFFFFu;
  uint64_t written_ = 0;
};

struct BufferSink {
  uint8_t *at;
  static size_t write(void *user, const void *data, size_t size) {
    auto *sink = static_cast<BufferSink *>(user);
    std::memcpy(sink->at, data, size);
    sink->at += size;
    return size;
  }
};

void check_range(const qjlkv_cache *c, uint32_t seq, uint32_t first_layer, uint32_t num_layers) {
  const uint32_t layers = c->spec().cfg.num_layers;
  QJLKV_REQUIRE(num_layers >= 1, "num_layers is 0, must be >= 1");
  QJLKV_REQUIRE(first_layer < layers && num_layers <= layers - first_layer,
                "first_layer (%u) + num_layers (%u) exceed the cache's %u layers", first_layer, num_layers, layers);
  for (uint32_t l = first_layer; l < first_layer + num_layers; ++l)
    if (c->length(l, seq) > 0) return;
  fail(QJLKV_ERROR_INVALID_ARGUMENT, "seq %u holds no tokens in layers [%u, %u)", seq, first_layer,
       first_layer + num_layers);
}

LayerShape layer_shape(const qjlkv_cache *c, uint32_t layer, uint32_t seq) {
  LayerShape shape;
  shape.counts = c->portable_counts(layer, seq);
  if (shape.counts.length > 0 && c->spec().layers[layer].traced) {
    PortableOutliers ott;
    for (uint32_t h = 0; h < c->spec().cfg.num_kv_heads; ++h) {
      c->read_outliers(layer, seq, h, ott);
      shape.outlier_tokens.push_back(ott.pool + ott.spilled);
      shape.pool_tokens.push_back(ott.pool);
    }
  }
  return shape;
}

// The format version of a stream of these layers: 5 only when one has freed blocks.
uint32_t stream_version(const qjlkv_cache *c, uint32_t seq, uint32_t first_layer, uint32_t num_layers) {
  bool freed = false;
  for (uint32_t l = first_layer; l < first_layer + num_layers; ++l)
    freed = freed || c->portable_counts(l, seq).freed_blocks > 0;
  return written_version(c->spec().cfg, freed);
}

uint64_t stream_bytes(const qjlkv_cache *c, uint32_t seq, uint32_t first_layer, uint32_t num_layers,
                      uint64_t *payload) {
  const uint32_t version = stream_version(c, seq, first_layer, num_layers);
  uint64_t bytes = 0;
  for (uint32_t l = first_layer; l < first_layer + num_layers; ++l)
    bytes += kSectionHeaderBytes +
             layer_body_bytes(c->spec(), layer_shape(c, l, seq), record_bytes(c->spec().layers[l].layout), version);
  if (payload) *payload = bytes;
  return header_bytes_of(version) + bytes + kTrailerBytes;
}

void write_header(Writer &out, const qjlkv_cache *c, uint32_t version, uint32_t first_layer, uint32_t num_layers,
                  uint64_t payload) {
  const uint32_t header_bytes = header_bytes_of(version);
  uint8_t h[kMaxHeaderBytes] = {};
  std::memcpy(h, kMagic, 8);
  put32(h + 8, version);
  put32(h + 12, header_bytes);
  put32(h + 16, QJLKV_VERSION_NUMBER);
  put32(h + 20, 0);  // flags
  put32(h + 24, first_layer);
  put32(h + 28, num_layers);
  put64(h + 32, payload);
  const StoredConfig sc = stored_config(c->spec().cfg);
  put64(h + 40, sc.seed);
  for (size_t i = 0; i < config_fields(version); ++i) put32(h + 48 + 4 * i, sc.fields[i]);
  put32(h + header_bytes - 4, crc32c(h, header_bytes - 4));
  out.bytes(h, header_bytes);
}

// Export reads the blocks of a layer in runs of up to this many bytes (a backend whose reads
// synchronize, CUDA, waits once per run).
constexpr size_t kBlockRun = size_t(1) << 18;

void export_stream(const qjlkv_cache *c, uint32_t seq, uint32_t first_layer, uint32_t num_layers, Writer &out) {
  const CacheSpec &spec = c->spec();
  const qjlkv_config &cfg = spec.cfg;
  uint64_t payload = 0;
  const uint64_t total = stream_bytes(c, seq, first_layer, num_layers, &payload);
  const uint32_t version = stream_version(c, seq, first_layer, num_layers);
  write_header(out, c, version, first_layer, num_layers, payload);
  std::vector<uint8_t> block, rows;
  PortableOutliers ott;
  for (uint32_t l = first_layer; l < first_layer + num_layers; ++l) {
    const LayerShape shape = layer_shape(c, l, seq);
    const BlockLayout &layout = spec.layers[l].layout;
    uint8_t f[kSectionHeaderBytes + kMaxLayerFieldBytes] = {};
    put32(f, kLayerTag);
    put64(f + 8, layer_body_bytes(spec, shape, record_bytes(layout), version));
    uint8_t *lf = f + kSectionHeaderBytes;
    put32(lf, l);
    put32(lf + 4, uint32_t(shape.outlier_tokens.size()));
    put64(lf + 8, shape.counts.length);
    put32(lf + 16, shape.counts.blocks);
    put32(lf + 20, shape.counts.tail_tokens);
    put32(lf + 24, uint32_t(record_bytes(layout)));
    put32(lf + 28, shape.counts.sink_tokens);
    if (version >= kFreedBlocksVersion) put32(lf + 32, shape.counts.freed_blocks);  // lf + 36: reserved, 0
    out.bytes(f, kSectionHeaderBytes + layer_field_bytes(version));
    if (shape.counts.length == 0) continue;
    const size_t token = size_t(cfg.num_kv_heads) * cfg.head_dim * spec.io_elem;
    const uint32_t chunk = uint32_t(std::max<size_t>(1, Writer::kPiece / token));
    rows.resize(size_t(std::min(chunk, std::max(shape.counts.sink_tokens, shape.counts.tail_tokens))) * token);
    // All keys, then all values of the sinks (or the tail), through a bounded buffer.
    const auto write_exact = [&](ExactRows which, uint32_t tokens) {
      for (const bool values : {false, true}) {
        for (uint32_t t = 0; t < tokens; t += chunk) {
          const uint32_t n = std::min(chunk, tokens - t);
          c->read_exact(l, seq, which, t, n, values, rows.data());
          out.bytes(rows.data(), size_t(n) * token);
        }
      }
    };
    write_exact(ExactRows::sinks, shape.counts.sink_tokens);
    // Runs of blocks (all kv heads) of up to kBlockRun bytes, at least one block.
    const size_t block_bytes = size_t(cfg.num_kv_heads) * layout.stride;
    const uint32_t run = uint32_t(std::max<size_t>(1, kBlockRun / block_bytes));
    block.resize(size_t(std::min(run, shape.counts.blocks - shape.counts.freed_blocks)) * block_bytes);
    for (uint32_t b = shape.counts.freed_blocks; b < shape.counts.blocks; b += run) {
      const uint32_t n = std::min(run, shape.counts.blocks - b);
      c->read_blocks(l, seq, b, n, block.data());
      for (size_t r = 0; r < size_t(n) * cfg.num_kv_heads; ++r) {
        const uint8_t *record = block.data() + r * layout.stride;
        out.bytes(record, layout.key_bytes);
        out.bytes(record + layout.values_offset, layout.value_bytes);
      }
    }
    write_exact(ExactRows::tail, shape.counts.tail_tokens);
    for (uint32_t h = 0; h < shape.outlier_tokens.size(); ++h) {
      c->read_outliers(l, seq, h, ott);
      uint8_t of[kOutlierFieldBytes] = {};
      put32(of, ott.pool);
      put32(of + 4, ott.spilled);
      put32(of + 8, ott.tracing ? 1 : 0);
      out.bytes(of, sizeof of);
      out.bytes(ott.positions.data(), 4 * ott.positions.size());
      out.bytes(ott.norms.data(), 4 * ott.norms.size());
      out.bytes(ott.keys.data(), ott.keys.size());
      out.bytes(ott.values.data(), ott.values.size());
    }
  }
  out.finish();
  if (out.written() != total)
    fail(QJLKV_ERROR_INTERNAL, "export wrote %llu bytes, its size was computed as %llu",
         (unsigned long long)out.written(), (unsigned long long)total);
}

// ---- input -----------------------------------------------------------------------------------------
// Reads exact byte counts from the source, keeping the running CRC and the offset for messages.
class Reader {
 public:
  Reader(qjlkv_read_fn read, void *user, uint64_t known_size)
      : read_(read), user_(user), known_size_(known_size) {}

  void bytes(void *data, size_t size, const char *what) {
    if (size == 0) return;  // data may be the NULL of an empty vector
    if (known_size_ != kUnknown && size > known_size_ - offset_) truncated(what);
    const size_t got = read_(user_, data, size);
    if (got != size) truncated(what);
    crc_ = crc32c_update(crc_, data, size);
    offset_ += size;
  }
  // Whether `size` more bytes can be there (false only for sources of known size).
  bool can_hold(uint64_t size) const { return known_size_ == kUnknown || size <= known_size_ - offset_; }
  uint32_t crc() const { return crc_ ^ 0xFFFFFFFFu; }
  uint64_t known_size() const { return known_size_; }
  uint64_t offset() const { return offset_; }
  static constexpr uint64_t kUnknown = ~uint64_t(0);

 private:
  [[noreturn]] void truncated(const char *what) const {
    fail(QJLKV_ERROR_CORRUPT_DATA, "the stream is truncated: it ends inside %s (stream offset %llu)", what,
         (unsigned long long)offset_);
  }
  qjlkv_read_fn read_;
  void *user_;
  uint64_t known_size_;
  uint32_t crc_ = 0xFFFFFFFFu;
  uint64_t offset_ = 0;
};

struct BufferSource {
  const uint8_t *at;
  static size_t read(void *user, void *data, size_t size) {
    auto *source = static_cast<BufferSource *>(user);
    std::memcpy(data, source->at, size);
    source->at += size;
    return size;
  }
};

[[noreturn]] void corrupt(const char *format, ...) __attribute__((format(printf, 1, 2)));
void corrupt(const char *format, ...) {
  char message[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(message, sizeof message, format, args);
  va_end(args);
  fail(QJLKV_ERROR_CORRUPT_DATA, "corrupt stream: %s", message);
}

bool half_finite(uint16_t h, qjlkv_dtype stored) {
  return stored == QJLKV_DTYPE_BF16 ? (h & 0x7f80u) != 0x7f80u : (h & 0x7c00u) != 0x7c00u;
}

// Checks the header against this cache and call; returns its size, the layer range and the
// payload's size.
struct HeaderInfo {
  uint32_t version, header_bytes;
  uint32_t first_layer, num_layers;
  uint64_t payload;
};

HeaderInfo read_header(Reader &in, const qjlkv_cache *c, uint32_t seq) {
  uint8_t h[kMaxHeaderBytes];
  in.bytes(h, 12, "the header");
  if (std::memcmp(h, kMagic, 8) != 0) corrupt("the first 8 bytes are not the magic \"QJLKVSEQ\": not a qjlkv stream");
  const uint32_t version = get32(h + 8);
  if (version < 1 || version > kFormatVersion)
    fail(QJLKV_ERROR_INVALID_ARGUMENT, "the stream has format version %u; this library (%s) reads versions 1 to %u",
         version, qjlkv_version_string(), kFormatVersion);
  const uint32_t header_bytes = header_bytes_of(version);
  in.bytes(h + 12, header_bytes - 12, "the header");
  const uint32_t crc_at = header_bytes - 4;
  if (get32(h + crc_at) != crc32c(h, crc_at))
    corrupt("the header checksum is 0x%08x, the header's bytes give 0x%08x", get32(h + crc_at), crc32c(h, crc_at));
  if (get32(h + 12) != header_bytes)
    corrupt("header_bytes is %u, format version %u has %u", get32(h + 12), version, header_bytes);
  if (get32(h + 20) != 0) corrupt("flags is 0x%x, format version %u defines none", get32(h + 20), version);
  const StoredConfig mine = stored_config(c->spec().cfg);
  const size_t stored_fields = config_fields(version);
  const auto compare = [&](size_t i) {
    const uint32_t theirs = i < stored_fields ? get32(h + 48 + 4 * i) : kImpliedFields[i - kConfigFieldsV1];
    if (theirs == mine.fields[i]) return;
    if (i < stored_fields)
      fail(QJLKV_ERROR_INVALID_ARGUMENT, "the stream's config does not match this cache: config.%s is %u in the stream, %u here",
           kConfigFieldNames[i], theirs, mine.fields[i]);
    fail(QJLKV_ERROR_INVALID_ARGUMENT,
         "the stream's config does not match this cache: config.%s is %u in the stream (format version %u, which "
         "predates the field), %u here",
         kConfigFieldNames[i], theirs, version, mine.fields[i]);
  };
  // value_method first: it decides what value_bits and value_group_size mean, so that a
  // mismatch names the method rather than one of its consequences.
  compare(kValueMethodField);
  for (size_t i = 0; i < mine.fields.size(); ++i)
    if (i != kValueMethodField) compare(i);
  const uint64_t seed = get64(h + 40);
  if (seed != mine.seed)
    fail(QJLKV_ERROR_INVALID_ARGUMENT,
         "the stream's config does not match this cache: config.seed (of the sketch or the value rotation) is %llu "
         "in the stream, %llu here",
         (unsigned long long)seed, (unsigned long long)mine.seed);
  const HeaderInfo info{version, header_bytes, get32(h + 24), get32(h + 28), get64(h + 32)};
  const uint32_t layers = c->spec().cfg.num_layers;
  if (info.num_layers == 0) corrupt("the header lists 0 layers");
  if (info.first_layer >= layers || info.num_layers > layers - info.first_layer)
    fail(QJLKV_ERROR_INVALID_ARGUMENT, "the stream holds layers [%u, %u), this cache has %u layers",
         info.first_layer, uint32_t(std::min<uint64_t>(uint64_t(info.first_layer) + info.num_layers, UINT32_MAX)),
         layers);
  for (uint32_t l = info.first_layer; l < info.first_layer + info.num_layers; ++l) {
    const uint64_t length = c->length(l, seq);
    if (length > 0)
      fail(QJLKV_ERROR_INVALID_ARGUMENT,
           "seq %u already holds %llu tokens in layer %u: import needs an empty sequence (clear it first)", seq,
           (unsigned long long)length, l);
  }
  if (!in.can_hold(info.payload) || !in.can_hold(info.payload + kTrailerBytes))
    corrupt("the stream is truncated: the header announces %llu payload bytes, the stream ends before them",
            (unsigned long long)info.payload);
  return info;
}

// The importer's side of a method's check_stored(): the problems of one block record of one kv
// head, reported as corrupt data that names the block.
struct StoredBlockCheck {
  const uint8_t *block;
  uint32_t layer, b, h;
  // n 16-bit numbers at `offset`: finite, and >= 0 (or -0) when non_negative.
  void halves(size_t offset, size_t n, bool non_negative, qjlkv_dtype stored, const char *what) const {
    for (size_t i = 0; i < n; ++i) {
      const uint16_t x = at<uint16_t>(block, offset)[i];
      if (!half_finite(x, stored) || (non_negative && (x & 0x8000u) && x != 0x8000u))
        corrupt("layer %u, block %u, kv head %u: %s[%zu] is %g", layer, b, h, what, i,
                double(from_16bit(x, stored)));
    }
  }
  [[noreturn, gnu::format(printf, 2, 3)]] void fail(const char *format, ...) const {
    char message[384];
    va_list args;
    va_start(args, format);
    std::vsnprintf(message, sizeof message, format, args);
    va_end(args);
    corrupt("layer %u, block %u, kv head %u: %s", layer, b, h, message);
  }
};

// Checks one block record of one kv head (already placed at its layout offsets in `block`): the
// numbers the kernels index or divide by, and finiteness of every stored float (the methods'
// check_stored). Appends the positions OTT moved out of the block to `moved`.
void check_block(const CacheSpec &spec, uint32_t layer, const uint8_t *block, uint64_t first_position,
                 std::vector<uint64_t> &moved, uint32_t b, uint32_t h) {
  const LayerSpec &ls = spec.layers[layer];
  const StoredBlockCheck check{block, layer, b, h};
  with_methods(spec.cfg, [&](auto keys, auto values) {
    keys.check_stored(spec, ls, block, check);
    values.check_stored(spec, ls, block, check);
    for (uint32_t t = 0; t < spec.cfg.block_tokens; ++t)
      if (keys.moved(ls.layout, block, t)) moved.push_back(first_position + t);
  });
}

// The block of a version 1 or 2 record of a QJL layer with outlier channels (`old_keys`, the
// SignBitsLayout; the values already in place): the arrays both layouts share moved to this
// version's offsets, then each token's corrections computed from the outlier sign bits the old
// record holds in their place. The shared arrays are checked first, as check_block checks them:
// the corrections index the sketch by the outlier channels and scale by the norms.
void convert_sign_bits_record(const CacheSpec &spec, uint32_t layer, const uint8_t *old_keys, uint8_t *block,
                              uint32_t b, uint32_t h) {
  const qjlkv_config &cfg = spec.cfg;
  const LayerSpec &ls = spec.layers[layer];
  const BlockLayout &l = ls.layout;
  const SignBitsLayout old = sign_bits_layout(cfg, ls);
  const size_t B = cfg.block_tokens;
  std::memcpy(block + l.key_norm_in, old_keys + old.norm_in, 2 * B);
  std::memcpy(block + l.key_norm_out, old_keys + old.norm_out, 2 * B);
  std::memcpy(block + l.key_bits_in, old_keys + old.bits_in, B * l.key_bytes_per_token_bits_in);
  std::memcpy(block + l.key_outlier_idx, old_keys + old.outlier_idx, cfg.outlier_channels);
  std::memset(block + l.key_corrections, 0, 2 * B * cfg.outlier_channels);  // finite until computed
  QjlKeys::check_stored(spec, ls, block, StoredBlockCheck{block, layer, b, h});
  for (uint32_t t = 0; t < B; ++t)
    QjlKeys::store_corrections(ls, cfg, spec.qjl_constant, block, t,
                               old_keys + old.bits_out + t * old.bytes_per_token_bits_out);
}

// Exact key (or value) rows of head_dim elements in the I/O dtype: finite and within the limits
// append enforces, so that they can be quantized later like appended ones.
void check_rows(const CacheSpec &spec, const uint8_t *data, size_t rows, bool values, uint32_t layer,
                const char *where) {
  const uint32_t d = spec.cfg.head_dim;
  const float limit = values ? spec.value_limit : spec.key_limit;
  const char *what = values ? "value" : "key";
  const double norm_limit = values ? value_norm_limit(spec.cfg) : key_norm_limit(spec.cfg);  // 0: none
  for (size_t r = 0; r < rows; ++r) {
    double norm2 = 0.0;
    for (uint32_t j = 0; j < d; ++j) {
      const float x = load_element(data, r * d + j, dtype_of(spec.cfg));
      if (!std::isfinite(x) || std::fabs(x) > limit)
        corrupt("layer %u: %s %s row %zu holds %g", layer, where, what, r, double(x));
      norm2 += double(x) * x;
    }
    if (norm_limit > 0.0 && std::sqrt(norm2) > norm_limit)
      corrupt("layer %u: %s %s row %zu has L2 norm %g > %g, more than this configuration's %ss store", layer, where,
              what, r, std::sqrt(norm2), norm_limit, what);
  }
}

// A layer section's header and counts, checked against the config and the payload left.
struct LayerSection {
  uint32_t layer = 0;
  LayerShape shape;
  uint32_t outlier_heads = 0;
  bool traced = false;         // an OTT-traced layer holding tokens
  uint64_t body = 0;           // bytes after the section header
  uint64_t section_start = 0;  // stream offset where the body began
};

LayerSection read_section_header(Reader &in, const CacheSpec &spec, uint32_t version, uint32_t expected_layer,
                                 uint64_t &payload_left) {
  const qjlkv_config &cfg = spec.cfg;
  uint8_t f[kSectionHeaderBytes + kMaxLayerFieldBytes] = {};
  const uint32_t field_bytes = layer_field_bytes(version);
  in.bytes(f, kSectionHeaderBytes + field_bytes, "a layer section's header");
  const uint32_t tag = get32(f);
  if (tag != kLayerTag)
    corrupt("section tag %u at stream offset %llu is not the layer tag (%u)", tag,
            (unsigned long long)(in.offset() - kSectionHeaderBytes - field_bytes), kLayerTag);
  LayerSection s;
  s.body = get64(f + 8);
  const uint8_t *lf = f + kSectionHeaderBytes;
  const uint32_t layer = s.layer = get32(lf);
  if (get32(f + 4) != 0) corrupt("layer %u: the reserved field is not 0", layer);
  if (layer != expected_layer) corrupt("the layer section for layer %u holds layer %u", expected_layer, layer);
  // Version 1's reserved field at lf + 28 is 0, the sink count of the caches it is read into.
  s.shape.counts = {get64(lf + 8), get32(lf + 16), get32(lf + 20), get32(lf + 28), get32(lf + 32)};
  if (get32(lf + 36) != 0) corrupt("layer %u: the reserved field after freed_blocks is not 0", layer);
  const PortableCounts &counts = s.shape.counts;
  s.outlier_heads = get32(lf + 4);
  const uint64_t length = counts.length, R = cfg.residual_tokens, B = cfg.block_tokens;
  if (length > UINT32_MAX) corrupt("layer %u: length %llu exceeds 2^32 - 1", layer, (unsigned long long)length);
  const uint64_t sinks = std::min<uint64_t>(length, cfg.sink_tokens), rest = length - sinks;
  if (counts.sink_tokens != sinks)
    corrupt("layer %u: %u sink tokens, a sequence of %llu tokens holds %llu (config.sink_tokens %u)", layer,
            counts.sink_tokens, (unsigned long long)length, (unsigned long long)sinks, cfg.sink_tokens);
  const uint64_t blocks = rest >= R + B ? (rest - R) / B : 0;
  if (counts.blocks != blocks || counts.tail_tokens != rest - blocks * B)
    corrupt("layer %u: %u blocks and %u tail tokens are not how a sequence of %llu tokens is stored (%llu blocks)",
            layer, counts.blocks, counts.tail_tokens, (unsigned long long)length, (unsigned long long)blocks);
  if (counts.freed_blocks > counts.blocks)
    corrupt("layer %u: %u freed blocks of %u blocks", layer, counts.freed_blocks, counts.blocks);
  const size_t record = stream_record_bytes(spec, layer, version);
  if (get32(lf + 24) != record)
    corrupt("layer %u: block records of %u bytes, this config's are %zu in format version %u", layer, get32(lf + 24),
            record, version);
  s.traced = spec.layers[layer].traced && length > 0;
  if (s.outlier_heads != (s.traced ? cfg.num_kv_heads : 0))
    corrupt("layer %u: outlier state for %u kv heads, expected %u", layer, s.outlier_heads,
            s.traced ? cfg.num_kv_heads : 0);
  // The section size without the outlier tokens, which are only known as they are read.
  const uint64_t fixed_body =
      layer_body_bytes(spec, s.shape, record, version) + uint64_t(s.outlier_heads) * kOutlierFieldBytes;
  const uint64_t available = payload_left - std::min(payload_left, uint64_t(kSectionHeaderBytes));
  if (s.body > available || s.body < fixed_body || (!s.traced && s.body != fixed_body))
    corrupt("layer %u: the section claims %llu bytes; its counts need %s%llu, the payload has %llu left", layer,
            (unsigned long long)s.body, s.traced ? "at least " : "", (unsigned long long)fixed_body,
            (unsigned long long)available);
  if (!in.can_hold(s.body - field_bytes))
    corrupt("the stream is truncated: layer %u's section claims %llu bytes, the stream ends before", layer,
            (unsigned long long)s.body);
  payload_left -= kSectionHeaderBytes + s.body;
  s.section_start = in.offset() - field_bytes;
  return s;
}

// All keys, then all values of the sinks (or the tail), through the bounded buffer `rows`.
void read_exact_rows(Reader &in, const CacheSpec &spec, uint32_t layer, ExactRows which, uint32_t tokens,
                     std::vector<uint8_t> &rows, PortableImport &staging) {
  const qjlkv_config &cfg = spec.cfg;
  const size_t token = size_t(cfg.num_kv_heads) * cfg.head_dim * spec.io_elem;
  const uint32_t chunk = uint32_t(rows.size() / token);
  const bool sink = which == ExactRows::sinks;
  for (const bool values : {false, true}) {
    for (uint32_t t = 0; t < tokens; t += chunk) {
      const uint32_t n = std::min(chunk, tokens - t);
      in.bytes(rows.data(), size_t(n) * token,
               sink ? (values ? "the sink values" : "the sink keys") : (values ? "the tail values" : "the tail keys"));
      check_rows(spec, rows.data(), size_t(n) * cfg.num_kv_heads, values, layer, sink ? "sink" : "tail");
      staging.write_exact(which, t, n, values, rows.data());
    }
  }
}

// The block records of a layer, each checked and staged; returns, per kv head, the positions the
// blocks mark as moved to OTT's pool, in order.
std::vector<std::vector<uint64_t>> read_blocks(Reader &in, const CacheSpec &spec, uint32_t version,
                                               const LayerSection &s, PortableImport &staging) {
  const qjlkv_config &cfg = spec.cfg;
  const LayerSpec &ls = spec.layers[s.layer];
  const BlockLayout &layout = ls.layout;
  std::vector<uint8_t> block(layout.stride, 0);
  const bool sign_bits = stores_sign_bits(spec, ls, version);
  std::vector<uint8_t> old_keys(sign_bits ? sign_bits_layout(cfg, ls).key_bytes : 0);
  std::vector<std::vector<uint64_t>> moved(cfg.num_kv_heads);
  const uint64_t pool_limit = s.traced ? uint64_t(cfg.outlier_tokens) + cfg.outlier_spill_tokens : 0;
  for (uint32_t b = s.shape.counts.freed_blocks; b < s.shape.counts.blocks; ++b) {
    for (uint32_t h = 0; h < cfg.num_kv_heads; ++h) {
      // Keys of the sign-bit layout are read aside and converted into the block.
      in.bytes(sign_bits ? old_keys.data() : block.data(), sign_bits ? old_keys.size() : layout.key_bytes,
               "a block record");
      in.bytes(block.data() + layout.values_offset, layout.value_bytes, "a block record");
      if (sign_bits) convert_sign_bits_record(spec, s.layer, old_keys.data(), block.data(), b, h);
      check_block(spec, s.layer, block.data(), s.shape.counts.sink_tokens + uint64_t(b) * cfg.block_tokens,
                  moved[h], b, h);
      if (moved[h].size() > pool_limit)
        corrupt("layer %u, kv head %u: more tokens marked as moved than this layer's pool and spill area hold "
                "(%llu)", s.layer, h, (unsigned long long)pool_limit);
      staging.write_block(b, h, block.data());
    }
  }
  return moved;
}

// OTT's outlier state of each kv head: its tokens must be exactly those the blocks mark as moved,
// and distinct positions of freed blocks (whose marks are gone).
void read_outlier_states(Reader &in, const CacheSpec &spec, const LayerSection &s,
                         const std::vector<std::vector<uint64_t>> &moved, PortableImport &staging) {
  const qjlkv_config &cfg = spec.cfg;
  const uint32_t layer = s.layer;
  PortableOutliers ott;
  const size_t row = size_t(cfg.head_dim) * spec.io_elem;
  for (uint32_t h = 0; h < s.outlier_heads; ++h) {
    uint8_t of[kOutlierFieldBytes];
    in.bytes(of, sizeof of, "an outlier state");
    ott.pool = get32(of);
    ott.spilled = get32(of + 4);
    const uint32_t tracing = get32(of + 8);
    if (ott.pool > cfg.outlier_tokens || ott.spilled > cfg.outlier_spill_tokens || tracing > 1 || get32(of + 12) != 0)
      corrupt("layer %u, kv head %u: outlier state (pool %u, spilled %u, tracing %u) outside (%u, %u, 0/1)", layer,
              h, ott.pool, ott.spilled, tracing, cfg.outlier_tokens, cfg.outlier_spill_tokens);
    ott.tracing = tracing == 1;
    const size_t n = size_t(ott.pool) + ott.spilled;
    if (in.offset() - s.section_start + n * (4 + 2 * row) + 4 * ott.pool > s.body)
      corrupt("layer %u, kv head %u: the outlier tokens overrun the section", layer, h);
    ott.positions.resize(n);
    ott.norms.resize(ott.pool);
    ott.keys.resize(n * row);
    ott.values.resize(n * row);
    in.bytes(ott.positions.data(), 4 * n, "the outlier positions");
    in.bytes(ott.norms.data(), 4 * size_t(ott.pool), "the outlier norms");
    in.bytes(ott.keys.data(), ott.keys.size(), "the outlier keys");
    in.bytes(ott.values.data(), ott.values.size(), "the outlier values");
    std::vector<uint64_t> listed(ott.positions.begin(), ott.positions.end());
    std::sort(listed.begin(), listed.end());
    const uint64_t freed_end = cfg.sink_tokens + uint64_t(s.shape.counts.freed_blocks) * cfg.block_tokens;
    const auto of_freed = std::lower_bound(listed.begin(), listed.end(), freed_end);
    if (!listed.empty() && of_freed != listed.begin() && listed.front() < cfg.sink_tokens)
      corrupt("layer %u, kv head %u: outlier token at position %llu, a sink", layer, h,
              (unsigned long long)listed.front());
    if (std::adjacent_find(listed.begin(), of_freed) != of_freed)
      corrupt("layer %u, kv head %u: an outlier position of the freed blocks is listed twice", layer, h);
    listed.erase(listed.begin(), of_freed);
    if (listed != moved[h])
      corrupt("layer %u, kv head %u: the outlier tokens' positions are not those the blocks mark as moved", layer, h);
    for (uint32_t i = 0; i < ott.pool; ++i)
      if (!std::isfinite(ott.norms[i]) || ott.norms[i] < 0.0f)
        corrupt("layer %u, kv head %u: outlier norm %u is %g", layer, h, i, double(ott.norms[i]));
    check_rows(spec, ott.keys.data(), n, false, layer, "outlier");
    check_rows(spec, ott.values.data(), n, true, layer, "outlier");
    staging.write_outliers(h, ott);
  }
}

// One layer section: its header, then sinks, blocks, tail and outlier states, in stream order.
// Returns the layer's freed blocks.
uint32_t read_layer(Reader &in, const qjlkv_cache *c, uint32_t version, uint32_t expected_layer,
                    PortableImport &staging, uint64_t &payload_left) {
  const CacheSpec &spec = c->spec();
  const qjlkv_config &cfg = spec.cfg;
  const LayerSection s = read_section_header(in, spec, version, expected_layer, payload_left);
  const PortableCounts &counts = s.shape.counts;
  if (counts.length == 0) return 0;
  if (counts.freed_blocks > 0) {
    // Freed positions must stay out of every query an append can make next: the layer needs a
    // window that starts, for the query at position `length`, after them.
    const uint32_t window = c->attention(s.layer).window;
    const uint64_t freed_end = cfg.sink_tokens + uint64_t(counts.freed_blocks) * cfg.block_tokens;
    if (window == 0 || window_start(counts.length, window) < freed_end)
      fail(QJLKV_ERROR_INVALID_ARGUMENT,
           "layer %u: the stream's sequence has positions [%u, %llu) freed by a sliding window; this cache's layer "
           "%u has window_tokens %u, which needs them for the next query (at position %llu)",
           s.layer, cfg.sink_tokens, (unsigned long long)freed_end, s.layer, window,
           (unsigned long long)counts.length);
  }
  staging.add_layer(s.layer, counts);

  const size_t token = size_t(cfg.num_kv_heads) * cfg.head_dim * spec.io_elem;
  const uint32_t chunk = uint32_t(std::max<size_t>(1, Writer::kPiece / token));
  std::vector<uint8_t> rows(size_t(std::max(1u, std::min(chunk, std::max(counts.sink_tokens, counts.tail_tokens)))) *
                            token);
  read_exact_rows(in, spec, s.layer, ExactRows::sinks, counts.sink_tokens, rows, staging);
  const std::vector<std::vector<uint64_t>> moved = read_blocks(in, spec, version, s, staging);
  read_exact_rows(in, spec, s.layer, ExactRows::tail, counts.tail_tokens, rows, staging);
  read_outlier_states(in, spec, s, moved, staging);
  if (in.offset() - s.section_start != s.body)
    corrupt("layer %u: the section claims %llu bytes, its contents take %llu", s.layer, (unsigned long long)s.body,
            (unsigned long long)(in.offset() - s.section_start));
  return counts.freed_blocks;
}

void import_stream(qjlkv_cache *c, uint32_t seq, Reader &in) {
  const HeaderInfo info = read_header(in, c, seq);
  const uint64_t total = info.header_bytes + info.payload + kTrailerBytes;
  if (in.known_size() != Reader::kUnknown && in.known_size() != total)
    fail(QJLKV_ERROR_INVALID_ARGUMENT, "size is %llu, the stream's header announces %llu bytes",
         (unsigned long long)in.known_size(), (unsigned long long)total);
  std::unique_ptr<PortableImport> staging = c->begin_import(seq);
  uint64_t payload_left = info.payload;
  bool freed = false;
  for (uint32_t l = info.first_layer; l < info.first_layer + info.num_layers; ++l) {
    if (payload_left < kSectionHeaderBytes) corrupt("the payload ends before the section of layer %u", l);
    freed = read_layer(in, c, info.version, l, *staging, payload_left) > 0 || freed;
  }
  // Version 5 is written only for freed blocks: a stream is canonical (it exports as it came).
  if (info.version >= kFreedBlocksVersion && !freed)
    corrupt("format version %u, but no layer has freed blocks (such streams are version 3 or 4)", info.version);
  if (payload_left != 0)
    corrupt("the header announces %llu payload bytes, the layer sections take %llu", (unsigned long long)info.payload,
            (unsigned long long)(info.payload - payload_left));
  const uint32_t computed = in.crc();
  uint8_t trailer[kTrailerBytes];
  in.bytes(trailer, kTrailerBytes, "the checksum");
  if (get32(trailer) != computed)
    corrupt("the checksum is 0x%08x, the stream's bytes give 0x%08x", get32(trailer), computed);
  staging->flush();
  require_budget(*c, staging->bytes_added(), "the import");
  staging->commit();
}

void require_pointer(const void *p, const char *name) { QJLKV_REQUIRE(p != nullptr, "%s is NULL", name); }

}  // namespace
}  // namespace qjlkv

using qjlkv::guarded;
using qjlkv::require_pointer;

extern "C" {

qjlkv_status qjlkv_cache_export_size(const qjlkv_cache *c, uint32_t seq, uint32_t first_layer, uint32_t num_layers,
                                     uint64_t *size) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(size, "size");
    qjlkv::check_range(c, seq, first_layer, num_layers);
    *size = qjlkv::stream_bytes(c, seq, first_layer, num_layers, nullptr);
  });
}

qjlkv_status qjlkv_cache_export(const qjlkv_cache *c, uint32_t seq, uint32_t first_layer, uint32_t num_layers,
                                void *buf, uint64_t buf_size) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(buf, "buf");
    qjlkv::check_range(c, seq, first_layer, num_layers);
    const uint64_t size = qjlkv::stream_bytes(c, seq, first_layer, num_layers, nullptr);
    QJLKV_REQUIRE(buf_size >= size, "buf_size is %llu, the stream takes %llu bytes (qjlkv_cache_export_size)",
                  (unsigned long long)buf_size, (unsigned long long)size);
    qjlkv::BufferSink sink{static_cast<uint8_t *>(buf)};
    qjlkv::Writer out(&qjlkv::BufferSink::write, &sink);
    qjlkv::export_stream(c, seq, first_layer, num_layers, out);
  });
}

qjlkv_status qjlkv_cache_export_stream(const qjlkv_cache *c, uint32_t seq, uint32_t first_layer,
                                       uint32_t num_layers, qjlkv_write_fn write, void *user) {
  return guarded([&] {
    require_pointer(c, "c");
    QJLKV_REQUIRE(write != nullptr, "write is NULL");
    qjlkv::check_range(c, seq, first_layer, num_layers);
    qjlkv::Writer out(write, user);
    qjlkv::export_stream(c, seq, first_layer, num_layers, out);
  });
}

qjlkv_status qjlkv_cache_import(qjlkv_cache *c, uint32_t seq, const void *buf, uint64_t size) {
  return guarded([&] {
    require_pointer(c, "c");
    require_pointer(buf, "buf");
    qjlkv::BufferSource source{static_cast<const uint8_t *>(buf)};
    qjlkv::Reader in(&qjlkv::BufferSource::read, &source, size);
    qjlkv::import_stream(c, seq, in);
  });
}

qjlkv_status qjlkv_cache_import_stream(qjlkv_cache *c, uint32_t seq, qjlkv_read_fn read, void *user) {
  return guarded([&] {
    require_pointer(c, "c");
    QJLKV_REQUIRE(read != nullptr, "read is NULL");
    qjlkv::Reader in(read, user, qjlkv::Reader::kUnknown);
    qjlkv::import_stream(c, seq, in);
  });
}

}  // extern "C"
