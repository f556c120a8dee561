"""Package surface: version, C functions reachable, Config, Sketch, stats, repr and docs."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

import qjlkv
from conftest import randn, raises, small_config

HEADER = pathlib.Path(__file__).resolve().parents[2] / "include" / "qjlkv" / "qjlkv.h"

# Every function of the C ABI and the Python callable that reaches it.
C_FUNCTIONS = {
    "qjlkv_version_number": qjlkv.version_number,
    "qjlkv_version_string": qjlkv.version_string,
    "qjlkv_status_string": qjlkv.status_string,
    "qjlkv_last_error_message": qjlkv.last_error_message,
    "qjlkv_sketch_create": qjlkv.Sketch,
    "qjlkv_sketch_matrix": qjlkv.Sketch.matrix,
    "qjlkv_sketch_shape": qjlkv.Sketch.shape,
    "qjlkv_sketch_destroy": qjlkv.Sketch,  # when the Sketch object is collected
    "qjlkv_config_init": qjlkv.Config,
    "qjlkv_config_validate": qjlkv.Config.validate,
    "qjlkv_cache_create": qjlkv.Cache,
    "qjlkv_cache_destroy": qjlkv.Cache.close,
    "qjlkv_cache_config": qjlkv.Cache.config,
    "qjlkv_cache_set_stream": qjlkv.Cache.set_stream,
    "qjlkv_workers_create": qjlkv.Workers,
    "qjlkv_workers_destroy": qjlkv.Workers,  # when the Workers object is collected
    "qjlkv_cache_set_workers": qjlkv.Cache.set_workers,
    "qjlkv_cache_set_layer_attention": qjlkv.Cache.set_layer_attention,
    "qjlkv_cache_append": qjlkv.Cache.append,
    "qjlkv_cache_attend": qjlkv.Cache.attend,
    "qjlkv_cache_append_batch": qjlkv.Cache.append_batch,
    "qjlkv_cache_attend_batch": qjlkv.Cache.attend_batch,
    "qjlkv_cache_scores": qjlkv.Cache.scores,
    "qjlkv_cache_reconstruct": qjlkv.Cache.reconstruct,
    "qjlkv_cache_length": qjlkv.Cache.length,
    "qjlkv_cache_sketch": qjlkv.Cache.sketch,
    "qjlkv_cache_clear_sequence": qjlkv.Cache.clear,
    "qjlkv_cache_stats": qjlkv.Cache.stats,
    "qjlkv_cache_export_size": qjlkv.Cache.export_bytes,
    "qjlkv_cache_export": qjlkv.Cache.export_bytes,
    "qjlkv_cache_export_stream": qjlkv.Cache.export_to,
    "qjlkv_cache_import": qjlkv.Cache.import_bytes,
    "qjlkv_cache_import_stream": qjlkv.Cache.import_from,
    "qjlkv_cache_truncate": qjlkv.Cache.truncate,
    "qjlkv_cache_fork": qjlkv.Cache.fork,
    "qjlkv_cache_bytes_needed": qjlkv.Cache.bytes_needed,
    "qjlkv_cache_sequence_bytes": qjlkv.Cache.sequence_bytes,
}


def test_every_c_function_is_bound():
    declared = set(re.findall(r"QJLKV_API\s+[\w\s\*]*?\b(qjlkv_\w+)\s*\(", HEADER.read_text()))
    assert declared == set(C_FUNCTIONS), f"unbound: {declared - set(C_FUNCTIONS)}, gone: {set(C_FUNCTIONS) - declared}"


def test_version_comes_from_the_c_library():
    major, minor, patch = (int(x) for x in qjlkv.__version__.split("."))
    assert qjlkv.version_number() == major * 10000 + minor * 100 + patch
    assert qjlkv.version_string() == qjlkv.__version__
    assert qjlkv._qjlkv.HEADER_VERSION_NUMBER == qjlkv.version_number()  # header and library agree
    header = HEADER.read_text()
    assert f"#define QJLKV_VERSION_MAJOR {major}\n" in header and f"#define QJLKV_VERSION_MINOR {minor}\n" in header


def test_a_library_older_than_the_header_is_refused():
    """The import-time check of the extension: an older libqjlkv lacks what the header declares."""
    header = qjlkv._qjlkv.HEADER_VERSION_NUMBER
    qjlkv._qjlkv._require_library_version(header)
    qjlkv._qjlkv._require_library_version(header + 1)
    with pytest.raises(ImportError, match=f"version number {header - 1}, older than the {header}"):
        qjlkv._qjlkv._require_library_version(header - 1)


def test_installed_distribution_version_matches():
    from importlib.metadata import version

    assert version("qjlkv") == qjlkv.__version__


def test_status_strings_and_error_hierarchy():
    assert qjlkv.status_string(qjlkv.Status.OK) == "QJLKV_OK"
    assert qjlkv.status_string(qjlkv.Status.UNSUPPORTED) == "QJLKV_ERROR_UNSUPPORTED"
    assert qjlkv.status_string(999) == "unknown status"
    assert issubclass(qjlkv.InvalidArgument, (qjlkv.Error, ValueError))
    assert issubclass(qjlkv.InvalidType, qjlkv.InvalidArgument) and issubclass(qjlkv.InvalidType, TypeError)
    assert issubclass(qjlkv.OutOfMemory, MemoryError) and issubclass(qjlkv.OutOfMemory, qjlkv.Error)
    assert issubclass(qjlkv.Unsupported, NotImplementedError)
    for cls in (qjlkv.DeviceError, qjlkv.CorruptData, qjlkv.InternalError):
        assert issubclass(cls, qjlkv.Error) and issubclass(cls, RuntimeError)
    assert qjlkv.InvalidArgument.__module__ == "qjlkv"


def test_last_error_message_is_the_c_message():
    with pytest.raises(qjlkv.InvalidArgument) as info:
        qjlkv.Sketch(64, 12)
    assert qjlkv.last_error_message() == str(info.value)
    assert info.value.status is qjlkv.Status.INVALID_ARGUMENT


def test_config_presets_and_fields():
    assert qjlkv.PRESETS == ("q2", "q3", "q4", "qjl", "kivi", "ott", "exact")  # as qjlkv.h lists them
    for preset in qjlkv.PRESETS:
        cfg = qjlkv.Config(preset, num_layers=3, num_q_heads=8, num_kv_heads=2, head_dim=128)
        cfg.validate()
        tier = preset in ("q2", "q3", "q4")
        assert cfg.key_method == {"q2": "mixed", "q3": "kivi", "q4": "kivi"}.get(preset, preset)
        assert cfg.value_method == (qjlkv.ValueMethod.ROTATED_LLOYD_MAX if tier else qjlkv.ValueMethod.UNIFORM)
        assert cfg.value_bits == {"q2": 2, "q3": 2, "q4": 3, "exact": 16}.get(preset, 2)
        assert cfg.sink_tokens == {"q2": 16, "q3": 16, "q4": 4}.get(preset, 0)
        if tier:
            assert (cfg.block_tokens, cfg.residual_tokens) == ((64, 16) if preset == "q3" else (128, 32))
        # 2.125 bits a channel, whole bytes a token: 8 * ceil(17 * 128 / 64) in every preset.
        assert cfg.key_token_bits == 272
        assert (cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim) == (3, 8, 2, 128)
        assert cfg.dtype == "float32" and cfg.device == -1
    default = qjlkv.Config(num_layers=1, num_q_heads=4, num_kv_heads=4, head_dim=64)
    assert default.preset == "q3" and default.to_dict() == qjlkv.Config(
        "q3", num_layers=1, num_q_heads=4, num_kv_heads=4, head_dim=64).to_dict()
    assert (default.key_method, default.key_bits, default.value_bits) == ("kivi", 3, 2)
    assert set(default.to_dict()) == set(qjlkv.Config.FIELDS)


def test_new_fields_pass_through(rng):
    # value_method and sink_tokens reach the library: the sinks stay exact, the rotated values
    # keep each token's norm.
    cfg = qjlkv.Config("kivi", num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=64, block_tokens=16,
                       residual_tokens=4, sink_tokens=3, value_method=qjlkv.ValueMethod.ROTATED_LLOYD_MAX,
                       value_bits=3)
    assert cfg.to_dict()["sink_tokens"] == 3 and cfg.to_dict()["value_method"] == 1
    cache = qjlkv.Cache(cfg)
    keys = rng.standard_normal((40, 1, 64)).astype(np.float32)
    values = rng.standard_normal((40, 1, 64)).astype(np.float32)
    cache.append(0, 0, keys, values)
    k_hat, v_hat = cache.reconstruct(0, 0)
    np.testing.assert_array_equal(k_hat[:3], keys[:3])
    np.testing.assert_array_equal(v_hat[:3], values[:3])
    assert not np.array_equal(v_hat[3:35], values[3:35])  # two quantized blocks of 16
    np.testing.assert_allclose(np.linalg.norm(v_hat[3:35], axis=-1), np.linalg.norm(values[3:35], axis=-1),
                               rtol=1e-3)


@pytest.mark.parametrize("head_dim", [8, 16, 24, 64, 96, 128, 256])
def test_q2_preset_key_token_bits(head_dim):
    """The 2-bit tier: mixed-bit keys with key_token_bits = 8 * ceil(17 * head_dim / 64) (qjlkv.h),
    a field of the config (0.5) that reaches the cache and comes back from it."""
    cfg = qjlkv.Config("q2", num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=head_dim)
    assert cfg.key_method == "mixed" and cfg.to_dict()["key_method"] == qjlkv.KeyMethod.MIXED == 4
    assert cfg.key_token_bits == 8 * -(-17 * head_dim // 64)
    assert "key_token_bits" in qjlkv.Config.FIELDS and cfg.key_token_bits % 8 == 0
    cache = qjlkv.Cache(cfg.replace(key_token_bits=4 * head_dim))
    assert cache.config.key_token_bits == 4 * head_dim and cache.config.key_method == "mixed"
    # Every preset sets it, so that switching another preset to mixed keys gives a sane size.
    kivi = small_config("kivi", head_dim=head_dim, key_method="mixed")
    assert kivi.key_token_bits == cfg.key_token_bits and kivi.to_dict()["key_method"] == 4
    kivi.validate()


def test_key_token_bits_rules():
    """A multiple of 8 in [8, 4 * head_dim] when key_method is "mixed"; ignored otherwise."""
    cfg = small_config("q2", head_dim=64)
    for bits in (8, 136, 256):
        cfg.replace(key_token_bits=bits).validate()
    for bits in (0, 4, 137, 264, 2**32 - 8):
        with raises(qjlkv.InvalidArgument, "key_token_bits", str(bits)):
            cfg.replace(key_token_bits=bits).validate()
        small_config("q3", key_token_bits=bits).validate()
    with raises(qjlkv.InvalidArgument, "key_token_bits"):
        qjlkv.Cache(cfg.replace(key_token_bits=0))


def test_q2_stores_the_key_bits_it_is_given(rng):
    """key_token_bits sets the size of a block's key codes: per kv head fp16 minima and maxima,
    3-bit widths per channel and key_token_bits a token."""
    d, B = 64, 32
    sizes = {}
    for bits in (8, 136, 256):
        cache = qjlkv.Cache(small_config("q2", block_tokens=B, residual_tokens=8, sink_tokens=0, num_layers=1,
                                         key_token_bits=bits))
        keys = randn(rng, 3 * B + 8, 2, d)
        cache.append(0, 0, keys, keys)
        sizes[bits] = cache.stats()["bytes_keys_quantized"]
        k_hat, _ = cache.reconstruct(0, 0)
        assert not np.array_equal(k_hat[:3 * B], keys[:3 * B])
        np.testing.assert_array_equal(k_hat[3 * B:], keys[3 * B:])
    # 3 blocks of 2 kv heads: the codes grow by B * (bits / 8) bytes a block and head
    assert sizes[136] - sizes[8] == 3 * 2 * B * (136 - 8) // 8
    assert sizes[256] - sizes[136] == 3 * 2 * B * (256 - 136) // 8


@pytest.mark.parametrize("given,name", [
    ("float16", "float16"), ("bf16", "bfloat16"), (np.float32, "float32"), (np.dtype("float16"), "float16"),
])
def test_config_dtype_names(given, name):
    assert small_config(dtype=given).dtype == name


def test_config_dtype_from_torch_and_ml_dtypes():
    torch = pytest.importorskip("torch")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert small_config(dtype=torch.bfloat16).dtype == "bfloat16"
    assert small_config(dtype=torch.float16).dtype == "float16"
    assert small_config(dtype=ml_dtypes.bfloat16).dtype == "bfloat16"
    assert small_config(device=torch.device("cpu")).device == -1
    assert small_config(device="cuda:1").device == 1


def test_config_fields_reach_the_cache():
    cfg = small_config("kivi", key_bits=4, value_bits=8, value_group_size=16, seed=5, block_tokens=64,
                       residual_tokens=16, num_threads=1, dtype="float16")
    cache = qjlkv.Cache(cfg)
    assert cache.config == cfg
    got = cache.config
    assert (got.key_bits, got.value_bits, got.value_group_size, got.seed) == (4, 8, 16, 5)
    assert (got.block_tokens, got.residual_tokens, got.dtype, got.key_method) == (64, 16, "float16", "kivi")
    copy = cfg.replace(key_bits=2)
    assert copy.key_bits == 2 and cfg.key_bits == 4


def test_sketch_object():
    s = qjlkv.Sketch(32, 48, seed=1, orthogonal=True)
    assert s.shape == (48, 32) and s.owned
    assert s.matrix.shape == (48, 32) and s.matrix.dtype == np.float32
    assert s.matrix is not s.matrix  # a fresh array each time: the sketch is immutable


def test_cache_sketch_keeps_the_cache_alive(rng):
    cache = qjlkv.Cache(small_config())
    sketch = cache.sketch(1)
    expected = sketch.matrix.copy()
    del cache
    import gc

    gc.collect()
    np.testing.assert_array_equal(sketch.matrix, expected)


def test_stats_fields_and_counts(rng):
    cfg = small_config(num_layers=2)
    cache = qjlkv.Cache(cfg)
    empty = cache.stats()
    assert empty["tokens"] == 0 and empty["bytes_used"] == 0 and np.isnan(empty["compression_ratio"])
    cache.append(0, 0, randn(rng, 100, 2, 64), randn(rng, 100, 2, 64))
    cache.append(1, 3, randn(rng, 40, 2, 64), randn(rng, 40, 2, 64))
    s = cache.stats()
    assert s["tokens"] == 140
    assert s["bytes_fp16_equivalent"] == 140 * 2 * 64 * 2 * 2
    assert s["bytes_used"] == (s["bytes_keys_quantized"] + s["bytes_values_quantized"] + s["bytes_full_precision"]
                               + s["bytes_metadata"] + s["bytes_rollback"])
    assert s["bytes_reserved"] >= s["bytes_used"]
    assert s["bits_per_number"] == pytest.approx(s["bytes_used"] * 8 / (140 * 2 * 64 * 2))
    assert s["compression_ratio"] == pytest.approx(s["bytes_fp16_equivalent"] / s["bytes_used"])
    cache.clear(0)
    assert cache.length(0, 0) == 0 and cache.stats()["tokens"] == 40


def test_qjl_memory_at_4k_tokens_is_5x_below_fp16(rng):
    """SPEC §8: >= 5x smaller than an fp16 cache at >= 4k tokens, by the library's count (of
    the stored sequence: without the exact copies kept for rollback, rollback_tokens=0)."""
    cache = qjlkv.Cache(small_config(num_layers=1, dtype="float16", rollback_tokens=0))
    keys = randn(rng, 4096, 2, 64, dtype=np.float16)
    cache.append(0, 0, keys, keys)
    stats = cache.stats()
    assert stats["compression_ratio"] >= 5, stats


def test_close_and_context_manager(rng):
    with qjlkv.Cache(small_config()) as cache:
        cache.append(0, 0, randn(rng, 2, 2, 64), randn(rng, 2, 2, 64))
        assert "qjl" in repr(cache)
    assert repr(cache) == "qjlkv.Cache(closed)"
    cache.close()  # closing twice is harmless


def test_public_callables_have_docstrings():
    for name in qjlkv.__all__:
        obj = getattr(qjlkv, name)
        if callable(obj) and not isinstance(obj, type(qjlkv.Status.OK)):
            assert obj.__doc__, name
    for name in ("append", "attend", "append_batch", "attend_batch", "scores", "reconstruct", "length", "clear",
                 "stats", "sketch", "set_stream", "set_workers", "truncate", "fork", "bytes_needed", "sequence_bytes",
                 "set_layer_attention"):
        assert getattr(qjlkv.Cache, name).__doc__, name


def test_module_namespace_is_the_api():
    public = {name for name in dir(qjlkv) if not name.startswith("_")}
    assert public - {"hf"} == set(qjlkv.__all__)
    for helper in ("np", "math", "Any", "Mapping", "Iterable", "annotations"):
        assert not hasattr(qjlkv, helper), helper


def test_help_reads_as_a_manual():
    import pydoc

    text = pydoc.render_doc(qjlkv.Cache, renderer=pydoc.plaintext)
    for section in ("Creating", "decode loop", "Tensors", "Errors", "Threads", "serialized", "closed", "Memory",
                    "Attention variants"):
        assert section in text, section
    for name in ("append", "attend", "append_batch", "attend_batch", "scores", "reconstruct", "length", "clear",
                 "stats", "sketch", "set_stream", "close", "closed", "config", "__init__"):
        assert (getattr(qjlkv.Cache, name).__doc__ or "").strip(), name
    for cls in (qjlkv.Config, qjlkv.Sketch):
        for name, member in vars(cls).items():
            if not name.startswith("_") and (callable(member) or isinstance(member, property)):
                assert (getattr(cls, name).__doc__ or "").strip(), f"{cls.__name__}.{name}"


def test_type_stubs_are_shipped():
    import importlib.resources

    files = {p.name for p in importlib.resources.files("qjlkv").iterdir()}
    # The pure-Python modules are annotated inline; the extension has its stub.
    assert {"_qjlkv.pyi", "py.typed"} <= files
