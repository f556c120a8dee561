// CRC-32C (Castagnoli: reflected polynomial 0x82F63B78, initial value and final XOR 0xFFFFFFFF),
// the checksum of the serialized stream (docs/FORMAT.md). A byte-table implementation, sped up
// with 8 tables (slicing-by-8); the SSE4.2 crc32 instruction where the CPU has it. Both give the
// same value (tests/cpp/test_serialize.cpp checks them against RFC 3720's vectors and each other).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define QJLKV_CRC32C_SSE42 1
#endif

namespace qjlkv {

namespace crc32c_detail {

inline constexpr uint32_t kPolynomial = 0x82F63B78u;

constexpr std::array<std::array<uint32_t, 256>, 8> make_tables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = c & 1u ? (c >> 1) ^ kPolynomial : c >> 1;
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (size_t s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
  return t;
}
inline constexpr auto kTables = make_tables();

}  // namespace crc32c_detail

// Continues a running CRC (the state before the final XOR; start from 0xFFFFFFFF) over bytes.
inline uint32_t crc32c_update_portable(uint32_t state, const void *data, size_t size) {
  const auto &t = crc32c_detail::kTables;
  const auto *p = static_cast<const uint8_t *>(data);
  for (; size >= 8; size -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);  // the tables assume little-endian words (docs/FORMAT.md)
    word ^= state;
    state = t[7][word & 0xff] ^ t[6][(word >> 8) & 0xff] ^ t[5][(word >> 16) & 0xff] ^ t[4][(word >> 24) & 0xff] ^
            t[3][(word >> 32) & 0xff] ^ t[2][(word >> 40) & 0xff] ^ t[1][(word >> 48) & 0xff] ^ t[0][word >> 56];
  }
  for (; size > 0; --size, ++p) state = (state >> 8) ^ t[0][(state ^ *p) & 0xffu];
  return state;
}

#ifdef QJLKV_CRC32C_SSE42
__attribute__((target("sse4.2"))) inline uint32_t crc32c_update_sse42(uint32_t state, const void *data, size_t size) {
  const auto *p = static_cast<const uint8_t *>(data);
  uint64_t s = state;
  for (; size >= 8; size -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    s = _mm_crc32_u64(s, word);
  }
  auto s32 = uint32_t(s);
  for (; size > 0; --size, ++p) s32 = _mm_crc32_u8(s32, *p);
  return s32;
}
#endif

inline uint32_t crc32c_update(uint32_t state, const void *data, size_t size) {
#ifdef QJLKV_CRC32C_SSE42
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  if (has_sse42) return crc32c_update_sse42(state, data, size);
#endif
  return crc32c_update_portable(state, data, size);
}

// The CRC-32C of a whole buffer: crc32c("123456789", 9) == 0xE3069283.
inline uint32_t crc32c(const void *data, size_t size) { return crc32c_update(0xFFFFFFFFu, data, size) ^ 0xFFFFFFFFu; }

}  // namespace qjlkv
