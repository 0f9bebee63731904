"""The operator's model routes: POST /models/load and /models/unload, behind the API key. One model
served is a set of one: unloading it frees its memory until a request or /models/load brings it back.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.http.edge import json_response
from actors.http.model_resolver import ModelResolver, peek
from forge.errors import RequestError


class ModelRoutes:
    def __init__(self, resolver: ModelResolver) -> None:
        """`resolver`: the gateway's edge checks, body reader and model set."""
        self._resolver = resolver

    def routes(self) -> list[Route]:
        return [Route("/models/load", self.load_model, methods=["POST"]),
                Route("/models/unload", self.unload_model, methods=["POST"])]

    async def load_model(self, request: Request) -> Response:
        """POST /models/load {"model": ID}: load it now (an operator's warm-up)."""
        models = self._resolver.check_open(request)
        entry = models.entry(model_field(await self._resolver.body(request)))
        await models.load(entry.model_id)
        return json_response({"model": entry.model_id, **entry.card()})

    async def unload_model(self, request: Request) -> Response:
        """POST /models/unload {"model": ID}: unload it if idle (409 while it has requests in flight)."""
        models = self._resolver.check_open(request)
        entry = models.entry(model_field(await self._resolver.body(request)))
        if entry.state == "loaded" and not models.unload(entry.model_id):
            raise RequestError(f"the model '{entry.model_id}' has requests in flight", param="model",
                               status=409, code="model_busy")
        await models.wait_unloaded(entry.model_id)
        return json_response({"model": entry.model_id, **entry.card()})


def model_field(body: bytes) -> str:
    model = peek(body).model
    if not isinstance(model, str):
        raise RequestError("the body must be JSON with a string field 'model'", param="model")
    return model
