"""A response's lifetime on the engine, whatever wire format its route speaks.

Count it in flight from its body on, admit it as one unit (503 past the bounds, 400 if it never could
be admitted), open its group in the stream demultiplexer and submit its first window of choices, wait for their
verdicts; then read the choices to one JSON body or an SSE stream, the rest of them fed to the engine
as the first end (actors/http/choice_feed.py). On every way out (done, client gone, an error) the choices in the
engine are aborted behind their Submits, those never sent are forgotten, and the request is counted
out of admission exactly once. Routes build bodies and frames; this owns nothing of their shapes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response

from actors.http.admission import Admission
from actors.http.choice_feed import ChoiceFeed
from actors.http.choice_reader import ChoiceReader
from actors.http.edge import error_response, json_response
from actors.http.model_resolver import ModelResolver
from actors.http.sse_response import SSEResponse
from actors.runtime.model_handle import ModelHandle, only_embeds
from forge.api.openai import openai_output as wire
from forge.api.openai.openai_prepare import Constraint
from forge.errors import RequestError
from forge.messages import Accepted, Submit

if TYPE_CHECKING:
    from actors.http.tenants import Tenant

# Tokens a response may have generated and not yet written to its client, all its choices together, before
# the daemon ends it (--max-unsent-tokens): its writer is stuck on a client that stopped reading, past what
# the kernel's socket buffers hold.
DEFAULT_MAX_UNSENT_TOKENS = 4096

log = structlog.get_logger("forge.gateway")

Handler = Callable[[Request, ModelHandle, bytes, float], Awaitable[Response]]
# A route that generates nothing (count_tokens, /tokenize, the render routes): its body and the handle of the
# model the body names, resolved as the generation routes resolve it, held until the block ends.
ResolveModel = Callable[[Request], AbstractAsyncContextManager[tuple[ModelHandle, bytes]]]


class ResponseLifetime:
    def __init__(self, admission: Admission, resolver: ModelResolver, *, ping_interval: float,
                 max_unsent_tokens: int = DEFAULT_MAX_UNSENT_TOKENS) -> None:
        """`resolver`: the gateway's edge checks, body reader and model resolution; `ping_interval`: seconds
        of silence before a stream sends a ping; `max_unsent_tokens`: tokens a response may have waiting
        for its client before it is cut off."""
        self.admission = admission
        self._resolver = resolver
        self._ping_interval = ping_interval
        self._max_unsent_tokens = max_unsent_tokens

    async def run(self, request: Request, handler: Handler, *, embeds: bool = False) -> Response:
        """Count the request in flight from its body until its response is done (or it fails), its model
        held as long.

        A handler that returns has counted its request out (a JSON body) or will when its stream
        ends (SSE); one that raises has not, and it is counted out here, exactly once.
        """
        self._resolver.check_open(request)
        body = await self._resolver.body(request)
        arrival = time.monotonic()
        pipe = await self._resolver.acquire(request, body)
        try:
            if pipe.embeds_only and not embeds:                # a generation route on an embedding model
                raise only_embeds(pipe.serving.served_model_name)
            tenant = getattr(request.state, "tenant", None)
            if tenant is not None:
                self._resolver.tenants.enter(tenant)           # 429 past its limits
                request.state.tenant_entered = tenant
        except BaseException:
            self._resolver.release(request)
            raise
        self.admission.enter()
        try:
            return await handler(request, pipe, body, arrival)
        except BaseException:
            self.leave(request)
            raise

    def leave(self, request: Request) -> None:
        """The response has ended: out of admission, its tenant's count and bucket, and its model no longer held."""
        self.admission.leave()
        self._resolver.release(request)
        tenant = getattr(request.state, "tenant_entered", None)
        if tenant is not None:
            request.state.tenant_entered = None
            self._resolver.tenants.leave(tenant, getattr(request.state, "prompt_tokens", 0) or 0,
                                         getattr(request.state, "completion_tokens", 0) or 0)

    async def check_constraint(self, pipe: ModelHandle, constraint: Constraint | None) -> None:
        """A constraint compiles against the vocabulary (InvalidRequest if not), checked off the event
        loop: a large schema may take a while to compile."""
        if constraint is not None:
            await anyio.to_thread.run_sync(functools.partial(pipe.grammars.check, constraint.grammar,
                                                             param=constraint.param))

    async def start(self, request: Request, pipe: ModelHandle, submits: list[Submit], num_bytes: int,
                    arrival: float, *, max_choices: int | None = None) -> ChoiceReader:
        """Admit the response as one unit (503 past the bounds; 400 if it never could be: more choices than
        `max_choices`, by default --max-waiting), open its streams, submit its first window of choices,
        wait for their verdicts. The reader feeds the rest as those end."""
        submits = [with_tenant(s, getattr(request.state, "tenant", None)) for s in submits]
        window = self.admission.window(len(submits), num_bytes // 4, max_choices=max_choices,
                                       engine_slots=pipe.serving.max_num_seqs)
        with self.admission.admitting(pipe.load_stats, window.num_choices, window.num_tokens):
            group = pipe.demux.open([s.request_id for s in submits])
            feed = ChoiceFeed(group, submits, pipe.to_tokenizer, window=window.num_choices)
            group.bound(self._max_unsent_tokens, functools.partial(self._cut_off, pipe, feed))
            try:
                feed.top_up()
                statuses = await group.wait_statuses(feed.num_sent)
            except BaseException:
                self._abort(pipe, feed)
                raise
        if group.rejected is not None:
            self._abort(pipe, feed)
            raise group.rejected.error()
        num_prompt_tokens = sum(s.num_prompt_tokens for s in statuses if isinstance(s, Accepted))
        request.state.prompt_tokens = num_prompt_tokens
        return ChoiceReader(group, pipe.metrics, arrival=arrival, ping_interval=self._ping_interval,
                            num_prompt_tokens=num_prompt_tokens, feed=feed)

    async def respond(self, request: Request, pipe: ModelHandle, reader: ChoiceReader, build: Callable[[], Any], *,
                      render_error: Callable[[RequestError], Response] = error_response) -> Response:
        """One JSON body once every choice has ended, or the engine's failure as `render_error` writes
        it. (If this raises, `run` counts the request out.)"""
        try:
            await reader.collect(request)
        finally:
            self.end(request, pipe, reader)
        failure = reader.failure()
        if failure is not None and reader.group.rejected is not None and failure.status < 500:
            raise failure                   # a later window's choice refused: answered as the first window's
        response = render_error(failure) if failure is not None else json_response(build())
        self.leave(request)
        return response

    def sse(self, request: Request, pipe: ModelHandle, reader: ChoiceReader, frames: AsyncIterator[bytes], *,
            done: bytes | None = wire.SSE_DONE, media_type: str = "text/event-stream") -> SSEResponse:
        """The frames as an event stream (or another `media_type`'s), then `done` (OpenAI's [DONE]; None
        for none)."""
        async def body() -> AsyncIterator[bytes]:
            async for frame in frames:
                yield frame
            if done is not None:
                yield done

        def cleanup() -> None:
            self.end(request, pipe, reader)
            self.leave(request)

        return SSEResponse(body(), cleanup, media_type=media_type)

    def end(self, request: Request, pipe: ModelHandle, reader: ChoiceReader) -> None:
        """Stop reading the response (its choices in the engine dropped, those never sent forgotten); its
        token counts go to the access log."""
        assert reader.feed is not None
        self._abort(pipe, reader.feed)
        request.state.prompt_tokens = reader.group.num_prompt_tokens()
        request.state.completion_tokens = reader.num_completion_tokens

    def _cut_off(self, pipe: ModelHandle, feed: ChoiceFeed, num_unsent_tokens: int) -> None:
        """Its client stopped reading (ResponseGroup.bound): its choices leave the engine now, their blocks
        freed, and none is sent after them; the response ends when the client reads again or leaves."""
        feed.abort()
        pipe.metrics.slow_reader_aborts.inc()
        log.warning("slow_reader_aborted", request_ids=feed.group.request_ids[:8],
                    num_choices=len(feed.group.request_ids), num_unsent_tokens=num_unsent_tokens,
                    max_unsent_tokens=self._max_unsent_tokens)

    def _abort(self, pipe: ModelHandle, feed: ChoiceFeed) -> None:
        """Stop reading the group; its choices in the engine are dropped behind their Submits."""
        pipe.demux.close(feed.group)
        feed.abort()


def with_tenant(submit: Submit, tenant: Tenant | None) -> Submit:
    """The Submit as its tenant may send it: its priority no more urgent than the tenant's (a larger number
    of the two), the tenant's name and share on its parameters for the scheduler. Without a tenant, as sent."""
    if tenant is None:
        return submit
    params = msgspec.structs.replace(submit.params, priority=max(submit.params.priority, tenant.priority),
                                     tenant=tenant.name, tenant_share=tenant.share)
    return msgspec.structs.replace(submit, params=params)
