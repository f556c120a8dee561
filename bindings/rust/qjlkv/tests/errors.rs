//! Every error path: the status, a message naming the argument, and an unchanged cache.
//! Length and dtype mistakes are caught by the crate before any C call; the rest carry the
//! library's own message.

mod common;

use std::ffi::CStr;

use common::*;
use qjlkv::{Backend, Bf16, Cache, Config, Dtype, KeyMethod, Sketch, Status, F16};

fn small_cache() -> Cache {
    Cache::new(&Config::preset("qjl", 2, 4, 2, 32).unwrap()).unwrap()
}

/// This thread's last message from the C library.
fn c_last_error() -> String {
    // SAFETY: never NULL; copied at once.
    unsafe { CStr::from_ptr(qjlkv::sys::qjlkv_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn bad_presets_and_shapes() {
    assert_invalid(Config::preset("qjll", 1, 4, 2, 32), "preset \"qjll\" is unknown");
    assert_invalid(Config::preset("qjl\0", 1, 4, 2, 32), "preset");
    assert_invalid(Config::preset("qjl", 0, 4, 2, 32), "num_layers");
    assert_invalid(
        Config::preset("qjl", 1, 6, 4, 32),
        "num_q_heads (6) is not a multiple of num_kv_heads (4)",
    );
    assert_invalid(Config::preset("qjl", 1, 4, 2, 12), "head_dim is 12");
    assert_invalid(Config::preset("qjl", 1, 4, 2, 264), "head_dim is 264");
}

#[test]
fn bad_config_fields_fail_validate_and_create_with_the_same_message() {
    let base = Config::preset("qjl", 2, 4, 2, 32).unwrap();
    let mixed = base.key_method(KeyMethod::Mixed);
    let cases = [
        (base.value_group_size(12), "value_group_size"),
        (base.value_bits(5), "value_bits"),
        (base.block_tokens(12), "block_tokens"),
        (base.key_sketch_dim(100), "key_sketch_dim"),
        (base.outlier_channels(32), "outlier_channels"),
        (base.outlier_sketch_dim(0), "outlier_sketch_dim"),
        (base.initial_layers(3), "initial_layers"),
        (base.key_method(KeyMethod::Kivi).key_bits(5), "key_bits"),
        (base.value_method(7), "value_method"),
        (base.sink_tokens(70000), "sink_tokens"),
        (base.key_method(KeyMethod::Ott).outlier_tokens(40), "outlier_tokens"),
        (base.num_threads(5000), "num_threads"),
        (base.device_ordinal(1), "device_ordinal"),
        (mixed.key_token_bits(0), "key_token_bits"),
        (mixed.key_token_bits(12), "key_token_bits"),
        (mixed.key_token_bits(4 * 32 + 8), "key_token_bits"),
    ];
    for (config, field) in cases {
        let invalid = assert_invalid(config.validate(), field);
        let created = assert_invalid(Cache::new(&config), field);
        assert_eq!(invalid.message(), created.message());
    }
    base.validate().unwrap();
    // key_token_bits belongs to mixed-bit keys: the other key methods ignore it.
    base.key_token_bits(0).validate().unwrap();
    mixed.key_token_bits(8).validate().unwrap();
    mixed.key_token_bits(4 * 32).validate().unwrap();
}

#[test]
fn cuda_device_is_refused_by_the_host_slice_api() {
    let config = Config::preset("qjl", 1, 4, 2, 32).unwrap().backend(Backend::Cuda);
    let err = Cache::new(&config).unwrap_err();
    assert_eq!(err.status(), Status::Unsupported);
    assert!(err.message().contains("config.backend is 1"), "{}", err.message());
}

#[test]
fn append_length_and_dtype_errors_are_caught_before_the_library() {
    let mut cache = small_cache();
    let kv = cache.shape().kv_token_len();
    let good = vec![0.25f32; 3 * kv];
    cache.append(0, 0, &good, &good).unwrap();
    // A library error first, so that its message shows whether C was called again.
    assert_invalid(cache.append(7, 0, &good, &good), "layer is 7");
    let c_message = c_last_error();

    let e = assert_invalid(cache.append(0, 0, &good[..kv + 5], &good[..kv + 5]), "keys");
    assert_eq!(
        e.message(),
        "keys: length 69 is not a multiple of num_kv_heads * head_dim = 64"
    );
    assert_invalid(
        cache.append(0, 0, &good, &good[..2 * kv]),
        "values: length 128 does not match keys.len() = 192",
    );
    let halves = vec![F16::from_f32(0.25); kv];
    assert_invalid(
        cache.append(0, 0, &halves, &halves),
        "keys: element type f16 does not match the cache dtype f32",
    );
    let brains = vec![Bf16::from_f32(0.25); kv];
    assert_invalid(cache.append(0, 0, &brains, &brains), "element type bf16");
    assert_eq!(
        c_last_error(),
        c_message,
        "the crate's own checks must not call the library"
    );
    assert_eq!(cache.length(0, 0).unwrap(), 3);
}

#[test]
fn append_errors_from_the_library_leave_the_sequence_unchanged() {
    let mut cache = small_cache();
    let kv = cache.shape().kv_token_len();
    let good = vec![0.25f32; 40 * kv];
    cache.append(0, 0, &good, &good).unwrap();
    let before = cache.stats().unwrap();

    assert_invalid(cache.append::<f32>(0, 0, &[], &[]), "n_tokens is 0");
    assert_invalid(cache.append(2, 0, &good, &good), "layer is 2, the cache has 2 layers");
    let mut bad = good.clone();
    bad[kv + 1] = f32::NAN;
    assert_invalid(cache.append(0, 0, &bad, &good), "keys[65] is nan");
    bad[kv + 1] = f32::INFINITY;
    assert_invalid(cache.append(0, 0, &good, &bad), "values[65] is inf");
    bad[kv + 1] = 70000.0;
    assert_invalid(cache.append(0, 0, &good, &bad), "outside the fp16 range");
    // Every element within range, but a QJL key's norm above what fp16 norms hold.
    let big = vec![60000.0f32; kv];
    assert_invalid(cache.append(0, 0, &big, &big[..]), "L2 norm");

    assert_eq!(cache.length(0, 0).unwrap(), 40);
    assert_eq!(cache.stats().unwrap(), before);
}

#[test]
fn attend_errors() {
    let mut cache = small_cache();
    let (kv, q) = (cache.shape().kv_token_len(), cache.shape().q_token_len());
    cache
        .append(0, 0, &vec![0.5f32; 4 * kv], &vec![0.5f32; 4 * kv])
        .unwrap();
    let query = vec![0.1f32; q];
    let mut out = vec![0.0f32; q];

    assert_invalid(
        cache.attend(0, 0, &query[..q - 1], None),
        "queries: length 127 is not a multiple of num_q_heads * head_dim = 128",
    );
    assert_invalid(
        cache.attend_into(0, 0, &query, None, &mut out[..q - 2]),
        "out: length 126 does not match queries.len() = 128",
    );
    assert_invalid(cache.attend(0, 0, &[F16(0); 128], None), "queries: element type f16");
    assert_invalid(cache.attend(0, 0, &query, Some(0.0)), "scale is 0, must be > 0");
    assert_invalid(cache.attend(0, 0, &query, Some(-1.0)), "scale is -1");
    assert_invalid(cache.attend(0, 0, &query, Some(f32::NAN)), "scale is nan");
    assert_invalid(cache.attend(0, 0, &query, Some(f32::INFINITY)), "scale is inf");
    assert_invalid(cache.attend::<f32>(0, 0, &[], None), "n_queries is 0");
    assert_invalid(cache.attend(0, 9, &query, None), "seq 9 holds no tokens in layer 0");
    assert_invalid(cache.attend(1, 0, &query, None), "seq 0 holds no tokens in layer 1");
    assert_invalid(cache.attend(5, 0, &query, None), "layer is 5");
    assert_invalid(
        cache.attend(0, 0, &vec![0.1f32; 5 * q], None),
        "n_queries is 5, but seq 0 holds only 4 tokens",
    );
    let mut nan_query = query.clone();
    nan_query[3] = f32::NAN;
    assert_invalid(cache.attend(0, 0, &nan_query, None), "queries[3] is nan");

    cache.clear_sequence(0).unwrap();
    assert_invalid(cache.attend(0, 0, &query, None), "seq 0 holds no tokens");
}

#[test]
fn batch_errors() {
    let mut cache = small_cache();
    let (kv, q) = (cache.shape().kv_token_len(), cache.shape().q_token_len());
    let two = vec![0.5f32; 2 * kv];
    assert_invalid(
        cache.append_batch(0, &[1, 2], &two[..kv], &two[..kv]),
        "keys: length 64 does not match seqs.len() * num_kv_heads * head_dim = 128",
    );
    assert_invalid(
        cache.append_batch(0, &[1, 2], &two, &two[..kv]),
        "values: length 64 does not match keys.len() = 128",
    );
    assert_invalid(cache.append_batch::<f32>(0, &[], &[], &[]), "n_seqs is 0");
    assert_invalid(
        cache.append_batch(0, &[1, 1], &two, &two),
        "seqs lists sequence 1 twice",
    );
    cache.append_batch(0, &[1, 2], &two, &two).unwrap();

    let queries = vec![0.1f32; 2 * q];
    assert_invalid(
        cache.attend_batch(0, &[1], &queries, None),
        "queries: length 256 does not match seqs.len() * num_q_heads * head_dim = 128",
    );
    let mut out = vec![0.0f32; q];
    assert_invalid(
        cache.attend_batch_into(0, &[1, 2], &queries, None, &mut out),
        "out: length 128 does not match queries.len() = 256",
    );
    assert_invalid(cache.attend_batch::<f32>(0, &[], &[], None), "n_seqs is 0");
    assert_invalid(cache.attend_batch(0, &[1, 3], &queries, None), "seq 3");
    assert_invalid(cache.attend_batch(0, &[1, 2], &queries, Some(-2.0)), "scale");
    assert_eq!((cache.length(0, 1).unwrap(), cache.length(0, 2).unwrap()), (1, 1));
}

#[test]
fn scores_length_and_stats_errors() {
    let mut cache = small_cache();
    let (kv, q) = (cache.shape().kv_token_len(), cache.shape().q_token_len());
    cache.append(0, 0, &vec![0.5f32; kv], &vec![0.5f32; kv]).unwrap();
    assert_invalid(
        cache.scores(0, 0, &vec![0.1f32; 2 * q]),
        "query: length 256 does not match num_q_heads * head_dim = 128",
    );
    assert_invalid(cache.scores(0, 0, &[Bf16(0); 128]), "query: element type bf16");
    assert_invalid(cache.scores(0, 4, &vec![0.1f32; q]), "seq 4 holds no tokens");
    assert_invalid(cache.scores(2, 0, &vec![0.1f32; q]), "layer is 2");
    assert_invalid(cache.length(2, 0), "layer is 2");
    assert_eq!(cache.length(1, 12345).unwrap(), 0, "an unknown sequence has length 0");
    cache.clear_sequence(777).unwrap(); // clearing an unknown id is fine
}

#[test]
fn sketch_errors() {
    assert_invalid(Sketch::new(0, 64, 1, true), "head_dim is 0");
    assert_invalid(Sketch::new(2000, 64, 1, true), "head_dim is 2000");
    assert_invalid(Sketch::new(64, 12, 1, true), "sketch_dim");
    assert_invalid(Sketch::new(64, 0, 1, true), "sketch_dim");
    let sketch = Sketch::new(16, 24, 1, false).unwrap();
    assert_eq!((sketch.rows(), sketch.cols()), (24, 16));
    let mut short = vec![0.0; 24 * 16 - 1];
    assert_invalid(
        sketch.matrix_into(&mut short),
        "out: length 383 does not match the sketch's rows * cols = 24 * 16 = 384",
    );

    let cache = small_cache();
    assert_invalid(cache.sketch(2), "layer is 2");
    let kivi = Cache::new(&Config::preset("kivi", 1, 4, 2, 32).unwrap()).unwrap();
    let err = kivi.sketch(0).unwrap_err();
    assert_eq!(err.status(), Status::Unsupported);
    assert!(err.message().contains("not QJL"), "{}", err.message());
}

#[test]
fn error_formatting() {
    let err = Config::preset("nope", 1, 1, 1, 8).unwrap_err();
    assert_eq!(err.status().name(), "QJLKV_ERROR_INVALID_ARGUMENT");
    assert_eq!(err.status().code(), qjlkv::sys::QJLKV_ERROR_INVALID_ARGUMENT);
    assert_eq!(
        err.to_string(),
        format!("{} (QJLKV_ERROR_INVALID_ARGUMENT)", err.message())
    );
    let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(err);
    assert!(boxed.to_string().contains("nope"));
    assert_eq!(Status::Unsupported.name(), "QJLKV_ERROR_UNSUPPORTED");
    assert_eq!(Status::Other(99).name(), "unknown status");
    assert_eq!(Dtype::Bf16.to_string(), "bf16");
}
