"""Hugging Face transformers integration: a ``Cache`` backed by libqjlkv.

>>> from qjlkv.hf import QJLCache, use_qjlkv_attention
>>> use_qjlkv_attention(model)          # decoding steps attend on the compressed cache
>>> out = model.generate(**inputs, cache=QJLCache(model.config))           # preset "q3"

(``cache=`` is the spelling of transformers 5.x; ``past_key_values=`` still works there, with
a FutureWarning that it goes away in 6.0.) ``examples/hf_generate.py`` runs this on
SmolLM2-135M; ``examples/hf_modes.py`` measures every generate mode below.

Works with Llama-family decoders (GQA included; RoPE is applied before keys reach the
cache), and with Gemma 2 and 3, gpt-oss and other models with sliding-window layers (below). Each batch row is a library sequence of its own; the rows' ids change as generate
reorders them.

Every ``generate`` mode works: greedy and sampling, ``num_return_sequences``, beam search
(``reorder_cache``), assisted decoding with an ``assistant_model`` or
``prompt_lookup_num_tokens`` (``crop``), and ``batch_repeat_interleave`` /
``batch_select_indices``. None of them copies the compressed cache: a row that several rows
continue is forked (``qjlkv.Cache.fork``: they share its compressed blocks), rejected draft
tokens are truncated (``qjlkv.Cache.truncate``), and rows that are dropped are cleared.
Prompt rows that are equal (``num_return_sequences`` and beams repeat the prompt) are stored
once and forked, so they share the prompt's bytes (``stats()["bytes_shared"]``).

Two ways to attend:

* The ``"qjlkv"`` attention function (``use_qjlkv_attention(model)``): the prompt attends to
  its exact keys and values; every later query calls the library's fused attention on the
  compressed bytes, over the cache as it stood when that query's own token was appended
  (several new tokens are appended and attended one at a time). So a token's output depends
  only on the tokens before it, never on how they were grouped into forward passes: assisted
  and prompt-lookup decoding give the tokens of plain greedy decoding, and, since a
  truncate by at most ``rollback_tokens`` (32) is exact, rejected drafts leave no trace.
  Left-padded batches work here: padding is never stored (each row is a sequence of its own
  length), and each row decodes as it would alone.
* Any attention implementation transformers ships (``sdpa``, ``eager``, ...): the prompt
  attends to its exact keys and values, and every later step gets back the dense
  reconstruction of the compressed cache (``qjlkv_cache_reconstruct``: keys whose dot
  products with any query equal the scores the library uses, dequantized values). Padding is
  stored there, masked by transformers.

Attention variants. Where the model config has ``attn_logit_softcapping`` (Gemma 2), the
library cache soft-caps the logits of every layer (``qjlkv.Cache.set_layer_attention``, set
when the library cache is created). With the fused attention, the module's ``softcap`` and
gpt-oss's learned sinks (``s_aux``, the ``self_attn.sinks`` parameter) are handed to the
library cache when a layer first attends, and the prompt's exact attention applies them too
(in float32, in place of SDPA, which has neither), so each applies exactly once. With any other
attention implementation the model's own function applies them to the dense reconstruction
(Gemma 2 and gpt-oss need ``eager`` there).

Sliding-window layers (Gemma 2 and 3, gpt-oss, Mistral, Qwen2 with ``use_sliding_window``):
each layer's window W is read from the config as transformers' own caches read it
(``layer_windows``: ``layer_types`` and ``sliding_window``) and set on the library cache before
any token (``set_layer_attention(window_tokens=W)``: the query at position p sees
[p - W + 1, p], as transformers' mask has it). The fused attention accepts transformers'
sliding-window mask when it is exactly causal + window + left padding, and the library applies
the window itself: the prompt (longer than the window too) attends exactly with that mask,
every later query on the compressed cache within its window. With any other attention
implementation, a windowed layer's dense reconstruction holds only the positions its newest
queries see (older ones are zeros the model's mask hides). Both library backends apply
windows and free the blocks a window leaves behind, so a windowed layer's memory stays bounded.

The cache stores ``dtype`` (default: the model's); keys, values and queries are converted to
it and outputs back. ``QJLCache.stats()`` is the library's own memory count.
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

__all__ = ["ATTENTION_NAME", "QJLCache", "layer_windows", "qjlkv_attention_forward", "use_qjlkv_attention"]

#: The name under which the fused attention is registered in transformers' AttentionInterface.
ATTENTION_NAME = "qjlkv"

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _unsupported(message: str) -> qjlkv.Unsupported:
    err = qjlkv.Unsupported(message)
    err.status = qjlkv.Status.UNSUPPORTED
    return err


def _invalid(message: str) -> qjlkv.InvalidArgument:
    err = qjlkv.InvalidArgument(message)
    err.status = qjlkv.Status.INVALID_ARGUMENT
    return err


def layer_windows(config: Any) -> list[int]:
    """Each decoder layer's sliding window (0: full attention), read from a text config as
    transformers' own caches read it (``cache_utils.get_layer_types_and_kwargs``): a layer of
    type ``"sliding_attention"`` in ``config.layer_types`` slides a window of
    ``config.sliding_window`` positions (the query at position p sees [p - W + 1, p]). The
    configs of transformers 5 derive ``layer_types`` from their own fields: Gemma 2's
    alternation, Gemma 3's ``sliding_window_pattern``, Qwen2's ``use_sliding_window`` and
    ``max_window_layers``, gpt-oss's alternation. A config without ``layer_types`` (an older
    transformers) slides every layer when it has a ``sliding_window``, as Mistral does, and
    Gemma 2's even layers. Other layer types (``"chunked_attention"``, ...) get no window: the
    fused attention refuses their masks."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    per_layer = getattr(config, "per_layer_config", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        if getattr(config, "model_type", None) == "gemma2":
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        else:
            types = ["sliding_attention" if window else "full_attention"] * layers
    if len(types) != layers:
        raise _invalid(f"the config has {len(types)} layer_types for {layers} layers")
    windows = []
    for i, kind in enumerate(types):
        w = window
        if per_layer is not None:  # transformers' heterogeneous configs: one view per layer
            try:
                w = getattr(per_layer[i], "sliding_window", window)
            except (IndexError, KeyError, TypeError):
                pass
        if kind == "sliding_attention" and w:
            windows.append(int(w))
        else:
            windows.append(0)
    return windows


