"""Rotary position embeddings in the GGUF row order: adjacent pairs (2i, 2i+1) rotate together.

GGUF conversion permutes the q/k rows of every Llama head so that pair i is (2i, 2i+1), with angle
pos * base^(-2i / rope_dim). forge keeps those rows as stored and rotates adjacent pairs; it never
un-permutes them (mixing the two conventions gives fluent-looking garbage). Families whose files
rotate halves (i with i + rope_dim / 2) get their rows reordered into pairs at load (weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from forge.llama.config import LlamaConfig

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
C64 = npt.NDArray[np.complex64]


@dataclass(frozen=True, slots=True)
class RopeTables:
    rotation: C64  # [max_position, rope_dim / 2]  cos + i sin of every pair's angle

    @property
    def max_position(self) -> int:
        return int(self.rotation.shape[0])

    @classmethod
    def build(cls, config: LlamaConfig, freq_divisors: F32 | None = None, *, sliding: bool = False) -> RopeTables:
        """Angles computed in float64 once, stored as complex64 for every position below max_position.
        `sliding`: the tables of the family's sliding-window layers (their own base, no scaling)."""
        half = config.rope_dim // 2
        theta, scale = config.rope_theta, config.rope_scale
        if sliding and config.arch.sliding_rope_base:
            theta, scale, freq_divisors = config.arch.sliding_rope_base, 1.0, None
        inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / config.rope_dim)  # [half]
        if freq_divisors is not None:
            inv_freq = inv_freq / freq_divisors.astype(np.float64)
        positions = np.arange(config.max_position, dtype=np.float64) / scale                         # [P]
        angles = np.outer(positions, inv_freq)                                                        # [P, half]
        rotation = np.empty(angles.shape, np.complex64)                                               # [P, half]
        rotation.real = np.cos(angles)
        rotation.imag = np.sin(angles)
        return cls(rotation=rotation)

    def at(self, positions: I64) -> C64:
        """The rotations at the given positions, shaped [T, 1, rope_dim / 2] to broadcast over heads."""
        return self.rotation[positions][:, None, :]


def apply_rope(x: F32, rotation: C64) -> None:
    """Rotate x in place: x is [T, num_heads, head_dim] (a view is fine, as long as its last axis
    is contiguous); rotation comes from RopeTables.at(positions). Only the first rope_dim dims of
    each head rotate. Pair (2i, 2i+1) is the complex number x[2i] + i x[2i+1], so one complex
    multiply gives (x[2i] cos - x[2i+1] sin, x[2i] sin + x[2i+1] cos)."""
    half = rotation.shape[-1]
    pairs = x[..., : 2 * half].view(np.complex64)                    # [T, nh, half] view: dims (2i, 2i+1)
    pairs *= rotation
