"""One response's choices read from its ResponseGroup, to their ends or delta by delta.

A ChoiceReader accumulates each choice's text, logprobs, token counts and timing as deltas arrive
(observing the latency metrics on the way), and says what the response failed with, if it did. What it
read becomes a wire format's body or stream elsewhere (actors/http/openai_render.py, the routes' renderers).
Nothing here admits, routes or aborts: the lifetime does that.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from starlette.requests import Request

from actors.http.choice_feed import ChoiceFeed
from actors.ops.metrics import ModelMetrics
from actors.runtime.stream_demux import REJECTED, SHUTDOWN, SLOW_READER, ResponseGroup
from forge.api.openai.openai_output import FinishReason, TokenLogprob, Usage
from forge.errors import RequestError
from forge.messages import TextDelta, TokenCounts
from forge.sampling.reasoning import ReasoningParts, ReasoningReader
from forge.text.harmony import HarmonyReader

# Most inter-token gaps observed for one delta: a stalled reader's coalesced delta may hold many
# tokens, and one gap per token would flood the histogram with one figure.
MAX_GAPS_PER_DELTA = 64


@dataclass(frozen=True, slots=True)
class ReasoningReading:
    """Each choice's text is split into a thinking section and content (forge.sampling.reasoning); starts_inside:
    the generation prompt opened the section (deepseek_r1); harmony: by gpt-oss's channels instead
    (forge.text.harmony: analysis as reasoning, final as content, calls to functions as forge's tool calls)."""
    starts_inside: bool = False
    harmony: bool = False


@dataclass(slots=True)
class Choice:
    text: str = ""
    # Under a ReasoningReading, `text` split as it arrives: the thinking section's text, what follows it,
    # and what the latest delta added to each (a route writes reasoning from these; `text` is still whole).
    reasoning: str = ""
    content: str = ""
    parts: ReasoningParts = ReasoningParts()
    splitter: ReasoningReader | HarmonyReader | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)   # its prompt's tokens scored, when asked
    finish_reason: FinishReason | None = None
    stop_string: str | None = None           # the stop string that ended it, if one did
    counts: TokenCounts = TokenCounts()
    error: str | None = None                 # the engine failed this choice
    embedding: bytes | None = None           # an embedding request's vector (little-endian float32)
    first_token_at: float | None = None
    last_token_at: float | None = None


