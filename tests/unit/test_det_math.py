"""The deterministic numerics' exponential and logarithm (forge/kernels/det_math.h): every build level this
host can run gives the numpy definition's bits (forge.kernels.det_math), in its vector lanes and its scalar
tail alike, and both stay within 2 ulp of the true functions."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from forge.kernels import compiled
from forge.kernels.det_math import compiled_exp, compiled_log, det_exp, det_log
from tests.unit.test_block_linear import RUNNABLE


def bits(a: npt.NDArray[np.float32]) -> npt.NDArray[np.uint32]:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def ulps(got: npt.NDArray[np.float32], want: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)


def level(isa: str):  # type: ignore[no-untyped-def]
    return compiled.library() if isa == "native" else compiled.library_at(isa)


def test_exp_is_the_definition_on_every_level() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-100, 100, 5000), rng.uniform(-1, 1, 2000), rng.uniform(-88, 0, 3000),
                        [0.0, -0.0, 1e-30, -1e-30, 88.7, -87.3, 89.0, -90.0, np.inf, -np.inf, np.nan, 0.5, -0.5],
                        rng.uniform(-5, 5, 13)]).astype(np.float32)     # 10,026 values: a scalar tail too
    want = det_exp(x)
    for isa in RUNNABLE:
        assert np.array_equal(bits(compiled_exp(x, level(isa))), bits(want)), isa
    inside = (x > -87) & (x < 88)
    assert ulps(want[inside], np.exp(x[inside].astype(np.float64))).max() <= 2
    assert det_exp(np.float32([0.0]))[0] == 1.0
    assert det_exp(np.float32([np.nan]))[0] == det_exp(np.float32([-87.33654]))[0]


def test_log_is_the_definition_on_every_level() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([np.exp(rng.uniform(-80, 80, 6000)), rng.uniform(1, 2, 2000), rng.uniform(0.5, 1.5, 2000),
                        [1.0, 2.0, 0.5, 1.41421356, 1.41421366, 3.4e38, 1.2e-38]]).astype(np.float32)
    want = det_log(x)
    for isa in RUNNABLE:
        assert np.array_equal(bits(compiled_log(x, level(isa))), bits(want)), isa
    assert ulps(want, np.log(x.astype(np.float64))).max() <= 2
    assert det_log(np.float32([1.0]))[0] == 0.0
