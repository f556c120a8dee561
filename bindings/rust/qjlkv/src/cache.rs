use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::ptr::{self, NonNull};

use qjlkv_sys as sys;

use crate::config::{Config, Shape};
use crate::element::{Dtype, Element};
use crate::error::{check, Error, Status};
use crate::sketch::Sketch;
use crate::workers::Workers;

/// Memory statistics of a cache (`qjlkv_stats`): every stored byte is counted.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    /// Cached positions, all layers and sequences.
    pub tokens: u64,
    /// Bytes that hold cache data.
    pub bytes_used: u64,
    /// Bytes allocated for cache data (>= `bytes_used`).
    pub bytes_reserved: u64,
    /// What an fp16 cache of the same tokens would take: tokens * Hkv * d * 2 (K, V) * 2.
    pub bytes_fp16_equivalent: u64,
    /// `bytes_used * 8` per cached number.
    pub bits_per_number: f64,
    /// Sign bits, norms, outlier indices, codes, scales and minima of quantized key blocks.
    pub bytes_keys_quantized: u64,
    /// Codes, scales and minima of quantized value blocks.
    pub bytes_values_quantized: u64,
    /// Full-precision tails, OTT pools and spill areas.
    pub bytes_full_precision: u64,
    /// Per-sequence bookkeeping.
    pub bytes_metadata: u64,
    /// Exact copies of recently quantized blocks, kept so that a truncate by up to
    /// [`Config::rollback_tokens`] positions is exact; a part of `bytes_used` (the parts
    /// above and this one sum to it).
    pub bytes_rollback: u64,
    /// The part of `bytes_used` held by more than one sequence (forks), counted once.
    pub bytes_shared: u64,
}

impl Stats {
    /// How many times smaller than an fp16 cache of the same tokens (0 when empty).
    pub fn compression_vs_fp16(&self) -> f64 {
        if self.bytes_used == 0 {
            0.0
        } else {
            self.bytes_fp16_equivalent as f64 / self.bytes_used as f64
        }
    }
}

/// The bytes one sequence holds, all layers ([`Cache::sequence_bytes`]).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SequenceBytes {
    /// Everything the sequence references, blocks it shares with other sequences included.
    pub bytes: u64,
    /// The part of `bytes` that another sequence holds too.
    pub shared: u64,
}

impl SequenceBytes {
    /// What clearing the sequence frees: `bytes - shared`.
    pub fn exclusive(&self) -> u64 {
        self.bytes - self.shared
    }
}

