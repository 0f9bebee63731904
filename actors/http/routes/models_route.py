"""The operator's model routes of a daemon serving several models: POST /models/load and
/models/unload, behind the API key. A daemon serving one model answers them 404 `single_model`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.http.edge import json_response
from actors.runtime.model_set import ModelSet
from forge.errors import RequestError


class ModelRoutes:
    def __init__(self, *, model_set: Callable[[], ModelSet | None], check_open: Callable[[Request], None],
                 body: Callable[[Request], Awaitable[bytes]]) -> None:
        """`model_set`: the gateway's set (None with one model); `check_open`: its key and drain check;
        `body`: its reader of a request body within limits."""
        self._model_set, self._check_open, self._body = model_set, check_open, body

    def routes(self) -> list[Route]:
        return [Route("/models/load", self.load_model, methods=["POST"]),
                Route("/models/unload", self.unload_model, methods=["POST"])]

    async def load_model(self, request: Request) -> Response:
        """POST /models/load {"model": ID}: load it now (an operator's warm-up)."""
        models = self._operated(request)
        entry = models.entry(model_field(await self._body(request)))
        await models.load(entry.model_id)
        return json_response({"model": entry.model_id, **entry.card()})

    async def unload_model(self, request: Request) -> Response:
        """POST /models/unload {"model": ID}: unload it if idle (409 while it has requests in flight)."""
        models = self._operated(request)
        entry = models.entry(model_field(await self._body(request)))
        if entry.state == "loaded" and not models.unload(entry.model_id):
            raise RequestError(f"the model '{entry.model_id}' has requests in flight", param="model",
                               status=409, code="model_busy")
        await models.wait_unloaded(entry.model_id)
        return json_response({"model": entry.model_id, **entry.card()})

    def _operated(self, request: Request) -> ModelSet:
        self._check_open(request)
        models = self._model_set()
        if models is None:
            raise RequestError("this daemon serves one model: start it with several --model to load and "
                               "unload models", status=404, type="not_found_error", code="single_model")
        return models


class Peek(msgspec.Struct):
    model: object = None
    keep_alive: object = None                      # Ollama's field: seconds, or a duration like "5m"


def peek(body: bytes) -> Peek:
    """The body's `model` and `keep_alive`, before its route decodes it (which answers bad JSON with 400)."""
    try:
        return msgspec.json.decode(body, type=Peek)
    except msgspec.DecodeError:
        return Peek()


def model_field(body: bytes) -> str:
    model = peek(body).model
    if not isinstance(model, str):
        raise RequestError("the body must be JSON with a string field 'model'", param="model")
    return model
