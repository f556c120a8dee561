/*
 * qjlkv.h — compressed LLM key/value cache with attention computed on the
 * compressed form.
 *
 * This header is the manual. Read "Conventions" once; each function then
 * documents its contract, its errors and its thread rules.
 *
 * ---------------------------------------------------------------------------
 * What the library does
 * ---------------------------------------------------------------------------
 * A cache holds, per layer and per sequence, the key and value vectors of every
 * kv head, appended token by token (or many tokens at once for a prefill). The
 * first sink_tokens tokens of a sequence (attention sinks) and the newest
 * tokens stay exact, the latter in a "tail"; whenever the tail holds at least
 * residual_tokens + block_tokens tokens, its oldest block_tokens tokens are
 * quantized as one block:
 *   - keys with QJL (1-bit signs of a random orthogonalized sketch plus the
 *     key norms, with a second sketch for the few outlier channels of each
 *     block, stored as one fp16 correction per outlier channel), or KIVI
 *     (per-channel 2/3/4/8-bit), or OTT (KIVI plus tracing of outlier
 *     tokens), or mixed-bit (per-channel codes of 0 to 4 bits, the bits of a
 *     token going to the channels whose block ranges are widest), or kept
 *     exact in 16 bits;
 *   - values per token in groups of value_group_size channels with 2, 3, 4 or
 *     8 bits (or kept exact in 16 bits), or per token after a randomized
 *     Hadamard rotation with 2, 3 or 4-bit Lloyd-Max codes.
 * qjlkv_cache_attend() then computes decode attention softmax(scale·q·Kᵀ)·V
 * for the query heads of a layer directly on the compressed bytes.
 *
 * ---------------------------------------------------------------------------
 * Conventions
 * ---------------------------------------------------------------------------
 * Status. Every fallible function returns a qjlkv_status; QJLKV_OK is 0. On
 *   failure nothing is half-done: the cache is left exactly as it was (same
 *   length, same stored bytes, same statistics), output buffers may have been
 *   written, and qjlkv_last_error_message() returns a human-readable reason
 *   that names the argument and the values that were wrong.
 * Handles. qjlkv_sketch and qjlkv_cache are opaque. qjlkv_*_destroy(NULL) is a
 *   no-op.
 * Tensors. Keys, values, queries and outputs are dense, row-major, contiguous
 *   arrays in the cache's dtype (config.dtype); their shapes are given at each
 *   function. On a CUDA cache (config.backend == QJLKV_BACKEND_CUDA) they are
 *   device pointers.
 * Validation. Every argument is checked before anything changes: NULL
 *   pointers, dimensions, ranges, sizes that overflow, and the data itself
 *   (keys, values and queries must be finite; for quantized storage they must
 *   also lie within the fp16 range |x| <= 65504, because scales, minima and
 *   norms are stored in fp16; bf16 values stored at 16 bits must lie within
 *   |x| <= 2^95, so that attention's float sum over up to 2^32 tokens stays
 *   finite).
 * Threads. One cache handle is used by one thread at a time (the caller
 *   serializes); distinct handles are fully independent. A sketch is immutable
 *   and may be shared by any number of threads. qjlkv_last_error_message() is
 *   thread-local. A cache may use several worker threads internally
 *   (config.num_threads, or threads shared with other caches:
 *   qjlkv_workers_create); results do not depend on their number.
 * Memory. All memory is owned by the handles; a failed allocation returns
 *   QJLKV_ERROR_OUT_OF_MEMORY and leaves the cache unchanged.
 * Enums. Every enumerator has a fixed number that never changes meaning; new
 *   ones are appended. Struct fields that hold an enum value are uint32_t (a
 *   C enum's size is the compiler's choice), and the library reads any enum
 *   value it receives, field or argument, as an integer: values outside the
 *   enum are refused (or, for qjlkv_status_string, named "unknown status").
 * Growing structs. qjlkv_config and qjlkv_stats begin with uint32_t
 *   struct_size so that later releases can append fields without breaking
 *   programs built against earlier headers. One rule for both, and for every
 *   function that reads or fills them: before the call, the caller sets
 *   struct_size to sizeof the struct of the header it was compiled with
 *   (qjlkv_config_init included: it does not guess from uninitialized memory).
 *   The library accepts exactly the sizes that releases shipped, the
 *   QJLKV_*_SIZE_<release> macros and this header's sizeof, reads or writes
 *   exactly struct_size bytes, and treats fields beyond them as their
 *   documented defaults. Any other size is refused with INVALID_ARGUMENT and
 *   nothing is read or written. packaging/VERSIONING.md has the policy.
 * Environment. QJLKV_CPU_ISA=scalar|avx2|avx512|avx512vnni forces the
 *   instruction set of the CPU kernels (unset or empty: the best the CPU runs;
 *   avx2 and avx512 compute KIVI/OTT and QJL key scores in integers,
 *   avx512vnni also rotated Lloyd-Max and uniform value sums, within the error
 *   budget of docs/DESIGN.md; layouts the integer kernels do not cover keep fp32,
 *   as does scalar). qjlkv_cache_create
 *   of a CPU cache fails with INVALID_ARGUMENT for any other value and with
 *   UNSUPPORTED when this CPU cannot run the forced set.
 *
 * ---------------------------------------------------------------------------
 * Stored numbers (docs/DESIGN.md has the details)
 * ---------------------------------------------------------------------------
 * - Tail tokens (and OTT pool/spill tokens) are kept in the input dtype: exact.
 * - QJL: sign bit 1 iff the fp32 projection is > 0, packed LSB-first (bit j of
 *   byte b is sketch row 8b + j); norms ‖k_in‖, ‖k_out‖ as fp16. The estimate
 *   uses c_d = sqrt(pi)·Gamma((d+1)/2) / (sqrt(d)·Gamma(d/2)) for orthogonal
 *   sketches and sqrt(pi/2) for Gaussian ones, so it is unbiased for the sketch
 *   actually used. Outlier channels: per block, the c channels of largest
 *   energy over the block's keys (ties: lower channel).
 * - Value groups and KIVI channels: min stored as the largest fp16 <= min,
 *   scale as the smallest fp16 >= (max - min)/(2^b - 1); codes round half to
 *   even; a group whose values are all equal gets scale 0 and reproduces min.
 *   b-bit codes of a token (or a key block's token row) form one LSB-first bit
 *   stream: code j is bits j·b .. j·b+b-1 (3-bit: 8 codes in 3 bytes).
 * - Mixed-bit keys ("q2"): per block and channel j the fp16 range [lo_j, hi_j]
 *   (min rounded down, max rounded up, r_j = hi_j - lo_j) and a width w_j of
 *   0 to 4 bits; the widths sum to key_token_bits: they are the key_token_bits
 *   largest of r_j·2^-b over channels j and b = 0..3 (ties: lower channel,
 *   then lower b), so each bit goes where it removes the most squared error.
 *   Codes are floor((k - lo)/c_j) clamped to [0, 2^w_j - 1], c_j = r_j·2^-w_j,
 *   and decode to lo_j + (code + 1/2)·c_j (0 bits: the middle of the range). A
 *   token's codes form one LSB-first bit stream, channel j at bit
 *   w_0 + ... + w_{j-1}; the widths are stored in 3 bits each.
 * - 16-bit exact storage (preset "exact", value_bits 16) is fp16 for fp32 and
 *   fp16 inputs, bf16 for bf16 inputs.
 * - Rotated Lloyd-Max values: y = H·diag(s)·v (H: normalized Walsh-Hadamard
 *   blocks over the power-of-two blocks of the head, s: ±1 per channel from
 *   the seed and layer), codes of the nearest Lloyd-Max level of y·sqrt(d)/‖y‖,
 *   and one fp16 scale per token chosen so that the decoded vector has the
 *   input's norm. Each value vector's L2 norm must be at most
 *   65504·sqrt(d)·(the smallest |level|: 0.4528, 0.2451, 0.1284 for 2, 3, 4
 *   bits), else append fails with INVALID_ARGUMENT naming values.
 * - Attention sinks: the first sink_tokens positions of every sequence are
 *   kept like the tail (input dtype, exact) and never quantized; blocks and the
 *   tail rule apply to the positions after them.
 */