/// A compressed key/value cache on the CPU.
///
/// Tensors are slices of [`Element`]s (`f32`, [`F16`](crate::F16), [`Bf16`](crate::Bf16)) in
/// the config's dtype, row-major: keys and values `[n_tokens][num_kv_heads][head_dim]`,
/// queries and outputs `[n_queries][num_q_heads][head_dim]`. Lengths and element types are
/// checked before the library is called; on any error the cache is unchanged.
///
/// A cache is `Send` but not `Sync`: it may move between threads, but one thread uses it at
/// a time (the C contract). Wrap it in a `Mutex` to share it.
///
/// ```
/// use qjlkv::{Cache, Config};
///
/// let config = Config::preset("qjl", 1, 8, 2, 64)?; // 1 layer, 8 q heads, 2 kv heads, d = 64
/// let mut cache = Cache::new(&config)?;
/// let kv_len = cache.shape().kv_token_len(); // 2 * 64 numbers per token
///
/// // Prefill 100 tokens of sequence 7, then one decode step.
/// let keys: Vec<f32> = (0..100 * kv_len).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
/// let values = keys.iter().map(|x| x * 0.5).collect::<Vec<_>>();
/// cache.append(0, 7, &keys, &values)?;
/// cache.append(0, 7, &keys[..kv_len], &values[..kv_len])?;
/// let query = vec![0.1f32; cache.shape().q_token_len()];
/// let out = cache.attend(0, 7, &query, None)?; // scale 1/sqrt(64)
/// assert_eq!(out.len(), 8 * 64);
/// assert_eq!(cache.length(0, 7)?, 101);
///
/// // At 101 tokens most of the bytes are the exact tail and the exact copies kept for
/// // rollback (`bytes_rollback`); long sequences approach the preset's bits per number.
/// let stats = cache.stats()?;
/// assert_eq!(stats.tokens, 101);
/// assert!(stats.bytes_used - stats.bytes_rollback < stats.bytes_fp16_equivalent);
///
/// // A wrong length is reported without calling the library.
/// let err = cache.append(0, 7, &keys[..kv_len - 1], &values[..kv_len - 1]).unwrap_err();
/// assert!(err.message().starts_with("keys:"));
/// # Ok::<(), qjlkv::Error>(())
/// ```
///
/// A cache cannot be shared between threads without a lock:
///
/// ```compile_fail
/// fn shared<T: Sync>(_: &T) {}
/// let cache = qjlkv::Cache::new(&qjlkv::Config::preset("qjl", 1, 4, 2, 64)?)?;
/// shared(&cache); // error: `Cache` is not `Sync`
/// # Ok::<(), qjlkv::Error>(())
/// ```
#[derive(Debug)]
pub struct Cache {
    ptr: NonNull<sys::qjlkv_cache>,
    config: Config,
    shape: Shape,
    dtype: Dtype,
}

// SAFETY: the C contract lets a cache handle move between threads as long as one thread
// uses it at a time; `Cache` is not `Sync` (NonNull is not), so `&Cache` never crosses
// threads and `&mut self` methods are exclusive.
unsafe impl Send for Cache {}

impl Cache {
    /// Creates an empty cache; the sketches of all layers are generated here, once.
    /// Errors: an invalid config (the message names the field), out of memory, and
    /// `Unsupported` for a backend other than the CPU (this API takes host slices) and for a
    /// library older than the header the bindings come from.
    pub fn new(config: &Config) -> Result<Cache, Error> {
        crate::require_library_version()?;
        let backend = config.as_raw().backend;
        if backend != sys::QJLKV_BACKEND_CPU {
            return Err(Error::new(
                Status::Unsupported,
                format!(
                    "config.backend is {backend}: qjlkv::Cache takes host slices and so only CPU caches \
                     (QJLKV_BACKEND_CPU = 0); use qjlkv-sys with device pointers for a CUDA cache"
                ),
            ));
        }
        let mut raw = ptr::null_mut();
        // SAFETY: the config is a complete qjlkv_config; raw is a valid out pointer.
        check(unsafe { sys::qjlkv_cache_create(config.as_raw(), &mut raw) })?;
        let ptr = NonNull::new(raw).expect("qjlkv_cache_create returned OK and a cache");
        let mut stored = MaybeUninit::<sys::qjlkv_config>::zeroed();
        // SAFETY: ptr is live; stored is a writable qjlkv_config whose struct_size is set first.
        let status = unsafe {
            (*stored.as_mut_ptr()).struct_size = std::mem::size_of::<sys::qjlkv_config>() as u32;
            sys::qjlkv_cache_config(ptr.as_ptr(), stored.as_mut_ptr())
        };
        if let Err(err) = check(status) {
            // SAFETY: the cache was created above and is referenced nowhere else.
            unsafe { sys::qjlkv_cache_destroy(ptr.as_ptr()) };
            return Err(err);
        }
        // SAFETY: zeroed is a valid qjlkv_config and the library filled it.
        let config = Config::from_raw(unsafe { stored.assume_init() });
        Ok(Cache {
            ptr,
            config,
            shape: config.shape(),
            dtype: config.get_dtype(),
        })
    }

