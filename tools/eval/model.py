"""A decoder of GGUF architectures `llama`, `qwen2` and `gemma3` run in numpy (float32).

Two entry points share the weights:
  forward(tokens, start_pos, past)
                              the straightforward sequence forward with causal attention
                              (the reference, and the exact prefill), optionally after
                              the K/V of earlier positions;
  decode_step(tokens, pos, caches)
                              one new token for each of several KV caches at once: the
                              dense matmuls are batched over the caches (so the weights
                              are read once per step), attention goes through each cache.

GGUF facts this relies on (llama.cpp's converter and loader):
  - every shape comes from the metadata (`<arch>.block_count`, `.embedding_length`,
    `.attention.head_count[_kv]`, `.attention.key_length`, `.rope.freq_base` ...);
  - RoPE pairs depend on the architecture, as llama.cpp's llama_model_rope_type says:
    `llama` Q/K rows are permuted by the converter so that adjacent pairs (x[2i], x[2i+1])
    rotate ("normal" RoPE); `qwen2` Q/K rows are stored unpermuted and the pairs are
    (x[i], x[i + d/2]) ("NEOX" RoPE, Hugging Face's half split);
  - qwen2 has q/k/v biases (blk.N.attn_{q,k,v}.bias); llama has none;
  - a model without output.weight ties the output matrix to token_embd.weight;
  - weight matrices are stored [out][in] (gguf shape [in, out]) and may be quantized
    (Q4_1, Q4_K, Q6_K, Q8_0 ...): gguf.quants.dequantize gives float32.

Gemma 3 (`gemma3`, as llama.cpp's converter writes it and Hugging Face's Gemma3 runs it):
  - embeddings scaled by sqrt(embedding_length); NEOX RoPE; tied output;
  - RMSNorm of q and k per head (blk.N.attn_{q,k}_norm) before RoPE, and norms after
    attention and after the FFN (blk.N.post_attention_norm, post_ffw_norm) on the branch
    before it joins the residual; ffn_norm is the pre-FFN norm;
  - every norm weight is stored as 1 + w (the converter adds Gemma's 1), so the norms
    here are plain RMSNorm with the stored weight;
  - GeLU (tanh approximation) gates the FFN instead of SiLU;
  - local layers attend to the newest `attention.sliding_window` positions (the query's
    own included) with RoPE base `rope.freq_base_swa`; every `sliding_window_pattern`-th
    layer (the 6th, 12th ...) is global with `rope.freq_base`. A converter that does not
    write the last two keys relies on llama.cpp's Gemma 3 values, 10000 and 6, used here
    then (Hugging Face's Gemma3TextConfig defaults agree);
  - queries are scaled by query_pre_attn_scalar^-0.5, which llama.cpp takes as
    head_dim^-0.5 (dim/heads for the 27B model, which this decoder refuses): the caches'
    own 1/sqrt(head_dim);
  - `final_logit_softcapping`, when the metadata has it, caps the logits (c tanh(z / c));
    attention soft-capping (Gemma 2's) is refused.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .models import DEFAULT_MODEL, fetch, smollm2_path
from .tokenizer import Tokenizer

# llama.cpp's rope type of each architecture this model runs (llama_model_rope_type)
ROPE_ADJACENT_PAIRS, ROPE_HALVES = "normal", "neox"
ROPE_TYPE = {"llama": ROPE_ADJACENT_PAIRS, "qwen2": ROPE_HALVES, "gemma3": ROPE_HALVES}
# Gemma 3 values llama.cpp's loader sets when the metadata has none (llama-model.cpp)
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6
# Rows of queries per attention/FFN call in forward(): bounds the score matrix and the FFN
# activations of a long prompt (4k tokens of a 1.5B model: ~0.3 GB instead of ~3 GB).
FORWARD_CHUNK = 1024
# below these a score matrix's softmax runs on one thread (pool start-up would dominate)
SOFTMAX_PARALLEL_SIZE = 1 << 22
SOFTMAX_MIN_ROWS = 64


@dataclass
class ModelShape:
    num_layers: int
    dim: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_base: float
    norm_eps: float
    architecture: str = "llama"
    rope_type: str = ROPE_ADJACENT_PAIRS
    # per layer: how many of the newest positions a query sees (its own included), None
    # for full causal attention; None here: every layer is global
    windows: tuple | None = None
    rope_base_local: float | None = None  # RoPE base of the windowed layers

    def window(self, layer: int) -> int | None:
        return None if self.windows is None else self.windows[layer]


@dataclass
class LayerWeights:
    attn_norm: np.ndarray   # [dim]
    # Stored [in, out] (x @ w): the small-batch decode matmuls run 2x faster on this
    # layout than on GGUF's [out, in] transposed.
    w_qkv: np.ndarray       # [dim, (Hq + 2 Hkv) * d]: q, k, v columns side by side
    b_qkv: np.ndarray | None  # [(Hq + 2 Hkv) * d] biases of those columns (qwen2), or None
    w_out: np.ndarray       # [Hq * d, dim]
    ffn_norm: np.ndarray    # [dim]
    w_gate_up: np.ndarray   # [dim, 2 * ffn]: gate columns, then up columns
    w_down: np.ndarray      # [ffn, dim]
    # Gemma 3 only (None elsewhere): per-head RMSNorm of q and k [d], the norms of the
    # attention and FFN branches before the residual add [dim]
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None
    post_ffn_norm: np.ndarray | None = None
    window: int | None = None       # sliding window of this layer (None: global)
    inv_freq: np.ndarray | None = None  # RoPE frequencies of this layer (None: the model's)


class QuantizedRows:
    """A GGUF matrix kept as stored, rows dequantized when indexed: the token embedding,
    of which a step reads a few rows (float32 would hold 0.9 GB for Qwen2.5-1.5B)."""

    def __init__(self, tensor):
        self.data = np.array(tensor.data)  # a copy: the GGUF file's mapping can close
        self.tensor_type = tensor.tensor_type
        self.shape = (int(tensor.shape[1]), int(tensor.shape[0]))

    def __getitem__(self, rows) -> np.ndarray:
        from gguf import quants

        return np.asarray(quants.dequantize(self.data[rows], self.tensor_type), dtype=np.float32)


def blas_threads(count: int):
    """A context in which BLAS runs `count` threads."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=count, user_api="blas")


