//! Attention variants of a layer (`Cache::set_layer_attention`): soft-capped logits and sink
//! logits against the f64 reference over what the exact preset stores, per layer, reversible,
//! and the argument checks.

mod common;

use common::*;
use qjlkv::{Cache, Config, Shape};

const SHAPE: Shape = Shape {
    num_layers: 2,
    num_q_heads: 8,
    num_kv_heads: 2,
    head_dim: 32,
};
const LENGTH: usize = 90; // two quantized (fp16) blocks of 32 and an f32 tail

struct Filled {
    cache: Cache,
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// A cache of `preset` whose two layers hold the same LENGTH tokens in sequence 3.
fn filled(preset: &str) -> Filled {
    let config = Config::preset(
        preset,
        SHAPE.num_layers,
        SHAPE.num_q_heads,
        SHAPE.num_kv_heads,
        SHAPE.head_dim,
    )
    .unwrap();
    let mut cache = Cache::new(&config).unwrap();
    let mut rng = Rng(41);
    // Logits of a few units, so that a cap of a few units bites.
    let keys: Vec<f32> = rng
        .normals(LENGTH * SHAPE.kv_token_len())
        .iter()
        .map(|x| 2.0 * x)
        .collect();
    let values = rng.normals(LENGTH * SHAPE.kv_token_len());
    for layer in 0..SHAPE.num_layers {
        cache.append(layer, 3, &keys, &values).unwrap();
    }
    Filled { cache, keys, values }
}

fn sinks() -> Vec<f32> {
    // From negligible to dominant against logits of a few units.
    (0..SHAPE.num_q_heads).map(|h| -2.0 + 0.7 * h as f32).collect()
}

#[test]
fn softcap_and_sinks_match_the_reference() {
    let Filled {
        mut cache,
        keys,
        values,
    } = filled("exact");
    let raw = cache.config().as_raw();
    let quantized = quantized_positions(LENGTH, raw.block_tokens as usize, raw.residual_tokens as usize);
    let kv = SHAPE.kv_token_len();
    let (stored_keys, stored_values) = (
        exact_preset_view(&keys, kv, quantized),
        exact_preset_view(&values, kv, quantized),
    );
    let sinks = sinks();
    let mut rng = Rng(7);
    for (softcap, with_sinks) in [(0.0f32, true), (5.0, false), (2.5, true), (0.0, false)] {
        let sink_logits = with_sinks.then_some(sinks.as_slice());
        cache.set_layer_attention(1, softcap, sink_logits, 0).unwrap();
        for n_queries in [1, 4] {
            let queries = rng.normals(n_queries * SHAPE.q_token_len());
            let scale = 0.3;
            let out = cache.attend(1, 3, &queries, Some(scale)).unwrap();
            let want = reference_attend_variant(
                SHAPE,
                &stored_keys,
                &stored_values,
                &queries,
                f64::from(scale),
                f64::from(softcap),
                sink_logits,
            );
            let diff = max_relative_diff(&out, &want);
            assert!(
                diff < 1e-4,
                "softcap {softcap}, sinks {with_sinks}, {n_queries} queries: off by {diff} (relative)"
            );
            if n_queries == 1 {
                let twice = [queries.as_slice(), queries.as_slice()].concat();
                let batch = cache.attend_batch(1, &[3, 3], &twice, Some(scale)).unwrap();
                assert_eq!(batch, [out.as_slice(), out.as_slice()].concat(), "attend_batch");
            }
        }
    }
}

#[test]
fn the_variant_is_per_layer_and_a_zeroed_one_is_plain() {
    // q3: compressed keys and values; each layer is compared with its own plain output.
    let Filled { mut cache, .. } = filled("q3");
    let queries = Rng(9).normals(SHAPE.q_token_len());
    let plain = [
        cache.attend(0, 3, &queries, None).unwrap(),
        cache.attend(1, 3, &queries, None).unwrap(),
    ];
    let scores = cache.scores(0, 3, &queries).unwrap();
    cache.set_layer_attention(0, 1.0, Some(&sinks()), 0).unwrap();
    assert_ne!(cache.attend(0, 3, &queries, None).unwrap(), plain[0]);
    assert_eq!(
        cache.attend(1, 3, &queries, None).unwrap(),
        plain[1],
        "layer 1 is untouched"
    );
    assert_eq!(
        cache.scores(0, 3, &queries).unwrap(),
        scores,
        "scores stay the raw <q, k>"
    );
    cache.set_layer_attention(0, 0.0, None, 0).unwrap();
    assert_eq!(
        cache.attend(0, 3, &queries, None).unwrap(),
        plain[0],
        "a zeroed variant is plain"
    );
}

#[test]
fn sinks_take_weight_from_the_values() {
    // A dominant sink in every head: the weights of the positions sum to about e^-20, so the
    // output all but vanishes.
    let Filled { mut cache, .. } = filled("q2");
    let queries = Rng(11).normals(SHAPE.q_token_len());
    let plain = cache.attend(0, 3, &queries, None).unwrap();
    let big = vec![40.0f32; SHAPE.num_q_heads as usize];
    cache.set_layer_attention(0, 0.0, Some(&big), 0).unwrap();
    let sunk = cache.attend(0, 3, &queries, None).unwrap();
    assert!(norm(&sunk) < 1e-6 * norm(&plain), "{} vs {}", norm(&sunk), norm(&plain));
}

#[test]
fn bad_arguments_name_the_field_and_change_nothing() {
    let Filled { mut cache, .. } = filled("kivi");
    let queries = Rng(13).normals(SHAPE.q_token_len());
    let plain = cache.attend(0, 3, &queries, None).unwrap();
    let heads = SHAPE.num_q_heads as usize;

    for len in [0, heads - 1, heads + 1] {
        let err = assert_invalid(cache.set_layer_attention(0, 1.0, Some(&vec![0.0; len]), 0), "sink_logits");
        assert!(err.message().contains(&format!("num_q_heads = {heads}")), "{err}");
    }
    let mut nan = vec![0.0f32; heads];
    nan[5] = f32::NAN;
    let err = assert_invalid(cache.set_layer_attention(0, 1.0, Some(&nan), 0), "sink_logits[5]");
    assert!(err.message().contains("finite"), "{err}");
    for cap in [-1.0, f32::NAN, f32::INFINITY] {
        assert_invalid(cache.set_layer_attention(0, cap, None, 0), "logit_softcap");
    }
    assert_invalid(cache.set_layer_attention(SHAPE.num_layers, 1.0, None, 0), "layer");
    assert_eq!(
        cache.attend(0, 3, &queries, None).unwrap(),
        plain,
        "refused variants leave the layer plain"
    );
}

#[test]
fn a_window_frees_blocks_and_refuses_freed_positions() {
    let config = Config::preset(
        "q3",
        SHAPE.num_layers,
        SHAPE.num_q_heads,
        SHAPE.num_kv_heads,
        SHAPE.head_dim,
    )
    .unwrap();
    let mut cache = Cache::new(&config).unwrap();
    let window = 64;
    cache.set_layer_attention(0, 0.0, None, window).unwrap();
    let mut rng = Rng(7);
    let chunk = 50;
    let mut used = Vec::new();
    for _ in 0..100 {
        let keys = rng.normals(chunk * SHAPE.kv_token_len());
        let values = rng.normals(chunk * SHAPE.kv_token_len());
        cache.append(0, 3, &keys, &values).unwrap();
        used.push(cache.stats().unwrap().bytes_used);
    }
    // 5,000 positions appended; the window, the rollback copies, the tail and a chunk are held.
    assert!(cache.stats().unwrap().tokens < 1000, "{:?}", cache.stats().unwrap());
    let middle = *used[40..70].iter().max().unwrap();
    assert!(*used[70..].iter().max().unwrap() <= middle, "bytes keep growing: {used:?}");
    cache.attend(0, 3, &rng.normals(SHAPE.q_token_len()), None).unwrap();
    let too_many = 3 * window as usize + 256;
    assert_invalid(
        cache.attend(0, 3, &rng.normals(too_many * SHAPE.q_token_len()), None),
        "n_queries",
    );
}
