"""The model set's rules with real actor sets over the real default model served under three ids
(a small K/V each): loads on demand (one load for all who wait), the least recently used idle model
unloaded first, a busy model never (it yields its turn to a model whose request has waited the bound),
keep_alive."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.http.gateway import GatewayConfig
from actors.runtime.model_set import ModelEntry, ModelSet, parse_keep_alive
from actors.supervisor import Daemon, DaemonConfig
from forge.config import EngineConfig
from forge.errors import CapacityError, RequestError


@pytest.fixture
def tiny_paths(default_model_path: Path) -> dict[str, Path]:
    return {name: default_model_path for name in "abc"}


def model_set(paths: dict[str, Path], **limits: Any) -> ModelSet:
    engine = EngineConfig(kv_cache_memory=16 << 20, max_model_len=128, max_num_seqs=2, blas_threads=1,
                          kv_cache_commit="off")
    daemon = Daemon(DaemonConfig(engine=engine, gateway=GatewayConfig()))
    entries = [ModelEntry(model_id=k, source=str(p), size_bytes=p.stat().st_size) for k, p in paths.items()]
    return ModelSet(entries, daemon._build, **limits)


async def test_the_least_recently_used_idle_model_is_unloaded_first(tiny_paths: dict[str, Path]) -> None:
    models = model_set(tiny_paths, max_loaded=2)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(models.run)
            for model_id in ("a", "b"):
                await models.acquire(model_id)
                models.release(model_id)
            await models.acquire("a")                  # a is now the more recent
            models.release("a")
            await models.acquire("c")
            await models.wait_unloaded("b")
            states = {k: e.state for k, e in models.entries.items()}
            models.release("c")
            tg.cancel_scope.cancel()
    assert states == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    assert models.num_swaps == 1


async def test_a_busy_model_is_never_unloaded_and_yields_its_turn(tiny_paths: dict[str, Path]) -> None:
    """One model loaded at a time: a request for b waits (not a 503) while a is busy, and a keeps admitting
    until b's request has waited the bound; then a stops admitting (its new request waits too), drains,
    unloads, and b loads; once a's waiting request has waited the bound, b yields back the same way."""
    models = model_set(tiny_paths, max_loaded=1, turn_after_s=0.5)
    got: list[str] = []

    async def take(model_id: str) -> None:
        await models.acquire(model_id)
        got.append(model_id)

    def rows() -> dict[str, tuple[str, int, int, bool]]:
        return {str(r["id"]): (str(r["state"]), int(r["num_active"]), int(r["waiting_for_load"]),  # type: ignore[call-overload]
                               bool(r["yielding"])) for r in models.statistics()}

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(models.run)
            await models.acquire("a")                  # in use: not released
            tg.start_soon(take, "b")
            await anyio.sleep(0.05)
            refused_unload = models.unload("a")
            await models.acquire("a")                  # b has not waited the bound: a still admits
            before_bound = rows()
            await anyio.sleep(0.8)                     # past it: a yields
            tg.start_soon(take, "a")
            await anyio.sleep(0.05)
            yielding = rows()
            models.release("a")
            models.release("a")                        # a drained: unloaded, b loads, b's request takes it
            while got != ["b"]:
                await anyio.sleep(0.02)
            b_turn = rows()
            await anyio.sleep(0.8)                     # a's request has waited the bound: b yields back
            b_yielding = rows()
            models.release("b")
            while got != ["b", "a"]:
                await anyio.sleep(0.02)
            a_turn = rows()
            models.release("a")
            tg.cancel_scope.cancel()
    assert not refused_unload
    assert before_bound == {"a": ("loaded", 2, 0, False), "b": ("unloaded", 0, 1, False),
                            "c": ("unloaded", 0, 0, False)}
    assert yielding["a"] == ("loaded", 2, 1, True) and yielding["b"] == ("unloaded", 0, 1, False)
    assert b_turn["b"][:3] == ("loaded", 1, 0) and b_turn["a"][0] == "unloaded" and b_turn["a"][2] == 1
    assert b_yielding["b"] == ("loaded", 1, 0, True)
    assert a_turn["a"] == ("loaded", 1, 0, False) and a_turn["b"][0] == "unloaded"
    assert models.num_swaps == 2 and models.entries["b"].num_loads == 1 and models.entries["a"].num_loads == 2
    # each turn given up while busy counts once, however many times the schedule is settled meanwhile
    assert models.entries["a"].num_yields == 1 and models.entries["b"].num_yields == 1
    assert models.entries["c"].num_yields == 0


