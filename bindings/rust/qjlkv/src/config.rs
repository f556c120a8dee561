use std::ffi::CString;
use std::mem::MaybeUninit;

use qjlkv_sys as sys;

use crate::element::Dtype;
use crate::error::{check, Error};

/// How keys are stored once their block is quantized (`qjlkv_key_method`).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyMethod {
    /// Sign bits of a JL sketch plus norms, with an outlier-channel sketch.
    Qjl,
    /// Per-channel asymmetric `key_bits` quantization.
    Kivi,
    /// KIVI plus outlier-token tracing.
    Ott,
    /// 16-bit keys, no quantization.
    Exact,
    /// Per-channel codes of 0-4 bits chosen per block from the channels' ranges,
    /// [`Config::key_token_bits`] a token (the `"q2"` preset's keys).
    Mixed,
}

impl KeyMethod {
    fn to_raw(self) -> sys::qjlkv_key_method {
        match self {
            KeyMethod::Qjl => sys::QJLKV_KEYS_QJL,
            KeyMethod::Kivi => sys::QJLKV_KEYS_KIVI,
            KeyMethod::Ott => sys::QJLKV_KEYS_OTT,
            KeyMethod::Exact => sys::QJLKV_KEYS_EXACT,
            KeyMethod::Mixed => sys::QJLKV_KEYS_MIXED,
        }
    }

    fn from_raw(raw: sys::qjlkv_key_method) -> Option<KeyMethod> {
        match raw {
            sys::QJLKV_KEYS_QJL => Some(KeyMethod::Qjl),
            sys::QJLKV_KEYS_KIVI => Some(KeyMethod::Kivi),
            sys::QJLKV_KEYS_OTT => Some(KeyMethod::Ott),
            sys::QJLKV_KEYS_EXACT => Some(KeyMethod::Exact),
            sys::QJLKV_KEYS_MIXED => Some(KeyMethod::Mixed),
            _ => None,
        }
    }
}

/// Where a cache keeps its data and runs its kernels (`qjlkv_backend`); the device within
/// the backend is [`Config::device_ordinal`].
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Host memory and the CPU kernels (device ordinal 0).
    Cpu,
    /// An NVIDIA GPU; the device ordinal is the CUDA device ordinal.
    Cuda,
}

impl Backend {
    fn to_raw(self) -> u32 {
        match self {
            Backend::Cpu => sys::QJLKV_BACKEND_CPU,
            Backend::Cuda => sys::QJLKV_BACKEND_CUDA,
        }
    }

    fn from_raw(raw: u32) -> Option<Backend> {
        match raw {
            sys::QJLKV_BACKEND_CPU => Some(Backend::Cpu),
            sys::QJLKV_BACKEND_CUDA => Some(Backend::Cuda),
            _ => None,
        }
    }
}

/// The model shape a cache is made for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Layers.
    pub num_layers: u32,
    /// Query heads (Hq), a multiple of `num_kv_heads`.
    pub num_q_heads: u32,
    /// Key/value heads (Hkv); query head `h` uses kv head `h / (Hq / Hkv)`.
    pub num_kv_heads: u32,
    /// Head dimension d.
    pub head_dim: u32,
}

impl Shape {
    /// Elements of one token's keys (or values): `num_kv_heads * head_dim`.
    pub fn kv_token_len(&self) -> usize {
        self.num_kv_heads as usize * self.head_dim as usize
    }

    /// Elements of one token's queries (or attention output): `num_q_heads * head_dim`.
    pub fn q_token_len(&self) -> usize {
        self.num_q_heads as usize * self.head_dim as usize
    }
}

/// A cache configuration: a named preset with the shape of the model, changed field by field
/// with builder methods. Every field is documented at `qjlkv_config` in `qjlkv.h`.
///
/// ```
/// use qjlkv::{Config, Dtype};
///
/// // Llama-3-8B-like layer shape, QJL keys, fp16 tensors, bigger blocks.
/// let config = Config::preset("qjl", 32, 32, 8, 128)?
///     .dtype(Dtype::F16)
///     .block_tokens(64)
///     .residual_tokens(64);
/// config.validate()?;
/// assert_eq!(config.get_dtype(), Dtype::F16);
///
/// let wrong = config.value_group_size(48);
/// let err = wrong.validate().unwrap_err();
/// assert!(err.message().contains("value_group_size"));
/// # Ok::<(), qjlkv::Error>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Config {
    raw: sys::qjlkv_config,
}

