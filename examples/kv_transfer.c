/*
 * kv_transfer.c: disaggregated prefill and decode with qjlkv_cache_export / qjlkv_cache_import.
 *
 * A toy language model (synthetic, deterministic weights; Llama-like shape scaled down) whose
 * decode really depends on the cache: each layer's query, key and value come from the token
 * and from the previous layer's attention output, and the next token is the argmax of the last
 * layer's output against an embedding table.
 *
 *   kv_transfer prefill FILE [PRESET]   prefills the prompt, writes its cache to FILE, prints the
 *                                       file's size against the fp16 cache's
 *   kv_transfer decode FILE N [PRESET]  a second process: imports FILE, decodes N tokens, prints them
 *   kv_transfer both N [PRESET]         one process doing both (the reference)
 *
 * The tokens printed by "decode" equal those of "both" (examples/CMakeLists.txt checks it for
 * every preset).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qjlkv/qjlkv.h"

enum { LAYERS = 4, Q_HEADS = 8, KV_HEADS = 2, HEAD_DIM = 64, VOCAB = 97, PROMPT = 1000, SEQ = 0 };
enum { KV_WIDTH = KV_HEADS * HEAD_DIM, Q_WIDTH = Q_HEADS * HEAD_DIM };

static void die(const char *what, qjlkv_status s) {
  fprintf(stderr, "%s: %s (%s)\n", what, qjlkv_status_string(s), qjlkv_last_error_message());
  exit(1);
}
#define CHECK(call)                        \
  do {                                     \
    qjlkv_status s_ = (call);              \
    if (s_ != QJLKV_OK) die(#call, s_);    \
  } while (0)

/* A deterministic pseudo-random weight in [-1, 1) for (matrix, row, column): the "model". */
static float weight(uint32_t matrix, uint32_t row, uint32_t col) {
  uint64_t x = ((uint64_t)matrix << 40) ^ ((uint64_t)row << 20) ^ col;
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return (float)(x >> 40) / (float)(1u << 23) - 1.0f;
}

/* The projections of every layer (K, V, Q), from every 8th input channel: computed once. */
enum { MATRICES = 3 * LAYERS, INPUTS = Q_WIDTH / 8 };
static float weights[MATRICES][Q_WIDTH][INPUTS];

static void init_weights(void) {
  for (uint32_t m = 0; m < MATRICES; ++m)
    for (uint32_t i = 0; i < Q_WIDTH; ++i)
      for (uint32_t j = 0; j < INPUTS; ++j) weights[m][i][j] = weight(m, i, j) * 0.3f;
}

static void project(uint32_t matrix, const float *input, uint32_t width, float *out) {
  for (uint32_t i = 0; i < width; ++i) {
    float sum = 0.0f;
    for (uint32_t j = 0; j < INPUTS; ++j) sum += input[8 * j] * weights[matrix][i][j];
    out[i] = sum;
  }
}

static void embed(uint32_t token, float *x) {
  for (uint32_t j = 0; j < Q_WIDTH; ++j) x[j] = weight(999, token, j);
}

/* Runs token `token` through every layer (appending its K/V) and returns the next token: each
 * layer's input is the token's embedding plus the previous layer's attention output. */
static uint32_t step(qjlkv_cache *c, uint32_t token) {
  float x[Q_WIDTH], q[Q_WIDTH], k[KV_WIDTH], v[KV_WIDTH], out[Q_WIDTH];
  embed(token, x);
  for (uint32_t l = 0; l < LAYERS; ++l) {
    project(3 * l, x, KV_WIDTH, k);
    project(3 * l + 1, x, KV_WIDTH, v);
    project(3 * l + 2, x, Q_WIDTH, q);
    CHECK(qjlkv_cache_append(c, l, SEQ, 1, k, v));
    CHECK(qjlkv_cache_attend(c, l, SEQ, 1, q, 0.0f, out));
    for (uint32_t j = 0; j < Q_WIDTH; ++j) x[j] = 0.2f * x[j] + 4.0f * out[j];
  }
  uint32_t best = 0;
  float best_logit = -INFINITY;
  for (uint32_t t = 0; t < VOCAB; ++t) {
    float logit = 0.0f;
    for (uint32_t j = 0; j < Q_WIDTH; ++j) logit += out[j] * weight(998, t, j);
    if (logit > best_logit) best_logit = logit, best = t;
  }
  return best;
}

