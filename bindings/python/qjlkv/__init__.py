"""qjlkv: a compressed LLM key/value cache with attention computed on the compressed form.

Thin bindings of libqjlkv's C ABI (``include/qjlkv/qjlkv.h``, the manual):

>>> import numpy as np, qjlkv
>>> cache = qjlkv.Cache(qjlkv.Config("qjl", num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=64))
>>> keys = np.random.randn(100, 2, 64).astype(np.float32)     # (n_tokens, num_kv_heads, head_dim)
>>> cache.append(0, 0, keys, keys)
>>> out = cache.attend(0, 0, np.random.randn(8, 64).astype(np.float32))   # (num_q_heads, head_dim)

Tensors are numpy arrays (float32, float16, ml_dtypes.bfloat16) or torch tensors on the CPU
or a CUDA device (any DLPack producer). They are passed to the library without copies, so
they must already be contiguous, of the cache's dtype and on its device; otherwise a
``qjlkv.Error`` subclass says which argument is wrong. The GIL is released while the
library works; one ``Cache`` may be shared by threads (its calls run one at a time).
``qjlkv.hf.QJLCache`` plugs the cache into Hugging Face transformers.

The API: ``Config``, ``Cache``, ``Sketch``, ``Workers``, ``PRESETS``, the error classes (``Error`` and
its subclasses), the enums ``Status``/``DType``/``KeyMethod`` and the C library's
``version_number``/``version_string``/``status_string``/``last_error_message``.
"""

# Only the API is bound at module level: helpers are imported under private names.
import math as _math
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import Any as _Any

import numpy as _np

from . import _qjlkv
from ._qjlkv import (
    CorruptData,
    DeviceError,
    DType,
    Error,
    InternalError,
    InvalidArgument,
    InvalidType,
    KeyMethod,
    MemoryBudgetError,
    OutOfMemory,
    Status,
    Unsupported,
    ValueMethod,
)

__all__ = [
    "Cache",
    "Config",
    "CorruptData",
    "DType",
    "DeviceError",
    "Error",
    "InternalError",
    "InvalidArgument",
    "InvalidType",
    "KeyMethod",
    "MemoryBudgetError",
    "OutOfMemory",
    "PRESETS",
    "Sketch",
    "Status",
    "Unsupported",
    "ValueMethod",
    "Workers",
    "status_string",
    "last_error_message",
    "version_number",
    "version_string",
]

__version__: str = _qjlkv.version_string()


def __dir__() -> list:
    # The private helpers below stay reachable, but dir() and completion show the API only.
    return sorted([*__all__, "__version__", "__doc__", "__file__", "__name__", "__path__"])


version_number = _qjlkv.version_number
version_string = _qjlkv.version_string
status_string = _qjlkv.status_string
last_error_message = _qjlkv.last_error_message

#: Preset names accepted by :class:`Config` (``qjlkv_config_init``).
PRESETS = ("q2", "q3", "q4", "qjl", "kivi", "ott", "exact")

_DTYPE_NAMES = {
    "float32": DType.F32, "fp32": DType.F32, "f32": DType.F32, "float": DType.F32,
    "float16": DType.F16, "fp16": DType.F16, "f16": DType.F16, "half": DType.F16,
    "bfloat16": DType.BF16, "bf16": DType.BF16,
}
_DTYPE_CANONICAL = {DType.F32: "float32", DType.F16: "float16", DType.BF16: "bfloat16"}
_KEY_METHOD_NAMES = {"qjl": KeyMethod.QJL, "kivi": KeyMethod.KIVI, "ott": KeyMethod.OTT, "exact": KeyMethod.EXACT,
                     "mixed": KeyMethod.MIXED}


def _error(cls: type, message: str) -> Error:
    err = cls(message)
    err.status = Status.INVALID_ARGUMENT
    return err


