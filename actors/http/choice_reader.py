"""Response assembly: one response's choices read from its ResponseGroup, as one JSON body or SSE frames.

A ChoiceReader accumulates each choice's text, logprobs, token counts and timing as deltas arrive
(observing the latency metrics on the way); the functions below turn what it read into the OpenAI
wire shapes (forge.api.openai.openai_schema). Nothing here admits, routes or aborts: the gateway does that.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.requests import Request

from actors.http.choice_feed import ChoiceFeed
from actors.ops.metrics import ModelMetrics
from actors.runtime.stream_demux import REJECTED, SHUTDOWN, SLOW_READER, ResponseGroup
from forge.api.openai import openai_output as wire
from forge.api.openai.openai_output import FinishReason, ResponseHeader, TokenLogprob, Usage
from forge.errors import RequestError
from forge.messages import TextDelta, TokenCounts
from forge.sampling.reasoning import ReasoningParts, ReasoningReader
from forge.text.tool_calls import ArgumentsDelta, CallStart, ContentDelta, ToolCallReader, ToolEvent, read_message

# Most inter-token gaps observed for one delta: a stalled reader's coalesced delta may hold many
# tokens, and one gap per token would flood the histogram with one figure.
MAX_GAPS_PER_DELTA = 64


@dataclass(frozen=True, slots=True)
class ReasoningReading:
    """Each choice's text is split into a thinking section and content (forge.sampling.reasoning); starts_inside:
    the generation prompt opened the section (deepseek_r1)."""
    starts_inside: bool = False


@dataclass(slots=True)
class Choice:
    text: str = ""
    # Under a ReasoningReading, `text` split as it arrives: the thinking section's text, what follows it,
    # and what the latest delta added to each (a route writes reasoning from these; `text` is still whole).
    reasoning: str = ""
    content: str = ""
    parts: ReasoningParts = ReasoningParts()
    splitter: ReasoningReader | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
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
                c.splitter = ReasoningReader(starts_inside=reading.starts_inside)

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


def _error_frame(reader: ChoiceReader) -> bytes:
    """A choice the engine failed ends its stream part with OpenAI's error envelope as an SSE event
    (the other choices carry on; the stream still ends with [DONE])."""
    error = reader.failure()
    assert error is not None
    return wire.sse_frame(wire.error_body(error.message, error.type, error.param, error.code))


# ---- /v1/completions ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CompletionShape:
    """What a completion response needs besides its choices."""
    header: ResponseHeader
    n: int                          # choices per prompt
    echoes: list[str]               # per choice: the prompt text it repeats ("" without echo)
    want_logprobs: bool


def _completion_logprobs(entries: list[TokenLogprob], start: int) -> dict[str, Any]:
    """Logprobs with each token's text offset, counted from `start` in the choice's text."""
    offsets = []
    for entry in entries:
        offsets.append(start)
        start += len(entry.text)
    return wire.completion_logprobs(entries, offsets)


def completion_body(reader: ChoiceReader, shape: CompletionShape) -> dict[str, Any]:
    items = []
    for k, c in enumerate(reader.choices):
        echo = shape.echoes[k]
        lp = _completion_logprobs(c.logprobs, len(echo)) if shape.want_logprobs else None
        items.append(wire.completion_choice(k, echo + c.text, c.finish_reason or "length", lp))
    return wire.completion_response(shape.header, items, reader.usage(shape.n))


async def completion_frames(reader: ChoiceReader, shape: CompletionShape) -> AsyncIterator[bytes]:
    header = shape.header
    offsets = [len(echo) for echo in shape.echoes]     # where each choice's next token starts
    for k, echo in enumerate(shape.echoes):
        if echo:
            yield wire.sse_frame(wire.completion_chunk(header, index=k, text=echo))
    async for item in reader.deltas():
        if item is None:
            yield wire.SSE_PING
            continue
        k, delta, choice = item
        if delta.error is not None:
            yield _error_frame(reader)
            continue
        # Text held back (half a character, a possible stop string) still sends its logprobs.
        if not delta.text and delta.finish_reason is None and not (shape.want_logprobs and delta.logprobs):
            continue
        lp = None
        if shape.want_logprobs:
            entries = choice.logprobs[-len(delta.logprobs):] if delta.logprobs else []
            lp = _completion_logprobs(entries, offsets[k])
            offsets[k] += sum(len(e.text) for e in entries)
        yield wire.sse_frame(wire.completion_chunk(header, index=k, text=delta.text,
                                                 finish_reason=choice.finish_reason, logprobs=lp))
    if header.include_usage:
        yield wire.sse_frame(wire.completion_usage_chunk(header, reader.usage(shape.n)))


# ---- /v1/chat/completions ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ToolReading:
    """Tool calls are read out of each choice's text (forge.text.tool_calls); at most max_calls per choice."""
    max_calls: int | None = None


