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
    qwen3moe qwen3's attention; a mixture of experts in every layer (forge.models.llama.mixture),
             the top k's weights renormalised
    olmoe    QK-norm over the whole q and k projections (not per head); RoPE over halves; a
             mixture of experts, the top k's softmax weights as they are
    qwen2moe qwen2's attention; a mixture of experts beside a shared expert whose output a sigmoid
             gate scales
    (llama)  a llama file with {arch}.expert_count (Mixtral): a mixture of experts, the top k's
             weights renormalised (the softmax of their logits)
    gpt-oss  biases on q/k/v and the output projection; a learned logit per head in the softmax's
             denominator (attention sinks); RoPE over halves, YaRN's correction range unrounded;
             every other layer on a sliding window; the pre-MLP norm stored as post_attention_norm;
             a mixture of experts with biases on the router and every expert, the softmax of the
             top k's logits, and the clamped SwiGLU (forge.models.llama.clamped_swiglu)

RoPE over halves (llama.cpp's "NEOX" style: dims i and i + d/2 rotate together) is turned into
Llama's adjacent pairs when the weights are loaded, by reordering the q/k rows of each head (and
their biases and QK-norm weights the same way): q.k is unchanged by a reordering applied to both,
so the shared RoPE and attention kernels serve both styles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RopeStyle = Literal["pairs", "halves"]
Activation = Literal["silu", "gelu_tanh", "swiglu_oai"]


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
    qk_norm_whole: bool = False        # QK-norm over the whole q and k projections (olmoe), not each head
    experts: bool = False              # every layer a mixture of experts ({arch}.expert_count required);
                                       # a llama file has one when it names an expert_count
    norm_top_k: bool = True            # the top k's weights renormalised to sum 1, unless the file's
                                       # {arch}.expert_weights_norm says otherwise
    shared_expert: bool = False        # blk.N.ffn_{gate,up,down}_shexp.weight, gated by ffn_gate_inp_shexp
    attention_sinks: bool = False      # blk.N.attn_sinks.weight: a logit per query head beside the keys'
    output_bias: bool = False          # blk.N.attn_output.bias
    expert_bias: bool = False          # blk.N.ffn_gate_inp.bias and ffn_{gate,up,down}_exps.bias
    ffn_norm: str = "ffn_norm"         # the tensor name of the norm before the MLP (blk.N.{ffn_norm}.weight)
    yarn_truncate: bool = True         # YaRN's correction range widened to whole pairs (llama.cpp's, most
                                       # families'); gpt-oss was trained without (transformers' truncate=False)


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
        Architecture("qwen3moe", rope_style="halves", qk_norm=True, experts=True),
        Architecture("olmoe", rope_style="halves", qk_norm=True, qk_norm_whole=True, experts=True, norm_top_k=False),
        Architecture("qwen2moe", rope_style="halves", attention_bias=True, experts=True, norm_top_k=False,
                     shared_expert=True),
        Architecture("gpt-oss", rope_style="halves", attention_bias=True, activation="swiglu_oai",
                     sliding_window_period=2, experts=True, attention_sinks=True, output_bias=True, expert_bias=True,
                     ffn_norm="post_attention_norm", yarn_truncate=False),
    )
}