def _dtype_code(dtype: _Any) -> DType:
    """A ``qjlkv.DType`` for a name ("float32", "float16", "bfloat16"), a numpy or
    ml_dtypes dtype, or a torch dtype."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, str):
        name = dtype.lower()
    elif type(dtype).__module__ == "torch":  # torch.float16 prints as "torch.float16"
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            name = _np.dtype(dtype).name
        except TypeError:
            raise _error(InvalidType, f"config.dtype {dtype!r} is not a dtype") from None
    if name not in _DTYPE_NAMES:
        raise _error(InvalidType, f"config.dtype is {name!r}, must be float32, float16 or bfloat16")
    return _DTYPE_NAMES[name]


def _key_method_code(method: _Any) -> KeyMethod:
    if isinstance(method, KeyMethod):
        return method
    if isinstance(method, str) and method.lower() in _KEY_METHOD_NAMES:
        return _KEY_METHOD_NAMES[method.lower()]
    raise _error(InvalidArgument, f"config.key_method is {method!r}, must be one of {', '.join(map(repr, _KEY_METHOD_NAMES))}")


def _device_code(device: _Any) -> int:
    """-1 for the CPU, the ordinal for a CUDA device: accepts ints, "cpu", "cuda", "cuda:N"
    and torch.device."""
    if isinstance(device, (int, _np.integer)) and not isinstance(device, bool):
        return int(device)
    text = str(device)
    if text == "cpu":
        return -1
    if text == "cuda":
        return 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise _error(InvalidArgument, f"config.device is {device!r}, must be -1/'cpu' or a CUDA ordinal/'cuda:N'")


class Config:
    """A cache configuration (``qjlkv_config``): a preset's defaults, then any field changed.

    ``Config(preset="qjl", num_layers=..., num_q_heads=..., num_kv_heads=..., head_dim=..., **fields)``

    The fields are those of ``qjlkv_config`` (see ``Config.FIELDS``); ``dtype`` takes
    "float32"/"float16"/"bfloat16" or a numpy/torch dtype, ``key_method`` takes
    "qjl"/"kivi"/"ott"/"exact"/"mixed", ``device`` takes -1/"cpu" or a CUDA ordinal/"cuda:N".
    Reading ``dtype`` and ``key_method`` gives their names. Fields can also be set as
    attributes afterwards; :meth:`validate` (and :class:`Cache`) checks the whole config.
    """

    FIELDS: tuple = _qjlkv.CONFIG_FIELDS

    def __init__(self, preset: str | None = None, *, num_layers: int, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, **fields: _Any) -> None:
        values = _qjlkv.config_init(preset, num_layers, num_q_heads, num_kv_heads, head_dim)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "preset", preset or "q3")  # None or "": the library's default
        for name, value in fields.items():
            setattr(self, name, value)

    @classmethod
    def _from_dict(cls, values: _Mapping[str, int], preset: str | None = None) -> "Config":
        cfg = cls.__new__(cls)
        object.__setattr__(cfg, "_values", dict(values))
        object.__setattr__(cfg, "preset", preset)
        return cfg

    def __getattr__(self, name: str) -> _Any:
        values = self.__dict__.get("_values")
        if values is None or name not in values:
            raise AttributeError(f"Config has no field {name!r}")
        if name == "dtype":
            return _DTYPE_CANONICAL[DType(values[name])]
        if name == "key_method":
            return KeyMethod(values[name]).name.lower()
        return values[name]

    def __setattr__(self, name: str, value: _Any) -> None:
        if name not in self._values:
            raise _error(InvalidType, f"config has no field {name!r}; fields: {', '.join(self.FIELDS)}")
        if name == "dtype":
            value = _dtype_code(value)
        elif name == "key_method":
            value = _key_method_code(value)
        elif name == "device":
            value = _device_code(value)
        self._values[name] = int(value) if isinstance(value, (bool, _np.integer)) else value

    def to_dict(self) -> dict:
        """The fields as the C struct holds them (dtype and key_method as integers)."""
        return dict(self._values)

    def validate(self) -> None:
        """``qjlkv_config_validate``: raises qjlkv.InvalidArgument naming the first wrong field."""
        _qjlkv.config_validate(self._values)

    def replace(self, **fields: _Any) -> "Config":
        """A copy with some fields changed."""
        cfg = Config._from_dict(self._values, self.preset)
        for name, value in fields.items():
            setattr(cfg, name, value)
        return cfg

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._values == other._values

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.FIELDS)
        return f"Config(preset={self.preset!r}, {fields})"


#: The QJL sketch (``qjlkv_sketch``): ``Sketch(head_dim, sketch_dim, seed=0, orthogonal=True)``.
Sketch = _qjlkv.Sketch

#: CPU worker threads several caches can share (``qjlkv_workers_create``):
#: ``Workers(num_threads=0)``, 0 = the cores available; see :meth:`Cache.set_workers`.
Workers = _qjlkv.Workers


def _sink_logits(sink_logits: _Any) -> _np.ndarray | None:
    """None, or ``sink_logits`` (a 1-D array-like of numbers: numpy, a torch tensor on any
    device, a list) as a contiguous float32 host array; the extension checks its length."""
    if sink_logits is None:
        return None
    if type(sink_logits).__module__.startswith("torch"):
        import torch

        if not isinstance(sink_logits, torch.Tensor):
            raise _error(InvalidType, f"sink_logits is a {type(sink_logits).__name__}; expected a 1-D array of numbers")
        if sink_logits.is_complex() or sink_logits.dtype == torch.bool:
            raise _error(InvalidType, f"sink_logits has dtype {sink_logits.dtype}; expected real numbers")
        return _np.ascontiguousarray(sink_logits.detach().to(device="cpu", dtype=torch.float32).numpy())
    if isinstance(sink_logits, (str, bytes)):
        raise _error(InvalidType, f"sink_logits is a {type(sink_logits).__name__}; expected a 1-D array of numbers")
    try:
        array = _np.asarray(sink_logits)
    except (TypeError, ValueError) as e:
        raise _error(InvalidType, f"sink_logits cannot be read as an array: {e}") from None
    if array.dtype.kind not in "fiu" and array.dtype.name != "bfloat16":
        raise _error(InvalidType, f"sink_logits has dtype {array.dtype.name}; expected real numbers")
    with _np.errstate(over="ignore"):  # beyond float32: infinite, which the library refuses by index
        return _np.ascontiguousarray(array, dtype=_np.float32)


def _new_like(tensor: _Any) -> _Any:
    """An uninitialized array of ``tensor``'s kind, shape, dtype and device."""
    if isinstance(tensor, _np.ndarray):
        return _np.empty(tensor.shape, dtype=tensor.dtype)
    if type(tensor).__module__.startswith("torch"):
        import torch

        return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    if hasattr(tensor, "__array_namespace__"):
        return tensor.__array_namespace__().empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    raise _error(InvalidType, f"queries is a {type(tensor).__name__}; expected a numpy array or a DLPack tensor")


