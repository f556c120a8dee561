"""Sliding-window attention in the numpy caches and the refusal of library rows on a
windowed model when the installed qjlkv cannot apply windows (tools/eval/caches.py)."""
from types import SimpleNamespace

import numpy as np
import pytest

from tools.eval.anchors import BlockQuantCache
from tools.eval.caches import (ExactCache, QjlkvCache, WindowsUnsupported, require_library_windows,
                               window_bytes)
from tools.eval.evaluate import CacheConfig, runnable_configurations
from tools.eval.model import causal_mask
from tools.eval.research import ResearchConfig

SHAPE = SimpleNamespace(num_layers=2, num_q_heads=2, num_kv_heads=1, head_dim=32, windows=(3, None))


def reference_attention(q, k, v, visible):
    """One query head over the visible key positions, in float64."""
    scores = (k[visible, 0].astype(np.float64) @ q.astype(np.float64)) / np.sqrt(len(q))
    weights = np.exp(scores - scores.max())
    return (weights / weights.sum()) @ v[visible, 0]


def test_causal_mask_with_a_window_sees_the_newest_positions_only():
    mask = causal_mask(np.array([0, 2, 5]), 0, 6, window=3)
    assert (np.isfinite(mask) == np.array([[1, 0, 0, 0, 0, 0],
                                           [1, 1, 1, 0, 0, 0],
                                           [0, 0, 0, 1, 1, 1]], bool)).all()
    assert np.isfinite(causal_mask(np.array([5]), 0, 6)).all()  # no window: every earlier one


@pytest.mark.parametrize("chunks", [[8], [1] * 8, [5, 3]])
def test_exact_cache_attends_within_the_window_of_each_layer(chunks):
    """Appended in one go, token by token or in pieces: each query sees the newest 3
    positions on layer 0 and every earlier one on layer 1."""
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((8, 1, 32), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((8, 2, 32), dtype=np.float32)
    cache = ExactCache.of(SHAPE)
    assert cache.windows == (3, None)
    outputs = {0: [], 1: []}
    start = 0
    for n in chunks:
        for layer in (0, 1):
            cache.append(layer, k[start:start + n], v[start:start + n])
            outputs[layer].append(cache.attend(layer, q[start:start + n]))
        start += n
    for layer, window in ((0, 3), (1, 8)):
        out = np.concatenate(outputs[layer])
        for pos in range(8):
            visible = np.arange(max(0, pos - window + 1), pos + 1)
            for head in range(2):
                np.testing.assert_allclose(out[pos, head], reference_attention(q[pos, head], k, v, visible),
                                           atol=1e-5)


def test_block_formats_follow_the_windows():
    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal((6, 1, 32), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((1, 2, 32), dtype=np.float32)
    windowed = BlockQuantCache("q8_0", "q8_0", SHAPE)
    unwindowed = BlockQuantCache("q8_0", "q8_0", SimpleNamespace(**{**vars(SHAPE), "windows": None}))
    for cache in (windowed, unwindowed):
        cache.append(0, k, v)
    # only the window's 3 newest positions: a cache holding just those attends the same
    newest = BlockQuantCache("q8_0", "q8_0", SimpleNamespace(**{**vars(SHAPE), "windows": None}))
    newest.append(0, k[3:], v[3:])
    np.testing.assert_allclose(windowed.attend(0, q), newest.attend(0, q), atol=1e-6)
    assert np.abs(windowed.attend(0, q) - unwindowed.attend(0, q)).max() > 1e-3


def test_window_bytes_count_what_a_freeing_store_keeps():
    shape = SimpleNamespace(num_layers=6, num_kv_heads=1, head_dim=256, windows=(512,) * 5 + (None,))
    per_position = 256 * 2 * 2  # K and V, fp16
    sizes = window_bytes(shape, 2048, 2)
    assert sizes == {"full": 6 * 2048 * per_position, "windowed": (5 * 512 + 2048) * per_position}
    assert window_bytes(shape, 100, 2)["windowed"] == sizes["full"] // 2048 * 100  # windows not full yet
    assert window_bytes(shape, 2048, 2, block=32)["windowed"] == (5 * 543 + 2048) * per_position


def test_library_without_windows_is_refused_on_a_windowed_model():
    class Cache:  # a qjlkv module whose caches have no window method
        pass

    old_library = SimpleNamespace(Cache=Cache, __version__="0.0")
    with pytest.raises(WindowsUnsupported, match="full attention would measure another model"):
        require_library_windows(old_library, "qjl preset")

    class WindowedCache:
        def set_layer_attention(self, layer, window_tokens=0):
            pass

    require_library_windows(SimpleNamespace(Cache=WindowedCache), "qjl preset")  # accepted


def test_runnable_configurations_keep_the_numpy_rows(monkeypatch):
    import qjlkv

    from tools.eval import caches

    monkeypatch.setattr(caches, "LIBRARY_WINDOW_METHOD", "no_such_method")
    model = SimpleNamespace(shape=SHAPE)
    research = ResearchConfig("Q2q", None)  # a numpy format of tools.eval.research
    configs = [CacheConfig("qjl preset", "qjl"), CacheConfig("q4_0", "q4_0", anchor=True), research]
    assert [c.name for c in runnable_configurations(model, configs)] == ["q4_0", "Q2q"]
    with pytest.raises(ValueError, match="sliding windows"):
        runnable_configurations(model, configs[:1])
    with pytest.raises(WindowsUnsupported):
        QjlkvCache("qjl", "qjl", SHAPE)
    # a model without windows runs the library's rows as before
    plain = SimpleNamespace(shape=SimpleNamespace(**{**vars(SHAPE), "windows": None}))
    assert runnable_configurations(plain, configs) == configs
    assert qjlkv.Cache  # the real module is untouched
