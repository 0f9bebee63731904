"""The daemon's lifetime: channels, one task group for the five actors, hypercorn, signals.

The HTTP server comes up first (readiness 503 while the model loads), then the actors start.
SIGTERM or SIGINT drains: readiness turns 503, new requests get 503, running ones finish within
the drain timeout, then the process exits 0. An actor that crashes takes the daemon down loudly.
"""

from __future__ import annotations

import dataclasses
import math
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
from actors.ops.stats import Sources
from actors.runtime.allocator_actor import AllocatorActor
from actors.runtime.encoder_actor import EncoderActor, EncoderInbox
from actors.runtime.kv_publisher import KvEventPublisher, KvEventsConfig
from actors.runtime.model_actors import ModelActors, wire_actors
from actors.runtime.model_handle import ModelHandle
from actors.runtime.model_set import ModelEntry, ModelSet
from actors.runtime.scheduler_actor import SchedulerActor
from actors.runtime.stream_demux import StreamDemux
from actors.runtime.tokenizer_actor import TokenizerActor
from actors.runtime.worker_actor import ModelWorkerActor
from forge.config import EngineConfig
from forge.engine.assembly import EngineParts, build_engine, encoder_serving
from forge.errors import ForgeError, RequestError
from forge.models.bert.encoder import LoadedEncoder
from forge.models.llama.linear import configure_matmul
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
    preload: list[str] = field(default_factory=list)
    kv_events: KvEventsConfig | None = None   # publish the prefix cache's KV events (actors.runtime.kv_publisher)


