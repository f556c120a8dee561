//! Append, attend, scores, stats, GQA and batches through the safe API, checked against an
//! f64 reference of the semantics in qjlkv.h / DESIGN.md.

mod common;

use common::*;
use qjlkv::{Bf16, Cache, Config, Dtype, Element, KeyMethod, Shape, F16};

fn exact_cache(shape: Shape) -> Cache {
    let config = Config::preset(
        "exact",
        shape.num_layers,
        shape.num_q_heads,
        shape.num_kv_heads,
        shape.head_dim,
    )
    .expect("valid shape");
    Cache::new(&config).expect("cache")
}

/// Everything `stats` counts except reserved capacity, which depends on how storage grew.
fn stored_bytes(cache: &Cache) -> [u64; 6] {
    let s = cache.stats().unwrap();
    [
        s.tokens,
        s.bytes_used,
        s.bytes_keys_quantized,
        s.bytes_values_quantized,
        s.bytes_full_precision,
        s.bytes_metadata,
    ]
}

fn shape(num_layers: u32, num_q_heads: u32, num_kv_heads: u32, head_dim: u32) -> Shape {
    Shape {
        num_layers,
        num_q_heads,
        num_kv_heads,
        head_dim,
    }
}

/// Appends `length` random tokens in chunks and checks attention of `n_queries` queries
/// against the reference over what the exact preset stores.
fn check_exact_attend(shape: Shape, length: usize, chunk: usize, n_queries: usize, scale: Option<f32>) {
    let mut rng = Rng(length as u64 * 31 + shape.num_q_heads as u64);
    let mut cache = exact_cache(shape);
    let keys = rng.normals(length * shape.kv_token_len());
    let values = rng.normals(length * shape.kv_token_len());
    let kv = shape.kv_token_len();
    for start in (0..length).step_by(chunk) {
        let end = (start + chunk).min(length);
        cache
            .append(0, 5, &keys[start * kv..end * kv], &values[start * kv..end * kv])
            .unwrap();
    }
    assert_eq!(cache.length(0, 5).unwrap(), length as u64);

    let raw = cache.config().as_raw();
    let quantized = quantized_positions(length, raw.block_tokens as usize, raw.residual_tokens as usize);
    let stored_keys = exact_preset_view(&keys, kv, quantized);
    let stored_values = exact_preset_view(&values, kv, quantized);
    let queries = rng.normals(n_queries * shape.q_token_len());
    let out = cache.attend(0, 5, &queries, scale).unwrap();
    let scale = scale.map_or(1.0 / f64::from(shape.head_dim).sqrt(), f64::from);
    let want = reference_attend(shape, &stored_keys, &stored_values, &queries, scale);
    let diff = max_relative_diff(&out, &want);
    assert!(diff < 2e-5, "attend differs from the reference by {diff} (relative)");
}

#[test]
fn exact_attend_matches_reference_over_blocks_and_tail() {
    // 100 tokens: three quantized (fp16) blocks of 32 and an f32 tail of 4.
    check_exact_attend(shape(1, 8, 2, 64), 100, 100, 1, None);
}

#[test]
fn gqa_groups_and_mqa_map_query_heads_to_kv_heads() {
    check_exact_attend(shape(1, 12, 3, 32), 70, 70, 1, None);
    check_exact_attend(shape(1, 6, 1, 64), 40, 40, 1, None);
    check_exact_attend(shape(1, 4, 4, 16), 40, 40, 1, None);
}

#[test]
fn several_queries_are_causal_among_themselves() {
    check_exact_attend(shape(1, 4, 2, 32), 77, 77, 5, None);
}

#[test]
fn explicit_scale_is_used() {
    check_exact_attend(shape(1, 4, 2, 32), 50, 50, 1, Some(0.37));
}

#[test]
fn token_by_token_appends_match_reference() {
    check_exact_attend(shape(1, 4, 2, 32), 70, 1, 1, None);
}

