"""The mixture-of-experts block: each token routed to its top k experts, the step's products grouped
by expert, the weighted sum scattered back.

    logits = x @ router (+ b)                 [T, E]
    p = softmax(logits)                       over all E experts
    top k of p per token                      renormalised to sum 1 when the family (or the file) says so
    y_t = sum over its experts e of p_te * down_e(act(gate_e x_t, up_e x_t))
          (+ sigmoid(x_t . g) * shared(x_t), qwen2moe's shared expert)

gpt-oss adds a bias to the router's logits and to each expert's gate, up and down products (each
expert's own row of the layer's bias tensors), and its act is the clamped SwiGLU.

Mixtral's softmax over the top k's own logits is the renormalised case. The step's rows (the tokens
of every prompt chunk and decode stream in it) are grouped by expert: each active expert's weights
are read once per step, by one product over all of its rows, each token's outputs added in expert
order (the order in which transformers adds them too). Where the compiled products hold the experts,
all of a step's experts go in one call per projection (grouped_experts: gate/up, the activation over
every row at once, down), with the bits of the loop over the experts that the numpy reference runs.
Owns no weights (forge.models.llama.experts holds them) and no state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt

import forge.models.llama.det_forward as det_forward
from forge.models.llama.experts import MoeWeights
from forge.models.llama.linear import MatmulFn
from forge.models.llama.llama_config import MoeConfig

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
Activation = Callable[[F32], F32]     # [n, 2F] = [gate | up] -> [n, F]


def route(logits: F32, top_k: int, norm_top_k: bool, scale: float = 1.0) -> tuple[I64, F32]:
    """Each token's top_k experts [T, k] (in no particular order) and their weights [T, k]: the
    softmax over all experts' logits [T, E], renormalised over the k when norm_top_k, times scale."""
    num_experts = logits.shape[1]
    if top_k < num_experts:
        ids = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]          # [T, k]
    else:
        ids = np.broadcast_to(np.arange(num_experts), logits.shape).copy()
    shifted = logits - logits.max(axis=1, keepdims=True)                       # [T, E]
    probs = np.exp(shifted, dtype=np.float32)                                  # [T, E]
    probs /= probs.sum(axis=1, keepdims=True)
    weights: F32 = np.take_along_axis(probs, ids, axis=1)                      # [T, k]
    if norm_top_k:
        weights /= weights.sum(axis=1, keepdims=True)
    if scale != 1.0:
        weights *= np.float32(scale)
    return ids.astype(np.int64, copy=False), weights


def expert_groups(ids: I64, weights: F32) -> Iterator[tuple[int, I64, F32]]:
    """(expert, its tokens [n], their weights [n]) for every expert some token chose, in expert
    order, each expert's tokens ascending. A token chooses an expert at most once, so an expert's
    tokens are distinct."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)                                                     # [T * k]
    order = np.argsort(flat, kind="stable")                                    # the choices grouped by expert
    experts, starts = np.unique(flat[order], return_index=True)
    bounds = np.append(starts, flat.size)
    tokens = order // top_k                                                    # [T * k] in group order
    chosen = weights.reshape(-1)[order]                                        # [T * k]
    for expert, lo, hi in zip(experts.tolist(), bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        yield expert, tokens[lo:hi], chosen[lo:hi]


def mixture(x: F32, moe: MoeWeights, config: MoeConfig, mm: MatmulFn, activation: Activation,
            det: bool = False) -> F32:
    """The block's output [T, H] for its normed input x [T, H]: every active expert's product once,
    over all the rows routed to it. `det`: the deterministic numerics' router (forge.models.llama.det_forward)."""
    logits = (det_forward.product if det else mm)(x, moe.router)              # [T, E]
    if moe.router_bias is not None:
        logits += moe.router_bias
    ids, weights = (det_forward.route if det else route)(logits, config.num_used, config.norm_top_k,
                                                         config.weights_scale)
    if moe.gate_up.is_kernel and moe.down.is_kernel:
        out = grouped_experts(x, moe, ids, weights, activation)
    else:
        out = np.zeros_like(x)                                                 # [T, H]
        for expert, tokens, chosen in expert_groups(ids, weights):
            rows = x[tokens]                                                   # [n, H]
            gate_up = mm(rows, moe.gate_up[expert])                            # [n, 2F]
            if moe.gate_up_bias is not None:
                gate_up += moe.gate_up_bias[expert]
            y = mm(activation(gate_up), moe.down[expert])                      # [n, H]
            if moe.down_bias is not None:
                y += moe.down_bias[expert]
            y *= chosen[:, None]
            out[tokens] += y                                                   # tokens distinct: no lost adds
    if moe.shared_gate_up is not None and moe.shared_down is not None and moe.shared_gate is not None:
        shared = mm(activation(mm(x, moe.shared_gate_up)), moe.shared_down)    # [T, H]
        shared *= (det_forward.sigmoid(det_forward.product(x, moe.shared_gate)) if det
                   else sigmoid(mm(x, moe.shared_gate)))                       # [T, 1]
        out += shared
    return out


def grouped_experts(x: F32, moe: MoeWeights, ids: I64, weights: F32, activation: Activation) -> F32:
    """sum over each token's experts of weight * down_e(act(gate_up_e x)) [T, H], every expert's rows
    in one grouped product per projection (ExpertStack.grouped), then each token's k outputs added in
    expert order: the same additions as the loop in mixture(), so the same bits."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)                                                     # [T * k]
    order = np.argsort(flat, kind="stable")                                    # the choices grouped by expert
    experts, starts = np.unique(flat[order], return_index=True)
    bounds = np.append(starts, flat.size)                                      # [groups + 1]
    gate_up = moe.gate_up.grouped(x[order // top_k], experts, bounds)          # [T * k, 2F]
    if moe.gate_up_bias is not None:                                           # gpt-oss: each row its expert's
        gate_up += moe.gate_up_bias[flat[order]]
    y = moe.down.grouped(activation(gate_up), experts, bounds)                 # [T * k, H]
    if moe.down_bias is not None:
        y += moe.down_bias[flat[order]]
    y *= weights.reshape(-1)[order][:, None]
    rows = np.empty_like(order)
    rows[order] = np.arange(order.size)                                        # choice (t, j) -> its row of y
    rows = np.sort(rows.reshape(-1, top_k), axis=1)                            # [T, k] each token's, expert order
    out: F32 = y[rows[:, 0]]                                                   # [T, H] (0 + y: the same value)
    for j in range(1, top_k):
        out += y[rows[:, j]]
    return out


def sigmoid(z: F32) -> F32:
    """1 / (1 + exp(-z)), 0 without a warning where exp overflows."""
    with np.errstate(over="ignore"):
        out = np.exp(-z, dtype=np.float32)                                    # [T, 1]
    out += np.float32(1.0)
    np.reciprocal(out, out=out)
    return out
