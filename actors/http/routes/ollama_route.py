"""Ollama's generation routes, served beside the OpenAI ones by the gateway:

    POST /api/chat          a chat: NDJSON objects as they come (Ollama streams unless `stream` is false),
                            the last with `done: true`, its reason and timings; or one object
    POST /api/generate      a prompt through the chat template (with `system`), or `raw` as it is;
                            an empty prompt only loads the model (`done_reason: "load"`, or "unload" with
                            keep_alive 0)
    POST /api/embed         {"embeddings": [[...], ...]} for a string or a list of strings
    POST /api/embeddings    {"embedding": [...]} for one prompt (the older route)

A chat is another wire format over a chat request (forge/api/ollama/ollama_schema.py turns it into one): it
runs the one generation route (actors/http/generation.py) and is read back with the same tool-call and
reasoning readers; only its renderer differs (OllamaRenderer and OllamaFrames here, the shapes
forge/api/ollama/ollama_output.py's). Embeddings run as /v1/embeddings' do. The model is found by the same
resolver as every route's (a name's `:latest` tag may be left on), and errors are written `{"error": ...}`
(actors/http/edge.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.http.choice_reader import Choice, ChoiceReader
from actors.http.edge import json_response, ollama_error_response
from actors.http.generation import Renderer, ToolReading, generate_chat, params_for
from actors.http.lifetime import ResponseLifetime
from actors.http.stream_writer import StreamFrames
from actors.runtime.model_handle import ModelHandle
from actors.runtime.model_set import parse_keep_alive
from forge.api.embeddings.embeddings_schema import MAX_INPUTS, embedding_value, prepare_embeddings
from forge.api.ollama import ollama_output as wire
from forge.api.ollama.ollama_schema import (
    OllamaChat,
    OllamaGenerate,
    decode_chat,
    decode_embed,
    decode_embeddings,
    decode_generate,
    prepare_chat,
)
from forge.api.openai.openai_prepare import PreparedChat
from forge.errors import InvalidRequest, RequestError
from forge.messages import Submit, TextDelta
from forge.text.tool_reader import ArgumentsDelta, CallStart, ContentDelta, ToolCall, ToolCallReader


class OllamaRoutes:
    def __init__(self, life: ResponseLifetime) -> None:
        """`life`: the gateway's response lifetime."""
        self._life = life

    def routes(self) -> list[Route]:
        return [Route("/api/chat", self.chat, methods=["POST"]),
                Route("/api/generate", self.generate, methods=["POST"]),
                Route("/api/embed", self.embed, methods=["POST"]),
                Route("/api/embeddings", self.embeddings, methods=["POST"])]

    async def chat(self, request: Request) -> Response:
        return await self._life.run(request, self._chat)

    async def generate(self, request: Request) -> Response:
        return await self._life.run(request, self._generate)

    async def embed(self, request: Request) -> Response:
        return await self._life.run(request, self._embed, embeds=True)

    async def embeddings(self, request: Request) -> Response:
        return await self._life.run(request, self._embed, embeds=True)

    # ---- chat and generate ----------------------------------------------------------------------

    async def _chat(self, request: Request, pipe: ModelHandle, body: bytes, arrival: float) -> Response:
        req = decode_chat(body)
        if not req.messages:
            return self._loaded(request, req, arrival, chat=True)
        prep = self._prepare(pipe, req)
        tools = ToolReading.of(prep)
        return await generate_chat(self._life, request, pipe, prep, lambda: OllamaRenderer(
            model=req.model, chat=True, tools=tools, arrival=arrival), num_bytes=len(body), arrival=arrival)

    async def _generate(self, request: Request, pipe: ModelHandle, body: bytes, arrival: float) -> Response:
        req = decode_generate(body)
        if not req.prompt:
            return self._loaded(request, req, arrival, chat=False)
        prep = self._prepare(pipe, req)
        renderer = OllamaRenderer(model=req.model, chat=False, tools=None, arrival=arrival)
        if not req.raw:
            return await generate_chat(self._life, request, pipe, prep, lambda: renderer, num_bytes=len(body),
                                       arrival=arrival)
        # raw: the prompt as it is, no template; the sampling and constraint are the chat's
        await self._life.check_constraint(pipe, prep.constraint)
        request.state.response_id = renderer.response_id
        submit = Submit(request_id=f"{renderer.response_id}-0", params=params_for(prep.params, 0), text=req.prompt)
        reader = await self._life.start(request, pipe, [submit], len(body), arrival)
        if req.stream:
            return self._life.sse(request, pipe, reader, renderer.frames(reader).stream(), done=None,
                                  media_type=wire.NDJSON)
        return await self._life.respond(request, pipe, reader, lambda: renderer.body(reader),
                                        render_error=renderer.error_response)

    def _prepare(self, pipe: ModelHandle, req: OllamaChat | OllamaGenerate) -> PreparedChat:
        """The chat request it means; `think` asked of a model without a thinking section is a 400, as
        Ollama answers it."""
        if req.think not in (None, False) and pipe.reasoning_parser == "none":
            raise InvalidRequest(f"\"{req.model}\" does not support thinking", param="think")
        return prepare_chat(req, served_model_name=pipe.serving.served_model_name, max_model_len=pipe.max_model_len)

    def _loaded(self, request: Request, req: OllamaChat | OllamaGenerate, arrival: float, *, chat: bool) -> Response:
        """A request with nothing to generate loads the model (the resolver has) and says so; with keep_alive
        0 it is unloaded once idle."""
        self._life.leave(request)
        unloads = req.keep_alive is not None and parse_keep_alive(req.keep_alive) == 0
        reason: wire.DoneReason = "unload" if unloads else "load"
        obj = (wire.chat_object(req.model, content="") if chat else wire.generate_object(req.model, response=""))
        return json_response(wire.ended(obj, reason, None) | {"load_duration": int((time.monotonic() - arrival) * 1e9)})

    # ---- embeddings -----------------------------------------------------------------------------

    async def _embed(self, request: Request, pipe: ModelHandle, body: bytes, arrival: float) -> Response:
        started = time.monotonic()
        legacy = request.url.path == "/api/embeddings"
        if legacy:
            old = decode_embeddings(body)
            model, inputs, dimensions = old.model, [old.prompt], None
        else:
            new = decode_embed(body)
            model, dimensions = new.model, new.dimensions
            inputs = [new.input] if isinstance(new.input, str) else new.input
        served = pipe.serving
        # /v1/embeddings' preparation, from the same inputs: its checks (dimensions, empty inputs) and params
        prep = prepare_embeddings(msgspec.json.encode({"input": inputs, "dimensions": dimensions}),
                                  served_model_name=served.served_model_name, embedding_size=served.embedding_size,
                                  vocab_size=pipe.vocab_size, pooling=served.pooling,
                                  max_input_tokens=pipe.max_input_tokens)
        base = f"embd-{uuid.uuid4().hex}"
        request.state.response_id = base
        submits = [Submit(request_id=f"{base}-{i}", params=prep.params, text=str(x)) for i, x in enumerate(prep.inputs)]
        reader = await self._life.start(request, pipe, submits, len(body), arrival, max_choices=MAX_INPUTS)

        def body_of() -> dict[str, Any]:
            vectors = [embedding_value(c.embedding or b"", dimensions=dimensions, encoding_format="float")
                       for c in reader.choices]
            if legacy:
                return {"embedding": vectors[0]}
            num_tokens = sum(c.counts.prompt for c in reader.choices)
            now = time.monotonic()
            timings = wire.Timings(total_s=now - arrival, load_s=started - arrival, prompt_eval_s=now - started,
                                   eval_s=0.0, num_prompt_tokens=num_tokens, num_tokens=0)
            return wire.embed_body(model, [v for v in vectors if isinstance(v, list)], timings)

        return await self._life.respond(request, pipe, reader, body_of, render_error=ollama_error_response)


