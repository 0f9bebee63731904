"""Reading a Llama GGUF file into the weights of the forward: dense float32 arrays, or kernels that
keep the file's quantized blocks (forge.kernels, chosen by the caller).

Owns opening the file, the layout, and dequantizing what stays dense. Every dense matrix is an [in, out]
array for forge.models.llama.linear: C-contiguous, except w_down, an F-ordered view of the file's [out, in]
(multiplied weight-first, measured faster at decode sizes); q/k/v fused into one matrix and gate/up into
another per layer; a tied head is C-contiguous [H, V] and the embedding its transposed view (measured
faster than the other way round). Keeps no copy of the file's bytes once loading is done. The q/k rows
stay in the file's RoPE order for Llama files; a family that rotates halves has each head's q/k rows
(and their biases and QK-norm weights) reordered into pairs here (forge.models.llama.arch). A mixture
of experts keeps its experts as views of the file's 3-D tensors (forge.models.llama.experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf.constants import GGMLQuantizationType

from forge.kernels import KernelChoice, compiled
from forge.kernels.quant_linear import BlockMatrix
from forge.models.gguf_file import GGUFFile
from forge.models.llama.experts import MoeWeights, prefault_experts
from forge.models.llama.layout import check_layout
from forge.models.llama.linear import Q8Matrix
from forge.models.llama.llama_config import LlamaConfig
from forge.models.llama.tensor_source import QuantEmbedding, TensorSource
from forge.models.llama.weight_memory import check_weight_memory
from forge.models.llama.weight_types import Weight

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
@dataclass(slots=True)
class LayerWeights:
    attn_norm: F32       # [H]
    wqkv: Weight         # [H, (nh + 2 * nkv) * hd]   columns: q heads, then k heads, then v heads
    wo: Weight           # [nh * hd, H]
    ffn_norm: F32        # [H]
    w_gate_up: Weight | None   # [H, 2 * F]           columns: gate, then up; None in a mixture of experts
    w_down: Weight | None      # [F, H]               dense: F-ordered, a view of the file's [H, F]
    qkv_bias: F32 | None = None        # [(nh + 2 * nkv) * hd]  qwen2
    q_norm: F32 | None = None          # [hd]  QK-norm (qwen3, gemma3); [nh, hd] over the whole q (olmoe)
    k_norm: F32 | None = None          # [hd]                              [nkv, hd]
    post_attn_norm: F32 | None = None  # [H]   sandwich norms (gemma3): after attention's projection
    post_ffn_norm: F32 | None = None   # [H]   and after the MLP, before each residual add
    moe: MoeWeights | None = None      # the MLP as a mixture of experts (forge.models.llama.mixture)
    sinks: F32 | None = None           # [nh]  a logit per query head in its softmax's denominator (gpt-oss)
    wo_bias: F32 | None = None         # [H]   the output projection's bias (gpt-oss)


@dataclass(slots=True)
class LlamaWeights:
    embedding: F32 | QuantEmbedding  # [V, H]  rows looked up by id; dense and tied: the head's transposed view
    layers: list[LayerWeights]
    out_norm: F32           # [H]
    head: Weight            # [H, V]   dense: C-contiguous
    rope_freqs: F32 | None  # [rope_dim / 2]  per-frequency divisors, when the file has them (LongRoPE: the short)
    kernels: str = "numpy"  # the backend that holds the matrices (forge.kernels)
    fast: bool = False      # the `fast` numerics: bfloat16/int8 products, prompt attention in bfloat16 pairs
    det: bool = False       # the deterministic numerics (forge/kernels/qmatmul_det.c and its kin)
    rope_long: F32 | None = None  # [rope_dim / 2]  LongRoPE's long factors, past the original context

    def embed(self, token_ids: npt.NDArray[np.int64]) -> F32:
        """The embedding rows of token_ids: [T, H] float32."""
        if isinstance(self.embedding, QuantEmbedding):
            return self.embedding.rows(token_ids)
        rows: F32 = self.embedding[token_ids]
        return rows

    @property
    def is_dense(self) -> bool:
        """Every matrix a float32 array (the numpy reference)."""
        return all(w is None or isinstance(w, np.ndarray) for layer in self.layers
                   for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)) and isinstance(
            self.head, np.ndarray) and all(layer.moe.is_dense for layer in self.layers if layer.moe is not None)

    @property
    def nbytes(self) -> int:
        """Bytes held by the weights (a tied head shares the embedding's memory, dense or in blocks)."""
        held: list[Any] = [self.embedding, self.out_norm]
        for layer in self.layers:
            held += [w for w in (layer.attn_norm, layer.wqkv, layer.wo, layer.ffn_norm, layer.w_gate_up,
                                 layer.w_down) if w is not None]
            held += [w for w in (layer.qkv_bias, layer.q_norm, layer.k_norm, layer.post_attn_norm,
                                 layer.post_ffn_norm, layer.moe, layer.sinks, layer.wo_bias) if w is not None]
        tied_dense = (isinstance(self.head, np.ndarray) and isinstance(self.embedding, np.ndarray)
                      and np.shares_memory(self.head, self.embedding))
        tied_blocks = (isinstance(self.head, BlockMatrix) and isinstance(self.embedding, QuantEmbedding)
                       and self.head.reads(self.embedding.data) and not self.head.packed)
        if not (tied_dense or tied_blocks):
            held.append(self.head)
        return sum(int(w.nbytes) for w in held)


def halves_to_pairs(num_heads: int, head_dim: int, rope_dim: int) -> I64:
    """Row order that turns q/k rows rotating halves (dim i with i + rope_dim / 2) into rows rotating
    adjacent pairs (2i with 2i + 1), head by head; dims past rope_dim keep their place."""
    half = rope_dim // 2
    within = np.concatenate([np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1),
                             np.arange(rope_dim, head_dim)])                         # [hd]
    order: I64 = (np.arange(num_heads)[:, None] * head_dim + within[None, :]).reshape(-1)  # [num_heads * hd]
    return order


