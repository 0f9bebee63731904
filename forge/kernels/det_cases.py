"""Fixed inputs for the deterministic numerics' committed bits: weight blocks and activations made by a
64-bit linear congruential generator (no library's random stream, whose sequence may change between
versions), so that any host builds the same arrays. scripts/reference/make_det_bits.py writes the
products' sha256 into tests/data/det_expected_bits.json; tests/unit/test_det_numerics.py holds every build
of every host to them."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
ROWS, COLS, STEP = 37, 768, 5                 # weight rows, K, rows of x
# Byte offsets of each block's float16 scales (set to sane values, not random bytes that could be NaN).
F16_AT = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
          Q.Q6_K: [208]}


def lcg(seed: int, n: int) -> npt.NDArray[np.uint64]:
    """n values of Knuth's MMIX generator from seed (the high 32 bits of each state are the useful ones)."""
    out = np.empty(n, dtype=np.uint64)
    state = np.uint64(seed)
    a, c = np.uint64(6364136223846793005), np.uint64(1442695040888963407)
    with np.errstate(over="ignore"):
        for i in range(n):
            state = state * a + c
            out[i] = state
    return out


def case(qtype: GGMLQuantizationType) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    """The weight blocks [ROWS, bytes] and x [STEP, COLS] of qtype's case."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    size = ROWS * COLS // elems * nbytes
    words = lcg(int(qtype) + 1, size // 4 + 1)
    data = np.ascontiguousarray((words >> np.uint64(32)).astype(np.uint32)).view(np.uint8)[:size].copy()
    blocks = data.reshape(-1, nbytes)
    for at in F16_AT[qtype]:
        # scales 2^-10 .. 2^-5 with either sign, from the generator's top bits
        bits = (lcg(1000 + int(qtype) * 7 + at, len(blocks)) >> np.uint64(40)).astype(np.int64)
        scale = (np.float32(2.0) ** -(10 - (bits % 6))).astype(np.float32) * np.where(bits & 64, -1, 1)
        blocks[:, at:at + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    xbits = (lcg(77 + int(qtype), STEP * COLS) >> np.uint64(40)).astype(np.int64)       # 24-bit integers
    x = ((xbits - (1 << 23)).astype(np.float32) * np.float32(2.0**-20)).reshape(STEP, COLS)
    return data.reshape(ROWS, -1), x
