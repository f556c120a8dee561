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
library works. ``qjlkv.hf.QJLCache`` plugs the cache into Hugging Face transformers.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import numpy as np

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
    "OutOfMemory",
    "PRESETS",
    "Sketch",
    "Status",
    "Unsupported",
    "ValueMethod",
    "status_string",
    "last_error_message",
    "version_number",
    "version_string",
]

__version__: str = _qjlkv.version_string()
version_number = _qjlkv.version_number
version_string = _qjlkv.version_string
status_string = _qjlkv.status_string
last_error_message = _qjlkv.last_error_message

#: Preset names accepted by :class:`Config` (``qjlkv_config_init``).
PRESETS = ("q3", "q4", "qjl", "kivi", "ott", "exact")

_DTYPE_NAMES = {
    "float32": DType.F32, "fp32": DType.F32, "f32": DType.F32, "float": DType.F32,
    "float16": DType.F16, "fp16": DType.F16, "f16": DType.F16, "half": DType.F16,
    "bfloat16": DType.BF16, "bf16": DType.BF16,
}
_DTYPE_CANONICAL = {DType.F32: "float32", DType.F16: "float16", DType.BF16: "bfloat16"}
_KEY_METHOD_NAMES = {"qjl": KeyMethod.QJL, "kivi": KeyMethod.KIVI, "ott": KeyMethod.OTT, "exact": KeyMethod.EXACT}


def _error(cls: type, message: str) -> Error:
    err = cls(message)
    err.status = Status.INVALID_ARGUMENT
    return err


def _dtype_code(dtype: Any) -> DType:
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
            name = np.dtype(dtype).name
        except TypeError:
            raise _error(InvalidType, f"config.dtype {dtype!r} is not a dtype") from None
    if name not in _DTYPE_NAMES:
        raise _error(InvalidType, f"config.dtype is {name!r}, must be float32, float16 or bfloat16")
    return _DTYPE_NAMES[name]


def _key_method_code(method: Any) -> KeyMethod:
    if isinstance(method, KeyMethod):
        return method
    if isinstance(method, str) and method.lower() in _KEY_METHOD_NAMES:
        return _KEY_METHOD_NAMES[method.lower()]
    raise _error(InvalidArgument, f"config.key_method is {method!r}, must be one of 'qjl', 'kivi', 'ott', 'exact'")


def _device_code(device: Any) -> int:
    """-1 for the CPU, the ordinal for a CUDA device: accepts ints, "cpu", "cuda", "cuda:N"
    and torch.device."""
    if isinstance(device, (int, np.integer)) and not isinstance(device, bool):
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
    "qjl"/"kivi"/"ott"/"exact", ``device`` takes -1/"cpu" or a CUDA ordinal/"cuda:N".
    Reading ``dtype`` and ``key_method`` gives their names. Fields can also be set as
    attributes afterwards; :meth:`validate` (and :class:`Cache`) checks the whole config.
    """

    FIELDS: tuple = _qjlkv.CONFIG_FIELDS

    def __init__(self, preset: str | None = None, *, num_layers: int, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, **fields: Any) -> None:
        values = _qjlkv.config_init(preset, num_layers, num_q_heads, num_kv_heads, head_dim)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "preset", preset or "q3")  # None or "": the library's default
        for name, value in fields.items():
            setattr(self, name, value)

    @classmethod
    def _from_dict(cls, values: Mapping[str, int], preset: str | None = None) -> "Config":
        cfg = cls.__new__(cls)
        object.__setattr__(cfg, "_values", dict(values))
        object.__setattr__(cfg, "preset", preset)
        return cfg

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values")
        if values is None or name not in values:
            raise AttributeError(f"Config has no field {name!r}")
        if name == "dtype":
            return _DTYPE_CANONICAL[DType(values[name])]
        if name == "key_method":
            return KeyMethod(values[name]).name.lower()
        return values[name]

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._values:
            raise _error(InvalidType, f"config has no field {name!r}; fields: {', '.join(self.FIELDS)}")
        if name == "dtype":
            value = _dtype_code(value)
        elif name == "key_method":
            value = _key_method_code(value)
        elif name == "device":
            value = _device_code(value)
        self._values[name] = int(value) if isinstance(value, (bool, np.integer)) else value

    def to_dict(self) -> dict:
        """The fields as the C struct holds them (dtype and key_method as integers)."""
        return dict(self._values)

    def validate(self) -> None:
        """``qjlkv_config_validate``: raises qjlkv.InvalidArgument naming the first wrong field."""
        _qjlkv.config_validate(self._values)

    def replace(self, **fields: Any) -> "Config":
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


def _new_like(tensor: Any) -> Any:
    """An uninitialized array of ``tensor``'s kind, shape, dtype and device."""
    if isinstance(tensor, np.ndarray):
        return np.empty(tensor.shape, dtype=tensor.dtype)
    if type(tensor).__module__.startswith("torch"):
        import torch

        return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    if hasattr(tensor, "__array_namespace__"):
        return tensor.__array_namespace__().empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    raise _error(InvalidType, f"queries is a {type(tensor).__name__}; expected a numpy array or a DLPack tensor")


def _scale_arg(scale: float | None) -> float:
    # The C library reads scale <= 0 as "1/sqrt(head_dim)".
    return 0.0 if scale is None else float(scale)