def single_threaded_blas():
    """Decode matmuls have a handful of rows and alternate with single-threaded cache
    calls: one BLAS thread is faster there, and far faster on a busy machine, where
    OpenBLAS's spinning threads stall (measured 2 threads 7x slower under load)."""
    return blas_threads(1)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    """In place on one temporary: a prefill chunk's FFN activations are tens of megabytes."""
    out = np.negative(x)
    np.exp(out, out=out)
    out += 1.0
    return np.divide(x, out, out=out)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GeLU, tanh approximation (PyTorch's approximate="tanh", Gemma's hidden_activation)."""
    inner = np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)
    return 0.5 * x * (1.0 + np.tanh(inner))


def causal_mask(query_positions: np.ndarray, first_key: int, last_key: int,
                window: int | None = None) -> np.ndarray:
    """Additive mask [n, last_key - first_key] of queries at query_positions over keys at
    first_key..last_key-1: a query sees keys at or before its position and, with a
    window W, only the newest W of those (key position > query position - W)."""
    keys = np.arange(first_key, last_key)[None, :]
    queries = np.asarray(query_positions)[:, None]
    visible = keys <= queries
    if window is not None:
        visible &= keys > queries - window
    return np.where(visible, np.float32(0), np.float32(-np.inf))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """In float64: KL divergences near 1e-7 need the extra precision."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _exp_scores_rows(scores: np.ndarray, mask: np.ndarray, d: int, sums: np.ndarray) -> None:
    scores *= np.float32(1.0 / np.sqrt(d))
    masked_columns = np.flatnonzero(mask.any(axis=0))
    if len(masked_columns):
        first = masked_columns[0]
        scores[..., first:] += mask[:, first:]
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    np.sum(scores, axis=-1, keepdims=True, out=sums)


