//! Thread rules: a Cache moves between threads (Send, not Sync); a Sketch is shared
//! (Send + Sync); error messages are per thread.

mod common;

use std::sync::mpsc;
use std::sync::Arc;
use std::thread;

use common::*;
use qjlkv::{Cache, Config, Sketch, Workers};

fn assert_send<T: Send>() {}
fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn marker_traits() {
    assert_send::<Cache>();
    assert_send_sync::<Sketch<'static>>();
    assert_send_sync::<Sketch<'_>>();
    assert_send_sync::<qjlkv::Error>();
    assert_send_sync::<Workers>();
    // Cache is not Sync: checked by a compile_fail doctest on Cache.
}

/// Appends `steps` tokens to `seq` (data from `seed`) and returns the last attention output.
fn decode(cache: &mut Cache, seq: u32, seed: u64, steps: usize) -> Vec<f32> {
    let mut rng = Rng(seed);
    let (kv, q) = (cache.shape().kv_token_len(), cache.shape().q_token_len());
    let mut out = Vec::new();
    for _ in 0..steps {
        let keys = rng.normals(kv);
        cache.append(0, seq, &keys, &keys).unwrap();
        out = cache.attend(0, seq, &rng.normals(q), None).unwrap();
    }
    out
}

fn config() -> Config {
    Config::preset("qjl", 1, 8, 2, 64).unwrap().num_threads(1)
}

#[test]
fn caches_move_to_worker_threads_and_back() {
    let expected: Vec<Vec<f32>> = (0..4)
        .map(|i| decode(&mut Cache::new(&config()).unwrap(), i, 100 + u64::from(i), 150))
        .collect();

    let workers: Vec<_> = (0..4u32)
        .map(|i| {
            let mut cache = Cache::new(&config()).unwrap(); // created here, used there
            thread::spawn(move || {
                let out = decode(&mut cache, i, 100 + u64::from(i), 150);
                (cache, out)
            })
        })
        .collect();
    for (i, worker) in workers.into_iter().enumerate() {
        let (cache, out) = worker.join().unwrap();
        assert_eq!(out, expected[i], "cache {i}");
        assert_eq!(cache.length(0, i as u32).unwrap(), 150);
    }
}

#[test]
fn one_cache_handed_from_thread_to_thread_mid_sequence() {
    let mut reference = Cache::new(&config()).unwrap();
    decode(&mut reference, 0, 7, 60);
    let expected = decode(&mut reference, 0, 8, 60);

    let (to_second, from_first) = mpsc::channel::<Cache>();
    let first = thread::spawn(move || {
        let mut cache = Cache::new(&config()).unwrap();
        decode(&mut cache, 0, 7, 60);
        to_second.send(cache).unwrap();
    });
    let second = thread::spawn(move || {
        let mut cache = from_first.recv().unwrap();
        decode(&mut cache, 0, 8, 60)
    });
    first.join().unwrap();
    assert_eq!(second.join().unwrap(), expected);
}

#[test]
fn a_sketch_is_shared_through_arc() {
    let sketch = Arc::new(Sketch::new(128, 256, 9, true).unwrap());
    let expected = sketch.matrix();
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let sketch = Arc::clone(&sketch);
            thread::spawn(move || {
                (0..20)
                    .map(|_| sketch.matrix())
                    .all(|m| m == Sketch::new(128, 256, 9, true).unwrap().matrix())
            })
        })
        .collect();
    for reader in readers {
        assert!(reader.join().unwrap());
    }
    assert_eq!(sketch.matrix(), expected);
}

#[test]
fn a_cache_sketch_is_read_by_scoped_threads() {
    let cache = Cache::new(&config().seed(3)).unwrap();
    let sketch = cache.sketch(0).unwrap();
    let expected = Sketch::new(64, sketch.rows(), 3, true).unwrap().matrix();
    thread::scope(|scope| {
        let readers: Vec<_> = (0..3).map(|_| scope.spawn(|| sketch.matrix())).collect();
        for reader in readers {
            assert_eq!(reader.join().unwrap(), expected);
        }
    });
}

#[test]
fn error_messages_belong_to_their_thread() {
    let workers: Vec<_> = (0..8u32)
        .map(|i| {
            thread::spawn(move || {
                let mut cache = Cache::new(&config()).unwrap();
                let kv = cache.shape().kv_token_len();
                for _ in 0..200 {
                    // Each thread fails with its own layer number.
                    let err = cache
                        .append(10 + i, 0, &vec![0.0f32; kv], &vec![0.0f32; kv])
                        .unwrap_err();
                    assert!(
                        err.message().starts_with(&format!("layer is {}", 10 + i)),
                        "{}",
                        err.message()
                    );
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
}

/// Caches on one set of shared workers, each driven by its own thread at once, compute what a
/// cache on its own thread does; the workers may be dropped while the caches use them.
#[test]
fn caches_share_workers_across_threads() {
    let config = Config::preset("q3", 1, 8, 2, 64).unwrap().num_threads(1);
    let expected: Vec<Vec<f32>> = (0..4)
        .map(|i| decode(&mut Cache::new(&config).unwrap(), i, 200 + u64::from(i), 200))
        .collect();
    let workers = Workers::new(2).unwrap();
    let caches: Vec<Cache> = (0..4)
        .map(|_| {
            let mut cache = Cache::new(&config).unwrap();
            cache.set_workers(Some(&workers)).unwrap();
            cache
        })
        .collect();
    drop(workers);
    let handles: Vec<_> = caches
        .into_iter()
        .zip(0u32..)
        .map(|(mut cache, i)| thread::spawn(move || decode(&mut cache, i, 200 + u64::from(i), 200)))
        .collect();
    for (handle, want) in handles.into_iter().zip(&expected) {
        assert_eq!(&handle.join().unwrap(), want);
    }
}
