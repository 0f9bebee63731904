"""The `tokenizers` models a GGUF vocabulary describes (forge.text.tokenizer builds its Tokenizer on them): byte-level
BPE from the file's merges and pre-tokenizer name, SentencePiece BPE with merges derived from the vocabulary,
the byte tables both need, and typed access to the file's tokenizer metadata.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _BpeTokenizer

from forge.errors import ModelLoadError
from forge.models.gguf_file import GGUFFile

# GGUF token types (tokenizer.ggml.token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6

SPACE = "\u2581"  # "▁": SentencePiece's spelling of a space
# The split regex of Llama-3 style byte-level BPE ("llama-bpe" in GGUF files).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's split: as Llama 3's, but digits one by one.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k's split (GPT-4o, and gpt-oss's o200k_harmony, "gpt-4o" in GGUF files): a word is a run of capitals and
# then of lower-case letters (camelCase splits before the C), its contraction kept on; '/' and newlines go
# with the punctuation before them.
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
          "gpt-4o": _O200K_SPLIT}
# Pre-tokenizer names whose files split as GPT-2 did (byte-level, its own regex).
GPT2_SPLIT_NAMES = frozenset({"default", "gpt2", "gpt-2"})
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: every byte value as one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    num_shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + num_shifted)
            num_shifted += 1
    return table


BYTE_TO_CHAR = _byte_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def build_bpe(tokens: Sequence[str], merges: Sequence[str], pre: str) -> _BpeTokenizer:
    vocab = {piece: i for i, piece in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError("tokenizer vocabulary has duplicate tokens")
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise ModelLoadError(f"malformed tokenizer merge {merge!r}")
        pairs.append((left, right))
    try:
        bpe = _BpeTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    except Exception as exc:  # the library reports bad merges (unknown pieces) as plain exceptions
        raise ModelLoadError(f"invalid tokenizer vocabulary or merges: {exc}") from exc
    bpe.pre_tokenizer = _pre_tokenizer(pre)
    bpe.decoder = decoders.ByteLevel()
    return bpe


def spm_merges(tokens: Sequence[str], priority: Sequence[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a piece into two pieces of
    the vocabulary, ranked by the priority of the piece they make (highest first; ties: longer
    left part, then longer right part, then the order of the vocabulary). The same order transformers
    builds for these files, so the two tokenize alike. A 262,144-piece vocabulary (Gemma's) has about
    half a million; they are ranked with one stable numpy sort, not a sort of Python tuples."""
    ids = {piece: i for i, piece in enumerate(tokens)}
    lefts: list[str] = []
    rights: list[str] = []
    made: list[int] = []                                         # the piece each merge makes
    cuts: list[int] = []                                         # the length of its left part
    for order, piece in enumerate(tokens):
        n = len(piece)
        if n < 2 or ids.get(piece) != order:
            continue                                             # a single character, or a duplicate spelling
        for k in range(1, n):
            left = piece[:k]
            if left in ids:
                right = piece[k:]
                if right in ids:
                    lefts.append(left)
                    rights.append(right)
                    made.append(order)
                    cuts.append(k)
    if not made:
        return []
    made_ids, cut = np.asarray(made), np.asarray(cuts)
    lengths = np.fromiter((len(tokens[i]) for i in made), dtype=np.int64, count=len(made))
    scores = np.asarray(priority, dtype=np.float64)[made_ids]
    # lexsort: the last key first; each key's ties keep the order of the keys before it (stable)
    ranked = np.lexsort((made_ids, -(lengths - cut), -cut, -scores))
    return [(lefts[i], rights[i]) for i in ranked.tolist()]


def build_spm(tokens: Sequence[str], merges: Sequence[str] | Sequence[tuple[str, str]], *,
               add_space_prefix: bool, unk_token: str | None) -> _BpeTokenizer:
    vocab: dict[str, int] = {}
    for i, piece in enumerate(tokens):
        vocab.setdefault(piece, i)
    pairs = [(m.split(" ", 1)[0], m.split(" ", 1)[-1]) if isinstance(m, str) else m for m in merges]
    try:
        spm = _BpeTokenizer(models.BPE(vocab, pairs, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    except Exception as exc:  # the library reports bad merges (unknown pieces) as plain exceptions
        raise ModelLoadError(f"invalid tokenizer vocabulary or merges: {exc}") from exc
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        # SentencePiece's dummy prefix: "▁" before the text whatever it starts with (and, as in
        # llama.cpp, after each special token: every stretch of plain text is normalized alone)
        spm.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        spm.normalizer = normalizers.Replace(" ", SPACE)
    spm.decoder = decoders.Sequence(steps)
    return spm


def missing_byte_pieces(tokens: Sequence[str], types: Sequence[int]) -> frozenset[int]:
    """Byte values with no <0xXX> piece: text needing them cannot be spelled by byte fallback."""
    present = {int(m.group(1), 16) for piece, t in zip(tokens, types, strict=True)
               if t == TOKEN_TYPE_BYTE and (m := BYTE_PIECE.fullmatch(piece))}
    return frozenset(set(range(256)) - present)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer named by `tokenizer.ggml.pre`; other names get GPT-2's byte-level splitting
    (the constructor warns about names it does not know)."""
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def missing_bytes(tokens: Sequence[str], added_ids: frozenset[int]) -> frozenset[int]:
    """Byte values with no token of their own (BPE cannot spell any text containing them)."""
    present = {piece for i, piece in enumerate(tokens) if len(piece) == 1 and i not in added_ids}
    return frozenset(b for b, c in BYTE_TO_CHAR.items() if c not in present)


class Metadata:
    """Typed access to GGUF metadata; missing keys read as None."""

    def __init__(self, reader: GGUFFile) -> None:
        self._values = reader.metadata

    def _list(self, key: str) -> list[Any] | None:
        value = self._values.get(key)
        if value is None:
            return None
        return list(value) if isinstance(value, (list, np.ndarray)) else [value]

    def string(self, key: str) -> str | None:
        items = self._list(key)
        return None if not items else _utf8(key, items[0])

    def strings(self, key: str) -> list[str] | None:
        items = self._list(key)
        return None if items is None else [_utf8(key, item) for item in items]

    def number(self, key: str) -> int | None:
        items = self._list(key)
        return None if not items else _int(key, items[0])

    def numbers(self, key: str) -> list[int] | None:
        items = self._list(key)
        return None if items is None else [_int(key, item) for item in items]

    def floats(self, key: str) -> list[float] | None:
        value = self._values.get(key)
        if value is None:
            return None
        try:
            return np.asarray(value, dtype=np.float64).reshape(-1).tolist()
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"GGUF metadata {key} must be numbers") from exc


def _int(key: str, value: Any) -> int:
    if isinstance(value, (str, bytes, list)):
        raise ModelLoadError(f"GGUF metadata {key} must be a number")
    return int(value)


def _utf8(key: str, raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, bytes):
        raise ModelLoadError(f"GGUF metadata {key} must be a string")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"GGUF metadata {key} is not valid UTF-8") from exc
