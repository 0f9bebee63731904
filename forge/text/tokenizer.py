"""The text <-> token-id mapping of a GGUF model, built from the file's metadata with `tokenizers`.

Two kinds of vocabulary, by `tokenizer.ggml.model`:
    gpt2    byte-level BPE (SmolLM2, Llama 3, Qwen): the file's merges, a pre-tokenizer named by
            `tokenizer.ggml.pre`, every byte spelled as one printable character
    llama   SentencePiece BPE (Gemma, Llama 2, Mistral, TinyLlama): spaces as "▁", bytes no piece
            spells as <0xXX> tokens (byte fallback); the file has no merges, so they are derived
            from the vocabulary, best first: by score, or for Gemma by the pieces' order in the
            file (its scores do not follow its merge order); a "▁" before the text unless the file
            says tokenizer.ggml.add_space_prefix = false (always, as SentencePiece adds it, even
            before a text that starts with a space)

Owns vocabulary, merges, pre-tokenizer choice, special tokens and each token's bytes
(`token_bytes`). Reads metadata only; it never touches tensors and never does network I/O.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, normalizers
from tokenizers import Tokenizer as _BpeTokenizer

from forge.errors import ModelLoadError
from forge.models.gguf_file import GGUFFile, read_gguf
from forge.text.tokenizer_models import (
    BYTE_PIECE,
    CHAR_TO_BYTE,
    GPT2_SPLIT_NAMES,
    SPACE,
    SPLITS,
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_USER_DEFINED,
    Metadata,
    build_bpe,
    build_spm,
    missing_byte_pieces,
    missing_bytes,
    spm_merges,
)

# Control tokens that end a turn in the chat formats of the families forge runs: generating one ends
# a request, as eos does (files name eos once; a chat model may end its turn with another token).
END_OF_TURN_PIECES = frozenset({"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                                "<|endoftext|>", "<|end_of_text|>"})
# OpenAI's harmony format (gpt-oss, a vocabulary with <|return|>): <|end|> closes every message, the
# reasoning's too, and the reply goes on; <|return|> ends the reply and <|call|> a tool call (as
# llama.cpp and the harmony library read them).
HARMONY_END_PIECES = frozenset({"<|return|>", "<|call|>"})

_SURROGATES = re.compile("[\ud800-\udfff]")
class Tokenizer:
    """The tokenizer of one model: byte-level BPE (kind "gpt2") or SentencePiece BPE ("spm").

    Invariants:
    - `encode` never raises on any `str`, and gives the ids the model's own tokenizer gives. A byte
      value with no token in the vocabulary (byte-level vocabularies may lack rarely used bytes:
      see `missing_bytes`) is dropped on its own, the other bytes of its character are kept, as
      the model was trained. Lone surrogates (not valid Unicode) are encoded as U+FFFD.
    - `decode(ids)` equals the UTF-8 decoding (invalid sequences -> U+FFFD) of the concatenated
      `token_bytes` of the non-skipped ids (for a SentencePiece vocabulary with a prefix space, less
      one leading space); ids outside [0, vocab_size) raise IndexError.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str] | Sequence[tuple[str, str]],
        *,
        kind: str = "gpt2",
        add_space_prefix: bool = False,
        end_token_ids: Sequence[int] = (),
        unk_token_id: int | None = None,
        token_types: Sequence[int] | None = None,
        pre: str = "default",
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._tokens = list(tokens)
        self.vocab_size = len(self._tokens)
        types = list(token_types) if token_types is not None else [TOKEN_TYPE_NORMAL] * self.vocab_size
        if len(types) != self.vocab_size:
            raise ModelLoadError(f"tokenizer has {self.vocab_size} tokens but {len(types)} token types")
        for name, token_id in (("bos", bos_token_id), ("eos", eos_token_id), ("pad", pad_token_id)):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ModelLoadError(f"tokenizer {name} token id {token_id} is outside the vocabulary")
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.pre = pre
        self.kind = kind
        self.add_space_prefix = add_space_prefix
        self.warnings: list[str] = []      # what the loader should tell the operator (an unknown pre-tokenizer)
        self._types = types
        self.special_ids = frozenset(i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL)
        # eos, the file's end-of-turn ids, and the control tokens named in END_OF_TURN_PIECES (harmony's)
        ends = END_OF_TURN_PIECES
        if any(self._tokens[i] == "<|return|>" for i in self.special_ids):
            ends = (ends - {"<|end|>"}) | HARMONY_END_PIECES
        self.end_token_ids = frozenset(
            {i for i in self.special_ids if self._tokens[i] in ends}
            | {i for i in (eos_token_id, *end_token_ids) if i is not None and 0 <= i < self.vocab_size})
        added_ids = [i for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
        self._added_ids = frozenset(added_ids)
        self._bytes_cache: list[bytes | None] = [None] * self.vocab_size
        self._max_token_bytes: int | None = None   # the longest token's bytes, found when first needed
        if kind == "spm":
            has_unk = unk_token_id is not None and 0 <= unk_token_id < self.vocab_size
            unk = self._tokens[unk_token_id] if has_unk and unk_token_id is not None else None
            self._bpe = build_spm(self._tokens, merges, add_space_prefix=add_space_prefix, unk_token=unk)
        elif kind == "gpt2":
            if pre not in SPLITS and pre != "smollm" and pre not in GPT2_SPLIT_NAMES:
                self.warnings.append(f"unknown pre-tokenizer {pre!r}: splitting text as GPT-2 does (byte-level "
                                     "regex); tokens may differ from the model's own tokenizer")
            self._bpe = build_bpe(self._tokens, [m if isinstance(m, str) else " ".join(m) for m in merges], pre)
        else:
            raise ModelLoadError(f"unknown tokenizer kind {kind!r}")
        self._bpe.add_special_tokens(
            [AddedToken(self._tokens[i], special=True, normalized=False) for i in added_ids if i in self.special_ids]
        )
        user_defined = [i for i in added_ids if i not in self.special_ids]
        self._bpe.add_tokens([AddedToken(self._tokens[i], special=False, normalized=False) for i in user_defined])
        # Bytes no token spells are dropped by BPE, each alone (the rest of the text, even the
        # other bytes of the same character, is kept): exactly what the model's own tokenizer does.
        self._bare: _BpeTokenizer | None = None
        self.missing_bytes = (missing_bytes(self._tokens, self._added_ids) if kind == "gpt2"
                              else missing_byte_pieces(self._tokens, types))

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike[str] | Any) -> Tokenizer:
        """Build from a GGUF file (a path, or a GGUFFile already read, to avoid re-reading it)."""
        reader = _open_reader(path_or_reader)
        meta = Metadata(reader)
        model = meta.string("tokenizer.ggml.model")
        tokens = meta.strings("tokenizer.ggml.tokens")
        if model not in ("gpt2", "llama"):
            raise ModelLoadError(f"unsupported tokenizer {model!r}: forge supports 'gpt2' (byte-level BPE) "
                                 "and 'llama' (SentencePiece BPE)")
        if tokens is None:
            raise ModelLoadError("the model file has no tokenizer vocabulary")
        common: dict[str, Any] = dict(
            token_types=meta.numbers("tokenizer.ggml.token_type"),
            pre=meta.string("tokenizer.ggml.pre") or "default",
            bos_token_id=meta.number("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.number("tokenizer.ggml.eos_token_id"),
            pad_token_id=meta.number("tokenizer.ggml.padding_token_id"),
            chat_template=meta.string("tokenizer.chat_template"),
            end_token_ids=[i for key in ("eot_token_id", "eom_token_id")
                           if (i := meta.number(f"tokenizer.ggml.{key}")) is not None],
        )
        if model == "gpt2":
            merges = meta.strings("tokenizer.ggml.merges")
            if merges is None:
                raise ModelLoadError("the model file has no tokenizer merges")
            return cls(tokens, merges, add_bos=bool(meta.number("tokenizer.ggml.add_bos_token") or 0), **common)
        # SentencePiece: merges derived from the vocabulary, best first (module docstring)
        if (meta.string("general.architecture") or "").startswith("gemma"):
            # Gemma files store pieces of two or more spaces as spaces; the pieces around them use "▁"
            tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
            priority: Sequence[float] = [-float(i) for i in range(len(tokens))]
        else:
            scores = meta.floats("tokenizer.ggml.scores")
            if scores is None or len(scores) != len(tokens):
                raise ModelLoadError("the SentencePiece vocabulary has no scores, or not one per token")
            priority = scores
        add_bos = meta.number("tokenizer.ggml.add_bos_token")
        add_space_prefix = meta.number("tokenizer.ggml.add_space_prefix")
        return cls(tokens, spm_merges(tokens, priority), kind="spm",
                   add_space_prefix=True if add_space_prefix is None else bool(add_space_prefix),
                   unk_token_id=meta.number("tokenizer.ggml.unknown_token_id"),
                   add_bos=True if add_bos is None else bool(add_bos), **common)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Text to ids. Special-token text (e.g. "<|im_start|>") becomes its single id.

        With add_special_tokens, a bos id is prepended only if the model file asks for it.
        """
        text = _valid_unicode(text)
        if len(text) > _GIL_FREE_CHARS:  # the batch call lets other threads (the event loop) run meanwhile
            ids: list[int] = self._bpe.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._bpe.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))`, in time linear in the text and far less than encoding it:
        no token spells more than `_max_token_bytes` bytes of the text (bytes BPE drops spell none). 0 for a
        SentencePiece vocabulary without every byte piece, whose unknown runs fuse into one token."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max(len(self.token_bytes(i)) for i in range(self.vocab_size))
        if self.kind == "spm" and self.missing_bytes:
            return 0
        data = _valid_unicode(text).encode("utf-8")
        if self.kind == "gpt2" and self.missing_bytes:
            data = data.translate(None, delete=bytes(sorted(self.missing_bytes)))
        return -(-len(data) // max(self._max_token_bytes, 1))

    def encode_exact(self, text: str) -> list[int]:
        """Ids whose token_bytes join to exactly text's UTF-8: encode without special tokens and,
        for a SentencePiece vocabulary, without the prefix space (a grammar engine tokenizing a
        fragment of output, not a whole prompt)."""
        if not (self.kind == "spm" and self.add_space_prefix):
            return self.encode(text, add_special_tokens=False)
        if self._bare is None:                    # a copy without the prefix, made once, when first needed
            bare = _BpeTokenizer.from_str(self._bpe.to_str())
            bare.normalizer = normalizers.Replace(" ", SPACE)
            self._bare = bare
        return list(self._bare.encode(_valid_unicode(text), add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Ids to text; bytes that do not form valid UTF-8 become U+FFFD."""
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise IndexError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return str(self._bpe.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token `token_id` stands for (for "<|im_end|>": its text as UTF-8)."""
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        cached = self._bytes_cache[token_id]
        if cached is None and self.kind == "spm":
            piece = self._tokens[token_id]
            byte = BYTE_PIECE.fullmatch(piece) if self._types[token_id] == TOKEN_TYPE_BYTE else None
            cached = bytes((int(byte.group(1), 16),)) if byte else piece.replace(SPACE, " ").encode("utf-8")
            self._bytes_cache[token_id] = cached
        if cached is None:
            piece = self._tokens[token_id]
            # As the decoder does for every token (special ones too): a character of the byte
            # alphabet stands for its byte, any other character for its own UTF-8.
            cached = b"".join(bytes((CHAR_TO_BYTE[c],)) if c in CHAR_TO_BYTE else c.encode("utf-8") for c in piece)
            self._bytes_cache[token_id] = cached
        return cached

    def token_str(self, token_id: int) -> str:
        """The text of one token; lossy: part of a multi-byte character shows as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def mismatch(self, other: Tokenizer, *, max_size_difference: int = 128) -> str | None:
        """Why `other` does not speak this vocabulary (a draft model's tokenizer against its
        target's), or None when it does: the same kind, the same piece at every id both have, and
        sizes that differ only by a few added tokens at the end."""
        if other.kind != self.kind:
            return f"its tokenizer is {other.kind!r}, this one {self.kind!r}"
        if abs(other.vocab_size - self.vocab_size) > max_size_difference:
            return f"it has {other.vocab_size} tokens, this one {self.vocab_size}"
        shared = min(self.vocab_size, other.vocab_size)
        for i in range(shared):
            if self._tokens[i] != other._tokens[i]:
                return f"token {i} is {other._tokens[i]!r} there, {self._tokens[i]!r} here"
        return None

    def token_to_id(self, piece: str) -> int | None:
        """The id of a vocabulary entry given in its stored spelling (byte-level, or with "▁")."""
        token_id = self._bpe.token_to_id(piece)
        return None if token_id is None else int(token_id)


_GIL_FREE_CHARS = 2048


def _valid_unicode(text: str) -> str:
    """Lone surrogates (not valid Unicode) as U+FFFD, as every encode takes them."""
    return _SURROGATES.sub("\ufffd", text) if _SURROGATES.search(text) else text


def _open_reader(path_or_reader: str | os.PathLike[str] | Any) -> GGUFFile:
    if isinstance(path_or_reader, GGUFFile):
        return path_or_reader
    return read_gguf(path_or_reader)


