"""The Responses API's routes, served beside the chat ones by the gateway:

    POST   /v1/responses          a response: one JSON body, or with `stream: true` the typed SSE events
                                  response.created, response.in_progress, response.output_item.added, ...,
                                  response.completed (or response.incomplete; an engine fault mid-stream:
                                  an `error` event, then response.failed)
    GET    /v1/responses/{id}     a stored response
    DELETE /v1/responses/{id}     forget it

A response is a chat request in another wire format (forge/api/responses/responses_schema.py turns it into one, after
the stored conversation it continues): it runs the one generation route of a chat completion
(actors/http/generation.py: the same preparation, admission, tokenizer, engine and response lifetime), and
is read back with the same tool-call reader; only its renderer differs (ResponseRenderer and its stream's
frames here, the shapes forge/api/responses/responses_output.py's). Errors are OpenAI's envelope, as on chat.
The store is this gateway's memory (forge/api/responses/responses_store.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.http.choice_reader import Choice, ChoiceReader
from actors.http.edge import json_response
from actors.http.generation import Renderer, ToolReading, generate_chat
from actors.http.lifetime import ResponseLifetime
from actors.http.stream_writer import StreamFrames
from actors.runtime.model_handle import ModelHandle
from forge.api.anthropic.anthropic_output import text_events
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
from forge.api.responses.responses_tools import call_names, warning_header, warnings
from forge.api.sse import sse_event
from forge.errors import RequestError
from forge.messages import TextDelta
from forge.text.tool_reader import ToolCallReader


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
        name = pipe.serving.served_model_name
        conversation, prep = prepare_response(req, self._history(req), served_model_name=name,
                                              max_model_len=pipe.max_model_len)
        tools = ToolReading.of(prep, max_calls=max_calls(req))
        response = await generate_chat(self._life, request, pipe, prep, lambda: ResponseRenderer(
            wire.new_response_id(), created_at=int(time.time()), model=name, echoed=wire.echo(req), tools=tools,
            names=call_names(req.tools), store=self.store if req.store else None, conversation=conversation),
            num_bytes=num_bytes, arrival=arrival)
        header = warning_header(warnings(req.tools))         # tools it does not run, left out: said, not refused
        if header is not None:
            response.headers["Warning"] = header
        return response

    def _history(self, req: ResponsesRequest) -> Conversation:
        """The conversation previous_response_id names (404 when it is not stored, or no longer)."""
        if req.previous_response_id is None:
            return ()
        stored = self.store.get(req.previous_response_id, now=time.monotonic())
        if stored is None:
            raise not_found(req.previous_response_id, param="previous_response_id")
        return stored.conversation


class ResponseRenderer(Renderer):
    """One response's answer: the response object, or its typed events (no [DONE]); a finished response
    is stored (when asked) with the conversation it ends."""

    def __init__(self, response_id: str, *, created_at: int, model: str, echoed: dict[str, Any],
                 tools: ToolReading | None, names: dict[str, tuple[str | None, str]], store: ResponseStore | None,
                 conversation: Conversation) -> None:
        """`echoed`: the request's settings, repeated in every response object; `tools`: how tool calls are
        read out of the text; `names`: a called name -> (namespace, name) as its item says them; `store`:
        where it is kept (None: store false); `conversation`: what it continues, the stored one, then its
        input."""
        super().__init__(response_id)
        self.created_at, self.model, self.echoed = created_at, model, echoed
        self.tools, self.names, self.store, self.conversation = tools, names, store, conversation

    def calls(self) -> ToolCallReader | None:
        return self.tools.reader() if self.tools is not None else None

    def response(self, status: wire.Status, output: list[dict[str, Any]] | None = None,
                 usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return wire.response(response_id=self.response_id, created_at=self.created_at, model=self.model,
                             status=status, echoed=self.echoed, output=output or [], usage=usage, error=error)

    def finish(self, choice: Choice, items: wire.OutputItems) -> dict[str, Any]:
        """The finished response object, stored (when asked) with the conversation it ends."""
        output = items.items()
        usage = wire.usage(prompt_tokens=choice.counts.prompt, cached_tokens=choice.counts.cached,
                           output_tokens=choice.counts.completion,
                           reasoning_tokens=min(choice.counts.reasoning, choice.counts.completion))
        body = self.response(wire.status(choice.finish_reason), output, usage)
        if self.store is not None:
            said = tuple(msgspec.convert(output, list[Item]))      # the output items, as a client would replay them
            self.store.put(self.response_id, body, self.conversation + said, now=time.monotonic())
        return body

    def body(self, reader: ChoiceReader) -> dict[str, Any]:
        choice = reader.choices[0]
        items = wire.OutputItems(self.names)
        if choice.splitter is not None:             # a reasoning model: its section, then what follows
            items.push_reasoning(choice.reasoning)
            items.push(text_events(self.calls(), choice.content, final=True))
        else:
            items.push(text_events(self.calls(), choice.text, final=True))
        items.close(wire.status(choice.finish_reason))
        return self.finish(choice, items)

    def frames(self, reader: ChoiceReader) -> StreamFrames:
        return ResponseFrames(reader, self)


class ResponseFrames(StreamFrames):
    """The stream: response.created and response.in_progress at once, each delta's item events, then
    response.completed or response.incomplete (stored first, so a client that saw it may continue it);
    an engine fault is an `error` event, then response.failed. Every event is numbered in the order sent."""

    failure_ends_stream = True

    def __init__(self, reader: ChoiceReader, renderer: ResponseRenderer) -> None:
        super().__init__(reader)
        self.renderer = renderer
        self._numbers = itertools.count()
        self._items, self._calls = wire.OutputItems(renderer.names), renderer.calls()

    def _frame(self, event: dict[str, Any]) -> bytes:
        return sse_event({**event, "sequence_number": next(self._numbers)})

    def opening(self) -> Iterator[bytes]:
        yield self._frame({"type": "response.created", "response": self.renderer.response("in_progress")})
        yield self._frame({"type": "response.in_progress", "response": self.renderer.response("in_progress")})

    def failed(self, error: RequestError) -> Iterator[bytes]:
        yield self._frame(wire.error_event(message=error.message, code=error.code, param=error.param))
        failure = {"code": "server_error", "message": error.message}
        yield self._frame({"type": "response.failed",
                           "response": self.renderer.response("failed", self._items.items(), error=failure)})

    def delta(self, _index: int, delta: TextDelta, choice: Choice) -> Iterator[bytes]:   # one choice
        items = self._items
        ended = delta.finish_reason is not None
        text, events = delta.text, []
        if choice.splitter is not None:
            text = choice.parts.content
            events = items.push_reasoning(choice.parts.reasoning)
        events += items.push(text_events(self._calls, text, final=ended))
        if ended:
            events += items.close(wire.status(choice.finish_reason))
        for event in events:
            yield self._frame(event)
        if ended:
            body = self.renderer.finish(choice, items)
            yield self._frame({"type": f"response.{body['status']}", "response": body})
