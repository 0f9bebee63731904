"""The models one daemon serves, by id: which are loaded, loading or unloaded, and their actor sets.
One model served is a set of one, loaded at start and never unloaded unless an operator asks.

A request names its model; `acquire` gives it the model's actors, loading the model first if need be
(requests that arrive meanwhile wait for the same load). A load that would pass --max-loaded-models or
--models-memory first unloads the least recently used idle model; a model with requests in flight is
never unloaded (the new request gets 503 when no idle model can make room). keep_alive unloads a model
idle that long. Each loaded model's actors run in this set's task group, started and stopped here.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from actors.runtime.model_actors import ModelActors
from forge.errors import CapacityError, RequestError
from forge.models.loading import release_free_memory

log = structlog.get_logger("forge.models")

State = Literal["unloaded", "loading", "loaded", "unloading"]
Build = Callable[["ModelEntry"], Awaitable[ModelActors]]      # load a model and wire its actors (off the loop)
REAP_INTERVAL_S = 0.25                                        # how often idle models are checked against keep_alive


@dataclass(slots=True)
class _Load:
    done: anyio.Event = field(default_factory=anyio.Event)
    error: str | None = None
    exception: Exception | None = None            # what the load raised (the cause of the waiters' error)


@dataclass(slots=True)
class ModelEntry:
    """One model the daemon can serve. `keep_alive`: seconds idle before it is unloaded (None: never)."""
    model_id: str
    source: str | None                            # a GGUF path or a catalog name (forge.models.hub); None: the default
    keep_alive: float | None = None
    size_bytes: int = 0                           # the file's size (its weights, mapped)
    state: State = "unloaded"
    actors: ModelActors | None = None
    num_active: int = 0                           # responses using it now (routed and not yet ended)
    last_used: float = 0.0                        # monotonic seconds of its last use
    num_loads: int = 0
    error: str | None = None                      # why its last load failed (None: it did not)
    memory_bytes: int = 0                         # weights + K/V while loaded
    _load: _Load | None = None
    _stop: anyio.Event | None = None
    _stopped: anyio.Event | None = None

    def card(self) -> dict[str, object]:
        """What /v1/models says of it beyond OpenAI's fields."""
        out: dict[str, object] = {"state": self.state, "size_bytes": self.size_bytes}
        if self.actors is not None:
            served = self.actors.served
            out.update(max_model_len=served.max_model_len, kv_blocks=served.kv_blocks,
                       block_size=served.block_size, memory_bytes=self.memory_bytes)
        if self.error is not None:
            out["error"] = self.error
        return out


