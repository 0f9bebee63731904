"""The byte tokenizer that goes with TinyTransformer: one token per UTF-8 byte.

Token 0 is eos, byte b is token b + 1, and 257..319 are reserved ids that no text encodes to.
Decoding is lossy but never fails: it drops non-byte ids and turns invalid UTF-8 into U+FFFD.
"""

from __future__ import annotations

from collections.abc import Iterable

from forge.seed.toy_model import TokenId

VOCAB_SIZE = 320
EOS_TOKEN: TokenId = 0
_NUM_BYTES = 256          # byte ids are 1..256


def encode(text: str) -> list[TokenId]:
    """The UTF-8 bytes of ``text``, each shifted up by one. Never emits eos or a reserved id.

    A lone surrogate (which a Python str can hold but UTF-8 cannot) is encoded as U+FFFD.
    """
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        data = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text).encode("utf-8")
    return [b + 1 for b in data]


def decode(tokens: Iterable[TokenId]) -> str:
    """Text of a token run. eos, reserved and out-of-range ids decode to nothing (the bytes on
    either side join up); byte sequences that are not valid UTF-8 become U+FFFD."""
    data = bytes(t - 1 for t in tokens if 1 <= t <= _NUM_BYTES)
    return data.decode("utf-8", errors="replace")


def decode_one(token: TokenId) -> str:
    """Text of one token: an ASCII character, "" for a non-byte id, and U+FFFD for a byte
    >= 0x80, which is never valid UTF-8 alone (decode whole runs to get multi-byte characters)."""
    return decode((token,))