class Cache:
    """A compressed KV cache (``qjlkv_cache``) for one model: every layer, any number of
    sequences (caller-chosen uint32 ids).

    Shapes: keys/values ``(n_tokens, num_kv_heads, head_dim)``, queries/outputs
    ``(n_queries, num_q_heads, head_dim)``; a 2-D ``(heads, head_dim)`` array is one token.
    All tensors must have the cache's dtype and live on its device.
    """

    def __init__(self, config: Config) -> None:
        if not isinstance(config, Config):
            raise _error(InvalidType, f"config is a {type(config).__name__}; expected qjlkv.Config")
        self._handle = _qjlkv.Cache(config.to_dict())
        self._preset = config.preset

    @property
    def config(self) -> Config:
        """A copy of the configuration the cache was created with (``qjlkv_cache_config``)."""
        return Config._from_dict(self._handle.config(), self._preset)

    def append(self, layer: int, seq: int, keys: Any, values: Any) -> None:
        """``qjlkv_cache_append``: appends ``len(keys)`` tokens to sequence ``seq`` of ``layer``."""
        self._handle.append(layer, seq, keys, values)

    def attend(self, layer: int, seq: int, queries: Any, scale: float | None = None, *, out: Any = None) -> Any:
        """``qjlkv_cache_attend``: attention of the last ``len(queries)`` positions (causal
        among themselves); returns an array of the queries' kind, shape and dtype (or fills
        ``out``). ``scale=None`` means 1/sqrt(head_dim)."""
        if out is None:
            out = _new_like(queries)
        self._handle.attend(layer, seq, queries, _scale_arg(scale), out)
        return out

    def append_batch(self, layer: int, seqs: Iterable[int], keys: Any, values: Any) -> None:
        """``qjlkv_cache_append_batch``: one token for each of the distinct sequences ``seqs``;
        keys/values ``(len(seqs), num_kv_heads, head_dim)``. All or nothing."""
        self._handle.append_batch(layer, seqs, keys, values)

    def attend_batch(self, layer: int, seqs: Iterable[int], queries: Any, scale: float | None = None, *,
                     out: Any = None) -> Any:
        """``qjlkv_cache_attend_batch``: one query token for each of ``seqs``; queries and the
        result ``(len(seqs), num_q_heads, head_dim)``."""
        if out is None:
            out = _new_like(queries)
        self._handle.attend_batch(layer, seqs, queries, _scale_arg(scale), out)
        return out

    def scores(self, layer: int, seq: int, query: Any) -> np.ndarray:
        """``qjlkv_cache_scores``: raw estimated logits <q, k> (no scale, no softmax) of one query
        token ``(num_q_heads, head_dim)`` against every cached position: numpy float32
        ``(num_q_heads, length)``."""
        return self._handle.scores(layer, seq, query)

    def reconstruct(self, layer: int, seq: int, first: int = 0, count: int | None = None, *, keys: bool = True,
                    values: bool = True) -> tuple[np.ndarray | None, np.ndarray | None]:
        """``qjlkv_cache_reconstruct``: the dense reconstruction of positions
        ``[first, first + count)`` (``count=None``: to the end) as numpy float32 arrays
        ``(count, num_kv_heads, head_dim)``: keys whose dot product with any query equals the
        score the attention uses (k-hat of SPEC section 3 for QJL), dequantized values; exact
        tail tokens. ``keys=False`` / ``values=False`` skip one (returned as None)."""
        return self._handle.reconstruct(layer, seq, first, count, keys, values)

    def length(self, layer: int, seq: int) -> int:
        """``qjlkv_cache_length``: positions appended to (layer, seq)."""
        return self._handle.length(layer, seq)

    def clear(self, seq: int) -> None:
        """``qjlkv_cache_clear_sequence``: drops every layer of ``seq`` and frees its memory."""
        self._handle.clear(seq)

    def stats(self) -> dict:
        """``qjlkv_cache_stats`` as a dict, plus ``compression_ratio`` =
        bytes_fp16_equivalent / bytes_used (``nan`` when empty)."""
        stats = self._handle.stats()
        used = stats["bytes_used"]
        stats["compression_ratio"] = stats["bytes_fp16_equivalent"] / used if used else math.nan
        return stats

    def sketch(self, layer: int) -> Sketch:
        """``qjlkv_cache_sketch``: the sketch ``layer`` uses (keeps the cache alive). Raises
        qjlkv.Unsupported unless the key method is QJL."""
        return self._handle.sketch(layer)

    def set_stream(self, stream: Any) -> None:
        """``qjlkv_cache_set_stream``: orders a CUDA cache's work on ``stream`` (a
        torch.cuda.Stream, an integer cudaStream_t, or None for the default stream)."""
        self._handle.set_stream(getattr(stream, "cuda_stream", stream))

    def close(self) -> None:
        """Frees the cache now (also done when it is garbage collected)."""
        self._handle.close()

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._handle.closed:
            return "qjlkv.Cache(closed)"
        cfg = self.config
        return (f"qjlkv.Cache(preset={cfg.preset!r}, key_method={cfg.key_method!r}, layers={cfg.num_layers}, "
                f"heads={cfg.num_q_heads}/{cfg.num_kv_heads}, head_dim={cfg.head_dim}, dtype={cfg.dtype!r}, "
                f"device={cfg.device})")