static qjlkv_cache *make_cache(const char *preset) {
  qjlkv_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.struct_size = sizeof cfg;
  CHECK(qjlkv_config_init(&cfg, preset, LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM));
  cfg.seed = 42;
  qjlkv_cache *c = NULL;
  CHECK(qjlkv_cache_create(&cfg, &c));
  return c;
}

/* The prompt: PROMPT tokens of a fixed pseudo-random text; returns the first generated token. */
static uint32_t prefill(qjlkv_cache *c) {
  uint32_t next = 0;
  for (uint32_t i = 0; i < PROMPT; ++i) next = step(c, (uint32_t)(weight(7, i, 0) * 48.0f + 48.0f) % VOCAB);
  return next;
}

static void decode(qjlkv_cache *c, uint32_t next, int n) {
  for (int i = 0; i < n; ++i) {
    printf("%u%c", next, i + 1 == n ? '\n' : ' ');
    next = step(c, next);
  }
}

static size_t write_file(void *user, const void *data, size_t size) { return fwrite(data, 1, size, (FILE *)user); }
static size_t read_file(void *user, void *data, size_t size) { return fread(data, 1, size, (FILE *)user); }

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "";
  init_weights();
  if (strcmp(mode, "prefill") == 0 && argc >= 3) {
    qjlkv_cache *c = make_cache(argc > 3 ? argv[3] : "q3");
    const uint32_t next = prefill(c);
    FILE *f = fopen(argv[2], "wb");
    if (!f) return perror(argv[2]), 1;
    /* The first generated token travels with the cache, as a prefill node would send it. */
    if (fwrite(&next, sizeof next, 1, f) != 1) return perror(argv[2]), 1;
    CHECK(qjlkv_cache_export_stream(c, SEQ, 0, LAYERS, write_file, f));
    if (fclose(f) != 0) return perror(argv[2]), 1;
    uint64_t stream = 0;
    CHECK(qjlkv_cache_export_size(c, SEQ, 0, LAYERS, &stream));
    qjlkv_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK(qjlkv_cache_stats(c, &st));
    printf("%u tokens x %u layers: stream %llu bytes, fp16 cache %llu bytes (%.2fx smaller)\n", PROMPT, LAYERS,
           (unsigned long long)stream, (unsigned long long)st.bytes_fp16_equivalent,
           (double)st.bytes_fp16_equivalent / (double)stream);
    qjlkv_cache_destroy(c);
    return 0;
  }
  if (strcmp(mode, "decode") == 0 && argc >= 4) {
    qjlkv_cache *c = make_cache(argc > 4 ? argv[4] : "q3");
    FILE *f = fopen(argv[2], "rb");
    if (!f) return perror(argv[2]), 1;
    uint32_t next = 0;
    if (fread(&next, sizeof next, 1, f) != 1) return fprintf(stderr, "%s: too short\n", argv[2]), 1;
    CHECK(qjlkv_cache_import_stream(c, SEQ, read_file, f));
    fclose(f);
    decode(c, next, atoi(argv[3]));
    qjlkv_cache_destroy(c);
    return 0;
  }
  if (strcmp(mode, "both") == 0 && argc >= 3) {
    qjlkv_cache *c = make_cache(argc > 3 ? argv[3] : "q3");
    decode(c, prefill(c), atoi(argv[2]));
    qjlkv_cache_destroy(c);
    return 0;
  }
  fprintf(stderr,
          "usage: %s prefill FILE [PRESET] | decode FILE N [PRESET] | both N [PRESET]\n"
          "  (PRESET: q2, q3, q4, qjl, kivi, ott or exact; default q3)\n",
          argv[0]);
  return 2;
}
