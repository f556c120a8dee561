"""The tokenizers of GGUF metadata (tokenizer.ggml.*): GPT-2-style byte-level BPE
(`tokenizer.ggml.model` gpt2: SmolLM2, Qwen2.5) and SentencePiece-style BPE by token scores
(`llama`: Gemma 3; SentencePieceTokenizer below). `from_gguf` picks the one the file names.

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
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_BYTE = 3, 4, 6


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
        self.bos_prefix: list[int] = []  # neither GGUF asks for a BOS token (add_bos_token)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        # Longest first, so that a special token never matches a prefix of a longer one.
        self._special_split = regex.compile(
            "(" + "|".join(regex.escape(s) for s in sorted(self.special, key=len, reverse=True)) + ")"
        )

    @classmethod
    def from_gguf(cls, reader):
        """The tokenizer the file names: a Tokenizer or a SentencePieceTokenizer."""
        fields = reader.fields
        model = fields["tokenizer.ggml.model"].contents()
        if model == "llama":
            return SentencePieceTokenizer.from_gguf(reader)
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model is {model!r}, only 'gpt2' (byte-level BPE) "
                             "and 'llama' (SentencePiece) are supported")
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


SPACE = "\u2581"  # SentencePiece's visible space


class SentencePieceTokenizer:
    """llama.cpp's SPM tokenizer (llm_tokenizer_spm), as it runs Gemma 3's GGUF vocabulary:
      - user-defined tokens (Gemma's runs of newlines and of spaces, HTML tags) are matched
        in the raw text first, always, longest first; control tokens (<bos>,
        <start_of_turn> ...) only when allow_special is set;
      - in the rest, spaces become U+2581 and the characters are merged pairwise, always
        the adjacent pair whose concatenation is the vocabulary token of highest score
        (leftmost on ties), until no pair is a token;
      - a character that is no token is written as its UTF-8 bytes (<0xAB> tokens).
    No text is split beforehand: merges may cross spaces where the vocabulary allows.
    bos_prefix is [bos] when the GGUF asks for one (tokenizer.ggml.add_bos_token): a text
    the model reads from its start begins with it."""

    def __init__(self, tokens: list[str], token_types: list[int], scores: list[float],
                 eos_id: int, bos_id: int | None = None, add_bos: bool = False):
        self.tokens = tokens
        self.token_ids = {t: i for i, t in enumerate(tokens)}
        self.scores = scores
        self.eos_id = eos_id
        self.bos_prefix = [bos_id] if add_bos and bos_id is not None else []
        self.special = {t: i for i, t in enumerate(tokens)
                        if token_types[i] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)}
        self.special_ids = {i for t, i in self.special.items() if token_types[i] == TOKEN_TYPE_CONTROL}
        self.user_defined = {t: i for t, i in self.special.items() if i not in self.special_ids}
        self.byte_ids = {}
        self.id_bytes = {}
        for i, t in enumerate(tokens):
            if token_types[i] == TOKEN_TYPE_BYTE:
                self.byte_ids[int(t[3:5], 16)] = i
                self.id_bytes[i] = bytes([int(t[3:5], 16)])
        if len(self.byte_ids) != 256:
            raise ValueError(f"the vocabulary has {len(self.byte_ids)} byte tokens, 256 expected")

        def splitter(names):
            longest_first = sorted(names, key=len, reverse=True)
            return regex.compile("(" + "|".join(regex.escape(s) for s in longest_first) + ")")

        self._user_split = splitter(self.user_defined)
        self._special_split = splitter(self.special)

    @classmethod
    def from_gguf(cls, reader) -> "SentencePieceTokenizer":
        fields = reader.fields

        def value(key, default=None):
            return fields[key].contents() if key in fields else default

        if value("tokenizer.ggml.add_space_prefix", False):
            raise ValueError("tokenizer.ggml.add_space_prefix is set: not supported")
        return cls(value("tokenizer.ggml.tokens"), value("tokenizer.ggml.token_type"),
                   value("tokenizer.ggml.scores"), int(value("tokenizer.ggml.eos_token_id")),
                   value("tokenizer.ggml.bos_token_id"),
                   bool(value("tokenizer.ggml.add_bos_token", False)))

    def _merge(self, text: str) -> list[int]:
        import heapq

        symbols = list(text.replace(" ", SPACE))
        n = len(symbols)
        following = list(range(1, n + 1))   # index of the next live symbol (n: none)
        preceding = list(range(-1, n - 1))
        heap: list[tuple[float, int, str]] = []

        def push(left: int) -> None:
            if left < 0 or following[left] >= n:
                return
            right = following[left]
            merged = symbols[left] + symbols[right]
            token = self.token_ids.get(merged)
            if token is not None:
                heapq.heappush(heap, (-self.scores[token], left, merged))

        for i in range(n - 1):
            push(i)
        while heap:
            _, left, merged = heapq.heappop(heap)
            right = following[left]
            # stale: one of the two symbols has merged since this pair was pushed
            if symbols[left] is None or right >= n or symbols[left] + symbols[right] != merged:
                continue
            symbols[left], symbols[right] = merged, None
            following[left] = following[right]
            if following[right] < n:
                preceding[following[right]] = left
            push(preceding[left])
            push(left)
        ids: list[int] = []
        for symbol in symbols:
            if symbol is None:
                continue
            token = self.token_ids.get(symbol)
            if token is not None:
                ids.append(token)
            else:  # byte fallback
                ids.extend(self.byte_ids[b] for b in symbol.encode("utf-8"))
        return ids

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        matches = self._special_split if allow_special else self._user_split
        table = self.special if allow_special else self.user_defined
        ids: list[int] = []
        for piece in matches.split(text):
            if piece in table:
                ids.append(table[piece])
            elif piece:
                ids.extend(self._merge(piece))
        return ids

    def decode(self, ids) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if i in self.id_bytes:
                out += self.id_bytes[i]
            else:
                out += self.tokens[i].replace(SPACE, " ").encode("utf-8")
        return out.decode("utf-8", errors="replace")
