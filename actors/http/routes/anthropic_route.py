"""The Messages API's routes, served beside the OpenAI ones by the gateway:

    POST /v1/messages                 a message: one JSON body, or with `stream: true` the named SSE events
                                      message_start, content_block_start/delta/stop, ping, message_delta,
                                      message_stop (an engine fault mid-stream: an `error` event)
    POST /v1/messages/count_tokens    {"input_tokens": N}: the prompt a message would run, tools included

A message is a chat request in another wire format (forge/api/anthropic/anthropic_schema.py turns it into one): it runs
through the same preparation, admission, tokenizer and engine as a chat completion, through the same
response lifetime (actors/http/lifetime.py), and is read back with the same tool-call reader; only the
shapes written here differ (forge/api/anthropic/anthropic_output.py). The errors of these routes are written in
the Messages API's envelope (actors/http/edge.py), and their key may come as `x-api-key`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.http.choice_reader import Choice, ChoiceReader
from actors.http.edge import json_response, messages_error_response
from actors.http.lifetime import ResolveModel, ResponseLifetime
from actors.runtime.model_handle import ModelHandle
from forge.api.anthropic import anthropic_output as wire
from forge.api.anthropic.anthropic_schema import prepare_count_tokens, prepare_messages
from forge.api.openai.openai_prepare import template_messages
from forge.api.sse import sse_event
from forge.messages import Submit
from forge.text.tool_calls import ToolCallReader


@dataclass(frozen=True, slots=True)
class MessageShape:
    """What one message's body or events need besides what the reader reads."""
    message_id: str
    model: str
    has_tools: bool                 # tool calls are read out of the text
    max_calls: int | None           # at most this many (1 when parallel tool use is off)

    def calls(self) -> ToolCallReader | None:
        return ToolCallReader(max_calls=self.max_calls) if self.has_tools else None


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
        req, prep = prepare_messages(body, served_model_name=name, max_model_len=pipe.max_model_len)
        await self._life.check_constraint(pipe, prep.constraint)
        messages, template_tools = template_messages(pipe.template.supports_tools, prep.messages, prep.functions)
        shape = MessageShape(message_id=wire.new_message_id(), model=name, has_tools=bool(prep.functions),
                             max_calls=None if prep.request.parallel_tool_calls else 1)
        request.state.response_id = shape.message_id
        params, reasoning = pipe.thinking(prep)
        submit = Submit(request_id=f"{shape.message_id}-0", params=params, messages=messages,
                        tools=template_tools, template_kwargs=prep.request.chat_template_kwargs)
        reader = await self._life.start(request, pipe, [submit], len(body), arrival)
        reader.split_reasoning(reasoning)
        if req.stream:
            return self._life.sse(request, pipe, reader, message_events(reader, shape), done=None)
        return await self._life.respond(request, pipe, reader, lambda: message_body(reader.choices[0], shape),
                                        render_error=messages_error_response)

    async def count_tokens(self, request: Request) -> Response:
        async with self._resolve(request) as (pipe, body):
            prep = prepare_count_tokens(body, served_model_name=pipe.serving.served_model_name,
                                        max_model_len=pipe.max_model_len)
            ids = await pipe.off_loop(lambda: pipe.chat_prompt_ids(prep.messages, prep.functions,
                                                                   kwargs=prep.request.chat_template_kwargs))
        return json_response({"input_tokens": len(ids)})


def _ending(choice: Choice, blocks: wire.ContentBlocks) -> tuple[wire.StopReason, str | None, dict[str, int]]:
    """The stop reason, the stop sequence that matched (if that is why) and the usage of an ended choice."""
    reason = wire.stop_reason(choice.finish_reason, choice.stop_string, has_tool_use=blocks.has_tool_use)
    usage = wire.usage(prompt_tokens=choice.counts.prompt, cached_tokens=choice.counts.cached,
                       output_tokens=choice.counts.completion)
    return reason, choice.stop_string if reason == "stop_sequence" else None, usage


def message_body(choice: Choice, shape: MessageShape) -> dict[str, Any]:
    blocks = wire.ContentBlocks()
    if choice.splitter is not None:                 # a reasoning model: its section, then what follows
        blocks.push([wire.ThinkingDelta(choice.reasoning)])
        blocks.push(wire.text_events(shape.calls(), choice.content, final=True))
    else:
        blocks.push(wire.text_events(shape.calls(), choice.text, final=True))
    blocks.close()
    reason, sequence, usage = _ending(choice, blocks)
    return wire.message(message_id=shape.message_id, model=shape.model, content=blocks.content(),
                        stop_reason=reason, stop_sequence=sequence, usage=usage)


async def message_events(reader: ChoiceReader, shape: MessageShape) -> AsyncIterator[bytes]:
    """The stream: message_start at once, a ping after the first block starts and whenever nothing
    comes for a while (a long prefill), each delta's block events, then message_delta and message_stop."""
    yield sse_event(wire.message_start(message_id=shape.message_id, model=shape.model,
                                            input_tokens=reader.num_prompt_tokens))
    blocks, calls, pinged = wire.ContentBlocks(), shape.calls(), False
    async for item in reader.deltas():
        if item is None:
            yield wire.PING
            continue
        _, delta, choice = item
        if delta.error is not None:
            failure = reader.failure()
            assert failure is not None
            yield sse_event(wire.error_body(failure.status, failure.message))
            return                                  # the message ends here, without message_stop
        ended = delta.finish_reason is not None
        text, events = delta.text, []
        if choice.splitter is not None:
            text = choice.parts.content
            events = blocks.push([wire.ThinkingDelta(choice.parts.reasoning)])
        events += blocks.push(wire.text_events(calls, text, final=ended)) + (blocks.close() if ended else [])
        for event in events:
            yield sse_event(event)
            if not pinged and event["type"] == "content_block_start":
                yield wire.PING
                pinged = True
        if ended:
            reason, sequence, usage = _ending(choice, blocks)
            yield sse_event(wire.message_delta(stop_reason=reason, stop_sequence=sequence, usage=usage))
            yield sse_event(wire.MESSAGE_STOP)