class _Handoff(threading.local):
    """What the last ``update`` of this thread left for the fused attention function, which
    transformers calls right after it with the same layer but without the cache."""

    cache: "QJLCache | None" = None
    layer: int = -1
    keys: torch.Tensor | None = None    # (batch, kv heads, tokens, d): appended by the attention
    values: torch.Tensor | None = None
    prefill: bool = False
    # Set by use_qjlkv_attention's hooks for the model forward in progress: its logits_to_keep
    # minus one, the draft tokens transformers' assisted decoding puts behind the prompt.
    draft: int = 0
    # The last mask QJLCache._check_mask accepted for each window (0: none): one tensor serves
    # every layer of a kind in a forward (full layers one, sliding-window layers another).
    checked_masks: dict = {}

    def __init__(self) -> None:
        self.checked_masks = {}


_HANDOFF = _Handoff()


class QJLLayer(CacheLayerMixin):
    """One decoder layer's view of the shared library cache. Rows are sequences of the whole
    cache, so crop, reorder_cache and the batch_* methods act on every layer at once: call
    them on the ``QJLCache``."""

    is_compileable = False
    is_croppable = True
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
        """Takes this step's keys and values (batch, kv_heads, tokens, head_dim) into the
        library cache; returns what the attention should see (see QJLCache)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._owner._update(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the attention mask for ``query_length`` new tokens."""
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Positions of this layer, padding included (every row has the same)."""
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

    def _whole_cache(self, name: str) -> qjlkv.Unsupported:
        return _unsupported(f"QJLLayer.{name} would change one layer of sequences that span every layer: "
                            f"call QJLCache.{name}")

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: call ``QJLCache.crop`` (every layer at once)."""
        raise self._whole_cache("crop")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Refused: call ``QJLCache.reorder_cache`` (every layer at once)."""
        raise self._whole_cache("reorder_cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Refused: call ``QJLCache.batch_repeat_interleave`` (every layer at once)."""
        raise self._whole_cache("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Refused: call ``QJLCache.batch_select_indices`` (every layer at once)."""
        raise self._whole_cache("batch_select_indices")


class QJLCache(Cache):
    """A transformers ``Cache`` whose keys and values live compressed in a ``qjlkv.Cache``.

    ``QJLCache(model.config, preset="q3", **fields)``: ``preset`` is one of ``qjlkv.PRESETS``
    (``"q2"`` about 2.5 bits a number, ``"q3"`` about 3, ...); ``fields`` are ``qjlkv.Config`` fields
    (e.g. ``seed=1``, ``num_threads=2``, ``rollback_tokens=64``, ``memory_budget=...``;
    ``dtype=torch.float16`` stores fp16 whatever the model computes in). The library cache is
    created on the first update, with the dtype and device of the model's keys unless
    ``dtype``/``device`` are given.

    Batch row ``b`` is the library sequence ``rows[b]``; ``pads[b]`` leading positions of it
    are padding that is not stored (fused attention only).

    A config's ``attn_logit_softcapping`` (Gemma 2) is set on every layer of the library cache
    and each sliding-window layer's window (``windows``) on that layer, when the library cache
    is created (``qjlkv.Cache.set_layer_attention``); gpt-oss's sinks reach it through the fused
    attention.
    """

    def __init__(self, config: Any, preset: str = "q3", **fields: Any) -> None:
        text = config.get_text_config(decoder=True)
        self._text_config = text
        self._num_layers = text.num_hidden_layers
        self._num_q_heads = text.num_attention_heads
        self._num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self._head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        # Gemma 2's attention soft-capping, set on every layer of the library cache.
        self._softcap = float(getattr(text, "attn_logit_softcapping", None) or 0.0)
        # Each layer's sliding window (0: full attention), as transformers' own caches and
        # masks read it from the config; set on the library cache when it is created.
        self._windows = layer_windows(text)
        self._preset = preset
        self._fields = dict(fields)
        # Fails now, not at the first forward, on a bad preset or field.
        qjlkv.Config(preset, num_layers=self._num_layers, num_q_heads=self._num_q_heads,
                     num_kv_heads=self._num_kv_heads, head_dim=self._head_dim, **self._fields).validate()
        self._lib: qjlkv.Cache | None = None
        self._dtype: torch.dtype | None = None  # what the library stores
        self._rows: list[int] = []              # library sequence of each batch row
        self._pads: list[int] = []              # unstored leading positions of each row
        self._next_id = 0
        self._free: list[int] = []              # cleared sequence ids, reused first
        # Prefill rows equal to an earlier row (same padding, keys and values in every layer so
        # far): row -> the earlier row. Forked from it once every layer is in.
        self._alias: dict[int, int] = {}
        # The attention variant each layer of the library cache holds: (soft-cap, sink tensor).
        self._variants: list[tuple[float, Any]] = [(0.0, None)] * self._num_layers
        super().__init__(layers=[QJLLayer(self, i) for i in range(self._num_layers)])

    # -- the library cache -------------------------------------------------------------------
    @property
    def library_cache(self) -> qjlkv.Cache | None:
        """The underlying ``qjlkv.Cache`` (None before the first update)."""
        return self._lib

    @property
    def windows(self) -> list[int]:
        """Each layer's sliding window W from the model config (the query at position p sees
        positions [p - W + 1, p]); 0 for a layer of full attention."""
        return list(self._windows)

    @property
    def rows(self) -> list[int]:
        """The library sequence id of each batch row (a copy)."""
        return list(self._rows)

    @property
    def pads(self) -> list[int]:
        """Each batch row's leading padding positions, which the library does not store."""
        return list(self._pads)

    def _create(self, key_states: torch.Tensor) -> None:
        fields = dict(self._fields)
        fields.setdefault("dtype", key_states.dtype)
        fields.setdefault("device", -1 if key_states.device.type == "cpu" else key_states.device.index or 0)
        cfg = qjlkv.Config(self._preset, num_layers=self._num_layers, num_q_heads=self._num_q_heads,
                           num_kv_heads=self._num_kv_heads, head_dim=self._head_dim, **fields)
        self._lib = qjlkv.Cache(cfg)
        self._dtype = _TORCH_DTYPES[cfg.dtype]
        if key_states.is_cuda:
            self._lib.set_stream(torch.cuda.current_stream(key_states.device))
        self._variants = [(0.0, None)] * self._num_layers
        for layer in range(self._num_layers):
            if self._softcap or self._windows[layer]:
                # Before any token: a layer's window can change only while it is empty.
                self._lib.set_layer_attention(layer, self._softcap, None, self._windows[layer])
                self._variants[layer] = (self._softcap, None)

    def _use_variant(self, layer: int, softcap: float | None, sinks: torch.Tensor | None) -> None:
        """Makes the library layer attend with this soft-cap and these sinks (set once: a layer
        keeps its variant until either changes)."""
        softcap = float(softcap or 0.0)
        held_softcap, held_sinks = self._variants[layer]
        if softcap != held_softcap or sinks is not held_sinks:
            self._lib.set_layer_attention(layer, softcap, sinks, self._windows[layer])
            self._variants[layer] = (softcap, sinks)

    def _new_id(self) -> int:
        if self._free:
            return self._free.pop()
        self._next_id += 1
        return self._next_id - 1

    def _drop(self, seq: int) -> None:
        self._lib.clear(seq)
        self._free.append(seq)

    def _length(self, layer: int) -> int:
        if self._lib is None or not self._rows or layer >= self._num_layers:
            return 0
        return self._lib.length(layer, self._rows[0]) + self._pads[0]

    def _stored(self, layer: int) -> list[int]:
        return [self._lib.length(layer, s) for s in self._rows]

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
        if batch != len(self._rows):
            if any(self._length(l) for l in range(self._num_layers)):
                raise _unsupported(f"QJLCache holds a batch of {len(self._rows)} sequences; got {batch}")
            self._settle()
            for s in self._rows:
                self._drop(s)
            self._rows, self._pads, self._alias = [self._new_id() for _ in range(batch)], [0] * batch, {}
        prefill = not any(self._stored(layer))
        if self._fused():  # the attention function appends: it knows the padding and the draft
            _HANDOFF.cache, _HANDOFF.layer, _HANDOFF.prefill = self, layer, prefill
            _HANDOFF.keys, _HANDOFF.values = key_states, value_states
            return key_states, value_states
        keys, values = self._library_layout(key_states), self._library_layout(value_states)
        if prefill:  # the prompt attends to its exact keys and values
            self._append_prefill(layer, keys, values, [0] * batch)
            return key_states, value_states
        self._append(layer, keys, values)
        return self._reconstruction(layer, key_states.dtype, key_states.device, tokens)

    def _library_layout(self, states: torch.Tensor) -> torch.Tensor:
        """(batch, heads, tokens, d) -> (batch, tokens, heads, d), contiguous, in the stored dtype
        (the projections' own memory order: no copy when the dtype already matches)."""
        return states.detach().transpose(1, 2).to(self._dtype).contiguous()

    def _append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if keys.shape[1] == 1 and len(self._rows) > 1:
            self._lib.append_batch(layer, self._rows, keys[:, 0], values[:, 0])
        else:
            for b, s in enumerate(self._rows):
                self._lib.append(layer, s, keys[b], values[b])

    def _append_prefill(self, layer: int, keys: torch.Tensor, values: torch.Tensor, pads: list[int]) -> None:
        """The prompt of every row, without its padding. A row equal to an earlier one in every
        layer so far is not stored: it is forked from that row after the last layer (or, if a
        later layer differs, right then, sharing the layers that were equal)."""
        if layer == 0:
            self._pads, self._alias = list(pads), {}
            for b in range(1, len(self._rows)):
                for a in range(b):
                    if a not in self._alias and pads[a] == pads[b] and torch.equal(keys[a], keys[b]) \
                            and torch.equal(values[a], values[b]):
                        self._alias[b] = a
                        break
        elif pads != self._pads:
            raise _invalid(f"the padding of layer {layer} ({pads}) differs from layer 0's ({self._pads})")
        for b, a in list(self._alias.items()):
            if layer and not (torch.equal(keys[a], keys[b]) and torch.equal(values[a], values[b])):
                del self._alias[b]  # equal up to this layer: share those, store the rest
                self._lib.fork(self._rows[a], self._rows[b])
        for b, s in enumerate(self._rows):
            if b not in self._alias and pads[b] < keys.shape[1]:
                self._lib.append(layer, s, keys[b, pads[b]:], values[b, pads[b]:])
        if layer == self._num_layers - 1:
            self._settle()

    def _settle(self) -> None:
        """Forks the prompt rows that equal an earlier row (see _append_prefill)."""
        for b, a in self._alias.items():
            self._lib.fork(self._rows[a], self._rows[b])
        self._alias = {}

    def _reconstruction(self, layer: int, dtype: torch.dtype, device: torch.device, tokens: int):
        """The dense keys and values of every position, for the ``tokens`` newest queries. On a
        layer whose library cache applies a window W, only the newest W + tokens - 1 positions
        (all those queries see) are reconstructed; older ones stay zero, which the model's
        sliding-window mask hides (and which the library may have freed)."""
        length = self._length(layer)
        keys = torch.zeros(len(self._rows), length, self._num_kv_heads, self._head_dim)
        values = torch.zeros_like(keys)
        window = self._windows[layer]
        for b, s in enumerate(self._rows):
            stored = length - self._pads[b]
            if stored > 0:
                first = max(stored - (window + tokens - 1), 0) if window else 0
                k, v = self._lib.reconstruct(layer, s, first)
                start = self._pads[b] + first
                keys[b, start:], values[b, start:] = torch.from_numpy(k), torch.from_numpy(v)
        return (keys.transpose(1, 2).to(device=device, dtype=dtype),
                values.transpose(1, 2).to(device=device, dtype=dtype))

    # -- rows: fork, truncate, clear -----------------------------------------------------------
    def _select(self, sources: list[int]) -> None:
        """Row i becomes a copy of old row sources[i]: the first copy of a row keeps its
        sequence, the others are forks of it (sharing its compressed blocks); rows no one
        copies are cleared first, so their memory is free before the forks take any."""
        self._settle()
        if any(not 0 <= j < len(self._rows) for j in sources):
            raise _invalid(f"row indices {sources} are outside the batch of {len(self._rows)}")
        if self._lib is None:
            self._rows, self._pads = [self._new_id() for _ in sources], [0] * len(sources)
            return
        old, kept = self._rows, set()
        rows: list[int | None] = []
        for j in sources:
            rows.append(None if j in kept else old[j])
            kept.add(j)
        for j, s in enumerate(old):
            if j not in kept:
                self._drop(s)
        for i, j in enumerate(sources):
            if rows[i] is None:
                rows[i] = self._new_id()
                if any(self._lib.length(l, old[j]) for l in range(self._num_layers)):
                    self._lib.fork(old[j], rows[i])
        self._pads = [self._pads[j] for j in sources]
        self._rows = rows

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues old row ``beam_idx[i]`` (forks, no copies)."""
        self._select([int(j) for j in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` consecutive rows, forks of it."""
        self._select([j for j in range(len(self._rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps the rows ``indices`` (in that order); the others are cleared."""
        self._select([int(j) for j in torch.as_tensor(indices).reshape(-1).tolist()])

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)`` drops the last ``n`` positions of every row (transformers' assisted
        decoding after rejected drafts); ``crop(n)`` with n > 0 keeps the first ``n`` (the
        older spelling). Exact (``qjlkv.Cache.truncate``) when it goes back at most
        ``rollback_tokens`` positions from the longest the rows have been since."""
        self._settle()
        length = self.get_seq_length()
        keep = length + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove
        if keep >= length:
            return
        keep = max(keep, 0)
        for b, s in enumerate(self._rows):
            self._lib.truncate(s, max(keep - self._pads[b], 0))
            self._pads[b] = min(self._pads[b], keep)

    # -- transformers Cache API ---------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions cached for ``layer_idx``, padding included (every row has the same)."""
        return self._length(layer_idx)

    def reset(self) -> None:
        """Clears every sequence; the library cache and its configuration stay."""
        if self._lib is not None:
            for s in self._rows:
                self._drop(s)
        self._rows, self._pads, self._alias = [], [], {}

    def stats(self) -> dict:
        """The library's memory statistics (``qjlkv.Cache.stats()``); zeros before the first update."""
        if self._lib is None:
            return {"tokens": 0, "bytes_used": 0, "bytes_reserved": 0, "bytes_fp16_equivalent": 0,
                    "bits_per_number": 0.0, "bytes_keys_quantized": 0, "bytes_values_quantized": 0,
                    "bytes_full_precision": 0, "bytes_metadata": 0, "bytes_rollback": 0, "bytes_shared": 0,
                    "compression_ratio": float("nan")}
        return self._lib.stats()

    def __repr__(self) -> str:
        return f"QJLCache(preset={self._preset!r}, layers={self._num_layers}, batch={len(self._rows)})"

    # -- the fused attention (called by qjlkv_attention_forward) --------------------------------
    def _attend(self, layer: int, query: torch.Tensor, keys_in: torch.Tensor, values_in: torch.Tensor,
                mask: torch.Tensor | None, scaling: float | None, prefill: bool, exact: Any,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Appends this layer's keys and values and returns the attention (batch, tokens, q heads, d),
        with the layer's soft-cap and sinks applied once: by ``exact`` for the prompt, by the
        library for the rest."""
        self._use_variant(layer, softcap, sinks)
        batch, _, tokens, _ = query.shape
        keys, values = self._library_layout(keys_in), self._library_layout(values_in)
        if prefill:
            pads = _left_padding(mask, batch, tokens, self._windows[layer])
            draft = min(_HANDOFF.draft, tokens - 1)
            out = exact()  # exact attention of the prompt (and what the draft tokens overwrite)
            if draft and batch == 1:
                self._append_prefill(layer, keys[:, :tokens - draft], values[:, :tokens - draft], pads)
                queries = query.detach().transpose(1, 2).to(self._dtype).contiguous()
                self._attend_each(layer, queries, keys, values, out, first=tokens - draft, scaling=scaling)
            else:
                self._append_prefill(layer, keys, values, pads)
            return out
        self._check_mask(layer, mask, tokens)
        queries = query.detach().transpose(1, 2).to(self._dtype).contiguous()
        if tokens == 1 and batch > 1:
            self._lib.append_batch(layer, self._rows, keys[:, 0], values[:, 0])
            out = self._lib.attend_batch(layer, self._rows, queries[:, 0], scaling).unsqueeze(1)
            return out.to(query.dtype)
        out = torch.empty(queries.shape, dtype=query.dtype, device=query.device)
        self._attend_each(layer, queries, keys, values, out, first=0, scaling=scaling)
        return out

    def _attend_each(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     out: torch.Tensor, first: int, scaling: float | None = None) -> None:
        """Appends tokens [first, T) of every row one at a time, each followed by its query's
        attention: every query sees the cache as it stood when its own token came in."""
        for b, s in enumerate(self._rows):
            for t in range(first, queries.shape[1]):
                self._lib.append(layer, s, keys[b, t], values[b, t])
                out[b, t] = self._lib.attend(layer, s, queries[b, t], scaling).to(out.dtype)

    def _check_mask(self, layer: int, mask: torch.Tensor | None, tokens: int) -> None:
        """The library applies causality, the rows' left padding and the layer's sliding window
        itself: the mask must be exactly that (transformers' causal or sliding-window mask of a
        left-padded batch); any other mask is refused."""
        window = self._windows[layer]
        if mask is None or _HANDOFF.checked_masks.get(window) is mask:
            return
        allowed = mask if mask.dtype == torch.bool else mask == 0
        kv, past = allowed.shape[-1], self._length(layer)
        if kv != past + tokens or allowed.shape[-2] != tokens:
            raise _unsupported(f"the qjlkv attention got a mask over {kv} positions for {tokens} queries; "
                               f"the cache holds {past}")
        for b in range(allowed.shape[0]):
            if bool((allowed[b] == _expected_mask(tokens, kv, self._pads[b], window, mask.device)).all()):
                continue
            what = f"a sliding window of {window} positions" if window else "no window"
            raise _unsupported(f"the qjlkv attention applies causality, left padding and the layer's own window "
                               f"only (layer {layer}: {what}); this mask asks for something else (use sdpa for "
                               "custom masks)")
        _HANDOFF.checked_masks[window] = mask


def _expected_mask(tokens: int, kv: int, pad: int, window: int, device: torch.device) -> torch.Tensor:
    """(tokens, kv) booleans: the query at position p = kv - tokens + t sees positions
    [max(pad, p - window + 1), p] (window 0: [pad, p])."""
    query = torch.arange(kv - tokens, kv, device=device).unsqueeze(1)
    key = torch.arange(kv, device=device).unsqueeze(0)
    want = (key <= query) & (key >= pad)
    if window:
        want &= key > query - window
    return want


def _left_padding(mask: torch.Tensor | None, batch: int, tokens: int, window: int = 0) -> list[int]:
    """Each row's leading padding, read from the prompt's 4-D mask: the first query that sees
    itself is the first token after the padding, and the last query sees every token after
    the padding (within its window, on a sliding-window layer)."""
    if mask is None:
        return [0] * batch
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if allowed.dim() == 4:  # (batch, heads, queries, kv): transformers' masks have one head
        allowed = allowed[:, 0]
    allowed = allowed[..., -tokens:, -tokens:].reshape(-1, tokens, tokens)
    diagonal = allowed.diagonal(dim1=-2, dim2=-1)
    pads = []
    for b in range(batch):
        row = b if allowed.shape[0] > 1 else 0
        seen = diagonal[row]
        pad = int(seen.int().argmax()) if bool(seen.any()) else tokens
        want = _expected_mask(1, tokens, pad, window, allowed.device)[0]
        if not bool(seen[pad:].all()) or not bool((allowed[row, -1] == want).all()):
            raise _unsupported("the qjlkv attention takes left padding only (the prompt's last token must see "
                               "every token after the padding, within the layer's window); use sdpa for other "
                               "masks")
        pads.append(pad)
    return pads


def _exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Exact attention (batch, tokens, q heads, d) in float32 with Gemma 2's soft-cap and
    gpt-oss's sinks, which SDPA lacks: query (batch, q heads, tokens, d), key and value
    (batch, kv heads, kv, d); mask boolean (True = attend) or additive, None = causal."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).float()
    v = value.repeat_interleave(groups, dim=1).float()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    logits = torch.matmul(query.float(), k.transpose(2, 3)) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    tokens, kv = logits.shape[-2:]
    if mask is None:
        mask = torch.ones(tokens, kv, dtype=torch.bool, device=logits.device).tril(kv - tokens)
    mask = mask[..., :kv]
    if mask.dtype == torch.bool:  # a finite floor: rows that see nothing give no NaN
        logits = logits.masked_fill(~mask, torch.finfo(torch.float32).min)
    else:
        logits = logits + mask.float()
    if sinks is not None:
        column = sinks.detach().float().reshape(1, -1, 1, 1).expand(logits.shape[0], -1, tokens, 1)
        weights = torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(logits, dim=-1)
    return torch.matmul(weights, v).transpose(1, 2).to(query.dtype).contiguous()


def qjlkv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs: Any):
    """transformers attention function ``"qjlkv"``: with a ``QJLCache``, appends the layer's
    keys and values (without padding) and attends: the prompt with exact attention (SDPA, or
    a float32 eager computation where the module passes a ``softcap`` or sinks ``s_aux``),
    every later query with ``qjlkv_cache_attend`` on the compressed cache, the layer's
    soft-cap and sinks set on the library cache (``Cache.set_layer_attention``), so that
    each is applied exactly once. Layers of any other cache use the exact attention."""
    handoff = _HANDOFF
    cache, layer = handoff.cache, getattr(module, "layer_idx", None)
    keys, values = handoff.keys, handoff.values
    handoff.cache, handoff.keys, handoff.values = None, None, None
    softcap, sinks = kwargs.pop("softcap", None), kwargs.pop("s_aux", None)

    def exact():
        if softcap or sinks is not None:
            return _exact_attention(query, key, value, attention_mask, scaling, softcap, sinks)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)[0]

    if cache is None:  # another cache, or none
        return exact(), None
    if handoff.layer != layer:
        raise _unsupported(f"the qjlkv attention of layer {layer} follows the cache update of layer {handoff.layer}")
    if module.training and dropout > 0:
        raise _unsupported("the qjlkv attention is for inference: no dropout")
    return cache._attend(layer, query, keys, values, attention_mask, scaling, handoff.prefill, exact, softcap,
                         sinks), None


AttentionInterface.register(ATTENTION_NAME, qjlkv_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _note_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    keep = kwargs.get("logits_to_keep", 0)
    _HANDOFF.draft = keep - 1 if isinstance(keep, int) and keep > 1 else 0


def _end_forward(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    _HANDOFF.draft = 0


def use_qjlkv_attention(model: Any) -> Any:
    """Switches ``model`` to the fused ``"qjlkv"`` attention function and returns it.

    It also notes each forward's ``logits_to_keep``: transformers' assisted decoding puts its
    first draft behind the prompt and keeps ``drafts + 1`` logits, and those draft tokens are
    then attended like decoding steps (on the compressed cache), as plain greedy decoding
    would have, so that the two give the same tokens."""
    model.set_attn_implementation(ATTENTION_NAME)
    if not getattr(model, "_qjlkv_hooked", False):
        model.register_forward_pre_hook(_note_forward, with_kwargs=True)
        model.register_forward_hook(_end_forward, with_kwargs=True, always_call=True)
        model._qjlkv_hooked = True
    return model
