"""LlamaConfig: the hyperparameters of a Llama-family model, read from GGUF metadata.

Owns the metadata keys and their validation; never hard-codes a model's numbers. Which family a
file is, and how its block differs, comes from forge.models.llama.arch; reading the tensors belongs to
weights.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from forge.errors import ModelLoadError
from forge.models.gguf_file import GGUFFile
from forge.models.llama.arch import ARCHITECTURES, Architecture
from forge.models.llama.rope_scaling import RopeScaling, yarn_mscale

ARCHITECTURE = "llama"
# The longest context_length a file may claim: past every model's trained context (the longest published,
# 10M tokens), so a larger claim is a broken file. Nothing is sized by it (the RoPE tables and the KV cache
# follow the context served, forge.engine.cache_plan), but the served context is at most it.
MAX_CONTEXT_LENGTH = 2**24


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture of experts in every layer: each token's top k of num_experts experts, by the router."""
    num_experts: int          # {arch}.expert_count
    num_used: int             # {arch}.expert_used_count: the k of each token's top k
    expert_ffn: int           # one expert's feed-forward width ({arch}.expert_feed_forward_length)
    shared_ffn: int = 0       # the shared expert's width (qwen2moe); 0: none
    norm_top_k: bool = True   # the top k's softmax weights renormalised to sum 1
    weights_scale: float = 1.0  # the experts' weights times this ({arch}.expert_weights_scale)


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    name: str                 # the model file's name, e.g. "SmolLM2-135M-Instruct.Q4_1.gguf"
    vocab_size: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int         # the trained context length; RoPE tables cover positions below it
    bos_token_id: int | None
    eos_token_id: int
    tied_embeddings: bool     # no output.weight: the head is the token embedding, transposed
    rope_dim: int             # leading dims of each head that RoPE rotates (== head_dim for Llama)
    rope_scale: float = 1.0   # linear position scaling; 1.0 means none
    rope_scaling: RopeScaling = RopeScaling()   # the file's scaling: linear, YaRN, LongRoPE (rope_scaling.py)
    arch: Architecture = ARCHITECTURES[ARCHITECTURE]
    sliding_window: int = 0   # keys a sliding-window layer's query sees (its own included); 0: none
    attn_softcap: float = 0.0   # attention scores soft-capped at this (cap * tanh(x / cap)); 0: none
    final_softcap: float = 0.0  # the same for the output logits
    moe: MoeConfig | None = None  # every layer's MLP a mixture of experts (forge.models.llama.mixture)

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends to the last sliding_window positions only."""
        period = self.arch.sliding_window_period
        return bool(self.sliding_window and period and (period == 1 or (layer + 1) % period))

    @property
    def attention_scale(self) -> float:
        """The factor of q.k in attention: 1 / sqrt(head size) for every family here."""
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_size(self) -> int:
        """Columns of the fused q/k/v projection."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


@dataclass(frozen=True, slots=True)
class ArrayField:
    """Stands for a metadata array: only its length matters to the config."""

    length: int


def field_value(reader: GGUFFile, key: str) -> Any:
    """A metadata value as a Python scalar or string, an ArrayField for arrays, None if absent."""
    value = reader.get(key)
    if isinstance(value, (list, np.ndarray)):
        return ArrayField(len(value))
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


