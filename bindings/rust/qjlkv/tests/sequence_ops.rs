//! Sequence operations through the safe API (qjlkv.h, "Sequence operations"): exact rollback
//! by truncate, copy-on-write fork, the memory budget and its byte predictions, and the
//! refusals, each checked by export bytes (the stream holds every stored byte).

mod common;

use std::io::{self, Cursor};

use common::*;
use qjlkv::{Cache, Config, Error, SequenceBytes, Status};

const LAYERS: u32 = 2;
const PRESETS: [&str; 7] = ["q2", "q3", "q4", "qjl", "kivi", "ott", "exact"];

fn config(preset: &str) -> Config {
    Config::preset(preset, LAYERS, 4, 2, 64)
        .expect("valid shape")
        .num_threads(1)
}

/// `n` random tokens (keys, values); every ninth has small keys, so that OTT traces some.
fn tokens(rng: &mut Rng, n: usize) -> (Vec<f32>, Vec<f32>) {
    let row = 2 * 64;
    let mut keys = rng.normals(n * row);
    for (t, token) in keys.chunks_mut(row).enumerate() {
        if rng.next().is_multiple_of(9) || t % 9 == 4 {
            token.iter_mut().for_each(|x| *x *= 0.05);
        }
    }
    let values = rng.normals(n * row);
    (keys, values)
}

/// Appends tokens `[first, first + n)` of `data` to every layer of `seq`, in pieces of `piece`.
fn feed(cache: &mut Cache, seq: u32, data: &(Vec<f32>, Vec<f32>), first: usize, n: usize, piece: usize) {
    let row = cache.shape().kv_token_len();
    let mut done = 0;
    while done < n {
        let m = piece.min(n - done);
        let range = (first + done) * row..(first + done + m) * row;
        for layer in 0..LAYERS {
            cache
                .append(layer, seq, &data.0[range.clone()], &data.1[range.clone()])
                .unwrap_or_else(|e| panic!("append: {e}"));
        }
        done += m;
    }
}

fn exported(cache: &Cache, seq: u32) -> Vec<u8> {
    cache.export(seq, 0..LAYERS).unwrap_or_else(|e| panic!("export: {e}"))
}

fn attended(cache: &mut Cache, seq: u32, query: &[f32]) -> Vec<u32> {
    (0..LAYERS)
        .flat_map(|layer| cache.attend(layer, seq, query, None).expect("attend"))
        .map(f32::to_bits)
        .collect()
}

#[track_caller]
fn assert_status<T: std::fmt::Debug>(result: Result<T, Error>, status: Status, argument: &str) -> Error {
    let err = result.expect_err("the call must fail");
    assert_eq!(err.status(), status, "status of {err}");
    assert!(
        err.message().contains(argument),
        "message {:?} must name {argument:?}",
        err.message()
    );
    err
}

/// Speculative decoding: append k draft tokens, truncate back to n, and the sequence is bit for
/// bit the one that never saw them (export now, export and attention after a continuation), for
/// k up to rollback_tokens and n on either side of the block boundaries.
#[test]
fn rollback_by_up_to_rollback_tokens_is_exact() {
    for preset in PRESETS {
        let cfg = config(preset);
        let depth = cfg.get_rollback_tokens() as usize;
        assert_eq!(depth, 32, "{preset}: the documented default depth");
        let (b, r) = (
            cfg.as_raw().block_tokens as usize,
            cfg.as_raw().residual_tokens as usize,
        );
        let mut rng = Rng(11);
        for n in [5, b + r - 1, b + r, 2 * b + r + 3, 3 * b - 1] {
            let prefix = tokens(&mut rng, n);
            let continuation = tokens(&mut rng, b + 5);
            let query = rng.normals(cache_q_len());
            let mut reference = Cache::new(&cfg).expect("cache");
            feed(&mut reference, 0, &prefix, 0, n, n);
            let at_n = exported(&reference, 0);
            feed(&mut reference, 0, &continuation, 0, b + 5, 3);
            for k in [1, 7, depth] {
                let draft = tokens(&mut rng, k);
                let mut cache = Cache::new(&cfg).expect("cache");
                feed(&mut cache, 0, &prefix, 0, n, n);
                feed(&mut cache, 0, &draft, 0, k, 1 + k / 2);
                cache.truncate(0, n as u64).unwrap();
                let case = format!("{preset}: n {n}, k {k}");
                assert_eq!(cache.length(0, 0).unwrap(), n as u64, "{case}");
                assert_eq!(exported(&cache, 0), at_n, "{case}: after the truncate");
                feed(&mut cache, 0, &continuation, 0, b + 5, 3);
                assert_eq!(
                    exported(&cache, 0),
                    exported(&reference, 0),
                    "{case}: after the continuation"
                );
                assert_eq!(
                    attended(&mut cache, 0, &query),
                    attended(&mut reference, 0, &query),
                    "{case}"
                );
            }
        }
    }
}

