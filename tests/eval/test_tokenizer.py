"""The GGUF byte-level BPE tokenizer. Expected ids were checked once against the Hugging
Face `tokenizers` BPE built from the same vocab/merges with the smollm pre-tokenizer
(individual digits, then GPT-2 byte-level regex); they agreed on four licence texts."""
from tools.eval.evaluate import DEFAULT_TEXT
from tools.eval.tokenizer import bytes_to_unicode, pre_tokenize

SAMPLE = ("Numbers: 3.14159, 2024-11-30; émigré naïve café — “quotes” 日本語 tabs\tand\r\n"
          "CRLF  spaces   end  ")
SAMPLE_IDS = [39006, 42, 216, 35, 30, 33, 36, 33, 37, 41, 28, 216, 34, 32, 34, 36, 29, 33, 33,
              29, 35, 32, 43, 26411, 22757, 27968, 15486, 46494, 37366, 1841, 619, 385, 2346,
              573, 17097, 241, 115, 40993, 179, 120, 248, 29416, 197, 397, 201, 198, 9088, 60,
              54, 216, 5600, 256, 1112, 256]


def test_bytes_to_unicode_is_a_bijection_onto_printable_characters():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"


def test_pre_tokenizer_splits_digits_and_keeps_every_character():
    words = pre_tokenize("in 2024,\nthe  end ")
    assert words == ["in", " ", "2", "0", "2", "4", ",", "\n", "the", " ", " end", " "]
    assert "".join(words) == "in 2024,\nthe  end "


def test_sample_matches_the_reference_ids(model):
    tok = model.tokenizer
    assert tok.encode(SAMPLE) == SAMPLE_IDS
    assert tok.decode(SAMPLE_IDS) == SAMPLE


def test_round_trip_of_the_evaluation_text(model):
    tok = model.tokenizer
    with open(DEFAULT_TEXT, encoding="utf-8") as f:
        text = f.read()
    ids = tok.encode(text)
    assert len(ids) > 7000
    assert tok.decode(ids) == text


def test_special_tokens_only_when_allowed(model):
    tok = model.tokenizer
    chat = "<|im_start|>user\nHi<|im_end|>\n"
    ids = tok.encode(chat, allow_special=True)
    assert ids[0] == tok.special["<|im_start|>"] == 1
    assert tok.special["<|im_end|>"] in ids
    assert tok.decode(ids) == chat
    plain = tok.encode(chat)
    assert 1 not in plain and tok.decode(plain) == chat


def tiny_sentencepiece():
    """A vocabulary in Gemma's layout: control tokens, user-defined runs, 256 byte tokens,
    then pieces whose scores decide the merge order."""
    from tools.eval.tokenizer import SentencePieceTokenizer

    tokens = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "\n\n", "  "]
    types = [3, 3, 3, 3, 4, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = {"a": -1.0, "b": -1.0, "c": -1.0, "▁": -1.0, "ab": -5.0, "bc": -2.0, "abc": -3.0,
              "▁a": -4.0, "é": -1.0}
    tokens += list(pieces)
    types += [1] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + list(pieces.values())
    return SentencePieceTokenizer(tokens, types, scores, eos_id=1, bos_id=2, add_bos=True)


def test_sentencepiece_merges_the_best_scored_pair_first():
    tok = tiny_sentencepiece()
    names = lambda ids: [tok.tokens[i] for i in ids]  # noqa: E731
    # "bc" (-2) beats "ab" (-5), then a + bc = "abc" (-3) is a token: merged in two steps
    assert names(tok.encode("abc")) == ["abc"]
    assert names(tok.encode("abab")) == ["ab", "ab"]
    assert names(tok.encode("ab")) == ["ab"]
    assert names(tok.encode("a b")) == ["a", "▁", "b"]  # no "▁b" piece
    assert names(tok.encode(" a")) == ["▁a"]
    # user-defined runs always; control tokens only when allowed; bytes for unknown characters
    assert names(tok.encode("a\n\nb  c")) == ["a", "\n\n", "b", "  ", "c"]
    assert names(tok.encode("<bos>", allow_special=True)) == ["<bos>"]
    assert "<bos>" not in names(tok.encode("<bos>"))
    assert names(tok.encode("z")) == ["<0x7A>"]
    assert names(tok.encode("日")) == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert tok.bos_prefix == [2]
    text = "a b\n\nabc  日 é"
    assert tok.decode(tok.encode(text)) == text
