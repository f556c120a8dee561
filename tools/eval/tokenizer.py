"""GPT-2-style byte-level BPE tokenizer read from GGUF metadata (tokenizer.ggml.*).

Pre-tokenization follows llama.cpp's pre-tokenizer named by `tokenizer.ggml.pre`:
  smollm  every digit is split off on its own, then the GPT-2 regex splits the rest;
  qwen2   Qwen2's single regex (case-insensitive contractions, letters with one leading
          non-letter, each digit alone, punctuation runs with their newlines, ...).
Control and user-defined tokens (<|im_start|>, <tool_call> ...) are matched literally when
`allow_special` is set.
"""
from __future__ import annotations

import functools

import regex

_DIGIT = regex.compile(r"\p{N}")
_GPT2_SPLIT = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
# Qwen2's pattern, as in llama.cpp (LLAMA_VOCAB_PRE_TYPE_QWEN2) and Qwen's tokenizer.json
_QWEN2_SPLIT = regex.compile(
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (vocab strings use it)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def pre_tokenize_qwen2(text: str) -> list[str]:
    """Split text into the words BPE runs on (llama.cpp's qwen2 pre-tokenizer)."""
    return _QWEN2_SPLIT.findall(text)


def pre_tokenize(text: str) -> list[str]:
    """Split text into the words BPE runs on (llama.cpp's smollm pre-tokenizer)."""
    words: list[str] = []
    start = 0
    for digit in _DIGIT.finditer(text):
        if digit.start() > start:
            words.extend(_GPT2_SPLIT.findall(text[start : digit.start()]))
        words.append(digit.group())
        start = digit.end()
    if start < len(text):
        words.extend(_GPT2_SPLIT.findall(text[start:]))
    return words


PRE_TOKENIZERS = {"smollm": pre_tokenize, "qwen2": pre_tokenize_qwen2}


class Tokenizer:
    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str],
                 eos_id: int, pre: str = "smollm"):
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported; known: {sorted(PRE_TOKENIZERS)}")
        self.pre_tokenize = PRE_TOKENIZERS[pre]
        self.tokens = tokens
        self.token_ids = {t: i for i, t in enumerate(tokens)}
        self.merge_rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.special = {t: i for i, t in enumerate(tokens)
                        if token_types[i] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)}
        self.special_ids = set(self.special.values())
        self.eos_id = eos_id
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        # Longest first, so that a special token never matches a prefix of a longer one.
        self._special_split = regex.compile(
            "(" + "|".join(regex.escape(s) for s in sorted(self.special, key=len, reverse=True)) + ")"
        )

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        fields = reader.fields
        model = fields["tokenizer.ggml.model"].contents()
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model is {model!r}, only 'gpt2' (byte-level BPE) is supported")
        return cls(fields["tokenizer.ggml.tokens"].contents(),
                   fields["tokenizer.ggml.token_type"].contents(),
                   fields["tokenizer.ggml.merges"].contents(),
                   int(fields["tokenizer.ggml.eos_token_id"].contents()),
                   fields["tokenizer.ggml.pre"].contents())

    @functools.lru_cache(maxsize=65536)
    def _bpe(self, word: str) -> tuple[int, ...]:
        parts = [self.byte_encoder[b] for b in word.encode("utf-8")]
        while len(parts) > 1:
            ranked = [(self.merge_rank[pair], i) for i, pair in enumerate(zip(parts, parts[1:]))
                      if pair in self.merge_rank]
            if not ranked:
                break
            _, i = min(ranked)  # the best-ranked pair, leftmost first, as GPT-2 does
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return tuple(self.token_ids[p] for p in parts)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        pieces = self._special_split.split(text) if allow_special else [text]
        ids: list[int] = []
        for piece in pieces:
            if allow_special and piece in self.special:
                ids.append(self.special[piece])
            elif piece:
                for word in self.pre_tokenize(piece):
                    ids.extend(self._bpe(word))
        return ids

    def decode(self, ids) -> str:
        out = bytearray()
        for i in ids:
            token = self.tokens[int(i)]
            if int(i) in self.special_ids:
                out += token.encode("utf-8")
            else:
                out += bytes(self.byte_decoder[c] for c in token)
        return out.decode("utf-8", errors="replace")
