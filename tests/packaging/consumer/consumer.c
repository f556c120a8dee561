/* What an engine written in C does with an installed libqjlkv: build a QJL cache and an
 * exact one (presets "qjl" and "exact"; 2 layers, 8 query heads, 2 kv heads, d = 64),
 * append 100 tokens, attend with one query token, and check both outputs against attention
 * computed here in double precision. Each query head asks for one cached token (its query
 * is twice that token's key), so exact attention returns almost exactly that token's value;
 * the QJL cache must return the same token's value up to its 2-bit value quantization.
 * Exit status 0 only if every check passes. */
#include <qjlkv/qjlkv.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef CONSUMER_NAME
#define CONSUMER_NAME "C consumer"
#endif

enum { LAYERS = 2, Q_HEADS = 8, KV_HEADS = 2, HEAD_DIM = 64, TOKENS = 100 };
enum { KV_FLOATS = TOKENS * KV_HEADS * HEAD_DIM, Q_FLOATS = Q_HEADS * HEAD_DIM };

/* Relative L2 error bounds. exact: fp16 rounding of the quantized blocks' keys and values.
 * qjl: 2-bit values in groups of 32 round with an rms error of about 0.4 of a Gaussian's
 * spread; a retrieval of the wrong token would be off by about 1.4. */
#define EXACT_TOLERANCE 1e-2
#define QJL_TOLERANCE 0.6

static int failures = 0;