class ModelSet:
    def __init__(self, entries: list[ModelEntry], build: Build, *, max_loaded: int | None = None,
                 max_memory: int | None = None, retry_after_s: int = 5,
                 on_swap: Callable[[str], None] = lambda _model_id: None) -> None:
        self.entries = {e.model_id: e for e in entries}
        self._build = build
        self.max_loaded = max_loaded
        self.max_memory = max_memory
        self._retry_after_s = retry_after_s
        self._on_swap = on_swap
        self._tg: TaskGroup | None = None
        self.num_swaps = 0

    # ---- lookups ------------------------------------------------------------------------------

    def entry(self, model_id: str) -> ModelEntry:
        entry = self.entries.get(model_id)
        if entry is None:
            raise RequestError(f"the model '{model_id}' does not exist; available: {', '.join(self.entries)}",
                               param="model", status=404, code="model_not_found")
        return entry

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries.values() if e.actors is not None]

    def most_recent(self) -> ModelEntry | None:
        """The loaded model used last (what a request naming no model, or a model-less route, gets)."""
        return max(self.loaded(), key=lambda e: e.last_used, default=None)

    def statistics(self) -> list[dict[str, object]]:
        """Each model as /stats and the dashboard show it: state, memory, its requests."""
        out = []
        for entry in self.entries.values():
            row: dict[str, object] = {"id": entry.model_id, "num_active": entry.num_active,
                                      "num_loads": entry.num_loads, **entry.card()}
            if entry.actors is not None:
                running, waiting = entry.actors.requests()
                row.update(running=running, waiting=waiting)
            out.append(row)
        return out

    # ---- acquire / release --------------------------------------------------------------------

    async def acquire(self, model_id: str) -> ModelActors:
        """The model's actors, counted in use until `release`; loads it first if it is not loaded."""
        entry = self.entry(model_id)
        while True:
            if entry.state == "loaded" and entry.actors is not None:
                entry.num_active += 1
                entry.last_used = time.monotonic()
                return entry.actors
            if entry.state == "unloading" and entry._stopped is not None:
                await entry._stopped.wait()
                continue
            load = entry._load if entry.state == "loading" else self._start_load(entry)
            assert load is not None
            await load.done.wait()
            if load.error is not None:
                raise RequestError(f"the model '{model_id}' failed to load: {load.error}", param="model",
                                   status=500, type="server_error", code="model_load_failed") from load.exception

    def release(self, model_id: str) -> None:
        entry = self.entries[model_id]
        entry.num_active -= 1
        entry.last_used = time.monotonic()
        if entry.num_active == 0 and entry.keep_alive == 0:
            self.unload(model_id)

    # ---- load / unload ------------------------------------------------------------------------

    def _start_load(self, entry: ModelEntry) -> _Load:
        if self._tg is None:
            raise CapacityError("the server is starting", code="loading", retry_after_s=self._retry_after_s)
        self._make_room(entry)
        entry.state, entry._load, entry.error = "loading", _Load(), None
        self._tg.start_soon(self._serve, entry, entry._load)
        return entry._load

    def _make_room(self, entry: ModelEntry) -> None:
        """Unload the least recently used idle models until `entry` fits (or raise CapacityError)."""
        while not self._fits(entry):
            idle = [e for e in self.loaded() if e.num_active == 0 and e.state == "loaded"]
            if not idle:
                raise CapacityError(f"no model can be unloaded to load '{entry.model_id}': every loaded "
                                    "model has requests in flight; retry later", code="models_busy",
                                    retry_after_s=self._retry_after_s)
            victim = min(idle, key=lambda e: e.last_used)
            self.num_swaps += 1
            self._on_swap(victim.model_id)
            self.unload(victim.model_id)

    def _fits(self, entry: ModelEntry) -> bool:
        held = [e for e in self.entries.values() if e.state in ("loaded", "loading") and e is not entry]
        if self.max_loaded is not None and len(held) + 1 > self.max_loaded:
            return False
        if self.max_memory is not None:
            used = sum(e.memory_bytes or e.size_bytes for e in held)
            return not held or used + entry.size_bytes <= self.max_memory
        return True

    def unload(self, model_id: str) -> bool:
        """Stop an idle loaded model's actors (its memory is freed once they have stopped)."""
        entry = self.entry(model_id)
        if entry.state != "loaded" or entry.num_active > 0 or entry._stop is None:
            return False
        entry.state = "unloading"
        entry._stop.set()
        return True

    async def load(self, model_id: str) -> ModelEntry:
        """Load a model now (POST /models/load, --preload), without counting it in use."""
        await self.acquire(model_id)
        entry = self.entries[model_id]
        entry.num_active -= 1
        return entry

    async def wait_unloaded(self, model_id: str) -> None:
        entry = self.entry(model_id)
        if entry._stopped is not None:
            await entry._stopped.wait()

    async def _serve(self, entry: ModelEntry, load: _Load) -> None:
        """One model's life in the set: load, serve until told to stop, drop every reference."""
        structlog.contextvars.clear_contextvars()     # this task outlives the request that started it
        log.info("model_loading", model_name=entry.model_id)
        try:
            wired = await self._build(entry)
        except Exception as exc:            # noqa: BLE001 - the daemon serves on; the waiters get the cause
            log.warning("model_load_failed", model_name=entry.model_id, error=str(exc))
            entry.state, entry.error, load.error = "unloaded", str(exc), str(exc) or type(exc).__name__
            load.exception = exc
            load.done.set()
            return
        entry._stop, entry._stopped = anyio.Event(), anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(wired.run, entry._stop)
                entry.actors, entry.state, entry.num_loads = wired, "loaded", entry.num_loads + 1
                entry.memory_bytes = entry.size_bytes + _kv_bytes(wired)
                entry.last_used = time.monotonic()
                log.info("model_loaded", model_name=entry.model_id, memory_bytes=entry.memory_bytes)
                load.done.set()
        finally:
            entry.actors, entry.state, entry.memory_bytes = None, "unloaded", 0
            wired.refresh_metrics()        # what its allocator counted since the last scrape, before it goes
            wired.metrics.unloaded()       # its gauges at zero, its kernels and cache layout no longer listed
            del wired
            gc.collect()                    # the weights' mapping and the K/V go now, not at some later cycle
            release_free_memory()           # and glibc hands the freed heap back rather than keeping it
            entry._stopped.set()
            log.info("model_unloaded", model_name=entry.model_id)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Own the loaded models' task group; unload the idle ones past their keep_alive. Cancelled to stop."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            while True:
                await anyio.sleep(REAP_INTERVAL_S)
                self.reap(time.monotonic())

    def reap(self, now: float) -> list[str]:
        """Unload every idle model whose keep_alive has passed; their ids."""
        expired = [e.model_id for e in self.loaded()
                   if e.keep_alive is not None and e.num_active == 0 and now - e.last_used >= e.keep_alive]
        return [model_id for model_id in expired if self.unload(model_id)]


def _kv_bytes(wired: ModelActors) -> int:
    served = wired.served
    return served.kv_tokens * served.kv_bytes_per_token


def parse_keep_alive(value: object) -> float | None:
    """Ollama's keep_alive: seconds (a number), or a duration ("30s", "5m", "1h"); negative: forever (None)."""
    if value is None or isinstance(value, bool):
        raise RequestError("keep_alive must be a number of seconds or a duration like '5m'", param="keep_alive")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
        text = value.strip()
        unit = next((u for u in ("ms", "s", "m", "h") if text.endswith(u)), "")
        try:
            seconds = float(text.removesuffix(unit) if unit else text) * units.get(unit, 1.0)
        except ValueError:
            raise RequestError(f"keep_alive '{value}' is not a duration (e.g. 30s, 5m, 1h)",
                               param="keep_alive") from None
    else:
        raise RequestError("keep_alive must be a number of seconds or a duration like '5m'", param="keep_alive")
    if not math.isfinite(seconds):
        raise RequestError("keep_alive must be finite", param="keep_alive")
    return None if seconds < 0 else seconds
