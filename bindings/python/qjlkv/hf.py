"""Hugging Face transformers integration: a ``Cache`` backed by libqjlkv.

>>> from qjlkv.hf import QJLCache
>>> out = model.generate(**inputs, cache=QJLCache(model.config, preset="qjl"))

(``cache=`` is the spelling of transformers 5.x; ``past_key_values=`` still works there, with
a FutureWarning that it goes away in 6.0.) ``examples/hf_generate.py`` runs this on
SmolLM2-135M.

Works with Llama-family decoders (GQA included; RoPE is applied before keys reach the
cache). Batch row ``b`` is the library's sequence ``b``.

Two ways to attend:

* Any attention implementation transformers ships (``sdpa``, ``eager``, ``flex``...): the
  prompt attends to its exact keys and values, and every decoding step gets back the dense
  reconstruction of the compressed cache from ``qjlkv_cache_reconstruct`` — keys k-hat
  whose dot products with any query equal the QJL estimates exactly, and dequantized
  values — so the model sees exactly what the compressed cache holds.
* The ``"qjlkv"`` attention function (``use_qjlkv_attention(model)``): decoding steps call
  the library's fused attention on the compressed bytes; nothing dense is materialized.

``QJLCache.stats()`` is the library's own memory count.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import qjlkv

__all__ = ["ATTENTION_NAME", "QJLCache", "qjlkv_attention_forward", "use_qjlkv_attention"]

#: The name under which the fused attention is registered in transformers' AttentionInterface.
ATTENTION_NAME = "qjlkv"


def _unsupported(message: str) -> qjlkv.Unsupported:
    err = qjlkv.Unsupported(message)
    err.status = qjlkv.Status.UNSUPPORTED
    return err


def _invalid(message: str) -> qjlkv.InvalidArgument:
    err = qjlkv.InvalidArgument(message)
    err.status = qjlkv.Status.INVALID_ARGUMENT
    return err


class _Handoff(threading.local):
    """What the last ``update`` of this thread left for the fused attention function, which
    transformers calls right after it with the same layer but without the cache."""

    cache: "QJLCache | None" = None
    layer: int = -1
    prefill: bool = False


_HANDOFF = _Handoff()


class QJLLayer(CacheLayerMixin):
    """One decoder layer's view of the shared library cache."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: "QJLCache", layer_idx: int) -> None:
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Notes the dtype and device of the first keys (the library cache is the owner's)."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Appends this step's keys and values (batch, kv_heads, tokens, head_dim) to the
        library cache; returns what the attention should see (see QJLCache)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._owner._update(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the attention mask for ``query_length`` new tokens."""
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Positions cached for this layer (of sequence 0)."""
        return self._owner._length(self.layer_idx)

    def get_max_length(self) -> int:
        """-1: the cache grows without a set limit."""
        return -1

    def reset(self) -> None:
        """Clears every sequence of the whole cache (all layers share the library cache)."""
        self._owner.reset()

    def offload(self) -> None:
        """Unsupported: the compressed cache lives in the library."""
        raise _unsupported("QJLCache does not offload: the compressed cache lives in the library")

    def prefetch(self) -> None:
        """Unsupported: the compressed cache lives in the library."""
        raise _unsupported("QJLCache does not offload: the compressed cache lives in the library")

    def crop(self, tokens_to_remove: int) -> None:
        """Only a no-op crop (0 tokens) is supported: cached tokens cannot be dropped."""
        if tokens_to_remove != 0:
            raise _unsupported("QJLCache cannot drop cached tokens (assisted decoding / crop)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Only the identity order is supported (no beam search)."""
        if not torch.equal(beam_idx.cpu(), torch.arange(len(beam_idx))):
            raise _unsupported("QJLCache cannot reorder sequences (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Only repeats=1 is supported."""
        if repeats != 1:
            raise _unsupported("QJLCache cannot repeat sequences (num_return_sequences / beams > 1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Unsupported (contrastive search)."""
        raise _unsupported("QJLCache cannot select sequences (contrastive search)")


class QJLCache(Cache):
    """A transformers ``Cache`` whose keys and values live compressed in a ``qjlkv.Cache``.

    ``QJLCache(model.config, preset="qjl", **fields)``: ``fields`` are ``qjlkv.Config`` fields
    (e.g. ``seed=1``, ``value_bits=4``). The library cache is created on the first update,
    with the dtype and device of the model's keys unless ``dtype``/``device`` are given.
    """

    def __init__(self, config: Any, preset: str = "qjl", **fields: Any) -> None:
        text = config.get_text_config(decoder=True)
        self._text_config = text
        self._num_layers = text.num_hidden_layers
        self._num_q_heads = text.num_attention_heads
        self._num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self._head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self._preset = preset
        self._fields = dict(fields)
        # Fails now, not at the first forward, on a bad preset or field.
        qjlkv.Config(preset, num_layers=self._num_layers, num_q_heads=self._num_q_heads,
                     num_kv_heads=self._num_kv_heads, head_dim=self._head_dim, **self._fields).validate()
        self._lib: qjlkv.Cache | None = None
        self._batch = 0
        super().__init__(layers=[QJLLayer(self, i) for i in range(self._num_layers)])

    # -- the library cache -------------------------------------------------------------------
    @property
    def library_cache(self) -> qjlkv.Cache | None:
        """The underlying ``qjlkv.Cache`` (None before the first update)."""
        return self._lib

    def _create(self, key_states: torch.Tensor) -> None:
        fields = dict(self._fields)
        fields.setdefault("dtype", key_states.dtype)
        fields.setdefault("device", -1 if key_states.device.type == "cpu" else key_states.device.index or 0)
        cfg = qjlkv.Config(self._preset, num_layers=self._num_layers, num_q_heads=self._num_q_heads,
                           num_kv_heads=self._num_kv_heads, head_dim=self._head_dim, **fields)
        self._lib = qjlkv.Cache(cfg)
        if key_states.is_cuda:
            self._lib.set_stream(torch.cuda.current_stream(key_states.device))

    def _length(self, layer: int) -> int:
        return 0 if self._lib is None or self._batch == 0 else self._lib.length(layer, 0)

    def _fused(self) -> bool:
        return getattr(self._text_config, "_attn_implementation", None) == ATTENTION_NAME

    def _update(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        batch, kv_heads, tokens, head_dim = key_states.shape
        if (kv_heads, head_dim) != (self._num_kv_heads, self._head_dim):
            raise _invalid(
                f"key_states has shape {tuple(key_states.shape)}, expected (batch, {self._num_kv_heads}, tokens, "
                f"{self._head_dim}) from the model config")
        if self._lib is None:
            self._create(key_states)
        past = self._length(layer)
        if self._batch != batch:
            if any(self._length(l) for l in range(self._num_layers)):
                raise _unsupported(f"QJLCache holds a batch of {self._batch} sequences; got {batch}")
            self._batch = batch
        # (batch, tokens, heads, head_dim) is the projections' own memory order: no copy.
        keys = key_states.detach().transpose(1, 2).contiguous()
        values = value_states.detach().transpose(1, 2).contiguous()
        if tokens == 1 and batch > 1:
            self._lib.append_batch(layer, range(batch), keys[:, 0], values[:, 0])
        else:
            for b in range(batch):
                self._lib.append(layer, b, keys[b], values[b])

        if self._fused():
            _HANDOFF.cache, _HANDOFF.layer, _HANDOFF.prefill = self, layer, past == 0
            return key_states, value_states
        if past == 0:  # the prompt attends to its exact keys and values
            return key_states, value_states
        return self._reconstruction(layer, key_states.dtype, key_states.device)

    def _reconstruction(self, layer: int, dtype: torch.dtype, device: torch.device):
        keys, values = zip(*(self._lib.reconstruct(layer, b) for b in range(self._batch)))

        def dense(parts):  # (batch, length, heads, d) float32 -> (batch, heads, length, d)
            return torch.from_numpy(np.stack(parts)).transpose(1, 2).to(device=device, dtype=dtype)

        return dense(keys), dense(values)

    # -- transformers Cache API ---------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions cached for ``layer_idx`` (of sequence 0)."""
        return self._length(layer_idx) if layer_idx < self._num_layers else 0

    def reset(self) -> None:
        """Clears every sequence; the library cache and its configuration stay."""
        if self._lib is not None:
            for b in range(self._batch):
                self._lib.clear(b)
        self._batch = 0

    def stats(self) -> dict:
        """The library's memory statistics (``qjlkv.Cache.stats()``); zeros before the first update."""
        if self._lib is None:
            return {"tokens": 0, "bytes_used": 0, "bytes_reserved": 0, "bytes_fp16_equivalent": 0,
                    "bits_per_number": 0.0, "bytes_keys_quantized": 0, "bytes_values_quantized": 0,
                    "bytes_full_precision": 0, "bytes_metadata": 0, "compression_ratio": float("nan")}
        return self._lib.stats()

    def __repr__(self) -> str:
        return f"QJLCache(preset={self._preset!r}, layers={self._num_layers}, batch={self._batch})"


def _mask_is_causal(mask: torch.Tensor, kv_length: int) -> bool:
    """Whether a 4-D mask (bool: True attends; float: 0 attends) only says "causal", which the
    library applies itself: query i of T sits at position kv_length - T + i."""
    allowed = mask if mask.dtype == torch.bool else mask == 0
    tokens = allowed.shape[-2]
    causal = torch.ones(tokens, kv_length, dtype=torch.bool, device=mask.device).tril(kv_length - tokens)
    return allowed.shape[-1] == kv_length and bool((allowed == causal).all())


def qjlkv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs: Any):
    """transformers attention function ``"qjlkv"``: with a ``QJLCache``, decoding steps call
    ``qjlkv_cache_attend`` (``_batch``) on the compressed cache (no padding: the library has no
    attention masks); the prompt, and layers of any other cache, use exact SDPA attention."""
    handoff = _HANDOFF
    cache, layer = handoff.cache, getattr(module, "layer_idx", None)
    handoff.cache = None
    if cache is None or handoff.layer != layer or handoff.prefill:  # another cache, or the prompt
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if module.training and dropout > 0:
        raise _unsupported("the qjlkv attention is for inference: no dropout")
    batch, _, tokens, _ = query.shape
    if attention_mask is not None and not _mask_is_causal(attention_mask, cache.get_seq_length(layer)):
        raise _unsupported("the qjlkv attention cannot apply padding or custom masks; use sdpa for padded batches")
    lib = cache.library_cache
    queries = query.detach().transpose(1, 2).contiguous()  # (batch, tokens, q heads, head_dim)
    if tokens == 1 and batch > 1:
        return lib.attend_batch(layer, range(batch), queries[:, 0], scaling).unsqueeze(1), None
    out = torch.empty_like(queries)
    for b in range(batch):
        lib.attend(layer, b, queries[b], scaling, out=out[b])
    return out, None


AttentionInterface.register(ATTENTION_NAME, qjlkv_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def use_qjlkv_attention(model: Any) -> Any:
    """Switches ``model`` to the fused ``"qjlkv"`` attention function and returns it."""
    model.set_attn_implementation(ATTENTION_NAME)
    return model
