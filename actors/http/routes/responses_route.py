"""The Responses API's routes, served beside the chat ones by the gateway:

    POST   /v1/responses          a response: one JSON body, or with `stream: true` the typed SSE events
                                  response.created, response.in_progress, response.output_item.added, ...,
                                  response.completed (or response.incomplete; an engine fault mid-stream:
                                  an `error` event, then response.failed)
    GET    /v1/responses/{id}     a stored response
    DELETE /v1/responses/{id}     forget it

A response is a chat request in another wire format (forge/api/responses/responses_schema.py turns it into one, after
the stored conversation it continues): it runs through the same preparation, admission, tokenizer and
engine as a chat completion, through the same response lifetime (actors/http/lifetime.py), and is read back
with the same tool-call reader; only the shapes written here differ (forge/api/responses/responses_output.py). Errors
are OpenAI's envelope, as on chat. The store is this gateway's memory (forge/api/responses/responses_store.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.http.choice_reader import Choice, ChoiceReader
from actors.http.edge import json_response
from actors.http.lifetime import ResponseLifetime
from actors.runtime.model_handle import ModelHandle
from forge.api.anthropic.anthropic_output import text_events
from forge.api.openai.openai_output import SSE_PING
from forge.api.openai.openai_prepare import template_messages
from forge.api.responses import responses_output as wire
from forge.api.responses.responses_schema import (
    Conversation,
    Item,
    ResponsesRequest,
    decode_responses,
    max_calls,
    prepare_response,
    wire_param,
)
from forge.api.responses.responses_store import ResponseStore
from forge.api.sse import sse_event
from forge.errors import RequestError
from forge.messages import Submit
from forge.text.tool_calls import ToolCallReader


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """What one response's body or events need besides what the reader reads."""
    response_id: str
    created_at: int
    model: str
    echoed: dict[str, Any]          # the request's settings, repeated in every response object
    has_tools: bool                 # tool calls are read out of the text
    max_calls: int | None
    store: bool
    conversation: Conversation      # what this response continues: the stored one, then its input

    def calls(self) -> ToolCallReader | None:
        return ToolCallReader(max_calls=self.max_calls) if self.has_tools else None

    def body(self, status: wire.Status, output: list[dict[str, Any]] | None = None,
             usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return wire.response(response_id=self.response_id, created_at=self.created_at, model=self.model,
                             status=status, echoed=self.echoed, output=output or [], usage=usage, error=error)


def not_found(response_id: str, param: str | None = None) -> RequestError:
    code = "previous_response_not_found" if param else "response_not_found"
    what = "Previous response" if param else "Response"
    return RequestError(f"{what} with id '{response_id}' not found.", status=404, param=param, code=code)


class ResponsesRoutes:
    def __init__(self, life: ResponseLifetime, *, authorize: Callable[[Request], None], store: ResponseStore) -> None:
        """`life`: the gateway's response lifetime; `authorize`: its key check (GET and DELETE need the
        key, not a loaded model); `store`: where stored responses live. A response names the model that
        served it (the handle's), as every route does."""
        self._life, self._authorize = life, authorize
        self.store = store

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])]

    async def retrieve(self, request: Request) -> Response:
        self._authorize(request)
        response_id = request.path_params["response_id"]
        stored = self.store.get(response_id, now=time.monotonic())
        if stored is None:
            raise not_found(response_id)
        return json_response(stored.body)

    async def delete(self, request: Request) -> Response:
        self._authorize(request)
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id, now=time.monotonic()):
            raise not_found(response_id)
        return json_response(wire.deleted(response_id))

    async def create(self, request: Request) -> Response:
        return await self._life.run(request, self._create)

    async def _create(self, request: Request, pipe: ModelHandle, body: bytes, arrival: float) -> Response:
        try:
            req = decode_responses(body)
            return await self._start(request, pipe, req, len(body), arrival)
        except RequestError as exc:                 # an error on the chat request names the field as sent
            exc.param = wire_param(exc.param)
            raise

    async def _start(self, request: Request, pipe: ModelHandle, req: ResponsesRequest, num_bytes: int,
                     arrival: float) -> Response:
        history = self._history(req)
        conversation, prep = prepare_response(req, history, served_model_name=pipe.serving.served_model_name,
                                              max_model_len=pipe.max_model_len)
        await self._life.check_constraint(pipe, prep.constraint)
        messages, template_tools = template_messages(pipe.template.supports_tools, prep.messages, prep.functions)
        shape = ResponseShape(response_id=wire.new_response_id(), created_at=int(time.time()),
                              model=pipe.serving.served_model_name,
                              echoed=wire.echo(req), has_tools=bool(prep.functions), max_calls=max_calls(req),
                              store=req.store, conversation=conversation)
        request.state.response_id = shape.response_id
        params, reasoning = pipe.thinking(prep)
        submit = Submit(request_id=f"{shape.response_id}-0", params=params, messages=messages,
                        tools=template_tools, template_kwargs=prep.request.chat_template_kwargs)
        reader = await self._life.start(request, pipe, [submit], num_bytes, arrival)
        reader.split_reasoning(reasoning)
        if req.stream:
            return self._life.sse(request, pipe, reader, self._events(reader, shape), done=None)
        return await self._life.respond(request, pipe, reader, lambda: self._body(reader.choices[0], shape))

    def _history(self, req: ResponsesRequest) -> Conversation:
        """The conversation previous_response_id names (404 when it is not stored, or no longer)."""
        if req.previous_response_id is None:
            return ()
        stored = self.store.get(req.previous_response_id, now=time.monotonic())
        if stored is None:
            raise not_found(req.previous_response_id, param="previous_response_id")
        return stored.conversation

    def _finish(self, shape: ResponseShape, choice: Choice, items: wire.OutputItems) -> dict[str, Any]:
        """The finished response object, stored (when asked) with the conversation it ends."""
        output = items.items()
        usage = wire.usage(prompt_tokens=choice.counts.prompt, cached_tokens=choice.counts.cached,
                           output_tokens=choice.counts.completion,
                           reasoning_tokens=min(choice.counts.reasoning, choice.counts.completion))
        body = shape.body(wire.status(choice.finish_reason), output, usage)
        if shape.store:
            said = tuple(msgspec.convert(output, list[Item]))      # the output items, as a client would replay them
            self.store.put(shape.response_id, body, shape.conversation + said, now=time.monotonic())
        return body

    def _body(self, choice: Choice, shape: ResponseShape) -> dict[str, Any]:
        items = wire.OutputItems()
        if choice.splitter is not None:             # a reasoning model: its section, then what follows
            items.push_reasoning(choice.reasoning)
            items.push(text_events(shape.calls(), choice.content, final=True))
        else:
            items.push(text_events(shape.calls(), choice.text, final=True))
        items.close(wire.status(choice.finish_reason))
        return self._finish(shape, choice, items)

    async def _events(self, reader: ChoiceReader, shape: ResponseShape) -> AsyncIterator[bytes]:
        """The stream: response.created and response.in_progress at once, each delta's item events,
        then response.completed or response.incomplete (stored first, so a client that saw it may
        continue it). Every event is numbered in the order sent."""
        numbers = itertools.count()

        def frame(event: dict[str, Any]) -> bytes:
            return sse_event({**event, "sequence_number": next(numbers)})

        yield frame({"type": "response.created", "response": shape.body("in_progress")})
        yield frame({"type": "response.in_progress", "response": shape.body("in_progress")})
        items, calls = wire.OutputItems(), shape.calls()
        async for item in reader.deltas():
            if item is None:
                yield SSE_PING
                continue
            _, delta, choice = item
            if delta.error is not None:
                failure = reader.failure()
                assert failure is not None
                yield frame(wire.error_event(message=failure.message, code=failure.code, param=failure.param))
                error = {"code": "server_error", "message": failure.message}
                yield frame({"type": "response.failed", "response": shape.body("failed", items.items(), error=error)})
                return
            text, events = delta.text, []
            if choice.splitter is not None:
                text = choice.parts.content
                events = items.push_reasoning(choice.parts.reasoning)
            events += items.push(text_events(calls, text, final=delta.finish_reason is not None))
            if delta.finish_reason is not None:
                events += items.close(wire.status(choice.finish_reason))
            for event in events:
                yield frame(event)
            if delta.finish_reason is not None:
                body = self._finish(shape, choice, items)
                yield frame({"type": f"response.{body['status']}", "response": body})