fn cache_q_len() -> usize {
    4 * 64
}

#[test]
fn truncate_to_zero_empties_and_deep_truncates_keep_a_prefix() {
    let cfg = config("q3");
    let mut rng = Rng(3);
    let data = tokens(&mut rng, 300);
    let mut cache = Cache::new(&cfg).unwrap();
    feed(&mut cache, 4, &data, 0, 300, 300);
    // Deeper than the rollback depth: allowed, keeps the first positions (reconstructed).
    cache.truncate(4, 100).unwrap();
    assert_eq!(cache.length(1, 4).unwrap(), 100);
    let out = cache.attend(1, 4, &rng.normals(cache_q_len()), None).unwrap();
    assert!(out.iter().all(|x| x.is_finite()));
    cache.truncate(4, 0).unwrap();
    assert_eq!(cache.length(0, 4).unwrap(), 0);
    assert_eq!(cache.stats().unwrap().bytes_used, 0);
    assert_eq!(cache.sequence_bytes(4).unwrap(), SequenceBytes::default());
}

/// Prefix sharing: a fork exports as its source, shares its blocks (counted once), and the two
/// decode on independently, each exactly as a fresh sequence fed the same tokens.
#[test]
fn forks_share_blocks_and_decode_independently() {
    for preset in ["q3", "qjl", "ott", "exact"] {
        let cfg = config(preset);
        let b = cfg.as_raw().block_tokens as usize;
        let length = 4 * b + 21;
        let mut rng = Rng(5);
        let prompt = tokens(&mut rng, length);
        let (a, bb) = (tokens(&mut rng, 2 * b + 3), tokens(&mut rng, b + 9));
        let mut cache = Cache::new(&cfg).unwrap();
        feed(&mut cache, 0, &prompt, 0, length, length);
        let source = exported(&cache, 0);
        let used_before = cache.stats().unwrap().bytes_used;

        cache.fork(0, 1, length as u64).unwrap();
        assert_eq!(exported(&cache, 1), source, "{preset}");
        let stats = cache.stats().unwrap();
        assert!(stats.bytes_shared > 0, "{preset}");
        let held = cache.sequence_bytes(1).unwrap();
        assert!(held.shared > 0 && held.shared <= held.bytes, "{preset}: {held:?}");
        assert_eq!(cache.sequence_bytes(0).unwrap().shared, held.shared, "{preset}");
        // A fork adds only what it does not share: its copies of the exact rows.
        assert_eq!(stats.bytes_used - used_before, held.exclusive(), "{preset}");

        feed(&mut cache, 1, &a, 0, a.0.len() / 128, 1);
        assert_eq!(
            exported(&cache, 0),
            source,
            "{preset}: the source after the fork's appends"
        );
        feed(&mut cache, 0, &bb, 0, bb.0.len() / 128, 3);
        let mut fresh = Cache::new(&cfg).unwrap();
        feed(&mut fresh, 1, &prompt, 0, length, length);
        feed(&mut fresh, 1, &a, 0, a.0.len() / 128, 1);
        feed(&mut fresh, 0, &prompt, 0, length, length);
        feed(&mut fresh, 0, &bb, 0, bb.0.len() / 128, 3);
        let query = rng.normals(cache_q_len());
        for seq in [0, 1] {
            assert_eq!(exported(&cache, seq), exported(&fresh, seq), "{preset}: seq {seq}");
            assert_eq!(
                attended(&mut cache, seq, &query),
                attended(&mut fresh, seq, &query),
                "{preset}"
            );
        }

        // fork(p) is fork(whole) + truncate(p): inside the sinks, the blocks and the tail.
        let whole = cache.length(0, 0).unwrap();
        for p in [1, b as u64 + 2, 3 * b as u64, length as u64 - 1] {
            cache.fork(0, 7, p).unwrap();
            cache.fork(0, 8, whole).unwrap();
            cache.truncate(8, p).unwrap();
            assert_eq!(cache.length(1, 7).unwrap(), p, "{preset}");
            assert_eq!(exported(&cache, 7), exported(&cache, 8), "{preset}: p {p}");
            cache.clear_sequence(7).unwrap();
            cache.clear_sequence(8).unwrap();
        }

        // Clearing the source leaves the fork whole; clearing both frees everything.
        let fork_now = exported(&cache, 1);
        cache.clear_sequence(0).unwrap();
        assert_eq!(exported(&cache, 1), fork_now, "{preset}");
        assert_eq!(cache.sequence_bytes(1).unwrap().shared, 0, "{preset}");
        cache.clear_sequence(1).unwrap();
        let empty = cache.stats().unwrap();
        assert_eq!((empty.bytes_used, empty.bytes_shared), (0, 0), "{preset}");
    }
}

