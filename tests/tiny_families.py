"""Tiny random models of every family forge runs, as Hugging Face checkpoints and as GGUF files.

`state_dict(family)` makes a checkpoint's tensors with numpy from a fixed seed, under the names and
in the layout Hugging Face transformers uses; `write_gguf(family, path)` writes the same weights the
way llama.cpp's converter does (Llama's q/k rows permuted into pairs, Gemma's norm weights + 1, the
GGUF tensor and metadata names). scripts/reference/make_family_reference.py loads the checkpoint into
transformers (torch, a dev-only venv) and commits its logits; tests/unit/test_families.py writes
the GGUF and checks forge's logits against them. Both sides build the weights from this file.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests import tiny_gpt_oss
from tests.tiny_gguf import BOS_ID, EOS_ID, SPECIAL_TOKENS, _tokens, permute_rows

F32 = np.float32


@dataclass(frozen=True)
class TinySpec:
    family: str                 # the case's name: the architecture, or a variant of one
    hf_model_type: str          # transformers' config class key
    vocab: int = 64
    hidden: int = 64
    ffn: int = 96
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    context: int = 128
    tied: bool = False
    sliding_window: int = 0
    hf_extra: dict[str, Any] = field(default_factory=dict)     # more keyword arguments of the config
    gguf_extra: dict[str, Any] = field(default_factory=dict)   # more metadata: {arch}.KEY = value
    arch: str = ""              # general.architecture, when the name is a variant's
    sequence: int = 20          # tokens of the reference input: past gemma3's window, so the sliding layers mask
    experts: int = 0            # a mixture of experts in every layer: this many experts
    experts_used: int = 0       # each token's top k
    expert_ffn: int = 0         # one expert's feed-forward width, when not `ffn` (Qwen's moe_intermediate_size)
    shared_ffn: int = 0         # the shared expert's width (qwen2moe)

    @property
    def architecture(self) -> str:
        return self.arch or self.family

    @property
    def expert_width(self) -> int:
        return self.expert_ffn or self.ffn


SPECS: dict[str, TinySpec] = {s.family: s for s in (
    TinySpec("llama", "llama"),
    TinySpec("qwen2", "qwen2", tied=True, rope_theta=1e6),
    TinySpec("qwen3", "qwen3", head_dim=32, tied=True, rope_theta=1e6),      # head size != width / heads
    TinySpec("gemma3", "gemma3_text", layers=6, kv_heads=1, head_dim=32, tied=True, rope_theta=1e6,
             sliding_window=8),                                               # layers 0-4 sliding, 5 global
    TinySpec("phi3", "phi3", sliding_window=8),                              # q/k/v and gate/up fused
    TinySpec("gemma2", "gemma2", layers=4, head_dim=16, tied=True, sliding_window=8,  # layers 0, 2 sliding
             hf_extra={"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},  # caps that bite
             gguf_extra={"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    TinySpec("llama-linear-rope", "llama", arch="llama",                     # positions divided by 4
             hf_extra={"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
             gguf_extra={"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}),
    TinySpec("llama-llama3-rope", "llama", arch="llama",                     # Llama 3.1's: rope_freqs.weight
             hf_extra={"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                           "rope_theta": 10000.0}}),
    # Mixtures of experts: 8 experts, top 2, 2 layers. The Qwen files' dense width (ffn) is unused,
    # their experts' width comes from its own key; OLMoE and Mixtral's experts are `ffn` wide.
    TinySpec("qwen3moe", "qwen3_moe", head_dim=32, rope_theta=1e6, experts=8, experts_used=2, expert_ffn=32),
    TinySpec("olmoe", "olmoe", ffn=32, rms_eps=1e-5, experts=8, experts_used=2),   # the converter writes eps 1e-5
    TinySpec("qwen2moe", "qwen2_moe", rope_theta=1e6, experts=8, experts_used=2, expert_ffn=32, shared_ffn=64),
    TinySpec("mixtral", "mixtral", arch="llama", ffn=32, experts=8, experts_used=2),
    # gpt-oss-20b's shapes but smaller: 32 experts, top 4, heads of 64 (4 x 64 wider than the width of 64),
    # layers 0 and 2 on a window of 8, its RoPE (YaRN x32 over 4,096 positions, base 150,000, the range
    # unrounded) and context; the experts in MXFP4 (tests/tiny_gpt_oss.py)
    TinySpec("gpt-oss", "gpt_oss", ffn=32, layers=4, head_dim=64, rope_theta=150000.0, rms_eps=1e-5,
             context=131072, sliding_window=8, experts=32, experts_used=4,
             hf_extra={"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 4096,
                                           "rope_theta": 150000.0}},
             gguf_extra={"rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
                         "rope.scaling.original_context_length": 4096}),
)}

# Long-context RoPE (tests/unit/test_rope_scaling.py, tests/data/rope_scaling_reference.json): original contexts
# of 16-32 positions, so that inputs of 40-48 tokens run past them, as a 128k file's prompts run past its 4k or 32k.
ROPE_SCALING_SPECS: dict[str, TinySpec] = {s.family: s for s in (
    TinySpec("qwen3-yarn", "qwen3", arch="qwen3", head_dim=32, tied=True, sequence=48,   # the ramp spans dims 0-3
             hf_extra={"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                           "rope_theta": 10000.0}},
             gguf_extra={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                         "rope.scaling.original_context_length": 32}),
    TinySpec("llama-yarn", "llama", arch="llama", sequence=48,                  # the optional keys, pairs' order
             hf_extra={"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                           "beta_fast": 8.0, "beta_slow": 0.5, "attention_factor": 1.25,
                                           "rope_theta": 10000.0}},
             gguf_extra={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                         "rope.scaling.original_context_length": 32, "rope.scaling.yarn_beta_fast": 8.0,
                         "rope.scaling.yarn_beta_slow": 0.5, "rope.scaling.yarn_attn_factor": 1.25}),
    TinySpec("phi3-longrope", "phi3", arch="phi3", context=64, sequence=40,   # Phi-3.5 / Phi-4-mini's 128k files
             hf_extra={"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                           "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0],
                                           "long_factor": [1.3, 1.8, 2.5, 3.5, 5.0, 7.0, 10.0, 14.0]},
                       "original_max_position_embeddings": 16, "sliding_window": None},
             gguf_extra={"rope.scaling.original_context_length": 16, "attention.sliding_window": 0}),
)}
SEED = 20261201


def spec(family: str) -> TinySpec:
    """A family's spec, or a long-context RoPE case's."""
    return SPECS[family] if family in SPECS else ROPE_SCALING_SPECS[family]


def input_ids(family: str) -> list[int]:
    rng = np.random.default_rng(SEED + 1)
    return [int(i) for i in rng.integers(len(SPECIAL_TOKENS), spec(family).vocab, spec(family).sequence)]


def state_dict(family: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors, Hugging Face names and layout ([out, in] matrices), float32."""
    s = spec(family)
    rng = np.random.default_rng([SEED, zlib.crc32(family.encode())])   # a new family reseeds no other
    arch = s.architecture
    gemma = arch.startswith("gemma")

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(F32)

    def norm(width: int) -> np.ndarray:   # Gemma's checkpoints store w for a scale of (1 + w)
        return ((0.0 if gemma else 1.0) + 0.1 * rng.standard_normal(width)).astype(F32)

    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((s.vocab, s.hidden)).astype(F32)}
    if gemma:   # gemma scales embeddings by sqrt(width): keep the residual stream near unit size
        out["model.embed_tokens.weight"] /= np.sqrt(s.hidden)
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm(s.hidden)
        out[p + "self_attn.q_proj.weight"] = matrix(q_rows, s.hidden)
        out[p + "self_attn.k_proj.weight"] = matrix(kv_rows, s.hidden)
        out[p + "self_attn.v_proj.weight"] = matrix(kv_rows, s.hidden)
        out[p + "self_attn.o_proj.weight"] = matrix(s.hidden, q_rows)
        if arch in ("qwen2", "qwen2moe"):
            out[p + "self_attn.q_proj.bias"] = (0.1 * rng.standard_normal(q_rows)).astype(F32)
            out[p + "self_attn.k_proj.bias"] = (0.1 * rng.standard_normal(kv_rows)).astype(F32)
            out[p + "self_attn.v_proj.bias"] = (0.1 * rng.standard_normal(kv_rows)).astype(F32)
        if arch in ("qwen3", "gemma3", "qwen3moe"):     # QK-norm
            out[p + "self_attn.q_norm.weight"] = norm(s.head_dim)
            out[p + "self_attn.k_norm.weight"] = norm(s.head_dim)
        if arch == "olmoe":                 # QK-norm over the whole q and k projections
            out[p + "self_attn.q_norm.weight"] = norm(q_rows)
            out[p + "self_attn.k_norm.weight"] = norm(kv_rows)
        out[p + "post_attention_layernorm.weight"] = norm(s.hidden)
        if gemma:
            out[p + "pre_feedforward_layernorm.weight"] = norm(s.hidden)
            out[p + "post_feedforward_layernorm.weight"] = norm(s.hidden)
        if arch == "gpt-oss":                # biases, sinks, and its experts in MXFP4's values
            out.update(tiny_gpt_oss.layer(s, p, rng, matrix))
            continue
        if s.experts:
            out.update(_experts(s, p, matrix))
            continue
        out[p + "mlp.gate_proj.weight"] = matrix(s.ffn, s.hidden)
        out[p + "mlp.up_proj.weight"] = matrix(s.ffn, s.hidden)
        out[p + "mlp.down_proj.weight"] = matrix(s.hidden, s.ffn)
        if arch == "phi3":      # the checkpoint keeps q/k/v, and gate/up, each in one tensor
            out[p + "self_attn.qkv_proj.weight"] = np.concatenate(
                [out.pop(p + f"self_attn.{x}_proj.weight") for x in ("q", "k", "v")])
            out[p + "mlp.gate_up_proj.weight"] = np.concatenate(
                [out.pop(p + "mlp.gate_proj.weight"), out.pop(p + "mlp.up_proj.weight")])
    out["model.norm.weight"] = norm(s.hidden)
    if not s.tied:
        out["lm_head.weight"] = matrix(s.vocab, s.hidden)
    return out


