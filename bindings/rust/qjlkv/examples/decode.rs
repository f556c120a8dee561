//! A decode loop over one Llama-shaped layer (32 query heads, 8 kv heads, d = 128, fp16):
//! tokens are appended one at a time up to a few thousand, and every few steps the new
//! token's query attends over the whole cache. Prints, per preset, the memory the cache
//! takes (bits per number, compression against fp16) and the attention error against the
//! "exact" preset (16-bit keys and values, no quantization).
//!
//! Synthetic keys carry a few outlier channels per kv head (large, consistent offsets), as
//! the keys of deeper layers of real models do; that is what QJL's outlier sketch and OTT's
//! tracing are for. Two kinds of query are measured: a "diffuse" one (random, so attention
//! spreads over thousands of tokens and the output is a small average that any score noise
//! moves: the hardest case) and a "retrieval" one (a noisy copy of an earlier key's ordinary
//! channels, so attention must find that token among thousands).
//!
//!     cargo run --release --example decode [-- TOKENS]

use qjlkv::{Cache, Config, Dtype, Error, F16};

const Q_HEADS: u32 = 32;
const KV_HEADS: u32 = 8;
const HEAD_DIM: u32 = 128;
const OUTLIER_CHANNELS: usize = 4;
const MEASURE_EVERY: usize = 128;

fn main() -> Result<(), Error> {
    let tokens: usize = std::env::args()
        .nth(1)
        .map_or(4096, |arg| arg.parse().expect("TOKENS is a number"));
    // (label, preset, value bits): the "/v16" rows keep values exact, isolating the key error.
    let presets = [
        ("exact", "exact", None),
        ("q2", "q2", None),
        ("q3", "q3", None),
        ("q4", "q4", None),
        ("qjl", "qjl", None),
        ("kivi", "kivi", None),
        ("ott", "ott", None),
        ("qjl/v16", "qjl", Some(16)),
        ("kivi/v16", "kivi", Some(16)),
    ];
    let mut caches = presets
        .iter()
        .map(|&(_, preset, value_bits)| {
            let mut config = Config::preset(preset, 1, Q_HEADS, KV_HEADS, HEAD_DIM)?.dtype(Dtype::F16);
            if preset == "ott" {
                // The one layer here plays a deep layer; OTT leaves the first two untraced.
                config = config.outlier_skip_layers(0);
            }
            if let Some(bits) = value_bits {
                config = config.value_bits(bits);
            }
            Cache::new(&config)
        })
        .collect::<Result<Vec<_>, Error>>()?;

    let kv_len = (KV_HEADS * HEAD_DIM) as usize;
    let q_len = (Q_HEADS * HEAD_DIM) as usize;
    let mut rng = Rng(0x5eed);
    let outliers = OutlierChannels::new(&mut rng);
    // errors[preset][query kind]: relative errors of the attention output.
    let mut errors = vec![[Vec::new(), Vec::new()]; presets.len()];
    let mut all_keys: Vec<F16> = Vec::with_capacity(tokens * kv_len);
    let mut values = vec![F16(0); kv_len];

    for step in 1..=tokens {
        let start = all_keys.len();
        all_keys.resize(start + kv_len, F16(0));
        outliers.fill_keys(&mut rng, &mut all_keys[start..]);
        values.iter_mut().for_each(|v| *v = F16::from_f32(rng.normal()));
        for cache in &mut caches {
            cache.append(0, 0, &all_keys[start..], &values)?;
        }
        if step % MEASURE_EVERY != 0 {
            continue;
        }
        let diffuse: Vec<F16> = (0..q_len).map(|_| F16::from_f32(rng.normal())).collect();
        let retrieval = retrieval_query(&mut rng, &outliers, &all_keys, step);
        for (kind, query) in [diffuse, retrieval].iter().enumerate() {
            let exact = caches[0].attend(0, 0, query, None)?;
            for (cache, errors) in caches.iter_mut().zip(&mut errors) {
                let out = cache.attend(0, 0, query, None)?;
                errors[kind].push(relative_error(&out, &exact));
            }
        }
    }

    println!(
        "decode of {tokens} tokens, 1 layer, {Q_HEADS} q heads, {KV_HEADS} kv heads, d = {HEAD_DIM}, fp16; \
         error measured every {MEASURE_EVERY} tokens against \"exact\""
    );
    println!("relative error of the attention output ||o - o_exact|| / ||o_exact||, mean (max):");
    println!(
        "{:<9} {:>12} {:>9} {:>12} {:>18} {:>18}",
        "preset", "bits/number", "vs fp16", "bytes used", "diffuse query", "retrieval query"
    );
    for ((&(label, _, _), cache), errors) in presets.iter().zip(&caches).zip(&errors) {
        let stats = cache.stats()?;
        let summary = |e: &[f64]| {
            let mean = e.iter().sum::<f64>() / e.len().max(1) as f64;
            format!("{mean:.4} ({:.4})", e.iter().copied().fold(0.0, f64::max))
        };
        println!(
            "{:<9} {:>12.3} {:>8.2}x {:>12} {:>18} {:>18}",
            label,
            stats.bits_per_number,
            stats.compression_vs_fp16(),
            stats.bytes_used,
            summary(&errors[0]),
            summary(&errors[1])
        );
    }
    Ok(())
}