/// Admission control: bytes_needed(seq, n) is exactly what n more tokens in every layer add to
/// bytes_used, through appends in one call or several, forks and truncates.
#[test]
fn bytes_needed_is_the_growth_of_bytes_used() {
    for preset in PRESETS {
        let cfg = config(preset);
        let b = cfg.as_raw().block_tokens as usize;
        let mut cache = Cache::new(&cfg).unwrap();
        let mut rng = Rng(9);
        for step in 0..48u32 {
            let seq = (rng.next() % 3) as u32;
            let n = if step % 7 == 0 {
                2 * b + (rng.next() % b as u64) as usize
            } else {
                1 + (rng.next() % 5) as usize
            };
            let predicted = cache.bytes_needed(seq, n as u32).unwrap();
            let before = cache.stats().unwrap().bytes_used;
            let piece = if step.is_multiple_of(2) { n } else { 3 };
            feed(&mut cache, seq, &tokens(&mut rng, n), 0, n, piece);
            let after = cache.stats().unwrap().bytes_used;
            assert_eq!(
                predicted,
                after.saturating_sub(before),
                "{preset}: step {step}, seq {seq}, n {n}"
            );
            let length = cache.length(0, seq).unwrap();
            if step % 11 == 5 {
                cache.fork(seq, 10 + step, length).unwrap();
            }
            if step % 13 == 8 {
                cache.truncate(seq, length - length.min(4)).unwrap();
            }
        }
        assert_eq!(cache.bytes_needed(77, 0).unwrap(), 0, "{preset}: nothing to append");
    }
}

/// The budget refuses what would exceed it with a status of its own, changing nothing, and
/// freeing memory makes room again.
#[test]
fn the_memory_budget_refuses_without_changing_anything() {
    for preset in ["q3", "kivi", "ott"] {
        let base = config(preset);
        assert_eq!(base.get_memory_budget(), 0, "{preset}: no budget by default");
        let b = base.as_raw().block_tokens as usize;
        let n = 3 * b + 5;
        let row = 2 * 64;
        let mut rng = Rng(21);
        let prompt = tokens(&mut rng, n);
        let mut unlimited = Cache::new(&base).unwrap();
        unlimited.append(0, 0, &prompt.0, &prompt.1).unwrap();
        let one_layer = unlimited.stats().unwrap().bytes_used;
        feed(&mut unlimited, 3, &prompt, 0, n, n);
        let stream = exported(&unlimited, 3);

        let cfg = base.memory_budget(one_layer + 1);
        assert_eq!(cfg.get_memory_budget(), one_layer + 1);
        let mut tight = Cache::new(&cfg).unwrap();
        assert_eq!(tight.config().get_memory_budget(), one_layer + 1);
        assert!(tight.bytes_needed(0, n as u32).unwrap() > one_layer + 1, "{preset}");
        tight.append(0, 0, &prompt.0, &prompt.1).unwrap();
        let before = exported(&tight, 0);
        let stats_before = tight.stats().unwrap();
        assert_eq!(stats_before.bytes_used, one_layer, "{preset}");

        let refused = [
            ("append", tight.append(1, 0, &prompt.0, &prompt.1)),
            ("fork", tight.fork(0, 1, 5)),
            (
                "append_batch",
                tight.append_batch(0, &[0, 5], &prompt.0[..2 * row], &prompt.1[..2 * row]),
            ),
            ("import", tight.import(2, &stream)),
        ];
        for (call, result) in refused {
            let err = assert_status(result, Status::MemoryBudget, "memory_budget");
            assert_ne!(err.status(), Status::OutOfMemory);
            assert!(
                err.to_string().ends_with("(QJLKV_ERROR_MEMORY_BUDGET)"),
                "{preset} {call}: {err}"
            );
        }
        let io_err = tight.import_from(2, &mut Cursor::new(&stream)).unwrap_err();
        assert_eq!(io_err.kind(), io::ErrorKind::QuotaExceeded, "{preset}: {io_err}");
        let inner = io_err
            .get_ref()
            .and_then(|e| e.downcast_ref::<Error>())
            .expect("a qjlkv::Error");
        assert_eq!(inner.status(), Status::MemoryBudget);

        assert_eq!(exported(&tight, 0), before, "{preset}");
        assert_eq!(tight.stats().unwrap(), stats_before, "{preset}");
        for seq in [1, 2, 5] {
            assert_eq!(tight.length(0, seq).unwrap(), 0, "{preset}: seq {seq}");
        }
        assert_eq!(tight.length(1, 0).unwrap(), 0, "{preset}");

        // Truncate is never refused for the budget, and freeing makes room again.
        tight.truncate(0, 0).unwrap();
        assert_eq!(tight.stats().unwrap().bytes_used, 0, "{preset}");
        tight.append(0, 0, &prompt.0, &prompt.1).unwrap();
        assert_eq!(exported(&tight, 0), before, "{preset}");
    }
}