#ifndef QJLKV_H
#define QJLKV_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#  if defined(QJLKV_BUILDING)
#    define QJLKV_API __declspec(dllexport)
#  elif defined(QJLKV_STATIC)
#    define QJLKV_API
#  else
#    define QJLKV_API __declspec(dllimport)
#  endif
#elif defined(__GNUC__) && __GNUC__ >= 4
#  define QJLKV_API __attribute__((visibility("default")))
#else
#  define QJLKV_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ===========================================================================
 * Version
 * ======================================================================== */
#define QJLKV_VERSION_MAJOR 0
#define QJLKV_VERSION_MINOR 5
#define QJLKV_VERSION_PATCH 0
/* MAJOR*10000 + MINOR*100 + PATCH, as zstd does. */
#define QJLKV_VERSION_NUMBER \
  (QJLKV_VERSION_MAJOR * 10000 + QJLKV_VERSION_MINOR * 100 + QJLKV_VERSION_PATCH)

/* The version of the library linked at run time. A program (or binding) built
 * against this header needs qjlkv_version_number() >= QJLKV_VERSION_NUMBER:
 * an older library lacks functions, fields or enumerators the header has.
 * Never fails. */
QJLKV_API unsigned qjlkv_version_number(void);
/* "MAJOR.MINOR.PATCH" of the library linked at run time; a static string. */
QJLKV_API const char *qjlkv_version_string(void);

/* ===========================================================================
 * Errors
 * ======================================================================== */
/* Append-only: values never change meaning. */
typedef enum qjlkv_status {
  QJLKV_OK = 0,
  QJLKV_ERROR_INVALID_ARGUMENT = 1, /* a bad pointer, size, range, config or
                                       data                                   */
  QJLKV_ERROR_OUT_OF_MEMORY = 2,    /* an allocation failed; nothing changed  */
  QJLKV_ERROR_UNSUPPORTED = 3,      /* valid, but not available in this build
                                       or on this machine (e.g. no CUDA device) */
  QJLKV_ERROR_DEVICE = 4,           /* the CUDA runtime reported an error    */
  QJLKV_ERROR_CORRUPT_DATA = 5,     /* a serialized stream (or internal
                                       state) failed a consistency check      */
  QJLKV_ERROR_INTERNAL = 6,         /* a bug in the library: please report it */
  QJLKV_ERROR_MEMORY_BUDGET = 7     /* the call would take the cache's bytes_used
                                       above config.memory_budget; nothing
                                       changed (free or preempt, then retry)  */
} qjlkv_status;

/* A static, constant name for a status ("QJLKV_OK", ...); "unknown status"
 * for any other value (a C caller may pass any int). Never returns NULL. */
QJLKV_API const char *qjlkv_status_string(qjlkv_status s);

/* The reason for the last failure of a qjlkv_* call made by this thread, or ""
 * if none failed yet. The string stays valid until the next failing call on
 * the same thread. Successful calls do not clear it. Never returns NULL. */
QJLKV_API const char *qjlkv_last_error_message(void);

/* ===========================================================================
 * Types
 * ======================================================================== */
/* Element type of keys, values, queries and outputs. Computation is fp32. */
typedef enum qjlkv_dtype {
  QJLKV_DTYPE_F32 = 0,
  QJLKV_DTYPE_F16 = 1,  /* IEEE binary16 */
  QJLKV_DTYPE_BF16 = 2  /* bfloat16      */
} qjlkv_dtype;

/* How keys are stored once their block is quantized. */
typedef enum qjlkv_key_method {
  QJLKV_KEYS_QJL = 0,   /* sign bits of a JL sketch + norms (see the top)    */
  QJLKV_KEYS_KIVI = 1,  /* per-channel asymmetric key_bits quantization      */
  QJLKV_KEYS_OTT = 2,   /* KIVI + outlier-token tracing                      */
  QJLKV_KEYS_EXACT = 3, /* 16-bit keys, no quantization                      */
  QJLKV_KEYS_MIXED = 4  /* per-channel codes of 0-4 bits chosen per block
                           from the channels' ranges, key_token_bits a
                           token (see "Stored numbers"); added in 0.5  */
} qjlkv_key_method;

/* Where a cache keeps its data and runs its kernels (config.backend); the
 * device within the backend is config.device_ordinal. */
typedef enum qjlkv_backend {
  QJLKV_BACKEND_CPU = 0,  /* host memory, the CPU kernels; device_ordinal 0 */
  QJLKV_BACKEND_CUDA = 1  /* an NVIDIA GPU: device_ordinal is the CUDA device
                             ordinal (as cudaSetDevice takes it)            */
} qjlkv_backend;

/* ===========================================================================
 * Limits (inclusive upper bounds of the config fields and arguments they name)
 * ======================================================================== */
#define QJLKV_MAX_LAYERS 65536u          /* config.num_layers                 */
#define QJLKV_MAX_HEADS 4096u            /* num_q_heads, num_kv_heads         */
#define QJLKV_MAX_HEAD_DIM 256u          /* config.head_dim                   */
#define QJLKV_MAX_SKETCH_HEAD_DIM 1024u  /* qjlkv_sketch_create's head_dim    */
#define QJLKV_MAX_SKETCH_DIM 65536u      /* every sketch row count            */
#define QJLKV_MAX_BLOCK_TOKENS 4096u     /* config.block_tokens               */
#define QJLKV_MAX_RESIDUAL_TOKENS 65536u /* config.residual_tokens            */
#define QJLKV_MAX_SPILL_TOKENS 4096u     /* config.outlier_spill_tokens       */
#define QJLKV_MAX_THREADS 1024u          /* config.num_threads                */
#define QJLKV_MAX_ROLLBACK_TOKENS 65536u /* config.rollback_tokens            */