def chat_body(reader: ChoiceReader, header: ResponseHeader, *, want_logprobs: bool,
              tools: ToolReading | None = None) -> dict[str, Any]:
    items = []
    split = reader.reasoning is not None
    for k, c in enumerate(reader.choices):
        reason: FinishReason = c.finish_reason or "length"
        lp = wire.chat_logprobs(c.logprobs) if want_logprobs else None
        reasoning = (c.reasoning or None) if split else None
        text = c.content if split else c.text
        if tools is None:
            # Only a reasoning model's section with nothing after it leaves content null (as vLLM's).
            items.append(wire.chat_choice(k, None if reasoning and not text else text, reason, lp,
                                          reasoning=reasoning))
            continue
        message = read_message(text, max_calls=tools.max_calls)
        if message.tool_calls and reason == "stop":
            reason = "tool_calls"
        calls = [wire.tool_call(t.id, t.name, t.arguments) for t in message.tool_calls]
        items.append(wire.chat_choice(k, message.content, reason, lp, calls, reasoning=reasoning))
    return wire.chat_response(header, items, reader.usage(len(reader.choices)))   # one prompt


async def chat_frames(reader: ChoiceReader, header: ResponseHeader, *, want_logprobs: bool,
                      tools: ToolReading | None = None) -> AsyncIterator[bytes]:
    calls = [ToolCallReader(max_calls=tools.max_calls) for _ in reader.choices] if tools is not None else None
    for k in range(len(reader.choices)):
        yield wire.sse_frame(wire.chat_role_chunk(header, index=k))
    async for item in reader.deltas():
        if item is None:
            yield wire.SSE_PING
            continue
        k, delta, choice = item
        if delta.error is not None:
            yield _error_frame(reader)
            continue
        lp = wire.chat_logprobs(choice.logprobs[-len(delta.logprobs):]) if want_logprobs and delta.logprobs else None
        reason = choice.finish_reason if delta.finish_reason is not None else None
        text = delta.text
        if reader.reasoning is not None:
            text = choice.parts.content
            if choice.parts.reasoning:
                yield wire.sse_frame(wire.chat_reasoning_chunk(header, index=k, reasoning=choice.parts.reasoning,
                                                               logprobs=lp))
                lp = None
        if calls is None:
            if text or lp is not None or (delta.logprobs and reader.reasoning is None):
                yield wire.sse_frame(wire.chat_content_chunk(header, index=k, content=text, logprobs=lp))
        else:
            events = calls[k].push(text) + (calls[k].finish() if reason is not None else [])
            for frame in _tool_frames(header, k, events, lp):
                yield frame
            if reason == "stop" and calls[k].num_calls:
                reason = "tool_calls"
        if reason is not None:
            yield wire.sse_frame(wire.chat_finish_chunk(header, index=k, finish_reason=reason))
    if header.include_usage:
        yield wire.sse_frame(wire.chat_usage_chunk(header, reader.usage(len(reader.choices))))


def _tool_frames(header: ResponseHeader, k: int, events: list[ToolEvent], lp: dict[str, Any] | None) -> list[bytes]:
    """Content and tool-call chunks for one delta's events; its logprobs ride on the first content chunk,
    or on an empty one."""
    frames = []
    for event in events:
        match event:
            case ContentDelta(text=text):
                frames.append(wire.sse_frame(wire.chat_content_chunk(header, index=k, content=text, logprobs=lp)))
                lp = None
            case CallStart(index=i, id=call_id, name=name):
                frames.append(wire.sse_frame(wire.chat_tool_call_chunk(header, index=k, call_index=i,
                                                                      call_id=call_id, name=name)))
            case ArgumentsDelta(index=i, text=text):
                frames.append(wire.sse_frame(wire.chat_tool_call_chunk(header, index=k, call_index=i,
                                                                      arguments=text)))
    if lp is not None:
        frames.append(wire.sse_frame(wire.chat_content_chunk(header, index=k, content="", logprobs=lp)))
    return frames