class Daemon:
    """Owns the gateway and, once loaded, the actors. `run` serves until drained or crashed."""

    def __init__(self, config: DaemonConfig, loaded: LoadedModel | LoadedEncoder | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.gateway = Gateway(config.gateway, self.metrics)
        self.loaded = loaded
        self.tokenizer: TokenizerActor | None = None
        self.scheduler: SchedulerActor | None = None
        self.allocator: AllocatorActor | None = None
        self.worker: ModelWorkerActor | None = None
        self.encoder: EncoderActor | None = None    # an embedding model's one actor, instead of those four
        self.kv_publisher: KvEventPublisher | None = None
        self.models: ModelSet | None = None         # several models: their sets, loaded on demand
        self._cores: anyio.CapacityLimiter | None = None
        self._stop = anyio.Event()
        self.is_started = anyio.Event()

    def app(self) -> Any:
        return AccessLog(self.gateway.app())

    def tracked(self) -> dict[str, int]:
        """Sizes of every per-request table in the gateway and the actors: all zero when idle.

        A daemon that runs for weeks must keep nothing for a request after it ends.
        """
        sizes = {"gateway.inflight": self.gateway.admission.num_inflight}
        if self.gateway.handle is not None:
            sizes["demux.requests"] = len(self.gateway.handle.demux)
        for actor in (self.tokenizer, self.scheduler, self.allocator, self.worker, self.encoder):
            if actor is not None:
                sizes.update(actor.tracked())
        if self.models is not None:
            for entry in self.models.loaded():
                assert entry.actors is not None
                sizes.update({f"{entry.model_id}:{k}": v for k, v in entry.actors.tracked().items()})
        return sizes

    def request_drain(self) -> None:
        """Begin a graceful stop (what SIGTERM does)."""
        if not self.gateway.is_draining:
            log.info("draining", inflight=self.gateway.admission.num_inflight)
            self.gateway.is_draining = True
        self._stop.set()

    async def run_actors(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load the model (off the loop), wire the five actors, serve until the channels close. The KV-event
        socket is bound first, so that an endpoint in use fails the start before the model loads."""
        if self.config.models:
            if self.config.kv_events is not None:
                raise ForgeError("--kv-events publishes one prefix cache: serve one model with it")
            await self._run_models(task_status=task_status)
            return
        publisher = KvEventPublisher(self.config.kv_events) if self.config.kv_events is not None else None
        try:
            await self._run_engine(publisher, task_status=task_status)
        finally:
            if publisher is not None:
                publisher.close()

    async def _run_engine(self, publisher: KvEventPublisher | None, *,
                          task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        if self.loaded is None:
            self.loaded = await anyio.to_thread.run_sync(lambda: load_served(
                self.config.model, kernels=self.config.engine.kernels, numerics=self.config.engine.numerics,
                progress=_progress))
        if isinstance(self.loaded, LoadedEncoder):
            await self._run_encoder(self.loaded, task_status=task_status)
            return
        loaded, cfg = self.loaded, self.config.engine
        if publisher is not None:
            cfg = dataclasses.replace(cfg, record_kv_events=True)
            self.gateway.fleet.kv_publisher = publisher
            self.kv_publisher = publisher
        draft = await anyio.to_thread.run_sync(lambda: load_draft(loaded, cfg, _progress))
        parts = await anyio.to_thread.run_sync(lambda: build_engine(loaded, cfg, draft))
        if parts.plan.warning is not None:
            log.warning("kv_cache_short", reason=parts.plan.warning)
        wired = wire_actors(loaded, cfg, parts, self.metrics, served_model_name=self.config.gateway.served_model_name,
                             edge_grammars=edge_grammars(loaded, parts), draft=draft, publisher=publisher)
        served = wired.served
        self.tokenizer, self.scheduler = wired.tokenizer, wired.scheduler
        self.allocator, self.worker = wired.allocator, wired.worker
        self.metrics.on_scrape(lambda: wired.refresh_metrics(publisher))
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            await tg.start(wired.run, stop)
            scheduler, allocator = wired.scheduler, wired.allocator
            self.gateway.handle = wired.handle
            self.gateway.stats.sources = Sources(
                scheduler=scheduler.statistics, cache=allocator.statistics, block_map=allocator.block_map,
                serving=msgspec.to_builtins(served))
            tg.start_soon(self.gateway.stats.run_sampler)
            await self._serve_until_stopped(msgspec.structs.asdict(served), task_status)
            stop.set()
            tg.cancel_scope.cancel()            # nothing is in flight: stop the actors

    async def _run_models(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Several models: the gateway routes each request to its model's set, loaded on demand."""
        cfg = self.config
        models = ModelSet(cfg.models, self._build_set, max_loaded=cfg.max_loaded_models,
                          max_memory=cfg.models_memory, retry_after_s=cfg.gateway.retry_after_s,
                          on_swap=lambda model_id: self.metrics.model_swaps.labels(model_name=model_id).inc())
        self.models = models
        # the models' steps take turns on the cores (actors.runtime.worker_actor)
        self._cores = anyio.CapacityLimiter(1)

        def refresh() -> None:                    # each loaded model's gauges and cache counters
            for entry in models.loaded():
                if entry.actors is not None:
                    entry.actors.refresh_metrics()

        self.metrics.on_scrape(refresh)
        async with anyio.create_task_group() as tg:
            await tg.start(models.run)
            for model_id in cfg.preload:
                try:
                    await models.load(model_id)
                except RequestError as exc:        # the daemon serves the others; requests for it get the cause
                    log.error("preload_failed", model_name=model_id, error=str(exc))
            self.gateway.model_set = models          # until now /healthz and requests answer 503 loading
            await self._serve_until_stopped({"models": list(models.entries)}, task_status)
            tg.cancel_scope.cancel()

    async def _build_set(self, entry: ModelEntry) -> ModelActors:
        """Load one model off the loop and wire its actors (ModelSet calls this for each load)."""
        cfg = self.config.engine

        def build() -> ModelActors:
            loaded = load_served(entry.source, kernels=cfg.kernels, numerics=cfg.numerics, progress=_progress)
            if isinstance(loaded, LoadedEncoder):
                raise ForgeError("an embedding model is served alone, not beside other models")
            draft = load_draft(loaded, cfg, _progress)
            parts = build_engine(loaded, cfg, draft)
            return wire_actors(loaded, cfg, parts, self.metrics, served_model_name=entry.model_id,
                               edge_grammars=edge_grammars(loaded, parts), draft=draft, cores=self._cores)

        wired = await anyio.to_thread.run_sync(build)
        self.metrics.model_loads.labels(model_name=entry.model_id).inc()
        return wired

    async def _run_encoder(self, encoder: LoadedEncoder, *,
                           task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """An embedding model: the gateway and one encoder actor, which tokenizes, batches and embeds."""
        cfg = self.config.engine
        await anyio.to_thread.run_sync(lambda: configure_matmul(cfg.matmul_strategy, cfg.blas_threads))
        served = encoder_serving(encoder, served_model_name=self.config.gateway.served_model_name)
        to_enc, enc_in = anyio.create_memory_object_stream[EncoderInbox](math.inf)
        demux = StreamDemux()
        own = self.metrics.model(served.served_model_name)
        self.encoder = actor = EncoderActor(encoder, demux, own, inbox=enc_in)
        with to_enc:
            async with anyio.create_task_group() as tg:
                await tg.start(actor.run)
                self.gateway.handle = ModelHandle(
                    demux=demux, to_tokenizer=to_enc, max_model_len=served.max_model_len,
                    load_stats=lambda: (actor.num_waiting(), 0), serving=served, metrics=own, step_age=actor.step_age,
                    load=actor.num_waiting, vocab_size=encoder.vocab_size, max_input_tokens=encoder.max_seq_length)
                await self._serve_until_stopped(msgspec.structs.asdict(served), task_status)
                tg.cancel_scope.cancel()

    async def _serve_until_stopped(self, ready: dict[str, Any], task_status: TaskStatus[None]) -> None:
        log.info("ready", **ready)
        task_status.started()
        self.is_started.set()
        await self._stop.wait()
        await self._drain()
        self.gateway.handle = None
        self.gateway.model_set = None
        log.info("stopped", inflight=self.gateway.admission.num_inflight)

    async def _drain(self) -> None:
        with anyio.move_on_after(self.config.drain_timeout) as scope:
            await self.gateway.admission.wait_idle()
        if scope.cancelled_caught:
            # Responses still running end properly, never cut off: a stream with an error event and
            # [DONE], a body not yet sent with a 503 (code "shutdown": send it again).
            pipes = [self.gateway.handle] if self.gateway.handle is not None else []
            if self.models is not None:
                pipes += [e.actors.handle for e in self.models.loaded() if e.actors is not None]
            ended = sum(pipe.demux.fail_all() for pipe in pipes)
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
        async def http() -> None:
            await serve(daemon.app(), config, shutdown_trigger=http_stop.wait)

        tg.start_soon(http)
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
        # hypercorn now closes its connections on its own (graceful_timeout). Cancelling it instead
        # (as an exception leaving this task group would) breaks its shutdown: an InvalidStateError
        # mid-drain, or a stray traceback at exit when a model fails to load during its start-up.
    if failure is not None:
        raise failure


async def _watch_signals(daemon: Daemon) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("signal", signal=signal.Signals(signum).name)
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