    /// The configuration the cache was created with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The model shape.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// The element type every slice must have.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Appends tokens to sequence `seq` of `layer`; `keys` and `values` are
    /// `[n_tokens][num_kv_heads][head_dim]` with the same length. A sequence is created on
    /// its first append. Appending n tokens at once stores what n single appends would.
    pub fn append<T: Element>(&mut self, layer: u32, seq: u32, keys: &[T], values: &[T]) -> Result<(), Error> {
        let n_tokens = self.kv_rows(keys, values)?;
        // SAFETY: the cache is live and exclusively borrowed; keys and values hold
        // n_tokens * kv_token_len elements of the cache's dtype.
        check(unsafe { sys::qjlkv_cache_append(self.ptr.as_ptr(), layer, seq, n_tokens, void(keys), void(values)) })
    }

    /// Attention of the last `queries.len() / q_token_len()` appended positions of `seq`
    /// (causal among themselves); `queries` is `[n_queries][num_q_heads][head_dim]` and the
    /// result has the same shape. `scale` `None` means 1/sqrt(head_dim).
    pub fn attend<T: Element>(
        &mut self,
        layer: u32,
        seq: u32,
        queries: &[T],
        scale: Option<f32>,
    ) -> Result<Vec<T>, Error> {
        let mut out = vec![T::default(); queries.len()];
        self.attend_into(layer, seq, queries, scale, &mut out)?;
        Ok(out)
    }

    /// [`attend`](Cache::attend) into a caller's buffer of the same length as `queries`.
    pub fn attend_into<T: Element>(
        &mut self,
        layer: u32,
        seq: u32,
        queries: &[T],
        scale: Option<f32>,
        out: &mut [T],
    ) -> Result<(), Error> {
        let n_queries = self.q_rows(queries, out)?;
        let scale = raw_scale(scale)?;
        // SAFETY: the cache is live and exclusively borrowed; queries and out hold
        // n_queries * q_token_len elements of the cache's dtype.
        check(unsafe {
            sys::qjlkv_cache_attend(
                self.ptr.as_ptr(),
                layer,
                seq,
                n_queries,
                void(queries),
                scale,
                void_mut(out),
            )
        })
    }

    /// The batched decode step: one token for each of the distinct sequences `seqs`; `keys`
    /// and `values` are `[seqs.len()][num_kv_heads][head_dim]`. All or nothing: if any check
    /// fails (duplicate ids included), no sequence changes.
    pub fn append_batch<T: Element>(
        &mut self,
        layer: u32,
        seqs: &[u32],
        keys: &[T],
        values: &[T],
    ) -> Result<(), Error> {
        let n_seqs = self.batch_len(seqs)?;
        self.expect_len(
            "keys",
            keys,
            seqs.len() * self.shape.kv_token_len(),
            "seqs.len() * num_kv_heads * head_dim",
        )?;
        self.expect_len("values", values, keys.len(), "keys.len()")?;
        // SAFETY: the cache is live and exclusively borrowed; seqs holds n_seqs ids and
        // keys, values n_seqs * kv_token_len elements of the cache's dtype.
        check(unsafe {
            sys::qjlkv_cache_append_batch(
                self.ptr.as_ptr(),
                layer,
                n_seqs,
                seqs.as_ptr(),
                void(keys),
                void(values),
            )
        })
    }

    /// One query token for each of `seqs` (ids may repeat); `queries` is
    /// `[seqs.len()][num_q_heads][head_dim]` and so is the result.
    pub fn attend_batch<T: Element>(
        &mut self,
        layer: u32,
        seqs: &[u32],
        queries: &[T],
        scale: Option<f32>,
    ) -> Result<Vec<T>, Error> {
        let mut out = vec![T::default(); queries.len()];
        self.attend_batch_into(layer, seqs, queries, scale, &mut out)?;
        Ok(out)
    }

