"""Sequence operations through the Python binding: Cache.truncate, fork, bytes_needed,
sequence_bytes, the config fields memory_budget and rollback_tokens, the stats keys
bytes_rollback and bytes_shared, and qjlkv.MemoryBudgetError. Held to the exported stream
(the stored bytes, bit for bit) and to attention, as tests/cpp/test_sequence_ops.cpp does."""

from __future__ import annotations

import numpy as np
import pytest

import qjlkv
from conftest import randn, raises, small_config

PRESETS = ["q2", "q3", "q4", "qjl", "kivi", "ott", "exact"]


def feed(cache: qjlkv.Cache, seq: int, keys: np.ndarray, values: np.ndarray, pieces=(1, 5, 17)) -> None:
    """Appends keys/values to every layer in pieces of the given sizes, cycled."""
    done, i = 0, 0
    while done < len(keys):
        n = min(pieces[i % len(pieces)], len(keys) - done)
        for layer in range(cache.config.num_layers):
            cache.append(layer, seq, keys[done:done + n], values[done:done + n])
        done, i = done + n, i + 1


def tokens(rng: np.random.Generator, n: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    return randn(rng, n, 2, 64, dtype=dtype), randn(rng, n, 2, 64, dtype=dtype)


def attention(cache: qjlkv.Cache, seq: int, query: np.ndarray) -> list[np.ndarray]:
    return [cache.attend(layer, seq, query) for layer in range(cache.config.num_layers)]


def test_new_config_fields_and_stats_keys(rng):
    for preset in PRESETS:
        cfg = small_config(preset)
        assert (cfg.memory_budget, cfg.rollback_tokens) == (0, 32), preset
    assert {"memory_budget", "rollback_tokens"} <= set(qjlkv.Config.FIELDS)
    cache = qjlkv.Cache(small_config("q3", rollback_tokens=48, memory_budget=1 << 30))
    assert (cache.config.rollback_tokens, cache.config.memory_budget) == (48, 1 << 30)
    feed(cache, 0, *tokens(rng, 200))
    s = cache.stats()
    assert s["bytes_rollback"] > 0 and s["bytes_shared"] == 0
    assert s["bytes_used"] == (s["bytes_keys_quantized"] + s["bytes_values_quantized"] + s["bytes_full_precision"]
                               + s["bytes_metadata"] + s["bytes_rollback"])
    with raises(qjlkv.InvalidArgument, "rollback_tokens"):
        qjlkv.Cache(small_config(rollback_tokens=65537))


@pytest.mark.parametrize("preset", PRESETS)
def test_truncate_within_the_rollback_depth_is_exact(rng, preset):
    """Appending k draft tokens (k up to rollback_tokens, across block boundaries) and truncating
    back leaves the bytes and the attention of a cache that never saw them, also after more appends."""
    keys, values = tokens(rng, 300)
    draft_k, draft_v = tokens(rng, 32)
    query = randn(rng, 8, 64)
    for n, k in [(100, 32), (150, 7), (64, 1), (17, 30)]:
        want, got = qjlkv.Cache(small_config(preset)), qjlkv.Cache(small_config(preset))
        feed(want, 0, keys[:n], values[:n])
        feed(got, 0, keys[:n], values[:n])
        feed(got, 0, draft_k[:k], draft_v[:k], pieces=(k,))
        got.truncate(0, n)
        assert got.length(1, 0) == n
        assert got.export_bytes(0) == want.export_bytes(0), (n, k)
        feed(want, 0, keys[n:n + 40], values[n:n + 40])
        feed(got, 0, keys[n:n + 40], values[n:n + 40])
        assert got.export_bytes(0) == want.export_bytes(0), (n, k)
        for a, b in zip(attention(got, 0, query), attention(want, 0, query)):
            np.testing.assert_array_equal(a, b)


def test_truncate_deeper_than_the_depth_keeps_the_prefix(rng):
    cache = qjlkv.Cache(small_config("q3"))
    feed(cache, 0, *tokens(rng, 400))
    cache.truncate(0, 90)
    assert [cache.length(layer, 0) for layer in range(2)] == [90, 90]
    cache.truncate(0, 0)
    assert cache.length(0, 0) == 0 and cache.sequence_bytes(0) == (0, 0)


@pytest.mark.parametrize("preset", PRESETS)
def test_fork_shares_and_decodes_as_a_fresh_sequence(rng, preset):
    cache, fresh = qjlkv.Cache(small_config(preset)), qjlkv.Cache(small_config(preset))
    keys, values = tokens(rng, 260)
    feed(cache, 0, keys[:200], values[:200])
    feed(fresh, 0, keys[:200], values[:200])
    before = cache.stats()["bytes_used"]
    cache.fork(0, 7)
    assert cache.export_bytes(7) == cache.export_bytes(0) == fresh.export_bytes(0)
    s = cache.stats()
    if preset != "exact" or s["bytes_shared"]:
        assert s["bytes_shared"] > 0 and s["bytes_used"] < 2 * before
    total, shared = cache.sequence_bytes(7)
    assert total >= shared == cache.sequence_bytes(0)[1] > 0 or preset == "exact"
    # appends to the fork decode exactly as the same tokens fed afresh; the source is unchanged
    source = cache.export_bytes(0)
    feed(cache, 7, keys[200:], values[200:])
    feed(fresh, 0, keys[200:], values[200:])
    assert cache.export_bytes(7) == fresh.export_bytes(0) and cache.export_bytes(0) == source
    query = randn(rng, 8, 64)
    for a, b in zip(attention(cache, 7, query), attention(fresh, 0, query)):
        np.testing.assert_array_equal(a, b)
    # clearing the source frees only what it alone held
    alone = cache.sequence_bytes(0)[0] - cache.sequence_bytes(0)[1]
    used = cache.stats()["bytes_used"]
    cache.clear(0)
    assert cache.stats()["bytes_used"] == used - alone
    assert cache.export_bytes(7) == fresh.export_bytes(0)


def test_fork_of_a_prefix_equals_fork_and_truncate(rng):
    cache = qjlkv.Cache(small_config("q3"))
    feed(cache, 0, *tokens(rng, 300))
    cache.fork(0, 1, 123)
    cache.fork(0, 2)
    cache.truncate(2, 123)
    assert cache.length(0, 1) == 123 and cache.export_bytes(1) == cache.export_bytes(2)


def test_refusals_change_nothing(rng):
    cache = qjlkv.Cache(small_config("q3"))
    feed(cache, 0, *tokens(rng, 100))
    feed(cache, 1, *tokens(rng, 10))
    before = (cache.export_bytes(0), cache.export_bytes(1), cache.stats())
    with raises(qjlkv.InvalidArgument):
        cache.fork(0, 1)  # dst holds tokens
    with raises(qjlkv.InvalidArgument):
        cache.fork(0, 0)
    with raises(qjlkv.InvalidArgument):
        cache.fork(0, 5, 101)
    with raises(qjlkv.InvalidArgument):
        cache.truncate(0, 101)
    with raises(qjlkv.InvalidArgument, "seq is -1"):
        cache.truncate(-1, 0)
    with raises(qjlkv.InvalidType, "length", "float"):
        cache.fork(0, 5, 3.0)
    assert (cache.export_bytes(0), cache.export_bytes(1), cache.stats()) == before
    assert cache.length(0, 5) == 0


@pytest.mark.parametrize("preset", ["q2", "q3", "qjl", "ott"])
def test_bytes_needed_is_exact(rng, preset):
    cache = qjlkv.Cache(small_config(preset))
    keys, values = tokens(rng, 400)
    done = 0
    for n in (1, 30, 64, 1, 100, 7, 150):
        want = cache.bytes_needed(0, n)
        used = cache.stats()["bytes_used"]
        feed(cache, 0, keys[done:done + n], values[done:done + n], pieces=(n,))
        # an append can also free bytes (rollback copies of blocks now below the floor): growth 0
        assert max(cache.stats()["bytes_used"] - used, 0) == want, (preset, done, n)
        done += n


def test_memory_budget_refuses_with_its_own_error_and_changes_nothing(rng):
    keys, values = tokens(rng, 400)
    probe = qjlkv.Cache(small_config("q3"))
    feed(probe, 0, keys[:100], values[:100])
    budget = probe.stats()["bytes_used"] + probe.bytes_needed(0, 20)
    cache = qjlkv.Cache(small_config("q3", memory_budget=budget))
    feed(cache, 0, keys[:100], values[:100])
    assert cache.bytes_needed(0, 20) == probe.bytes_needed(0, 20)
    feed(cache, 0, keys[100:120], values[100:120], pieces=(20,))  # exactly up to the budget
    assert cache.stats()["bytes_used"] == budget
    assert cache.bytes_needed(1, 50) > 0  # a new sequence's tokens take bytes: refused
    before = (cache.export_bytes(0), cache.stats())
    with raises(qjlkv.MemoryBudgetError, status=qjlkv.Status.MEMORY_BUDGET) as info:
        cache.append(0, 1, keys[120:170], values[120:170])
    assert "budget" in str(info.value)
    with raises(qjlkv.MemoryBudgetError):
        cache.fork(0, 1)
    assert (cache.export_bytes(0), cache.stats()) == before and cache.length(0, 1) == 0
    # preempting (here: truncating) another sequence, then retrying, is the way on
    cache.truncate(0, 20)
    cache.append(0, 1, keys[120:170], values[120:170])


def test_memory_budget_error_is_not_an_allocation_failure():
    assert issubclass(qjlkv.MemoryBudgetError, qjlkv.Error)
    assert not issubclass(qjlkv.MemoryBudgetError, (MemoryError, qjlkv.OutOfMemory))
    assert qjlkv.MemoryBudgetError.__module__ == "qjlkv" and "MemoryBudgetError" in qjlkv.__all__
    assert qjlkv.Status.MEMORY_BUDGET == 7
    assert qjlkv.status_string(qjlkv.Status.MEMORY_BUDGET) == "QJLKV_ERROR_MEMORY_BUDGET"


def test_fork_many_beams_share_one_prompt(rng):
    """Beam search's pattern: one prompt, forks each step, dropped beams cleared. Each beam
    copies only its exact rows (q3: 16 sinks and a tail of 16 to 79 tokens), so four beams of
    a 4096-token prompt take about a third more than one sequence."""
    cache = qjlkv.Cache(small_config("q3", dtype="float16"))
    feed(cache, 0, *tokens(rng, 4096, np.float16), pieces=(4096,))
    alone = cache.stats()["bytes_used"]
    for seq in (1, 2, 3):
        cache.fork(0, seq)
    for _ in range(20):
        k, v = tokens(rng, 4, np.float16)
        for layer in range(2):
            cache.append_batch(layer, [0, 1, 2, 3], k, v)
        cache.clear(3)
        cache.fork(1, 3)
    s = cache.stats()
    assert s["bytes_used"] < 1.5 * alone and s["bytes_shared"] > 0.5 * s["bytes_used"], s
