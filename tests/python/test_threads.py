"""One qjlkv.Cache shared by several Python threads: the GIL is released during every call, so
the binding's per-handle lock is all that keeps two calls (or a call and close()) apart.

These tests are also the sanitizer check of that lock: bindings/python/sanitize.sh runs this
file against an extension built with ThreadSanitizer or AddressSanitizer.
"""

import threading
import time

import numpy as np
import pytest

import qjlkv
from conftest import raises, randn, small_config

THREADS = 4
STEPS = 60


def run_threads(target, count=THREADS):
    """Runs target(i) on `count` threads at once; re-raises the first exception."""
    errors = []
    start = threading.Barrier(count)

    def body(i):
        try:
            start.wait()
            target(i)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_concurrent_calls_on_one_cache_are_serialized(rng):
    """Every thread appends to the same sequence and attends, reads stats, scores and
    reconstructs in between: with calls serialized, no append is lost and every result is
    well formed."""
    cache = qjlkv.Cache(small_config(num_layers=1))
    tokens = [randn(np.random.default_rng(i), STEPS, 2, 64) for i in range(THREADS)]
    queries = randn(rng, 8, 64)
    cache.append(0, 0, tokens[0][:1], tokens[0][:1])

    def work(i):
        for step in range(STEPS):
            cache.append(0, 0, tokens[i][step], tokens[i][step])
            out = cache.attend(0, 0, queries)
            assert out.shape == (8, 64) and np.isfinite(out).all()
            stats = cache.stats()
            assert stats["tokens"] >= step + 2
            if step % 10 == 0:
                assert cache.scores(0, 0, queries).shape[0] == 8
                keys, values = cache.reconstruct(0, 0)
                assert keys.shape == values.shape and keys.shape[0] >= step + 2
            cache.append(0, 1 + i, tokens[i][step], tokens[i][step])  # a sequence of its own too

    run_threads(work)
    assert cache.length(0, 0) == 1 + THREADS * STEPS
    assert [cache.length(0, 1 + i) for i in range(THREADS)] == [STEPS] * THREADS
    # The per-thread sequences hold exactly what each thread appended, in its order.
    ref = qjlkv.Cache(small_config(num_layers=1))
    for i in range(THREADS):
        ref.append(0, 0, tokens[i], tokens[i])
        for a, b in zip(cache.reconstruct(0, 1 + i), ref.reconstruct(0, 0)):
            np.testing.assert_array_equal(a, b)
        ref.clear(0)
    cache.close()


def test_close_waits_for_calls_in_flight(rng):
    """Threads attend on a long sequence while another closes the cache: each call either
    completes with the right answer or raises "closed"; none runs on a freed cache."""
    cache = qjlkv.Cache(small_config(num_layers=1))
    keys = randn(rng, 4096, 2, 64)
    cache.append(0, 0, keys, keys)
    queries = randn(rng, 8, 64)
    expected = cache.attend(0, 0, queries)
    completed = [0] * THREADS
    closed = threading.Event()

    def work(i):
        if i == 0:  # the closer: lets the others get going first
            while sum(completed) < THREADS:
                time.sleep(0.001)
            cache.close()
            closed.set()
            return
        while True:
            try:
                out = cache.attend(0, 0, queries)
            except qjlkv.InvalidArgument as err:
                assert "closed" in str(err)
                assert closed.wait(10)
                return
            np.testing.assert_array_equal(out, expected)
            completed[i] += 1
            stats = None
            try:
                stats = cache.stats()
            except qjlkv.InvalidArgument as err:
                assert "closed" in str(err)
            assert stats is None or stats["tokens"] == 4096

    completed[0] = 1
    run_threads(work)
    assert cache.closed


@pytest.mark.parametrize("call", ["append", "attend", "stats", "length", "scores", "reconstruct", "clear",
                                  "sketch", "set_stream"])
def test_every_call_after_close_raises(rng, call):
    cache = qjlkv.Cache(small_config())
    k1 = randn(rng, 2, 64)
    q = randn(rng, 8, 64)
    cache.append(0, 0, k1, k1)
    cache.close()
    calls = {
        "append": lambda: cache.append(0, 0, k1, k1),
        "attend": lambda: cache.attend(0, 0, q),
        "stats": cache.stats,
        "length": lambda: cache.length(0, 0),
        "scores": lambda: cache.scores(0, 0, q),
        "reconstruct": lambda: cache.reconstruct(0, 0),
        "clear": lambda: cache.clear(0),
        "sketch": lambda: cache.sketch(0),
        "set_stream": lambda: cache.set_stream(None),
    }
    with raises(qjlkv.InvalidArgument, "the cache is closed"):
        calls[call]()


def test_a_lent_sketch_fails_once_its_cache_is_closed():
    cache = qjlkv.Cache(small_config())
    sketch = cache.sketch(1)
    matrix = sketch.matrix
    assert matrix.shape == sketch.shape
    cache.close()
    with raises(qjlkv.InvalidArgument, "the cache that lent this sketch is closed"):
        sketch.matrix  # noqa: B018 - the property is the call


def test_close_from_many_threads_at_once():
    cache = qjlkv.Cache(small_config())
    run_threads(lambda i: cache.close())
    assert cache.closed and repr(cache) == "qjlkv.Cache(closed)"


def test_caches_sharing_workers_from_many_threads(rng: np.random.Generator):
    """Caches on one qjlkv.Workers, each driven by its own thread at once, store and compute what
    a cache on its own threads does (qjlkv_cache_set_workers)."""
    keys = [randn(rng, 300, 2, 64) for _ in range(THREADS)]
    queries = [randn(rng, 1, 8, 64) for _ in range(THREADS)]

    def workload(cache, i):
        cache.append(0, 0, keys[i], keys[i])
        return cache.attend(0, 0, queries[i]), cache.export_bytes(0)

    expected = [workload(qjlkv.Cache(small_config("q3")), i) for i in range(THREADS)]
    workers = qjlkv.Workers(2)
    caches = [qjlkv.Cache(small_config("q3", num_threads=1)) for _ in range(THREADS)]
    for cache in caches:
        cache.set_workers(workers)
    del workers  # the caches keep the threads alive
    got = [None] * THREADS

    def body(i):
        for _ in range(3):
            caches[i].clear(0)
            got[i] = workload(caches[i], i)

    run_threads(body)
    for (out, stream), (want_out, want_stream) in zip(got, expected):
        np.testing.assert_array_equal(out, want_out)
        assert stream == want_stream
    caches[0].set_workers(None)  # back to its own thread
    caches[0].clear(0)
    np.testing.assert_array_equal(workload(caches[0], 0)[0], expected[0][0])