    /// [`attend_batch`](Cache::attend_batch) into a caller's buffer of the length of `queries`.
    pub fn attend_batch_into<T: Element>(
        &mut self,
        layer: u32,
        seqs: &[u32],
        queries: &[T],
        scale: Option<f32>,
        out: &mut [T],
    ) -> Result<(), Error> {
        let n_seqs = self.batch_len(seqs)?;
        self.expect_len(
            "queries",
            queries,
            seqs.len() * self.shape.q_token_len(),
            "seqs.len() * num_q_heads * head_dim",
        )?;
        self.expect_len("out", out, queries.len(), "queries.len()")?;
        let scale = raw_scale(scale)?;
        // SAFETY: the cache is live and exclusively borrowed; seqs holds n_seqs ids and
        // queries, out n_seqs * q_token_len elements of the cache's dtype.
        check(unsafe {
            sys::qjlkv_cache_attend_batch(
                self.ptr.as_ptr(),
                layer,
                n_seqs,
                seqs.as_ptr(),
                void(queries),
                scale,
                void_mut(out),
            )
        })
    }

    /// Diagnostic: the raw logits <q, k> (no scale, no softmax) of one query token
    /// (`[num_q_heads][head_dim]`) against every cached position of `seq`, as
    /// `out[h * length + t]`. Quantized positions give the estimate attention uses; OTT
    /// positions whose token moved to the outlier pool give `-inf`.
    pub fn scores<T: Element>(&mut self, layer: u32, seq: u32, query: &[T]) -> Result<Vec<f32>, Error> {
        self.expect_dtype::<T>("query")?;
        self.expect_len("query", query, self.shape.q_token_len(), "num_q_heads * head_dim")?;
        let length = usize::try_from(self.length(layer, seq)?)
            .map_err(|_| Error::invalid("the sequence is too long to list on this platform".into()))?;
        let mut out = vec![0.0f32; self.shape.num_q_heads as usize * length];
        // SAFETY: the cache is live and exclusively borrowed; query holds q_token_len
        // elements of the cache's dtype and out out.len() writable floats.
        check(unsafe {
            sys::qjlkv_cache_scores(self.ptr.as_ptr(), layer, seq, void(query), out.as_mut_ptr(), out.len())
        })?;
        Ok(out)
    }

    /// Positions appended to (`layer`, `seq`); 0 for a sequence never appended to or cleared.
    pub fn length(&self, layer: u32, seq: u32) -> Result<u64, Error> {
        let mut length = 0;
        // SAFETY: the cache is live; length is a valid out pointer.
        check(unsafe { sys::qjlkv_cache_length(self.ptr.as_ptr(), layer, seq, &mut length) })?;
        Ok(length)
    }

    /// Drops every layer of sequence `seq` and releases its memory (no-op for an unknown id).
    pub fn clear_sequence(&mut self, seq: u32) -> Result<(), Error> {
        // SAFETY: the cache is live and exclusively borrowed.
        check(unsafe { sys::qjlkv_cache_clear_sequence(self.ptr.as_ptr(), seq) })
    }

    /// Keeps the first `min(length, its length)` positions of every layer of `seq`
    /// (speculative decoding's rollback of rejected draft tokens). Truncating a layer by at
    /// most [`Config::rollback_tokens`] positions since its appends is exact: the sequence is
    /// bit for bit the one that never saw the dropped positions (attention, export, later
    /// appends). Deeper truncates keep the dequantized reconstruction of reopened blocks (see
    /// `qjlkv_cache_truncate`). `length` 0 empties the sequence. Never refused for the memory
    /// budget. Errors: `length` above the longest layer of `seq`; on any error nothing
    /// changed.
    pub fn truncate(&mut self, seq: u32, length: u64) -> Result<(), Error> {
        // SAFETY: the cache is live and exclusively borrowed.
        check(unsafe { sys::qjlkv_cache_truncate(self.ptr.as_ptr(), seq, length) })
    }

