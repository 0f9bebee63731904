"""Rotary position embeddings in the GGUF row order: adjacent pairs (2i, 2i+1) rotate together.

GGUF conversion permutes the q/k rows of every head so that pair i is (2i, 2i+1), with angle
pos * base^(-2i / rope_dim). forge keeps the rows as stored and rotates adjacent pairs; it never
un-permutes them (mixing the two conventions gives fluent-looking garbage).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from forge.llama.config import LlamaConfig

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class RopeTables:
    cos: F32  # [max_position, rope_dim / 2]
    sin: F32  # [max_position, rope_dim / 2]

    @property
    def max_position(self) -> int:
        return int(self.cos.shape[0])

    @classmethod
    def build(cls, config: LlamaConfig, freq_divisors: F32 | None = None) -> RopeTables:
        """Angles computed in float64 once, stored as float32 for every position below max_position."""
        half = config.rope_dim // 2
        inv_freq = config.rope_theta ** (-np.arange(half, dtype=np.float64) * 2.0 / config.rope_dim)  # [half]
        if freq_divisors is not None:
            inv_freq = inv_freq / freq_divisors.astype(np.float64)
        positions = np.arange(config.max_position, dtype=np.float64) / config.rope_scale             # [P]
        angles = np.outer(positions, inv_freq)                                                        # [P, half]
        return cls(cos=np.cos(angles).astype(np.float32), sin=np.sin(angles).astype(np.float32))

    def at(self, positions: I64) -> tuple[F32, F32]:
        """cos and sin at the given positions, shaped [T, 1, rope_dim / 2] to broadcast over heads."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rope(x: F32, cos: F32, sin: F32) -> None:
    """Rotate x in place: x is [T, num_heads, head_dim] (a view is fine); cos/sin come from
    RopeTables.at(positions). Only the first rope_dim dims of each head rotate."""
    half = cos.shape[-1]
    pairs = x[..., : 2 * half]                                       # [T, nh, rope_dim]
    even = pairs[..., 0::2]                                          # [T, nh, half] view: dims 2i
    odd = pairs[..., 1::2]                                           # [T, nh, half] view: dims 2i+1
    new_even = even * cos - odd * sin                                # [T, nh, half]
    odd *= cos
    odd += even * sin
    even[...] = new_even
