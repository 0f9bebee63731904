"""The daemon's lifetime: the models' actor sets, hypercorn, signals.

The HTTP server comes up first (readiness 503 while the model loads), then the models named at start
load and their actors start (one model served is a set of one: actors.runtime.model_set).
SIGTERM or SIGINT drains: readiness turns 503, new requests get 503, running ones finish within
the drain timeout, then the process exits 0. SIGHUP reloads what can change live (actors.ops.reload).
An actor that crashes takes the daemon down loudly.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus
from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig

from actors.http.access_log import AccessLog
from actors.http.gateway import Gateway, GatewayConfig
from actors.ops.metrics import Metrics
from actors.ops.reload import LiveSettings, Reloader, ReloadSource
from actors.ops.systemd_notify import Notifier, Report, run_reports, watchdog_interval
from actors.runtime.allocator_actor import AllocatorActor
from actors.runtime.encoder_actor import EncoderActor
from actors.runtime.kv_publisher import KvEventPublisher, KvEventsConfig
from actors.runtime.model_actors import ModelActors, wire_actors, wire_encoder
from actors.runtime.model_set import DEFAULT_TURN_AFTER_S, ModelEntry, ModelSet
from actors.runtime.scheduler_actor import SchedulerActor
from forge.config import EngineConfig
from forge.engine.assembly import EngineParts, build_engine
from forge.errors import CapacityError, ForgeError, RequestError
from forge.models.bert.encoder import LoadedEncoder
from forge.models.loading import LoadedModel, load_draft, load_served
from forge.sampling.structured import Grammars

log = structlog.get_logger("forge.supervisor")

# After the drain timeout, how long the responses that were ended get to write their last frames.
FINAL_WRITE_S = 2.0


@dataclass(slots=True)
class DaemonConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    model: str | None = None                  # a GGUF path; None: the default model
    drain_timeout: float = 30.0
    # Several models (forge serve --model A --model B, --models-dir): each loaded on demand, in its own
    # actor set; empty: the one model above, as always.
    models: list[ModelEntry] = field(default_factory=list)
    max_loaded_models: int | None = None
    models_memory: int | None = None          # bytes of weights + K/V the loaded models may hold
    model_turn_wait: float = DEFAULT_TURN_AFTER_S   # seconds a model waits for room before a busy one yields
    preload: list[str] = field(default_factory=list)
    kv_events: KvEventsConfig | None = None   # publish the prefix cache's KV events (actors.runtime.kv_publisher)
    # Listening on a socket systemd handed over (forge.socket), which stays open between forge processes:
    # accept only once the models serve and stop when a drain starts, so that connections wait in the kernel's
    # backlog for a process that serves them instead of getting 503 "loading" or "draining".
    handed_socket: bool = False
    api_keys_file: str | None = None          # the tenant file (gateway.tenants is its reading): re-read on SIGHUP
    log_level: str = "info"
    keep_alive: list[str] = field(default_factory=list)     # --keep-alive values, as given
    reload_source: ReloadSource = field(default_factory=ReloadSource)   # what SIGHUP reads (actors.ops.reload)


class Daemon:
    """Owns the gateway and the models' actor sets (one model served is a set of one). `run` serves until
    drained or crashed."""

    def __init__(self, config: DaemonConfig, loaded: LoadedModel | LoadedEncoder | None = None) -> None:
        """`loaded`: the one model, already loaded (tests and embedding), served in place of `config.model`."""
        self.config = config
        self.metrics = Metrics()
        self.gateway = Gateway(config.gateway, self.metrics)
        self._preloaded = loaded
        self.kv_publisher: KvEventPublisher | None = None
        self.models: ModelSet | None = None         # the models served, each loaded on demand or at start
        self._cores = anyio.CapacityLimiter(1)      # the models' steps take turns on the cores (worker_actor)
        self._stop = anyio.Event()
        self.is_started = anyio.Event()
        self.draining = anyio.Event()
        self.notifier = Notifier.from_env()         # systemd's notify socket (Type=notify); inert without one
        live = LiveSettings(api_key=config.gateway.api_key, api_keys_file=config.api_keys_file,
                            log_level=config.log_level, keep_alive=tuple(config.keep_alive),
                            max_loaded_models=config.max_loaded_models, models_memory=config.models_memory)
        self.reloader = Reloader(live, config.reload_source, tenants=self.gateway.tenants, notifier=self.notifier,
                                 models=lambda: self.models, several=bool(config.models))

    def app(self) -> Any:
        return AccessLog(self.gateway.app())

    def _recent(self) -> ModelActors | None:
        """The loaded model's actors used last (with one model: its actors, once loaded)."""
        recent = self.models.most_recent() if self.models is not None else None
        return recent.actors if recent is not None else None

    @property
    def scheduler(self) -> SchedulerActor | None:
        actors = self._recent()
        return actors.scheduler if actors is not None else None

    @property
    def allocator(self) -> AllocatorActor | None:
        actors = self._recent()
        return actors.allocator if actors is not None else None

    @property
    def encoder(self) -> EncoderActor | None:
        actors = self._recent()
        return actors.encoder if actors is not None else None

    def tracked(self) -> dict[str, int]:
        """Sizes of every per-request table in the gateway and the actors: all zero when idle.

        A daemon that runs for weeks must keep nothing for a request after it ends. With several models
        each table's key is prefixed by its model's id.
        """
        sizes = {"gateway.inflight": self.gateway.admission.num_inflight}
        if self.models is not None:
            loaded = self.models.loaded()
            for entry in loaded:
                assert entry.actors is not None
                prefix = f"{entry.model_id}:" if len(self.models.entries) > 1 else ""
                sizes.update({prefix + k: v for k, v in entry.actors.tracked().items()})
        return sizes

    def request_drain(self) -> None:
        """Begin a graceful stop (what SIGTERM does)."""
        if not self.gateway.is_draining:
            log.info("draining", inflight=self.gateway.admission.num_inflight)
            self.gateway.is_draining = True
            self.notifier.send("STOPPING=1", f"STATUS=draining: {self.gateway.admission.num_inflight} in flight")
            if self.models is not None:           # requests still waiting for a model's load will not get it
                self.models.fail_waiters(CapacityError("the server is shutting down", code="draining",
                                                       retry_after_s=self.config.gateway.retry_after_s))
        self.draining.set()
        self._stop.set()

    def _entries(self) -> tuple[list[ModelEntry], list[str]]:
        """The models served and those loaded at start: the several of --model/--models-dir, or the one
        model as a set of one, loaded at start (its failure to load fails the start)."""
        cfg = self.config
        if cfg.models:
            return cfg.models, cfg.preload
        source = self._preloaded.path if self._preloaded is not None else cfg.model
        sole = ModelEntry(model_id=cfg.gateway.served_model_name, source=source)
        return [sole], [sole.model_id]

    async def run_actors(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve the models (those named at start loaded off the loop first) until the channels close.
        The KV-event socket is bound first, so that an endpoint in use fails the start before a model loads."""
        cfg = self.config
        entries, preload = self._entries()
        if cfg.kv_events is not None:
            if len(entries) > 1:
                raise ForgeError("--kv-events publishes one prefix cache: serve one model with it")
            self.kv_publisher = self.gateway.fleet.kv_publisher = KvEventPublisher(cfg.kv_events)
        models = ModelSet(entries, self._build, max_loaded=cfg.max_loaded_models, max_memory=cfg.models_memory,
                          retry_after_s=cfg.gateway.retry_after_s, turn_after_s=cfg.model_turn_wait,
                          on_swap=lambda model_id: self.metrics.model_swaps.labels(model_name=model_id).inc())
        self.models = models
        publisher = self.kv_publisher

        def refresh() -> None:                    # each loaded model's gauges and cache counters
            for entry in models.loaded():
                if entry.actors is not None:
                    entry.actors.refresh_metrics()

        self.metrics.on_scrape(refresh)
        try:
            async with anyio.create_task_group() as tg:
                if self.notifier.enabled:
                    tg.start_soon(lambda: run_reports(self.notifier, self._systemd_report,
                                                      watchdog_s=watchdog_interval()))
                await tg.start(models.run)
                for model_id in preload:
                    try:
                        await models.load(model_id)
                    except RequestError as exc:
                        if not cfg.models and exc.__cause__ is not None:   # the one model: nothing to serve
                            raise exc.__cause__ from None
                        log.error("preload_failed", model_name=model_id, error=str(exc))   # the others serve
                self.gateway.model_set = models       # until now /healthz and requests answer 503 loading
                tg.start_soon(self.gateway.stats.run_sampler)
                await self._serve_until_stopped({"models": list(models.entries)}, task_status)
                tg.cancel_scope.cancel()
        finally:
            self.notifier.close()
            if publisher is not None:
                publisher.close()

    def _systemd_report(self) -> Report:
        """What systemd is told every few seconds: STATUS=, whether a step is stuck, whether models load."""
        tokens = sum(s.value for m in self.metrics.generation_tokens.collect() for s in m.samples
                     if s.name.endswith("_total"))
        stuck = self.gateway.stuck_step_s()
        models = self.models
        loading = self.gateway.model_set is None and not self.gateway.is_draining
        names = ", ".join(models.entries) if models is not None else self.config.gateway.served_model_name
        if stuck is not None:
            status = f"step stuck for {stuck:.0f}s (watchdog pings stopped): {names}"
        elif self.gateway.is_draining:
            status = f"draining: {self.gateway.admission.num_inflight} in flight"
        elif loading:
            status = f"loading {names}"
        else:
            assert models is not None
            stats = [e.actors.scheduler.statistics() for e in models.loaded()
                     if e.actors is not None and e.actors.scheduler is not None]
            loaded = [e.model_id for e in models.loaded()]
            shown = (names if len(models.entries) == 1
                     else f"{len(loaded)} of {len(models.entries)} loaded ({', '.join(loaded)})")
            status = (f"serving {shown}: {sum(c.num_running for c in stats)} running, "
                      f"{sum(c.num_waiting for c in stats)} waiting")
        return Report(status=status, serving=stuck is None and not loading and not self.gateway.is_draining,
                      loading=loading, stuck=stuck is not None, generation_tokens=tokens)

    async def _build(self, entry: ModelEntry) -> ModelActors:
        """Load one model off the loop and wire its actors (ModelSet calls this for each load)."""
        cfg = self.config.engine
        publisher = self.kv_publisher
        if publisher is not None:
            cfg = dataclasses.replace(cfg, record_kv_events=True)
        preloaded, self._preloaded = self._preloaded, None      # given once: a reload reads the file

        def build() -> ModelActors:
            loaded = preloaded or load_served(entry.source, kernels=cfg.kernels, numerics=cfg.numerics,
                                              progress=_progress)
            if isinstance(loaded, LoadedEncoder):
                return wire_encoder(loaded, cfg, self.metrics, served_model_name=entry.model_id)
            draft = load_draft(loaded, cfg, _progress)
            parts = build_engine(loaded, cfg, draft,
                                 warn=lambda reason: log.warning("kv_disk_tier_off", model_name=entry.model_id,
                                                                 reason=reason))
            if parts.plan.warning is not None:
                log.warning("kv_cache_short", model_name=entry.model_id, reason=parts.plan.warning)
            return wire_actors(loaded, cfg, parts, self.metrics, served_model_name=entry.model_id,
                               edge_grammars=edge_grammars(loaded, parts), draft=draft, publisher=publisher,
                               cores=self._cores)

        wired = await anyio.to_thread.run_sync(build)
        self.metrics.model_loads.labels(model_name=entry.model_id).inc()
        log.info("model_ready", **msgspec.structs.asdict(wired.served))
        return wired

    async def _serve_until_stopped(self, ready: dict[str, Any], task_status: TaskStatus[None]) -> None:
        log.info("ready", **ready)
        self.notifier.send("READY=1", f"STATUS=ready: {', '.join(ready['models'])}")
        task_status.started()
        self.is_started.set()
        await self._stop.wait()
        await self._drain()
        self.gateway.model_set = None
        log.info("stopped", inflight=self.gateway.admission.num_inflight)

    async def _drain(self) -> None:
        with anyio.move_on_after(self.config.drain_timeout) as scope:
            await self.gateway.admission.wait_idle()
        if scope.cancelled_caught:
            # Responses still running end properly, never cut off: a stream with an error event and
            # [DONE], a body not yet sent with a 503 (code "shutdown": send it again).
            ended = sum(actors.handle.demux.fail_all() for actors in self.gateway.resolver.loaded())
            log.warning("drain_timeout", inflight=self.gateway.admission.num_inflight, responses_ended=ended)
            with anyio.move_on_after(FINAL_WRITE_S):
                await self.gateway.admission.wait_idle()


def edge_grammars(loaded: LoadedModel, parts: EngineParts) -> Grammars:
    """The gateway checks constraints at the edge with a grammar engine of its own over the model's
    vocabulary; the worker's makes the matchers. No mutable object is shared between them: the edge's
    is the worker's sibling (Grammars.sibling), sharing only the vocabulary llguidance built once."""
    worker = parts.runner.grammars
    return worker.sibling() if worker is not None else Grammars(loaded.tokenizer)


def _progress(message: str) -> None:
    log.info("model", message=message)


def hypercorn_config(bind: str | None = None, fd: int | None = None) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"fd://{fd}"] if fd is not None else [bind or "127.0.0.1:8080"]
    config.accesslog = None
    config.errorlog = None
    config.keep_alive_timeout = 75
    config.graceful_timeout = 5
    return config


