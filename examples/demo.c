/* Demo: a Llama-3-8B-shaped attention layer (32 query heads, 8 kv heads, head_dim 128) with
 * synthetic keys that carry outlier channels, as real keys of deeper layers do. Appends the
 * tokens to a cache of each preset, then compares decode attention against the exact cache.
 * Inputs are fp32, so the tokens every preset keeps exact (the newest ones, and the first ones
 * of q2, q3 and q4) take 32 bits each: a short run shows more bits per number than a long one.
 *
 *   usage: qjlkv_demo [tokens] [decode_steps] [f16]   (defaults: 8192 tokens, 16 steps, fp32)
 * With f16 the keys, values and queries go in as fp16 (_Float16), as an engine holds them, and
 * the exact tokens take 16 bits.
 *   build: cc demo.c $(pkg-config --cflags --libs qjlkv) -lm */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qjlkv/qjlkv.h"

enum { LAYERS = 1, HQ = 32, HKV = 8, D = 128 };

static int check(qjlkv_status s, const char *what) {
  if (s != QJLKV_OK) {
    fprintf(stderr, "%s failed: %s: %s\n", what, qjlkv_status_string(s), qjlkv_last_error_message());
    exit(1);
  }
  return 0;
}

/* xorshift64* uniform in [0,1) and a Box-Muller normal: deterministic synthetic data. */
static unsigned long long rng_state = 0x9E3779B97F4A7C15ull;
static double uniform(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (double)((rng_state * 2685821657736338717ull) >> 11) * 0x1p-53;
}
static float normal(void) {
  const double u1 = 1.0 - uniform(), u2 = uniform();
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* Keys: N(0,1) per channel, except 4 outlier channels per kv head with a large offset, the
 * pattern QJL's outlier sketch handles. Values: N(0,1). */
static void make_token(float *keys, float *values) {
  for (int h = 0; h < HKV; ++h)
    for (int j = 0; j < D; ++j) {
      const int outlier = (j * 37 + h * 11) % D < 4;
      keys[h * D + j] = outlier ? 12.0f + 3.0f * normal() : normal();
      values[h * D + j] = normal();
    }
}

/* IEEE half (GCC 12+, Clang): a C extension, hence __extension__ for -Wpedantic. */
__extension__ typedef _Float16 half;

/* The calls in the cache's dtype: the fp32 arrays as they are, or converted to fp16. */
static qjlkv_status append_token(qjlkv_cache *c, const float *keys, const float *values, int f16) {
  if (!f16) return qjlkv_cache_append(c, 0, 0, 1, keys, values);
  half k[HKV * D], v[HKV * D];
  for (int i = 0; i < HKV * D; ++i) k[i] = (half)keys[i], v[i] = (half)values[i];
  return qjlkv_cache_append(c, 0, 0, 1, k, v);
}

static qjlkv_status attend_query(qjlkv_cache *c, const float *query, float *out, int f16) {
  if (!f16) return qjlkv_cache_attend(c, 0, 0, 1, query, 0.0f, out);
  half q[HQ * D], o[HQ * D];
  for (int i = 0; i < HQ * D; ++i) q[i] = (half)query[i];
  const qjlkv_status s = qjlkv_cache_attend(c, 0, 0, 1, q, 0.0f, o);
  for (int i = 0; i < HQ * D; ++i) out[i] = (float)o[i];
  return s;
}

int main(int argc, char **argv) {
  const unsigned tokens = argc > 1 ? (unsigned)atoi(argv[1]) : 8192;
  const unsigned steps = argc > 2 ? (unsigned)atoi(argv[2]) : 16;
  const int f16 = argc > 3 && strcmp(argv[3], "f16") == 0;
  if (tokens == 0 || steps == 0 || steps > tokens || (argc > 3 && !f16)) {
    fprintf(stderr, "usage: %s [tokens > 0] [decode_steps in 1..tokens] [f16]\n", argv[0]);
    return 2;
  }
  const char *presets[] = {"exact", "q2", "q3", "q4", "qjl", "kivi", "ott"};
  enum { NPRESETS = 7 };
  qjlkv_cache *caches[NPRESETS];
  for (int p = 0; p < NPRESETS; ++p) {
    qjlkv_config cfg;
    cfg.struct_size = sizeof cfg; /* the size of this header's struct: set before every call */
    check(qjlkv_config_init(&cfg, presets[p], LAYERS, HQ, HKV, D), "qjlkv_config_init");
    cfg.seed = 42;
    cfg.dtype = f16 ? QJLKV_DTYPE_F16 : QJLKV_DTYPE_F32;
    cfg.outlier_skip_layers = 0; /* ott: trace this one layer (the preset skips a model's first two) */
    if (qjlkv_cache_create(&cfg, &caches[p]) != QJLKV_OK) {
      fprintf(stderr, "preset %s unavailable: %s\n", presets[p], qjlkv_last_error_message());
      caches[p] = NULL;
    }
  }
  float *all_keys = malloc(sizeof(float) * HKV * D * (size_t)tokens), *values = malloc(sizeof(float) * HKV * D);
  float *query = malloc(sizeof(float) * HQ * D), *exact = malloc(sizeof(float) * HQ * D);
  float *approx = malloc(sizeof(float) * HQ * D);
  double err2[NPRESETS] = {0}, ref2 = 0;
  printf("libqjlkv %s demo: Llama-3-8B-shaped layer (Hq=%d, Hkv=%d, d=%d), %s, %u tokens, %u decode steps\n",
         qjlkv_version_string(), HQ, HKV, D, f16 ? "fp16" : "fp32", tokens, steps);
  for (unsigned t = 0; t < tokens; ++t) {
    float *keys = all_keys + (size_t)t * HKV * D;
    make_token(keys, values);
    for (int p = 0; p < NPRESETS; ++p)
      if (caches[p]) check(append_token(caches[p], keys, values, f16), "qjlkv_cache_append");
    if (t + steps < tokens) continue;
    /* Decode step: each query head looks for one earlier token (a retrieval-like, peaked
     * attention, as many real heads have), plus noise. */
    for (int h = 0; h < HQ; ++h) {
      const float *target = all_keys + ((size_t)(uniform() * t) * HKV + h / (HQ / HKV)) * D;
      for (int j = 0; j < D; ++j) query[h * D + j] = target[j] + 0.5f * normal();
    }
    check(attend_query(caches[0], query, exact, f16), "attend exact");
    for (int i = 0; i < HQ * D; ++i) ref2 += (double)exact[i] * exact[i];
    for (int p = 1; p < NPRESETS; ++p) {
      if (!caches[p]) continue;
      check(attend_query(caches[p], query, approx, f16), "attend");
      for (int i = 0; i < HQ * D; ++i) err2[p] += ((double)approx[i] - exact[i]) * ((double)approx[i] - exact[i]);
    }
  }
  printf("%-6s %14s %14s %12s %22s\n", "preset", "bytes used", "bits/number", "vs fp16", "attn rel. L2 error");
  for (int p = 0; p < NPRESETS; ++p) {
    if (!caches[p]) continue;
    qjlkv_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    check(qjlkv_cache_stats(caches[p], &st), "qjlkv_cache_stats");
    printf("%-6s %14llu %14.3f %11.2fx %22.4f\n", presets[p], (unsigned long long)st.bytes_used,
           st.bits_per_number, (double)st.bytes_fp16_equivalent / (double)st.bytes_used,
           p == 0 ? 0.0 : sqrt(err2[p] / ref2));
    qjlkv_cache_destroy(caches[p]);
  }
  printf("\nbits/number: every stored byte over the keys and values held (fp16 = 16); the exact\n"
         "tokens are a fixed cost, so fewer tokens mean more bits per number.\n"
         "attn rel. L2 error: ||o - o_exact|| / ||o_exact|| of the attention outputs of the last %u\n"
         "steps against the exact preset (0.10 = off by 10 %% of their size), on synthetic keys and\n"
         "queries; how much each preset changes a real model's predictions: docs/ACCURACY.md.\n",
         steps);
  free(all_keys);
  free(values);
  free(query);
  free(exact);
  free(approx);
  return 0;
}
