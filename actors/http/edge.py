"""The HTTP edge's small parts: JSON and error responses, the API key check, reading a body within limits.

The Messages API's routes (/v1/messages...), and the model list asked for with Anthropic's
`anthropic-version` header, speak that API's edge: errors in its envelope, and the key taken from
`x-api-key` as well as `Authorization: Bearer`. Ollama's routes (/api/...) answer errors as Ollama does,
`{"error": "..."}`. Every other route speaks OpenAI's.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from forge.api.anthropic import anthropic_output as anthropic
from forge.api.ollama import ollama_output as ollama
from forge.api.openai import openai_output as wire
from forge.errors import PromptTooLong, RequestError

_json = msgspec.json.Encoder()


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json", headers=headers)


MESSAGES_PATH = "/v1/messages"
MODELS_PATH = "/v1/models"
ANTHROPIC_VERSION = "anthropic-version"         # the header every Anthropic client sends
OLLAMA_PREFIX = "/api/"                          # Ollama's routes (actors/http/routes/ollama_route.py)


def speaks_messages(path: str, headers: Mapping[str, str] | None = None) -> bool:
    """Whether the route at `path` speaks the Messages API's edge: one of that API's routes, or the model
    list when `headers` carry anthropic-version (Anthropic's client lists models on the same path)."""
    if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):
        return True
    on_models = path == MODELS_PATH or path.startswith(MODELS_PATH + "/")
    return on_models and headers is not None and ANTHROPIC_VERSION in headers


def error_response(exc: RequestError) -> Response:
    return json_response(wire.error_body(exc.message, exc.type, exc.param, exc.code), exc.status, exc.headers)


def messages_error_response(exc: RequestError) -> Response:
    """The error in the Messages API's envelope, its type from the status (the same status and headers)."""
    return json_response(anthropic.error_body(exc.status, exc.message, exc.param), exc.status, exc.headers)


def ollama_error_response(exc: RequestError) -> Response:
    """The error as Ollama writes it: {"error": message}, with the same status and headers."""
    return json_response(ollama.error_body(exc.message), exc.status, exc.headers)


def error_response_for(path: str, exc: RequestError, headers: Mapping[str, str] | None = None) -> Response:
    """The error in the envelope of the API the route at `path` (asked with `headers`) speaks."""
    if path.startswith(OLLAMA_PREFIX):
        return ollama_error_response(exc)
    return messages_error_response(exc) if speaks_messages(path, headers) else error_response(exc)


def check_key(request: Request, key: str | None) -> None:
    """The API key, when one is set: `Authorization: Bearer <key>`, or on the Messages API's routes
    `x-api-key: <key>` too (401 otherwise), compared in constant time."""
    if key is None:
        return
    matches = [hmac.compare_digest(token.encode(), key.encode()) for token in presented_keys(request)]
    if not any(matches):
        raise unauthorized()


def unauthorized() -> RequestError:
    """The 401 of a missing or unknown key."""
    return RequestError("invalid or missing API key", status=401, type="authentication_error", code="invalid_api_key")


def presented_keys(request: Request) -> list[str]:
    """The keys a request presents: `Authorization: Bearer <key>` ("" without one), and on the Messages
    API's routes `x-api-key` too."""
    given = request.headers.get("authorization", "")
    keys = [given[7:] if given[:7].lower() == "bearer " else ""]
    if speaks_messages(request.url.path, request.headers):
        keys.append(request.headers.get("x-api-key", ""))
    return keys


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The whole body, at most `limit` bytes (413 beyond), within `timeout` seconds (408 after)."""
    too_large = RequestError(f"request body over {limit} bytes", status=413, code="body_too_large")
    # Up to max_drain bytes are read and dropped before the 413: closing a connection with
    # unread data resets it, and the client would see a reset instead of the 413.
    max_drain = 4 * limit
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_drain:
        raise too_large
    chunks, size = [], 0
    # A body that never ends (a stalled or hostile client) holds a handler and a connection:
    # it has `timeout` seconds to arrive whole, then gets a 408 and the connection closes.
    with anyio.move_on_after(timeout) as scope:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_drain:
                raise too_large
            if size <= limit:
                chunks.append(chunk)
    if scope.cancelled_caught:
        raise RequestError(f"the request body did not arrive within {timeout:g} s",
                           status=408, code="body_timeout", headers={"Connection": "close"})
    if size > limit:
        raise too_large
    return b"".join(chunks)


def rejection_reason(exc: RequestError) -> str:
    """forge:request_rejected_total's reason: overload, draining (or loading), too_long, auth, cross_site
    (a foreign Host or Origin: actors.http.browser_guard), tenant_limit (a tenant past its limits: 429),
    invalid."""
    if exc.status == 401:
        return "auth"
    if exc.status == 429:
        return "tenant_limit"
    if exc.status in (403, 421):
        return "cross_site"
    if exc.status == 503:                 # a CapacityError, or one relayed from the engine as data
        return "draining" if exc.code in ("draining", "loading") else "overload"
    if exc.code == PromptTooLong.code:
        return "too_long"
    return "invalid"