def _experts(s: TinySpec, p: str, matrix: Any) -> dict[str, np.ndarray]:
    """A layer's mixture of experts under the checkpoint's names: one tensor per expert and
    projection (Mixtral's w1 = gate, w3 = up, w2 = down), the router, a shared expert (qwen2moe)."""
    out: dict[str, np.ndarray] = {}
    width = s.expert_width
    if s.architecture == "llama":       # Mixtral
        out[p + "block_sparse_moe.gate.weight"] = matrix(s.experts, s.hidden)
        for e in range(s.experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            out[q + "w1.weight"], out[q + "w3.weight"] = matrix(width, s.hidden), matrix(width, s.hidden)
            out[q + "w2.weight"] = matrix(s.hidden, width)
        return out
    out[p + "mlp.gate.weight"] = matrix(s.experts, s.hidden)
    for e in range(s.experts):
        q = f"{p}mlp.experts.{e}."
        out[q + "gate_proj.weight"], out[q + "up_proj.weight"] = matrix(width, s.hidden), matrix(width, s.hidden)
        out[q + "down_proj.weight"] = matrix(s.hidden, width)
    if s.shared_ffn:
        q = p + "mlp.shared_expert."
        out[q + "gate_proj.weight"], out[q + "up_proj.weight"] = (matrix(s.shared_ffn, s.hidden),
                                                                  matrix(s.shared_ffn, s.hidden))
        out[q + "down_proj.weight"] = matrix(s.hidden, s.shared_ffn)
        out[p + "mlp.shared_expert_gate.weight"] = matrix(1, s.hidden)
    return out


def hf_config(family: str) -> dict[str, Any]:
    """The keyword arguments of the family's transformers config."""
    s = spec(family)
    arch = s.architecture
    config: dict[str, Any] = dict(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.ffn, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim, rms_norm_eps=s.rms_eps,
        max_position_embeddings=s.context, tie_word_embeddings=s.tied, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=0, hidden_act="silu", rope_theta=s.rope_theta, attention_bias=arch == "qwen2",
    )
    if "rope_parameters" in s.hf_extra:
        del config["rope_theta"]
    if arch == "qwen2":
        del config["attention_bias"], config["head_dim"]
    if arch == "phi3":
        del config["attention_bias"], config["head_dim"]
        config.update(sliding_window=s.sliding_window, original_max_position_embeddings=s.context)
    if arch == "gpt-oss":
        config.update(tiny_gpt_oss.hf_config(s))
    elif s.experts:
        config.update(_hf_experts(s))
    if arch == "qwen2moe":
        del config["attention_bias"], config["head_dim"]
    if s.hf_model_type == "mixtral":
        del config["attention_bias"]
    if arch == "gemma2":
        config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=s.head_dim,
                      sliding_window=s.sliding_window,
                      layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.layers)])
        del config["hidden_act"]
    if arch == "gemma3":
        config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=s.head_dim,
                      sliding_window=s.sliding_window, final_logit_softcapping=None, attn_logit_softcapping=None,
                      layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                   for i in range(s.layers)],
                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": s.rope_theta},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
        del config["hidden_act"], config["rope_theta"]
    config.update(s.hf_extra)
    return config