/// Per query head: the ordinary channels of an earlier key of its kv head (chosen at random)
/// plus unit noise; the outlier channels random like a diffuse query's (they carry no
/// token-specific content here).
fn retrieval_query(rng: &mut Rng, outliers: &OutlierChannels, all_keys: &[F16], tokens: usize) -> Vec<F16> {
    let (d, group) = (HEAD_DIM as usize, (Q_HEADS / KV_HEADS) as usize);
    let mut query = Vec::with_capacity((Q_HEADS * HEAD_DIM) as usize);
    for head in 0..Q_HEADS as usize {
        let kv_head = head / group;
        let token = (rng.next() % tokens as u64) as usize;
        let key = &all_keys[(token * KV_HEADS as usize + kv_head) * d..][..d];
        for (channel, k) in key.iter().enumerate() {
            let content = if outliers.channels[kv_head].contains(&channel) {
                0.0
            } else {
                k.to_f32()
            };
            query.push(F16::from_f32(content + rng.normal()));
        }
    }
    query
}

/// ||out - exact|| / ||exact|| over all heads.
fn relative_error(out: &[F16], exact: &[F16]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (o, e) in out.iter().zip(exact) {
        let (o, e) = (f64::from(o.to_f32()), f64::from(e.to_f32()));
        diff += (o - e) * (o - e);
        norm += e * e;
    }
    (diff / norm).sqrt()
}

/// Per kv head, a few channels with a large fixed offset and spread.
struct OutlierChannels {
    channels: Vec<[usize; OUTLIER_CHANNELS]>,
    offsets: Vec<[f32; OUTLIER_CHANNELS]>,
}

impl OutlierChannels {
    fn new(rng: &mut Rng) -> OutlierChannels {
        let mut channels = Vec::new();
        let mut offsets = Vec::new();
        for _ in 0..KV_HEADS {
            let mut chosen = [0; OUTLIER_CHANNELS];
            let mut offset = [0.0; OUTLIER_CHANNELS];
            for i in 0..OUTLIER_CHANNELS {
                chosen[i] = loop {
                    let c = (rng.next() % u64::from(HEAD_DIM)) as usize;
                    if !chosen[..i].contains(&c) {
                        break c;
                    }
                };
                offset[i] = (8.0 + 8.0 * rng.uniform() as f32) * if rng.next() & 1 == 0 { 1.0 } else { -1.0 };
            }
            channels.push(chosen);
            offsets.push(offset);
        }
        OutlierChannels { channels, offsets }
    }

    fn fill_keys(&self, rng: &mut Rng, keys: &mut [F16]) {
        for (head, row) in keys.chunks_mut(HEAD_DIM as usize).enumerate() {
            let mut key: Vec<f32> = (0..HEAD_DIM).map(|_| rng.normal()).collect();
            for (&c, &offset) in self.channels[head].iter().zip(&self.offsets[head]) {
                key[c] = offset + 2.0 * key[c];
            }
            row.iter_mut().zip(&key).for_each(|(k, &x)| *k = F16::from_f32(x));
        }
    }
}

/// SplitMix64: small, seedable, good enough for synthetic data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
}