/* How values are stored once their block is quantized (config.value_method,
 * a uint32_t holding one of these). Append-only: values never change meaning. */
typedef enum qjlkv_value_method {
  QJLKV_VALUES_UNIFORM = 0,          /* per token, groups of value_group_size
                                        channels: min/max codes of value_bits
                                        bits, or 16-bit values (value_bits 16) */
  QJLKV_VALUES_ROTATED_LLOYD_MAX = 1 /* per token: a randomized Hadamard
                                        rotation of the head, then value_bits
                                        (2, 3 or 4) Lloyd-Max codes for N(0,1)
                                        and one fp16 scale (value_group_size is
                                        ignored)                              */
} qjlkv_value_method;

/* ===========================================================================
 * Sketch
 * ======================================================================== */
/* The QJL sketch: an m x d float32 matrix (m = sketch_dim, d = head_dim).
 *
 * Entries start as i.i.d. N(0,1) drawn from a Philox4x32-10 counter-based
 * generator keyed by (seed, stream 0), in float64 on the host. With
 * QJLKV_SKETCH_ORTHOGONAL, the m rows are cut into ceil(m/d) blocks of at
 * most d rows; each block is made orthonormal by a float64 Householder QR
 * (signs fixed so that diag(R) > 0) and every row is scaled to norm sqrt(d).
 * Without the flag the Gaussian rows are used as drawn.
 *
 * A cache's layer l uses the same construction with stream l; layer 0 of a
 * cache with seed s and sketch_flags f uses exactly
 * qjlkv_sketch_create(d, m_0, s, f), where m_0 is that layer's sketch row
 * count (see qjlkv_cache_sketch()). */
typedef struct qjlkv_sketch qjlkv_sketch;

#define QJLKV_SKETCH_ORTHOGONAL 1u

/* Creates a sketch. head_dim in [1, QJLKV_MAX_SKETCH_HEAD_DIM]; sketch_dim a
 * positive multiple of 8, at most QJLKV_MAX_SKETCH_DIM; flags 0 or
 * QJLKV_SKETCH_ORTHOGONAL.
 * Errors: INVALID_ARGUMENT (out == NULL, bad sizes, unknown flags),
 * OUT_OF_MEMORY. On failure *out is set to NULL (when out != NULL).
 * Thread-safe. */
QJLKV_API qjlkv_status qjlkv_sketch_create(uint32_t head_dim, uint32_t sketch_dim,
                                           uint64_t seed, uint32_t flags,
                                           qjlkv_sketch **out);

/* Copies the matrix the kernels use, row-major m x d, into out.
 * out_len is the number of floats available and must be >= m*d.
 * Errors: INVALID_ARGUMENT (NULL s or out, out_len too small). Thread-safe. */
QJLKV_API qjlkv_status qjlkv_sketch_matrix(const qjlkv_sketch *s, float *out,
                                           size_t out_len);

/* Rows (m) and columns (d) of a sketch. Errors: INVALID_ARGUMENT (NULL). */
QJLKV_API qjlkv_status qjlkv_sketch_shape(const qjlkv_sketch *s, uint32_t *rows,
                                          uint32_t *cols);

/* Frees a sketch created by qjlkv_sketch_create(); NULL is a no-op. Must not
 * be called while another thread uses the sketch. Never call it on the
 * borrowed sketch returned by qjlkv_cache_sketch(). */
QJLKV_API void qjlkv_sketch_destroy(qjlkv_sketch *s);

/* ===========================================================================
 * Configuration
 * ======================================================================== */
/* Start from qjlkv_config_init(), then change fields. Growing struct: see
 * "Growing structs" at the top. QJLKV_CONFIG_SIZE_0_1 is the size of 0.1's
 * struct (fields up to num_threads, where 0.1's `int32_t device` held both the
 * backend and the ordinal: -1 = CPU, >= 0 = CUDA device ordinal). A struct of
 * that size is read and written with 0.1's meaning: the library derives
 * backend and device_ordinal from that field and writes it back the same way,
 * so a program built against 0.1 keeps working (provided it set struct_size,
 * which 0.1 did not require of qjlkv_config_init: packaging/VERSIONING.md). */
#define QJLKV_CONFIG_SIZE_0_1 112u
#define QJLKV_CONFIG_SIZE_0_3 128u /* 0.2's and 0.3's struct: fields up to sink_tokens */
#define QJLKV_CONFIG_SIZE_0_4 144u /* 0.4's struct: fields up to rollback_tokens */
typedef struct qjlkv_config {
  uint32_t struct_size;          /* sizeof(qjlkv_config), set by the caller   */
  uint32_t num_layers;           /* [1, QJLKV_MAX_LAYERS]                     */
  uint32_t num_q_heads;          /* Hq in [1, QJLKV_MAX_HEADS], a multiple of
                                    num_kv_heads                              */
  uint32_t num_kv_heads;         /* Hkv in [1, QJLKV_MAX_HEADS] (Hq/Hkv = GQA
                                    group; 1 kv head = MQA)                   */
  uint32_t head_dim;             /* d: a multiple of 8 in [8, QJLKV_MAX_HEAD_DIM] */
  uint32_t dtype;                /* a qjlkv_dtype: keys, values, queries,
                                    outputs                                   */
  uint32_t device_ordinal;       /* the device within `backend`: 0 for the
                                    CPU, the CUDA device ordinal for CUDA     */
  uint64_t seed;                 /* sketch seed (layer l uses stream l)       */
  uint32_t sketch_flags;         /* QJLKV_SKETCH_ORTHOGONAL in every preset   */
  uint32_t key_method;           /* a qjlkv_key_method                        */
  uint32_t block_tokens;         /* B: tokens quantized together; a multiple
                                    of 8 in [8, QJLKV_MAX_BLOCK_TOKENS]       */
  uint32_t residual_tokens;      /* R: newest tokens always exact,
                                    <= QJLKV_MAX_RESIDUAL_TOKENS              */
  /* QJL (key_method == QJLKV_KEYS_QJL) */
  uint32_t key_sketch_dim;       /* m: multiple of 8 in [8, QJLKV_MAX_SKETCH_DIM] */
  uint32_t outlier_channels;     /* c: outlier channels per block, [0, d)     */
  uint32_t outlier_sketch_dim;   /* m_out: multiple of 8 in
                                    [0, QJLKV_MAX_SKETCH_DIM]; > 0 when c > 0 */
  uint32_t initial_layers;       /* layers [0, initial_layers) use the two
                                    sizes below instead of m and m_out        */
  uint32_t initial_key_sketch_dim;
  uint32_t initial_outlier_sketch_dim;
  /* KIVI / OTT */
  uint32_t key_bits;             /* 2, 3, 4 or 8                              */
  /* OTT */
  uint32_t outlier_tokens;       /* P: pool size per (sequence, kv head),
                                    [0, block_tokens)                         */
  uint32_t outlier_spill_tokens; /* spill area size,
                                    [0, QJLKV_MAX_SPILL_TOKENS]               */
  uint32_t outlier_skip_layers;  /* layers [0, n) do no tracing, n <= layers  */
  /* values */
  uint32_t value_bits;           /* 2, 3, 4, 8, or 16 = exact 16-bit values   */
  uint32_t value_group_size;     /* g: divides head_dim                       */
  uint32_t num_threads;          /* CPU worker threads, <= QJLKV_MAX_THREADS;
                                    0 = all cores                             */
  uint32_t unused_0_1;           /* the tail padding of 0.1's struct (whose
                                    callers may leave garbage there): never
                                    read, written as 0                        */
  /* --- added in 0.2 --- */
  uint32_t backend;              /* a qjlkv_backend (default CPU)             */
  uint32_t value_method;         /* a qjlkv_value_method; 0 = uniform codes
                                    (the meaning of a 0.1-sized struct)       */
  uint32_t sink_tokens;          /* S: the first S positions of every sequence
                                    stay exact (attention sinks),
                                    <= QJLKV_MAX_RESIDUAL_TOKENS; 0 for a
                                    0.1-sized struct                          */
  uint32_t unused_0_3;           /* the tail padding of 0.3's struct: never
                                    read, written as 0                        */
  /* --- added in 0.4 --- */
  uint64_t memory_budget;        /* the most bytes_used (qjlkv_cache_stats)
                                    the cache may hold; 0 = no budget. See
                                    "Sequence operations"                     */
  uint32_t rollback_tokens;      /* D: truncating a sequence by up to D
                                    positions is exact (see
                                    qjlkv_cache_truncate), at the cost of
                                    keeping exact copies of the blocks it may
                                    undo (stats.bytes_rollback);
                                    <= QJLKV_MAX_ROLLBACK_TOKENS; 32 in every
                                    preset, 0 for an older struct             */
  uint32_t unused_0_4;           /* the tail padding of 0.4's struct: never
                                    read, written as 0                        */
  /* --- added in 0.5 --- */
  uint32_t key_token_bits;       /* MIXED keys: the bits of one token's key
                                    codes (one kv head), a multiple of 8 in
                                    [8, 4 * head_dim]; every preset sets
                                    8 * ceil(17 * head_dim / 64) (2.125 bits
                                    a channel); 0 for an older struct, which
                                    therefore cannot configure MIXED keys     */
} qjlkv_config;

