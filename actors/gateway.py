"""The HTTP gateway: starlette routes, checks at the edge, and disconnect -> Abort.

Requests are validated at the edge (forge.api) and admitted against explicit bounds before any
tokenising work (actors/admission.py). Each response's choices go to the tokeniser as Submits and are read back from
the router (actors.responses assembles the body or the SSE frames); a client that goes away, in
any phase, aborts its requests through the same path, so their blocks are freed at the next step.
Every error a request meets is a RequestError, rendered as OpenAI's error envelope.
"""

from __future__ import annotations

import functools
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectSendStream
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.admission import Admission, LoadStats
from actors.dashboard import dashboard_page
from actors.metrics import Metrics
from actors.openapi import openapi_document
from actors.responses import (
    ChoiceReader,
    CompletionShape,
    ToolReading,
    chat_body,
    chat_frames,
    completion_body,
    completion_frames,
)
from actors.router import ResponseGroup, Router
from actors.sse import SSEResponse
from actors.stats import Stats
from forge import api
from forge import api_responses as wire
from forge.api_responses import ResponseHeader
from forge.chat import ChatTemplate
from forge.errors import CapacityError, PromptTooLong, RequestError
from forge.messages import Abort, Accepted, Rejected, Submit
from forge.sampling_params import SamplingParams
from forge.structured import Grammars
from forge.tokenizer import Tokenizer
from forge.tools import Function, messages_with_tools

log = structlog.get_logger("forge.gateway")
_json = msgspec.json.Encoder()


@dataclass(slots=True)
class GatewayConfig:
    served_model_name: str = "forge"
    api_key: str | None = None
    max_body_size: int = 1 << 20
    body_timeout: float = 30.0      # seconds a request body has to arrive whole (408 after)
    max_waiting: int = 256
    max_queued_tokens: int = 262144
    sse_ping_interval: float = 5.0
    retry_after_s: int = 5
    watchdog_s: float = 60.0        # a step running longer than this turns /healthz to 503 ("stuck")


@dataclass(slots=True)
class Pipeline:
    """What the gateway talks to once the model is loaded."""
    router: Router
    to_tokeniser: MemoryObjectSendStream[Submit | Abort]
    tokenizer: Tokenizer
    template: ChatTemplate
    max_model_len: int
    load_stats: LoadStats
    grammars: Grammars
    step_age: Callable[[], float] = lambda: 0.0     # seconds the engine step in flight has run (0: none)


Handler = Callable[[Request, Pipeline, bytes, float], Awaitable[Response]]


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json", headers=headers)


def error_response(exc: RequestError) -> Response:
    return json_response(wire.error_body(exc.message, exc.type, exc.param, exc.code), exc.status, exc.headers)


