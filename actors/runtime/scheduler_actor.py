"""The scheduler actor: the continuous-batching loop, as its own task.

Each iteration drains the inbox (new requests, aborts), asks the allocator for blocks, hands the
batch to the model worker and routes the sampled tokens to the tokenizer. It parks on its inbox
only when there is nothing to run, and it never awaits a client.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.ops.metrics import ModelMetrics
from forge.engine.core import CoreStats, EngineCore
from forge.errors import RequestError
from forge.messages import (
    Abort,
    Accepted,
    AllocateStep,
    FlushCache,
    Rejected,
    StepAllocation,
    StepBatch,
    StepOutput,
    Tokenized,
    TokensEmitted,
)

SchedulerInbox = Tokenized | Abort | FlushCache
ToTokenizer = Accepted | Rejected | TokensEmitted

log = structlog.get_logger("forge.scheduler")


@dataclass(frozen=True, slots=True)
class _Totals:
    """The core's running totals that feed counters, as last carried into them."""
    preemptions: int = 0
    fair_preemptions: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: tuple[int, ...] = ()


class SchedulerActor:
    def __init__(self, core: EngineCore, metrics: ModelMetrics, *,
                 inbox: MemoryObjectReceiveStream[SchedulerInbox],
                 to_allocator: MemoryObjectSendStream[AllocateStep],
                 from_allocator: MemoryObjectReceiveStream[StepAllocation],
                 to_worker: MemoryObjectSendStream[StepBatch],
                 from_worker: MemoryObjectReceiveStream[StepOutput],
                 to_tokenizer: MemoryObjectSendStream[ToTokenizer]) -> None:
        self._core = core
        self._metrics = metrics
        self._inbox = inbox
        self._to_allocator, self._from_allocator = to_allocator, from_allocator
        self._to_worker, self._from_worker = to_worker, from_worker
        self._to_tokenizer = to_tokenizer
        self._arrivals: dict[int, float] = {}        # seq id -> arrival, until first scheduled
        self._rids: dict[str, int] = {}
        self._num_queued_tokens = 0
        self._step_started: float | None = None     # monotonic time the step in flight was sent
        self._queued: dict[int, int] = {}            # seq id -> prompt tokens, while waiting
        self._seen = _Totals()                       # the core's running totals at the last count

    def statistics(self) -> CoreStats:
        return self._core.stats()

    def load(self) -> int:
        """Sequences running and waiting: what a router's /get_load compares across replicas."""
        stats = self._core.stats()
        return stats.num_running + stats.num_waiting

    def tracked(self) -> dict[str, int]:
        """Sizes of the per-request tables here and in the core: all zero when nothing is in flight."""
        return {"scheduler.arrivals": len(self._arrivals), "scheduler.rids": len(self._rids),
                "scheduler.queued": len(self._queued), **self._core.tracked()}

    @property
    def num_queued_tokens(self) -> int:
        return self._num_queued_tokens

    def step_age(self) -> float:
        """Seconds the step in flight has been running (0.0 between steps): the watchdog's reading."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with (self._inbox, self._to_allocator, self._from_allocator, self._to_worker,
                    self._from_worker, self._to_tokenizer):
            task_status.started()
            while True:
                if not self._core.has_work():
                    try:
                        await self._handle(await self._inbox.receive())   # idle: park here
                    except anyio.EndOfStream:
                        return
                while True:                                               # requests land between steps
                    try:
                        await self._handle(self._inbox.receive_nowait())
                    except anyio.WouldBlock:
                        break
                    except anyio.EndOfStream:
                        return
                if self._core.has_work():
                    await self._step()

    async def _handle(self, msg: SchedulerInbox) -> None:
        match msg:
            case Tokenized(request_id=rid, prompt_ids=ids, params=params):
                try:
                    seq_id = self._core.add_request(rid, list(ids), params)
                except RequestError as exc:
                    await self._to_tokenizer.send(Rejected.of(rid, exc))
                    return
                self._arrivals[seq_id] = time.monotonic()
                self._rids[rid] = seq_id
                self._queued[seq_id] = len(ids)
                self._num_queued_tokens += len(ids)
                self._metrics.prompt_tokens.inc(len(ids))
                await self._to_tokenizer.send(Accepted(request_id=rid, num_prompt_tokens=len(ids)))
            case FlushCache(request_id=rid):
                # Between steps the allocator is free: one exchange with no asks, then the answer.
                await self._to_allocator.send(AllocateStep(frees=(), asks=(), admit_budget=0, flush_prefix_cache=True))
                flushed = await self._from_allocator.receive()
                log.info("prefix_cache_flushed", blocks=flushed.num_flushed)
                await self._to_tokenizer.send(Accepted(request_id=rid, num_prompt_tokens=0))
            case Abort(request_id=rid, by_client=by_client):
                # It comes behind its own Tokenized; unknown here, the request already ended.
                aborted = self._rids.pop(rid, None)
                if aborted is not None:
                    phase = self._core.phase(rid)
                    if by_client and phase is not None:
                        self._metrics.request_aborted.labels(phase=phase).inc()
                    self._core.abort(rid)
                    self._dequeue(aborted)

    async def _step(self) -> None:
        await self._to_allocator.send(self._core.propose())
        batch = self._core.build(await self._from_allocator.receive())
        now = time.monotonic()
        for new in batch.new_seqs:
            arrival = self._arrivals.pop(new.seq_id, None)
            if arrival is not None:
                self._metrics.request_queue_time.observe(now - arrival)
            self._dequeue(new.seq_id)
        started = self._step_started = time.monotonic()
        try:
            await self._to_worker.send(batch)
            output = await self._from_worker.receive()
        finally:
            self._step_started = None
        if batch.chunks:
            self._metrics.step_duration.observe(time.monotonic() - started)
            self._metrics.iteration_tokens.observe(sum(len(c.token_ids) for c in batch.chunks))
        if output.step_id != batch.step_id:
            raise RuntimeError(f"step {output.step_id} answered step {batch.step_id}")
        events = self._core.apply(output)
        if output.failed:
            log.error("step_failed", error=output.error, num_sequences=len(output.failed),
                      request_ids=[e.request_id for e in events if e.error is not None])
        # Counted before the events go on: a client that has read its last token finds it in /metrics.
        self._metrics.generation_tokens.inc(len(output.sampled))
        self._count_totals()
        for event in events:
            if event.finish_reason is not None or event.error is not None:
                self._rids.pop(event.request_id, None)
            await self._to_tokenizer.send(event)

    def _count_totals(self) -> None:
        """Carry the core's running totals (preemptions, made in build(); speculation's, in apply()) into
        the counters by what they gained since the last count: whichever phase of the step counts them."""
        m, seen, spec = self._metrics, self._seen, self._core.spec
        sched = self._core.scheduler
        now = _Totals(sched.num_preemptions, sched.num_fair_preemptions, spec.num_drafts, spec.num_draft_tokens,
                      spec.num_accepted_tokens, tuple(spec.accepted_per_position))
        if now == seen:
            return
        m.num_preemptions.inc(now.preemptions - seen.preemptions)
        m.fair_preemptions.inc(now.fair_preemptions - seen.fair_preemptions)
        m.spec_num_drafts.inc(now.drafts - seen.drafts)
        m.spec_num_draft_tokens.inc(now.draft_tokens - seen.draft_tokens)
        m.spec_num_accepted_tokens.inc(now.accepted - seen.accepted)
        for pos, total in enumerate(now.accepted_per_pos):
            before = seen.accepted_per_pos[pos] if pos < len(seen.accepted_per_pos) else 0
            if total != before:
                m.spec_accepted_per_pos.labels(position=str(pos)).inc(total - before)
        self._seen = now

    def _dequeue(self, seq_id: int) -> None:
        self._arrivals.pop(seq_id, None)
        self._num_queued_tokens -= self._queued.pop(seq_id, 0)
