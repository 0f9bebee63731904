"""Admission control: the bounds on waiting work, and the count of requests in flight.

A response is admitted only while the requests and prompt tokens waiting (in the scheduler, plus
those admitted but not yet queued) stay within bounds; beyond them it gets 503 with Retry-After
before any tokenizing work. A response of many choices (prompts x n, embedding inputs) is one unit
of work: it is charged for its window, the choices it may have in the engine at once (at most a
quarter of either bound, actors/http/choice_feed.py), and one that could never be admitted, however empty the
queue, is a 400 naming the limit instead of a 503 its client would retry for ever. The in-flight
count is what a graceful drain waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio

from forge.errors import CapacityError, InvalidRequest

LoadStats = Callable[[], tuple[int, int]]        # (requests waiting, prompt tokens waiting)

# A response's window is at most 1/FAIR_SHARE of the waiting queue, of its prompt tokens and of the
# engine's sequences, so a big request leaves the rest of the queue and of each step to everyone else.
FAIR_SHARE = 4


@dataclass(frozen=True, slots=True)
class Window:
    """How a response of num_choices runs: at most `num_choices` of them in the engine at once,
    charged to admission as that many requests and `num_tokens` guessed prompt tokens."""
    num_choices: int
    num_tokens: int


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

    @property
    def max_choices(self) -> int:
        """Most choices (prompts x n) one generation request may hold: the waiting queue's size."""
        return max(self.max_waiting, 1)

    def window(self, num_choices: int, num_tokens_guess: int, *, max_choices: int | None = None,
               engine_slots: int | None = None) -> Window:
        """The window of a response of num_choices whose body guesses num_tokens_guess prompt tokens;
        InvalidRequest (400) if it could never be admitted: more choices than `max_choices` (default
        self.max_choices), or one choice's share of the tokens past --max-queued-tokens. `engine_slots`: the
        sequences the engine runs at once (--max-num-seqs), of which the window takes at most its share."""
        limit = self.max_choices if max_choices is None else max_choices
        if num_choices > limit:
            raise InvalidRequest(f"this request asks for {num_choices} choices (prompts x n); a request may "
                                 f"hold at most {limit}, the server's --max-waiting", code="too_many_choices")
        per_choice = -(-num_tokens_guess // max(num_choices, 1))            # ceil
        if per_choice > self.max_queued_tokens:
            raise InvalidRequest(f"this request's prompt (about {per_choice} tokens, its bytes / 4) can never be "
                                 f"queued: the server's --max-queued-tokens is {self.max_queued_tokens}",
                                 code="request_too_large")
        by_count = max(1, self.max_waiting // FAIR_SHARE)
        by_tokens = max(1, self.max_queued_tokens // FAIR_SHARE // max(per_choice, 1))
        by_slots = max(1, engine_slots // FAIR_SHARE) if engine_slots else num_choices
        num = max(1, min(num_choices, by_count, by_tokens, by_slots))
        return Window(num_choices=num, num_tokens=min(num_tokens_guess, num * per_choice))

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