def _required_int(reader: GGUFFile, key: str, name: str) -> int:
    value = field_value(reader, key)
    if value is None:
        raise ModelLoadError(f"{name}: metadata key {key!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"{name}: metadata key {key!r} must be a positive integer, got {value!r}")
    return value


def _optional_number(reader: GGUFFile, key: str, default: float) -> float:
    value = field_value(reader, key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise ModelLoadError(f"metadata key {key!r} must be a number, got {value!r}")
    return float(value)


def config_from_reader(reader: GGUFFile, path: str | os.PathLike[str]) -> LlamaConfig:
    """Build and validate the config; raises ModelLoadError with a one-line message."""
    name = os.path.basename(os.fspath(path))
    arch = architecture_of(reader, name)
    a = arch.name
    hidden = _required_int(reader, f"{a}.embedding_length", name)
    num_heads, num_kv_heads, head_dim, rope_dim = _head_shape(reader, a, name, hidden)
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    if not isinstance(eos, int):
        raise ModelLoadError(f"{name}: metadata key 'tokenizer.ggml.eos_token_id' is missing")
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    vocab = tokens.length if isinstance(tokens, ArrayField) else field_value(reader, f"{a}.vocab_size")
    if not isinstance(vocab, int) or vocab <= max(eos, bos or 0):
        raise ModelLoadError(f"{name}: the token list is missing or shorter than the special token ids")
    context = _context_length(reader, a, name)
    scaling = _rope_scaling(reader, arch, name, context)
    ffn = _required_int(reader, f"{a}.feed_forward_length", name)
    return LlamaConfig(
        name=name,
        vocab_size=vocab,
        num_layers=_required_int(reader, f"{a}.block_count", name),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=_optional_number(reader, f"{a}.rope.freq_base", 10000.0),
        rms_eps=_optional_number(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        max_position=context,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_id=eos,
        tied_embeddings="output.weight" not in reader.tensors,
        rope_dim=rope_dim,
        rope_scale=scaling.factor if scaling.kind == "linear" else 1.0,
        rope_scaling=scaling,
        arch=arch,
        sliding_window=_sliding_window(reader, arch, name),
        attn_softcap=_optional_number(reader, f"{a}.attn_logit_softcapping", 0.0) if arch.softcapping else 0.0,
        final_softcap=_optional_number(reader, f"{a}.final_logit_softcapping", 0.0) if arch.softcapping else 0.0,
        moe=_mixture(reader, arch, name, ffn),
    )


# llama.cpp's expert gating functions ({arch}.expert_gating_func): 0 none (the family's own, softmax
# for every family here), 1 softmax; sigmoid (2) and others belong to families forge does not run.
SOFTMAX_GATING = (0, 1)


def _mixture(reader: GGUFFile, arch: Architecture, name: str, ffn: int) -> MoeConfig | None:
    """The file's mixture of experts, None for a dense model. A width the file does not name is the
    dense feed-forward width (as llama.cpp reads OLMoE's and Mixtral's files)."""
    a = arch.name
    if field_value(reader, f"{a}.expert_count") in (None, 0) and not arch.experts:
        return None
    num_experts = _required_int(reader, f"{a}.expert_count", name)
    num_used = _required_int(reader, f"{a}.expert_used_count", name)
    if num_used > num_experts:
        raise ModelLoadError(f"{name}: each token's {num_used} experts (expert_used_count) are more than the "
                             f"{num_experts} there are")
    gating = field_value(reader, f"{a}.expert_gating_func")
    if gating is not None and gating not in SOFTMAX_GATING:
        raise ModelLoadError(f"{name}: expert gating function {gating!r} is not supported (only softmax)")
    norm = field_value(reader, f"{a}.expert_weights_norm")
    scale = _optional_number(reader, f"{a}.expert_weights_scale", 1.0)
    return MoeConfig(
        num_experts=num_experts,
        num_used=num_used,
        expert_ffn=_optional_int(reader, f"{a}.expert_feed_forward_length", name, ffn),
        shared_ffn=_optional_int(reader, f"{a}.expert_shared_feed_forward_length", name, ffn)
        if arch.shared_expert else 0,
        norm_top_k=norm if isinstance(norm, bool) else arch.norm_top_k,
        weights_scale=scale or 1.0,             # 0: unset, as llama.cpp reads it
    )


def _optional_int(reader: GGUFFile, key: str, name: str, default: int) -> int:
    return default if field_value(reader, key) is None else _required_int(reader, key, name)


def _context_length(reader: GGUFFile, a: str, name: str) -> int:
    context = _required_int(reader, f"{a}.context_length", name)
    if context > MAX_CONTEXT_LENGTH:
        raise ModelLoadError(f"{name}: metadata key '{a}.context_length' is {context}, past any model's context "
                             f"(at most {MAX_CONTEXT_LENGTH})")
    return context


def architecture_of(reader: GGUFFile, name: str) -> Architecture:
    """The file's family; an unsupported one is refused naming it and the supported ones."""
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(repr(a) for a in ARCHITECTURES)
        raise ModelLoadError(f"{name}: architecture {arch!r} is not supported (only {supported})")
    return ARCHITECTURES[arch]


def _sliding_window(reader: GGUFFile, arch: Architecture, name: str) -> int:
    """The window of the family's sliding layers: required where some layers always slide (gemma3),
    optional where every layer slides only if the file says so (phi3; Phi-4's files say 0: none)."""
    if not arch.sliding_window_period:
        return 0
    if arch.sliding_window_period == 1 and field_value(reader, f"{arch.name}.attention.sliding_window") in (None, 0):
        return 0
    return _required_int(reader, f"{arch.name}.attention.sliding_window", name)


def _head_shape(reader: GGUFFile, a: str, name: str, hidden: int) -> tuple[int, int, int, int]:
    """(num_heads, num_kv_heads, head_dim, rope_dim), validated against each other."""
    num_heads = _required_int(reader, f"{a}.attention.head_count", name)
    num_kv_heads = field_value(reader, f"{a}.attention.head_count_kv") or num_heads
    if not isinstance(num_kv_heads, int) or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ModelLoadError(f"{name}: {num_heads} heads cannot be grouped over {num_kv_heads!r} KV heads")
    head_dim = field_value(reader, f"{a}.attention.key_length")
    if head_dim is None and hidden % num_heads == 0:
        head_dim = hidden // num_heads
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ModelLoadError(f"{name}: no even head size fits width {hidden} over {num_heads} heads")
    rope_dim = field_value(reader, f"{a}.rope.dimension_count") or head_dim
    if not isinstance(rope_dim, int) or rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ModelLoadError(f"{name}: RoPE dimension {rope_dim!r} does not fit head size {head_dim}")
    return num_heads, num_kv_heads, head_dim, rope_dim


def _rope_scaling(reader: GGUFFile, arch: Architecture, name: str, context: int) -> RopeScaling:
    """The file's RoPE scaling: linear, YaRN (its optional keys as transformers reads them; the correction
    range rounded as the family was trained) or LongRoPE (a file with rope_factors_long/short); any other is
    refused by name, not ignored. Every kind's cos and sin are scaled by rope.scaling.attn_factor, as
    llama.cpp scales them."""
    a = arch.name
    kind = field_value(reader, f"{a}.rope.scaling.type")
    longrope = any(t in reader.tensors for t in ("rope_factors_long.weight", "rope_factors_short.weight"))
    attn_factor = _positive_number(reader, f"{a}.rope.scaling.attn_factor", 1.0, name)
    original = field_value(reader, f"{a}.rope.scaling.original_context_length")
    if original not in (None, 0):      # absent or 0: the file's context, as llama.cpp reads it
        original = _required_int(reader, f"{a}.rope.scaling.original_context_length", name)
    original = original or context
    if longrope and kind in (None, "none", "longrope"):       # Phi-3's converter writes no type
        return RopeScaling("longrope", original_context=original, magnitude=attn_factor)
    if longrope or kind == "longrope":
        raise ModelLoadError(f"{name}: RoPE scaling {kind!r} does not go with LongRoPE's factor tensors "
                             "(rope_factors_long/short.weight): a file needs both, and no other scaling")
    if kind in (None, "none"):
        return RopeScaling(magnitude=attn_factor)
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"{name}: RoPE scaling {kind!r} is not supported (only 'linear', 'yarn' and LongRoPE)")
    factor = _positive_number(reader, f"{a}.rope.scaling.factor", 1.0, name)
    if kind == "linear":
        return RopeScaling("linear", factor=factor, magnitude=attn_factor)
    if _optional_number(reader, f"{a}.rope.scaling.yarn_log_multiplier", 0.0):
        raise ModelLoadError(f"{name}: YaRN's yarn_log_multiplier (DeepSeek's mscale_all_dim) is not supported")
    ext_factor = _optional_number(reader, f"{a}.rope.scaling.yarn_ext_factor", 1.0)
    mscale = _positive_number(reader, f"{a}.rope.scaling.yarn_attn_factor",
                              yarn_mscale(factor) if ext_factor else 1.0, name)
    return RopeScaling("yarn", factor=factor, original_context=original,
                       beta_fast=_positive_number(reader, f"{a}.rope.scaling.yarn_beta_fast", 32.0, name),
                       beta_slow=_positive_number(reader, f"{a}.rope.scaling.yarn_beta_slow", 1.0, name),
                       ext_factor=ext_factor, magnitude=mscale * attn_factor, truncate=arch.yarn_truncate)


def _positive_number(reader: GGUFFile, key: str, default: float, name: str) -> float:
    value = _optional_number(reader, key, default)
    if value <= 0:
        raise ModelLoadError(f"{name}: metadata key {key!r} must be positive, got {value}")
    return value
