//! Export and import through slices and `std::io::Write`/`Read`: round trips that continue to
//! decode bit-identically, several streams in one writer, and the refusals.

mod common;

use std::io::{self, Cursor, Read, Write};

use common::*;
use qjlkv::{Cache, Config, Status};

fn config(preset: &str) -> Config {
    Config::preset(preset, 2, 4, 2, 32)
        .expect("valid shape")
        .block_tokens(16)
        .residual_tokens(8)
        .num_threads(1)
}

fn fill(cache: &mut Cache, rng: &mut Rng, seq: u32, tokens: usize) {
    for layer in 0..2u32 {
        let n = tokens + layer as usize;
        let keys = rng.normals(n * 2 * 32);
        let values = rng.normals(n * 2 * 32);
        cache.append(layer, seq, &keys, &values).expect("append");
    }
}

/// Appends the same tokens to (a, seq_a) and (b, seq_b) and checks that attention agrees bit for bit.
fn decode_identically(a: &mut Cache, seq_a: u32, b: &mut Cache, seq_b: u32, steps: usize) {
    let mut rng = Rng(77);
    for step in 0..steps {
        for layer in 0..2u32 {
            let k = rng.normals(2 * 32);
            let v = rng.normals(2 * 32);
            a.append(layer, seq_a, &k, &v).expect("append a");
            b.append(layer, seq_b, &k, &v).expect("append b");
            let q = rng.normals(4 * 32);
            let out_a = a.attend(layer, seq_a, &q, None).expect("attend a");
            let out_b = b.attend(layer, seq_b, &q, None).expect("attend b");
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out_a), bits(&out_b), "step {step}, layer {layer}");
        }
    }
}

#[test]
fn every_method_round_trips_and_decodes_identically() {
    for preset in ["q2", "q3", "q4", "qjl", "kivi", "ott", "exact"] {
        let cfg = config(preset);
        let mut rng = Rng(1);
        let mut source = Cache::new(&cfg).expect("cache");
        fill(&mut source, &mut rng, 3, 61);
        let stream = source.export(3, 0..2).expect("export");
        assert_eq!(stream.len() as u64, source.export_size(3, 0..2).expect("size"));
        assert_eq!(&stream[..8], b"QJLKVSEQ");
        let mut dest = Cache::new(&cfg).expect("cache");
        dest.import(9, &stream).expect("import");
        assert_eq!(dest.export(9, 0..2).expect("export"), stream, "{preset}");
        decode_identically(&mut source, 3, &mut dest, 9, 20);
        assert_eq!(
            dest.export(9, 0..2).unwrap(),
            source.export(3, 0..2).unwrap(),
            "{preset}"
        );
    }
}

#[test]
fn writers_and_readers_carry_several_streams() {
    let cfg = config("ott");
    let mut rng = Rng(2);
    let mut source = Cache::new(&cfg).expect("cache");
    fill(&mut source, &mut rng, 1, 50);
    fill(&mut source, &mut rng, 2, 3);
    let mut file = Vec::new();
    let first = source.export_to(1, 0..2, &mut file).expect("export_to");
    let second = source.export_to(2, 1..2, &mut file).expect("export_to");
    assert_eq!(file.len() as u64, first + second);
    assert_eq!(&file[..first as usize], &source.export(1, 0..2).unwrap()[..]);
    let mut dest = Cache::new(&cfg).expect("cache");
    let mut reader = Cursor::new(&file);
    assert_eq!(dest.import_from(5, &mut reader).expect("import_from"), first);
    assert_eq!(dest.import_from(6, &mut reader).expect("import_from"), second);
    assert_eq!(reader.position(), file.len() as u64);
    assert_eq!(dest.export(5, 0..2).unwrap(), source.export(1, 0..2).unwrap());
    assert_eq!(dest.length(0, 6).unwrap(), 0);
    assert_eq!(dest.length(1, 6).unwrap(), source.length(1, 2).unwrap());
}

#[test]
fn refusals_leave_the_destination_unchanged() {
    let cfg = config("qjl");
    let mut rng = Rng(3);
    let mut source = Cache::new(&cfg).expect("cache");
    fill(&mut source, &mut rng, 1, 40);
    let stream = source.export(1, 0..2).expect("export");
    let mut dest = Cache::new(&cfg).expect("cache");
    fill(&mut dest, &mut rng, 1, 3);
    let before = dest.stats().unwrap();

    assert_invalid(dest.import(1, &stream), "already holds");
    let err = dest.import(2, &stream[..stream.len() - 1]).unwrap_err();
    assert_eq!(err.status(), Status::CorruptData, "{err}");
    assert!(err.message().contains("truncated"), "{err}");
    let mut damaged = stream.clone();
    damaged[300] ^= 4;
    let err = dest.import(2, &damaged).unwrap_err();
    assert_eq!(err.status(), Status::CorruptData, "{err}");
    assert_eq!(dest.import(2, &[]).unwrap_err().status(), Status::CorruptData);
    let io_err = dest.import_from(2, &mut Cursor::new(&stream[..100])).unwrap_err();
    assert_eq!(io_err.kind(), io::ErrorKind::InvalidData);
    let inner = io_err
        .get_ref()
        .and_then(|e| e.downcast_ref::<qjlkv::Error>())
        .expect("a qjlkv::Error inside");
    assert_eq!(inner.status(), Status::CorruptData);
    let mut other = Cache::new(&config("kivi")).unwrap();
    assert_invalid(other.import(1, &stream), "key_method");
    assert_invalid(source.export(1, std::ops::Range { start: 1, end: 0 }), "layers");
    assert_invalid(source.export(8, 0..2), "seq");
    assert_eq!(dest.stats().unwrap(), before);
    assert_eq!(dest.length(0, 2).unwrap(), 0);
}

#[test]
fn io_errors_of_the_writer_and_reader_come_back() {
    struct Full;
    impl Write for Full {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::new(io::ErrorKind::WriteZero, "disk full"))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    struct Broken;
    impl Read for Broken {
        fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
            Err(io::Error::new(io::ErrorKind::ConnectionReset, "peer went away"))
        }
    }
    let cfg = config("exact");
    let mut rng = Rng(4);
    let mut cache = Cache::new(&cfg).expect("cache");
    fill(&mut cache, &mut rng, 0, 5);
    assert_eq!(
        cache.export_to(0, 0..2, &mut Full).unwrap_err().kind(),
        io::ErrorKind::WriteZero
    );
    assert_eq!(
        cache.import_from(1, &mut Broken).unwrap_err().kind(),
        io::ErrorKind::ConnectionReset
    );
    assert_eq!(cache.length(0, 1).unwrap(), 0);
}
