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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
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
from actors.http.edge import error_response_for, json_response, rejection_reason
from actors.http.generation import ToolReading, generate_chat, params_for
from actors.http.lifetime import DEFAULT_MAX_UNSENT_TOKENS, ResponseLifetime
from actors.http.model_resolver import ModelResolver
from actors.http.openai_render import ChatRenderer, CompletionFrames, CompletionShape, completion_body
from actors.http.openapi import openapi_document
from actors.http.routes.anthropic_route import MessagesRoutes
from actors.http.routes.embeddings_route import EmbeddingsRoutes
from actors.http.routes.models_route import ModelRoutes
from actors.http.routes.ollama_models_route import OllamaModelRoutes
from actors.http.routes.ollama_route import OllamaRoutes
from actors.http.routes.responses_route import ResponsesRoutes
from actors.http.routes.text_routes import TextRoutes
from actors.http.tenant_limits import TenantGate
from actors.http.tenants import TenantTable
from actors.ops.dashboard import dashboard_page
from actors.ops.fleet import FleetRoutes
from actors.ops.metrics import Metrics
from actors.ops.stats import Sources, Stats
from actors.runtime.model_handle import ModelHandle
from actors.runtime.model_set import ModelSet
from forge.api.openai import openai_output as wire
from forge.api.openai.openai_output import ResponseHeader
from forge.api.openai.openai_prepare import prepare_chat, prepare_completion, prepare_generate
from forge.api.responses.responses_store import DEFAULT_MAX_RESPONSES, DEFAULT_TTL_S, ResponseStore
from forge.errors import RequestError
from forge.messages import Submit

log = structlog.get_logger("forge.gateway")


