"""How a file stretches RoPE past the context it was trained on: linear, YaRN and LongRoPE, as llama.cpp's GGUF
files describe them (`{arch}.rope.scaling.*`, `rope_factors_long/short.weight`).

    linear    positions divided by `factor` (rope.scaling.factor)
    YaRN      each frequency a blend of itself (extrapolated) and itself / factor (interpolated): fast ones,
              which turn more than beta_fast times over the original context, keep their own; slow ones, under
              beta_slow turns, are interpolated; a linear ramp between (transformers' _compute_yarn_parameters,
              ggml's rope_yarn). cos and sin are scaled by 0.1 ln(factor) + 1, or by the file's
              yarn_attn_factor where it names one
    LongRoPE  each frequency divided by a factor of its own: the file's short factors where the context served is
              at most the original context, its long factors past it; cos and sin scaled by rope.scaling.attn_factor

A scaled cos/sin is a rotation of that magnitude: forge.models.llama.rope multiplies its tables by it, which
scales q and k alike (the dims past rope_dim unscaled), as transformers scales cos and sin. This module is the
arithmetic; llama_config reads the keys and refuses what it cannot serve.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]
ScalingKind = Literal["none", "linear", "yarn", "longrope"]


@dataclass(frozen=True, slots=True)
class RopeScaling:
    kind: ScalingKind = "none"
    factor: float = 1.0          # linear, yarn: how many times the original context the positions stretch over
    original_context: int = 0    # yarn, longrope: the context trained before the stretch (0: the file's context)
    beta_fast: float = 32.0      # yarn: frequencies turning more often than this over the original context keep theirs
    beta_slow: float = 1.0       # yarn: those turning fewer times than this are interpolated
    ext_factor: float = 1.0      # yarn: the share of extrapolation the ramp mixes in (llama.cpp's; 0: linear only)
    magnitude: float = 1.0       # cos and sin multiplied by it: YaRN's mscale, LongRoPE's attention factor
    truncate: bool = True        # yarn: the correction range widened to whole pairs (gpt-oss: not, as it was trained)

    def frequencies(self, theta: float, rope_dim: int, divisors: npt.NDArray[np.float32] | None = None,
                    power: Callable[[float, F64], F64] = np.power) -> F64:
        """The angle per position of each pair, [rope_dim / 2] (before linear scaling divides positions):
        theta^(-2i / rope_dim) (by `power`: forge.models.llama.exact_trig's under the deterministic numerics),
        divided by the file's per-frequency `divisors` (rope_freqs, LongRoPE's factors), YaRN's blend for a YaRN
        file."""
        inv_freq = power(theta, -np.arange(rope_dim // 2, dtype=np.float64) * 2.0 / rope_dim)   # [half]
        if divisors is not None:
            inv_freq = inv_freq / divisors.astype(np.float64)
        if self.kind != "yarn":
            return inv_freq
        mix = self.ext_factor * (1.0 - yarn_ramp(self, theta, rope_dim))                          # [half]
        return inv_freq / self.factor * (1.0 - mix) + inv_freq * mix

    def uses_long_factors(self, served_context: int) -> bool:
        """LongRoPE: whether a daemon serving this context takes the long factors (as llama.cpp does, by the
        context served: fixed for the daemon's life, so the cached K/V of a prefix stays valid)."""
        return self.kind == "longrope" and served_context > self.original_context


def yarn_mscale(factor: float) -> float:
    """YaRN's magnitude for a stretch of `factor`: 0.1 ln(factor) + 1 (1 for no stretch)."""
    return 1.0 if factor <= 1.0 else 0.1 * math.log(factor) + 1.0


def yarn_ramp(scaling: RopeScaling, theta: float, rope_dim: int) -> F64:
    """0 for the pairs YaRN extrapolates, 1 for those it interpolates, linear between, [rope_dim / 2]: the
    correction range is the pairs turning between beta_fast and beta_slow times over the original context,
    widened to whole pairs unless the scaling says not to (transformers' `truncate`, false for gpt-oss)."""

    def pair_turning(turns: float) -> float:        # the (fractional) pair that turns `turns` times
        return rope_dim * math.log(scaling.original_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    span = max(high - low, 0.001)
    ramp: F64 = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / span, 0.0, 1.0)
    return ramp
