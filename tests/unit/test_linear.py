from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import numpy as np
import pytest

from forge.models.llama import linear as linear_mod
from forge.models.llama.linear import MatmulPool, _column_cuts


@pytest.fixture
def always_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_mod, "MIN_SPLIT_MACS", 0)
    monkeypatch.setattr(linear_mod, "MIN_SPLIT_ROWS", 1)


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_split_matmul_equals_one_matmul(always_split: None, num_threads: int, rows: int, layout: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 48), dtype=np.float32)
    w = rng.standard_normal((48, 100), dtype=np.float32)
    if layout == "out_in":
        w = np.ascontiguousarray(w.T).T                  # an F-ordered view of an [out, in] array
    pool = MatmulPool("split", num_threads)
    try:
        y = pool.matmul(x, w)
    finally:
        pool.close()
    assert y.flags.c_contiguous and y.shape == (rows, 100)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_column_cuts_cover_every_column_once() -> None:
    for num_cols in (1, 15, 16, 100, 49152):
        for parts in (1, 2, 3, 7):
            cuts = _column_cuts(num_cols, parts)
            assert cuts[0][0] == 0 and cuts[-1][1] == num_cols
            assert all(a[1] == b[0] for a, b in pairwise(cuts))


def test_bad_strategy_or_threads_are_refused() -> None:
    with pytest.raises(ValueError):
        MatmulPool("fast", 2)
    with pytest.raises(ValueError):
        MatmulPool("split", 0)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_run_parts_runs_every_part_once(num_threads: int) -> None:
    pool = MatmulPool("split", num_threads)
    assert pool.num_parts == num_threads
    seen: list[int] = []
    try:
        pool.run_parts(seen.append, list(range(5)))
        with pytest.raises(ZeroDivisionError):
            pool.run_parts(lambda i: seen.append(1 // i), [1, 0])
    finally:
        pool.close()
    assert sorted(seen) == [0, 1, 1, 2, 3, 4]
    assert MatmulPool("blas", 4).num_parts == 1


def test_the_pool_survives_a_failing_part_and_reports_the_first_failure() -> None:
    pool = MatmulPool("split", 3)

    def fail_on(bad: int) -> Callable[[int], None]:
        def part(i: int) -> None:
            if i == bad:
                raise ValueError(f"part {i}")
        return part

    try:
        for bad in (0, 1, 2):  # the caller's own part, then a worker's
            with pytest.raises(ValueError, match=f"part {bad}"):
                pool.run_parts(fail_on(bad), [0, 1, 2])
        seen: list[int] = []
        pool.run_parts(seen.append, [0, 1, 2])     # still usable, every worker free again
        assert sorted(seen) == [0, 1, 2]
    finally:
        pool.close()


def test_concurrent_and_nested_callers_get_the_same_matmuls(always_split: None) -> None:
    """One pool, called from several threads at once and from inside its own parts: each call
    either gets the pool or runs its parts itself; every matmul is right and nothing deadlocks."""
    import threading

    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    want = x @ w
    pool = MatmulPool("split", 2)
    failures: list[str] = []

    def caller() -> None:
        for _ in range(50):
            if not np.allclose(pool.matmul(x, w), want, atol=1e-4):
                failures.append("matmul")
            nested: list[np.ndarray] = []
            pool.run_parts(lambda _, out=nested: out.append(pool.matmul(x, w)), [0, 1])
            if len(nested) != 2 or not all(np.allclose(n, want, atol=1e-4) for n in nested):
                failures.append("nested")

    try:
        threads = [threading.Thread(target=caller) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
    finally:
        pool.close()
    assert failures == []


def test_one_row_splits_only_big_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A matrix-vector product is split over the pool only from MIN_SPLIT_MACS_FEW_ROWS on."""
    calls: list[int] = []
    real = linear_mod._matmul_into

    def spy(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        calls.append(w.shape[1])
        real(x, w, out)

    monkeypatch.setattr(linear_mod, "_matmul_into", spy)
    rng = np.random.default_rng(2)
    pool = MatmulPool("split", 2)
    try:
        for cols, pieces in ((512, 1), (4096, 2)):         # 0.26M and 2.1M multiply-adds
            x = rng.standard_normal((1, 512)).astype(np.float32)
            w = rng.standard_normal((512, cols)).astype(np.float32)
            calls.clear()
            np.testing.assert_allclose(pool.matmul(x, w), x @ w, rtol=1e-5, atol=1e-4)
            assert len(calls) == pieces and sum(calls) == cols
    finally:
        pool.close()
