"""The models one daemon serves, by id: which are loaded, loading or unloaded, and their actor sets.
One model served is a set of one, loaded at start and never unloaded unless an operator asks.

A request names its model; `acquire` gives it the model's actors, loading the model first if need be
(requests that arrive meanwhile wait for the same load). A load that would pass --max-loaded-models or
--models-memory first unloads the least recently used idle model. When no idle model can make room the
request waits for its model's turn: once a waiting model's oldest request has waited `turn_after_s`, the
loaded model that has held its place longest stops admitting (its new requests wait too), drains the
requests it has, and is unloaded; the waiting model loads. Waiting models get their turns in the order
of their oldest waiting request, so under mixed traffic the models alternate and none starves. A model
with requests in flight is never unloaded. keep_alive unloads a model idle that long. Each loaded
model's actors run in this set's task group, started and stopped here.
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
REAP_INTERVAL_S = 0.25          # how often idle models are checked against keep_alive, and waiters against the bound
# How long a model's oldest waiting request waits, with no room to load it, before a busy loaded model stops
# admitting and drains to give up its place (--model-turn-wait). Each turn costs a load (0.6-4.4 s on the
# models benchmarked): a longer bound serves more of a model's requests per turn, a shorter one answers sooner.
DEFAULT_TURN_AFTER_S = 3.0


@dataclass(slots=True)
class _Waiter:
    """A request waiting for its model: handed the model (`granted`) or failed (`error`), then `done`."""
    since: float                                  # monotonic seconds of its arrival
    done: anyio.Event = field(default_factory=anyio.Event)
    granted: bool = False
    error: RequestError | None = None
    cause: BaseException | None = None            # what the load raised (the error's cause)


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
    yielding: bool = False                        # loaded, draining to give its place to a waiting model
    num_yields: int = 0                           # turns it gave up while it had requests in flight
    loaded_at: float = 0.0                        # monotonic seconds its turn began (its load ended)
    waiters: list[_Waiter] = field(default_factory=list)     # requests waiting for it, oldest first
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

    def is_open(self) -> bool:
        """Loaded and admitting: a request for it takes it at once."""
        return self.state == "loaded" and self.actors is not None and not self.yielding


class ModelSet:
    def __init__(self, entries: list[ModelEntry], build: Build, *, max_loaded: int | None = None,
                 max_memory: int | None = None, retry_after_s: int = 5, turn_after_s: float = DEFAULT_TURN_AFTER_S,
                 on_swap: Callable[[str], None] = lambda _model_id: None) -> None:
        """`turn_after_s`: how long a waiting model's oldest request waits before a busy model yields to it;
        `on_swap`: called with the id of each model unloaded to make room for another."""
        self.entries = {e.model_id: e for e in entries}
        self._build = build
        self.max_loaded = max_loaded
        self.max_memory = max_memory
        self.turn_after_s = turn_after_s
        self._retry_after_s = retry_after_s
        self._on_swap = on_swap
        self._tg: TaskGroup | None = None
        self._refusal: RequestError | None = None     # set once draining: what a request that would wait gets
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

    def can_take(self, model_id: str) -> bool:
        """Whether a request for the model would get it now, without waiting for a load or a turn."""
        self._schedule()
        return self.entry(model_id).is_open()

    def statistics(self) -> list[dict[str, object]]:
        """Each model as /stats and the dashboard show it: state, memory, its requests (those waiting
        for its load or its turn included)."""
        out = []
        for entry in self.entries.values():
            row: dict[str, object] = {"id": entry.model_id, "num_active": entry.num_active,
                                      "num_loads": entry.num_loads, "waiting_for_load": len(entry.waiters),
                                      "yielding": entry.yielding, "num_yields": entry.num_yields,
                                      **entry.card()}
            if entry.actors is not None:
                running, waiting = entry.actors.requests()
                row.update(running=running, waiting=waiting)
            out.append(row)
        return out

    # ---- acquire / release --------------------------------------------------------------------

    async def acquire(self, model_id: str) -> ModelActors:
        """The model's actors, counted in use until `release`; waits for its load (and its turn) first if
        it is not loaded and admitting."""
        entry = self.entry(model_id)
        if self._tg is None:
            raise CapacityError("the server is starting", code="loading", retry_after_s=self._retry_after_s)
        self._schedule()
        if entry.is_open() and not entry.waiters:
            assert entry.actors is not None
            entry.num_active += 1
            entry.last_used = time.monotonic()
            return entry.actors
        if self._refusal is not None:
            raise self._refusal
        waiter = _Waiter(since=time.monotonic())
        entry.waiters.append(waiter)
        try:
            self._schedule()
            await waiter.done.wait()
        except BaseException:
            if waiter.granted:                        # handed the model as its client went away
                self.release(model_id)
            elif waiter in entry.waiters:
                entry.waiters.remove(waiter)
                self._schedule()                      # a model that yielded for it only may admit again
            raise
        if waiter.error is not None:
            raise waiter.error from waiter.cause
        assert entry.actors is not None               # granted: in use, so never unloaded since
        return entry.actors

    def release(self, model_id: str) -> None:
        entry = self.entries[model_id]
        entry.num_active -= 1
        entry.last_used = time.monotonic()
        if entry.num_active == 0 and entry.keep_alive == 0:
            self.unload(model_id)
        self._schedule()

    def fail_waiters(self, error: RequestError) -> int:
        """Fail every request waiting for a model, and those that would wait from now on (the daemon is
        draining); how many were waiting."""
        self._refusal = error
        num = 0
        for entry in self.entries.values():
            for waiter in entry.waiters:
                waiter.error = error
                waiter.done.set()
            num += len(entry.waiters)
            entry.waiters.clear()
        self._schedule()
        return num

    # ---- turns --------------------------------------------------------------------------------

    def _schedule(self, now: float | None = None) -> None:
        """Settle who loads, who yields and who is handed a model, after anything changed (an arrival, a
        release, a load or unload that ended, the clock). Waiting models are taken oldest waiter first; one
        that fits (after unloading idle models) loads now; one whose oldest request has waited turn_after_s
        makes busy models yield too. Nothing behind a waiting model that cannot load yet goes before it."""
        now = time.monotonic() if now is None else now
        self._grant_open(now)                         # a model just loaded serves its waiters before it may yield
        was_yielding = {e.model_id for e in self.entries.values() if e.yielding}
        for entry in self.entries.values():
            entry.yielding = False                    # recomputed below: the requests it yielded to may have left
        queue = sorted((e for e in self.entries.values() if e.waiters and e.state in ("unloaded", "unloading")),
                       key=lambda e: e.waiters[0].since)
        for entry in queue:
            if entry.state == "unloading" or self._tg is None:
                break
            victims = self._victims(entry, due=now - entry.waiters[0].since >= self.turn_after_s)
            if victims is None:
                break
            for victim in victims:
                victim.yielding = True
                if victim.num_active > 0 and victim.model_id not in was_yielding:
                    victim.num_yields += 1
                if victim.num_active == 0:
                    self.num_swaps += 1
                    self._on_swap(victim.model_id)
                    self.unload(victim.model_id)
            if any(v.state == "loaded" for v in victims):
                break                                 # its turn comes once they have drained
            self._start_load(entry)
        self._grant_open(now)

    def _victims(self, entry: ModelEntry, *, due: bool) -> list[ModelEntry] | None:
        """The loaded models to unload so that `entry` fits: idle ones first (least recently used first),
        then, once `due`, busy ones (the turn that began first first); None when it cannot fit yet."""
        loaded = [e for e in self.entries.values() if e.state == "loaded" and e is not entry]
        idle = sorted((e for e in loaded if e.num_active == 0 and not e.waiters), key=lambda e: e.last_used)
        busy = sorted((e for e in loaded if e.num_active > 0 or e.waiters), key=lambda e: e.loaded_at)
        candidates = idle + busy if due else idle
        chosen: list[ModelEntry] = []
        while not self._fits(entry, chosen):
            if not candidates:
                return None
            chosen.append(candidates.pop(0))
        return chosen

    def _fits(self, entry: ModelEntry, leaving: list[ModelEntry]) -> bool:
        held = [e for e in self.entries.values()
                if e.state in ("loaded", "loading") and e is not entry and e not in leaving]
        if self.max_loaded is not None and len(held) + 1 > self.max_loaded:
            return False
        if self.max_memory is not None:
            used = sum(e.memory_bytes or e.size_bytes for e in held)
            return not held or used + entry.size_bytes <= self.max_memory
        return True

    def _grant_open(self, now: float) -> None:
        """Hand each loaded, admitting model to every request waiting for it."""
        for entry in self.entries.values():
            if entry.is_open() and entry.waiters:
                entry.num_active += len(entry.waiters)
                entry.last_used = now
                for waiter in entry.waiters:
                    waiter.granted = True
                    waiter.done.set()
                entry.waiters.clear()

    # ---- load / unload ------------------------------------------------------------------------

    def _start_load(self, entry: ModelEntry) -> None:
        assert self._tg is not None
        entry.state, entry.error = "loading", None
        self._tg.start_soon(self._serve, entry)

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
        self._schedule()
        return entry

    async def wait_unloaded(self, model_id: str) -> None:
        entry = self.entry(model_id)
        if entry._stopped is not None:
            await entry._stopped.wait()

    async def _serve(self, entry: ModelEntry) -> None:
        """One model's life in the set: load, serve until told to stop, drop every reference."""
        structlog.contextvars.clear_contextvars()     # this task outlives the request that started it
        log.info("model_loading", model_name=entry.model_id, waiting=len(entry.waiters))
        try:
            wired = await self._build(entry)
        except Exception as exc:            # noqa: BLE001 - the daemon serves on; the waiters get the cause
            log.warning("model_load_failed", model_name=entry.model_id, error=str(exc))
            entry.state, entry.error = "unloaded", str(exc)
            error = RequestError(f"the model '{entry.model_id}' failed to load: {str(exc) or type(exc).__name__}",
                                 param="model", status=500, type="server_error", code="model_load_failed")
            for waiter in entry.waiters:
                waiter.error, waiter.cause = error, exc
                waiter.done.set()
            entry.waiters.clear()
            self._schedule()
            return
        entry._stop, entry._stopped = anyio.Event(), anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(wired.run, entry._stop)
                entry.actors, entry.state, entry.num_loads = wired, "loaded", entry.num_loads + 1
                entry.memory_bytes = entry.size_bytes + _kv_bytes(wired)
                entry.last_used = entry.loaded_at = time.monotonic()
                log.info("model_loaded", model_name=entry.model_id, memory_bytes=entry.memory_bytes)
                self._schedule()                      # its waiters take it
        finally:
            entry.actors, entry.state, entry.memory_bytes, entry.yielding = None, "unloaded", 0, False
            wired.refresh_metrics()        # what its allocator counted since the last scrape, before it goes
            wired.metrics.unloaded()       # its gauges at zero, its kernels and cache layout no longer listed
            del wired
            gc.collect()                    # the weights' mapping and the K/V go now, not at some later cycle
            release_free_memory()           # and glibc hands the freed heap back rather than keeping it
            entry._stopped.set()
            log.info("model_unloaded", model_name=entry.model_id)
            self._schedule()                # the next waiting model's turn

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Own the loaded models' task group; unload the idle ones past their keep_alive, and give waiting
        models their turns as their requests pass the bound. Cancelled to stop."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            try:
                while True:
                    await anyio.sleep(REAP_INTERVAL_S)
                    now = time.monotonic()
                    self.reap(now)
                    self._schedule(now)
            finally:
                self._tg = None

    def reap(self, now: float) -> list[str]:
        """Unload every idle model whose keep_alive has passed; their ids."""
        expired = [e.model_id for e in self.loaded()
                   if e.keep_alive is not None and e.num_active == 0 and not e.waiters
                   and now - e.last_used >= e.keep_alive]
        return [model_id for model_id in expired if self.unload(model_id)]


def _kv_bytes(wired: ModelActors) -> int:
    served = wired.served
    return served.kv_tokens * served.kv_bytes_per_token


FOREVER_S = 100 * 365 * 86400.0          # a keep_alive this long is forever


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
    # negative, or longer than any daemon runs (a deadline past it would overflow a clock's time_t): forever
    return None if seconds < 0 or seconds >= FOREVER_S else seconds
