"""gpt-oss's experts' activation: SwiGLU with both inputs clamped, a sigmoid of 1.702 x, and 1 added to up.

    gate' = min(gate, 7)        up' = clip(up, -7, 7)
    out   = gate' * sigmoid(1.702 gate') * (up' + 1)

as OpenAI's reference, transformers (GptOssExperts._apply_gate) and llama.cpp (swiglu_oai, its constants
fixed as here) compute it. The clamps bound what the experts' float16/bfloat16 products see; the 1.702
makes x sigmoid(1.702 x) the sigmoid approximation of GELU. The file's gate and up rows are split at
load into forge's [gate | up] columns (llama.cpp's converter de-interleaves the checkpoint's
gate_up_proj into ffn_gate_exps and ffn_up_exps), so the input here is [gate | up] like swiglu's.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]

ALPHA = np.float32(1.702)   # the sigmoid's gain
LIMIT = np.float32(7.0)     # gate clamped above at LIMIT, up to [-LIMIT, LIMIT]


def swiglu_oai(gate_up: F32) -> F32:
    """The clamped SwiGLU of gate_up = [gate | up] [T, 2F]: [T, F] float32."""
    half = gate_up.shape[1] // 2
    gate = np.minimum(gate_up[:, :half], LIMIT)                      # [T, F] new arrays
    up = np.clip(gate_up[:, half:], -LIMIT, LIMIT)
    with np.errstate(over="ignore"):                                 # exp -> inf for a very negative gate: -0
        act = np.exp(gate * -ALPHA)                                  # [T, F]
    act += np.float32(1.0)
    np.divide(gate, act, out=act)                                    # gate * sigmoid(alpha gate)
    up += np.float32(1.0)
    act *= up
    return act
