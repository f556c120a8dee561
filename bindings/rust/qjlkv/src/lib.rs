//! Safe Rust API for libqjlkv: an LLM key/value cache stored compressed (by default `q3`:
//! 3-bit per-channel keys and rotated 2-bit values, about 3 bits per number; `q2` about 2.5
//! with mixed-bit keys; `q4` about 4; the QJL, KIVI and OTT methods as published) with decode
//! attention computed directly on the compressed bytes.
//!
//! - [`Config`]: a preset (`"q2"`, `"q3"`, `"q4"`, `"qjl"`, `"kivi"`, `"ott"`, `"exact"`) for a
//!   model shape, refined with builder methods.
//! - [`Cache`]: append keys/values per (layer, sequence), attend queries, read statistics;
//!   truncate (rollback) and fork sequences, predict and cap their memory; give a layer
//!   soft-capped logits or sink logits ([`Cache::set_layer_attention`]).
//! - [`Sketch`]: the QJL projection matrix, standalone or borrowed from a cache.
//! - [`Workers`]: CPU worker threads several caches can share.
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
//! let mut cache = Cache::new(&Config::preset("q3", layers, q_heads, kv_heads, head_dim)?)?;
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
mod serialize;
mod sketch;
mod workers;

use std::ffi::CStr;

pub use cache::{Cache, SequenceBytes, Stats};
pub use config::{Backend, Config, KeyMethod, Shape};
pub use element::{Bf16, Dtype, Element, F16};
pub use error::{Error, Status};
pub use sketch::Sketch;
pub use workers::Workers;

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

/// Fails when the library linked at run time is older than the header the bindings were
/// generated from (`qjlkv_version_number() < QJLKV_VERSION_NUMBER`): such a library lacks
/// functions, fields or enumerators this crate uses. Every constructor checks it first.
pub fn require_library_version() -> Result<(), Error> {
    // SAFETY: qjlkv_version_number has no preconditions.
    check_version(unsafe { sys::qjlkv_version_number() }, sys::QJLKV_VERSION_NUMBER)
}

fn check_version(runtime: u32, header: u32) -> Result<(), Error> {
    if runtime >= header {
        return Ok(());
    }
    Err(Error::new(
        Status::Unsupported,
        format!(
            "the libqjlkv linked at run time has version number {runtime}, older than the {header} \
             (MAJOR*10000 + MINOR*100 + PATCH) of the header qjlkv-sys was generated from; link a \
             libqjlkv at least that new"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_library_is_refused_with_both_versions_named() {
        let header = sys::QJLKV_VERSION_NUMBER;
        assert!(check_version(header, header).is_ok());
        assert!(check_version(header + 1, header).is_ok());
        let err = check_version(header - 1, header).unwrap_err();
        assert_eq!(err.status(), Status::Unsupported);
        let expected = format!("version number {}, older than the {header}", header - 1);
        assert!(err.message().contains(&expected), "{}", err.message());
        require_library_version().unwrap();
    }
}
