"""The model routes: the list (GET /v1/models) and one model (GET /v1/models/{id}), in OpenAI's shape or,
asked with Anthropic's `anthropic-version` header, in the Anthropic Models API's; and the operator's
POST /models/load and /models/unload, behind the API key. One model served is a set of one: unloading it
frees its memory until a request or /models/load brings it back.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.http.edge import ANTHROPIC_VERSION, json_response
from actors.http.model_resolver import ModelResolver, peek
from actors.runtime.model_set import ModelEntry
from forge.api.anthropic import anthropic_output as anthropic
from forge.api.openai import openai_output as wire
from forge.errors import InvalidRequest, RequestError


class ModelRoutes:
    def __init__(self, resolver: ModelResolver) -> None:
        """`resolver`: the gateway's edge checks, body reader and model set."""
        self._resolver = resolver

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.retrieve_model, methods=["GET"]),
                Route("/models/load", self.load_model, methods=["POST"]),
                Route("/models/unload", self.unload_model, methods=["POST"])]

    async def list_models(self, request: Request) -> Response:
        """Every model served with its state; Anthropic's shape (paged by limit, after_id, before_id) when
        the request carries anthropic-version."""
        entries = list(self._resolver.check_open(request).entries.values())
        if ANTHROPIC_VERSION not in request.headers:
            return json_response(wire.model_list([openai_card(e) for e in entries]))
        query = request.query_params
        limit = _limit(query.get("limit"))
        try:
            page = anthropic.model_page([anthropic_info(e) for e in entries], limit=limit,
                                        after_id=query.get("after_id"), before_id=query.get("before_id"))
        except ValueError:
            param = "after_id" if query.get("after_id") not in {e.model_id for e in entries} else "before_id"
            raise InvalidRequest(f"{param} names no model served; available: "
                                 f"{', '.join(e.model_id for e in entries)}", param=param) from None
        return json_response(page)

    async def retrieve_model(self, request: Request) -> Response:
        """One model's entry, in the shape its client asks for (404 model_not_found naming those served)."""
        entry = self._resolver.check_open(request).entry(request.path_params["model_id"])
        anthropic_asked = ANTHROPIC_VERSION in request.headers
        return json_response(anthropic_info(entry) if anthropic_asked else openai_card(entry))

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


def openai_card(entry: ModelEntry) -> dict[str, object]:
    """OpenAI's model object, with forge's state, size and (once loaded) context and memory."""
    card = wire.model_card(entry.model_id, created=0, max_model_len=0)
    card.update(entry.card())
    if card["max_model_len"] == 0:
        card["max_model_len"] = None        # not known until it loads
    return card


def anthropic_info(entry: ModelEntry) -> dict[str, object]:
    return anthropic.model_info(entry.model_id, max_model_len=entry.actors.served.max_model_len
                                if entry.actors is not None else None)


def _limit(raw: str | None) -> int:
    if raw is None:
        return 20
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= anthropic.MAX_PAGE:
        raise InvalidRequest(f"limit must be an integer from 1 to {anthropic.MAX_PAGE}, got {raw!r}", param="limit")
    return limit


def model_field(body: bytes) -> str:
    model = peek(body).model
    if not isinstance(model, str):
        raise RequestError("the body must be JSON with a string field 'model'", param="model")
    return model
