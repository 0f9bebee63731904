"""Rotary position embeddings in the GGUF row order: adjacent pairs (2i, 2i+1) rotate together.

GGUF conversion permutes the q/k rows of every Llama head so that pair i is (2i, 2i+1), with angle
pos * base^(-2i / rope_dim). forge keeps those rows as stored and rotates adjacent pairs; it never
un-permutes them (mixing the two conventions gives fluent-looking garbage). Families whose files
rotate halves (i with i + rope_dim / 2) get their rows reordered into pairs at load (weights.py).
The frequencies and the magnitude of a scaled file's rotations (linear, YaRN, LongRoPE) come from
forge.models.llama.rope_scaling.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

import forge.models.llama.exact_trig as exact_trig
from forge.models.llama.llama_config import LlamaConfig
from forge.models.llama.rope_scaling import RopeScaling

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
C64 = npt.NDArray[np.complex64]


# Positions a model's tables cover when it is loaded. They grow (doubling, up to the model's context) when a
# position past them comes, and the engine sizes them to the context it serves (LlamaModel.serve_context):
# never to the file's own context_length, which may claim 2^40 positions.
POSITIONS_AT_LOAD = 4096


class RopeTables:
    """magnitude * (cos + i sin) of every pair's angle at positions [0, num_positions), num_positions at most
    max_position; the magnitude is 1 but for a scaled file's (YaRN, LongRoPE)."""

    def __init__(self, config: LlamaConfig, freq_divisors: F32 | None = None, *, sliding: bool = False,
                 long_divisors: F32 | None = None, exact: bool = False) -> None:
        """`freq_divisors`: the file's per-frequency divisors (rope_freqs, or LongRoPE's short factors);
        `long_divisors`: LongRoPE's long factors, taken instead while the context served passes the original
        context (serve()). Until serve() says otherwise, the context served is the file's. `sliding`: the tables
        of the family's sliding-window layers (their own base, no scaling). `exact`: the frequencies, cos and
        sin by forge.models.llama.exact_trig (the deterministic numerics: the same tables on every host)."""
        self._exact = exact
        self._theta, self._rope_dim, self._scale = config.rope_theta, config.rope_dim, config.rope_scale
        self._scaling = config.rope_scaling
        self._divisors = {False: freq_divisors, True: long_divisors if long_divisors is not None else freq_divisors}
        if sliding and config.arch.sliding_rope_base:
            self._theta, self._scale, self._scaling = config.arch.sliding_rope_base, 1.0, RopeScaling()
            self._divisors = {False: None, True: None}
        self.max_position = config.max_position
        self.long_factors = self._scaling.uses_long_factors(self.max_position)
        self._inv_freq = self._frequencies()
        self.rotation = self._table(min(self.max_position, POSITIONS_AT_LOAD))       # [P, half]

    def serve(self, context: int) -> None:
        """Cover the context served, [0, context) (at most max_position), with the frequencies for it: LongRoPE's
        long factors past its original context, its short ones within."""
        long_factors = self._scaling.uses_long_factors(context)
        if long_factors == self.long_factors:
            self.resize(context)
            return
        self.long_factors = long_factors
        self._inv_freq = self._frequencies()
        self.rotation = self._table(max(1, min(context, self.max_position)))

    @property
    def num_positions(self) -> int:
        return int(self.rotation.shape[0])

    def resize(self, num_positions: int) -> None:
        """Cover exactly positions [0, num_positions) (at most max_position): the context served."""
        num_positions = max(1, min(num_positions, self.max_position))
        if num_positions != self.num_positions:
            self.rotation = self._table(num_positions)

    def _frequencies(self) -> npt.NDArray[np.float64]:
        power = exact_trig.power if self._exact else np.power
        return self._scaling.frequencies(self._theta, self._rope_dim, self._divisors[self.long_factors], power)

    def _table(self, num_positions: int) -> C64:
        """Angles computed in float64, stored as complex64."""
        positions = np.arange(num_positions, dtype=np.float64) / self._scale                  # [P]
        angles = np.outer(positions, self._inv_freq)                                          # [P, half]
        rotation = np.empty(angles.shape, np.complex64)                                       # [P, half]
        magnitude = self._scaling.magnitude
        cos, sin = exact_trig.cos_sin(angles) if self._exact else (np.cos(angles), np.sin(angles))
        rotation.real = cos * magnitude
        rotation.imag = sin * magnitude
        return rotation

    def at(self, positions: I64) -> C64:
        """The rotations at the given positions (below max_position), shaped [T, 1, rope_dim / 2] to broadcast
        over heads; a position past the table grows it first (doubling, at most to max_position)."""
        rotation = self.rotation
        needed = int(positions.max()) + 1 if positions.size else 0
        if needed > rotation.shape[0]:
            self.resize(max(needed, 2 * rotation.shape[0]))
            rotation = self.rotation
        return rotation[positions][:, None, :]


def apply_rope(x: F32, rotation: C64) -> None:
    """Rotate x in place: x is [T, num_heads, head_dim] (a view is fine, as long as its last axis
    is contiguous); rotation comes from RopeTables.at(positions). Only the first rope_dim dims of
    each head rotate. Pair (2i, 2i+1) is the complex number x[2i] + i x[2i+1], so one complex
    multiply gives (x[2i] cos - x[2i+1] sin, x[2i] sin + x[2i+1] cos)."""
    half = rotation.shape[-1]
    pairs = x[..., : 2 * half].view(np.complex64)                    # [T, nh, half] view: dims (2i, 2i+1)
    pairs *= rotation


def apply_rope_exact(x: F32, rotation: C64) -> None:
    """apply_rope by explicit float32 operations, each rounded once in this order (the deterministic numerics:
    a complex multiply's vector code may fuse them): x0' = (x0 c) - (x1 s), x1' = (x0 s) + (x1 c)."""
    half = rotation.shape[-1]
    x0, x1 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]            # [T, nh, half] views
    c, s = rotation.real, rotation.imag                                      # [T, 1, half]
    first = x0 * c
    first -= x1 * s
    second = x0 * s
    second += x1 * c
    x0[...] = first
    x1[...] = second
