"""forge.text.tokenizer on the real default model file (SmolLM2-135M-Instruct, byte-level BPE, pre = smollm)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from forge.errors import ModelLoadError
from forge.models.gguf_file import read_gguf
from forge.models.hub import pull
from forge.text.tokenizer import Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was 3:45pm on 2024-01-02, and 1,000,000 people watched.",
    "def f(x):\n\tif x  >  1:\n\t\treturn    x ** 2\n\n\n    # trailing spaces   \n",
    "Crème brûlée, naïve façade, Ångström, ñandú, Ελληνικά, русский текст",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Family: 👩‍👩‍👧‍👦, flags 🇫🇷🇯🇵, skin tones 👍🏽, keycap 1️⃣, and a lone ♥︎.",
    "   leading and trailing whitespace \r\n\r\n\t ",
    "Arabic digits ٣٤٥ and fullwidth １２３ and superscript ²³",
    "",
]


@pytest.fixture(scope="module")
def reader() -> Any:
    return read_gguf(pull(progress=lambda _message: None))


@pytest.fixture(scope="module")
def tok(reader: Any) -> Tokenizer:
    return Tokenizer.from_gguf(reader)


def pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.token_str(i) for i in ids]


def test_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.add_bos is False
    assert tok.pre == "smollm"
    assert tok.special_ids == frozenset(range(17))
    assert tok.token_str(2) == "<|im_end|>"
    assert tok.end_token_ids == frozenset({0, 2})                  # <|endoftext|> ends a request too
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


def test_from_path(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(["<s>", "a", "b", "1", "Ġ", "ab", "Ġab"])
    writer.add_token_merges(["a b", "Ġ ab"])
    writer.add_token_types([3, 1, 1, 1, 1, 1, 1])
    writer.add_bos_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t = Tokenizer.from_gguf(path)
    assert t.chat_template is None and t.eos_token_id is None
    assert t.encode("ab ab1") == [0, 5, 6, 3]  # bos, because the file asks for it
    assert t.encode("ab", add_special_tokens=False) == [5]
    assert t.decode([0, 5, 6, 3]) == "ab ab1"


def test_digits_split_before_byte_level(tok: Tokenizer) -> None:
    ids = tok.encode("\n\n1.")
    assert pieces(tok, ids) == ["\n\n", "1", "."]
    assert ids == [tok.token_to_id("ĊĊ"), tok.token_to_id("1"), tok.token_to_id(".")]
    assert pieces(tok, tok.encode("in 2024")) == ["in", " ", "2", "0", "2", "4"]


def test_special_token_text_is_one_id(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user")
    assert ids == [1, tok.token_to_id("user")]
    assert tok.decode(ids) == "user"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user"
    assert tok.token_bytes(1) == b"<|im_start|>"


def test_no_bos_added(tok: Tokenizer) -> None:
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_token_bytes_of_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("👍")
    assert len(ids) > 1  # split inside the character
    assert b"".join(tok.token_bytes(i) for i in ids) == "👍".encode()
    assert "\ufffd" in tok.token_str(ids[0])
    assert tok.token_bytes(tok.token_to_id("Ġ") or 0) == b" "


def test_bytes_without_a_token_are_dropped_alone(tok: Tokenizer) -> None:
    # Bytes 0x04 and 0xF1 (lead byte of U+40000..U+7FFFF) have no token in this vocabulary; like
    # the model's own tokenizer, forge drops just those bytes and never fails.
    assert tok.token_to_id(chr(0x04)) is None
    assert 0x04 in tok.missing_bytes and 0xF1 in tok.missing_bytes
    assert tok.encode("a\x04b") == tok.encode("a") + tok.encode("b")
    kept = b"".join(tok.token_bytes(i) for i in tok.encode("x\U00050000y"))
    assert kept == b"x" + "\U00050000".encode()[1:] + b"y"
    assert tok.decode(tok.encode("\x06\x13\x14\x16\x1d")) == ""
    assert tok.encode("\x04") == []


def test_added_token_text_is_never_stripped() -> None:
    # A tiny vocabulary where most bytes have no token, with added tokens made of such bytes.
    t = Tokenizer(["a", "b", "Ġ", "ab", "<Ġx>", "uĠd", "<s>"], ["a b"], token_types=[1, 1, 1, 1, 3, 4, 3])
    ids = t.encode("a<Ġx>buĠd zz<s>")
    assert ids == [0, 4, 1, 5, 2, 6]
    assert t.decode(ids) == "abu d "  # special tokens skipped; the user-defined one kept
    assert t.decode(ids, skip_special_tokens=False) == b"".join(t.token_bytes(i) for i in ids).decode()


def test_decode_matches_token_bytes_on_random_ids(tok: Tokenizer) -> None:
    rng = random.Random(1234)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        joined = b"".join(tok.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
        assert tok.decode(ids, skip_special_tokens=False) == joined


def test_lone_surrogate_becomes_replacement_character(tok: Tokenizer) -> None:
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"


def test_out_of_range_ids(tok: Tokenizer) -> None:
    with pytest.raises(IndexError):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(IndexError):
        tok.decode([-1])
    with pytest.raises(IndexError):
        tok.token_bytes(tok.vocab_size)


def test_decode_of_split_character_is_lossy(tok: Tokenizer) -> None:
    ids = tok.encode("日本")
    assert tok.decode(ids[:1]).endswith("\ufffd")


def test_llama3_pre_tokenizer_builds() -> None:
    tokens = ["a", "b", "1", "2", "3", "Ġ", "ab", "12"]
    t = Tokenizer(tokens, ["a b", "1 2"], pre="llama-bpe")
    assert [t.token_str(i) for i in t.encode("ab 1231")] == ["ab", " ", "12", "3", "1"]


def test_unsupported_model_is_rejected(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "wordpiece.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("bert")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported tokenizer 'bert': forge supports 'gpt2'"):
        Tokenizer.from_gguf(path)


def test_missing_file() -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        Tokenizer.from_gguf("/nonexistent/model.gguf")


# ---- pre-tokenizers of other byte-level families, against transformers --------------------------

BPE_DATA: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parent.parent / "data" / "bpe_pretokenizer_reference.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_pre_tokenizers_match_transformers(pre: str) -> None:
    """A byte-level vocabulary trained by tokenizers (scripts/reference/make_family_reference.py) under Qwen2's
    and Llama 3's split rules: forge's ids are transformers' for every text of the corpus."""
    tokens = BPE_DATA["tokens"]
    tok = Tokenizer(tokens, BPE_DATA["merges"], pre=pre,
                    token_types=[3 if t.startswith("<|") else 1 for t in tokens])
    assert tok.warnings == []
    for case in BPE_DATA["cases"][pre]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
    other = "llama-bpe" if pre == "qwen2" else "qwen2"           # the two rules differ on digits
    assert any(a["ids"] != b["ids"] for a, b in zip(BPE_DATA["cases"][pre], BPE_DATA["cases"][other], strict=True))


