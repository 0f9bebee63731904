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

from actors.access import AccessLog
from actors.allocator import AllocatorActor
from actors.encoder_actor import EncoderActor, EncoderInbox
from actors.gateway import Gateway, GatewayConfig
from actors.kv_publisher import KvEventPublisher, KvEventsConfig
from actors.metrics import Metrics
from actors.pipeline import Pipeline
from actors.router import Router
from actors.scheduler import SchedulerActor, SchedulerInbox
from actors.stats import Sources
from actors.tokeniser_actor import TokeniserActor, TokeniserInbox
from actors.worker import ModelWorkerActor
from forge.bert.encoder import LoadedEncoder
from forge.config import EngineConfig
from forge.engine import Serving, build_engine, encoder_serving, serving
from forge.llama.linear import configure_matmul
from forge.loading import LoadedModel, load_draft, load_served
from forge.messages import AllocateStep, StepAllocation, StepBatch, StepOutput
from forge.reasoning import CLOSING_TEXT
from forge.structured import Grammars

log = structlog.get_logger("forge.supervisor")

# After the drain timeout, how long the responses that were ended get to write their last frames.
FINAL_WRITE_S = 2.0


@dataclass(slots=True)
class DaemonConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    model: str | None = None                  # a GGUF path; None: the default model
    drain_timeout: float = 30.0
    kv_events: KvEventsConfig | None = None   # publish the prefix cache's KV events (actors.kv_publisher)