def _exp_scores_in_place(scores: np.ndarray, mask: np.ndarray, d: int) -> np.ndarray:
    """The unnormalized softmax of scores [..., n, T] over the last axis, in place (scaled,
    masked, shifted by the row maximum, exponentiated); returns the row sums [..., n, 1], by
    which the caller divides the smaller attention output instead of the score matrix. mask
    [n, T] additive (0 or -inf), added only from its first nonzero column: adding the zeros
    before it would not change a score. A long prefill's score matrix is split into blocks
    of query rows, one per core: numpy's elementwise passes are single-threaded and, at 16k
    keys, cost as much as the matmuls; each row's arithmetic is the same either way."""
    n = scores.shape[-2]
    sums = np.empty(scores.shape[:-1] + (1,), np.float32)
    workers = min(os.cpu_count() or 1, n // SOFTMAX_MIN_ROWS)
    if workers < 2 or scores.size < SOFTMAX_PARALLEL_SIZE:
        _exp_scores_rows(scores, mask, d, sums)
        return sums
    bounds = np.linspace(0, n, workers + 1).astype(int)
    blocks = [(scores[..., lo:hi, :], mask[lo:hi], d, sums[..., lo:hi, :])
              for lo, hi in zip(bounds[:-1], bounds[1:])]
    with ThreadPoolExecutor(workers) as pool:  # ufuncs release the GIL
        list(pool.map(lambda block: _exp_scores_rows(*block), blocks))
    return sums


def grouped_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray,
                      scores_buffer: np.ndarray | None = None) -> np.ndarray:
    """Softmax attention with GQA (query head h uses kv head h // group) without repeating
    K/V. q: [n, Hq, d]; k, v: [T, Hkv, d]; mask: [n, T] additive (0 or -inf).
    scores_buffer: float32, at least n * Hq * T numbers, reused for the score matrix (a long
    prefill's chunks would otherwise each fault in hundreds of fresh megabytes).
    Contiguous 3-D stacks, so that numpy's matmul reaches BLAS; the softmax runs in place on
    the score matrix (the largest array of a long prefill: each pass over it costs as much
    as the matmuls), and its normalization divides the output rather than the scores. One
    query (a decode step) reads each kv head's keys and values in place instead, as strided
    [T, d] views that BLAS takes with their row stride: the contiguous copies would cost a
    decode step at 16k tokens eight times the matmuls."""
    n, num_q, d = q.shape
    num_kv = k.shape[1]
    group = num_q // num_kv
    if n == 1:
        out = np.empty((1, num_q, d), np.float32)
        for h in range(num_kv):
            heads = slice(h * group, (h + 1) * group)
            scores = q[0, heads] @ k[:, h, :].T                                # [group, T]
            sums = _exp_scores_in_place(scores, mask, d)
            out[0, heads] = scores @ v[:, h, :] / sums
        return out
    qg = np.ascontiguousarray(q.reshape(n, num_kv, group, d).transpose(1, 2, 0, 3))
    keys_t = np.ascontiguousarray(k.transpose(1, 2, 0))                    # [Hkv, d, T]
    shape = (num_kv, group * n, k.shape[0])
    scores = None if scores_buffer is None else scores_buffer[:np.prod(shape)].reshape(shape)
    scores = np.matmul(qg.reshape(num_kv, group * n, d), keys_t, out=scores)
    scores = scores.reshape(num_kv, group, n, -1)
    sums = _exp_scores_in_place(scores, mask, d).reshape(num_kv, group * n, 1)
    out = scores.reshape(num_kv, group * n, -1) @ np.ascontiguousarray(v.transpose(1, 0, 2))  # [Hkv, g*n, d]
    out /= sums
    return out.reshape(num_kv, group, n, d).transpose(2, 0, 1, 3).reshape(n, num_q, d)


