"""The tensors a Llama-family file must hold and the shape its metadata gives each, checked against the file's
header before anything is allocated. Metadata that sizes an allocation (width, heads, head size, feed-forward
width, vocabulary, layers) is believed only where the tensors, whose bytes the file really holds, agree; a
file that disagrees is a ModelLoadError naming the first tensor that does. Reads headers only.
"""

from __future__ import annotations

from collections.abc import Callable

from forge.errors import ModelLoadError
from forge.models.gguf_file import GGUFFile
from forge.models.llama.llama_config import LlamaConfig

Shape = tuple[int, ...]
# A [1, H] tensor that older converters wrote squeezed, [H] (llama.cpp reads both): the shared expert's gate.
SQUEEZED = "ffn_gate_inp_shexp.weight"


def check_layout(reader: GGUFFile, config: LlamaConfig) -> None:
    """Raise ModelLoadError if the file holds parts forge does not run (biases a family has not, Llama 3.1's and
    LongRoPE's factors together), or a tensor the model reads is missing or its shape is not the metadata's."""
    c, arch, has = config, config.arch, reader.tensors.__contains__
    if not arch.attention_bias and any(has(f"blk.0.attn_{x}.bias") for x in "qkv"):
        raise ModelLoadError(f"{c.name}: attention biases are not supported for {arch.name!r} files")
    if has("blk.0.attn_output.bias") and not arch.output_bias:
        raise ModelLoadError(f"{c.name}: an attention output bias is not supported for {arch.name!r} files")
    if has("rope_freqs.weight") and c.rope_scaling.kind == "longrope":
        raise ModelLoadError(f"{c.name}: rope_freqs and LongRoPE's rope_factors_long/short together are not supported")
    blocks = {int(part) for name in reader.tensors
              if name.startswith("blk.") and (part := name.split(".")[1]).isdigit()}
    if c.num_layers > len(blocks):        # before listing 2^40 layers' tensors
        raise ModelLoadError(f"{c.name}: the metadata says {c.num_layers} layers (block_count), the file holds "
                             f"tensors for {len(blocks)}")
    for name, shape in expected_shapes(c, has=has).items():
        tensor = reader.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{c.name}: tensor {name!r} is missing")
        if tuple(tensor.shape) != shape and not (name.endswith(SQUEEZED) and tuple(tensor.shape) == shape[1:]):
            raise ModelLoadError(f"{c.name}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape} "
                                 "from the metadata")


def expected_shapes(config: LlamaConfig, *, has: Callable[[str], bool]) -> dict[str, Shape]:
    """Every tensor forge.models.llama.weights reads, with its shape in numpy order ([out, in] for matrices).
    `has(name)`: whether the file holds an optional tensor (rope_freqs)."""
    c, arch = config, config.arch
    hidden, ffn, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q_rows, kv_rows = c.num_heads * hd, c.num_kv_heads * hd
    shapes: dict[str, Shape] = {"token_embd.weight": (c.vocab_size, hidden), "output_norm.weight": (hidden,)}
    if not c.tied_embeddings:
        shapes["output.weight"] = (c.vocab_size, hidden)
    for i in range(c.num_layers):
        p = f"blk.{i}."
        shapes[p + "attn_norm.weight"] = shapes[p + arch.ffn_norm + ".weight"] = (hidden,)
        if arch.fused_qkv:
            shapes[p + "attn_qkv.weight"] = (q_rows + 2 * kv_rows, hidden)
        else:
            shapes[p + "attn_q.weight"] = (q_rows, hidden)
            shapes[p + "attn_k.weight"] = shapes[p + "attn_v.weight"] = (kv_rows, hidden)
        shapes[p + "attn_output.weight"] = (hidden, q_rows)
        if arch.output_bias:
            shapes[p + "attn_output.bias"] = (hidden,)
        if arch.attention_sinks:
            shapes[p + "attn_sinks.weight"] = (c.num_heads,)
        if c.moe is not None:
            shapes.update(_expert_shapes(c, p))
        elif arch.fused_gate_up:
            shapes[p + "ffn_up.weight"] = (2 * ffn, hidden)
            shapes[p + "ffn_down.weight"] = (hidden, ffn)
        else:
            shapes[p + "ffn_gate.weight"] = shapes[p + "ffn_up.weight"] = (ffn, hidden)
            shapes[p + "ffn_down.weight"] = (hidden, ffn)
        if arch.attention_bias:
            shapes[p + "attn_q.bias"] = (q_rows,)
            shapes[p + "attn_k.bias"] = shapes[p + "attn_v.bias"] = (kv_rows,)
        if arch.qk_norm and arch.qk_norm_whole:
            shapes[p + "attn_q_norm.weight"], shapes[p + "attn_k_norm.weight"] = (q_rows,), (kv_rows,)
        elif arch.qk_norm:
            shapes[p + "attn_q_norm.weight"] = shapes[p + "attn_k_norm.weight"] = (hd,)
        if arch.sandwich_norms:
            shapes[p + "post_attention_norm.weight"] = shapes[p + "post_ffw_norm.weight"] = (hidden,)
    if has("rope_freqs.weight"):
        shapes["rope_freqs.weight"] = (c.rope_dim // 2,)
    if c.rope_scaling.kind == "longrope":           # both factor sets, or the missing one is named
        shapes["rope_factors_long.weight"] = shapes["rope_factors_short.weight"] = (c.rope_dim // 2,)
    return shapes


def _expert_shapes(config: LlamaConfig, p: str) -> dict[str, Shape]:
    """Layer p's mixture of experts: the router, each projection of every expert as one 3-D tensor
    [experts, out, in], their biases (gpt-oss), and the shared expert's parts."""
    moe, hidden = config.moe, config.hidden_size
    assert moe is not None
    num, ffn = moe.num_experts, moe.expert_ffn
    shapes: dict[str, Shape] = {p + "ffn_gate_inp.weight": (num, hidden),
                                p + "ffn_gate_exps.weight": (num, ffn, hidden),
                                p + "ffn_up_exps.weight": (num, ffn, hidden),
                                p + "ffn_down_exps.weight": (num, hidden, ffn)}
    if config.arch.expert_bias:
        shapes[p + "ffn_gate_inp.bias"] = (num,)
        shapes[p + "ffn_gate_exps.bias"] = shapes[p + "ffn_up_exps.bias"] = (num, ffn)
        shapes[p + "ffn_down_exps.bias"] = (num, hidden)
    if config.arch.shared_expert:
        shapes[p + "ffn_gate_shexp.weight"] = shapes[p + "ffn_up_shexp.weight"] = (moe.shared_ffn, hidden)
        shapes[p + "ffn_down_shexp.weight"] = (hidden, moe.shared_ffn)
        shapes[p + SQUEEZED] = (1, hidden)
    return shapes
