"""The HTTP gateway: starlette routes, checks at the edge, and disconnect -> Abort.

Requests are validated at the edge (forge.api.openai.openai_schema) and admitted against explicit bounds
before any tokenizing work (actors/http/admission.py). Each response's choices go to the tokenizer as
Submits and are read back from the stream demultiplexer (actors.http.lifetime admits, submits and reads them;
a chat runs the one generation route, actors.http.generation; actors.http.openai_render writes OpenAI's
bodies and SSE frames); a client that goes away, in any phase, aborts its requests through the same path,
so their blocks are freed at the next step.
Every error a request meets is a RequestError, rendered as OpenAI's error envelope.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route

from actors.http.admission import Admission
from actors.http.browser_guard import BrowserGuard, BrowserPolicy
from actors.http.edge import check_key, error_response_for, json_response, read_body, rejection_reason
from actors.http.generation import ToolReading, generate_chat, params_for
from actors.http.lifetime import DEFAULT_MAX_UNSENT_TOKENS, ResponseLifetime
from actors.http.openai_render import ChatRenderer, CompletionFrames, CompletionShape, completion_body
from actors.http.openapi import openapi_document
from actors.http.routes.anthropic_route import MessagesRoutes
from actors.http.routes.embeddings_route import EmbeddingsRoutes
from actors.http.routes.models_route import ModelRoutes, peek
from actors.http.routes.responses_route import ResponsesRoutes
from actors.http.routes.text_routes import TextRoutes
from actors.ops.dashboard import dashboard_page
from actors.ops.fleet import FleetRoutes
from actors.ops.metrics import Metrics
from actors.ops.stats import Stats
from actors.runtime.model_handle import ModelHandle
from actors.runtime.model_set import ModelSet, parse_keep_alive
from forge.api.openai import openai_output as wire
from forge.api.openai.openai_output import ResponseHeader
from forge.api.openai.openai_prepare import prepare_chat, prepare_completion, prepare_generate
from forge.api.responses.responses_store import DEFAULT_MAX_RESPONSES, DEFAULT_TTL_S, ResponseStore
from forge.errors import CapacityError, RequestError
from forge.messages import Submit

log = structlog.get_logger("forge.gateway")


@dataclass(slots=True)
class GatewayConfig:
    served_model_name: str = "forge"
    api_key: str | None = None
    max_body_size: int = 1 << 20
    body_timeout: float = 30.0      # seconds a request body has to arrive whole (408 after)
    max_waiting: int = 256
    max_queued_tokens: int = 262144
    sse_ping_interval: float = 5.0
    max_unsent_tokens: int = DEFAULT_MAX_UNSENT_TOKENS   # a response's tokens waiting for a client that stopped reading
    retry_after_s: int = 5
    watchdog_s: float = 60.0        # a step running longer than this turns /healthz to 503 ("stuck")
    responses_store_size: int = DEFAULT_MAX_RESPONSES     # stored responses (POST /v1/responses, store: true)
    responses_ttl_s: float = DEFAULT_TTL_S                # seconds a stored response is kept
    browser: BrowserPolicy = BrowserPolicy()              # the Host, Origin and Content-Type checks


class Gateway:
    def __init__(self, config: GatewayConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.handle: ModelHandle | None = None
        self.model_set: ModelSet | None = None    # several models: routed by each request's `model`
        self.is_draining = False
        self._stuck = False             # /healthz saw a step past the watchdog (logged once per episode)
        self.stats = Stats(metrics)
        self.fleet = FleetRoutes(ready=self._ready, body=self._body, healthz=self.healthz,
                                 served_model_name=config.served_model_name, total_load=self._total_load,
                                 resolve=self._model_and_body)
        self.admission = Admission(max_waiting=config.max_waiting, max_queued_tokens=config.max_queued_tokens,
                                   retry_after_s=config.retry_after_s)
        self.life = ResponseLifetime(self.admission, ready=self._ready, body=self._body,
                                     ping_interval=config.sse_ping_interval, route=self._route,
                                     release=self._release, is_routed=lambda: self.model_set is not None,
                                     check_open=self._check_open, max_unsent_tokens=config.max_unsent_tokens)
        self.messages = MessagesRoutes(self.life, resolve=self._model_and_body)
        self.responses = ResponsesRoutes(self.life, authorize=self._check_key,
                                         store=ResponseStore(max_responses=config.responses_store_size,
                                                             ttl_s=config.responses_ttl_s))
        self.embeddings = EmbeddingsRoutes(self.life)
        self.text_routes = TextRoutes(resolve=self._model_and_body)
        self.model_routes = ModelRoutes(model_set=lambda: self.model_set, check_open=self._check_open, body=self._body)

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
            *self.text_routes.routes(),
            *self.messages.routes(),
            *self.responses.routes(),
            *self.embeddings.routes(),
            *self.fleet.routes(),
            *self.model_routes.routes(),
        ]
        handlers: dict[Any, Callable[[Request, Any], Awaitable[Response]]] = {
            HTTPException: self._http_exception, RequestError: self._request_error, Exception: self._unexpected}
        policy = self.config.browser
        middleware = [Middleware(BrowserGuard, policy=policy, on_refused=self._count_refused)]
        if policy.allowed_origins:
            # Only origins the guard let through get here; those listed get CORS, preflights included.
            middleware.append(Middleware(CORSMiddleware, allow_origins=policy.allowed_origins,
                                         allow_methods=("GET", "POST", "DELETE"), allow_headers=("*",),
                                         expose_headers=("X-Request-ID", "Retry-After"),
                                         allow_private_network=True))
        app = Starlette(routes=routes, exception_handlers=handlers, middleware=middleware)
        # /healthz/ is a 404, not a redirect: starlette's would point at whatever the Host header named.
        app.router.redirect_slashes = False
        return app

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        message = {404: f"route {request.url.path} not found{_slash_hint(request)}", 405: "method not allowed"}.get(
            exc.status_code, str(exc.detail))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response_for(request.url.path, RequestError(message, status=exc.status_code, type=kind))

    async def _request_error(self, request: Request, exc: RequestError) -> Response:
        self._count_refused(exc)
        return error_response_for(request.url.path, exc)

    def _count_refused(self, exc: RequestError) -> None:
        self.metrics.request_rejected.labels(reason=rejection_reason(exc)).inc()

    async def _unexpected(self, request: Request, _exc: Exception) -> Response:
        log.exception("request_failed", path=request.url.path)
        return error_response_for(request.url.path, RequestError("internal error", status=500, type="server_error"))

    # ---- edge checks ------------------------------------------------------------------------

    def _check_key(self, request: Request) -> None:
        check_key(request, self.config.api_key)

    def _check_open(self, request: Request) -> None:
        self._check_key(request)
        if self.is_draining:
            raise CapacityError("the server is shutting down", code="draining",
                                retry_after_s=self.config.retry_after_s)

    def _ready(self, request: Request) -> ModelHandle:
        self._check_open(request)
        if self.model_set is not None:            # a route that names no model: the one used last
            recent = self.model_set.most_recent()
            if recent is not None and recent.actors is not None:
                return recent.actors.handle
        if self.handle is None:
            raise CapacityError("the model is loading", code="loading", retry_after_s=self.config.retry_after_s)
        return self.handle

    async def _route(self, request: Request, body: bytes) -> ModelHandle | None:
        """With several models: the pipeline of the model the body names (loaded first if need be),
        counted in use until `_release`; None with one model (the route's `_ready` pipeline serves)."""
        models = self.model_set
        if models is None:
            return None
        peeked = peek(body)
        model_id = peeked.model if isinstance(peeked.model, str) else None
        if model_id is None:
            recent = models.most_recent()
            model_id = recent.model_id if recent is not None else next(iter(models.entries))
        entry = models.entry(model_id)              # 404 naming the available ids
        request.state.model_name = model_id         # for the access log, whatever happens next
        keep_alive = peeked.keep_alive if peeked.keep_alive is not None else request.headers.get("x-keep-alive")
        if keep_alive is not None:
            entry.keep_alive = parse_keep_alive(keep_alive)
        # Waiting for a load counts against the admission bounds like a queued request (503 past them).
        with self.admission.admitting(lambda: (0, 0), 1, len(body) // 4):
            wired = await models.acquire(model_id)
        request.state.model_lease = model_id         # held until _release
        return wired.handle

    @asynccontextmanager
    async def _model_and_body(self, request: Request) -> AsyncIterator[tuple[ModelHandle, bytes]]:
        """lifetime.ResolveModel: the body, and the model it names as a generation route would find it (with
        several models: loaded if need be, and held until the block ends)."""
        self._check_open(request)
        body = await self._body(request)
        handle = await self._route(request, body)
        if handle is None:
            yield self._ready(request), body
            return
        try:
            yield handle, body
        finally:
            self._release(request)

    def _total_load(self, request: Request) -> int:
        """Sequences running and waiting, summed over every loaded model (a router's /get_load)."""
        if self.model_set is None:
            return self._ready(request).load()
        self._check_open(request)
        return sum(e.actors.handle.load() for e in self.model_set.loaded() if e.actors is not None)

    def _release(self, request: Request) -> None:
        model_id = getattr(request.state, "model_lease", None)
        if self.model_set is not None and model_id is not None:
            request.state.model_lease = None
            self.model_set.release(model_id)

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.config.max_body_size, self.config.body_timeout)

    # ---- plain routes -----------------------------------------------------------------------

    def _health(self) -> dict[str, Any]:
        """{"status": "ok" | "loading" | "draining" | "stuck", ...}: what /healthz and /stats say."""
        if self.is_draining:
            return {"status": "draining"}
        if self.model_set is not None:         # several models: up while any step is alive, none loaded included
            ages = [e.actors.handle.step_age() for e in self.model_set.loaded() if e.actors is not None]
            age = max(ages, default=0.0)
        elif self.handle is None:
            return {"status": "loading"}
        else:
            age = self.handle.step_age()
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
        snapshot = self.stats.snapshot(self._health()["status"])
        if self.model_set is not None:
            snapshot["models"] = self.model_set.statistics()
        return json_response(snapshot, headers={"Cache-Control": "no-store"})

    async def openapi(self, request: Request) -> Response:
        self._check_key(request)
        return json_response(openapi_document())

    async def dashboard(self, _request: Request) -> Response:
        """The page itself holds no data (the key is asked for by the page, for /stats), so it is
        served without one; its script runs under a content security policy that allows only it."""
        page = dashboard_page()
        return Response(page.html, media_type="text/html; charset=utf-8", headers=page.headers)

    async def models(self, request: Request) -> Response:
        if self.model_set is not None:
            self._check_open(request)
            cards = []
            for entry in self.model_set.entries.values():
                card = wire.model_card(entry.model_id, created=0, max_model_len=0)
                card.update(entry.card())
                if card["max_model_len"] == 0:
                    card["max_model_len"] = None        # not known until it loads
                cards.append(card)
            return json_response(wire.model_list(cards))
        pipe = self._ready(request)
        card = wire.model_card(self.config.served_model_name, created=0, max_model_len=pipe.max_model_len)
        return json_response(wire.model_list([card]))

    # ---- generation -------------------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        return await self.life.run(request, self._generate)

    async def completions(self, request: Request) -> Response:
        return await self.life.run(request, self._completions)

    async def chat_completions(self, request: Request) -> Response:
        return await self.life.run(request, self._chat)

    async def _generate(self, request: Request, pipe: ModelHandle, body: bytes, arrival: float) -> Response:
        req, params = prepare_generate(body)
        rid = f"{wire.new_request_id('cmpl')}-0"
        request.state.response_id = rid.removesuffix("-0")
        reader = await self.life.start(request, pipe, [Submit(request_id=rid, params=params, text=req.prompt)],
                                    len(body), arrival)
        return await self.life.respond(request, pipe, reader, lambda: {
            "text": reader.choices[0].text, "prompt_tokens": reader.choices[0].counts.prompt,
            "completion_tokens": reader.choices[0].counts.completion})

    async def _completions(self, request: Request, pipe: ModelHandle, body: bytes, arrival: float) -> Response:
        prep = prepare_completion(body, served_model_name=pipe.serving.served_model_name)
        await self.life.check_constraint(pipe, prep.constraint)
        req, params, prompts = prep.request, prep.params, prep.prompts
        n, base = req.n, wire.new_request_id("cmpl")
        request.state.response_id = base
        # Before a Submit is built: a body of a million one-character prompts is refused, not materialised
        self.admission.window(len(prompts) * n, len(body) // 4)
        submits = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                rid, p = f"{base}-{i * n + j}", params_for(params, j)
                if isinstance(prompt, str):
                    submits.append(Submit(request_id=rid, params=p, text=prompt))
                else:
                    submits.append(Submit(request_id=rid, params=p, token_ids=tuple(prompt)))
        reader = await self.life.start(request, pipe, submits, len(body), arrival)
        echoes = [_echo_text(pipe, prompts[k // n]) if req.echo else "" for k in range(len(submits))]
        shape = CompletionShape(header=self._header(pipe, base, req.include_usage), n=n, echoes=echoes,
                                want_logprobs=req.logprobs is not None)
        if req.stream:
            return self.life.sse(request, pipe, reader, CompletionFrames(reader, shape).stream())
        return await self.life.respond(request, pipe, reader, lambda: completion_body(reader, shape))

    async def _chat(self, request: Request, pipe: ModelHandle, body: bytes, arrival: float) -> Response:
        prep = prepare_chat(body, served_model_name=pipe.serving.served_model_name, max_model_len=pipe.max_model_len)
        req = prep.request
        tools = ToolReading(max_calls=None if req.parallel_tool_calls else 1) if prep.functions else None
        return await generate_chat(self.life, request, pipe, prep, lambda: ChatRenderer(
            self._header(pipe, wire.new_request_id("chatcmpl"), req.include_usage),
            want_logprobs=prep.params.logprobs is not None, tools=tools), num_bytes=len(body), arrival=arrival)

    def _header(self, pipe: ModelHandle, base: str, include_usage: bool) -> ResponseHeader:
        return ResponseHeader(request_id=base, created=int(time.time()), model=pipe.serving.served_model_name,
                              include_usage=include_usage)


def _slash_hint(request: Request) -> str:
    """' (/healthz is one)' when the path with or without its trailing slash is a route."""
    path = request.url.path
    other = path.rstrip("/") if path.endswith("/") else path + "/"
    scope = {**request.scope, "path": other}
    if other and any(route.matches(scope)[0] != Match.NONE for route in request.app.router.routes):
        return f" ({other} is one)"
    return ""


def _echo_text(pipe: ModelHandle, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else pipe.tokenizer.decode(prompt)
