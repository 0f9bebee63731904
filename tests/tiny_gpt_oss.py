"""The parts of a tiny GptOssForCausalLM that no other family has, for tests/tiny_families.py.

In the checkpoint (transformers' names and layout): biases on q/k/v/o, a sink logit per head
(`self_attn.sinks`), a router with a bias (`mlp.router`), and the experts as three fused parameters with
their biases: gate_up_proj [E, H, 2F] whose columns interleave gate and up (2j gate, 2j + 1 up),
down_proj [E, F, H], both multiplied as x @ W.

In the GGUF file, as llama.cpp's converter writes it (GptOssModel): the gate and up columns taken apart
into ffn_gate_exps and ffn_up_exps [E, F, H] (their biases likewise), ffn_down_exps [E, H, F], the
experts in MXFP4 (the released checkpoint's own blocks, repacked), the router as ffn_gate_inp (.weight,
.bias), the sinks as attn_sinks.weight, and the norm before the MLP as post_attention_norm.

Every expert weight is exactly representable in MXFP4 (a code of E2M1 times a power of two shared by
32 values), so the float32 checkpoint transformers runs and the MXFP4 file forge runs hold the same
values: the reference differs from forge only by arithmetic. The biases of the gate and up products
are large enough that the clamped SwiGLU's limit (7) bites.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf
import numpy as np

F32 = np.float32
MXFP4 = gguf.GGMLQuantizationType.MXFP4
MXFP4_BLOCK = 32


def mxfp4_exact(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random float32 [..., rows, cols] (cols a multiple of 32) that MXFP4 holds exactly: each block of 32
    a uniform E2M1 code times 2^k, k drawn per block so that the values' size is about 1 / sqrt(cols)."""
    *lead, cols = shape
    blocks = cols // MXFP4_BLOCK
    codes = rng.integers(0, 16, (*lead, blocks, MXFP4_BLOCK), dtype=np.uint8)
    # e8m0 exponents: the doubled codes (RMS 5.85) times 2^(e - 128) come out near 1 / sqrt(cols)
    target = int(np.round(np.log2(1.0 / np.sqrt(cols) / 5.85))) + 128
    exponents = rng.integers(target - 1, target + 1, (*lead, blocks, 1), dtype=np.uint8)
    packed = np.concatenate([exponents, codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)   # ggml's layout
    values = gguf.quants.dequantize(packed.reshape(*lead, blocks * 17), MXFP4)
    return np.ascontiguousarray(values, dtype=F32)


def mxfp4_blocks(w: np.ndarray) -> np.ndarray:
    """w's MXFP4 blocks (uint8 [..., rows, cols / 32 * 17]), checked to hold w exactly."""
    blocks = gguf.quants.quantize(np.ascontiguousarray(w, dtype=F32), MXFP4)
    if not np.array_equal(gguf.quants.dequantize(blocks, MXFP4), w):
        raise ValueError("weights not exactly representable in MXFP4")
    return blocks


def layer(s: Any, p: str, rng: np.random.Generator, matrix: Callable[[int, int], np.ndarray]) -> dict[str, np.ndarray]:
    """Layer p's attention biases, sinks and mixture of experts under the checkpoint's names."""
    q_rows, kv_rows, width = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.expert_width

    def bias(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(F32)

    out = {p + "self_attn.q_proj.bias": bias(q_rows), p + "self_attn.k_proj.bias": bias(kv_rows),
           p + "self_attn.v_proj.bias": bias(kv_rows), p + "self_attn.o_proj.bias": bias(s.hidden),
           p + "self_attn.sinks": bias(s.heads, scale=1.0),
           p + "mlp.router.weight": matrix(s.experts, s.hidden), p + "mlp.router.bias": bias(s.experts, scale=0.5)}
    gate, up = mxfp4_exact(rng, (s.experts, width, s.hidden)), mxfp4_exact(rng, (s.experts, width, s.hidden))
    gate_up = np.empty((s.experts, s.hidden, 2 * width), F32)                       # [E, H, 2F] interleaved
    gate_up[:, :, 0::2], gate_up[:, :, 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
    out[p + "mlp.experts.gate_up_proj"] = gate_up
    out[p + "mlp.experts.gate_up_proj_bias"] = bias(s.experts, 2 * width, scale=3.0)   # past the clamp at times
    out[p + "mlp.experts.down_proj"] = np.ascontiguousarray(
        mxfp4_exact(rng, (s.experts, s.hidden, width)).transpose(0, 2, 1))            # [E, F, H]
    out[p + "mlp.experts.down_proj_bias"] = bias(s.experts, s.hidden)
    return out


def put_layer(sd: dict[str, np.ndarray], h: str, p: str, put: Callable[..., None],
              add_raw: Callable[[str, np.ndarray, gguf.GGMLQuantizationType], None]) -> None:
    """Layer h's gpt-oss tensors into the file as the converter writes them (the attention's weights and
    norms are the caller's): `put` as tiny_families' (the matrices in the file's type), `add_raw` for
    blocks already packed."""
    put(p + "attn_output.bias", sd[h + "self_attn.o_proj.bias"])
    put(p + "attn_sinks.weight", sd[h + "self_attn.sinks"])
    put(p + "ffn_gate_inp.weight", sd[h + "mlp.router.weight"])
    put(p + "ffn_gate_inp.bias", sd[h + "mlp.router.bias"])
    gate_up = sd[h + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)                  # [E, 2F, H] rows interleaved
    add_raw(p + "ffn_gate_exps.weight", mxfp4_blocks(gate_up[:, 0::2]), MXFP4)
    add_raw(p + "ffn_up_exps.weight", mxfp4_blocks(gate_up[:, 1::2]), MXFP4)
    add_raw(p + "ffn_down_exps.weight", mxfp4_blocks(sd[h + "mlp.experts.down_proj"].transpose(0, 2, 1)), MXFP4)
    gate_up_bias = sd[h + "mlp.experts.gate_up_proj_bias"]
    put(p + "ffn_gate_exps.bias", np.ascontiguousarray(gate_up_bias[:, 0::2]))
    put(p + "ffn_up_exps.bias", np.ascontiguousarray(gate_up_bias[:, 1::2]))
    put(p + "ffn_down_exps.bias", sd[h + "mlp.experts.down_proj_bias"])


def hf_config(s: Any) -> dict[str, Any]:
    """GptOssConfig's keys beyond the common ones: the experts, the window on every other layer (the
    config's default layer_types), biases on."""
    return {"num_local_experts": s.experts, "num_experts_per_tok": s.experts_used, "intermediate_size": s.expert_width,
            "sliding_window": s.sliding_window, "attention_bias": True}
