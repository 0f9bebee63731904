"""Which model a request is for, and the checks every route makes before it reads one: key, draining, loading.

The daemon serves a set of models (actors.runtime.model_set; one model served is a set of one). A body
names its model: `acquire` finds it in the set (404 naming the ids there are), loads it if need be or
waits for its turn (the wait counted against the admission bounds, 503 past them; a name with Ollama's
`:latest` tag finds the model without it) and holds it until
`release`, so that it is never unloaded under a response; a body that names none gets the model used
last. A route with no body to name one (/get_server_info, /flush_cache) gets the loaded model used
last (`recent`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
from starlette.requests import Request

from actors.http.admission import Admission
from actors.http.edge import read_body
from actors.http.tenant_limits import TenantGate
from actors.runtime.model_actors import ModelActors
from actors.runtime.model_handle import ModelHandle
from actors.runtime.model_set import ModelSet, parse_keep_alive
from forge.errors import CapacityError

LATEST = ":latest"                                 # the tag Ollama's names carry by default


class Peek(msgspec.Struct):
    model: object = None
    keep_alive: object = None                      # Ollama's field: seconds, or a duration like "5m"


def peek(body: bytes) -> Peek:
    """The body's `model` and `keep_alive`, before its route decodes it (which answers bad JSON with 400)."""
    try:
        return msgspec.json.decode(body, type=Peek)
    except (msgspec.DecodeError, RecursionError):      # the route's own decoding says what is wrong (400)
        return Peek()


def known_name(models: ModelSet, name: str) -> str:
    """The id a name means: itself, or without Ollama's default tag (`smollm2:latest` -> `smollm2`) when only
    that is served."""
    if name not in models.entries and name.endswith(LATEST):
        return name.removesuffix(LATEST)
    return name


class ModelResolver:
    def __init__(self, admission: Admission, *, tenants: TenantGate, max_body_size: int, body_timeout: float,
                 retry_after_s: int) -> None:
        """`admission`: the gateway's bounds, which a wait for a model's load counts against; `tenants`: the
        key (or tenant table) every route but the health checks asks for; `max_body_size`, `body_timeout`: a
        body's limits."""
        self.admission = admission
        self.models: ModelSet | None = None      # set by the daemon once its models are ready (503 until then)
        self.is_draining = False
        self.tenants = tenants
        self._max_body_size, self._body_timeout = max_body_size, body_timeout
        self._retry_after_s = retry_after_s

    # ---- checks at the edge ---------------------------------------------------------------------

    def check_key(self, request: Request) -> None:
        """401 unless the request carries a key the daemon knows; its tenant (None without a tenant file)
        goes on request.state.tenant."""
        request.state.tenant = self.tenants.identify(request)

    def check_open(self, request: Request) -> ModelSet:
        """The key, then 503 while draining or before the models are ready; the set."""
        self.check_key(request)
        if self.is_draining:
            raise CapacityError("the server is shutting down", code="draining", retry_after_s=self._retry_after_s)
        if self.models is None:
            raise CapacityError("the model is loading", code="loading", retry_after_s=self._retry_after_s)
        return self.models

    async def body(self, request: Request) -> bytes:
        return await read_body(request, self._max_body_size, self._body_timeout)

    # ---- which model ----------------------------------------------------------------------------

    def loaded(self) -> list[ModelActors]:
        """Every loaded model's actors (none before the models are ready)."""
        models = self.models
        return [e.actors for e in models.loaded() if e.actors is not None] if models is not None else []

    def recent(self, request: Request) -> ModelHandle:
        """After the edge checks, the loaded model used last (503 loading when none is loaded)."""
        recent = self.check_open(request).most_recent()
        if recent is None or recent.actors is None:
            raise CapacityError("the model is loading", code="loading", retry_after_s=self._retry_after_s)
        return recent.actors.handle

    async def acquire(self, request: Request, body: bytes) -> ModelHandle:
        """The model the body names (loaded first if need be), counted in use until `release`."""
        models = self.check_open(request)
        peeked = peek(body)
        model_id = peeked.model if isinstance(peeked.model, str) else None
        if model_id is None:
            recent = models.most_recent()
            model_id = recent.model_id if recent is not None else next(iter(models.entries))
        model_id = known_name(models, model_id)
        entry = models.entry(model_id)              # 404 naming the available ids
        request.state.model_name = model_id         # for the access log, whatever happens next
        keep_alive = peeked.keep_alive if peeked.keep_alive is not None else request.headers.get("x-keep-alive")
        if keep_alive is not None:
            entry.keep_alive = parse_keep_alive(keep_alive)
        if models.can_take(model_id):
            wired = await models.acquire(model_id)
        else:
            # Waiting for a load (or for the model's turn) counts against the admission bounds like a queued
            # request (503 past them); a body past --max-queued-tokens on its own is its route's 400
            # (request_too_large), not a 503 here.
            guess = min(len(body) // 4, self.admission.max_queued_tokens)
            with self.admission.admitting(lambda: (0, 0), 1, guess):
                wired = await models.acquire(model_id)
        request.state.model_lease = model_id         # held until release
        return wired.handle

    def release(self, request: Request) -> None:
        """The request no longer holds its model (once; a request that holds none is a no-op)."""
        model_id = getattr(request.state, "model_lease", None)
        if model_id is not None and self.models is not None:
            request.state.model_lease = None
            self.models.release(model_id)

    @asynccontextmanager
    async def resolve(self, request: Request) -> AsyncIterator[tuple[ModelHandle, bytes]]:
        """lifetime.ResolveModel: the body, and the model it names as a generation route finds it, held
        until the block ends."""
        self.check_open(request)
        body = await self.body(request)
        handle = await self.acquire(request, body)
        try:
            yield handle, body
        finally:
            self.release(request)
