"""The Messages API's routes, served beside the OpenAI ones by the gateway:

    POST /v1/messages                 a message: one JSON body, or with `stream: true` the named SSE events
                                      message_start, content_block_start/delta/stop, ping, message_delta,
                                      message_stop (an engine fault mid-stream: an `error` event)
    POST /v1/messages/count_tokens    {"input_tokens": N}: the prompt a message would run, tools included

A message is a chat request in another wire format (forge/api/anthropic/anthropic_schema.py turns it into one): it runs
the one generation route of a chat completion (actors/http/generation.py: the same preparation, admission,
tokenizer, engine and response lifetime), and is read back with the same tool-call reader; only its renderer
differs (MessageRenderer and its stream's frames here, the shapes forge/api/anthropic/anthropic_output.py's).
The errors of these routes are written in the Messages API's envelope (actors/http/edge.py), and their key
may come as `x-api-key`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.http.choice_reader import Choice, ChoiceReader
from actors.http.edge import json_response, messages_error_response
from actors.http.generation import Renderer, ToolReading, generate_chat
from actors.http.lifetime import ResolveModel, ResponseLifetime
from actors.http.stream_writer import StreamFrames
from actors.runtime.model_handle import ModelHandle
from forge.api.anthropic import anthropic_output as wire
from forge.api.anthropic.anthropic_schema import prepare_count_tokens, prepare_messages
from forge.api.sse import sse_event
from forge.errors import RequestError
from forge.messages import TextDelta
from forge.text.tool_reader import ToolCallReader


class MessagesRoutes:
    def __init__(self, life: ResponseLifetime, *, resolve: ResolveModel) -> None:
        """`life`: the gateway's response lifetime; `resolve`: its resolution of the model a body names,
        for count_tokens. A message names the model that served it (the handle's)."""
        self._life, self._resolve = life, resolve

    def routes(self) -> list[Route]:
        return [Route("/v1/messages", self.create, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        return await self._life.run(request, self._create)

    async def _create(self, request: Request, pipe: ModelHandle, body: bytes, arrival: float) -> Response:
        name = pipe.serving.served_model_name
        _, prep = prepare_messages(body, served_model_name=name, max_model_len=pipe.max_model_len)
        tools = ToolReading.of(prep, max_calls=None if prep.request.parallel_tool_calls else 1)
        return await generate_chat(self._life, request, pipe, prep,
                                   lambda: MessageRenderer(wire.new_message_id(), model=name, tools=tools),
                                   num_bytes=len(body), arrival=arrival)

    async def count_tokens(self, request: Request) -> Response:
        async with self._resolve(request) as (pipe, body):
            prep = prepare_count_tokens(body, served_model_name=pipe.serving.served_model_name,
                                        max_model_len=pipe.max_model_len)
            ids = await pipe.off_loop(lambda: pipe.chat_prompt_ids(prep.messages, prep.functions,
                                                                   kwargs=prep.request.chat_template_kwargs))
        return json_response({"input_tokens": len(ids)})


class MessageRenderer(Renderer):
    """One message's answer: its body, or its named events (no [DONE]); an engine fault unstreamed is
    written in the Messages API's error envelope."""

    def __init__(self, message_id: str, *, model: str, tools: ToolReading | None) -> None:
        """`tools`: how tool calls are read out of the text (at most one when parallel tool use is off)."""
        super().__init__(message_id)
        self.model, self.tools = model, tools

    def calls(self) -> ToolCallReader | None:
        return self.tools.reader() if self.tools is not None else None

    def body(self, reader: ChoiceReader) -> dict[str, Any]:
        choice = reader.choices[0]
        blocks = wire.ContentBlocks()
        if choice.splitter is not None:                 # a reasoning model: its section, then what follows
            blocks.push([wire.ThinkingDelta(choice.reasoning)])
            blocks.push(wire.text_events(self.calls(), choice.content, final=True))
        else:
            blocks.push(wire.text_events(self.calls(), choice.text, final=True))
        blocks.close()
        reason, sequence, usage = _ending(choice, blocks)
        return wire.message(message_id=self.response_id, model=self.model, content=blocks.content(),
                            stop_reason=reason, stop_sequence=sequence, usage=usage)

    def frames(self, reader: ChoiceReader) -> StreamFrames:
        return MessageFrames(reader, self)

    def error_response(self, error: RequestError) -> Response:
        return messages_error_response(error)


class MessageFrames(StreamFrames):
    """The stream: message_start at once, a ping after the first block starts and whenever nothing comes
    for a while (a long prefill), each delta's block events, then message_delta and message_stop; an
    engine fault is an `error` event, and the message ends there, without message_stop."""

    ping = wire.PING
    failure_ends_stream = True

    def __init__(self, reader: ChoiceReader, message: MessageRenderer) -> None:
        super().__init__(reader)
        self.message = message
        self._blocks, self._calls, self._pinged = wire.ContentBlocks(), message.calls(), False

    def opening(self) -> Iterator[bytes]:
        yield sse_event(wire.message_start(message_id=self.message.response_id, model=self.message.model,
                                           input_tokens=self.reader.num_prompt_tokens))

    def failed(self, error: RequestError) -> Iterator[bytes]:
        yield sse_event(wire.error_body(error.status, error.message))

    def delta(self, _index: int, delta: TextDelta, choice: Choice) -> Iterator[bytes]:   # one choice
        blocks = self._blocks
        ended = delta.finish_reason is not None
        text, events = delta.text, []
        if choice.splitter is not None:
            text = choice.parts.content
            events = blocks.push([wire.ThinkingDelta(choice.parts.reasoning)])
        events += blocks.push(wire.text_events(self._calls, text, final=ended)) + (blocks.close() if ended else [])
        for event in events:
            yield sse_event(event)
            if not self._pinged and event["type"] == "content_block_start":
                yield wire.PING
                self._pinged = True
        if ended:
            reason, sequence, usage = _ending(choice, blocks)
            yield sse_event(wire.message_delta(stop_reason=reason, stop_sequence=sequence, usage=usage))
            yield sse_event(wire.MESSAGE_STOP)


def _ending(choice: Choice, blocks: wire.ContentBlocks) -> tuple[wire.StopReason, str | None, dict[str, int]]:
    """The stop reason, the stop sequence that matched (if that is why) and the usage of an ended choice."""
    reason = wire.stop_reason(choice.finish_reason, choice.stop_string, has_tool_use=blocks.has_tool_use)
    usage = wire.usage(prompt_tokens=choice.counts.prompt, cached_tokens=choice.counts.cached,
                       output_tokens=choice.counts.completion)
    return reason, choice.stop_string if reason == "stop_sequence" else None, usage