    /// The empty sequence `dst` becomes the first `length` positions of `src` in every layer
    /// (prefix caching, parallel sampling, beam search). `dst` shares `src`'s quantized blocks
    /// (reference counted, copy-on-write) and copies only the exact rows; later appends,
    /// truncates and clears of either never change the other. `fork(src, dst, p)` equals a
    /// fork of the whole sequence followed by `truncate(dst, p)`. Errors (nothing changed):
    /// `dst == src`, `dst` holds tokens, `length` above the longest layer of `src`, and
    /// [`Status::MemoryBudget`] when the copied rows would exceed the budget.
    pub fn fork(&mut self, src: u32, dst: u32, length: u64) -> Result<(), Error> {
        // SAFETY: the cache is live and exclusively borrowed.
        check(unsafe { sys::qjlkv_cache_fork(self.ptr.as_ptr(), src, dst, length) })
    }

    /// Admission control: the bytes by which [`Stats::bytes_used`] grows when `n_tokens` more
    /// tokens are appended to `seq` in every layer (each layer from its own length, in one
    /// append or several). Exact for the cache as it is now. Errors: the sequence would
    /// exceed `u32::MAX` positions.
    pub fn bytes_needed(&self, seq: u32, n_tokens: u32) -> Result<u64, Error> {
        let mut out = 0;
        // SAFETY: the cache is live; out is a valid out pointer.
        check(unsafe { sys::qjlkv_cache_bytes_needed(self.ptr.as_ptr(), seq, n_tokens, &mut out) })?;
        Ok(out)
    }

    /// The bytes `seq` holds, all layers, and the part of them shared with other sequences;
    /// zeros for a sequence holding nothing.
    pub fn sequence_bytes(&self, seq: u32) -> Result<SequenceBytes, Error> {
        let mut held = SequenceBytes::default();
        // SAFETY: the cache is live; both out pointers are valid.
        check(unsafe { sys::qjlkv_cache_sequence_bytes(self.ptr.as_ptr(), seq, &mut held.bytes, &mut held.shared) })?;
        Ok(held)
    }

    /// Memory statistics.
    pub fn stats(&self) -> Result<Stats, Error> {
        let mut raw = MaybeUninit::<sys::qjlkv_stats>::zeroed();
        // SAFETY: raw is a writable qjlkv_stats whose struct_size is set before the call.
        let raw = unsafe {
            (*raw.as_mut_ptr()).struct_size = std::mem::size_of::<sys::qjlkv_stats>() as u32;
            check(sys::qjlkv_cache_stats(self.ptr.as_ptr(), raw.as_mut_ptr()))?;
            raw.assume_init()
        };
        Ok(Stats {
            tokens: raw.tokens,
            bytes_used: raw.bytes_used,
            bytes_reserved: raw.bytes_reserved,
            bytes_fp16_equivalent: raw.bytes_fp16_equivalent,
            bits_per_number: raw.bits_per_number,
            bytes_keys_quantized: raw.bytes_keys_quantized,
            bytes_values_quantized: raw.bytes_values_quantized,
            bytes_full_precision: raw.bytes_full_precision,
            bytes_metadata: raw.bytes_metadata,
            bytes_rollback: raw.bytes_rollback,
            bytes_shared: raw.bytes_shared,
        })
    }