#[test]
fn appending_at_once_stores_what_single_appends_store() {
    for preset in ["q2", "qjl", "kivi", "ott", "exact"] {
        let config = Config::preset(preset, 1, 8, 2, 64).unwrap().outlier_skip_layers(0);
        let (mut at_once, mut one_by_one) = (Cache::new(&config).unwrap(), Cache::new(&config).unwrap());
        let kv = at_once.shape().kv_token_len();
        let mut rng = Rng(9);
        let length = 300;
        let keys = rng.normals(length * kv);
        let values = rng.normals(length * kv);
        at_once.append(0, 1, &keys, &values).unwrap();
        for (k, v) in keys.chunks(kv).zip(values.chunks(kv)) {
            one_by_one.append(0, 1, k, v).unwrap();
        }
        let query = rng.normals(at_once.shape().q_token_len());
        assert_eq!(
            at_once.attend(0, 1, &query, None).unwrap(),
            one_by_one.attend(0, 1, &query, None).unwrap(),
            "{preset}"
        );
        assert_eq!(
            at_once.scores(0, 1, &query).unwrap(),
            one_by_one.scores(0, 1, &query).unwrap(),
            "{preset}"
        );
        assert_eq!(stored_bytes(&at_once), stored_bytes(&one_by_one), "{preset}");
    }
}