async def serve_daemon(daemon: Daemon, config: HypercornConfig, *, handle_signals: bool = True) -> None:
    """Serve HTTP and run the actors until drained. Raises if the model cannot load or an actor
    crashes, after hypercorn has shut down on its own."""
    http_stop = anyio.Event()
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        gate, accepting = anyio.CancelScope(), anyio.CancelScope()

        async def http() -> None:
            if daemon.config.handed_socket:
                with gate:                          # connections queue in the handed socket until ready
                    await daemon.is_started.wait()
                if gate.cancel_called:
                    return
            await serve(daemon.app(), config, shutdown_trigger=http_stop.wait)

        tg.start_soon(http)
        if daemon.config.handed_socket:
            async def stop_accepting() -> None:     # the handed socket stays open in systemd: connections queue
                with accepting:
                    await daemon.draining.wait()
                    http_stop.set()

            tg.start_soon(stop_accepting)
        try:
            async with anyio.create_task_group() as signals:
                if handle_signals:
                    signals.start_soon(_watch_signals, daemon)
                await daemon.run_actors()
                signals.cancel_scope.cancel()
        except Exception as exc:                  # re-raised below, once hypercorn has stopped
            failure = exc
        finally:
            http_stop.set()
            gate.cancel()
            accepting.cancel()
        # hypercorn now closes its connections on its own (graceful_timeout). Cancelling it instead
        # (as an exception leaving this task group would) breaks its shutdown: an InvalidStateError
        # mid-drain, or a stray traceback at exit when a model fails to load during its start-up.
    if failure is not None:
        raise failure


async def _watch_signals(daemon: Daemon) -> None:
    """SIGTERM, SIGINT: drain and stop. SIGHUP: reload (actors.ops.reload), streams untouched."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal", signal=signal.Signals(signum).name)
            if signum == signal.SIGHUP:
                daemon.reloader.reload()
            else:
                daemon.request_drain()


@asynccontextmanager
async def running_daemon(daemon: Daemon, *, send_buffer: int | None = None) -> AsyncIterator[str]:
    """For tests and embedding: serve on a free loopback port; yields the base URL. `send_buffer`: the
    kernel's send buffer of each connection in bytes (SO_SNDBUF, which accepted sockets take from the
    listening one), in place of the megabytes it grows to: a client that stops reading blocks the
    daemon's writes after a few KiB."""
    sock = socket.socket()
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    sock.listen()                    # connections queue from now on, even before hypercorn runs
    port = sock.getsockname()[1]
    sock.set_inheritable(True)
    config = hypercorn_config(fd=sock.detach())
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve_daemon(daemon, config, handle_signals=False))
        await daemon.is_started.wait()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            daemon.request_drain()
