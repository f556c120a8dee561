//! Safe Rust API for libqjlkv: an LLM key/value cache stored compressed (QJL sign sketches,
//! KIVI or OTT keys, 2/4/8-bit values) with decode attention computed directly on the
//! compressed bytes.
//!
//! - [`Config`]: a preset (`"q3"`, `"q4"`, `"qjl"`, `"kivi"`, `"ott"`, `"exact"`) for a model shape, refined
//!   with builder methods.
//! - [`Cache`]: append keys/values per (layer, sequence), attend queries, read statistics.
//! - [`Sketch`]: the QJL projection matrix, standalone or borrowed from a cache.
//! - [`Error`]: a [`Status`] and the library's message, which names the wrong argument.
//!
//! Tensors are plain slices of `f32`, [`F16`] or [`Bf16`] (bit patterns); see [`Cache`] for
//! their shapes. The raw C API is in the `qjlkv-sys` crate.
//!
//! # A decode step
//!
//! ```
//! use qjlkv::{Cache, Config};
//!
//! # fn main() -> Result<(), qjlkv::Error> {
//! let (layers, q_heads, kv_heads, head_dim) = (2, 8, 2, 64);
//! let mut cache = Cache::new(&Config::preset("qjl", layers, q_heads, kv_heads, head_dim)?)?;
//! let kv = cache.shape().kv_token_len();
//! let q = cache.shape().q_token_len();
//!
//! // Two sequences; each step appends one token per sequence and attends its query.
//! let seqs = [10, 11];
//! for step in 0..80 {
//!     let keys: Vec<f32> = (0..seqs.len() * kv).map(|i| ((i + step) % 13) as f32 / 13.0).collect();
//!     let values = keys.clone();
//!     let queries = vec![0.05f32; seqs.len() * q];
//!     for layer in 0..layers {
//!         cache.append_batch(layer, &seqs, &keys, &values)?;
//!         let out = cache.attend_batch(layer, &seqs, &queries, None)?;
//!         assert_eq!(out.len(), queries.len());
//!     }
//! }
//! let stats = cache.stats()?;
//! assert_eq!(stats.tokens, 2 * 2 * 80); // layers * sequences * steps
//! println!("{:.2} bits per number, {:.1}x smaller than fp16", stats.bits_per_number, stats.compression_vs_fp16());
//! cache.clear_sequence(10)?;
//! assert_eq!(cache.length(0, 10)?, 0);
//! # Ok(())
//! # }
//! ```
//!
//! # Linking
//!
//! `qjlkv-sys` links the C library; its README lists the ways (in-tree CMake build,
//! `QJLKV_BUILD_DIR`, `QJLKV_LIB_DIR`, pkg-config).

#![warn(missing_docs)]

mod cache;
mod config;
mod element;
mod error;
mod sketch;

use std::ffi::CStr;

pub use cache::{Cache, Stats};
pub use config::{Config, KeyMethod, Shape};
pub use element::{Bf16, Dtype, Element, F16};
pub use error::{Error, Status};
pub use sketch::Sketch;

// The README's example runs as a doctest too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;

/// The raw bindings this crate is built on.
pub use qjlkv_sys as sys;

/// The version of the linked library, "MAJOR.MINOR.PATCH".
///
/// ```
/// let v = qjlkv::version();
/// assert_eq!(v, format!("{}.{}.{}", qjlkv::sys::QJLKV_VERSION_MAJOR, qjlkv::sys::QJLKV_VERSION_MINOR, qjlkv::sys::QJLKV_VERSION_PATCH));
/// ```
pub fn version() -> &'static str {
    // SAFETY: qjlkv_version_string returns a static NUL-terminated string.
    let version = unsafe { CStr::from_ptr(sys::qjlkv_version_string()) };
    version.to_str().expect("the version string is ASCII")
}