async def test_a_waiter_that_leaves_lets_the_busy_model_admit_again(tiny_paths: dict[str, Path]) -> None:
    models = model_set(tiny_paths, max_loaded=1, turn_after_s=0.2)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(models.run)
            await models.acquire("a")
            async with anyio.create_task_group() as client:
                client.start_soon(models.acquire, "b")
                await anyio.sleep(0.6)                 # b's request waits past the bound: a yields
                yielded = models.entries["a"].yielding, len(models.entries["b"].waiters)
                client.cancel_scope.cancel()           # and b's client goes away
            await models.acquire("a")                  # no one waits now: a admits at once
            left = models.entries["b"].waiters, models.entries["a"].yielding, models.entries["a"].num_active
            models.release("a")
            models.release("a")
            tg.cancel_scope.cancel()
    assert yielded == (True, 1)
    assert left == ([], False, 2) and models.entries["b"].state == "unloaded" and models.num_swaps == 0


async def test_waiters_fail_when_the_daemon_drains(tiny_paths: dict[str, Path]) -> None:
    models = model_set(tiny_paths, max_loaded=1)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(models.run)
            await models.acquire("a")
            failed: list[RequestError] = []

            async def wait_b() -> None:
                try:
                    await models.acquire("b")
                except RequestError as exc:
                    failed.append(exc)

            tg.start_soon(wait_b)
            await anyio.sleep(0.05)
            num = models.fail_waiters(CapacityError("draining", code="draining", retry_after_s=5))
            await anyio.sleep(0.05)
            await wait_b()                             # one that would wait from now on fails at once
            await models.acquire("a")                  # one for a loaded model is served, as the drain's are
            models.release("a")
            models.release("a")
            tg.cancel_scope.cancel()
    assert num == 1 and [e.code for e in failed] == ["draining", "draining"] and models.entries["b"].waiters == []


async def test_requests_during_a_load_share_it(tiny_paths: dict[str, Path]) -> None:
    models = model_set(tiny_paths)
    got = []
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(models.run)

            async def one() -> None:
                got.append(await models.acquire("a"))

            async with anyio.create_task_group() as waiters:
                for _ in range(3):
                    waiters.start_soon(one)
            for _ in got:
                models.release("a")
            tg.cancel_scope.cancel()
    assert len(got) == 3 and got[0] is got[1] is got[2]
    assert models.entries["a"].num_loads == 1 and models.entries["a"].num_active == 0


async def test_keep_alive_unloads_an_idle_model_only(tiny_paths: dict[str, Path]) -> None:
    models = model_set(tiny_paths)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(models.run)
            for model_id in ("a", "b"):
                await models.acquire(model_id)
            models.entries["a"].keep_alive = models.entries["b"].keep_alive = 0.0
            models.release("a")                        # idle, keep_alive 0: unloaded now
            reaped_busy = models.reap(now=float("inf"))   # b is in use: kept, whatever the time
            await models.wait_unloaded("a")
            state_b = models.entries["b"].state
            models.release("b")
            tg.cancel_scope.cancel()
    assert models.entries["a"].state == "unloaded"
    assert reaped_busy == [] and state_b == "loaded"


async def test_an_unknown_model_names_the_available_ones(tiny_paths: dict[str, Path]) -> None:
    models = model_set(tiny_paths)
    with pytest.raises(RequestError) as err:
        await models.acquire("zzz")
    assert err.value.status == 404 and "a, b, c" in str(err.value)


def test_keep_alive_takes_ollamas_forms() -> None:
    assert parse_keep_alive(30) == 30.0
    assert parse_keep_alive("5m") == 300.0
    assert parse_keep_alive("1h") == 3600.0
    assert parse_keep_alive("250ms") == 0.25
    assert parse_keep_alive(1e300) is None and parse_keep_alive("1e300h") is None   # past any clock: forever
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None
    for bad in ("soon", True, [1], "inf"):
        with pytest.raises(RequestError):
            parse_keep_alive(bad)


async def test_the_memory_budget_unloads_the_idle_model_to_fit_the_next(tiny_paths: dict[str, Path]) -> None:
    probe = model_set(tiny_paths)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(probe.run)
            await probe.load("a")
            one = probe.entries["a"].memory_bytes                 # weights + K/V of one
            tg.cancel_scope.cancel()
    models = model_set(tiny_paths, max_memory=one + one // 2)     # room for one and a half
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(models.run)
            await models.load("a")
            await models.load("b")
            await models.wait_unloaded("a")
            states = {k: e.state for k, e in models.entries.items()}
            tg.cancel_scope.cancel()
    assert one > models.entries["b"].size_bytes
    assert states == {"a": "unloaded", "b": "loaded", "c": "unloaded"} and models.num_swaps == 1