#define EXPECT(cond, ...)                                        \
  do {                                                           \
    if (!(cond)) {                                               \
      fprintf(stderr, "%s:%d: check failed: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                              \
      fputc('\n', stderr);                                       \
      ++failures;                                                \
    }                                                            \
  } while (0)

#define REQUIRE_OK(call)                                                          \
  do {                                                                            \
    qjlkv_status status_ = (call);                                                \
    if (status_ != QJLKV_OK) {                                                    \
      fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #call,  \
              qjlkv_status_string(status_), qjlkv_last_error_message());          \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

/* Deterministic, roughly Gaussian numbers (sum of four uniforms), the same everywhere. */
static uint64_t rng_state = UINT64_C(0x853c49e6748fea9b);
static float next_normal(void) {
  double sum = 0.0;
  int i;
  for (i = 0; i < 4; ++i) {
    rng_state = rng_state * UINT64_C(6364136223846793005) + UINT64_C(1442695040888963407);
    sum += (double)(rng_state >> 11) / 9007199254740992.0;
  }
  return (float)((sum - 2.0) * 1.7320508075688772);
}

static float keys[LAYERS][KV_FLOATS], values[LAYERS][KV_FLOATS];
static float queries[LAYERS][Q_FLOATS], reference[LAYERS][Q_FLOATS];

/* The token query head h of a layer asks for: spread over quantized blocks and the tail. */
static int wanted_token(int layer, int head) { return (head * 13 + layer * 7) % TOKENS; }

/* The cached token whose value is nearest to the output of query head h. */
static int nearest_token(int layer, int head, const float *out) {
  const int kv = head / (Q_HEADS / KV_HEADS);
  int t, i, best = -1;
  double best_distance = INFINITY;
  for (t = 0; t < TOKENS; ++t) {
    double distance = 0.0;
    for (i = 0; i < HEAD_DIM; ++i) {
      const double diff = (double)out[head * HEAD_DIM + i] - values[layer][(t * KV_HEADS + kv) * HEAD_DIM + i];
      distance += diff * diff;
    }
    if (distance < best_distance) {
      best_distance = distance;
      best = t;
    }
  }
  return best;
}

/* softmax(q.k / sqrt(d)) v over all cached tokens, query head h using kv head
 * h / (Q_HEADS / KV_HEADS). */
static void exact_attention(int layer) {
  int h, t, i;
  for (h = 0; h < Q_HEADS; ++h) {
    const int kv = h / (Q_HEADS / KV_HEADS);
    double logits[TOKENS], max_logit = -INFINITY, total = 0.0;
    for (t = 0; t < TOKENS; ++t) {
      double dot = 0.0;
      for (i = 0; i < HEAD_DIM; ++i)
        dot += (double)queries[layer][h * HEAD_DIM + i] *
               keys[layer][(t * KV_HEADS + kv) * HEAD_DIM + i];
      logits[t] = dot / sqrt((double)HEAD_DIM);
      if (logits[t] > max_logit) max_logit = logits[t];
    }
    for (t = 0; t < TOKENS; ++t) {
      logits[t] = exp(logits[t] - max_logit);
      total += logits[t];
    }
    for (i = 0; i < HEAD_DIM; ++i) {
      double out = 0.0;
      for (t = 0; t < TOKENS; ++t) out += logits[t] * values[layer][(t * KV_HEADS + kv) * HEAD_DIM + i];
      reference[layer][h * HEAD_DIM + i] = (float)(out / total);
    }
  }
}

static double relative_error(const float *got, const float *want, int n) {
  double diff = 0.0, norm = 0.0;
  int i;
  for (i = 0; i < n; ++i) {
    diff += ((double)got[i] - want[i]) * ((double)got[i] - want[i]);
    norm += (double)want[i] * want[i];
  }
  return sqrt(diff / norm);
}

/* Runs the preset on every layer; returns the worst relative error against the reference. */
static double run_preset(const char *preset, float out[LAYERS][Q_FLOATS]) {
  qjlkv_config cfg;
  qjlkv_cache *cache = NULL;
  qjlkv_stats stats;
  double worst = 0.0;
  int layer, head, i;

  cfg.struct_size = sizeof cfg;
  REQUIRE_OK(qjlkv_config_init(&cfg, preset, LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM));
  EXPECT(cfg.struct_size == sizeof cfg, "%s: struct_size %u", preset, (unsigned)cfg.struct_size);
  REQUIRE_OK(qjlkv_cache_create(&cfg, &cache));
  for (layer = 0; layer < LAYERS; ++layer) {
    uint64_t length = 0;
    /* a prefill and then the rest, as an engine would */
    const uint32_t prefill = 60;
    REQUIRE_OK(qjlkv_cache_append(cache, (uint32_t)layer, 7, prefill, keys[layer], values[layer]));
    REQUIRE_OK(qjlkv_cache_append(cache, (uint32_t)layer, 7, TOKENS - prefill,
                                  keys[layer] + prefill * KV_HEADS * HEAD_DIM,
                                  values[layer] + prefill * KV_HEADS * HEAD_DIM));
    REQUIRE_OK(qjlkv_cache_length(cache, (uint32_t)layer, 7, &length));
    EXPECT(length == TOKENS, "%s: length %lu, expected %d", preset, (unsigned long)length, TOKENS);
    REQUIRE_OK(qjlkv_cache_attend(cache, (uint32_t)layer, 7, 1, queries[layer], 0.0f, out[layer]));
    for (i = 0; i < Q_FLOATS; ++i)
      if (!isfinite(out[layer][i])) {
        EXPECT(0, "%s: layer %d output %d is not finite", preset, layer, i);
        break;
      }
    for (head = 0; head < Q_HEADS; ++head)
      EXPECT(nearest_token(layer, head, out[layer]) == wanted_token(layer, head),
             "%s: layer %d head %d returned the value of token %d, not of token %d", preset, layer,
             head, nearest_token(layer, head, out[layer]), wanted_token(layer, head));
    {
      const double err = relative_error(out[layer], reference[layer], Q_FLOATS);
      if (err > worst) worst = err;
    }
  }
  memset(&stats, 0, sizeof stats);
  stats.struct_size = sizeof stats;
  REQUIRE_OK(qjlkv_cache_stats(cache, &stats));
  EXPECT(stats.tokens == LAYERS * TOKENS, "%s: stats.tokens %lu", preset, (unsigned long)stats.tokens);
  printf("  %-5s: %.2f bits per number, relative error %.4f\n", preset, stats.bits_per_number, worst);
  qjlkv_cache_destroy(cache);
  return worst;
}

int main(void) {
  static float out_qjl[LAYERS][Q_FLOATS], out_exact[LAYERS][Q_FLOATS];
  char expected_version[32];
  qjlkv_cache *cache = NULL;
  int layer, head, i;

  EXPECT(qjlkv_version_number() == QJLKV_VERSION_NUMBER, "library version %u, header %d",
         qjlkv_version_number(), QJLKV_VERSION_NUMBER);
  sprintf(expected_version, "%d.%d.%d", QJLKV_VERSION_MAJOR, QJLKV_VERSION_MINOR, QJLKV_VERSION_PATCH);
  EXPECT(strcmp(qjlkv_version_string(), expected_version) == 0, "version string %s, expected %s",
         qjlkv_version_string(), expected_version);

  /* an error crosses the ABI as a status plus a message naming the argument */
  EXPECT(qjlkv_cache_create(NULL, &cache) == QJLKV_ERROR_INVALID_ARGUMENT, "create(NULL) status");
  EXPECT(cache == NULL, "create(NULL) left a cache");
  EXPECT(strstr(qjlkv_last_error_message(), "cfg") != NULL, "create(NULL) message \"%s\"",
         qjlkv_last_error_message());

  for (layer = 0; layer < LAYERS; ++layer) {
    for (i = 0; i < KV_FLOATS; ++i) {
      keys[layer][i] = next_normal();
      values[layer][i] = next_normal();
    }
    for (head = 0; head < Q_HEADS; ++head) {
      const int kv = head / (Q_HEADS / KV_HEADS);
      const float *key = &keys[layer][(wanted_token(layer, head) * KV_HEADS + kv) * HEAD_DIM];
      for (i = 0; i < HEAD_DIM; ++i) queries[layer][head * HEAD_DIM + i] = 2.0f * key[i];
    }
    exact_attention(layer);
  }

  printf("qjlkv %s (%s)\n", qjlkv_version_string(), CONSUMER_NAME);
  {
    const double exact_error = run_preset("exact", out_exact);
    const double qjl_error = run_preset("qjl", out_qjl);
    EXPECT(exact_error < EXACT_TOLERANCE, "exact preset error %g >= %g", exact_error, EXACT_TOLERANCE);
    EXPECT(qjl_error < QJL_TOLERANCE, "qjl preset error %g >= %g", qjl_error, QJL_TOLERANCE);
    for (layer = 0; layer < LAYERS; ++layer) {
      const double apart = relative_error(out_qjl[layer], out_exact[layer], Q_FLOATS);
      EXPECT(apart < QJL_TOLERANCE + EXACT_TOLERANCE, "layer %d: qjl vs exact %g", layer, apart);
    }
  }
  if (failures) fprintf(stderr, "%s: %d checks failed\n", CONSUMER_NAME, failures);
  return failures ? 1 : 0;
}