class OllamaRenderer(Renderer):
    """An /api/chat or /api/generate answer: one object, or NDJSON objects (no [DONE]); an engine fault is
    written `{"error": ...}`, unstreamed or as the stream's last line."""

    media_type = wire.NDJSON

    def __init__(self, *, model: str, chat: bool, tools: ToolReading | None, arrival: float) -> None:
        """`model`: the name the request gave (Ollama answers with it); `arrival`: when the body came (the
        timings count from there; the model was ready when this was made)."""
        super().__init__(f"ollama-{uuid.uuid4().hex}")
        self.model, self.chat, self.tools = model, chat, tools
        self.arrival, self.started = arrival, time.monotonic()

    def object(self, *, content: str, thinking: str = "", calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.chat:
            return wire.chat_object(self.model, content=content, thinking=thinking, calls=calls)
        return wire.generate_object(self.model, response=content, thinking=thinking)

    def final(self, reader: ChoiceReader, obj: dict[str, Any]) -> dict[str, Any]:
        choice = reader.choices[0]
        return wire.ended(obj, wire.done_reason(choice.finish_reason), self.timings(choice))

    def timings(self, choice: Choice) -> wire.Timings:
        now = time.monotonic()
        first = choice.first_token_at if choice.first_token_at is not None else now
        last = choice.last_token_at if choice.last_token_at is not None else now
        return wire.Timings(total_s=now - self.arrival, load_s=self.started - self.arrival,
                            prompt_eval_s=max(first - self.started, 0.0), eval_s=max(last - first, 0.0),
                            num_prompt_tokens=choice.counts.prompt, num_tokens=choice.counts.completion)

    def body(self, reader: ChoiceReader) -> dict[str, Any]:
        choice = reader.choices[0]
        split = choice.splitter is not None
        text, thinking = (choice.content, choice.reasoning) if split else (choice.text, "")
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            message = self.tools.read(text)
            calls, leftover = wire.tool_calls(message.tool_calls)
            text = "\n".join(t for t in (message.content or "", leftover) if t)
        return self.final(reader, self.object(content=text, thinking=thinking, calls=calls))

    def frames(self, reader: ChoiceReader) -> StreamFrames:
        return OllamaFrames(reader, self)

    def error_response(self, error: RequestError) -> Response:
        return ollama_error_response(error)


class OllamaFrames(StreamFrames):
    """The stream: an object for each delta with text (its content, or its thinking), a tool-call object
    once the calls are complete, then the final object (empty content, done, timings); an engine fault is
    an {"error": ...} line, and the stream ends there."""

    ping = wire.NDJSON_PING
    failure_ends_stream = True

    def __init__(self, reader: ChoiceReader, renderer: OllamaRenderer) -> None:
        super().__init__(reader)
        self.renderer = renderer
        self._calls = renderer.tools.reader() if renderer.tools is not None else None
        self._made: list[ToolCall] = []

    def failed(self, error: RequestError) -> Iterator[bytes]:
        yield wire.ndjson_line(wire.error_body(error.message))

    def delta(self, _index: int, delta: TextDelta, choice: Choice) -> Iterator[bytes]:    # one choice
        ended = delta.finish_reason is not None
        text, thinking = (choice.parts.content, choice.parts.reasoning) if choice.splitter is not None else (
            delta.text, "")
        if self._calls is not None:
            text = self._read_calls(self._calls, text, ended)
        if text or thinking:
            yield wire.ndjson_line(self.renderer.object(content=text, thinking=thinking))
        if not ended:
            return
        calls, leftover = wire.tool_calls(self._made)
        if calls or leftover:
            yield wire.ndjson_line(self.renderer.object(content=leftover, calls=calls))
        yield wire.ndjson_line(self.renderer.final(self.reader, self.renderer.object(content="")))

    def _read_calls(self, calls: ToolCallReader, text: str, ended: bool) -> str:
        """The content in `text`; the calls it holds are kept until the end."""
        content = []
        for event in calls.push(text) + (calls.finish() if ended else []):
            if isinstance(event, ContentDelta):
                content.append(event.text)
            elif isinstance(event, CallStart):
                self._made.append(ToolCall(event.id, event.name))
            elif isinstance(event, ArgumentsDelta):
                self._made[event.index].arguments += event.text
        return "".join(content)