/* Fills the first cfg->struct_size bytes of *cfg with the defaults of the
 * named preset and the given shape. Set cfg->struct_size first (see "Growing
 * structs").
 *
 * Presets (bits per number measured by the library's own statistics, see
 * README.md for the table). Every preset fills every field; in all of them
 * g (value_group_size) is the largest of 32, 16 and 8 that divides d, except
 * where "qjl" says otherwise:
 *   "q3"    (also preset NULL or ""): the 3-bit tier. KIVI keys, 3-bit,
 *           B = 64, R = 16; the first 16 tokens of every sequence exact
 *           (sink_tokens = 16); rotated 2-bit Lloyd-Max values
 *           (value_method QJLKV_VALUES_ROTATED_LLOYD_MAX). 2.92 bits per
 *           number at 8192 tokens with fp16 I/O and d = 128 (2.98 at d = 64).
 *   "q2"    the 2-bit tier: mixed-bit keys (QJLKV_KEYS_MIXED) of
 *           key_token_bits = 8·ceil(17·d/64) bits a token (2.125 bits a
 *           channel at d = 64 and 128), B = 128, R = 32, 16 sink tokens;
 *           rotated 2-bit Lloyd-Max values. 2.48 bits per number at 8192
 *           tokens with fp16 I/O and d = 128 (2.54 at d = 64). Needs a
 *           0.5-sized struct (key_token_bits).
 *   "q4"    the 4-bit tier: KIVI keys, 4-bit, B = 128, R = 32, 4 sink
 *           tokens; rotated 3-bit Lloyd-Max values; 3.88 bits (3.94 at
 *           d = 64).
 *           Both tiers use fields added in 0.2 (value_method, sink_tokens):
 *           a 0.1-sized struct gets their keys with uniform 2-bit values and
 *           no sinks. Both backends. Accuracy: docs/ACCURACY.md.
 *   "qjl"   QJL keys, m = 2d sketch rows,
 *           c = 4 outlier channels with m_out = d (c = 0 and m_out = 0 when
 *           d < 16), no initial layers (their sizes equal m and m_out),
 *           B = 32, R = 32; 2-bit values, g = 64 when 64 divides d.
 *           Lossy: see docs/ACCURACY.md.
 *   "kivi"  KIVI keys, 2-bit, B = 128, R = 32; 2-bit values.
 *   "ott"   "kivi" + outlier-token tracing, P = 3, spill 32, the first
 *           min(2, num_layers) layers untraced.
 *   "exact" 16-bit keys and values, no quantization (fp16 for fp32/fp16
 *           inputs, bf16 for bf16 inputs), B = 32, R = 0: the baseline for
 *           comparisons.
 * The fields of the other key methods keep the values above (QJL sizes of
 * "qjl", key_bits 2, P 3, spill 32, skip min(2, num_layers), key_token_bits
 * of "q2"), so that switching
 * key_method gives sane sizes. dtype defaults to F32, backend to CPU,
 * device_ordinal to 0, seed to 0, num_threads to 0.
 *
 * Errors: INVALID_ARGUMENT (cfg == NULL, a struct_size that is not a shipped
 * size, unknown preset, or a shape that no config can accept: zero sizes or
 * sizes above the limits, Hq not a multiple of Hkv, d not a multiple of 8 or
 * above QJLKV_MAX_HEAD_DIM). On failure *cfg is unchanged. Thread-safe. */
QJLKV_API qjlkv_status qjlkv_config_init(qjlkv_config *cfg, const char *preset,
                                         uint32_t num_layers, uint32_t num_q_heads,
                                         uint32_t num_kv_heads, uint32_t head_dim);

/* Checks a configuration without creating anything; the message of a failure
 * names the first field that is wrong (struct_size included). Whether the
 * backend's device exists is checked by qjlkv_cache_create, not here.
 * Errors: INVALID_ARGUMENT. */
QJLKV_API qjlkv_status qjlkv_config_validate(const qjlkv_config *cfg);

/* ===========================================================================
 * Cache
 * ======================================================================== */
typedef struct qjlkv_cache qjlkv_cache;

/* Creates an empty cache for cfg (validated as by qjlkv_config_validate).
 * The sketches of all layers are generated here, once.
 * Errors: INVALID_ARGUMENT, OUT_OF_MEMORY, UNSUPPORTED (the CUDA backend in
 * a build without CUDA, no CUDA device with that ordinal, or QJLKV_CPU_ISA
 * forcing kernels this CPU cannot run, see "Environment"), DEVICE. On failure
 * *out is set to NULL (when out != NULL). */
