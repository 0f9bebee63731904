"""The encoder actor: the whole engine of an embedding model (forge.models.bert), in place of the tokenizer,
scheduler, allocator and model worker a decoder runs on.

It takes Submits and Aborts from the gateway in order, as the tokenizer does, and is the router's only
producer: each Submit is tokenized (or its ids checked) and answered Accepted or Rejected, then every
request that arrived while the last forward ran goes into the next one, padded into batches of similar
length (LoadedEncoder.embed, in a worker thread), and ends with one TextDelta carrying its vector.
Nothing is kept for a request after its delta.
"""

from __future__ import annotations

import time

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from actors.ops.metrics import ModelMetrics
from actors.runtime.stream_demux import StreamDemux
from forge.engine.pooling import vector_bytes
from forge.errors import RequestError
from forge.messages import Abort, Accepted, FlushCache, Rejected, Submit, TextDelta, TokenCounts
from forge.models.bert.encoder import LoadedEncoder

EncoderInbox = Submit | Abort | FlushCache
# Most inputs taken into one round of forwards: a burst beyond it waits for the next round.
MAX_ROUND_INPUTS = 256


class EncoderActor:
    def __init__(self, encoder: LoadedEncoder, demux: StreamDemux, metrics: ModelMetrics, *,
                 inbox: MemoryObjectReceiveStream[EncoderInbox]) -> None:
        self._encoder = encoder
        self._demux = demux
        self._metrics = metrics
        self._inbox = inbox
        self._limiter = anyio.CapacityLimiter(1)
        self._pending: dict[str, list[int]] = {}     # accepted, not yet embedded
        self._started_at: float | None = None        # the forward in flight began (monotonic)

    def tracked(self) -> dict[str, int]:
        """Sizes of the per-request tables: all zero when no request is in flight."""
        return {"encoder.pending": len(self._pending)}

    def num_waiting(self) -> int:
        return len(self._pending)

    def step_age(self) -> float:
        """Seconds the forward in flight has run (0: none): the watchdog's figure."""
        return 0.0 if self._started_at is None else time.monotonic() - self._started_at

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with self._inbox:
            task_status.started()
            while True:
                if not self._pending:
                    try:
                        self._handle(await self._inbox.receive())     # idle: park here
                    except anyio.EndOfStream:
                        return
                while len(self._pending) < MAX_ROUND_INPUTS:          # all that came meanwhile, in order
                    try:
                        self._handle(self._inbox.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                if self._pending:
                    await self._embed_round()

    def _handle(self, msg: EncoderInbox) -> None:
        match msg:
            case Submit():
                try:
                    ids = self._ids(msg)
                except RequestError as exc:
                    self._demux.deliver(Rejected.of(msg.request_id, exc))
                    return
                self._pending[msg.request_id] = ids
                self._demux.deliver(Accepted(request_id=msg.request_id, num_prompt_tokens=len(ids)))
            case Abort(request_id=rid):
                self._pending.pop(rid, None)
            case FlushCache(request_id=rid):                          # no prefix cache to forget
                self._demux.deliver(Accepted(request_id=rid, num_prompt_tokens=0))

    def _ids(self, msg: Submit) -> list[int]:
        if msg.token_ids is not None:
            return self._encoder.check_ids(msg.token_ids)
        return self._encoder.encode(msg.text or "")

    async def _embed_round(self) -> None:
        round_ids, self._pending = self._pending, {}
        self._started_at = time.monotonic()
        try:
            vectors = await anyio.to_thread.run_sync(self._encoder.embed, list(round_ids.values()),
                                                     limiter=self._limiter)
        except Exception as exc:  # noqa: BLE001 - a failed forward fails its requests, not the daemon
            for rid, ids in round_ids.items():
                self._metrics.request_failed.inc()
                self._demux.deliver(TextDelta(request_id=rid, text="", num_tokens=0,
                                               error=f"{type(exc).__name__}: {exc}",
                                               counts=TokenCounts(prompt=len(ids))))
            return
        finally:
            self._started_at = None
        for (rid, ids), vector in zip(round_ids.items(), vectors, strict=True):
            self._metrics.request_success.labels(finished_reason="stop").inc()
            self._demux.deliver(TextDelta(request_id=rid, text="", num_tokens=0, finish_reason="stop",
                                           counts=TokenCounts(prompt=len(ids)), embedding=vector_bytes(vector)))
