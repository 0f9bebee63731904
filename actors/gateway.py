"""The HTTP gateway: starlette routes, OpenAI-compatible bodies and SSE, disconnect -> Abort.

Requests are validated at the edge (forge.api) and admitted against explicit bounds before any
tokenising work. Each response reads its choices from the router; a client that goes away, in
any phase, aborts its requests so their blocks are freed at the next step.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import anyio
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectSendStream
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.metrics import Metrics
from actors.router import ResponseGroup, Router
from actors.sse import SSEResponse
from forge import api
from forge.api_responses import ResponseHeader, TokenLogprob, Usage
from forge.errors import RequestError
from forge.messages import Abort, Accepted, Rejected, Submit, TextDelta
from forge.chat import ChatTemplate
from forge.sampling import SamplingParams
from forge.tokenizer import Tokenizer

log = structlog.get_logger("forge.gateway")
_json = msgspec.json.Encoder()


@dataclass(slots=True)
class GatewayConfig:
    served_model_name: str = "forge"
    api_key: str | None = None
    max_body_size: int = 1 << 20
    max_waiting: int = 256
    max_queued_tokens: int = 262144
    sse_ping_interval: float = 5.0
    retry_after_s: int = 5


@dataclass(slots=True)
class Pipeline:
    """What the gateway talks to once the model is loaded."""
    router: Router
    to_tokeniser: MemoryObjectSendStream[Submit]
    to_scheduler: MemoryObjectSendStream[Abort]
    tokenizer: Tokenizer
    template: ChatTemplate
    max_model_len: int
    load_stats: Callable[[], tuple[int, int]]       # (requests waiting, prompt tokens waiting)


class HttpError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json", headers=headers)


def error_response(exc: HttpError) -> Response:
    return json_response(api.error_body(exc.message, exc.type, exc.param, exc.code), exc.status, exc.headers)


@dataclass(slots=True)
class _Choice:
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None


class Gateway:
    def __init__(self, config: GatewayConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.pipeline: Pipeline | None = None
        self.is_draining = False
        self.num_inflight = 0
        self._idle = anyio.Event()
        self._idle.set()
        # Admitted but not yet queued by the scheduler (the scheduler takes new requests only
        # between steps): counted against the waiting bounds, or a burst would pass them all.
        self._num_admitting = 0
        self._num_admitting_tokens = 0

    # ---- app --------------------------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ]
        handlers = {HTTPException: self._http_exception, HttpError: self._http_error,
                    Exception: self._unexpected}
        return Starlette(routes=routes, exception_handlers=handlers)  # type: ignore[arg-type]

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        message = {404: f"route {request.url.path} not found", 405: "method not allowed"}.get(
            exc.status_code, str(exc.detail))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return json_response(api.error_body(message, kind), exc.status_code)

    async def _http_error(self, request: Request, exc: HttpError) -> Response:
        return error_response(exc)

    async def _unexpected(self, request: Request, exc: Exception) -> Response:
        log.exception("request_failed", path=request.url.path)
        return json_response(api.error_body("internal error", "server_error"), 500)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    # ---- edge checks ------------------------------------------------------------------------

    def _check_key(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise HttpError(401, "invalid or missing API key", "authentication_error",
                            code="invalid_api_key")

    def _ready(self, request: Request) -> Pipeline:
        self._check_key(request)
        if self.is_draining:
            raise HttpError(503, "the server is shutting down", "server_error", code="draining",
                            headers={"Retry-After": str(self.config.retry_after_s)})
        if self.pipeline is None:
            raise HttpError(503, "the model is loading", "server_error", code="loading",
                            headers={"Retry-After": str(self.config.retry_after_s)})
        return self.pipeline

    async def _body(self, request: Request) -> bytes:
        limit = self.config.max_body_size
        too_large = HttpError(413, f"request body over {limit} bytes", code="body_too_large")
        # Up to max_drain bytes are read and dropped before the 413: closing a connection with
        # unread data resets it, and the client would see a reset instead of the 413.
        max_drain = 4 * limit
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_drain:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_drain:
                raise too_large
            if size <= limit:
                chunks.append(chunk)
        if size > limit:
            raise too_large
        return b"".join(chunks)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise HttpError(404, f"the model '{model}' does not exist", "invalid_request_error",
                            param="model", code="model_not_found")

    def _admit(self, pipe: Pipeline, num_new: int, num_tokens_guess: int) -> None:
        num_waiting, num_tokens = pipe.load_stats()
        if (num_waiting + self._num_admitting + num_new > self.config.max_waiting
                or num_tokens + self._num_admitting_tokens + num_tokens_guess > self.config.max_queued_tokens):
            raise HttpError(503, "the server is overloaded; retry later", "server_error", code="overloaded",
                            headers={"Retry-After": str(self.config.retry_after_s)})

    def _decode(self, decoder: Callable[[bytes], Any], body: bytes) -> Any:
        try:
            return decoder(body)
        except RequestError as exc:
            raise HttpError(exc.status, exc.message, exc.type, exc.param, exc.code) from None

    # ---- plain routes -----------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        if self.is_draining:
            return json_response({"status": "draining"}, 503)
        if self.pipeline is None:
            return json_response({"status": "loading"}, 503)
        return json_response({"status": "ok"})

    async def metrics_route(self, request: Request) -> Response:
        self._check_key(request)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        pipe = self._ready(request)
        card = api.model_card(self.config.served_model_name, created=0, max_model_len=pipe.max_model_len)
        return json_response(api.model_list([card]))

    async def tokenize(self, request: Request) -> Response:
        pipe = self._ready(request)
        req = self._decode(api.decode_tokenize, await self._body(request))
        self._check_model(req.model)
        try:
            if req.messages is not None:
                text = pipe.template.render(api.chat_template_messages(req.messages),
                                            add_generation_prompt=req.add_generation_prompt)
                ids = pipe.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = pipe.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        except RequestError as exc:
            raise HttpError(exc.status, exc.message, exc.type, exc.param, exc.code) from None
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": pipe.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        pipe = self._ready(request)
        req = self._decode(api.decode_detokenize, await self._body(request))
        self._check_model(req.model)
        vocab = pipe.tokenizer.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise HttpError(400, f"token ids must lie in [0, {vocab})", param="tokens")
        return json_response({"prompt": pipe.tokenizer.decode(req.tokens)})

    # ---- generation -------------------------------------------------------------------------

    async def _start(self, request: Request, pipe: Pipeline, base: str,
                     submits: list[Submit], num_bytes: int) -> ResponseGroup:
        """Admit the response (or 503), open its streams, submit its choices, wait for the verdicts."""
        num_tokens_guess = num_bytes // 4
        self._admit(pipe, len(submits), num_tokens_guess)
        self._num_admitting += len(submits)
        self._num_admitting_tokens += num_tokens_guess
        group = pipe.router.open([s.request_id for s in submits])
        try:
            for s in submits:
                pipe.to_tokeniser.send_nowait(s)
            statuses = await group.wait_statuses()
        except BaseException:
            self._abort(pipe, group)
            raise
        finally:
            self._num_admitting -= len(submits)
            self._num_admitting_tokens -= num_tokens_guess
        rejected = next((s for s in statuses if isinstance(s, Rejected)), None)
        if rejected is not None:
            self._abort(pipe, group)
            raise HttpError(rejected.status, rejected.message, rejected.error_type, rejected.param, rejected.code)
        request.state.prompt_tokens = sum(s.num_prompt_tokens for s in statuses if isinstance(s, Accepted))
        return group

    def _abort(self, pipe: Pipeline, group: ResponseGroup) -> None:
        pipe.router.close(group)
        for i in sorted(group.unfinished):
            try:
                pipe.to_scheduler.send_nowait(Abort(request_id=group.request_ids[i]))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return                        # the daemon stopped (drain timed out): nothing to free

    def _enter(self) -> None:
        self.num_inflight += 1
        self._idle = anyio.Event() if self._idle.is_set() else self._idle

    def _leave(self) -> None:
        self.num_inflight -= 1
        if self.num_inflight == 0:
            self._idle.set()

    def _observe(self, choice: _Choice, delta: TextDelta, now: float, arrival: float) -> None:
        if delta.num_tokens:
            if choice.first_token_at is None:
                choice.first_token_at = now
                self.metrics.time_to_first_token.observe(now - arrival)
                if delta.num_tokens > 1:
                    self.metrics.inter_token_latency.observe(0.0)
            elif choice.last_token_at is not None:
                gap = (now - choice.last_token_at) / delta.num_tokens
                for _ in range(min(delta.num_tokens, 64)):
                    self.metrics.inter_token_latency.observe(gap)
            choice.last_token_at = now
        choice.text += delta.text
        for lp in delta.logprobs:
            choice.logprobs.append(TokenLogprob(text=lp.text, token_bytes=lp.token_bytes, logprob=lp.logprob,
                                                top=lp.top))
        choice.num_prompt_tokens = delta.num_prompt_tokens or choice.num_prompt_tokens
        choice.num_completion_tokens = delta.num_completion_tokens
        choice.num_cached_tokens = delta.num_cached_tokens or choice.num_cached_tokens
        if delta.finish_reason is not None:
            choice.finish_reason = "stop" if delta.finish_reason == "stop" else "length"
            self.metrics.e2e_request_latency.observe(now - arrival)

    async def _collect(self, request: Request, group: ResponseGroup, arrival: float) -> list[_Choice]:
        """Read every choice to its end; a client disconnect cancels and aborts (see caller)."""
        choices = [_Choice() for _ in group.request_ids]
        async with anyio.create_task_group() as tg:
            async def watch_disconnect() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch_disconnect)
            while group.unfinished:
                for i, delta in await group.next_deltas():
                    self._observe(choices[i], delta, time.monotonic(), arrival)
            tg.cancel_scope.cancel()
        if group.unfinished:
            raise anyio.get_cancelled_exc_class()()
        return choices

    def _usage(self, choices: list[_Choice], n: int) -> Usage:
        prompt = sum(c.num_prompt_tokens for c in choices[::n])
        return Usage(prompt_tokens=prompt, completion_tokens=sum(c.num_completion_tokens for c in choices),
                     cached_tokens=sum(c.num_cached_tokens for c in choices[::n]))

    def _params_for(self, params: SamplingParams, j: int) -> SamplingParams:
        if j == 0 or params.seed is None:
            return params
        return msgspec.structs.replace(params, seed=params.seed + j)

    async def _run(self, request: Request, handler: Callable[..., Any]) -> Response:
        pipe = self._ready(request)
        body = await self._body(request)
        arrival = time.monotonic()
        self._enter()
        try:
            return await handler(request, pipe, body, arrival)
        except BaseException:
            self._leave()
            raise

    async def generate(self, request: Request) -> Response:
        return await self._run(request, self._generate)

    async def completions(self, request: Request) -> Response:
        return await self._run(request, self._completions)

    async def chat_completions(self, request: Request) -> Response:
        return await self._run(request, self._chat)

    async def _generate(self, request: Request, pipe: Pipeline, body: bytes, arrival: float) -> Response:
        req = self._decode(api.decode_generate, body)
        params = self._decode(lambda _: api.to_sampling_params(req, default_max_tokens=32), body)
        params = msgspec.structs.replace(params, temperature=0.0)
        base = api.new_request_id("cmpl")
        group = await self._start(request, pipe, base, [Submit(request_id=f"{base}-0", params=params,
                                                               text=req.prompt)], len(body))
        return await self._finish_plain(request, pipe, group, arrival, lambda c: {
            "text": c[0].text, "prompt_tokens": c[0].num_prompt_tokens,
            "completion_tokens": c[0].num_completion_tokens})

    async def _finish_plain(self, request: Request, pipe: Pipeline, group: ResponseGroup, arrival: float,
                            build: Callable[[list[_Choice]], Any]) -> Response:
        try:
            choices = await self._collect(request, group, arrival)
        finally:
            self._abort(pipe, group)
            self._leave()
        request.state.completion_tokens = sum(c.num_completion_tokens for c in choices)
        return json_response(build(choices))

    async def _completions(self, request: Request, pipe: Pipeline, body: bytes, arrival: float) -> Response:
        req = self._decode(api.decode_completion, body)
        self._check_model(req.model)
        params = self._decode(lambda _: api.to_sampling_params(req, default_max_tokens=16), body)
        prompts = api.completion_prompts(req)
        n = req.n
        base = api.new_request_id("cmpl")
        submits = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                p = self._params_for(params, j)
                rid = f"{base}-{i * n + j}"
                if isinstance(prompt, str):
                    submits.append(Submit(request_id=rid, params=p, text=prompt))
                else:
                    submits.append(Submit(request_id=rid, params=p, token_ids=tuple(prompt)))
        group = await self._start(request, pipe, base, submits, len(body))
        header = ResponseHeader(request_id=base, created=int(time.time()), model=self.config.served_model_name,
                                include_usage=req.include_usage)
        echoes = [self._echo_text(pipe, prompts[k // n]) if req.echo else "" for k in range(len(submits))]
        want_logprobs = req.logprobs is not None

        def logprobs_of(choice: _Choice, echo: str) -> Any:
            if not want_logprobs:
                return None
            offsets, pos = [], len(echo)
            for lp in choice.logprobs:
                offsets.append(pos)
                pos += len(lp.text)
            return api.completion_logprobs(choice.logprobs, offsets)

        if not req.stream:
            def build(choices: list[_Choice]) -> Any:
                items = [api.completion_choice(k, echoes[k] + c.text, c.finish_reason, logprobs_of(c, echoes[k]))
                         for k, c in enumerate(choices)]
                return api.completion_response(header, items, self._usage(choices, n))
            return await self._finish_plain(request, pipe, group, arrival, build)

        async def frames(choices: list[_Choice]) -> AsyncIterator[bytes]:
            offsets = [len(echo) for echo in echoes]     # where each choice's next token starts
            for k, echo in enumerate(echoes):
                if echo:
                    yield api.sse_frame(api.completion_chunk(header, index=k, text=echo))
            async for item in self._deltas(request, group, choices, arrival):
                if item is None:
                    yield api.SSE_PING
                    continue
                k, delta, choice = item
                # Text held back (half a character, a possible stop string) still sends its logprobs.
                if not delta.text and delta.finish_reason is None and not (want_logprobs and delta.logprobs):
                    continue
                lp = None
                if want_logprobs:
                    entries = choice.logprobs[-len(delta.logprobs):] if delta.logprobs else []
                    starts = []
                    for entry in entries:
                        starts.append(offsets[k])
                        offsets[k] += len(entry.text)
                    lp = api.completion_logprobs(entries, starts)
                yield api.sse_frame(api.completion_chunk(header, index=k, text=delta.text,
                                                         finish_reason=choice.finish_reason, logprobs=lp))
            if req.include_usage:
                yield api.sse_frame(api.completion_usage_chunk(header, self._usage(choices, n)))

        return self._sse(request, pipe, group, frames)

    async def _chat(self, request: Request, pipe: Pipeline, body: bytes, arrival: float) -> Response:
        req = self._decode(api.decode_chat, body)
        self._check_model(req.model)
        max_default = max(1, pipe.max_model_len)
        params = self._decode(lambda _: api.to_sampling_params(req, default_max_tokens=max_default), body)
        messages = tuple(api.chat_template_messages(req.messages))
        n = req.n
        base = api.new_request_id("chatcmpl")
        submits = [Submit(request_id=f"{base}-{j}", params=self._params_for(params, j), messages=messages)
                   for j in range(n)]
        group = await self._start(request, pipe, base, submits, len(body))
        header = ResponseHeader(request_id=base, created=int(time.time()), model=self.config.served_model_name,
                                include_usage=req.include_usage)
        want_logprobs = params.logprobs is not None
        if not req.stream:
            def build(choices: list[_Choice]) -> Any:
                items = [api.chat_choice(k, c.text, c.finish_reason,
                                         api.chat_logprobs(c.logprobs) if want_logprobs else None)
                         for k, c in enumerate(choices)]
                return api.chat_response(header, items, self._usage(choices, n))
            return await self._finish_plain(request, pipe, group, arrival, build)

        async def frames(choices: list[_Choice]) -> AsyncIterator[bytes]:
            for k in range(n):
                yield api.sse_frame(api.chat_role_chunk(header, index=k))
            async for item in self._deltas(request, group, choices, arrival):
                if item is None:
                    yield api.SSE_PING
                    continue
                k, delta, choice = item
                if delta.text or delta.logprobs:
                    lp = api.chat_logprobs(choice.logprobs[-len(delta.logprobs):]) if want_logprobs else None
                    yield api.sse_frame(api.chat_content_chunk(header, index=k, content=delta.text, logprobs=lp))
                if choice.finish_reason is not None and delta.finish_reason is not None:
                    yield api.sse_frame(api.chat_finish_chunk(header, index=k,
                                                              finish_reason=choice.finish_reason))
            if req.include_usage:
                yield api.sse_frame(api.chat_usage_chunk(header, self._usage(choices, n)))

        return self._sse(request, pipe, group, frames)

    def _echo_text(self, pipe: Pipeline, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else pipe.tokenizer.decode(prompt)

    async def _deltas(self, request: Request, group: ResponseGroup, choices: list[_Choice],
                      arrival: float) -> AsyncIterator[tuple[int, TextDelta, _Choice] | None]:
        """Deltas as they come; while none comes for a while (a long prefill), a ping."""
        while group.unfinished:
            deltas = None
            with anyio.move_on_after(self.config.sse_ping_interval):
                deltas = await group.next_deltas()
            if deltas is None:
                yield None
                continue
            now = time.monotonic()
            for i, delta in deltas:
                self._observe(choices[i], delta, now, arrival)
                yield i, delta, choices[i]

    def _sse(self, request: Request, pipe: Pipeline, group: ResponseGroup,
             frames: Callable[[list[_Choice]], AsyncIterator[bytes]]) -> StreamingResponse:
        choices = [_Choice() for _ in group.request_ids]

        async def body() -> AsyncIterator[bytes]:
            async for frame in frames(choices):
                yield frame
            yield api.SSE_DONE

        def cleanup() -> None:
            self._abort(pipe, group)
            request.state.completion_tokens = sum(c.num_completion_tokens for c in choices)
            self._leave()

        return SSEResponse(body(), cleanup)