    /// The sketch `layer` uses (QJL caches only; others give `Unsupported`), borrowed for
    /// as long as the cache.
    pub fn sketch(&self, layer: u32) -> Result<Sketch<'_>, Error> {
        let mut raw = ptr::null();
        // SAFETY: the cache is live; raw is a valid out pointer.
        check(unsafe { sys::qjlkv_cache_sketch(self.ptr.as_ptr(), layer, &mut raw) })?;
        let ptr = NonNull::new(raw.cast_mut()).expect("qjlkv_cache_sketch returned OK and a sketch");
        // SAFETY: the sketch lives as long as the cache, which the lifetime borrows; it is
        // not owned, so never destroyed here.
        unsafe { Sketch::from_ptr(ptr, false) }
    }

    /// Runs this CPU cache's parallel work (appends, attention) on shared `workers` from the
    /// next call on; `None` goes back to its own `num_threads` threads. The cache keeps the
    /// workers alive while it uses them. A CUDA cache refuses workers with `Unsupported`.
    pub fn set_workers(&mut self, workers: Option<&Workers>) -> Result<(), Error> {
        let raw = workers.map_or(ptr::null_mut(), Workers::as_ptr);
        // SAFETY: the cache is live and used by this thread alone (&mut); raw is null or a
        // live workers handle that the borrow keeps alive for the call.
        check(unsafe { sys::qjlkv_cache_set_workers(self.ptr.as_ptr(), raw) })
    }

    /// Sets how `layer`'s attention departs from softmax(scale · q · Kᵀ) · V, for every later
    /// [`attend`](Cache::attend) and [`attend_batch`](Cache::attend_batch) on it:
    ///
    /// - `logit_softcap` c > 0: every logit s = scale · <q, k> becomes c · tanh(s / c) before
    ///   the softmax (Gemma 2's `attn_logit_softcapping`); 0 = none. Finite and >= 0.
    /// - `sink_logits`: `None`, or one finite logit per query head (`num_q_heads` of them):
    ///   exp(sink_logits\[h\]) joins head h's softmax denominator and attends to no value
    ///   (gpt-oss's learned sinks), so the weights sum to less than 1. Copied during the call.
    /// - `window_tokens` W > 0: a sliding window: the query at position p attends to positions
    ///   [p − W + 1, p] only; 0 = every position. It changes only while the layer holds no tokens.
    ///
    /// A cache starts with every layer plain; `set_layer_attention(layer, 0.0, None, 0)` makes a
    /// layer plain again. The stored bytes do not change: [`scores`](Cache::scores) still
    /// returns the raw <q, k>, and export/import carry no variant (set it on the importing
    /// cache). Errors ([`Status::InvalidArgument`], the layer then unchanged): `sink_logits`
    /// whose length is not `num_q_heads` (checked here), a layer out of range, a negative or
    /// non-finite `logit_softcap`, a non-finite sink logit (the message names its index), a
    /// `window_tokens` changed while the layer holds tokens.
    ///
    /// ```
    /// use qjlkv::{Cache, Config};
    ///
    /// let mut cache = Cache::new(&Config::preset("q3", 2, 4, 2, 64)?)?;
    /// cache.set_layer_attention(0, 50.0, None, 0)?; // soft-capped logits
    /// cache.set_layer_attention(1, 0.0, Some(&[0.5, -1.0, 2.0, 0.0]), 0)?; // a sink per q head
    /// let err = cache.set_layer_attention(1, 0.0, Some(&[0.5]), 0).unwrap_err();
    /// assert!(err.message().starts_with("sink_logits:"));
    /// cache.set_layer_attention(0, 0.0, None, 0)?; // plain again
    /// # Ok::<(), qjlkv::Error>(())
    /// ```
    pub fn set_layer_attention(
        &mut self,
        layer: u32,
        logit_softcap: f32,
        sink_logits: Option<&[f32]>,
        window_tokens: u32,
    ) -> Result<(), Error> {
        if let Some(sinks) = sink_logits {
            let heads = self.shape.num_q_heads as usize;
            if sinks.len() != heads {
                return Err(Error::invalid(format!(
                    "sink_logits: length {} does not match num_q_heads = {heads}",
                    sinks.len()
                )));
            }
        }
        let attention = sys::qjlkv_layer_attention {
            struct_size: std::mem::size_of::<sys::qjlkv_layer_attention>() as u32,
            logit_softcap,
            sink_logits: sink_logits.map_or(ptr::null(), <[f32]>::as_ptr),
            window_tokens,
        };
        // SAFETY: the cache is live and exclusively borrowed; attention is a complete struct
        // whose sink_logits is null or points to num_q_heads floats, read during the call only.
        check(unsafe { sys::qjlkv_cache_set_layer_attention(self.ptr.as_ptr(), layer, &attention) })
    }

    /// The C handle, for calls through `qjlkv-sys` (e.g. `qjlkv_cache_set_stream`). The
    /// cache still owns it.
    pub fn as_ptr(&self) -> *const sys::qjlkv_cache {
        self.ptr.as_ptr()
    }

    /// The mutable C handle; see [`as_ptr`](Cache::as_ptr).
    pub fn as_mut_ptr(&mut self) -> *mut sys::qjlkv_cache {
        self.ptr.as_ptr()
    }

    fn expect_dtype<T: Element>(&self, what: &str) -> Result<(), Error> {
        if T::DTYPE == self.dtype {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "{what}: element type {} does not match the cache dtype {}",
                T::DTYPE,
                self.dtype
            )))
        }
    }

    fn expect_len<T: Element>(&self, what: &str, slice: &[T], expected: usize, formula: &str) -> Result<(), Error> {
        self.expect_dtype::<T>(what)?;
        if slice.len() == expected {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "{what}: length {} does not match {formula} = {expected}",
                slice.len()
            )))
        }
    }

    /// The n of `[n][row_len]` data, checked to be whole rows; `count` names n in messages.
    fn rows<T: Element>(
        &self,
        what: &str,
        data: &[T],
        row_len: usize,
        formula: &str,
        count: &str,
    ) -> Result<u32, Error> {
        self.expect_dtype::<T>(what)?;
        if !data.len().is_multiple_of(row_len) {
            return Err(Error::invalid(format!(
                "{what}: length {} is not a multiple of {formula} = {row_len}",
                data.len()
            )));
        }
        u32::try_from(data.len() / row_len)
            .map_err(|_| Error::invalid(format!("{what}: {count} = {} exceeds u32::MAX", data.len() / row_len)))
    }

    fn kv_rows<T: Element>(&self, keys: &[T], values: &[T]) -> Result<u32, Error> {
        let row_len = self.shape.kv_token_len();
        let n = self.rows("keys", keys, row_len, "num_kv_heads * head_dim", "n_tokens")?;
        self.expect_len("values", values, keys.len(), "keys.len()")?;
        Ok(n)
    }

    fn q_rows<T: Element>(&self, queries: &[T], out: &[T]) -> Result<u32, Error> {
        let row_len = self.shape.q_token_len();
        let n = self.rows("queries", queries, row_len, "num_q_heads * head_dim", "n_queries")?;
        self.expect_len("out", out, queries.len(), "queries.len()")?;
        Ok(n)
    }

    fn batch_len(&self, seqs: &[u32]) -> Result<u32, Error> {
        u32::try_from(seqs.len()).map_err(|_| Error::invalid(format!("seqs: {} ids exceed u32::MAX", seqs.len())))
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        // SAFETY: the cache owns the handle; borrowed sketches cannot outlive it.
        unsafe { sys::qjlkv_cache_destroy(self.ptr.as_ptr()) }
    }
}

/// `None` -> 0 (the library's 1/sqrt(d)); an explicit scale must be positive, since the C
/// convention "<= 0 means default" would silently ignore a caller's mistake.
fn raw_scale(scale: Option<f32>) -> Result<f32, Error> {
    match scale {
        None => Ok(0.0),
        Some(s) if s <= 0.0 => Err(Error::invalid(format!(
            "scale is {s}, must be > 0 (None means 1/sqrt(head_dim))"
        ))),
        // NaN and infinity go to the library, which rejects them with its own message.
        Some(s) => Ok(s),
    }
}

fn void<T>(slice: &[T]) -> *const c_void {
    slice.as_ptr().cast()
}

fn void_mut<T>(slice: &mut [T]) -> *mut c_void {
    slice.as_mut_ptr().cast()
}