@dataclass(slots=True)
class GatewayConfig:
    served_model_name: str = "forge"
    api_key: str | None = None
    tenants: TenantTable | None = None   # --api-keys-file's tenants (actors/http/tenants.py); None: api_key alone
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
        self._stuck = False             # /healthz saw a step past the watchdog (logged once per episode)
        self.stats = Stats(metrics, sources=self._stats_sources)
        self.admission = Admission(max_waiting=config.max_waiting, max_queued_tokens=config.max_queued_tokens,
                                   retry_after_s=config.retry_after_s)
        self.tenants = TenantGate(config.tenants, api_key=config.api_key, metrics=metrics)
        self.resolver = ModelResolver(self.admission, tenants=self.tenants, max_body_size=config.max_body_size,
                                      body_timeout=config.body_timeout, retry_after_s=config.retry_after_s)
        self.fleet = FleetRoutes(self.resolver, healthz=self.healthz, total_load=self._total_load)
        self.life = ResponseLifetime(self.admission, self.resolver, ping_interval=config.sse_ping_interval,
                                     max_unsent_tokens=config.max_unsent_tokens)
        self.messages = MessagesRoutes(self.life, resolve=self.resolver.resolve)
        self.responses = ResponsesRoutes(self.life, authorize=self.resolver.check_key,
                                         store=ResponseStore(max_responses=config.responses_store_size,
                                                             ttl_s=config.responses_ttl_s))
        self.embeddings = EmbeddingsRoutes(self.life)
        self.text_routes = TextRoutes(resolve=self.resolver.resolve)
        self.model_routes = ModelRoutes(self.resolver)
        self.ollama = OllamaRoutes(self.life)
        self.ollama_models = OllamaModelRoutes(self.resolver)

    @property
    def model_set(self) -> ModelSet | None:
        """The models served (one model served is a set of one); None until they are ready."""
        return self.resolver.models

    @model_set.setter
    def model_set(self, models: ModelSet | None) -> None:
        self.resolver.models = models

    @property
    def is_draining(self) -> bool:
        return self.resolver.is_draining

    @is_draining.setter
    def is_draining(self, value: bool) -> None:
        self.resolver.is_draining = value

    # ---- app --------------------------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
            Route("/stats", self.stats_route, methods=["GET"]),
            Route("/dashboard", self.dashboard, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            *self.text_routes.routes(),
            *self.messages.routes(),
            *self.responses.routes(),
            *self.embeddings.routes(),
            *self.fleet.routes(),
            *self.model_routes.routes(),
            *self.ollama.routes(),
            *self.ollama_models.routes(),
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
        return error_response_for(request.url.path, RequestError(message, status=exc.status_code, type=kind),
                                  request.headers)

    async def _request_error(self, request: Request, exc: RequestError) -> Response:
        self._count_refused(exc)
        return error_response_for(request.url.path, exc, request.headers)

    def _count_refused(self, exc: RequestError) -> None:
        self.metrics.request_rejected.labels(reason=rejection_reason(exc)).inc()

    async def _unexpected(self, request: Request, _exc: Exception) -> Response:
        log.exception("request_failed", path=request.url.path)
        return error_response_for(request.url.path, RequestError("internal error", status=500, type="server_error"),
                                  request.headers)

    def _total_load(self, request: Request) -> int:
        """Sequences running and waiting, summed over every loaded model (a router's /get_load)."""
        self.resolver.check_open(request)
        return sum(actors.handle.load() for actors in self.resolver.loaded())

    def _stats_sources(self) -> Sources | None:
        """What the dashboard reads: the generation model used last (none before one is loaded)."""
        models = self.resolver.models
        recent = models.most_recent() if models is not None else None
        actors = recent.actors if recent is not None else None
        if actors is None or actors.scheduler is None or actors.allocator is None:
            return None
        return Sources(scheduler=actors.scheduler.statistics, cache=actors.allocator.statistics,
                       block_map=actors.allocator.block_map, serving=msgspec.to_builtins(actors.served))

    # ---- plain routes -----------------------------------------------------------------------

    def _health(self) -> dict[str, Any]:
        """{"status": "ok" | "loading" | "draining" | "stuck", ...}: what /healthz and /stats say."""
        if self.is_draining:
            return {"status": "draining"}
        if self.model_set is None:
            return {"status": "loading"}
        stuck = self.stuck_step_s()
        return {"status": "stuck", "step_seconds": round(stuck, 1)} if stuck is not None else {"status": "ok"}

    def stuck_step_s(self) -> float | None:
        """How long the oldest running step has run, if past the watchdog (None: every loaded model's step
        is alive, none loaded included). /healthz's "stuck" and systemd's watchdog pings read this."""
        age = max((actors.handle.step_age() for actors in self.resolver.loaded()), default=0.0)
        if age > self.config.watchdog_s:
            if not self._stuck:
                log.error("step_stuck", step_seconds=round(age, 1), watchdog_s=self.config.watchdog_s)
            self._stuck = True
            return age
        if self._stuck:
            log.info("step_unstuck")
            self._stuck = False
        return None

    async def healthz(self, _request: Request) -> Response:
        health = self._health()
        return json_response(health, 200 if health["status"] == "ok" else 503)

    async def metrics_route(self, request: Request) -> Response:
        self.resolver.check_key(request)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def stats_route(self, request: Request) -> Response:
        self.resolver.check_key(request)
        snapshot = self.stats.snapshot(self._health()["status"])
        if self.model_set is not None:
            snapshot["models"] = self.model_set.statistics()
        snapshot["tenants"] = self.tenants.statistics()      # [] without a tenant file
        return json_response(snapshot, headers={"Cache-Control": "no-store"})

    async def openapi(self, request: Request) -> Response:
        self.resolver.check_key(request)
        return json_response(openapi_document())

    async def dashboard(self, _request: Request) -> Response:
        """The page itself holds no data (the key is asked for by the page, for /stats), so it is
        served without one; its script runs under a content security policy that allows only it."""
        page = dashboard_page()
        return Response(page.html, media_type="text/html; charset=utf-8", headers=page.headers)

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
                                want_logprobs=req.logprobs is not None,
                                echo_logprobs=req.echo and req.logprobs is not None, num_top=req.logprobs or 0,
                                prompt_logprobs=None if req.stream else req.prompt_logprobs)
        if req.stream:
            return self.life.sse(request, pipe, reader, CompletionFrames(reader, shape).stream())
        return await self.life.respond(request, pipe, reader, lambda: completion_body(reader, shape))

    async def _chat(self, request: Request, pipe: ModelHandle, body: bytes, arrival: float) -> Response:
        prep = prepare_chat(body, served_model_name=pipe.serving.served_model_name, max_model_len=pipe.max_model_len)
        req = prep.request
        tools = ToolReading.of(prep, max_calls=None if req.parallel_tool_calls else 1)
        return await generate_chat(self.life, request, pipe, prep, lambda: ChatRenderer(
            self._header(pipe, wire.new_request_id("chatcmpl"), req.include_usage),
            want_logprobs=prep.params.logprobs is not None, tools=tools,
            prompt_logprobs=None if req.stream else req.prompt_logprobs), num_bytes=len(body), arrival=arrival)

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