#[test]
fn exact_scores_are_dot_products_of_stored_keys() {
    let shape = shape(1, 4, 2, 32);
    let mut cache = exact_cache(shape);
    let mut rng = Rng(3);
    let length = 90;
    let keys = rng.normals(length * shape.kv_token_len());
    cache.append(0, 0, &keys, &keys).unwrap();
    let query = rng.normals(shape.q_token_len());
    let scores = cache.scores(0, 0, &query).unwrap();
    assert_eq!(scores.len(), 4 * length);
    let stored = exact_preset_view(&keys, shape.kv_token_len(), quantized_positions(length, 32, 0));
    let d = 32;
    for h in 0..4 {
        for t in 0..length {
            let want = dot(&query[h * d..][..d], &stored[(t * 2 + h / 2) * d..][..d]);
            let got = f64::from(scores[h * length + t]);
            assert!(
                (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                "head {h} token {t}: {got} vs {want}"
            );
        }
    }
}

/// QJL: tail scores are exact; quantized scores estimate <q, k> within Lemma 3.5's bound,
/// and averaged over independent sketches (seeds) they are unbiased.
#[test]
fn qjl_scores_are_exact_in_the_tail_and_unbiased_estimates_in_blocks() {
    let d = 64usize;
    let (block, residual) = (32usize, 32usize);
    let length = block + residual;
    let mut seed_means = Vec::new();
    let mut worst = 0.0f64;
    for seed in 0..48u64 {
        let mut rng = Rng(1000 + seed);
        let config = Config::preset("qjl", 1, 1, 1, d as u32).unwrap().seed(seed);
        let mut cache = Cache::new(&config).unwrap();
        let keys = rng.normals(length * d);
        cache.append(0, 0, &keys, &keys).unwrap();
        let query = rng.normals(d);
        let scores = cache.scores(0, 0, &query).unwrap();
        let mut sum = 0.0;
        for t in 0..length {
            let key = &keys[t * d..][..d];
            let truth = dot(&query, key);
            let normalized = (f64::from(scores[t]) - truth) / (norm(&query) * norm(key));
            if t < block {
                sum += normalized;
                worst = worst.max(normalized.abs());
            } else {
                assert!(normalized.abs() < 1e-5, "tail token {t} must be exact: {}", scores[t]);
            }
        }
        seed_means.push(sum / block as f64);
    }
    // m = 2d = 128 rows: Lemma 3.5 gives P(|err| > 0.4 |q||k|) < 1e-4 for the inlier part.
    assert!(worst < 0.4, "largest normalized estimate error {worst}");
    let n = seed_means.len() as f64;
    let mean = seed_means.iter().sum::<f64>() / n;
    let sd = (seed_means.iter().map(|m| (m - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
    assert!(
        mean.abs() < 4.0 * sd / n.sqrt(),
        "bias {mean} exceeds 4 standard errors ({})",
        sd / n.sqrt()
    );
}

#[test]
fn compressed_attention_stays_close_to_exact() {
    let shape = shape(1, 8, 2, 128);
    let mut rng = Rng(77);
    let length = 1024;
    let keys = rng.normals(length * shape.kv_token_len());
    let values = rng.normals(length * shape.kv_token_len());
    // A query close to one key (per head) makes attention peaked, as in retrieval.
    let target = 500;
    let mut query = rng.normals(shape.q_token_len());
    for h in 0..8 {
        let key = &keys[(target * 2 + h / 4) * 128..][..128];
        query[h * 128..][..128]
            .iter_mut()
            .zip(key)
            .for_each(|(q, k)| *q = 0.3 * *q + k);
    }
    let mut exact = exact_cache(shape);
    exact.append(0, 0, &keys, &values).unwrap();
    let want = exact.attend(0, 0, &query, None).unwrap();
    for preset in ["q2", "qjl", "kivi", "ott"] {
        // 8-bit values isolate the key error (uniform: q2's rotated values take 2 to 4 bits).
        let config = Config::preset(preset, 1, 8, 2, 128)
            .unwrap()
            .value_method(0)
            .value_bits(8)
            .outlier_skip_layers(0);
        let mut cache = Cache::new(&config).unwrap();
        cache.append(0, 0, &keys, &values).unwrap();
        let error = relative_l2(&cache.attend(0, 0, &query, None).unwrap(), &want);
        assert!(error < 0.1, "{preset}: relative error {error} against the exact cache");
    }
}

#[test]
fn stats_count_tokens_and_bytes_consistently() {
    for preset in ["qjl", "kivi", "ott", "exact"] {
        let config = Config::preset(preset, 2, 8, 2, 128).unwrap();
        let mut cache = Cache::new(&config).unwrap();
        let empty = cache.stats().unwrap();
        assert_eq!((empty.tokens, empty.bytes_fp16_equivalent), (0, 0), "{preset}");

        let mut rng = Rng(5);
        let kv = cache.shape().kv_token_len();
        for (seq, length) in [(0u32, 4096usize), (1, 300)] {
            let keys = rng.normals(length * kv);
            for layer in 0..2 {
                cache.append(layer, seq, &keys, &keys).unwrap();
            }
        }
        let stats = cache.stats().unwrap();
        let tokens = 2 * (4096 + 300);
        assert_eq!(stats.tokens, tokens as u64, "{preset}");
        assert_eq!(stats.bytes_fp16_equivalent, (tokens * kv * 2 * 2) as u64, "{preset}");
        let components = stats.bytes_keys_quantized
            + stats.bytes_values_quantized
            + stats.bytes_full_precision
            + stats.bytes_metadata
            + stats.bytes_rollback;
        assert_eq!(
            stats.bytes_used, components,
            "{preset}: bytes_used is the sum of its parts"
        );
        assert!(stats.bytes_reserved >= stats.bytes_used, "{preset}");
        let numbers = (tokens * kv * 2) as f64;
        let bits = stats.bytes_used as f64 * 8.0 / numbers;
        assert!(
            (stats.bits_per_number - bits).abs() < 1e-9,
            "{preset}: {} vs {bits}",
            stats.bits_per_number
        );
        // The exact copies kept for rollback (up to a block per layer and sequence, f32 like
        // the input) are counted, but the bounds below are about the stored cache itself.
        assert!(stats.bytes_rollback > 0, "{preset}");
        let stored_bits = (stats.bytes_used - stats.bytes_rollback) as f64 * 8.0 / numbers;
        if preset == "exact" {
            // fp16 blocks plus an f32 tail of at most B - 1 tokens per sequence and layer.
            assert!((16.0..16.5).contains(&stored_bits), "{preset}: {stored_bits}");
        } else {
            assert!(stored_bits < 4.0, "{preset}: {stored_bits} bits per number");
            assert!(
                stats.bytes_keys_quantized > 0 && stats.bytes_values_quantized > 0,
                "{preset}"
            );
        }

        cache.clear_sequence(0).unwrap();
        let cleared = cache.stats().unwrap();
        assert_eq!(cleared.tokens, 2 * 300, "{preset}");
        assert!(cleared.bytes_used < stats.bytes_used, "{preset}");
        assert_eq!(cache.length(0, 0).unwrap(), 0);
        assert_eq!(cache.length(1, 1).unwrap(), 300);
    }
}

#[test]
fn batches_equal_one_call_per_sequence() {
    for preset in ["qjl", "ott"] {
        let config = Config::preset(preset, 2, 8, 4, 32).unwrap().outlier_skip_layers(0);
        let (mut batched, mut single) = (Cache::new(&config).unwrap(), Cache::new(&config).unwrap());
        let (kv, q) = (batched.shape().kv_token_len(), batched.shape().q_token_len());
        let seqs = [3u32, 9, 4];
        let mut rng = Rng(11);
        for step in 0..200 {
            let keys = rng.normals(seqs.len() * kv);
            let values = rng.normals(seqs.len() * kv);
            let layer = step % 2;
            batched.append_batch(layer, &seqs, &keys, &values).unwrap();
            for (i, &seq) in seqs.iter().enumerate() {
                single
                    .append(layer, seq, &keys[i * kv..][..kv], &values[i * kv..][..kv])
                    .unwrap();
            }
        }
        // Ids may repeat in attend_batch.
        let attend_seqs = [4u32, 3, 4];
        let queries = rng.normals(attend_seqs.len() * q);
        let out = batched.attend_batch(1, &attend_seqs, &queries, Some(0.2)).unwrap();
        for (i, &seq) in attend_seqs.iter().enumerate() {
            let one = single.attend(1, seq, &queries[i * q..][..q], Some(0.2)).unwrap();
            assert_eq!(&out[i * q..][..q], &one[..], "{preset}: seq {seq}");
        }
        assert_eq!(stored_bytes(&batched), stored_bytes(&single), "{preset}");
    }
}

#[test]
fn failed_batch_changes_no_sequence() {
    let mut cache = Cache::new(&Config::preset("qjl", 1, 4, 2, 32).unwrap()).unwrap();
    let kv = cache.shape().kv_token_len();
    cache
        .append_batch(0, &[1, 2], &vec![0.5; 2 * kv], &vec![0.5; 2 * kv])
        .unwrap();
    let before = cache.stats().unwrap();
    assert_invalid(
        cache.append_batch(0, &[1, 2, 1], &vec![0.5; 3 * kv], &vec![0.5; 3 * kv]),
        "seqs",
    );
    let mut bad = vec![0.5; 2 * kv];
    bad[kv + 3] = f32::NAN; // second sequence's key
    assert_invalid(cache.append_batch(0, &[1, 2], &bad, &vec![0.5; 2 * kv]), "keys");
    assert_eq!((cache.length(0, 1).unwrap(), cache.length(0, 2).unwrap()), (1, 1));
    assert_eq!(cache.stats().unwrap(), before);
}

/// The same cache in fp16 and bf16: stored and computed as the C tests expect, output in
/// the cache dtype.
fn check_half_dtype<T: Element>(dtype: Dtype, tolerance: f64) {
    let shape = shape(1, 8, 2, 64);
    let config = Config::preset("exact", 1, 8, 2, 64).unwrap().dtype(dtype);
    let mut cache = Cache::new(&config).unwrap();
    assert_eq!(cache.dtype(), dtype);
    let mut rng = Rng(21);
    let length = 80;
    let round = |v: Vec<f32>| v.into_iter().map(T::from_f32).collect::<Vec<T>>();
    let widen = |v: &[T]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let keys = round(rng.normals(length * shape.kv_token_len()));
    let values = round(rng.normals(length * shape.kv_token_len()));
    let queries = round(rng.normals(shape.q_token_len()));
    cache.append(0, 0, &keys, &values).unwrap();
    let out: Vec<T> = cache.attend(0, 0, &queries, None).unwrap();
    let want = reference_attend(shape, &widen(&keys), &widen(&values), &widen(&queries), 1.0 / 8.0);
    let diff = max_relative_diff(&widen(&out), &want);
    assert!(diff < tolerance, "{dtype}: {diff}");
    // 16-bit inputs are stored losslessly by the exact preset: scores are exact products.
    let scores = cache.scores(0, 0, &queries).unwrap();
    let want = dot(&widen(&queries)[..64], &widen(&keys)[..64]);
    assert!(
        (f64::from(scores[0]) - want).abs() < 1e-4 * (1.0 + want.abs()),
        "{dtype}"
    );
}

#[test]
fn f16_and_bf16_tensors() {
    check_half_dtype::<F16>(Dtype::F16, 2e-3);
    check_half_dtype::<Bf16>(Dtype::Bf16, 1.6e-2);
}

#[test]
fn f16_conversion_is_exact_and_rounds_to_nearest_even() {
    for bits in 0..=u16::MAX {
        let h = F16(bits);
        if h.to_f32().is_nan() {
            assert!(F16::from_f32(h.to_f32()).to_f32().is_nan());
        } else {
            assert_eq!(F16::from_f32(h.to_f32()), h, "{bits:#06x}");
        }
    }
    assert_eq!(F16::from_f32(1.0 + 2f32.powi(-11)), F16(0x3c00)); // tie -> even
    assert_eq!(F16::from_f32(1.0 + 3.0 * 2f32.powi(-11)), F16(0x3c02)); // tie -> even (up)
    assert_eq!(F16::from_f32(2f32.powi(-25)), F16(0)); // half the smallest subnormal -> 0
    assert_eq!(F16::from_f32(1.5 * 2f32.powi(-25)), F16(1));
    assert_eq!(F16::from_f32(65520.0), F16(0x7c00)); // rounds past 65504 -> inf
    assert_eq!(F16::from_f32(-65504.0), F16(0xfbff));
    for bits in [0u16, 0x3f80, 0x0001, 0x7f7f, 0x8000] {
        assert_eq!(Bf16::from_f32(Bf16(bits).to_f32()), Bf16(bits));
    }
    assert_eq!(Bf16::from_f32(1.0 + 2f32.powi(-8)), Bf16(0x3f80)); // tie -> even
    assert_eq!(Bf16::from_f32(1.0 + 3.0 * 2f32.powi(-8)), Bf16(0x3f82));
}

#[test]
fn sketches_of_a_cache() {
    let config = Config::preset("qjl", 3, 4, 2, 64).unwrap().seed(42);
    let cache = Cache::new(&config).unwrap();
    // "qjl": m = 2d = 128 rows, m_out = d/2 = 32, so max(m, m_out) = 128 rows.
    let layer0 = cache.sketch(0).unwrap();
    assert_eq!((layer0.rows(), layer0.cols()), (128, 64));
    let standalone = qjlkv::Sketch::new(64, 128, 42, true).unwrap();
    assert_eq!(layer0.matrix(), standalone.matrix());
    assert_ne!(
        cache.sketch(1).unwrap().matrix(),
        layer0.matrix(),
        "layers use independent streams"
    );
    let gaussian = qjlkv::Sketch::new(64, 128, 42, false).unwrap();
    assert_ne!(gaussian.matrix(), standalone.matrix());

    // Orthogonalized: each block of d rows is orthogonal with row norm sqrt(d).
    let m = standalone.matrix();
    for block in 0..2 {
        for i in 0..64 {
            for j in 0..64 {
                let (a, b) = (block * 64 + i, block * 64 + j);
                let product = dot(&m[a * 64..][..64], &m[b * 64..][..64]);
                let want = if i == j { 64.0 } else { 0.0 };
                assert!((product - want).abs() < 1e-3, "rows {a}, {b}: {product}");
            }
        }
    }
}

#[test]
fn q2_preset_has_mixed_keys_of_key_token_bits() {
    for head_dim in [8u32, 64, 128, 256] {
        let config = Config::preset("q2", 1, 4, 2, head_dim).unwrap();
        assert_eq!(config.get_key_method(), Some(KeyMethod::Mixed));
        // 2.125 bits a channel in whole bytes: 8 * ceil(17 * d / 64), in every preset.
        let bits = 8 * (17 * head_dim).div_ceil(64);
        assert_eq!(config.get_key_token_bits(), bits, "head_dim {head_dim}");
        let kivi = Config::preset("kivi", 1, 4, 2, head_dim).unwrap();
        assert_eq!(kivi.get_key_token_bits(), bits);
        kivi.key_method(KeyMethod::Mixed).validate().unwrap();
        let cache = Cache::new(&config.key_token_bits(4 * head_dim)).unwrap();
        assert_eq!(cache.config().get_key_token_bits(), 4 * head_dim);
        assert_eq!(cache.config().get_key_method(), Some(KeyMethod::Mixed));
    }
}

#[test]
fn key_token_bits_sizes_the_stored_keys() {
    // Per block and kv head the codes take B * key_token_bits / 8 bytes.
    let mut stored = Vec::new();
    for bits in [8u32, 136, 256] {
        let config = Config::preset("q2", 1, 4, 2, 64)
            .unwrap()
            .block_tokens(32)
            .residual_tokens(8)
            .sink_tokens(0)
            .key_token_bits(bits);
        let mut cache = Cache::new(&config).unwrap();
        let keys = Rng(3).normals((3 * 32 + 8) * 2 * 64);
        cache.append(0, 0, &keys, &keys).unwrap();
        stored.push(cache.stats().unwrap().bytes_keys_quantized);
    }
    assert_eq!(stored[1] - stored[0], 3 * 2 * 32 * (136 - 8) / 8);
    assert_eq!(stored[2] - stored[1], 3 * 2 * 32 * (256 - 136) / 8);
}
