"""Per-request streams from the pipeline to the gateway, routed by request id.

A response may carry several choices (n > 1, or a list of prompts); each choice is one request in
the engine, and the response reads them as one ResponseGroup. Delivery never blocks the producer:
text the reader has not taken yet waits per choice, so a slow client never slows the batching loop or
other requests; and a bounded group (ResponseGroup.bound) ends its choices once more tokens wait unread
than its bound, so one that stopped reading costs at most that much memory, not its whole output.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from forge.errors import CapacityError
from forge.messages import Accepted, DaemonEvent, Rejected, TextDelta, TokenCounts

# The error of a choice the daemon ended because it stopped (drain timeout) before the choice did.
SHUTDOWN = "shutdown"
# The error of a choice the engine refused (a Rejected after its response began): group.rejected says why.
REJECTED = "rejected"
# The error of a choice the daemon ended because its client stopped reading (ResponseGroup.bound).
SLOW_READER = "slow_reader"


def _merged(deltas: list[TextDelta]) -> TextDelta:
    """One delta for a choice's waiting ones, joined once (not pairwise as they come: that copies the
    text waiting at every step, quadratic in how far its reader has fallen behind)."""
    if len(deltas) == 1:
        return deltas[0]
    last, counts = deltas[-1], deltas[0].counts
    for d in deltas[1:]:
        counts = counts.merge(d.counts)
    return TextDelta(request_id=last.request_id, text="".join(d.text for d in deltas),
                     num_tokens=sum(d.num_tokens for d in deltas),
                     logprobs=tuple(lp for d in deltas for lp in d.logprobs),
                     prompt_logprobs=tuple(lp for d in deltas for lp in d.prompt_logprobs),
                     finish_reason=last.finish_reason,
                     stop_string=next((d.stop_string for d in reversed(deltas) if d.stop_string), None),
                     counts=counts, error=next((d.error for d in reversed(deltas) if d.error), None),
                     embedding=next((d.embedding for d in reversed(deltas) if d.embedding), None))


class ResponseGroup:
    """The choices of one response, by index. Read by one task (the response's handler)."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._status: list[Accepted | Rejected | None] = [None] * len(request_ids)
        self._pending: list[list[TextDelta]] = [[] for _ in request_ids]    # per choice, not yet read out
        self._changed = anyio.Event()
        self.unfinished = set(range(len(request_ids)))
        self.rejected: Rejected | None = None          # the first choice the engine refused
        self.num_unsent_tokens = 0                     # tokens of the deltas waiting, all choices
        self.max_unsent_tokens: int | None = None      # None: unbounded (bound() sets it)
        self._on_overflow: Callable[[int], None] | None = None
        self.overflowed = False                        # its reader fell too far behind: the choices ended

    def bound(self, max_unsent_tokens: int, on_overflow: Callable[[int], None]) -> None:
        """Once more than max_unsent_tokens wait unread (the response's writer is stuck on a client that
        stopped reading), drop what waits, end every unfinished choice with the SLOW_READER error (what
        its reader finds next, if the client ever reads again), ignore what the engine still sends, and
        call on_overflow(tokens waiting) once: it takes the choices out of the engine."""
        self.max_unsent_tokens, self._on_overflow = max_unsent_tokens, on_overflow

    def put(self, event: DaemonEvent) -> None:
        i = self._index[event.request_id]
        match event:
            case Accepted():
                self._status[i] = event
            case Rejected():
                # A refused choice ends there: its reader wakes and finds the REJECTED error.
                self._status[i] = event
                self.rejected = self.rejected or event
                self._drop(i)
                self._pending[i] = [TextDelta(request_id=event.request_id, text="", num_tokens=0, error=REJECTED)]
            case TextDelta():
                if self.overflowed:
                    return                              # ended here: what was in flight before its Abort
                self._pending[i].append(event)
                self.num_unsent_tokens += event.num_tokens
                if self.max_unsent_tokens is not None and self.num_unsent_tokens > self.max_unsent_tokens:
                    self._overflow()
        self._changed.set()

    def _drop(self, i: int) -> None:
        self.num_unsent_tokens -= sum(d.num_tokens for d in self._pending[i])
        self._pending[i] = []

    def _overflow(self) -> None:
        num_unsent = self.num_unsent_tokens
        self.overflowed = True
        for i in sorted(self.unfinished):
            waiting = self._pending[i]
            counts = _merged(waiting).counts if waiting else TokenCounts()
            self._drop(i)
            self._pending[i] = [TextDelta(request_id=self.request_ids[i], text="", num_tokens=0, counts=counts,
                                          error=SLOW_READER)]
        if self._on_overflow is not None:
            self._on_overflow(num_unsent)

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
            out = [(i, _merged(p)) for i, p in enumerate(self._pending) if p]
            if out:
                for i, d in out:
                    self._drop(i)
                    if d.finish_reason is not None or d.error is not None:
                        self.unfinished.discard(i)
                return out
            await self._wait()


class StreamDemux:
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