class LlamaModel:
    """The decoder of a GGUF file (default: SmolLM2-135M); see load_model for names."""

    def __init__(self, path: str | None = None, progress: bool = False):
        import gguf
        from gguf import quants
        from tqdm import tqdm

        self.path = path or smollm2_path()
        reader = gguf.GGUFReader(self.path)
        meta = {k: f for k, f in reader.fields.items()}
        arch = meta["general.architecture"].contents()
        if arch not in ROPE_TYPE:
            raise ValueError(f"general.architecture is {arch!r}, expected one of {sorted(ROPE_TYPE)}")

        def num(key, default=None):
            field = meta.get(f"{arch}.{key}")
            if field is None:
                if default is None:
                    raise ValueError(f"GGUF metadata {arch}.{key} is missing")
                return default
            return field.contents()

        tensors = {t.name: t for t in reader.tensors}

        def weight(name: str) -> np.ndarray:
            t = tensors[name]
            return np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

        def matrix(*names: str) -> np.ndarray:
            """[in, out], the out rows of the named tensors side by side."""
            return np.ascontiguousarray(np.concatenate([weight(n) for n in names]).T)

        dim = int(num("embedding_length"))
        num_q = int(num("attention.head_count"))
        num_kv = int(num("attention.head_count_kv"))
        head_dim = int(num("attention.key_length", dim // num_q))
        if int(num("attention.value_length", head_dim)) != head_dim:
            raise ValueError("key and value head sizes differ: not supported")
        self.shape = ModelShape(
            num_layers=int(num("block_count")), dim=dim, num_q_heads=num_q,
            num_kv_heads=num_kv, head_dim=head_dim,
            vocab_size=int(tensors["token_embd.weight"].shape[1]),
            rope_base=float(num("rope.freq_base")),
            norm_eps=float(num("attention.layer_norm_rms_epsilon")),
            architecture=arch, rope_type=ROPE_TYPE[arch])
        if int(num("rope.dimension_count", head_dim)) != head_dim:
            raise ValueError("partial RoPE (rope.dimension_count != head_dim) is not supported")
        scaling = meta.get(f"{arch}.rope.scaling.type")
        if scaling is not None and scaling.contents() not in ("none", ""):
            raise ValueError(f"RoPE scaling {scaling.contents()!r} is not supported")
        gemma = arch == "gemma3"
        self.embed_scale = np.float32(np.sqrt(dim)) if gemma else None
        self.activation = gelu_tanh if gemma else silu
        self.final_softcap = float(num("final_logit_softcapping", 0.0)) or None
        if float(num("attn_logit_softcapping", 0.0)):
            raise ValueError("attention logit soft-capping is not supported")
        if gemma:
            label = meta.get("general.size_label")
            if label is not None and label.contents() == "27B":
                raise ValueError("Gemma 3 27B scales queries by (dim/heads)^-0.5, not head_dim^-0.5: "
                                 "not supported")
            self.shape.windows = self._gemma3_windows(num)
            self.shape.rope_base_local = float(num("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))

        steps = tqdm(total=self.shape.num_layers + 2, desc="dequantizing weights", unit="layer",
                     disable=not progress)
        self.embedding = QuantizedRows(tensors["token_embd.weight"])    # [vocab, dim]
        self.output_norm = weight("output_norm.weight")
        self.output = matrix("output.weight" if "output.weight" in tensors else "token_embd.weight")
        steps.update(2)
        self.layers = []
        for i in range(self.shape.num_layers):
            p = f"blk.{i}."
            qkv = (p + "attn_q", p + "attn_k", p + "attn_v")
            biases = [n + ".bias" for n in qkv if n + ".bias" in tensors]
            if biases and len(biases) != 3:
                raise ValueError(f"layer {i} has biases on only some of q, k, v: {biases}")

            def optional(name):
                return weight(p + name) if p + name in tensors else None

            window = self.shape.window(i)
            self.layers.append(LayerWeights(
                attn_norm=weight(p + "attn_norm.weight"),
                w_qkv=matrix(*(n + ".weight" for n in qkv)),
                b_qkv=np.concatenate([weight(n) for n in biases]) if biases else None,
                w_out=matrix(p + "attn_output.weight"),
                ffn_norm=weight(p + "ffn_norm.weight"),
                w_gate_up=matrix(p + "ffn_gate.weight", p + "ffn_up.weight"),
                w_down=matrix(p + "ffn_down.weight"),
                q_norm=optional("attn_q_norm.weight"), k_norm=optional("attn_k_norm.weight"),
                post_attn_norm=optional("post_attention_norm.weight"),
                post_ffn_norm=optional("post_ffw_norm.weight"),
                window=window,
                inv_freq=None if window is None else self._frequencies(self.shape.rope_base_local)))
            if gemma and any(w is None for w in (self.layers[-1].q_norm, self.layers[-1].k_norm,
                                                 self.layers[-1].post_attn_norm,
                                                 self.layers[-1].post_ffn_norm)):
                raise ValueError(f"layer {i} lacks one of Gemma 3's q/k/post-attention/post-FFN norms")
            steps.update(1)
        steps.close()
        self.tokenizer = Tokenizer.from_gguf(reader)
        self._inv_freq = self._frequencies(self.shape.rope_base)

    def _frequencies(self, base: float) -> np.ndarray:
        half = self.shape.head_dim // 2
        return base ** (-np.arange(half, dtype=np.float64) * 2 / self.shape.head_dim)

    def _gemma3_windows(self, num) -> tuple:
        """Per layer: the sliding window of a local layer, None for a global one. The pattern
        is a period N (layer i is global when (i + 1) % N == 0) or, as newer converters
        may write it, one flag per layer (true: windowed)."""
        window = int(num("attention.sliding_window"))
        pattern = num("attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
        layers = self.shape.num_layers
        if isinstance(pattern, (list, tuple)):
            if len(pattern) != layers:
                raise ValueError(f"sliding_window_pattern has {len(pattern)} flags for {layers} layers")
            return tuple(window if bool(local) else None for local in pattern)
        return tuple(None if (i + 1) % int(pattern) == 0 else window for i in range(layers))

    # ---- pieces shared by both paths -------------------------------------------------
    def rope(self, x: np.ndarray, positions: np.ndarray,
             inv_freq: np.ndarray | None = None) -> np.ndarray:
        """x: [n, heads, d] at positions [n]; rotates the architecture's pairs: adjacent
        (x[2i], x[2i+1]) for llama's permuted GGUF rows, (x[i], x[i + d/2]) for qwen2 and
        gemma3. inv_freq: a layer's own frequencies (Gemma 3's local layers)."""
        inv_freq = self._inv_freq if inv_freq is None else inv_freq
        angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
        cos = np.cos(angles).astype(np.float32)[:, None, :]
        sin = np.sin(angles).astype(np.float32)[:, None, :]
        if self.shape.rope_type == ROPE_HALVES:
            half = self.shape.head_dim // 2
            first, second = x[..., :half], x[..., half:]
            return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def _qkv(self, layer: LayerWeights, x: np.ndarray, positions: np.ndarray):
        s = self.shape
        h = rms_norm(x, layer.attn_norm, s.norm_eps) @ layer.w_qkv
        if layer.b_qkv is not None:
            h += layer.b_qkv
        nq, nkv = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q = h[:, :nq].reshape(-1, s.num_q_heads, s.head_dim)
        k = h[:, nq:nq + nkv].reshape(-1, s.num_kv_heads, s.head_dim)
        v = np.ascontiguousarray(h[:, nq + nkv:].reshape(-1, s.num_kv_heads, s.head_dim))
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, s.norm_eps)
            k = rms_norm(k, layer.k_norm, s.norm_eps)
        return self.rope(q, positions, layer.inv_freq), self.rope(k, positions, layer.inv_freq), v

    def _finish_layer(self, layer: LayerWeights, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        eps = self.shape.norm_eps
        branch = attn.reshape(x.shape[0], -1) @ layer.w_out
        if layer.post_attn_norm is not None:
            branch = rms_norm(branch, layer.post_attn_norm, eps)
        x = x + branch
        gate_up = rms_norm(x, layer.ffn_norm, eps) @ layer.w_gate_up
        ffn = gate_up.shape[1] // 2
        branch = (self.activation(gate_up[:, :ffn]) * gate_up[:, ffn:]) @ layer.w_down
        if layer.post_ffn_norm is not None:
            branch = rms_norm(branch, layer.post_ffn_norm, eps)
        return x + branch

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        x = self.embedding[tokens]
        return x if self.embed_scale is None else x * self.embed_scale

    def logits(self, x: np.ndarray) -> np.ndarray:
        z = rms_norm(x, self.output_norm, self.shape.norm_eps) @ self.output
        if self.final_softcap is not None:
            z = self.final_softcap * np.tanh(z / self.final_softcap)
        return z

    # ---- the reference: a sequence, exact causal attention ----------------------------
    def forward(self, tokens, start_pos: int = 0, past=None, all_logits: bool = True,
                progress: bool = False):
        """tokens at positions start_pos.., after the per-layer (keys, values) `past` of
        positions 0..start_pos-1 (None when start_pos is 0). Returns (logits [n or 1, vocab],
        per-layer (keys, values) [n, Hkv, d] of the new tokens, post-RoPE). Long inputs run
        FORWARD_CHUNK rows at a time (same arithmetic per row, bounded memory)."""
        from tqdm import tqdm

        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens)
        if (past is None) != (start_pos == 0) or (past and len(past[0][0]) != start_pos):
            raise ValueError("past must hold the K/V of exactly the start_pos earlier positions")
        positions = np.arange(start_pos, start_pos + n)
        x = self.embed(tokens)
        kv = []
        scores_buffer = np.empty(min(n, FORWARD_CHUNK) * self.shape.num_q_heads * (start_pos + n),
                                 np.float32)
        for index, layer in enumerate(tqdm(self.layers, desc=f"forward of {n} tokens", unit="layer",
                                           disable=not progress, leave=False)):
            q, k, v = self._qkv(layer, x, positions)
            kv.append((k, v))
            if past:
                k = np.concatenate([past[index][0], k])
                v = np.concatenate([past[index][1], v])
            attn = np.empty_like(q)
            for lo in range(0, n, FORWARD_CHUNK):
                hi = min(n, lo + FORWARD_CHUNK)
                visible = start_pos + hi  # the chunk's last query sees keys 0..visible-1
                # a windowed layer's first query sees nothing before its window
                first = 0 if layer.window is None else max(0, start_pos + lo - layer.window + 1)
                mask = causal_mask(positions[lo:hi], first, visible, layer.window)
                attn[lo:hi] = grouped_attention(q[lo:hi], k[first:visible], v[first:visible], mask,
                                                scores_buffer)
            x = np.concatenate([self._finish_layer(layer, x[lo:lo + FORWARD_CHUNK],
                                                   attn[lo:lo + FORWARD_CHUNK])
                                for lo in range(0, n, FORWARD_CHUNK)])
        return self.logits(x if all_logits else x[-1:]), kv

    def forward_full(self, tokens, all_logits: bool = True):
        """forward() of a whole sequence from position 0."""
        return self.forward(tokens, all_logits=all_logits)

    # ---- decode: one token per cache, attention through the caches -------------------
    def decode_step(self, tokens, position: int, caches, logits: bool = True) -> np.ndarray | None:
        """tokens[c] is the new token of cache c, all at `position`; returns logits
        [len(caches), vocab] (None with logits=False: a teacher-forced token whose
        prediction is not read skips the output matrix, a sixth of a Qwen step's weights).
        Each layer appends the new K/V to every cache, then attends with the new query."""
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.full(len(tokens), position)
        x = self.embed(tokens)
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            attn = np.empty_like(q)
            for c, cache in enumerate(caches):
                cache.append(index, k[c:c + 1], v[c:c + 1])
                attn[c] = cache.attend(index, q[c:c + 1])[0]
            x = self._finish_layer(layer, x, attn)
        return self.logits(x) if logits else None

    def prefill(self, tokens, caches, progress: bool = False) -> np.ndarray:
        """Exact prefill: full-sequence attention in numpy, then every cache receives the
        prompt's K/V. Returns the logits of the last prompt token [vocab]."""
        logits, kv = self.forward(tokens, all_logits=False, progress=progress)
        for cache in caches:
            for index, (k, v) in enumerate(kv):
                cache.append(index, k, v)
        return logits[0]


def load_model(name: str = DEFAULT_MODEL, progress: bool = False) -> LlamaModel:
    """A model of tools/eval/models.py by name, fetched (and verified) first if needed."""
    return LlamaModel(fetch(name, progress=progress), progress=progress)
