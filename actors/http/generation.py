"""The one generation route every chat-like wire format runs: chat completions, the Messages API, the Responses API.

Each of them is a chat request in its own wire format, prepared by its schema into the same PreparedChat
(forge/api/openai/openai_prepare.py); from there the route is one: check the output constraint against the
vocabulary, follow the model's thinking section, render the messages and tools for the chat template, build
one Submit per choice, admit and start them (actors/http/lifetime.py), split each choice's reasoning from its
content, and answer with one JSON body or an event stream. A route supplies only its preparation and a
Renderer: the id its response goes by, its body, its stream's frames (actors/http/stream_writer.py) and the
envelope its errors are written in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actors.http.choice_reader import ChoiceReader
from actors.http.edge import error_response
from actors.http.lifetime import ResponseLifetime
from actors.http.stream_writer import StreamFrames
from actors.runtime.model_handle import ModelHandle
from forge.api.openai.openai_prepare import PreparedChat, template_messages
from forge.errors import RequestError
from forge.messages import Submit
from forge.sampling.sampling_params import SamplingParams
from forge.text.tool_reader import ParsedMessage, ToolCallReader, read_message


@dataclass(frozen=True, slots=True)
class ToolReading:
    """Tool calls are read out of each choice's text (forge.text.tool_reader); at most max_calls per choice.
    `strict`: the call grammar constrained the text (tool_choice required or named), so the reader follows
    the calls' JSON without the fallback that unconstrained output needs."""
    max_calls: int | None = None
    strict: bool = False

    @classmethod
    def of(cls, prep: PreparedChat, *, max_calls: int | None = None) -> ToolReading | None:
        """How a prepared chat's choices are read: None when it shows the model no tools."""
        if not prep.functions:
            return None
        return cls(max_calls, strict=prep.constraint is not None and prep.constraint.param == "tools")

    def reader(self) -> ToolCallReader:
        """A reader for one choice's text, delta by delta."""
        return ToolCallReader(max_calls=self.max_calls, strict=self.strict)

    def read(self, text: str) -> ParsedMessage:
        """One choice's whole text as content and calls."""
        return read_message(text, max_calls=self.max_calls, strict=self.strict)


class Renderer(ABC):
    """One wire format's answer to a chat request: the id its response goes by (its choices' request ids are
    `<id>-<j>`), its one JSON body once every choice has ended, or its stream."""

    done: bytes | None = None           # what ends a stream after its frames (OpenAI's [DONE]; None: nothing)
    media_type = "text/event-stream"    # its stream's (Ollama's: NDJSON)

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id

    @abstractmethod
    def body(self, reader: ChoiceReader) -> dict[str, Any]:
        """The response, every choice ended."""

    @abstractmethod
    def frames(self, reader: ChoiceReader) -> StreamFrames:
        """The response's stream."""

    def error_response(self, error: RequestError) -> Response:
        """The engine's failure, unstreamed (OpenAI's envelope unless the format has its own)."""
        return error_response(error)


async def generate_chat(life: ResponseLifetime, request: Request, pipe: ModelHandle, prep: PreparedChat,
                        answer: Callable[[], Renderer], *, num_bytes: int, arrival: float) -> Response:
    """Run a prepared chat request (`num_bytes`: its body's size, `arrival`: when it came) and answer it as
    `answer` renders it, made once the request is known good (its id drawn, its time stamped) and before its
    choices start. Raises what check_constraint and life.start raise, the lifetime's errors."""
    req = prep.request
    await life.check_constraint(pipe, prep.constraint)
    params, reasoning = pipe.thinking(prep)
    messages, template_tools = template_messages(pipe.template.supports_tools, prep.messages, prep.functions)
    renderer = answer()
    base = renderer.response_id
    request.state.response_id = base
    submits = [Submit(request_id=f"{base}-{j}", params=params_for(params, j), messages=messages,
                      tools=template_tools, template_kwargs=pipe.template_kwargs(prep)) for j in range(req.n)]
    reader = await life.start(request, pipe, submits, num_bytes, arrival)
    reader.split_reasoning(reasoning)
    if req.stream:
        return life.sse(request, pipe, reader, renderer.frames(reader).stream(), done=renderer.done,
                        media_type=renderer.media_type)
    return await life.respond(request, pipe, reader, lambda: renderer.body(reader),
                              render_error=renderer.error_response)


def params_for(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th choice's parameters: a seeded request's choices differ by their seeds, seed + j wrapped in
    signed 64 bits (2^63 - 1 then -2^63), so that every seed the API takes serves any n."""
    if j == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + j + 2**63) % 2**64 - 2**63)