class ChoiceReader:
    """Reads the choices of one response to their ends. Used by one task: the response's."""

    def __init__(self, group: ResponseGroup, metrics: ModelMetrics, *, arrival: float, ping_interval: float,
                 num_prompt_tokens: int = 0, feed: ChoiceFeed | None = None) -> None:
        """`feed`: what sends the group's choices a window at a time, topped up as choices end."""
        self.group = group
        self.feed = feed
        self.num_prompt_tokens = num_prompt_tokens      # as the scheduler accepted the choices (all of them)
        self.choices = [Choice() for _ in group.request_ids]
        self.reasoning: ReasoningReading | None = None
        self._metrics = metrics
        self._arrival = arrival
        self._ping_interval = ping_interval

    def split_reasoning(self, reading: ReasoningReading | None) -> None:
        """Split each choice's text into reasoning and content from here on (call before reading deltas)."""
        self.reasoning = reading
        if reading is not None:
            for c in self.choices:
                c.splitter = (HarmonyReader() if reading.harmony
                              else ReasoningReader(starts_inside=reading.starts_inside))

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.counts.completion for c in self.choices)

    def usage(self, n: int) -> Usage:
        """Token counts; the n choices of one prompt share it, so its tokens count once."""
        prompt = sum(c.counts.prompt for c in self.choices[::n])
        return Usage(prompt_tokens=prompt, completion_tokens=self.num_completion_tokens,
                     reasoning_tokens=sum(min(c.counts.reasoning, c.counts.completion) for c in self.choices),
                     cached_tokens=sum(c.counts.cached for c in self.choices[::n]),
                     draft_tokens=sum(c.counts.draft for c in self.choices),
                     accepted_tokens=sum(c.counts.accepted for c in self.choices))

    async def collect(self, request: Request) -> list[Choice]:
        """Every choice to its end. A client that goes away cancels the wait (the caller aborts)."""
        async with anyio.create_task_group() as tg:
            async def watch_disconnect() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch_disconnect)
            while self._reading():
                deltas = await self.group.next_deltas()
                self._top_up()
                now = time.monotonic()
                for i, delta in deltas:
                    self._observe(self.choices[i], delta, now)
            tg.cancel_scope.cancel()
        if self._reading():
            raise anyio.get_cancelled_exc_class()()
        return self.choices

    async def deltas(self) -> AsyncIterator[tuple[int, TextDelta, Choice] | None]:
        """Deltas as they come; None (a ping) while none comes for a while, as in a long prefill."""
        while self._reading():
            deltas = None
            with anyio.move_on_after(self._ping_interval):
                deltas = await self.group.next_deltas()
            if deltas is None:
                yield None
                continue
            self._top_up()
            now = time.monotonic()
            for i, delta in deltas:
                self._observe(self.choices[i], delta, now)
                yield i, delta, self.choices[i]

    def _reading(self) -> bool:
        """Choices still to come; none once the engine refused one (the response fails with its error)."""
        return bool(self.group.unfinished) and self.group.rejected is None

    def _top_up(self) -> None:
        if self.feed is not None:               # before the deltas are read out: the engine never waits on them
            self.feed.top_up()

    def _observe(self, choice: Choice, delta: TextDelta, now: float) -> None:
        m = self._metrics
        if delta.num_tokens:
            if choice.first_token_at is None:
                choice.first_token_at = now
                m.time_to_first_token.observe(now - self._arrival)
                m.recent_ttft.add(now - self._arrival, now)
                if delta.num_tokens > 1:
                    m.inter_token_latency.observe(0.0)
                    m.recent_itl.add(0.0, now)
            elif choice.last_token_at is not None:
                gap = (now - choice.last_token_at) / delta.num_tokens
                for _ in range(min(delta.num_tokens, MAX_GAPS_PER_DELTA)):
                    m.inter_token_latency.observe(gap)
                    m.recent_itl.add(gap, now)
            choice.last_token_at = now
        choice.text += delta.text
        if choice.splitter is not None:
            parts = choice.splitter.push(delta.text)
            if delta.finish_reason is not None or delta.error is not None:
                end = choice.splitter.finish()
                parts = ReasoningParts(parts.reasoning + end.reasoning, parts.content + end.content)
            choice.parts = parts
            choice.reasoning += parts.reasoning
            choice.content += parts.content
        for lp in delta.logprobs:
            choice.logprobs.append(TokenLogprob(text=lp.text, token_bytes=lp.token_bytes, logprob=lp.logprob,
                                                top=lp.top))
        for lp in delta.prompt_logprobs:
            choice.prompt_logprobs.append(TokenLogprob(text=lp.text, token_bytes=lp.token_bytes, logprob=lp.logprob,
                                                       top=lp.top, token_id=lp.token_id, rank=lp.rank,
                                                       top_ids=lp.top_ids))
        choice.counts = choice.counts.merge(delta.counts)
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            choice.stop_string = delta.stop_string
            m.e2e_request_latency.observe(now - self._arrival)
            if choice.first_token_at is not None and choice.counts.completion > 1:
                tpot = (now - choice.first_token_at) / (choice.counts.completion - 1)
                m.time_per_output_token.observe(tpot)
                m.recent_tpot.add(tpot, now)
        if delta.error is not None:
            choice.error = delta.error
        if delta.embedding is not None:
            choice.embedding = delta.embedding

    def failure(self) -> RequestError | None:
        """The error to answer with when the engine failed a choice (a 500: not the client's fault), the
        daemon stopped before it ended (a 503: send it again), or its client stopped reading (400)."""
        error = next((c.error for c in self.choices if c.error is not None), None)
        if error is None:
            return None
        if error == SHUTDOWN:
            return RequestError("the server stopped before this response was complete: send it again",
                                status=503, type="server_error", code="shutdown")
        if error == REJECTED and self.group.rejected is not None:
            return self.group.rejected.error()       # a later window's choice refused (e.g. too long)
        if error == SLOW_READER:
            return RequestError(f"this response was ended because its client stopped reading it: more than "
                                f"{self.group.max_unsent_tokens} generated tokens waited unsent (the server's "
                                f"--max-unsent-tokens)", status=400, code="slow_reader")
        return RequestError(f"the engine failed while generating this response ({error})", status=500,
                            type="server_error", code="engine_fault")