class Gateway:
    def __init__(self, config: GatewayConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.pipeline: Pipeline | None = None
        self.is_draining = False
        self._stuck = False             # /healthz saw a step past the watchdog (logged once per episode)
        self.stats = Stats(metrics)
        self.admission = Admission(max_waiting=config.max_waiting, max_queued_tokens=config.max_queued_tokens,
                                   retry_after_s=config.retry_after_s)

    # ---- app --------------------------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
            Route("/stats", self.stats_route, methods=["GET"]),
            Route("/dashboard", self.dashboard, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ]
        handlers: dict[Any, Callable[[Request, Any], Awaitable[Response]]] = {
            HTTPException: self._http_exception, RequestError: self._request_error, Exception: self._unexpected}
        return Starlette(routes=routes, exception_handlers=handlers)

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        message = {404: f"route {request.url.path} not found", 405: "method not allowed"}.get(
            exc.status_code, str(exc.detail))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return json_response(wire.error_body(message, kind), exc.status_code)

    async def _request_error(self, _request: Request, exc: RequestError) -> Response:
        self.metrics.request_rejected.labels(reason=_rejection_reason(exc)).inc()
        return error_response(exc)

    async def _unexpected(self, request: Request, _exc: Exception) -> Response:
        log.exception("request_failed", path=request.url.path)
        return json_response(wire.error_body("internal error", "server_error"), 500)

    # ---- edge checks ------------------------------------------------------------------------

    def _check_key(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise RequestError("invalid or missing API key", status=401, type="authentication_error",
                               code="invalid_api_key")

    def _ready(self, request: Request) -> Pipeline:
        self._check_key(request)
        if self.is_draining:
            raise CapacityError("the server is shutting down", code="draining",
                                retry_after_s=self.config.retry_after_s)
        if self.pipeline is None:
            raise CapacityError("the model is loading", code="loading", retry_after_s=self.config.retry_after_s)
        return self.pipeline

    async def _body(self, request: Request) -> bytes:
        limit = self.config.max_body_size
        too_large = RequestError(f"request body over {limit} bytes", status=413, code="body_too_large")
        # Up to max_drain bytes are read and dropped before the 413: closing a connection with
        # unread data resets it, and the client would see a reset instead of the 413.
        max_drain = 4 * limit
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_drain:
            raise too_large
        chunks, size = [], 0
        # A body that never ends (a stalled or hostile client) holds a handler and a connection:
        # it has body_timeout seconds to arrive whole, then gets a 408 and the connection closes.
        with anyio.move_on_after(self.config.body_timeout) as scope:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_drain:
                    raise too_large
                if size <= limit:
                    chunks.append(chunk)
        if scope.cancelled_caught:
            raise RequestError(f"the request body did not arrive within {self.config.body_timeout:g} s",
                               status=408, code="body_timeout", headers={"Connection": "close"})
        if size > limit:
            raise too_large
        return b"".join(chunks)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise RequestError(f"the model '{model}' does not exist", param="model", status=404,
                               code="model_not_found")

    # ---- plain routes -----------------------------------------------------------------------

    def _health(self) -> dict[str, Any]:
        """{"status": "ok" | "loading" | "draining" | "stuck", ...}: what /healthz and /stats say."""
        if self.is_draining:
            return {"status": "draining"}
        if self.pipeline is None:
            return {"status": "loading"}
        age = self.pipeline.step_age()
        if age > self.config.watchdog_s:
            if not self._stuck:
                log.error("step_stuck", step_seconds=round(age, 1), watchdog_s=self.config.watchdog_s)
            self._stuck = True
            return {"status": "stuck", "step_seconds": round(age, 1)}
        if self._stuck:
            log.info("step_unstuck")
            self._stuck = False
        return {"status": "ok"}

    async def healthz(self, _request: Request) -> Response:
        health = self._health()
        return json_response(health, 200 if health["status"] == "ok" else 503)

    async def metrics_route(self, request: Request) -> Response:
        self._check_key(request)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def stats_route(self, request: Request) -> Response:
        self._check_key(request)
        return json_response(self.stats.snapshot(self._health()["status"]), headers={"Cache-Control": "no-store"})

    async def openapi(self, request: Request) -> Response:
        self._check_key(request)
        return json_response(openapi_document())

    async def dashboard(self, _request: Request) -> Response:
        """The page itself holds no data (the key is asked for by the page, for /stats), so it is
        served without one; its script runs under a content security policy that allows only it."""
        page = dashboard_page()
        return Response(page.html, media_type="text/html; charset=utf-8", headers=page.headers)

    async def models(self, request: Request) -> Response:
        pipe = self._ready(request)
        card = wire.model_card(self.config.served_model_name, created=0, max_model_len=pipe.max_model_len)
        return json_response(wire.model_list([card]))

    async def tokenize(self, request: Request) -> Response:
        pipe = self._ready(request)
        req = api.decode_tokenize(await self._body(request))
        self._check_model(req.model)
        if req.messages is not None:
            messages, template_tools = _prompt_messages(pipe, req.messages, api.functions(req.tools))
            text = pipe.template.render(messages, add_generation_prompt=req.add_generation_prompt,
                                        tools=template_tools)
            ids = pipe.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = pipe.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": pipe.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        pipe = self._ready(request)
        req = api.decode_detokenize(await self._body(request))
        self._check_model(req.model)
        vocab = pipe.tokenizer.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise RequestError(f"token ids must lie in [0, {vocab})", param="tokens")
        return json_response({"prompt": pipe.tokenizer.decode(req.tokens)})

    # ---- generation -------------------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        return await self._run(request, self._generate)

    async def completions(self, request: Request) -> Response:
        return await self._run(request, self._completions)

    async def chat_completions(self, request: Request) -> Response:
        return await self._run(request, self._chat)

    async def _run(self, request: Request, handler: Handler) -> Response:
        """Count the request in flight from its body until its response is done (or it fails).

        A handler that returns has counted its request out (a JSON body) or will when its stream
        ends (SSE); one that raises has not, and it is counted out here, exactly once.
        """
        pipe = self._ready(request)
        body = await self._body(request)
        arrival = time.monotonic()
        self.admission.enter()
        try:
            return await handler(request, pipe, body, arrival)
        except BaseException:
            self.admission.leave()
            raise

    async def _generate(self, request: Request, pipe: Pipeline, body: bytes, arrival: float) -> Response:
        req = api.decode_generate(body)
        params = msgspec.structs.replace(api.to_sampling_params(req, default_max_tokens=32), temperature=0.0)
        rid = f"{wire.new_request_id('cmpl')}-0"
        request.state.response_id = rid.removesuffix("-0")
        reader = await self._start(request, pipe, [Submit(request_id=rid, params=params, text=req.prompt)],
                                    len(body), arrival)
        return await self._respond(request, pipe, reader, lambda: {
            "text": reader.choices[0].text, "prompt_tokens": reader.choices[0].num_prompt_tokens,
            "completion_tokens": reader.choices[0].num_completion_tokens})

    async def _completions(self, request: Request, pipe: Pipeline, body: bytes, arrival: float) -> Response:
        req = api.decode_completion(body)
        self._check_model(req.model)
        params = api.to_sampling_params(req, default_max_tokens=16, grammar=await self._grammar(pipe, req))
        prompts = api.completion_prompts(req)
        n, base = req.n, wire.new_request_id("cmpl")
        request.state.response_id = base
        submits = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                rid, p = f"{base}-{i * n + j}", _params_for(params, j)
                if isinstance(prompt, str):
                    submits.append(Submit(request_id=rid, params=p, text=prompt))
                else:
                    submits.append(Submit(request_id=rid, params=p, token_ids=tuple(prompt)))
        reader = await self._start(request, pipe, submits, len(body), arrival)
        echoes = [_echo_text(pipe, prompts[k // n]) if req.echo else "" for k in range(len(submits))]
        shape = CompletionShape(header=self._header(base, req.include_usage), n=n, echoes=echoes,
                                want_logprobs=req.logprobs is not None)
        if req.stream:
            return self._sse(request, pipe, reader, completion_frames(reader, shape))
        return await self._respond(request, pipe, reader, lambda: completion_body(reader, shape))

    async def _chat(self, request: Request, pipe: Pipeline, body: bytes, arrival: float) -> Response:
        req = api.decode_chat(body)
        self._check_model(req.model)
        params = api.to_sampling_params(req, default_max_tokens=max(1, pipe.max_model_len),
                                        grammar=await self._grammar(pipe, req))
        functions = api.request_functions(req)
        messages, template_tools = _prompt_messages(pipe, req.messages, functions)
        base = wire.new_request_id("chatcmpl")
        request.state.response_id = base
        submits = [Submit(request_id=f"{base}-{j}", params=_params_for(params, j), messages=messages,
                          tools=template_tools) for j in range(req.n)]
        reader = await self._start(request, pipe, submits, len(body), arrival)
        header = self._header(base, req.include_usage)
        want_logprobs = params.logprobs is not None
        tools = ToolReading(max_calls=None if req.parallel_tool_calls else 1) if functions else None
        if req.stream:
            return self._sse(request, pipe, reader,
                             chat_frames(reader, header, want_logprobs=want_logprobs, tools=tools))
        return await self._respond(request, pipe, reader,
                                   lambda: chat_body(reader, header, want_logprobs=want_logprobs, tools=tools))

    async def _grammar(self, pipe: Pipeline, req: api.CompletionRequest | api.ChatCompletionRequest) -> str | None:
        """The request's constraint as grammar text, checked against the vocabulary off the event loop
        (a large schema may take a while to compile); None without one."""
        constraint = api.request_constraint(req)
        if constraint is None:
            return None
        await anyio.to_thread.run_sync(functools.partial(pipe.grammars.check, constraint.grammar,
                                                         param=constraint.param))
        return constraint.grammar

    def _header(self, base: str, include_usage: bool) -> ResponseHeader:
        return ResponseHeader(request_id=base, created=int(time.time()), model=self.config.served_model_name,
                              include_usage=include_usage)

    # ---- a response's lifetime --------------------------------------------------------------

    async def _start(self, request: Request, pipe: Pipeline, submits: list[Submit], num_bytes: int,
                     arrival: float) -> ChoiceReader:
        """Admit the response (or 503), open its streams, submit its choices, wait for the verdicts."""
        with self.admission.admitting(pipe.load_stats, len(submits), num_bytes // 4):
            group = pipe.router.open([s.request_id for s in submits])
            try:
                for s in submits:
                    pipe.to_tokeniser.send_nowait(s)
                statuses = await group.wait_statuses()
            except BaseException:
                self._abort(pipe, group)
                raise
        rejected = next((s for s in statuses if isinstance(s, Rejected)), None)
        if rejected is not None:
            self._abort(pipe, group)
            raise rejected.error()
        request.state.prompt_tokens = sum(s.num_prompt_tokens for s in statuses if isinstance(s, Accepted))
        return ChoiceReader(group, self.metrics, arrival=arrival, ping_interval=self.config.sse_ping_interval)

    async def _respond(self, request: Request, pipe: Pipeline, reader: ChoiceReader,
                       build: Callable[[], Any]) -> Response:
        """One JSON body once every choice has ended. (If this raises, _run counts the request out.)"""
        try:
            await reader.collect(request)
        finally:
            self._abort(pipe, reader.group)
        request.state.completion_tokens = reader.num_completion_tokens
        failure = reader.failure()
        response = error_response(failure) if failure is not None else json_response(build())
        self.admission.leave()
        return response

    def _sse(self, request: Request, pipe: Pipeline, reader: ChoiceReader,
             frames: AsyncIterator[bytes]) -> SSEResponse:
        async def body() -> AsyncIterator[bytes]:
            async for frame in frames:
                yield frame
            yield wire.SSE_DONE

        def cleanup() -> None:
            self._abort(pipe, reader.group)
            request.state.completion_tokens = reader.num_completion_tokens
            self.admission.leave()

        return SSEResponse(body(), cleanup)

    def _abort(self, pipe: Pipeline, group: ResponseGroup) -> None:
        """Stop reading the group; its unfinished requests are dropped behind their Submits."""
        pipe.router.close(group)
        for i in sorted(group.unfinished):
            try:
                pipe.to_tokeniser.send_nowait(Abort(request_id=group.request_ids[i]))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return                        # the daemon stopped (drain timed out): nothing to free



def _rejection_reason(exc: RequestError) -> str:
    """forge:request_rejected_total's reason: overload, draining (or loading), too_long, auth, invalid."""
    if exc.status == 401:
        return "auth"
    if exc.status == 503:                 # a CapacityError, or one relayed from the engine as data
        return "draining" if exc.code in ("draining", "loading") else "overload"
    if exc.code == PromptTooLong.code:
        return "too_long"
    return "invalid"


def _params_for(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th choice's parameters: a seeded request's choices differ by their seeds."""
    if j == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=params.seed + j)


def _prompt_messages(pipe: Pipeline, messages: list[api.ChatMessage], functions: list[Function],
                     ) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...] | None]:
    """Messages (and tools) as the chat template gets them: a template that reads tools renders them and
    tool turns itself; for any other, tools and tool turns are written in forge's format."""
    entries = api.chat_template_messages(messages)
    if pipe.template.supports_tools:
        return tuple(entries), tuple(f.as_tool() for f in functions) or None
    if functions or any(m["role"] == "tool" or "tool_calls" in m for m in entries):
        entries = messages_with_tools(entries, functions)
    return tuple(entries), None


def _echo_text(pipe: Pipeline, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else pipe.tokenizer.decode(prompt)