QJLKV_API qjlkv_status qjlkv_cache_create(const qjlkv_config *cfg, qjlkv_cache **out);

/* Frees a cache and everything it holds; NULL is a no-op. */
QJLKV_API void qjlkv_cache_destroy(qjlkv_cache *c);

/* A copy of the configuration the cache was created with: the first
 * out->struct_size bytes (see "Growing structs"). Errors: INVALID_ARGUMENT
 * (NULL, a struct_size that is not a shipped size). */
QJLKV_API qjlkv_status qjlkv_cache_config(const qjlkv_cache *c, qjlkv_config *out);

/* Orders all work of a CUDA cache on the given cudaStream_t (NULL = default
 * stream). The stream must outlive the cache, or be replaced by NULL before it
 * is destroyed. On a CPU cache only NULL is accepted (a no-op).
 * CUDA caches, in this release: each append synchronizes the host once, to read
 * back the validation of the keys and values (non-finite data is rejected and
 * the cache stays unchanged); attend does not read back, so non-finite queries
 * are not rejected there and give NaN outputs for their heads (scores does
 * reject them).
 * Errors: INVALID_ARGUMENT (c == NULL), UNSUPPORTED (non-NULL on CPU). */
QJLKV_API qjlkv_status qjlkv_cache_set_stream(qjlkv_cache *c, void *cuda_stream);

/* ---- Shared worker threads (since 0.3) ----
 * By default every CPU cache starts config.num_threads threads of its own. An
 * engine with many caches can start one set and let every cache use it:
 *
 *   qjlkv_workers *w;  qjlkv_workers_create(0, &w);    // all cores
 *   cfg.num_threads = 1;                                // no threads of its own
 *   qjlkv_cache_create(&cfg, &c);  qjlkv_cache_set_workers(c, w);
 *   ...
 *   qjlkv_workers_destroy(w);  // any time: each cache using w keeps it alive
 *
 * Caches that share workers may be used from different threads at the same
 * time: the workers serve one call at a time, and a call that finds them busy
 * runs on its calling thread alone. Results never depend on which threads ran
 * a call. */
typedef struct qjlkv_workers qjlkv_workers;

/* Starts num_threads - 1 worker threads (the calling thread of each call is
 * the num_threads-th); 0 = the cores available. num_threads <=
 * QJLKV_MAX_THREADS. Errors: INVALID_ARGUMENT (out == NULL, num_threads too
 * large), OUT_OF_MEMORY (the system could not start the threads). On failure
 * *out is set to NULL (when out != NULL). Thread-safe. */
QJLKV_API qjlkv_status qjlkv_workers_create(uint32_t num_threads,
                                            qjlkv_workers **out);

/* Drops the caller's reference; the threads stop once no cache uses them.
 * NULL is a no-op. Must not be called while another thread passes the same
 * handle to qjlkv_cache_set_workers. */
QJLKV_API void qjlkv_workers_destroy(qjlkv_workers *workers);

/* From the next call on, runs the parallel work of CPU cache c (appends and
 * attention) on `workers` instead of its own config.num_threads threads;
 * NULL goes back to its own. c holds a reference to the workers until it is
 * destroyed or set to other workers. On a CUDA cache only NULL is accepted (a
 * no-op). Errors: INVALID_ARGUMENT (c == NULL), UNSUPPORTED (non-NULL on CUDA). */
QJLKV_API qjlkv_status qjlkv_cache_set_workers(qjlkv_cache *c,
                                               qjlkv_workers *workers);

/* Appends n_tokens tokens to sequence seq of layer `layer`.
 * keys, values: [n_tokens][num_kv_heads][head_dim] in cfg.dtype.
 * A sequence id is any uint32; a sequence is created on its first append.
 * Blocks are quantized as described at the top; appending n tokens at once
 * stores exactly what appending them one at a time would.
 * Errors: INVALID_ARGUMENT (NULL c/keys/values, n_tokens == 0, layer out of
 * range, n_tokens * num_kv_heads * head_dim overflowing, non-finite data or
 * data outside the fp16 range where stored quantized), OUT_OF_MEMORY.
 * On failure the sequence is unchanged. */
QJLKV_API qjlkv_status qjlkv_cache_append(qjlkv_cache *c, uint32_t layer, uint32_t seq,
                                          uint32_t n_tokens, const void *keys,
                                          const void *values);

/* Attention of the last n_queries appended positions of sequence seq.
 * queries, out: [n_queries][num_q_heads][head_dim] in cfg.dtype.
 * Query i (0-based) sits at position length - n_queries + i and attends to
 * positions <= its own (causal). Query head h uses kv head
 * h / (num_q_heads / num_kv_heads). Quantized keys contribute their estimated
 * scores, tail (and OTT pool/spill) tokens their exact scores; one joint
 * softmax per query head in fp32 with max subtraction. scale <= 0 means
 * 1/sqrt(head_dim).
 * Errors: INVALID_ARGUMENT (NULL pointers, layer out of range, unknown or
 * empty sequence, n_queries == 0 or > length, NaN/Inf scale, non-finite
 * queries, a first query whose sliding window reaches a position the window
 * freed: see qjlkv_layer_attention), OUT_OF_MEMORY. The cache is never
 * modified. */
QJLKV_API qjlkv_status qjlkv_cache_attend(qjlkv_cache *c, uint32_t layer, uint32_t seq,
                                          uint32_t n_queries, const void *queries,
                                          float scale, void *out);

/* The batched decode step: one token for each of n_seqs distinct sequences.
 * keys, values: [n_seqs][num_kv_heads][head_dim]. Equivalent to n_seqs calls
 * of qjlkv_cache_append with n_tokens = 1, but all-or-nothing: if any check
 * fails (duplicate ids included), no sequence changes. Errors: as append. */
QJLKV_API qjlkv_status qjlkv_cache_append_batch(qjlkv_cache *c, uint32_t layer,
                                                uint32_t n_seqs, const uint32_t *seqs,
                                                const void *keys, const void *values);

/* One query token for each of n_seqs sequences (not necessarily distinct).
 * queries, out: [n_seqs][num_q_heads][head_dim]. Equivalent to n_seqs calls
 * of qjlkv_cache_attend with n_queries = 1. Errors: as attend. */
QJLKV_API qjlkv_status qjlkv_cache_attend_batch(qjlkv_cache *c, uint32_t layer,
                                                uint32_t n_seqs, const uint32_t *seqs,
                                                const void *queries, float scale,
                                                void *out);

/* Diagnostic: the raw logits <q,k> (no scale, no softmax) of one query token
 * (query: [num_q_heads][head_dim], cfg.dtype, device memory on a CUDA cache)
 * against every cached position of the sequence, in position order:
 * out[h * length + t], float32, host memory, out_len >= num_q_heads*length.
 * Quantized positions give the estimate the attention uses; exact positions
 * the exact product. OTT: positions whose token moved to the outlier pool
 * give -INFINITY (their exact score is not part of this listing); tokens in the
 * pool or spill area are not listed. Positions a sliding window freed give
 * -INFINITY too.
 * Logits beyond the float range read +-INFINITY; where they would be NaN (a
 * finite query so large that its products overflow) the call fails instead.
 * Errors: INVALID_ARGUMENT (NULL, layer, unknown sequence, out_len too small,
 * non-finite query, a logit that overflows to NaN; out's contents are then
 * unspecified), OUT_OF_MEMORY. */