def test_the_o200k_split_matches_tiktoken() -> None:
    """The same vocabulary under o200k's split (`gpt-4o`: GPT-4o's, gpt-oss's o200k_harmony): forge's ids are
    tiktoken's own under its o200k pattern, and Llama 3's split would not give them (camelCase, capitals)."""
    tokens = BPE_DATA["tokens"]
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    tok = Tokenizer(tokens, BPE_DATA["merges"], pre="gpt-4o", token_types=types)
    assert tok.warnings == []
    for case in BPE_DATA["cases"]["gpt-4o"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
    llama3 = Tokenizer(tokens, BPE_DATA["merges"], pre="llama-bpe", token_types=types)
    assert any(llama3.encode(case["text"]) != case["ids"] for case in BPE_DATA["cases"]["gpt-4o"])


def test_harmony_ends_a_reply_at_return_or_call_not_at_end() -> None:
    """gpt-oss's harmony format closes every message with <|end|>, its reasoning's too, and the reply goes
    on: there <|return|> and <|call|> end it. Elsewhere (Phi-3) <|end|> ends the turn."""
    harmony = ["a", "b", "<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
               "<|call|>"]
    tok = Tokenizer(harmony, [], token_types=[1, 1] + [3] * 7, eos_token_id=7)
    assert tok.end_token_ids == {2, 7, 8}
    phi3 = Tokenizer(["a", "b", "<|end|>", "<|endoftext|>"], [], token_types=[1, 1, 3, 3], eos_token_id=3)
    assert phi3.end_token_ids == {2, 3}


def test_an_unknown_pre_tokenizer_is_named_in_a_warning() -> None:
    tok = Tokenizer(["a", "b", "ab"], ["a b"], pre="falcon")
    assert tok.warnings and "'falcon'" in tok.warnings[0] and "GPT-2" in tok.warnings[0]


@pytest.fixture(scope="module")
def gemma_tok(gemma3_model_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gemma3_model_path)


def test_min_num_tokens_is_a_lower_bound_and_long_texts_encode_the_same(tok: Tokenizer, gemma_tok: Tokenizer) -> None:
    """The bound the tokenizer refuses over-long prompts by never exceeds the real count, on byte-level
    and SentencePiece vocabularies, for text of every kind (runs of one character are where tokens are
    longest); and a text long enough to be encoded as a batch (letting the GIL go) gives the same ids."""
    rng = random.Random(5)
    pieces = [*TEXTS, " " * 300, "\n" * 200, "-" * 500, "1" * 100, "\u00e9" * 50, "\U0001f5fc" * 20, "\x00\x01\x7f",
              "<|im_start|>", "<|im_end|>", "<start_of_turn>", "ab" * 100]
    for t in (tok, gemma_tok):
        assert t.min_num_tokens("") == 0
        for _ in range(150):
            text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40)))
            assert t.min_num_tokens(text) <= len(t.encode(text, add_special_tokens=False)), (t.kind, text[:80])
        long = "".join(rng.choice(pieces) for _ in range(400))
        assert len(long) > 2048                                 # the batch call's side of the threshold
        assert t.encode(long, add_special_tokens=False) == t._bpe.encode(long, add_special_tokens=False).ids
    # SmolLM2 splits every digit off: a megabyte of them is a million tokens, and the bound shows it
    assert tok.min_num_tokens("1" * 2**20) > 8192