#[test]
fn refusals_name_the_argument_and_change_nothing() {
    let cfg = config("q3");
    let mut rng = Rng(2);
    let mut cache = Cache::new(&cfg).unwrap();
    feed(&mut cache, 0, &tokens(&mut rng, 150), 0, 150, 150);
    feed(&mut cache, 1, &tokens(&mut rng, 20), 0, 20, 20);
    let (s0, s1) = (exported(&cache, 0), exported(&cache, 1));
    let stats = cache.stats().unwrap();

    assert_invalid(cache.truncate(0, 151), "length");
    assert_invalid(cache.fork(0, 1, 10), "dst_seq");
    let same = assert_invalid(cache.fork(0, 0, 10), "dst_seq");
    assert!(same.message().contains("src_seq"), "{}", same.message());
    assert_invalid(cache.fork(0, 2, 151), "length");
    assert_invalid(cache.fork(5, 2, 1), "length");
    assert_invalid(cache.bytes_needed(0, u32::MAX), "n_tokens");
    let err = assert_invalid(cache.truncate(9, 1), "length");
    assert!(err.to_string().ends_with("(QJLKV_ERROR_INVALID_ARGUMENT)"), "{err}");

    assert_eq!(exported(&cache, 0), s0);
    assert_eq!(exported(&cache, 1), s1);
    assert_eq!(cache.stats().unwrap(), stats);
    assert_eq!(cache.length(0, 2).unwrap(), 0);

    // Truncating to the length, or forking nothing, change nothing either.
    cache.truncate(0, 150).unwrap();
    cache.fork(0, 3, 0).unwrap();
    assert_eq!(exported(&cache, 0), s0);
    assert_eq!(cache.length(0, 3).unwrap(), 0);
    assert_eq!(cache.sequence_bytes(3).unwrap(), SequenceBytes::default());
    assert_eq!(cache.sequence_bytes(12345).unwrap(), SequenceBytes::default());
    let held = cache.sequence_bytes(0).unwrap();
    assert!(held.bytes > 0 && held.shared == 0, "{held:?}");
}

#[test]
fn rollback_depth_is_a_checked_config_field() {
    let base = config("kivi");
    let max = qjlkv::sys::QJLKV_MAX_ROLLBACK_TOKENS;
    base.rollback_tokens(max).validate().unwrap();
    let too_deep = base.rollback_tokens(max + 1);
    let invalid = assert_invalid(too_deep.validate(), "rollback_tokens");
    let created = assert_invalid(Cache::new(&too_deep), "rollback_tokens");
    assert_eq!(invalid.message(), created.message());

    // Depth 0 keeps no copies; truncating then keeps the reconstruction (still allowed).
    let mut cache = Cache::new(&base.rollback_tokens(0)).unwrap();
    assert_eq!(cache.config().get_rollback_tokens(), 0);
    let mut rng = Rng(4);
    feed(&mut cache, 0, &tokens(&mut rng, 400), 0, 400, 400);
    assert_eq!(cache.stats().unwrap().bytes_rollback, 0);
    cache.truncate(0, 390).unwrap();
    assert_eq!(cache.length(0, 0).unwrap(), 390);

    let mut default = Cache::new(&base).unwrap();
    feed(&mut default, 0, &tokens(&mut rng, 300), 0, 300, 300);
    assert!(default.stats().unwrap().bytes_rollback > 0);
}

#[test]
fn memory_budget_status() {
    let status = Status::MemoryBudget;
    assert_eq!(status.code(), qjlkv::sys::QJLKV_ERROR_MEMORY_BUDGET);
    assert_eq!(status.code(), 7);
    assert_eq!(status.name(), "QJLKV_ERROR_MEMORY_BUDGET");
    assert_eq!(status.to_string(), "QJLKV_ERROR_MEMORY_BUDGET");
    assert_ne!(status, Status::OutOfMemory);
}
