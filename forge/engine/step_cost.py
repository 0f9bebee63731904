"""What a step costs: seconds as a linear function of the tokens it computes, learned as steps run.

The scheduler uses it to size a step to a time target (SchedulerConfig.max_step_s): so many decode
rows plus as much prefill as fits, instead of a fixed token budget. The fit is exponentially
weighted least squares over recent steps, so it follows the machine (another tenant, a longer
context) within a few dozen steps. Pure arithmetic: the engine reports each step's tokens and time.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of a step in the fit halves after this many newer steps.
HALF_LIFE_STEPS = 32
# Steps observed before the model answers at all.
MIN_STEPS = 4


@dataclass(slots=True)
class StepCostModel:
    """seconds ~= fixed + per_token * tokens, over recent steps."""

    half_life: int = HALF_LIFE_STEPS
    _w: float = 0.0        # decayed sums: weight, tokens, seconds, tokens^2, tokens*seconds
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    _n: int = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        keep = 0.5 ** (1.0 / self.half_life)
        x, y = float(num_tokens), seconds
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + x
        self._y = self._y * keep + y
        self._xx = self._xx * keep + x * x
        self._xy = self._xy * keep + x * y
        self._n += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before MIN_STEPS steps. Steps of one size
        alone cannot separate the two: then the fixed part is taken as zero."""
        if self._n < MIN_STEPS:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var > 1e-6 * mean_x * mean_x:
            per_token = (self._xy / self._w - mean_x * mean_y) / var
            fixed = mean_y - per_token * mean_x
            if per_token > 0 and fixed >= 0:
                return fixed, per_token
        return 0.0, mean_y / mean_x

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step can compute in `seconds` by the fit (at least 0); None unfitted."""
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_token = fitted
        return max(0, int((seconds - fixed) / per_token))