class Cache:
    """A compressed KV cache (``qjlkv_cache``) for one model: every layer, any number of
    sequences (caller-chosen uint32 ids, created on first append).

    Creating::

        cfg = qjlkv.Config("qjl", num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128,
                           dtype="float16")
        cache = qjlkv.Cache(cfg)          # or: with qjlkv.Cache(cfg) as cache: ...

    A decode loop (per layer ``l``, sequence ``s``; keys after RoPE)::

        cache.append(l, s, prompt_keys, prompt_values)     # prefill: (n, num_kv_heads, head_dim)
        out = cache.attend(l, s, prompt_queries)           # causal among the last n positions
        cache.append(l, s, k_new, v_new)                   # each step: one token (num_kv_heads, head_dim)
        out = cache.attend(l, s, q_new)                    # (num_q_heads, head_dim)

    Tensors: numpy arrays (float32, float16, ``ml_dtypes.bfloat16``) or DLPack tensors (torch
    on the CPU or CUDA), contiguous, of the cache's dtype and on its device; they are never
    copied or converted. keys/values are ``(n_tokens, num_kv_heads, head_dim)``,
    queries/outputs ``(n_queries, num_q_heads, head_dim)``; a 2-D ``(heads, head_dim)`` array
    is one token.

    Errors: every method raises a ``qjlkv.Error`` subclass naming the bad argument
    (``InvalidArgument``, a ValueError; ``InvalidType``, also a TypeError; ``OutOfMemory``;
    ``MemoryBudgetError``, when ``config.memory_budget`` would be exceeded; ``Unsupported``;
    ``DeviceError``), and a failed call changes nothing.

    Sequence operations (what serving engines do besides appending)::

        cache.append(l, s, draft_k, draft_v)    # speculative decoding: k draft tokens...
        cache.truncate(s, accepted)             # ...and back to the accepted length, exactly
        cache.fork(s, s2)                       # s2 shares s's compressed blocks (beams, n > 1)
        cache.bytes_needed(s, 128)              # admission control, exact
        cache.sequence_bytes(s)                 # (bytes, shared) per sequence

    ``config.rollback_tokens`` (32 in every preset) is how far a truncate is exact;
    ``config.memory_budget`` (0 = none) caps ``stats()["bytes_used"]``.

    Attention variants, per layer (Gemma 2's logit soft-capping, gpt-oss's sink logits)::

        cache.set_layer_attention(l, logit_softcap=50.0)         # logits c * tanh(s / c)
        cache.set_layer_attention(l, sink_logits=module.sinks)   # (num_q_heads,)

    Threads: the GIL is released while the library works. Calls on one cache from several
    threads are serialized (each waits for the one in flight); different caches run in
    parallel. ``close()`` waits for a call in flight, and any call after it raises
    ``InvalidArgument("the cache is closed")``. Caches may share one set of worker
    threads (:class:`Workers`, :meth:`set_workers`).

    Memory: ``stats()`` is the library's own count of every stored byte.
    """

    def __init__(self, config: Config) -> None:
        """Creates the cache (``qjlkv_cache_create``) from a :class:`Config`; the config is
        validated first (``InvalidArgument`` names the first wrong field)."""
        if not isinstance(config, Config):
            raise _error(InvalidType, f"config is a {type(config).__name__}; expected qjlkv.Config")
        self._handle = _qjlkv.Cache(config.to_dict())
        self._preset = config.preset

    @property
    def config(self) -> Config:
        """A copy of the configuration the cache was created with (``qjlkv_cache_config``)."""
        return Config._from_dict(self._handle.config(), self._preset)

    def set_layer_attention(self, layer: int, logit_softcap: float = 0.0, sink_logits: _Any = None,
                            window_tokens: int = 0) -> None:
        """Sets how ``layer``'s attention departs from softmax(scale * q K^T) V, for every later
        :meth:`attend` and :meth:`attend_batch` on it (``qjlkv_cache_set_layer_attention``):

        * ``logit_softcap`` c > 0: every logit s = scale * <q, k> becomes c * tanh(s / c) before
          the softmax (Gemma 2's ``attn_logit_softcapping``); 0 = none. Finite and >= 0.
        * ``sink_logits``: None, or ``num_q_heads`` finite logits, one per query head h (a 1-D
          numpy array, torch tensor on any device, or list; read once as float32 and copied):
          exp(sink_logits[h]) joins head h's softmax denominator and attends to no value
          (gpt-oss's learned sinks), so the weights sum to less than 1.
        * ``window_tokens`` W > 0: a sliding window: the query at position p attends to positions
          [p - W + 1, p] only (Gemma's, Mistral's local layers); 0 = every position. It changes
          only while the layer holds no tokens.

        Every layer starts plain; ``set_layer_attention(layer)`` (no soft-cap, no sinks) makes
        it plain again. The stored bytes do not change: :meth:`scores` still gives the raw
        <q, k>, and export/import carry no variant (set it on the importing cache). Raises
        InvalidArgument naming the argument (``layer`` out of range, ``logit_softcap`` negative
        or not finite, ``sink_logits`` of another length or with a non-finite entry, named by
        its index, ``window_tokens`` changed while the layer holds tokens) and InvalidType (not
        numbers); the layer is then unchanged."""
        self._handle.set_layer_attention(layer, logit_softcap, _sink_logits(sink_logits), window_tokens)

    def append(self, layer: int, seq: int, keys: _Any, values: _Any) -> None:
        """Appends tokens to sequence ``seq`` of ``layer`` (``qjlkv_cache_append``).

        keys, values: ``(n_tokens, num_kv_heads, head_dim)`` or ``(num_kv_heads, head_dim)``
        for one token, finite (and within the fp16 range where fp16 is stored). All or
        nothing: on error the sequence is unchanged.
        """
        self._handle.append(layer, seq, keys, values)

    def attend(self, layer: int, seq: int, queries: _Any, scale: float | None = None, *, out: _Any = None) -> _Any:
        """Attention of the last ``n_queries`` positions of (layer, seq) on the compressed
        cache (``qjlkv_cache_attend``): softmax(scale * q K^T) V, causal among the queries,
        with the layer's soft-cap and sinks if :meth:`set_layer_attention` set them.

        queries: ``(n_queries, num_q_heads, head_dim)`` or ``(num_q_heads, head_dim)``;
        n_queries <= length. scale: a finite number > 0, or None for 1/sqrt(head_dim).
        out: where to write the result (same shape, dtype and device as queries); by default
        a new array of the queries' kind. Returns out.
        """
        if out is None:
            out = _new_like(queries)
        self._handle.attend(layer, seq, queries, scale, out)
        return out

    def append_batch(self, layer: int, seqs: _Iterable[int], keys: _Any, values: _Any) -> None:
        """Appends one token to each of the distinct sequences ``seqs``
        (``qjlkv_cache_append_batch``): keys/values ``(len(seqs), num_kv_heads, head_dim)``.
        All or nothing."""
        self._handle.append_batch(layer, seqs, keys, values)

    def attend_batch(self, layer: int, seqs: _Iterable[int], queries: _Any, scale: float | None = None, *,
                     out: _Any = None) -> _Any:
        """One decode query per sequence (``qjlkv_cache_attend_batch``): queries and the result
        ``(len(seqs), num_q_heads, head_dim)``; ``scale`` and ``out`` as in :meth:`attend`."""
        if out is None:
            out = _new_like(queries)
        self._handle.attend_batch(layer, seqs, queries, scale, out)
        return out

    def scores(self, layer: int, seq: int, query: _Any) -> _np.ndarray:
        """Diagnostic (``qjlkv_cache_scores``): the raw estimated logits <q, k> (no scale, no
        softmax) of one query token ``(num_q_heads, head_dim)`` against every cached position,
        as numpy float32 ``(num_q_heads, length)``."""
        return self._handle.scores(layer, seq, query)

    def reconstruct(self, layer: int, seq: int, first: int = 0, count: int | None = None, *, keys: bool = True,
                    values: bool = True) -> tuple[_np.ndarray | None, _np.ndarray | None]:
        """The dense reconstruction of positions ``[first, first + count)`` (``count=None``:
        to the end) as numpy float32 arrays ``(count, num_kv_heads, head_dim)``
        (``qjlkv_cache_reconstruct``): keys whose dot product with any query equals the score
        the attention uses (k-hat of SPEC section 3 for QJL), dequantized values, exact tail
        tokens. ``keys=False`` / ``values=False`` skip one (returned as None)."""
        return self._handle.reconstruct(layer, seq, first, count, keys, values)

    def length(self, layer: int, seq: int) -> int:
        """The number of positions appended to (layer, seq) (``qjlkv_cache_length``); 0 for a
        sequence never used."""
        return self._handle.length(layer, seq)

    def clear(self, seq: int) -> None:
        """Drops every layer of sequence ``seq`` and frees its memory
        (``qjlkv_cache_clear_sequence``); the id can be reused."""
        self._handle.clear(seq)

    def truncate(self, seq: int, length: int) -> None:
        """Keeps the first ``min(length, its length)`` positions of every layer of ``seq``
        (``qjlkv_cache_truncate``). Exact (as if the dropped positions had never been appended)
        when it goes back at most ``config.rollback_tokens`` positions from the longest length
        the sequence had since its last deeper truncate: speculative decoding's rollback. Deeper,
        the kept positions that must reopen are their reconstruction (see the header).
        ``length`` 0 empties the sequence. Raises InvalidArgument when ``length`` is above the
        sequence's longest layer; never MemoryBudgetError."""
        self._handle.truncate(seq, length)

    def fork(self, src_seq: int, dst_seq: int, length: int | None = None) -> None:
        """The empty sequence ``dst_seq`` becomes the first ``length`` positions of
        ``src_seq`` in every layer (``qjlkv_cache_fork``; None = all of it), sharing its
        compressed blocks (copy-on-write: later operations on one never change the other;
        only exact rows are copied). A whole fork decodes exactly as a sequence fed the same
        tokens. Raises InvalidArgument (``dst_seq`` not empty or equal to ``src_seq``, ``length``
        above ``src_seq``'s), MemoryBudgetError; nothing changes then."""
        self._handle.fork(src_seq, dst_seq, length)

    def bytes_needed(self, seq: int, n_tokens: int) -> int:
        """The bytes by which ``stats()["bytes_used"]`` grows when ``n_tokens`` more tokens
        are appended to ``seq`` in every layer (``qjlkv_cache_bytes_needed``): exact, for
        admission control against ``config.memory_budget``; 0 when the append frees more than
        it takes (rollback copies of blocks that fall below the rollback floor)."""
        return self._handle.bytes_needed(seq, n_tokens)

    def sequence_bytes(self, seq: int) -> tuple[int, int]:
        """``(bytes, shared)`` of sequence ``seq``, all layers (``qjlkv_cache_sequence_bytes``):
        everything it references, and the part another sequence holds too (clearing ``seq``
        frees ``bytes - shared``). ``(0, 0)`` for a sequence holding nothing."""
        return self._handle.sequence_bytes(seq)

    def stats(self) -> dict:
        """Memory statistics (``qjlkv_cache_stats``) as a dict: tokens, bytes_used,
        bytes_reserved, bytes_fp16_equivalent, bits_per_number, bytes_keys_quantized,
        bytes_values_quantized, bytes_full_precision, bytes_metadata, bytes_rollback (exact
        copies kept for exact truncation, a part of bytes_used), bytes_shared (the part of
        bytes_used that several sequences hold, counted once), plus ``compression_ratio`` =
        bytes_fp16_equivalent / bytes_used (``nan`` when empty)."""
        stats = self._handle.stats()
        used = stats["bytes_used"]
        stats["compression_ratio"] = stats["bytes_fp16_equivalent"] / used if used else _math.nan
        return stats

    def _layer_range(self, first_layer: int, num_layers: int | None) -> tuple[int, int]:
        if num_layers is None:
            num_layers = self.config.num_layers - first_layer
        return first_layer, num_layers

    def export_bytes(self, seq: int, first_layer: int = 0, num_layers: int | None = None) -> bytes:
        """``qjlkv_cache_export``: sequence ``seq`` (layers ``[first_layer, first_layer +
        num_layers)``, default all) as the stream of docs/FORMAT.md."""
        return self._handle.export_bytes(seq, *self._layer_range(first_layer, num_layers))

    def export_to(self, file: _Any, seq: int, first_layer: int = 0, num_layers: int | None = None) -> int:
        """``qjlkv_cache_export_stream``: writes the stream to ``file`` (anything with
        ``write(bytes)``) in pieces of at most 64 KiB, never holding it whole; returns the bytes
        written. An exception raised by ``write`` propagates."""
        return self._handle.export_to(seq, *self._layer_range(first_layer, num_layers), file.write)

    def import_bytes(self, seq: int, data: _Any) -> None:
        """``qjlkv_cache_import``: imports a stream held in ``data`` (bytes, bytearray,
        memoryview, mmap or any C-contiguous buffer; read in place) into sequence ``seq``, which
        must be empty in the stream's layers. Raises qjlkv.CorruptData for damaged streams,
        qjlkv.InvalidArgument for mismatched configs; the cache is then unchanged."""
        self._handle.import_bytes(seq, data)

    def import_from(self, file: _Any, seq: int) -> None:
        """``qjlkv_cache_import_stream``: reads one stream from ``file`` (``readinto`` or
        ``read``), exactly its bytes, so streams written one after another are read one per
        call."""
        self._handle.import_from(seq, file)

    def sketch(self, layer: int) -> Sketch:
        """The QJL sketch ``layer`` uses (``qjlkv_cache_sketch``); it keeps this object alive
        and raises once the cache is closed. Raises qjlkv.Unsupported unless the key method
        is QJL."""
        return self._handle.sketch(layer)

    def set_stream(self, stream: _Any) -> None:
        """Orders a CUDA cache's work on ``stream`` (``qjlkv_cache_set_stream``): a
        torch.cuda.Stream, an integer cudaStream_t, or None for the default stream."""
        self._handle.set_stream(getattr(stream, "cuda_stream", stream))

    def set_workers(self, workers: Workers | None) -> None:
        """Runs this CPU cache's parallel work on shared ``workers`` from the next call on
        (``qjlkv_cache_set_workers``); None goes back to its own ``num_threads`` threads. Give
        caches that will share workers ``num_threads=1`` so they start no threads of their own.
        Raises qjlkv.Unsupported for workers on a CUDA cache."""
        self._handle.set_workers(workers)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._handle.closed

    def close(self) -> None:
        """Frees the cache now (``qjlkv_cache_destroy``; also done when the object is garbage
        collected). Waits for a call in flight on another thread; later calls raise
        ``InvalidArgument``. Closing twice is harmless."""
        self._handle.close()

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "qjlkv.Cache(closed)"
        cfg = self.config
        return (f"qjlkv.Cache(preset={cfg.preset!r}, key_method={cfg.key_method!r}, layers={cfg.num_layers}, "
                f"heads={cfg.num_q_heads}/{cfg.num_kv_heads}, head_dim={cfg.head_dim}, dtype={cfg.dtype!r}, "
                f"device={cfg.device})")
