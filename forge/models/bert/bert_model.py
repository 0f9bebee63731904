"""BertModel: a BERT encoder's forward in numpy float32, over a padded batch with its attention mask.

Owns the arithmetic of a sentence-transformers BERT (word + position + token-type embeddings,
post-norm layers of bidirectional attention and an erf-GELU MLP, mean pooling over the mask, L2
normalisation) and reading its safetensors file, memory-mapped: every weight is a view of the
file's pages, held once. Does no tokenizing and no batching policy (forge.models.bert.encoder).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from forge.errors import ModelLoadError
from forge.kernels import compiled
from forge.models.llama.linear import matmul

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


@dataclass(frozen=True, slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> BertConfig:
        """A Hugging Face config.json of model_type bert (ModelLoadError for anything else)."""
        if raw.get("model_type") != "bert" or raw.get("hidden_act", "gelu") != "gelu":
            raise ModelLoadError(f"not a BERT encoder with GELU: model_type {raw.get('model_type')!r}, "
                                 f"hidden_act {raw.get('hidden_act')!r}")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"unsupported position_embedding_type {raw['position_embedding_type']!r}")
        return cls(vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                   num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
                   intermediate_size=raw["intermediate_size"], max_position=raw["max_position_embeddings"],
                   type_vocab_size=raw.get("type_vocab_size", 2), layer_norm_eps=raw.get("layer_norm_eps", 1e-12))


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, npt.NDArray[Any]]:
    """Every tensor of a .safetensors file as a read-only view of one memory map of it."""
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        header_len = int(data[:8].view("<u8")[0])
        header = json.loads(bytes(data[8:8 + header_len]))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    base = 8 + header_len
    out: dict[str, npt.NDArray[Any]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        lo, hi = info["data_offsets"]
        out[name] = data[base + lo:base + hi].view(dtype).reshape(info["shape"])
    return out


def layer_norm(x: F32, weight: F32, bias: F32, eps: float) -> F32:
    """(x - mean) / std * weight + bias over the last axis; x [T, H]."""
    mean = x.mean(axis=-1, keepdims=True)                                   # [T, 1]
    centred = x - mean                                                      # [T, H]
    var = np.einsum("th,th->t", centred, centred)[:, None] / np.float32(x.shape[-1])   # [T, 1]
    centred *= 1.0 / np.sqrt(var + np.float32(eps))
    centred *= weight
    centred += bias
    out: F32 = centred
    return out


def erf(x: F32) -> F32:
    """erf by Abramowitz and Stegun 7.1.26: absolute error below 1.5e-7 (4e-7 in float32 arithmetic)."""
    t = 1.0 / (1.0 + np.float32(0.3275911) * np.abs(x))                     # [T, F]
    poly = t * (np.float32(0.254829592) + t * (np.float32(-0.284496736) + t * (
        np.float32(1.421413741) + t * (np.float32(-1.453152027) + t * np.float32(1.061405429)))))
    y = 1.0 - poly * np.exp(-x * x)
    out: F32 = np.copysign(y, x).astype(np.float32)
    return out


def gelu(x: F32) -> F32:
    """The exact GELU, x * Phi(x), that BERT's "gelu" means (not the tanh approximation)."""
    out: F32 = x * np.float32(0.5) * (1.0 + erf(x * np.float32(1.0 / math.sqrt(2.0))))
    return out