QJLKV_API qjlkv_status qjlkv_cache_scores(qjlkv_cache *c, uint32_t layer, uint32_t seq,
                                          const void *query, float *out, size_t out_len);

/* The dense reconstruction of positions [first, first + count) of (layer, seq), in position
 * order, as float32 host arrays [count][num_kv_heads][head_dim]:
 *   keys_out: the vector k̂ whose dot product with any query equals the score the attention
 *     uses: for QJL, k̂ = c_d/m·‖k_in‖·M_in·Sᵀ(±bits_in) + c_d/m_out·‖k_out‖·M_out·S_outᵀ(±bits_out)
 *     (the QJL estimate described at the top) with the outlier channels' part as stored, to fp16
 *     precision (docs/DESIGN.md, "QJL outlier corrections"); for KIVI/OTT and 16-bit keys the dequantized keys; exact keys in the tail;
 *   values_out: the dequantized values (exact in the tail).
 * OTT positions whose token moved to the pool or spill area give that token's exact key and
 * value, so attention over the reconstruction counts every token once, as attend does.
 * Either output may be NULL (not both). This is for engines whose attention kernels need dense
 * tensors (e.g. Hugging Face models); attend is the fast path.
 * Errors: INVALID_ARGUMENT (NULL c, both outputs NULL, layer out of range, count == 0,
 * first + count > length, a range holding positions a sliding window freed: the message names
 * them), OUT_OF_MEMORY. */
QJLKV_API qjlkv_status qjlkv_cache_reconstruct(qjlkv_cache *c, uint32_t layer, uint32_t seq,
                                               uint64_t first, uint64_t count, float *keys_out,
                                               float *values_out);

/* Number of positions appended to (layer, seq); 0 for a sequence never
 * appended to or cleared. Errors: INVALID_ARGUMENT (NULL, layer range). */
QJLKV_API qjlkv_status qjlkv_cache_length(const qjlkv_cache *c, uint32_t layer,
                                          uint32_t seq, uint64_t *out);

/* The sketch layer `layer` uses: max(m, m_out) rows of that layer (m and m_out
 * being the initial-layer sizes for layer < initial_layers); the inlier part
 * uses its first m rows, the outlier part its first m_out rows. Borrowed: it
 * lives as long as the cache; do not destroy it.
 * Errors: INVALID_ARGUMENT (NULL, layer out of range), UNSUPPORTED (the key
 * method is not QJL: such caches have no sketch). */
QJLKV_API qjlkv_status qjlkv_cache_sketch(const qjlkv_cache *c, uint32_t layer,
                                          const qjlkv_sketch **out);

/* Drops every layer of sequence seq and releases its memory. Clearing an id
 * that holds nothing is OK. Errors: INVALID_ARGUMENT (c == NULL). */
QJLKV_API qjlkv_status qjlkv_cache_clear_sequence(qjlkv_cache *c, uint32_t seq);

/* Memory accounting. Every stored byte is counted: sign bits, norms, outlier
 * indices and corrections, key/value codes, scales and minima, full-precision tails, OTT pools
 * and spill areas (whole, as allocated when the sequence is created), per-block metadata, the
 * rollback copies; bytes shared by forked sequences once. Blocks a sliding window freed are not
 * counted (bytes_used drops as they are freed). Capacity held but unused is counted
 * apart in bytes_reserved (>= bytes_used). Not cache data, so not counted:
 * the sketches (one per QJL layer, max(m, m_out) x head_dim floats, plus a
 * transposed copy on the CPU or a device copy on CUDA, and on CPUs with AVX2
 * tables of its columns, 8 bytes per entry; fixed at creation) and
 * the scratch buffers of append/attend, which grow to the largest call and
 * are kept for the next.
 * Growing struct: see "Growing structs" at the top. */
#define QJLKV_STATS_SIZE_0_1 80u /* 0.1's to 0.3's struct: fields up to bytes_metadata */
typedef struct qjlkv_stats {
  uint32_t struct_size;          /* sizeof(qjlkv_stats), set by the caller    */
  uint64_t tokens;               /* positions held, all layers and seqs (those
                                    a sliding window freed are not held)      */
  uint64_t bytes_used;           /* bytes that hold cache data                */
  uint64_t bytes_reserved;       /* bytes allocated for cache data            */
  uint64_t bytes_fp16_equivalent;/* tokens * Hkv * d * 2 (K and V) * 2 bytes  */
  double bits_per_number;        /* bytes_used * 8 / (tokens * Hkv * d * 2)   */
  /* --- per-component byte counts (bytes_used = their sum) --- */
  uint64_t bytes_keys_quantized; /* sign bits, norms, outlier data, codes,
                                    scales/minima of quantized key blocks     */
  uint64_t bytes_values_quantized;
  uint64_t bytes_full_precision; /* tails, OTT pools and spill areas          */
  uint64_t bytes_metadata;       /* per-sequence bookkeeping                  */
  /* --- added in 0.4 --- */
  uint64_t bytes_rollback;       /* exact copies of recently quantized blocks
                                    kept for exact truncation
                                    (config.rollback_tokens); a part of
                                    bytes_used                                */
  uint64_t bytes_shared;         /* the part of bytes_used held by more than
                                    one sequence (forks), counted once        */
} qjlkv_stats;

/* Fills the first out->struct_size bytes of *out (see "Growing structs").
 * Errors: INVALID_ARGUMENT (NULL, a struct_size that is not a shipped size). */
QJLKV_API qjlkv_status qjlkv_cache_stats(const qjlkv_cache *c, qjlkv_stats *out);

/* ===========================================================================
 * Sequence operations: rollback, fork, memory budget
 * ======================================================================== */
/* What serving engines do to a cache besides appending: speculative decoding
 * appends draft tokens and drops the rejected ones (truncate); prefix caching,
 * parallel sampling and beam search let sequences share a prompt (fork);
 * schedulers admit and preempt requests by memory (the budget calls). Each is
 * all-or-nothing, like append.
 *
 * Quantized blocks are reference counted: a fork shares them, and nothing
 * shared is ever rewritten (a sequence that appends after a fork writes its
 * new blocks elsewhere), so operations on one sequence never change another.
 *
 * The rollback floor. Each (layer, sequence) has a floor F: the largest
 * length - config.rollback_tokens it has had after an append (0 after its
 * creation), raised to n by a truncate below it to n (see below), equal to the
 * length after an import, and copied by a fork. The cache keeps exact copies
 * of the quantized blocks that a truncate to any n >= F would reopen
 * (stats.bytes_rollback): at most rollback_tokens + block_tokens positions a
 * layer, none once the blocks lie below F. Blocks that store 16-bit keys and
 * values of 16-bit inputs (the "exact" preset with F16 or BF16) reopen
 * exactly from themselves: such caches keep no copies, their floor is the
 * length, and every truncate is exact. */

