"""Admission control: the bounds on waiting work, and the count of requests in flight.

A response is admitted only while the requests and prompt tokens waiting (in the scheduler, plus
those admitted but not yet queued) stay within bounds; beyond them it gets 503 with Retry-After
before any tokenising work. The in-flight count is what a graceful drain waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio

from forge.errors import CapacityError

LoadStats = Callable[[], tuple[int, int]]        # (requests waiting, prompt tokens waiting)


class Admission:
    def __init__(self, *, max_waiting: int, max_queued_tokens: int, retry_after_s: int) -> None:
        self.max_waiting = max_waiting
        self.max_queued_tokens = max_queued_tokens
        self.retry_after_s = retry_after_s
        self.num_inflight = 0
        self._idle = anyio.Event()
        self._idle.set()
        # Admitted but not yet queued by the scheduler (the scheduler takes new requests only
        # between steps): counted against the bounds, or a burst would pass them all.
        self._num_admitting = 0
        self._num_admitting_tokens = 0

    @contextmanager
    def admitting(self, load_stats: LoadStats, num_new: int, num_tokens_guess: int) -> Iterator[None]:
        """Admit num_new requests (or raise CapacityError), counted as waiting until the block ends."""
        num_waiting, num_tokens = load_stats()
        if (num_waiting + self._num_admitting + num_new > self.max_waiting
                or num_tokens + self._num_admitting_tokens + num_tokens_guess > self.max_queued_tokens):
            raise CapacityError("the server is overloaded; retry later", code="overloaded",
                                retry_after_s=self.retry_after_s)
        self._num_admitting += num_new
        self._num_admitting_tokens += num_tokens_guess
        try:
            yield
        finally:
            self._num_admitting -= num_new
            self._num_admitting_tokens -= num_tokens_guess

    def enter(self) -> None:
        """One more request in flight (from its body until its response ends)."""
        self.num_inflight += 1
        self._idle = anyio.Event() if self._idle.is_set() else self._idle

    def leave(self) -> None:
        self.num_inflight -= 1
        if self.num_inflight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()