/// Builder methods that set one `u32` field of `qjlkv_config`.
macro_rules! u32_fields {
    ($($(#[$doc:meta])* $field:ident;)*) => {
        $(
            $(#[$doc])*
            #[must_use]
            pub fn $field(mut self, value: u32) -> Config {
                self.raw.$field = value;
                self
            }
        )*
    };
}

impl Config {
    /// The named preset (`"q2"`, `"q3"`, `"q4"`, `"qjl"`, `"kivi"`, `"ott"` or `"exact"`; see
    /// `qjlkv_config_init`)
    /// for a model of the given shape. Errors name the argument: an unknown preset, zero
    /// sizes, `num_q_heads` not a multiple of `num_kv_heads`, `head_dim` not a multiple of 8
    /// in [8, 256].
    pub fn preset(
        name: &str,
        num_layers: u32,
        num_q_heads: u32,
        num_kv_heads: u32,
        head_dim: u32,
    ) -> Result<Config, Error> {
        crate::require_library_version()?;
        let name = CString::new(name).map_err(|_| Error::invalid(format!("preset {name:?} contains a NUL byte")))?;
        let mut raw = MaybeUninit::<sys::qjlkv_config>::zeroed();
        // SAFETY: raw is a valid, writable qjlkv_config (zeroed); struct_size is set first, as
        // every call that fills the struct requires; name is NUL-terminated.
        check(unsafe {
            (*raw.as_mut_ptr()).struct_size = std::mem::size_of::<sys::qjlkv_config>() as u32;
            sys::qjlkv_config_init(
                raw.as_mut_ptr(),
                name.as_ptr(),
                num_layers,
                num_q_heads,
                num_kv_heads,
                head_dim,
            )
        })?;
        // SAFETY: zeroed is a valid qjlkv_config (plain integers) and init filled it.
        Ok(Config {
            raw: unsafe { raw.assume_init() },
        })
    }

    pub(crate) fn from_raw(raw: sys::qjlkv_config) -> Config {
        Config { raw }
    }

    /// Checks the configuration with `qjlkv_config_validate`; the message names the first
    /// field that is wrong.
    pub fn validate(&self) -> Result<(), Error> {
        // SAFETY: self.raw is a complete qjlkv_config with struct_size set by init.
        check(unsafe { sys::qjlkv_config_validate(&self.raw) })
    }

    /// The C struct, for calls through `qjlkv-sys`.
    pub fn as_raw(&self) -> &sys::qjlkv_config {
        &self.raw
    }

    /// The model shape.
    pub fn shape(&self) -> Shape {
        Shape {
            num_layers: self.raw.num_layers,
            num_q_heads: self.raw.num_q_heads,
            num_kv_heads: self.raw.num_kv_heads,
            head_dim: self.raw.head_dim,
        }
    }

    /// The element type of keys, values, queries and outputs.
    ///
    /// # Panics
    /// If the raw field holds a value no [`Dtype`] names (only possible via a newer library).
    pub fn get_dtype(&self) -> Dtype {
        Dtype::from_raw(self.raw.dtype).expect("qjlkv_config.dtype holds a known dtype")
    }

    /// The key method, or `None` for a value this crate does not know.
    pub fn get_key_method(&self) -> Option<KeyMethod> {
        KeyMethod::from_raw(self.raw.key_method)
    }

    /// The backend, or `None` for a value this crate does not know.
    pub fn get_backend(&self) -> Option<Backend> {
        Backend::from_raw(self.raw.backend)
    }

    /// The device within the backend (0 for the CPU).
    pub fn get_device_ordinal(&self) -> u32 {
        self.raw.device_ordinal
    }

    /// The most `bytes_used` the cache may hold; 0 = no budget (every preset).
    pub fn get_memory_budget(&self) -> u64 {
        self.raw.memory_budget
    }

    /// D: how many positions a truncate can undo exactly (32 in every preset).
    pub fn get_rollback_tokens(&self) -> u32 {
        self.raw.rollback_tokens
    }

    /// Mixed-bit keys: the bits of one token's key codes (one kv head); every preset sets
    /// `8 * ceil(17 * head_dim / 64)`, 2.125 bits a channel.
    pub fn get_key_token_bits(&self) -> u32 {
        self.raw.key_token_bits
    }

    /// Element type of keys, values, queries and outputs (default `F32`).
    #[must_use]
    pub fn dtype(mut self, dtype: Dtype) -> Config {
        self.raw.dtype = dtype.to_raw();
        self
    }

    /// How keys are stored once quantized (each preset sets its own).
    #[must_use]
    pub fn key_method(mut self, method: KeyMethod) -> Config {
        self.raw.key_method = method.to_raw();
        self
    }

    /// The backend (default [`Backend::Cpu`]). [`Cache`](crate::Cache) takes host slices and
    /// so accepts CPU caches only; use `qjlkv-sys` for CUDA caches.
    #[must_use]
    pub fn backend(mut self, backend: Backend) -> Config {
        self.raw.backend = backend.to_raw();
        self
    }

    /// The device within the backend: 0 for the CPU (the default), the CUDA device ordinal
    /// for [`Backend::Cuda`].
    #[must_use]
    pub fn device_ordinal(mut self, ordinal: u32) -> Config {
        self.raw.device_ordinal = ordinal;
        self
    }

    /// The sketch seed (layer `l` uses stream `l`).
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Config {
        self.raw.seed = seed;
        self
    }

    /// Caps the cache's `bytes_used` ([`Stats::bytes_used`](crate::Stats::bytes_used)) at
    /// `bytes`; 0 (the default) = no budget. An append, batch append, fork or import that
    /// would exceed it fails with [`Status::MemoryBudget`](crate::Status::MemoryBudget) and
    /// changes nothing; truncate and clear never fail for it.
    /// [`Cache::bytes_needed`](crate::Cache::bytes_needed) tells beforehand what an append
    /// will take.
    #[must_use]
    pub fn memory_budget(mut self, bytes: u64) -> Config {
        self.raw.memory_budget = bytes;
        self
    }

    /// Orthogonalized sketch rows (every preset) or plain Gaussian rows.
    #[must_use]
    pub fn orthogonal_sketch(mut self, orthogonal: bool) -> Config {
        self.raw.sketch_flags = if orthogonal { sys::QJLKV_SKETCH_ORTHOGONAL } else { 0 };
        self
    }

    u32_fields! {
        /// B: tokens quantized together, a multiple of 8 in [8, 4096].
        block_tokens;
        /// R: the newest tokens always kept exact, <= 65536.
        residual_tokens;
        /// QJL m: sketch rows for inlier channels, a multiple of 8.
        key_sketch_dim;
        /// QJL c: outlier channels per block, below `head_dim`.
        outlier_channels;
        /// QJL m_out: sketch rows for the outlier channels, a multiple of 8 (> 0 when c > 0).
        outlier_sketch_dim;
        /// QJL: layers `[0, n)` use the two `initial_*` sizes instead of m and m_out.
        initial_layers;
        /// QJL m of the initial layers.
        initial_key_sketch_dim;
        /// QJL m_out of the initial layers.
        initial_outlier_sketch_dim;
        /// KIVI/OTT key bits: 2, 3, 4 or 8.
        key_bits;
        /// OTT P: outlier-token pool size per (sequence, kv head), <= `block_tokens`.
        outlier_tokens;
        /// OTT spill area size, <= 4096.
        outlier_spill_tokens;
        /// OTT: layers `[0, n)` do no tracing.
        outlier_skip_layers;
        /// Value bits: 2, 3, 4, 8, or 16 = exact 16-bit values.
        value_bits;
        /// g: channels per value quantization group; divides `head_dim`.
        value_group_size;
        /// CPU worker threads; 0 = the cores available. Results do not depend on it.
        num_threads;
        /// A `qjlkv_value_method`: 0 = uniform per-token codes in groups, 1 = rotated
        /// Lloyd-Max codes (`value_bits` 2, 3 or 4).
        value_method;
        /// S: the first S positions of every sequence stay exact (attention sinks), <= 65536.
        sink_tokens;
        /// D: truncating a sequence by up to D positions is exact
        /// ([`Cache::truncate`](crate::Cache::truncate)), at the cost of exact copies of the
        /// blocks it may undo (`Stats::bytes_rollback`); <= 65536, 32 in every preset.
        rollback_tokens;
        /// [`KeyMethod::Mixed`]: the bits of one token's key codes (one kv head), a multiple
        /// of 8 in [8, 4 * `head_dim`], spent per block on the channels whose ranges are
        /// widest; every preset sets `8 * ceil(17 * head_dim / 64)` (2.125 bits a channel).
        /// Ignored by the other key methods.
        key_token_bits;
    }
}