def _hf_experts(s: TinySpec) -> dict[str, Any]:
    """The config keys of a mixture of experts: every layer sparse, top-k renormalised as the
    family's released models do (Qwen3-MoE: yes; OLMoE, Qwen2-MoE: no; Mixtral always)."""
    if s.hf_model_type == "mixtral":
        return {"num_local_experts": s.experts, "num_experts_per_tok": s.experts_used}
    config: dict[str, Any] = {"num_experts": s.experts, "num_experts_per_tok": s.experts_used,
                              "norm_topk_prob": s.architecture == "qwen3moe"}
    if s.architecture in ("qwen3moe", "qwen2moe"):
        config.update(moe_intermediate_size=s.expert_width, decoder_sparse_step=1, mlp_only_layers=[])
    if s.shared_ffn:
        config.update(shared_expert_intermediate_size=s.shared_ffn, qkv_bias=True)
    return config


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs.weight for Llama 3.1's
    RoPE scaling: 1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    freqs = rope["rope_theta"] ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=F32)


def write_gguf(family: str, path: str | os.PathLike[str], *, quant: str = "F32",
               readable_tokenizer: bool = False) -> Path:
    """The family's tiny model as llama.cpp's converter would write it: all tensors float32, or
    the matrices of the blocks in `quant` (a type gguf quantizes from numpy, e.g. Q8_0); gpt-oss's
    experts always in MXFP4, as its converter repacks the released checkpoint's.
    `readable_tokenizer`: the last token is "ab", which the file's one merge makes, so that
    Tokenizer.from_gguf reads it (as `forge serve` does); the weights are the same."""
    s = spec(family)
    sd = state_dict(family)
    path = Path(path)
    a = s.architecture
    writer = gguf.GGUFWriter(path, a)
    writer.add_name(f"tiny-{family}")
    writer.add_uint32(f"{a}.block_count", s.layers)
    writer.add_uint32(f"{a}.context_length", s.context)
    writer.add_uint32(f"{a}.embedding_length", s.hidden)
    writer.add_uint32(f"{a}.feed_forward_length", s.ffn)
    writer.add_uint32(f"{a}.attention.head_count", s.heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", s.kv_heads)
    writer.add_uint32(f"{a}.attention.key_length", s.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", s.head_dim)
    writer.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps)
    if a in ("llama", "phi3"):
        writer.add_uint32(f"{a}.rope.dimension_count", s.head_dim)
    if s.sliding_window:
        writer.add_uint32(f"{a}.attention.sliding_window", s.sliding_window)
    if s.experts:                                          # as the converter writes them (no norm-top-k key)
        writer.add_uint32(f"{a}.expert_count", s.experts)
        writer.add_uint32(f"{a}.expert_used_count", s.experts_used)
        if a in ("qwen2moe", "qwen3moe", "gpt-oss"):
            writer.add_uint32(f"{a}.expert_feed_forward_length", s.expert_width)
        if s.shared_ffn:
            writer.add_uint32(f"{a}.expert_shared_feed_forward_length", s.shared_ffn)
    for key, value in s.gguf_extra.items():                # gemma2's soft-capping, RoPE scaling
        if isinstance(value, str):
            writer.add_string(f"{a}.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"{a}.{key}", value)
        else:
            writer.add_float32(f"{a}.{key}", value)
    tokens = _tokens(s.vocab)
    if readable_tokenizer:
        tokens[-1] = "ab"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
                           + [gguf.TokenType.NORMAL] * (s.vocab - len(SPECIAL_TOKENS)))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)

    gemma = a.startswith("gemma")

    qtype = gguf.GGMLQuantizationType[quant]

    def put(name: str, w: np.ndarray, *, is_norm: bool = False) -> None:
        if is_norm and gemma:
            w = w + np.float32(1.0)        # the converter folds Gemma's (1 + w) into the file
        w = np.ascontiguousarray(w, dtype=F32)
        # The routers and biases stay float32, as llama.cpp's converter and quantizer keep them.
        if (qtype != gguf.GGMLQuantizationType.F32 and name.startswith("blk.") and w.ndim >= 2
                and not name.endswith(("ffn_gate_inp.weight", ".bias"))):
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(s.layers):
        h, p = f"model.layers.{i}.", f"blk.{i}."
        put(p + "attn_norm.weight", sd[h + "input_layernorm.weight"], is_norm=True)
        if a == "phi3":                   # written as the checkpoint holds them
            put(p + "attn_qkv.weight", sd[h + "self_attn.qkv_proj.weight"])
        else:
            q, k = sd[h + "self_attn.q_proj.weight"], sd[h + "self_attn.k_proj.weight"]
            if a == "llama":              # llama files keep q/k rows in RoPE pair order
                q, k = permute_rows(q, s.heads), permute_rows(k, s.kv_heads)
            put(p + "attn_q.weight", q)
            put(p + "attn_k.weight", k)
            put(p + "attn_v.weight", sd[h + "self_attn.v_proj.weight"])
        put(p + "attn_output.weight", sd[h + "self_attn.o_proj.weight"])
        for proj in ("q", "k", "v"):
            if h + f"self_attn.{proj}_proj.bias" in sd:
                put(p + f"attn_{proj}.bias", sd[h + f"self_attn.{proj}_proj.bias"])
        if h + "self_attn.q_norm.weight" in sd:
            put(p + "attn_q_norm.weight", sd[h + "self_attn.q_norm.weight"], is_norm=True)
            put(p + "attn_k_norm.weight", sd[h + "self_attn.k_norm.weight"], is_norm=True)
        if gemma:
            put(p + "post_attention_norm.weight", sd[h + "post_attention_layernorm.weight"], is_norm=True)
            put(p + "ffn_norm.weight", sd[h + "pre_feedforward_layernorm.weight"], is_norm=True)
            put(p + "post_ffw_norm.weight", sd[h + "post_feedforward_layernorm.weight"], is_norm=True)
        elif a == "gpt-oss":              # its converter maps the norm before the MLP to post_attention_norm
            put(p + "post_attention_norm.weight", sd[h + "post_attention_layernorm.weight"])
        else:
            put(p + "ffn_norm.weight", sd[h + "post_attention_layernorm.weight"])
        if a == "gpt-oss":
            tiny_gpt_oss.put_layer(sd, h, p, put, lambda n, blocks, t: writer.add_tensor(n, blocks, raw_dtype=t))
        elif s.experts:
            _put_experts(s, sd, h, p, put)
        elif a == "phi3":
            put(p + "ffn_up.weight", sd[h + "mlp.gate_up_proj.weight"])
            put(p + "ffn_down.weight", sd[h + "mlp.down_proj.weight"])
        else:
            put(p + "ffn_gate.weight", sd[h + "mlp.gate_proj.weight"])
            put(p + "ffn_up.weight", sd[h + "mlp.up_proj.weight"])
            put(p + "ffn_down.weight", sd[h + "mlp.down_proj.weight"])
    put("output_norm.weight", sd["model.norm.weight"], is_norm=True)
    if not s.tied:
        put("output.weight", sd["lm_head.weight"])
    rope = s.hf_extra.get("rope_parameters", {})
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, s.head_dim))
    if rope.get("rope_type") == "longrope":   # as the converter writes Phi-3's: its attention factor, both factor sets
        original = s.hf_extra["original_max_position_embeddings"]
        writer.add_float32(f"{a}.rope.scaling.attn_factor",
                           float(np.sqrt(1 + np.log(s.context / original) / np.log(original))))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=F32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=F32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _put_experts(s: TinySpec, sd: dict[str, np.ndarray], h: str, p: str, put: Any) -> None:
    """A layer's experts as the converter writes them: each projection of every expert stacked into
    one 3-D tensor [experts, rows, cols], the router as ffn_gate_inp, the shared expert's parts."""
    mixtral = s.architecture == "llama"
    moe = h + ("block_sparse_moe." if mixtral else "mlp.")
    put(p + "ffn_gate_inp.weight", sd[moe + "gate.weight"])
    names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {x: f"{x}_proj" for x in ("gate", "up", "down")}
    for proj, hf in names.items():
        put(p + f"ffn_{proj}_exps.weight", np.stack([sd[f"{moe}experts.{e}.{hf}.weight"] for e in range(s.experts)]))
    if s.shared_ffn:
        for proj in ("gate", "up", "down"):
            put(p + f"ffn_{proj}_shexp.weight", sd[f"{moe}shared_expert.{proj}_proj.weight"])
        put(p + "ffn_gate_inp_shexp.weight", sd[moe + "shared_expert_gate.weight"])     # [1, H]


def write_spm_tokenizer_gguf(path: str | os.PathLike[str], vocab: list[dict[str, Any]], *,
                             add_space_prefix: bool | None = None) -> Path:
    """A GGUF file holding only a SentencePiece ('llama') tokenizer, as Llama 2 / Mistral / TinyLlama
    files carry it: `vocab` is [{"piece", "score", "type"}] in id order (<unk>, <s>, </s>, the 256
    <0xXX> byte pieces, then the merged pieces, best first)."""
    path = Path(path)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-spm")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([v["piece"] for v in vocab])
    writer.add_token_scores([float(v["score"]) for v in vocab])
    writer.add_token_types([int(v["type"]) for v in vocab])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