class Daemon:
    """Owns the gateway and, once loaded, the actors. `run` serves until drained or crashed."""

    def __init__(self, config: DaemonConfig, loaded: LoadedModel | LoadedEncoder | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.gateway = Gateway(config.gateway, self.metrics)
        self.loaded = loaded
        self.tokeniser: TokeniserActor | None = None
        self.scheduler: SchedulerActor | None = None
        self.allocator: AllocatorActor | None = None
        self.worker: ModelWorkerActor | None = None
        self.encoder: EncoderActor | None = None    # an embedding model's one actor, instead of those four
        self.kv_publisher: KvEventPublisher | None = None
        self._stop = anyio.Event()
        self.is_started = anyio.Event()

    def app(self) -> Any:
        return AccessLog(self.gateway.app())

    def tracked(self) -> dict[str, int]:
        """Sizes of every per-request table in the gateway and the actors: all zero when idle.

        A daemon that runs for weeks must keep nothing for a request after it ends.
        """
        sizes = {"gateway.inflight": self.gateway.admission.num_inflight}
        if self.gateway.pipeline is not None:
            sizes["router.requests"] = len(self.gateway.pipeline.router)
        for actor in (self.tokeniser, self.scheduler, self.allocator, self.worker, self.encoder):
            if actor is not None:
                sizes.update(actor.tracked())
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
        # The gateway checks constraints at the edge with a grammar engine of its own over the same
        # vocabulary; the worker's makes the matchers (no object is shared between actors).
        edge_grammars = await anyio.to_thread.run_sync(Grammars, loaded.tokenizer)
        served = serving(loaded, cfg, parts, served_model_name=self.config.gateway.served_model_name, draft=draft)
        # The tokeniser's and the scheduler's inboxes are unbounded: requests are bounded by
        # admission control at the gateway, and a bounded ring of actors could deadlock on itself.
        # The cache allocator actor is the only owner of the block allocator from here on.
        to_tok, tok_in = anyio.create_memory_object_stream[TokeniserInbox](math.inf)
        to_sched, sched_in = anyio.create_memory_object_stream[SchedulerInbox](math.inf)
        to_alloc, alloc_in = anyio.create_memory_object_stream[AllocateStep](1)
        alloc_out, from_alloc = anyio.create_memory_object_stream[StepAllocation](1)
        to_worker, worker_in = anyio.create_memory_object_stream[StepBatch](1)
        worker_out, from_worker = anyio.create_memory_object_stream[StepOutput](1)
        router = Router()
        self.allocator = AllocatorActor(parts.allocator, alloc_in, alloc_out, publisher=publisher)
        self.worker = ModelWorkerActor(parts.runner, worker_in, worker_out)
        self.scheduler = SchedulerActor(parts.core, self.metrics, inbox=sched_in, to_allocator=to_alloc,
                                        from_allocator=from_alloc, to_worker=to_worker,
                                        from_worker=from_worker, to_tokeniser=to_tok.clone())
        self.tokeniser = TokeniserActor(loaded.tokenizer, loaded.chat_template, router, self.metrics,
                                        inbox=tok_in, to_scheduler=to_sched)
        self._register_gauges()
        with to_tok:                            # the gateway's end: closed when the daemon stops
            async with anyio.create_task_group() as tg:
                for actor in (self.allocator, self.worker, self.scheduler, self.tokeniser):
                    await tg.start(actor.run)
                scheduler = self.scheduler
                self.gateway.pipeline = Pipeline(
                    router=router, to_tokeniser=to_tok, text_tokenizer=loaded.tokenizer,
                    chat_template=loaded.chat_template, max_model_len=served.max_model_len,
                    load_stats=lambda: (scheduler.statistics().num_waiting, scheduler.num_queued_tokens),
                    grammar_engine=edge_grammars, serving=served, step_age=scheduler.step_age,
                    vocab_size=loaded.tokenizer.vocab_size,
                    load=scheduler.load, reasoning_parser=served.reasoning_parser,
                    thinking_close_ids=tuple(loaded.tokenizer.encode(CLOSING_TEXT, add_special_tokens=False)))
                self.metrics.kernels.labels(backend=served.kernels, numerics=served.numerics,
                                            attention=served.attention).set(1)
                self.metrics.serve(model_name=served.served_model_name, block_size=served.block_size,
                                   num_blocks=served.kv_blocks, cache_dtype=served.kv_cache_dtype,
                                   prefix_caching=cfg.enable_prefix_caching,
                                   num_spec_positions=cfg.num_speculative_tokens if cfg.speculative != "off" else 0)
                allocator = self.allocator
                self.gateway.stats.sources = Sources(
                    scheduler=scheduler.statistics, cache=allocator.statistics, block_map=allocator.block_map,
                    serving=msgspec.to_builtins(served))
                tg.start_soon(self.gateway.stats.run_sampler)
                await self._serve_until_stopped(served, task_status)
                tg.cancel_scope.cancel()            # nothing is in flight: stop the actors

    async def _run_encoder(self, encoder: LoadedEncoder, *,
                           task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """An embedding model: the gateway and one encoder actor, which tokenises, batches and embeds."""
        cfg = self.config.engine
        await anyio.to_thread.run_sync(lambda: configure_matmul(cfg.matmul_strategy, cfg.blas_threads))
        served = encoder_serving(encoder, served_model_name=self.config.gateway.served_model_name)
        to_enc, enc_in = anyio.create_memory_object_stream[EncoderInbox](math.inf)
        router = Router()
        self.encoder = actor = EncoderActor(encoder, router, self.metrics, inbox=enc_in)
        with to_enc:
            async with anyio.create_task_group() as tg:
                await tg.start(actor.run)
                self.gateway.pipeline = Pipeline(
                    router=router, to_tokeniser=to_enc, max_model_len=served.max_model_len,
                    load_stats=lambda: (actor.num_waiting(), 0), serving=served, step_age=actor.step_age,
                    load=actor.num_waiting, vocab_size=encoder.vocab_size, max_input_tokens=encoder.max_seq_length)
                await self._serve_until_stopped(served, task_status)
                tg.cancel_scope.cancel()

    async def _serve_until_stopped(self, served: Serving, task_status: TaskStatus[None]) -> None:
        log.info("ready", **msgspec.structs.asdict(served))
        task_status.started()
        self.is_started.set()
        await self._stop.wait()
        await self._drain()
        self.gateway.pipeline = None
        log.info("stopped", inflight=self.gateway.admission.num_inflight)

    async def _drain(self) -> None:
        with anyio.move_on_after(self.config.drain_timeout) as scope:
            await self.gateway.admission.wait_idle()
        if scope.cancelled_caught:
            # Responses still running end properly, never cut off: a stream with an error event and
            # [DONE], a body not yet sent with a 503 (code "shutdown": send it again).
            pipe = self.gateway.pipeline
            ended = pipe.router.fail_all() if pipe is not None else 0
            log.warning("drain_timeout", inflight=self.gateway.admission.num_inflight, responses_ended=ended)
            with anyio.move_on_after(FINAL_WRITE_S):
                await self.gateway.admission.wait_idle()

    def _register_gauges(self) -> None:
        m = self.metrics
        seen: dict[str, int] = {}                  # the cache's counts at the last scrape

        def count(counter: Any, key: str, total: int) -> None:
            counter.inc(total - seen.get(key, 0))
            seen[key] = total

        def refresh() -> None:
            if self.scheduler is not None and self.allocator is not None:
                stats, cache = self.scheduler.statistics(), self.allocator.statistics()
                m.num_requests_running.set(stats.num_running)
                m.num_requests_waiting.set(stats.num_waiting)
                used = cache.num_total_blocks - cache.num_free_blocks
                m.kv_cache_usage_perc.set(used / cache.num_total_blocks if cache.num_total_blocks else 0.0)
                m.prefix_cache_hit_rate.set(cache.prefix_hit_rate)
                count(m.prefix_cache_queries, "queries", cache.prefix_queries)
                count(m.prefix_cache_hits, "hits", cache.prefix_hits)
                for reason, total in cache.prefix_misses:
                    count(m.prefix_cache_misses.labels(reason=reason), f"miss:{reason}", total)
            if self.kv_publisher is not None:
                events = self.kv_publisher.statistics()
                count(m.kv_events_published, "kv_published", events.num_published)
                count(m.kv_events_dropped, "kv_dropped", events.num_dropped)

        m.on_scrape(refresh)


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
async def running_daemon(daemon: Daemon) -> AsyncIterator[str]:
    """For tests and embedding: serve on a free loopback port; yields the base URL."""
    sock = socket.socket()
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
