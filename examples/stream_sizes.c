/*
 * stream_sizes.c: bytes per token of the export stream (docs/FORMAT.md) for a model shape,
 * measured with qjlkv_cache_export_size on a one-layer bf16 cache of each preset.
 *
 *   stream_sizes NUM_KV_HEADS HEAD_DIM [NUM_Q_HEADS]
 *
 * Prints, per preset: the bytes one more token adds to one layer (all its kv heads) once its
 * block is quantized (measured over 8 whole blocks), the same for fp16 K and V, and the
 * per-sequence, per-layer overhead at 8 blocks (section fields, the exact sink tokens and tail
 * of R tokens, OTT's pool and spill area). docs/SCALE.md multiplies these by a model's layers.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qjlkv/qjlkv.h"

static void check(qjlkv_status s, const char *what) {
  if (s == QJLKV_OK) return;
  fprintf(stderr, "%s: %s (%s)\n", what, qjlkv_status_string(s), qjlkv_last_error_message());
  exit(1);
}

/* bf16 bits of a deterministic value in about [-2, 2). */
static uint16_t sample(uint64_t i) {
  uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull;
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  float f = (float)(x & 0xffffff) / (float)(1 << 22) - 2.0f;
  uint32_t bits;
  memcpy(&bits, &f, 4);
  return (uint16_t)(bits >> 16);
}

static uint64_t stream_after(const qjlkv_config *cfg, uint32_t tokens) {
  qjlkv_cache *c = NULL;
  check(qjlkv_cache_create(cfg, &c), "create");
  const size_t n = (size_t)tokens * cfg->num_kv_heads * cfg->head_dim;
  uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
  if (!k || !v) exit(1);
  for (size_t i = 0; i < n; ++i) k[i] = sample(i), v[i] = sample(i + n);
  check(qjlkv_cache_append(c, 0, 0, tokens, k, v), "append");
  uint64_t size = 0;
  check(qjlkv_cache_export_size(c, 0, 0, 1, &size), "export_size");
  free(k);
  free(v);
  qjlkv_cache_destroy(c);
  return size;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s NUM_KV_HEADS HEAD_DIM [NUM_Q_HEADS]\n", argv[0]);
    return 2;
  }
  const uint32_t hkv = (uint32_t)atoi(argv[1]), d = (uint32_t)atoi(argv[2]);
  const uint32_t hq = argc > 3 ? (uint32_t)atoi(argv[3]) : hkv;
  const char *presets[] = {"q2", "q3", "q4", "qjl", "kivi", "ott", "exact"};
  const int num_presets = (int)(sizeof presets / sizeof presets[0]);
  printf("%-6s %14s %14s %8s %22s\n", "preset", "bytes/token", "fp16 K+V", "ratio", "per-layer overhead");
  for (int p = 0; p < num_presets; ++p) {
    qjlkv_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.struct_size = sizeof cfg;
    check(qjlkv_config_init(&cfg, presets[p], 1, hq, hkv, d), "config_init");
    cfg.dtype = QJLKV_DTYPE_BF16;
    cfg.outlier_skip_layers = 0; /* measure a traced OTT layer */
    const uint32_t base = cfg.sink_tokens + cfg.residual_tokens + 8 * cfg.block_tokens, more = 8 * cfg.block_tokens;
    const uint64_t s1 = stream_after(&cfg, base), s2 = stream_after(&cfg, base + more);
    const double per_token = (double)(s2 - s1) / more, fp16 = 4.0 * hkv * d;
    /* 136 header bytes and the 4-byte checksum (docs/FORMAT.md, format version 3) */
    const double overhead = (double)s1 - 136 - 4 - per_token * (8.0 * cfg.block_tokens);
    printf("%-6s %14.3f %14.0f %7.2fx %22.0f\n", presets[p], per_token, fp16, fp16 / per_token, overhead);
  }
  return 0;
}
