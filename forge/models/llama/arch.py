"""The model families forge runs, each as the few ways its transformer block differs from Llama's.

One forward (forge.models.llama.llama_model) serves every family here; an Architecture says which of its
optional parts a family's block has, and where its GGUF file keeps what. Adding a family is a new
entry in ARCHITECTURES (and a reference test: docs/models.md), not a new model class.

    family   differences from llama
    qwen2    q/k/v projections have biases; RoPE over the two halves of each head
    qwen3    RMSNorm of each q and k head before RoPE (QK-norm); RoPE over halves
    gemma3   embeddings scaled by sqrt(width); QK-norm; a norm after attention and after the MLP
             too ("sandwich"); GELU (tanh) instead of SiLU in the gated MLP; RoPE over halves; five
             of every six layers attend to a sliding window only, with their own RoPE base
    gemma2   as gemma3 without QK-norm, every other layer on the window (one RoPE base), and attention
             scores and final logits soft-capped: cap * tanh(x / cap)
    phi3     q/k/v in one tensor and gate/up in another; RoPE over halves; every layer on a sliding
             window when the file names one

RoPE over halves (llama.cpp's "NEOX" style: dims i and i + d/2 rotate together) is turned into
Llama's adjacent pairs when the weights are loaded, by reordering the q/k rows of each head (and
their biases and QK-norm weights the same way): q.k is unchanged by a reordering applied to both,
so the shared RoPE and attention kernels serve both styles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RopeStyle = Literal["pairs", "halves"]
Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str                          # general.architecture, and the prefix of its metadata keys
    rope_style: RopeStyle = "pairs"    # pairs: the file's q/k rows already in adjacent-pair order
    attention_bias: bool = False       # blk.N.attn_{q,k,v}.bias
    qk_norm: bool = False              # blk.N.attn_{q,k}_norm.weight, over each head
    sandwich_norms: bool = False       # blk.N.post_attention_norm.weight, blk.N.post_ffw_norm.weight
    activation: Activation = "silu"    # of the gate, in act(gate) * up
    scale_embeddings: bool = False     # token embeddings times sqrt(hidden_size)
    sliding_window_period: int = 0     # layer i attends to a window unless (i + 1) % period == 0; 1: all do
    sliding_rope_base: float = 0.0     # the RoPE base of sliding-window layers (0: the model's)
    fused_qkv: bool = False            # blk.N.attn_qkv.weight: the q, k and v rows in one tensor
    fused_gate_up: bool = False        # blk.N.ffn_up.weight: the gate rows, then the up rows
    softcapping: bool = False          # {arch}.attn_logit_softcapping, {arch}.final_logit_softcapping


ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture("llama"),
        Architecture("qwen2", rope_style="halves", attention_bias=True),
        Architecture("qwen3", rope_style="halves", qk_norm=True),
        Architecture("gemma2", rope_style="halves", sandwich_norms=True, activation="gelu_tanh",
                     scale_embeddings=True, sliding_window_period=2, softcapping=True),
        Architecture("gemma3", rope_style="halves", qk_norm=True, sandwich_norms=True, activation="gelu_tanh",
                     scale_embeddings=True, sliding_window_period=6, sliding_rope_base=10000.0),
        Architecture("phi3", rope_style="halves", fused_qkv=True, fused_gate_up=True, sliding_window_period=1),
    )
}
