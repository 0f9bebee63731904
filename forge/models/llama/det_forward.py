"""The forward's operations under the deterministic numerics (LlamaWeights.det), besides attention and the
products: each one defined by fixed float32 operations (forge.kernels.det_rowwise, det_rowwise.c), so the same
bits on every build level and x86 host, whatever the batch.

    RMSNorm (rows, heads, a whole projection)   det_rowwise's: 16 partial sums of squares, a fixed tree
    the gated activations                       SiLU, GELU (tanh form), gpt-oss's clamped SwiGLU on det_exp
    RoPE                                        forge.models.llama.rope.apply_rope_exact: x0 c - x1 s, x0 s + x1 c
    Gemma 2's final soft-capping                cap * tanh(x / cap), det_rowwise's tanh
    a mixture's router                          a float32 router's logits by det_rowwise's dense product
                                                (a quantized one by the deterministic product), the softmax
                                                det_rowwise's, the top k by a stable sort (ties: the lower id),
                                                renormalised by adds in expert order; qwen2moe's shared gate
                                                1 / (1 + det_exp(-z)) of the same dense product

The embedding lookup, its scale, the biases and the residual adds are numpy's elementwise float32 operations,
exact on every host already.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from forge.kernels import det_rowwise
from forge.kernels.quant_linear import BlockMatrix
from forge.models.llama.weight_types import Weight

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


def rms_norm(x: F32, weight: F32, eps: float) -> F32:
    """RMSNorm of the rows of x [T, H] (any view with contiguous rows): a new [T, H]."""
    if x.strides[-1] != 4:
        x = np.ascontiguousarray(x)
    return det_rowwise.rms_norm(x, weight, eps)


def head_norm_(x: F32, weight: F32, eps: float) -> None:
    """RMSNorm of every head in place: x [T, heads, hd] (a view with contiguous heads), weight [hd]."""
    det_rowwise.rms_norm(x, weight, eps, out=x)


def projection_norm_(x: F32, weight: F32, eps: float) -> None:
    """RMSNorm over all heads of each row together, in place: x [T, heads, hd], weight [heads, hd]."""
    rows = x.reshape(x.shape[0], -1)                                         # [T, heads * hd]
    if not np.shares_memory(rows, x):
        raise ValueError("projection_norm_ needs each row's heads contiguous")
    det_rowwise.rms_norm(rows, np.ascontiguousarray(weight).reshape(-1), eps, out=rows)


def gated(gate_up: F32, kind: str) -> F32:
    """The gated activation `kind` ("silu", "gelu_tanh", "swiglu_oai") of [gate | up] [T, 2F]: [T, F]."""
    return det_rowwise.gated(gate_up, kind)


def softcap_(x: F32, cap: float) -> None:
    """x <- cap * tanh(x / cap) in place (x C-contiguous float32)."""
    x *= np.float32(1.0 / cap)
    det_rowwise.tanh_(x)
    x *= np.float32(cap)


# ggml's F32, F16 and BF16: their rows widen to float32 exactly in every build (BlockMatrix.rows).
WIDENED_EXACTLY = (0, 1, 30)


def product(x: F32, w: Weight) -> F32:
    """x [T, in] @ w [in, out] for a router or gate: a quantized matrix by the deterministic product (a type it
    does not read by the reference's), float32 or 16-bit values (rows widened exactly) by det_rowwise's dense
    product."""
    if isinstance(w, np.ndarray):
        return det_rowwise.matmul_f32(x, np.ascontiguousarray(w.T))
    if isinstance(w, BlockMatrix) and not w.det and len(w.types) == 1 and w.types[0] in WIDENED_EXACTLY:
        return det_rowwise.matmul_f32(x, w.rows(np.arange(w.shape[1], dtype=np.int64)))
    return w.matmul(x)


def route(logits: F32, top_k: int, norm_top_k: bool, scale: float = 1.0) -> tuple[I64, F32]:
    """mixture.route's experts [T, k] (ascending) and weights [T, k], deterministically: the softmax
    det_rowwise's, the top k the first k of a stable sort by falling logit."""
    ids = np.sort(np.argsort(-logits, axis=1, kind="stable")[:, :top_k], axis=1)      # [T, k]
    weights: F32 = np.take_along_axis(det_rowwise.softmax(np.ascontiguousarray(logits)), ids, axis=1)
    if norm_top_k:
        total = weights[:, 0].copy()                                           # [T] added in expert order
        for j in range(1, weights.shape[1]):
            total += weights[:, j]
        weights /= total[:, None]
    if scale != 1.0:
        weights *= np.float32(scale)
    return ids.astype(np.int64, copy=False), weights


def sigmoid(z: F32) -> F32:
    """1 / (1 + det_exp(-z))."""
    e = np.ascontiguousarray(-z, dtype=np.float32)
    det_rowwise.exp_(e)
    e += np.float32(1.0)
    out: F32 = np.float32(1.0) / e
    return out
