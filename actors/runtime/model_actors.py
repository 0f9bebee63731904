"""One loaded model's actors, wired by channels, and the ModelHandle the gateway talks to them through:
a generation model's tokenizer, scheduler, cache allocator and model worker (`wire_actors`), or an
embedding model's one encoder actor (`wire_encoder`).

The supervisor builds one set per loaded model (one model served is a set of one) and runs it in its
own task group; stopping the set (closing the gateway's end of the first actor's inbox and cancelling
the group) drops every reference to the model's weights and K/V, so they are freed. Nothing here is
shared between two sets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus

from actors.ops.metrics import Metrics, ModelMetrics
from actors.runtime.allocator_actor import AllocatorActor
from actors.runtime.encoder_actor import EncoderActor, EncoderInbox
from actors.runtime.kv_publisher import KvEventPublisher
from actors.runtime.model_handle import ModelHandle
from actors.runtime.scheduler_actor import SchedulerActor, SchedulerInbox
from actors.runtime.stream_demux import StreamDemux
from actors.runtime.tokenizer_actor import TokenizerActor, TokenizerInbox
from actors.runtime.worker_actor import ModelWorkerActor
from forge.config import EngineConfig
from forge.engine.assembly import EngineParts, Serving, encoder_serving, serving
from forge.messages import AllocateStep, StepAllocation, StepBatch, StepOutput
from forge.models.bert.encoder import LoadedEncoder
from forge.models.llama.linear import configure_matmul
from forge.models.loading import LoadedModel
from forge.sampling.reasoning import CLOSING_TEXT
from forge.sampling.structured import Grammars


@dataclass(slots=True)
class ModelActors:
    """One model's actors and the handle over them; `run` serves until `stop`. A generation model has the
    four (tokenizer, scheduler, allocator, worker), an embedding model the encoder alone."""
    served: Serving
    handle: ModelHandle
    metrics: ModelMetrics
    tokenizer: TokenizerActor | None = None
    scheduler: SchedulerActor | None = None
    allocator: AllocatorActor | None = None
    worker: ModelWorkerActor | None = None
    encoder: EncoderActor | None = None
    publisher: KvEventPublisher | None = None     # where its allocator sends KV events (--kv-events)

    def _actors(self) -> list[TokenizerActor | SchedulerActor | AllocatorActor | ModelWorkerActor | EncoderActor]:
        """Its actors in start order: each one's peers downstream are running before it."""
        return [a for a in (self.allocator, self.worker, self.scheduler, self.tokenizer, self.encoder) if a is not None]

    def refresh_metrics(self) -> None:
        """Its gauges and cache counters (and its KV events') up to date (a scrape's first step, and its last
        as it unloads)."""
        if self.scheduler is not None and self.allocator is not None:
            publisher = self.publisher
            tier = self.allocator.tier
            self.metrics.refresh(self.scheduler.statistics(), self.allocator.statistics(),
                                 publisher.statistics() if publisher is not None else None)
            if tier is not None:
                self.metrics.refresh_disk(tier.stats(), tier.take_read_seconds())

    def requests(self) -> tuple[int, int]:
        """(running, waiting): its sequences in the engine, or the encoder's inputs not yet embedded."""
        if self.scheduler is not None:
            core = self.scheduler.statistics()
            return core.num_running, core.num_waiting
        return 0, self.encoder.num_waiting() if self.encoder is not None else 0

    def tracked(self) -> dict[str, int]:
        sizes = {"demux.requests": len(self.handle.demux)}
        for actor in self._actors():
            sizes.update(actor.tracked())
        return sizes

    async def run(self, stop: anyio.Event, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start its actors, report started, serve until `stop` is set, then stop them."""
        try:
            with self.handle.to_tokenizer:          # the gateway's end: closed when the set stops
                async with anyio.create_task_group() as tg:
                    for actor in self._actors():
                        await tg.start(actor.run)
                    task_status.started()
                    await stop.wait()
                    tg.cancel_scope.cancel()            # nothing is in flight: stop the actors
        finally:                                    # no step runs now: the disk tier keeps what RAM holds
            if self.allocator is not None and self.allocator.tier is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self.allocator.close_tier)


def wire_actors(loaded: LoadedModel, cfg: EngineConfig, parts: EngineParts, metrics: Metrics, *,
                served_model_name: str, edge_grammars: Grammars, draft: LoadedModel | None,
                publisher: KvEventPublisher | None = None, cores: anyio.CapacityLimiter | None = None) -> ModelActors:
    """The channels and actors of one model over its engine parts (forge.engine.assembly.build_engine); `publisher`:
    where the allocator sends its KV events (--kv-events); `cores`: the turn its worker's steps take with
    the other models' (actors.runtime.worker_actor)."""
    served = serving(loaded, cfg, parts, served_model_name=served_model_name, draft=draft)
    own = metrics.model(served_model_name,
                        num_spec_positions=cfg.num_speculative_tokens if cfg.speculative != "off" else 0)
    own.describe(kernels=served.kernels, numerics=served.numerics, attention=served.attention,
                 block_size=served.block_size, num_blocks=served.kv_blocks, cache_dtype=served.kv_cache_dtype,
                 prefix_caching=cfg.enable_prefix_caching)
    # The tokenizer's and the scheduler's inboxes are unbounded: requests are bounded by
    # admission control at the gateway, and a bounded ring of actors could deadlock on itself.
    # The cache allocator actor is the only owner of the block allocator from here on.
    to_tok, tok_in = anyio.create_memory_object_stream[TokenizerInbox](math.inf)
    to_sched, sched_in = anyio.create_memory_object_stream[SchedulerInbox](math.inf)
    to_alloc, alloc_in = anyio.create_memory_object_stream[AllocateStep](1)
    alloc_out, from_alloc = anyio.create_memory_object_stream[StepAllocation](1)
    to_worker, worker_in = anyio.create_memory_object_stream[StepBatch](1)
    worker_out, from_worker = anyio.create_memory_object_stream[StepOutput](1)
    demux = StreamDemux()
    allocator = AllocatorActor(parts.allocator, alloc_in, alloc_out, publisher=publisher, tier=parts.tier)
    worker = ModelWorkerActor(parts.runner, worker_in, worker_out, cores=cores)
    scheduler = SchedulerActor(parts.core, own, inbox=sched_in, to_allocator=to_alloc,
                               from_allocator=from_alloc, to_worker=to_worker,
                               from_worker=from_worker, to_tokenizer=to_tok.clone())
    tokenizer = TokenizerActor(loaded.tokenizer, loaded.chat_template, demux, own,
                               inbox=tok_in, to_scheduler=to_sched, max_model_len=served.max_model_len)
    handle = ModelHandle(
        demux=demux, to_tokenizer=to_tok, text_tokenizer=loaded.tokenizer,
        chat_template=loaded.chat_template, max_model_len=served.max_model_len,
        load_stats=lambda: (scheduler.statistics().num_waiting, scheduler.num_queued_tokens),
        grammar_engine=edge_grammars, serving=served, metrics=own, step_age=scheduler.step_age,
        vocab_size=loaded.tokenizer.vocab_size,
        load=scheduler.load, reasoning_parser=served.reasoning_parser,
        thinking_close_ids=tuple(loaded.tokenizer.encode(CLOSING_TEXT, add_special_tokens=False)))
    return ModelActors(served=served, handle=handle, tokenizer=tokenizer, scheduler=scheduler,
                       allocator=allocator, worker=worker, metrics=own, publisher=publisher)


def wire_encoder(encoder: LoadedEncoder, cfg: EngineConfig, metrics: Metrics, *,
                 served_model_name: str) -> ModelActors:
    """An embedding model's one actor, which tokenizes, batches and embeds, and its handle."""
    configure_matmul(cfg.matmul_strategy, cfg.blas_threads)
    served = encoder_serving(encoder, served_model_name=served_model_name)
    to_enc, enc_in = anyio.create_memory_object_stream[EncoderInbox](math.inf)
    demux = StreamDemux()
    own = metrics.model(served_model_name)
    actor = EncoderActor(encoder, demux, own, inbox=enc_in)
    handle = ModelHandle(
        demux=demux, to_tokenizer=to_enc, max_model_len=served.max_model_len,
        load_stats=lambda: (actor.num_waiting(), 0), serving=served, metrics=own, step_age=actor.step_age,
        load=actor.num_waiting, vocab_size=encoder.vocab_size, max_input_tokens=encoder.max_seq_length)
    return ModelActors(served=served, handle=handle, metrics=own, encoder=actor)