/* Keeps the first min(length, its length) positions of every layer of seq.
 * Exact: truncating a layer to n >= its rollback floor leaves it bit for bit
 * as if the positions beyond n had never been appended: attend, scores,
 * reconstruct, export and every later append give what they would have given
 * (only the floor is not lowered). Speculative decoding, which appends at
 * most rollback_tokens draft tokens and truncates back to no less than the
 * accepted length, always stays within it.
 * Deeper (n below the floor): positions [0, n) are kept; those of quantized
 * blocks that must reopen into the exact tail and have no exact copy are kept
 * as their reconstruction (qjlkv_cache_reconstruct) stored in cfg.dtype
 * (clamped to its finite range), and OTT pool and spill tokens from those
 * blocks leave the pool. Attention afterwards equals attention over the
 * reconstruction of [0, n). The floor becomes n.
 * length 0 empties the sequence as qjlkv_cache_clear_sequence does, and
 * like it allocates nothing; so does a length at or above every layer's (a
 * no-op). Never refused for the memory budget (it can raise bytes_used, when
 * the exact copies it reopens are shared with a fork).
 * Sliding windows: a length n > 0 that would reopen a block the window freed,
 * or whose next query (at position n) would see a freed position (n - W + 1
 * below the end of the freed positions), is refused in every layer; truncates
 * to n >= the rollback floor, and to n >= (the longest length a layer has had
 * after an append) - rollback_tokens, are never refused for it.
 * Errors: INVALID_ARGUMENT (c == NULL, length above the longest layer of seq,
 * a length a window's freed blocks forbid: the message names the freed
 * positions), OUT_OF_MEMORY (for other lengths). On failure nothing changed. */
QJLKV_API qjlkv_status qjlkv_cache_truncate(qjlkv_cache *c, uint32_t seq, uint64_t length);

/* The empty sequence dst_seq becomes the first `length` positions of src_seq
 * in every layer src_seq holds (min(length, that layer's length) each):
 * exactly fork with src_seq's whole length followed by
 * qjlkv_cache_truncate(c, dst_seq, length). dst_seq shares src_seq's quantized
 * blocks and rollback copies (no compressed byte is copied: the cost is
 * bookkeeping per block) and gets copies of the exact rows: sinks, tail, OTT
 * pools. A fork of a whole sequence then decodes, appends and exports exactly
 * as a sequence fed the same tokens.
 * dst_seq shares src_seq's freed state: the same blocks are freed in both.
 * Errors: INVALID_ARGUMENT (c == NULL, dst_seq == src_seq, dst_seq holds
 * tokens, length above the longest layer of src_seq, a length that truncate
 * refuses for freed blocks), OUT_OF_MEMORY, MEMORY_BUDGET. On failure nothing
 * changed. */
QJLKV_API qjlkv_status qjlkv_cache_fork(qjlkv_cache *c, uint32_t src_seq, uint32_t dst_seq,
                                        uint64_t length);

/* Admission control: *out = the bytes by which stats.bytes_used grows when
 * n_tokens more tokens are appended to seq in every layer (each layer from its
 * own length, in one append or several); 0 when it does not grow (an append
 * can shrink it: quantizing exact tail tokens, letting rollback copies go and
 * freeing blocks a sliding window leaves behind free more than it adds). Exact
 * for the cache as it is now;
 * another sequence's later operations do not change it, except a truncate or
 * clear that leaves seq the only holder of a rollback copy or block it could
 * free.
 * With config.memory_budget = M > 0, an append, append_batch, fork or import
 * that would take bytes_used above M fails with QJLKV_ERROR_MEMORY_BUDGET and
 * changes nothing; truncate and clear never fail for it.
 * Errors: INVALID_ARGUMENT (NULL c or out, the sequence would exceed 2^32 - 1
 * positions). */
QJLKV_API qjlkv_status qjlkv_cache_bytes_needed(const qjlkv_cache *c, uint32_t seq, uint32_t n_tokens,
                                                uint64_t *out);

/* The bytes sequence seq holds, all layers: *bytes counts everything it
 * references, blocks it shares with other sequences included; *shared, the
 * part of it that another sequence holds too (clearing seq frees
 * *bytes - *shared). Either output may be NULL. A sequence holding nothing
 * has 0 and 0. Errors: INVALID_ARGUMENT (c == NULL). */
QJLKV_API qjlkv_status qjlkv_cache_sequence_bytes(const qjlkv_cache *c, uint32_t seq, uint64_t *bytes,
                                                  uint64_t *shared);

/* ===========================================================================
 * Attention variants of a layer (added in 0.5)
 * ======================================================================== */
/* How a layer's attention departs from softmax(scale·q·Kᵀ)·V, as some model
 * families define it. Growing struct: see "Growing structs". */
#define QJLKV_LAYER_ATTENTION_SIZE_0_5 24u /* sizeof on 64-bit targets */
typedef struct qjlkv_layer_attention {
  uint32_t struct_size;       /* sizeof(qjlkv_layer_attention), set by the caller */
  float logit_softcap;        /* c > 0: every logit s = scale·<q, k> becomes
                                 c·tanh(s / c) before the softmax (Gemma 2's
                                 attention soft-capping); 0 = none. Finite,
                                 >= 0                                         */
  const float *sink_logits;   /* NULL, or num_q_heads finite logits, one per
                                 query head h: a term exp(sink_logits[h]) in
                                 that head's softmax denominator that attends
                                 to no value (gpt-oss's learned sinks), so the
                                 weights sum to less than 1. Host memory, read
                                 during the call and copied                   */
  uint32_t window_tokens;     /* W > 0: a sliding window: the query at
                                 position p attends to positions
                                 [p - W + 1, p] only (sinks and OTT's outlier
                                 tokens included: each by its position), as
                                 Gemma's, Mistral's and gpt-oss's local layers
                                 do; 0 = every position. Can change only while
                                 the layer holds no tokens. Frees the blocks
                                 no later query sees (below)                  */
} qjlkv_layer_attention;

/* Windows free memory. After each append or append_batch on a
 * layer with window W, a sequence releases the leading quantized blocks that
 * end before min(L0, L - rollback_tokens) - W + 1, L0 and L being its lengths
 * before and after the append, except those a truncate to L - rollback_tokens
 * would reopen; blocks stay numbered as before. A block a fork shares is
 * released when its last holder frees or drops it. The sinks, the exact tail
 * and OTT's pools are kept (each has a fixed size), so a windowed sequence
 * holds about W + rollback_tokens + 2 * block_tokens positions plus those,
 * however long it grows: stats.tokens counts only the positions held, and
 * bytes_used and bytes_needed drop with the freed blocks, so a memory budget
 * that holds a windowed decode once holds it forever (one append's own tokens
 * are all held until it commits: prefill long prompts in chunks). A freed
 * position is gone: attend, reconstruct, truncate, fork and import refuse
 * what would need one, scores read -INFINITY there. Attention over the
 * positions a query sees is unchanged: bit for bit that of a cache that freed
 * nothing. */

