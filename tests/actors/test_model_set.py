"""The model set's rules with real actor sets over the real default model served under three ids
(a small K/V each): loads on demand (one load for all who wait), the least recently used idle model
unloaded first, a busy model never, keep_alive."""

from __future__ import annotations

from pathlib import Path

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


def model_set(paths: dict[str, Path], **limits: int) -> ModelSet:
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


async def test_a_busy_model_is_never_unloaded(tiny_paths: dict[str, Path]) -> None:
    models = model_set(tiny_paths, max_loaded=1)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(models.run)
            await models.acquire("a")                  # in use: not released
            with pytest.raises(CapacityError) as refused:
                await models.acquire("b")
            refused_unload = models.unload("a")
            state_a, state_b = models.entries["a"].state, models.entries["b"].state
            models.release("a")
            await models.acquire("b")                  # a is idle now: it makes room
            models.release("b")
            tg.cancel_scope.cancel()
    assert refused.value.code == "models_busy" and refused.value.headers == {"Retry-After": "5"}
    assert not refused_unload and state_a == "loaded" and state_b == "unloaded"
    assert models.entries["a"].state == "unloaded"


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