class BertModel:
    """A loaded BERT encoder. Immutable after load."""

    def __init__(self, config: BertConfig, tensors: dict[str, npt.NDArray[Any]]) -> None:
        self.config = config
        self._w = tensors
        missing = [n for n in self._names() if n not in tensors]
        if missing:
            raise ModelLoadError(f"the weights lack {len(missing)} BERT tensors, e.g. {missing[0]}")
        self.nbytes = sum(t.nbytes for t in tensors.values())
        self.compiled_gelu = compiled.library() is not None

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> BertModel:
        """config.json and model.safetensors of a Hugging Face BERT directory."""
        root = Path(directory)
        try:
            config = BertConfig.from_json(json.loads((root / "config.json").read_text()))
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot read {root / 'config.json'}: {exc}") from None
        return cls(config, read_safetensors(root / "model.safetensors"))

    def _names(self) -> list[str]:
        names = [f"embeddings.{n}" for n in ("word_embeddings.weight", "position_embeddings.weight",
                                             "token_type_embeddings.weight", "LayerNorm.weight", "LayerNorm.bias")]
        for i in range(self.config.num_layers):
            p = f"encoder.layer.{i}."
            for part in ("attention.self.query", "attention.self.key", "attention.self.value",
                         "attention.output.dense", "intermediate.dense", "output.dense"):
                names += [p + part + ".weight", p + part + ".bias"]
            names += [p + n for n in ("attention.output.LayerNorm.weight", "attention.output.LayerNorm.bias",
                                      "output.LayerNorm.weight", "output.LayerNorm.bias")]
        return names

    def _dense(self, x: F32, name: str) -> F32:
        w = self._w[name + ".weight"]                                       # [out, in]
        out = matmul(x, w.T)                                                # [T, out]
        out += self._w[name + ".bias"]
        return out

    def _gelu(self, x: F32) -> F32:
        """GELU in place: compiled where the kernels are built (elementwise.c), else the numpy reference."""
        if self.compiled_gelu:
            compiled.gelu_erf(x, x)
            return x
        return gelu(x)

    def _norm(self, x: F32, name: str) -> F32:
        return layer_norm(x, self._w[name + ".weight"], self._w[name + ".bias"], self.config.layer_norm_eps)

    def hidden_states(self, token_ids: I64, mask: BoolArray) -> F32:
        """The last layer's states [B, T, H] of a padded batch: token_ids [B, T], mask [B, T] True on
        real tokens (padding is never attended to; its rows are garbage)."""
        c = self.config
        b, t = token_ids.shape
        nh, hd = c.num_heads, c.hidden_size // c.num_heads
        w = self._w
        x = (w["embeddings.word_embeddings.weight"][token_ids]
             + w["embeddings.position_embeddings.weight"][:t][None]
             + w["embeddings.token_type_embeddings.weight"][0]).reshape(b * t, -1)         # [B*T, H]
        x = self._norm(x.astype(np.float32), "embeddings.LayerNorm")
        bias = np.where(mask, np.float32(0.0), np.float32(np.finfo(np.float32).min))[:, None, None, :]  # [B,1,1,T]
        scale = np.float32(1.0 / math.sqrt(hd))
        for i in range(c.num_layers):
            p = f"encoder.layer.{i}."
            q = self._dense(x, p + "attention.self.query").reshape(b, t, nh, hd)            # [B, T, nh, hd]
            k = self._dense(x, p + "attention.self.key").reshape(b, t, nh, hd)
            v = self._dense(x, p + "attention.self.value").reshape(b, t, nh, hd)
            # batched products per (sequence, head): matmul runs each as a BLAS product, einsum did not
            qh = np.ascontiguousarray((q * scale).transpose(0, 2, 1, 3))                     # [B, nh, T, hd]
            kh = np.ascontiguousarray(k.transpose(0, 2, 3, 1))                               # [B, nh, hd, T]
            vh = np.ascontiguousarray(v.transpose(0, 2, 1, 3))                               # [B, nh, T, hd]
            scores = np.matmul(qh, kh)                                                       # [B, nh, T, T]
            scores += bias
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            ctx = np.matmul(scores, vh).transpose(0, 2, 1, 3).reshape(b * t, -1)             # [B*T, H]
            x = self._norm(self._dense(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
            h = self._gelu(self._dense(x, p + "intermediate.dense"))                         # [B*T, F]
            x = self._norm(self._dense(h, p + "output.dense") + x, p + "output.LayerNorm")
        return x.reshape(b, t, -1)

    def embed(self, token_ids: I64, mask: BoolArray) -> F32:
        """Mean over the mask of the last states, L2-normalised: [B, H] (sentence-transformers' Pooling
        with pooling_mode_mean_tokens, then Normalize)."""
        states = self.hidden_states(token_ids, mask)                                         # [B, T, H]
        weights = mask.astype(np.float32)[:, :, None]                                        # [B, T, 1]
        pooled = (states * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), np.float32(1e-9))  # [B, H]
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)                                # [B, 1]
        out: F32 = (pooled / np.maximum(norms, np.float32(1e-12))).astype(np.float32)
        return out