/* Sets the attention variant of one layer, for every later attend and
 * attend_batch on it (each fused into the same pass over the cache: the
 * soft-cap applies per score as the scores are made, the sink term joins the
 * softmax's running sum, the window masks each query's positions and skips
 * the blocks no query sees). A CUDA cache does not wait for the device: the
 * sink logits are copied on the cache's stream, so attends enqueued before
 * the call keep the old variant. A cache starts with every layer plain (no
 * soft-cap, no sinks); setting a zeroed variant makes the layer plain again.
 * The stored bytes do not change, except that a window frees blocks (above):
 * qjlkv_cache_scores still returns the raw <q, k>, and export/import carry no
 * variant (set it on the importing cache).
 * Errors: INVALID_ARGUMENT (NULL c or attention, a struct_size that is not a
 * shipped size, layer out of range, a logit_softcap that is negative or not
 * finite, a sink logit that is not finite — the message names its index —,
 * a window_tokens other than the layer's while any sequence holds tokens in
 * it), OUT_OF_MEMORY; the layer's variant is then unchanged. */
QJLKV_API qjlkv_status qjlkv_cache_set_layer_attention(qjlkv_cache *c, uint32_t layer,
                                                       const qjlkv_layer_attention *attention);

/* ===========================================================================
 * Export and import (docs/FORMAT.md describes the stream)
 * ======================================================================== */
/* One sequence of a cache, in all its layers or a range of them, becomes a
 * self-describing byte stream: a versioned header (the config fields that
 * determine the stored bytes, the seed), one section per layer (the exact
 * sink tokens, the quantized blocks, the exact tail, OTT's outlier tokens),
 * and a CRC-32C over everything. Importing it into a cache whose config has
 * the same such fields restores exactly the stored bytes, so appends and
 * attention continue as if the sequence had never left (bit-identical
 * outputs). Every key and value method is carried, sink_tokens and rotated
 * values included; streams of format version 1 (written before either could
 * be exported) still import into caches that use neither, and those of
 * versions 1 and 2 of QJL caches with outlier channels (which stored the
 * outlier sign bits that version 3 replaced by corrections) are converted as
 * they are read, attending and exporting (as version 3) exactly as the cache
 * that appended the same keys. A layer with blocks its window freed is
 * exported with only the blocks after them (format version 5, written only
 * for such streams; the others keep the versions older libraries read). The
 * stream does not depend on the backend, the thread count or the number of
 * query heads: a CUDA cache exports the same bytes as a CPU cache holding the
 * same sequence,
 * and either imports the other's streams (CUDA: the stored bytes are copied
 * between host and device; the calls synchronize the cache's stream).
 *
 * Layers. A stream covers layers [first_layer, first_layer + num_layers) and is
 * imported into the same layer indices (each layer's sketch depends on its
 * index). Layers where the sequence holds no tokens are exported as empty. */

/* Receives the next `size` bytes of a stream being exported; returns the
 * number of bytes it took. Anything other than `size` stops the export. */
typedef size_t (*qjlkv_write_fn)(void *user, const void *data, size_t size);
/* Fills data with the next `size` bytes of a stream being imported; returns
 * the number of bytes read. Fewer than `size` means the stream ended. */
typedef size_t (*qjlkv_read_fn)(void *user, void *data, size_t size);

/* The exact number of bytes qjlkv_cache_export() writes for these arguments
 * (as long as the sequence does not change).
 * Errors: INVALID_ARGUMENT (NULL c or size; num_layers == 0; the range exceeds
 * the cache's layers; seq holds no tokens in any layer of the range),
 * OUT_OF_MEMORY, DEVICE (CUDA cache). */
QJLKV_API qjlkv_status qjlkv_cache_export_size(const qjlkv_cache *c, uint32_t seq,
                                               uint32_t first_layer, uint32_t num_layers,
                                               uint64_t *size);

/* Writes the stream of sequence seq, layers [first_layer, first_layer +
 * num_layers), into buf: exactly the size qjlkv_cache_export_size() reports.
 * Errors: as export_size, and INVALID_ARGUMENT for a NULL buf or a buf_size
 * below the stream's size. The cache is never modified. */
QJLKV_API qjlkv_status qjlkv_cache_export(const qjlkv_cache *c, uint32_t seq,
                                          uint32_t first_layer, uint32_t num_layers,
                                          void *buf, uint64_t buf_size);

/* The same stream, handed to write() in pieces of at most 64 KiB (the stream
 * is never held whole in memory). Errors: as export_size, and
 * INVALID_ARGUMENT for a NULL write or when write() takes fewer bytes than
 * given (the stream is then incomplete). */
QJLKV_API qjlkv_status qjlkv_cache_export_stream(const qjlkv_cache *c, uint32_t seq,
                                                 uint32_t first_layer, uint32_t num_layers,
                                                 qjlkv_write_fn write, void *user);

/* Imports a stream of exactly `size` bytes into sequence seq (any id; the
 * stream does not name one) of the layers it covers.
 * Errors, each with nothing changed:
 *   INVALID_ARGUMENT: NULL c or buf; a format version this library does not
 *     read; a config field that determines the stored bytes (or the seed, used
 *     by QJL's sketch and by rotated values) differs from this cache's (the
 *     message names it); the stream's layers exceed this cache's; seq
 *     already holds tokens in one of them; size larger than the stream; a
 *     layer with blocks a sliding window freed whose window_tokens here is 0
 *     or lets the next query (at position length) see a freed position (set
 *     the layer's window before importing).
 *   CORRUPT_DATA: not a stream (magic), a checksum mismatch, a truncated
 *     stream (size smaller than it), or counts and numbers that no cache
 *     stores (the message names the layer, block and field).
 *   OUT_OF_MEMORY, DEVICE (CUDA cache). */
QJLKV_API qjlkv_status qjlkv_cache_import(qjlkv_cache *c, uint32_t seq, const void *buf,
                                          uint64_t size);

/* The same, reading the stream through read() as it goes: no second copy of
 * the stream is held. Reads exactly the stream's bytes (several streams can
 * follow each other in a file). Storage for each layer is allocated as its
 * section header (checked by the header's checksum) announces, before the
 * payload is read; the sequence becomes visible only once the trailing
 * checksum matched. Errors: as import (a short read is CORRUPT_DATA, a
 * NULL read INVALID_ARGUMENT). */
QJLKV_API qjlkv_status qjlkv_cache_import_stream(qjlkv_cache *c, uint32_t seq,
                                                 qjlkv_read_fn read, void *user);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* QJLKV_H */