def load_weights(reader: GGUFFile, config: LlamaConfig, kernels: KernelChoice | None = None,
                 available: int | None = None) -> LlamaWeights:
    """Every tensor of the model: the matrices held by `kernels` (None: the numpy reference, all
    dequantized once); raises ModelLoadError on a missing or odd one, before allocating anything when a
    tensor's shape is not the metadata's (layout) or the weights, some widened to float32, would take
    more than `available` bytes (None: the machine's; weight_memory)."""
    check_layout(reader, config)
    check_weight_memory(reader, config.name, kernels, available)
    src = TensorSource(reader, config.name, kernels)
    c, arch = config, config.arch
    hidden, ffn, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q_order = k_order = head_order = None
    if arch.rope_style == "halves":
        q_order = halves_to_pairs(c.num_heads, hd, c.rope_dim)
        k_order = halves_to_pairs(c.num_kv_heads, hd, c.rope_dim)
        head_order = halves_to_pairs(1, hd, c.rope_dim)
    q_rows, kv_rows = c.num_heads * hd, c.num_kv_heads * hd
    layers: list[LayerWeights] = []
    for i in range(c.num_layers):
        p = f"blk.{i}."
        if arch.fused_qkv:   # one [q + k + v rows, H] tensor: its three parts picked by row
            full = (q_rows + 2 * kv_rows, hidden)
            q_sel = np.arange(q_rows) if q_order is None else q_order
            k_sel = q_rows + (np.arange(kv_rows) if k_order is None else k_order)
            wqkv = src.matrix([p + "attn_qkv.weight"] * 3, [full] * 3,
                              row_orders=[q_sel, k_sel, q_rows + kv_rows + np.arange(kv_rows)])
        else:
            wqkv = src.matrix([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                              [(q_rows, hidden), (kv_rows, hidden), (kv_rows, hidden)],
                              row_orders=[q_order, k_order, None])
        w_gate_up = w_down = None                  # a mixture of experts has no dense MLP
        if c.moe is None:
            if arch.fused_gate_up:   # one [gate + up rows, H] tensor: forge's own [gate | up] order
                w_gate_up = src.matrix([p + "ffn_up.weight"], [(2 * ffn, hidden)])
            else:
                w_gate_up = src.matrix([p + "ffn_gate.weight", p + "ffn_up.weight"], [(ffn, hidden), (ffn, hidden)])
            w_down = src.matrix([p + "ffn_down.weight"], [(hidden, ffn)], f_ordered=True)
        layer = LayerWeights(
            attn_norm=src.owned(p + "attn_norm.weight", (hidden,)),
            wqkv=wqkv,
            wo=src.matrix([p + "attn_output.weight"], [(hidden, q_rows)]),
            ffn_norm=src.owned(p + arch.ffn_norm + ".weight", (hidden,)),
            w_gate_up=w_gate_up,
            w_down=w_down,
            moe=_moe_weights(src, c, p) if c.moe is not None else None,
            sinks=src.owned(p + "attn_sinks.weight", (c.num_heads,)) if arch.attention_sinks else None,
            wo_bias=src.owned(p + "attn_output.bias", (hidden,)) if arch.output_bias else None,
        )
        if arch.attention_bias:
            layer.qkv_bias = np.concatenate([
                _rows(src.owned(p + "attn_q.bias", (c.num_heads * hd,)), q_order),
                _rows(src.owned(p + "attn_k.bias", (c.num_kv_heads * hd,)), k_order),
                src.owned(p + "attn_v.bias", (c.num_kv_heads * hd,)),
            ])
        if arch.qk_norm and arch.qk_norm_whole:   # over all of q (k): its rows in q's (k's) new order
            layer.q_norm = _rows(src.owned(p + "attn_q_norm.weight", (q_rows,)), q_order).reshape(c.num_heads, hd)
            layer.k_norm = _rows(src.owned(p + "attn_k_norm.weight", (kv_rows,)), k_order).reshape(-1, hd)
        elif arch.qk_norm:
            layer.q_norm = _rows(src.owned(p + "attn_q_norm.weight", (hd,)), head_order)
            layer.k_norm = _rows(src.owned(p + "attn_k_norm.weight", (hd,)), head_order)
        if arch.sandwich_norms:
            layer.post_attn_norm = src.owned(p + "post_attention_norm.weight", (hidden,))
            layer.post_ffn_norm = src.owned(p + "post_ffw_norm.weight", (hidden,))
        layers.append(layer)
    prefault_experts([s for layer in layers if layer.moe is not None for s in (layer.moe.gate_up, layer.moe.down)])
    embedding: F32 | QuantEmbedding
    head: Weight
    if c.tied_embeddings and src.blocks and src.keeps_blocks("token_embd.weight"):
        # A tied head multiplies straight from the embedding's blocks, which the lookup reads too.
        embedding = src.embedding("token_embd.weight", (c.vocab_size, hidden))
        assert isinstance(embedding, QuantEmbedding)
        head = BlockMatrix([(embedding.data, int(embedding.qtype))], hidden, fast=src.fast, det=src.det)
    elif (c.tied_embeddings and src.keeps_blocks("token_embd.weight", GGMLQuantizationType.Q8_0) and compiled.library()
          and not src.det):
        # A tied Q8_0 head multiplies straight from the embedding's blocks: no second copy.
        embedding = src.embedding("token_embd.weight", (c.vocab_size, hidden))
        assert isinstance(embedding, QuantEmbedding)
        head = Q8Matrix(embedding.data, embedding.shape)
    elif c.tied_embeddings:
        head = src.matrix(["token_embd.weight"], [(c.vocab_size, hidden)])  # [H, V]
        if isinstance(head, np.ndarray):
            embedding = head.T                                                 # [V, H] view, no copy
        else:
            embedding = src.embedding("token_embd.weight", (c.vocab_size, hidden))
    else:
        embedding = src.embedding("token_embd.weight", (c.vocab_size, hidden))  # [V, H]
        head = src.matrix(["output.weight"], [(c.vocab_size, hidden)])         # [H, V]
    rope_freqs = rope_long = None
    if src.has("rope_freqs.weight"):
        rope_freqs = src.owned("rope_freqs.weight", (c.rope_dim // 2,))
    elif c.rope_scaling.kind == "longrope":
        rope_freqs = src.owned("rope_factors_short.weight", (c.rope_dim // 2,))
        rope_long = src.owned("rope_factors_long.weight", (c.rope_dim // 2,))
    return LlamaWeights(
        embedding=embedding,
        layers=layers,
        out_norm=src.owned("output_norm.weight", (hidden,)),
        head=head,
        rope_freqs=rope_freqs,
        rope_long=rope_long,
        kernels=kernels.name if kernels is not None else "numpy",
        fast=src.fast,
        det=src.det,
    )


def _moe_weights(src: TensorSource, c: LlamaConfig, p: str) -> MoeWeights:
    """Layer p's router, experts (views of the file's 3-D tensors), their biases and shared expert."""
    assert c.moe is not None
    hidden, num, shared = c.hidden_size, c.moe.num_experts, c.moe.shared_ffn
    moe = MoeWeights(router=src.matrix([p + "ffn_gate_inp.weight"], [(num, hidden)]),
                     gate_up=src.experts([p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"], hidden),
                     down=src.experts([p + "ffn_down_exps.weight"], c.moe.expert_ffn))
    if c.arch.expert_bias:                                       # gpt-oss: [E], [E, 2F] (gate then up), [E, H]
        moe.router_bias = src.owned(p + "ffn_gate_inp.bias", (num,))
        moe.gate_up_bias = np.concatenate([src.owned(p + f"ffn_{x}_exps.bias", (num, c.moe.expert_ffn))
                                           for x in ("gate", "up")], axis=1)
        moe.down_bias = src.owned(p + "ffn_down_exps.bias", (num, hidden))
    if c.arch.shared_expert:
        moe.shared_gate_up = src.matrix([p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"],
                                        [(shared, hidden), (shared, hidden)])
        moe.shared_down = src.matrix([p + "ffn_down_shexp.weight"], [(hidden, shared)], f_ordered=True)
        gate = p + "ffn_gate_inp_shexp.weight"                  # [1, H], or [H] as older converters wrote it
        moe.shared_gate = src.owned(gate, src.shape(gate)).reshape(hidden, 1)
    return moe


def _rows(array: F32, order: I64 | None) -> F32:
    return array if order is None else np.ascontiguousarray(array[order])
