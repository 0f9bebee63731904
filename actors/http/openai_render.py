"""OpenAI's wire shapes of a read response: /v1/completions' and /v1/chat/completions' one JSON body or
stream frames (forge/api/openai/openai_output.py's chunks), from what a ChoiceReader read.

Both stream through the one loop (actors/http/stream_writer.py); a choice the engine failed ends its part
of the stream with OpenAI's error envelope, the other choices carry on, and the stream still ends with
[DONE]. Chat answers through the one generation route (actors/http/generation.py) as ChatRenderer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from actors.http.choice_reader import Choice, ChoiceReader
from actors.http.generation import Renderer, ToolReading
from actors.http.stream_writer import StreamFrames
from forge.api.openai import openai_output as wire
from forge.api.openai.openai_output import FinishReason, ResponseHeader, TokenLogprob
from forge.errors import RequestError
from forge.messages import TextDelta
from forge.text.tool_reader import ArgumentsDelta, CallStart, ContentDelta, ToolEvent


def _error_frame(error: RequestError) -> bytes:
    """A failed choice's error, as OpenAI's error envelope in an SSE event."""
    return wire.sse_frame(wire.error_body(error.message, error.type, error.param, error.code))


# ---- /v1/completions ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CompletionShape:
    """What a completion response needs besides its choices. With echo_logprobs (echo and logprobs) each
    choice's logprobs start with its prompt's tokens, offsets counted from the start of the echoed text, as
    OpenAI's legacy completions and vLLM did; prompt_logprobs: vLLM's, that many alternatives per token."""
    header: ResponseHeader
    n: int                          # choices per prompt
    echoes: list[str]               # per choice: the prompt text it repeats ("" without echo)
    want_logprobs: bool
    echo_logprobs: bool = False
    num_top: int = 0                # logprobs' alternatives per token (the prompt's may have been scored with more)
    prompt_logprobs: int | None = None


def _completion_logprobs(entries: list[TokenLogprob], start: int) -> dict[str, Any]:
    """Logprobs with each token's text offset, counted from `start` in the choice's text."""
    offsets = []
    for entry in entries:
        offsets.append(start)
        start += len(entry.text)
    return wire.completion_logprobs(entries, offsets)


def _echoed(choice: Choice, num_top: int) -> list[TokenLogprob]:
    """The choice's prompt tokens as its echo's logprobs list them: num_top alternatives each."""
    return [msgspec.structs.replace(e, top=e.top[:num_top]) for e in choice.prompt_logprobs]


def completion_body(reader: ChoiceReader, shape: CompletionShape) -> dict[str, Any]:
    items = []
    for k, c in enumerate(reader.choices):
        echo = shape.echoes[k]
        lp = None
        if shape.echo_logprobs:
            lp = _completion_logprobs(_echoed(c, shape.num_top) + c.logprobs, 0)
        elif shape.want_logprobs:
            lp = _completion_logprobs(c.logprobs, len(echo))
        prompt_lp = (wire.prompt_logprobs(c.prompt_logprobs, shape.prompt_logprobs)
                     if shape.prompt_logprobs is not None else None)
        items.append(wire.completion_choice(k, echo + c.text, c.finish_reason or "length", lp, prompt_lp))
    return wire.completion_response(shape.header, items, reader.usage(shape.n))


class CompletionFrames(StreamFrames):
    """A completion's stream: each choice's echo, its text chunks, then the usage chunk if asked. An echo
    with logprobs waits for its prompt's (they come with the choice's first delta) and goes in that chunk."""

    def __init__(self, reader: ChoiceReader, shape: CompletionShape) -> None:
        super().__init__(reader)
        self.shape = shape
        # where each choice's next token starts, and whether its echo is still to send with its first delta
        self._offsets = [0 if shape.echo_logprobs else len(echo) for echo in shape.echoes]
        self._echo_due = [shape.echo_logprobs] * len(shape.echoes)

    def opening(self) -> Iterator[bytes]:
        for k, echo in enumerate(self.shape.echoes):
            if echo and not self.shape.echo_logprobs:
                yield wire.sse_frame(wire.completion_chunk(self.shape.header, index=k, text=echo))

    def failed(self, error: RequestError) -> Iterator[bytes]:
        yield _error_frame(error)

    def delta(self, index: int, delta: TextDelta, choice: Choice) -> Iterator[bytes]:
        shape = self.shape
        echo, echoed = "", []
        if self._echo_due[index]:
            self._echo_due[index] = False
            echo, echoed = shape.echoes[index], _echoed(choice, shape.num_top)
        # Text held back (half a character, a possible stop string) still sends its logprobs.
        if not (echo or echoed or delta.text or delta.finish_reason is not None
                or (shape.want_logprobs and delta.logprobs)):
            return
        lp = None
        if shape.want_logprobs:
            entries = echoed + (choice.logprobs[-len(delta.logprobs):] if delta.logprobs else [])
            lp = _completion_logprobs(entries, self._offsets[index])
            self._offsets[index] += sum(len(e.text) for e in entries)
        yield wire.sse_frame(wire.completion_chunk(shape.header, index=index, text=echo + delta.text,
                                                   finish_reason=choice.finish_reason, logprobs=lp))

    def closing(self) -> Iterator[bytes]:
        if self.shape.header.include_usage:
            yield wire.sse_frame(wire.completion_usage_chunk(self.shape.header, self.reader.usage(self.shape.n)))


# ---- /v1/chat/completions ----------------------------------------------------------------------

def chat_body(reader: ChoiceReader, header: ResponseHeader, *, want_logprobs: bool,
              tools: ToolReading | None = None, prompt_logprobs: int | None = None) -> dict[str, Any]:
    """The chat completion; with `prompt_logprobs` (vLLM's: that many alternatives) the prompt's tokens scored,
    beside the choices (every choice ran the same prompt: the first's)."""
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
        message = tools.read(text)
        if message.tool_calls and reason == "stop":
            reason = "tool_calls"
        calls = [wire.tool_call(t.id, t.name, t.arguments) for t in message.tool_calls]
        items.append(wire.chat_choice(k, message.content, reason, lp, calls, reasoning=reasoning))
    prompt_lp = (wire.prompt_logprobs(reader.choices[0].prompt_logprobs, prompt_logprobs)
                 if prompt_logprobs is not None else None)
    return wire.chat_response(header, items, reader.usage(len(reader.choices)), prompt_lp)   # one prompt


class ChatFrames(StreamFrames):
    """A chat completion's stream: each choice's role chunk, then its reasoning, content and tool-call chunks
    and its finish chunk, then the usage chunk if asked."""

    def __init__(self, reader: ChoiceReader, header: ResponseHeader, *, want_logprobs: bool,
                 tools: ToolReading | None = None) -> None:
        super().__init__(reader)
        self.header, self.want_logprobs = header, want_logprobs
        self._calls = [tools.reader() for _ in reader.choices] if tools is not None else None

    def opening(self) -> Iterator[bytes]:
        for k in range(len(self.reader.choices)):
            yield wire.sse_frame(wire.chat_role_chunk(self.header, index=k))

    def failed(self, error: RequestError) -> Iterator[bytes]:
        yield _error_frame(error)

    def delta(self, index: int, delta: TextDelta, choice: Choice) -> Iterator[bytes]:
        header, k, reader = self.header, index, self.reader
        lp = (wire.chat_logprobs(choice.logprobs[-len(delta.logprobs):])
              if self.want_logprobs and delta.logprobs else None)
        reason = choice.finish_reason if delta.finish_reason is not None else None
        text = delta.text
        if reader.reasoning is not None:
            text = choice.parts.content
            if choice.parts.reasoning:
                yield wire.sse_frame(wire.chat_reasoning_chunk(header, index=k, reasoning=choice.parts.reasoning,
                                                               logprobs=lp))
                lp = None
        if self._calls is None:
            if text or lp is not None or (delta.logprobs and reader.reasoning is None):
                yield wire.sse_frame(wire.chat_content_chunk(header, index=k, content=text, logprobs=lp))
        else:
            calls = self._calls[k]
            yield from _tool_frames(header, k, calls.push(text) + (calls.finish() if reason is not None else []), lp)
            if reason == "stop" and calls.num_calls:
                reason = "tool_calls"
        if reason is not None:
            yield wire.sse_frame(wire.chat_finish_chunk(header, index=k, finish_reason=reason))

    def closing(self) -> Iterator[bytes]:
        if self.header.include_usage:
            yield wire.sse_frame(wire.chat_usage_chunk(self.header, self.reader.usage(len(self.reader.choices))))


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


class ChatRenderer(Renderer):
    """A chat completion's answer: chat_body, or ChatFrames then [DONE]."""

    done = wire.SSE_DONE

    def __init__(self, header: ResponseHeader, *, want_logprobs: bool, tools: ToolReading | None,
                 prompt_logprobs: int | None = None) -> None:
        super().__init__(header.request_id)
        self.header, self.want_logprobs, self.tools = header, want_logprobs, tools
        self.prompt_logprobs = prompt_logprobs          # vLLM's; never streamed (the schema refuses them there)

    def body(self, reader: ChoiceReader) -> dict[str, Any]:
        return chat_body(reader, self.header, want_logprobs=self.want_logprobs, tools=self.tools,
                         prompt_logprobs=self.prompt_logprobs)

    def frames(self, reader: ChoiceReader) -> StreamFrames:
        return ChatFrames(reader, self.header, want_logprobs=self.want_logprobs, tools=self.tools)
