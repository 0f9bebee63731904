"""Reading a Llama GGUF file into float32 arrays laid out for the forward's matmuls.

Owns opening the file, dequantizing every tensor once, and the layout. Every matrix is an [in, out]
array for forge.llama.linear: C-contiguous, except w_down, an F-ordered view of the file's [out, in]
(multiplied weight-first, measured faster at decode sizes); q/k/v fused into one matrix and gate/up into
another per layer; a tied head is C-contiguous [H, V] and the embedding its transposed view (measured
faster than the other way round). Keeps no copy of the file's bytes once loading is done. The q/k rows
stay in the file's RoPE order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from forge.errors import ModelLoadError
from forge.gguf_file import GGUFFile
from forge.llama.config import LlamaConfig
from forge.llama.dequant import dequantize

F32 = npt.NDArray[np.float32]


@dataclass(slots=True)
class LayerWeights:
    attn_norm: F32   # [H]
    wqkv: F32        # [H, (nh + 2 * nkv) * hd]   columns: q heads, then k heads, then v heads
    wo: F32          # [nh * hd, H]
    ffn_norm: F32    # [H]
    w_gate_up: F32   # [H, 2 * F]                 columns: gate, then up
    w_down: F32      # [F, H]                     F-ordered: a view of the file's [H, F]


@dataclass(slots=True)
class LlamaWeights:
    embedding: F32          # [V, H]   token embedding table, rows looked up by id; F-ordered when tied
    layers: list[LayerWeights]
    out_norm: F32           # [H]
    head: F32               # [H, V]   C-contiguous; `embedding` is its transposed view when the model is tied
    rope_freqs: F32 | None  # [rope_dim / 2]  per-frequency divisors, when the file has them

    @property
    def nbytes(self) -> int:
        """Bytes held by the weights (the tied head shares the embedding's memory)."""
        arrays = [self.embedding, self.out_norm]
        for layer in self.layers:
            arrays += [layer.attn_norm, layer.wqkv, layer.wo, layer.ffn_norm, layer.w_gate_up, layer.w_down]
        if not np.shares_memory(self.head, self.embedding):
            arrays.append(self.head)
        return sum(a.nbytes for a in arrays)


class _TensorSource:
    """Looks tensors up by name and dequantizes them to float32 with checked shapes."""

    def __init__(self, reader: GGUFFile, model_name: str) -> None:
        self._tensors = reader.tensors
        self._model_name = model_name

    def has(self, name: str) -> bool:
        return name in self._tensors

    def load(self, name: str, shape: tuple[int, ...]) -> F32:
        """The tensor as float32 in numpy order ([out, in] for matrices); may view the file."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self._model_name}: tensor {name!r} is missing")
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            kind = getattr(tensor.tensor_type, "name", tensor.tensor_type)
            raise ModelLoadError(f"{self._model_name}: tensor {name!r} has unsupported type {kind}") from exc
        if array.shape != shape:
            raise ModelLoadError(f"{self._model_name}: tensor {name!r} has shape {array.shape}, expected {shape}")
        return array.astype(np.float32, copy=False)

    def owned(self, name: str, shape: tuple[int, ...]) -> F32:
        """Like load, but never a view of the file, so the mapping can close."""
        array = self.load(name, shape)
        tensor = self._tensors[name]
        if np.may_share_memory(array, tensor.data) or not array.flags.c_contiguous:
            array = np.array(array, dtype=np.float32, order="C")
        return array

    def fused(self, names: list[str], shapes: list[tuple[int, int]]) -> F32:
        """Stack [out_i, in] matrices side by side, transposed: [in, sum(out_i)], C-contiguous."""
        width = shapes[0][1]
        out = np.empty((width, sum(rows for rows, _ in shapes)), dtype=np.float32)  # [in, out]
        col = 0
        for name, shape in zip(names, shapes, strict=True):
            out[:, col:col + shape[0]] = self.load(name, shape).T  # one dequantized temporary at a time
            col += shape[0]
        return out


def load_weights(reader: GGUFFile, config: LlamaConfig) -> LlamaWeights:
    """Every tensor of the model, dequantized once; raises ModelLoadError on a missing/odd one."""
    src = _TensorSource(reader, config.name)
    c = config
    hidden, ffn, hd = c.hidden_size, c.intermediate_size, c.head_dim
    for blk_tensor in ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"):
        if src.has(f"blk.0.{blk_tensor}"):
            raise ModelLoadError(f"{c.name}: attention biases are not supported")
    layers: list[LayerWeights] = []
    for i in range(c.num_layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=src.owned(p + "attn_norm.weight", (hidden,)),
            wqkv=src.fused(
                [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                [(c.num_heads * hd, hidden), (c.num_kv_heads * hd, hidden), (c.num_kv_heads * hd, hidden)],
            ),
            wo=src.fused([p + "attn_output.weight"], [(hidden, c.num_heads * hd)]),
            ffn_norm=src.owned(p + "ffn_norm.weight", (hidden,)),
            w_gate_up=src.fused([p + "ffn_gate.weight", p + "ffn_up.weight"], [(ffn, hidden), (ffn, hidden)]),
            w_down=src.owned(p + "ffn_down.weight", (hidden, ffn)).T,            # [F, H] view of [H, F]
        ))
    if c.tied_embeddings:
        head = src.fused(["token_embd.weight"], [(c.vocab_size, hidden)])  # [H, V]
        embedding = head.T                                                 # [V, H] view, no copy
    else:
        embedding = src.owned("token_embd.weight", (c.vocab_size, hidden))  # [V, H]
        head = src.fused(["output.weight"], [(c.vocab_size, hidden)])      # [H, V]
    rope_freqs = None
    if src.has("rope_freqs.weight"):
        rope_freqs = src.owned("rope_freqs.weight", (c.rope_dim // 2,))
    return LlamaWeights(
        embedding=embedding,
        layers=layers,
        out_norm=src.owned("output_norm.weight", (hidden,)),
        head=head,
        rope_freqs=rope_freqs,
    )
