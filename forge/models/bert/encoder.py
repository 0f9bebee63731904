"""A served sentence-embedding model: a BERT encoder, its WordPiece tokenizer and its
sentence-transformers modules (max_seq_length, mean pooling, Normalize), as their files say.

Inputs are tokenized by the `tokenizers` library from tokenizer.json, truncated at max_seq_length
(what sentence-transformers does; the file's own truncation and padding are replaced), and
embedded in padded batches of inputs of similar length. Pure and synchronous: the daemon's encoder
actor runs embed() off the event loop.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from forge.errors import InvalidRequest, ModelLoadError
from forge.models.bert.bert_model import BertModel

F32 = npt.NDArray[np.float32]
# Tokens (batch x longest input) in one forward: bounds the [B, heads, T, T] scores' memory.
MAX_BATCH_TOKENS = 8192


def is_encoder_dir(path: str | os.PathLike[str]) -> bool:
    """A directory of a sentence-transformers BERT: config.json, model.safetensors, tokenizer.json."""
    root = Path(path)
    return root.is_dir() and all((root / n).is_file() for n in ("config.json", "model.safetensors", "tokenizer.json"))


def _read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        if default is not None:
            return default
        raise ModelLoadError(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


@dataclass(slots=True)
class LoadedEncoder:
    path: str
    model: BertModel
    tokenizer: Tokenizer
    max_seq_length: int          # inputs are truncated to this many tokens, [CLS] and [SEP] included

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> LoadedEncoder:
        """The model of a sentence-transformers directory: ModelLoadError if its modules are not
        Transformer -> mean Pooling (-> Normalize), which is all this family serves."""
        root = Path(directory)
        modules = [m.get("type", "") for m in _read_json(root / "modules.json", default=[{}])]
        pooling = _read_json(root / "1_Pooling" / "config.json", default={"pooling_mode_mean_tokens": True})
        other = [k for k, v in pooling.items()
                 if k.startswith("pooling_mode_") and v and k != "pooling_mode_mean_tokens"]
        if not pooling.get("pooling_mode_mean_tokens") or other:
            raise ModelLoadError(f"{root}: only mean pooling is served, the model asks for {other or 'none'}")
        if modules != [{}] and not any(m.endswith("Normalize") for m in modules):
            raise ModelLoadError(f"{root}: forge serves normalised embeddings; modules.json has no Normalize")
        model = BertModel.load(root)
        st_config = _read_json(root / "sentence_bert_config.json",
                               default={"max_seq_length": model.config.max_position})
        max_len = min(int(st_config.get("max_seq_length") or model.config.max_position), model.config.max_position)
        try:
            tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - the library raises its own exception types
            raise ModelLoadError(f"cannot read {root / 'tokenizer.json'}: {exc}") from None
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=max_len)
        return cls(str(root), model, tokenizer, max_len)

    @property
    def name(self) -> str:
        return Path(self.path).name

    @property
    def embedding_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def encode(self, text: str) -> list[int]:
        """[CLS] + WordPiece ids + [SEP], truncated at max_seq_length."""
        ids: list[int] = self.tokenizer.encode(text).ids
        return ids

    def check_ids(self, ids: Sequence[int], param: str = "input") -> list[int]:
        """Token ids given as an input run as they are: in the vocabulary and within max_seq_length."""
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise InvalidRequest(f"token ids must lie in [0, {self.vocab_size})", param=param)
        if len(ids) > self.max_seq_length:
            raise InvalidRequest(f"this model takes at most {self.max_seq_length} tokens an input, got {len(ids)}",
                                 param=param, code="context_length_exceeded")
        return list(ids)

    def embed(self, inputs: Sequence[Sequence[int]]) -> F32:
        """The L2-normalised vectors [N, H] of the inputs' ids, in their order: inputs of similar
        length go through one forward together, padded to the longest of them."""
        out = np.empty((len(inputs), self.embedding_size), dtype=np.float32)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        start = 0
        while start < len(order):
            stop = start + 1
            while stop < len(order) and (stop + 1 - start) * len(inputs[order[stop]]) <= MAX_BATCH_TOKENS:
                stop += 1
            group = order[start:stop]
            width = len(inputs[group[-1]])
            ids = np.zeros((len(group), width), dtype=np.int64)                     # [B, T], pad id 0
            mask = np.zeros((len(group), width), dtype=np.bool_)                    # [B, T]
            for row, i in enumerate(group):
                ids[row, : len(inputs[i])] = inputs[i]
                mask[row, : len(inputs[i])] = True
            out[group] = self.model.embed(ids, mask)
            start = stop
        return out
