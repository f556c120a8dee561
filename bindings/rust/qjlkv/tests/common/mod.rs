//! Shared helpers: a seeded generator and an f64 reference of the cache's attention.
#![allow(dead_code)] // each test file uses a different subset

use qjlkv::{Error, Shape, F16};

/// SplitMix64 with Box-Muller normals.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    pub fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    pub fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }

    pub fn normals(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal()).collect()
    }
}

/// Positions of a sequence of `length` tokens that sit in quantized blocks (DESIGN.md:
/// floor((T - R) / B) blocks once T >= R + B).
pub fn quantized_positions(length: usize, block_tokens: usize, residual_tokens: usize) -> usize {
    if length >= residual_tokens + block_tokens {
        (length - residual_tokens) / block_tokens * block_tokens
    } else {
        0
    }
}

/// What the "exact" preset stores for f32 input: fp16 in quantized blocks, f32 in the tail.
pub fn exact_preset_view(data: &[f32], row_len: usize, quantized: usize) -> Vec<f32> {
    data.iter()
        .enumerate()
        .map(|(i, &x)| {
            if i / row_len < quantized {
                F16::from_f32(x).to_f32()
            } else {
                x
            }
        })
        .collect()
}

/// Causal multi-query attention in f64: the last `n_queries` of `length` positions, GQA
/// mapping h -> h / (Hq / Hkv). keys/values [length][Hkv][d], queries [n][Hq][d].
pub fn reference_attend(shape: Shape, keys: &[f32], values: &[f32], queries: &[f32], scale: f64) -> Vec<f64> {
    reference_attend_variant(shape, keys, values, queries, scale, 0.0, None)
}

/// [`reference_attend`] with a layer's attention variant (qjlkv_cache_set_layer_attention):
/// logits s become c * tanh(s / c) for `softcap` c > 0, and exp(sinks[h]) joins head h's
/// softmax denominator.
pub fn reference_attend_variant(
    shape: Shape,
    keys: &[f32],
    values: &[f32],
    queries: &[f32],
    scale: f64,
    softcap: f64,
    sinks: Option<&[f32]>,
) -> Vec<f64> {
    let (hq, hkv, d) = (
        shape.num_q_heads as usize,
        shape.num_kv_heads as usize,
        shape.head_dim as usize,
    );
    let length = keys.len() / (hkv * d);
    let n_queries = queries.len() / (hq * d);
    let mut out = vec![0.0; queries.len()];
    for i in 0..n_queries {
        let position = length - n_queries + i;
        for h in 0..hq {
            let kv = h / (hq / hkv);
            let q = &queries[(i * hq + h) * d..][..d];
            let logits: Vec<f64> = (0..=position)
                .map(|t| dot(q, &keys[(t * hkv + kv) * d..][..d]) * scale)
                .map(|s| {
                    if softcap > 0.0 {
                        softcap * (s / softcap).tanh()
                    } else {
                        s
                    }
                })
                .collect();
            let sink = sinks.map(|s| f64::from(s[h]));
            let max = logits.iter().copied().fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
            let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let total: f64 = weights.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
            for (t, w) in weights.iter().enumerate() {
                let v = &values[(t * hkv + kv) * d..][..d];
                for (o, &x) in out[(i * hq + h) * d..][..d].iter_mut().zip(v) {
                    *o += w / total * f64::from(x);
                }
            }
        }
    }
    out
}

pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum()
}

pub fn norm(a: &[f32]) -> f64 {
    dot(a, a).sqrt()
}

/// Largest |got - want| over the largest |want| (the output's own scale).
pub fn max_relative_diff(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let diff = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (&g, w)| m.max((f64::from(g) - w).abs()));
    diff / scale
}

/// ||got - want|| / ||want||.
pub fn relative_l2(got: &[f32], want: &[f32]) -> f64 {
    let diff: Vec<f32> = got.iter().zip(want).map(|(g, w)| g - w).collect();
    norm(&diff) / norm(want)
}

/// Asserts a library or argument-check error: its status is InvalidArgument and its message
/// names `argument`.
#[track_caller]
pub fn assert_invalid<T: std::fmt::Debug>(result: Result<T, Error>, argument: &str) -> Error {
    let err = result.expect_err("the call must fail");
    assert_eq!(err.status(), qjlkv::Status::InvalidArgument, "status of {err}");
    assert!(
        err.message().contains(argument),
        "message {:?} must name {argument:?}",
        err.message()
    );
    err
}
