"""Per-request streams from the pipeline to the gateway, routed by request id.

A response may carry several choices (n > 1, or a list of prompts); each choice is one request in
the engine, and the response reads them as one ResponseGroup. Delivery never blocks the producer:
text the reader has not taken yet is coalesced per choice, so a slow or stalled client costs only
its own output (bounded by max_tokens) and never slows the batching loop or other requests.
"""

from __future__ import annotations

import anyio

from forge.errors import CapacityError
from forge.messages import Accepted, DaemonEvent, Rejected, TextDelta

# The error of a choice the daemon ended because it stopped (drain timeout) before the choice did.
SHUTDOWN = "shutdown"
# The error of a choice the engine refused (a Rejected after its response began): group.rejected says why.
REJECTED = "rejected"


def _merge(a: TextDelta, b: TextDelta) -> TextDelta:
    return TextDelta(request_id=a.request_id, text=a.text + b.text, num_tokens=a.num_tokens + b.num_tokens,
                     logprobs=a.logprobs + b.logprobs, finish_reason=b.finish_reason,
                     stop_string=b.stop_string or a.stop_string, counts=a.counts.merge(b.counts),
                     error=b.error or a.error, embedding=b.embedding or a.embedding)


class ResponseGroup:
    """The choices of one response, by index. Read by one task (the response's handler)."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._status: list[Accepted | Rejected | None] = [None] * len(request_ids)
        self._pending: list[TextDelta | None] = [None] * len(request_ids)
        self._changed = anyio.Event()
        self.unfinished = set(range(len(request_ids)))
        self.rejected: Rejected | None = None          # the first choice the engine refused

    def put(self, event: DaemonEvent) -> None:
        i = self._index[event.request_id]
        match event:
            case Accepted():
                self._status[i] = event
            case Rejected():
                # A refused choice ends there: its reader wakes and finds the REJECTED error.
                self._status[i] = event
                self.rejected = self.rejected or event
                self._pending[i] = TextDelta(request_id=event.request_id, text="", num_tokens=0, error=REJECTED)
            case TextDelta():
                pending = self._pending[i]
                self._pending[i] = event if pending is None else _merge(pending, event)
        self._changed.set()

    def fail(self) -> None:
        """End every unfinished choice: one still without a verdict is refused (503, draining), the
        others end with the SHUTDOWN error (an SSE error event, or a 503 for an unsent body)."""
        for i in sorted(self.unfinished):
            rid = self.request_ids[i]
            if self._status[i] is None:
                self.put(Rejected.of(rid, CapacityError("the server is shutting down", code="draining")))
            self.put(TextDelta(request_id=rid, text="", num_tokens=0, error=SHUTDOWN))

    async def _wait(self) -> None:
        await self._changed.wait()
        self._changed = anyio.Event()

    async def wait_statuses(self, num_choices: int | None = None) -> list[Accepted | Rejected]:
        """The verdicts of the first num_choices (every choice's by default); returns early with what
        is known at the first rejection."""
        while True:
            head = self._status[:num_choices]
            if self.rejected is not None or all(s is not None for s in head):
                return [s for s in head if s is not None]
            await self._wait()

    def num_prompt_tokens(self) -> int:
        """The prompt tokens of the choices accepted so far."""
        return sum(s.num_prompt_tokens for s in self._status if isinstance(s, Accepted))

    async def next_deltas(self) -> list[tuple[int, TextDelta]]:
        """All text generated since the last call, one merged delta per choice (waits for some)."""
        while True:
            out = [(i, d) for i, d in enumerate(self._pending) if d is not None]
            if out:
                for i, d in out:
                    self._pending[i] = None
                    if d.finish_reason is not None or d.error is not None:
                        self.unfinished.discard(i)
                return out
            await self._wait()


class Router:
    """request id -> the group that reads it. Events nobody listens to any more are dropped."""

    def __init__(self) -> None:
        self._groups: dict[str, ResponseGroup] = {}

    def open(self, request_ids: list[str]) -> ResponseGroup:
        group = ResponseGroup(request_ids)
        for rid in request_ids:
            self._groups[rid] = group
        return group

    def close(self, group: ResponseGroup) -> None:
        for rid in group.request_ids:
            self._groups.pop(rid, None)

    def deliver(self, event: DaemonEvent) -> None:
        group = self._groups.get(event.request_id)
        if group is not None:
            group.put(event)

    def fail_all(self) -> int:
        """End every open response (the daemon stops with requests still running); their count."""
        groups = list({id(g): g for g in self._groups.values()}.values())
        for group in groups:
            group.fail()
        return len(groups)

    def __len__(self) -> int:
        return len(self._groups)
