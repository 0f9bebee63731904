from __future__ import annotations

import pytest

from forge.seed.byte_tokenizer import EOS_TOKEN, VOCAB_SIZE, decode, decode_one, encode


def test_constants() -> None:
    assert (VOCAB_SIZE, EOS_TOKEN) == (320, 0)


def test_byte_b_is_token_b_plus_one() -> None:
    assert encode("A") == [0x41 + 1]
    assert encode("") == []
    assert encode("\x00") == [1]
    assert encode("é") == [0xC3 + 1, 0xA9 + 1]


@pytest.mark.parametrize("text", ["hello, world", "café naïve", "日本語のテキスト", "🦀🐍 ok", "", "a\nb\tc\x00"])
def test_round_trip(text: str) -> None:
    tokens = encode(text)
    assert all(1 <= t <= 256 for t in tokens)
    assert len(tokens) == len(text.encode("utf-8"))
    assert decode(tokens) == text


def test_invalid_utf8_becomes_replacement_character() -> None:
    assert decode([0xFF + 1]) == "\ufffd"
    assert decode([ord("a") + 1, 0xC3 + 1, ord("b") + 1]) == "a\ufffdb"   # truncated 2-byte char
    assert decode(encode("🦀")[:2]) == "\ufffd"                           # cut emoji


def test_eos_reserved_and_out_of_range_decode_to_nothing() -> None:
    hi = encode("hi")
    assert decode([EOS_TOKEN, *hi, EOS_TOKEN]) == "hi"
    assert decode([257, hi[0], 300, 319, hi[1]]) == "hi"
    assert decode([-1, 320, 10**6, *hi]) == "hi"
    assert decode([EOS_TOKEN, 257, 319]) == ""


def test_decode_one() -> None:
    assert decode_one(ord("x") + 1) == "x"
    assert decode_one(EOS_TOKEN) == ""
    assert decode_one(257) == ""
    assert decode_one(320) == ""
    assert decode_one(0xC3 + 1) == "\ufffd"     # half a character on its own


def test_lone_surrogate_encodes_as_replacement() -> None:
    assert decode(encode("a\ud800b")) == "a\ufffdb"
