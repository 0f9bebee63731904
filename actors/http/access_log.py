"""The access log: one line per HTTP request, with its id, status, tokens and timings."""

from __future__ import annotations

import time
import uuid
from typing import Any

import structlog

log = structlog.get_logger("forge.access")


class AccessLog:
    """ASGI middleware: binds a request id for every log line of the request, logs when done."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex[:16]
        start = time.monotonic()
        state = scope.setdefault("state", {})
        info: dict[str, Any] = {"status": None, "first_byte_s": None, "client_closed": False}

        async def receive_wrapper() -> Any:
            message = await receive()
            if message["type"] == "http.disconnect":
                info["client_closed"] = True
            return message

        async def send_wrapper(message: Any) -> None:
            if message["type"] == "http.response.start":
                info["status"] = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            elif message["type"] == "http.response.body" and info["first_byte_s"] is None:
                info["first_byte_s"] = round(time.monotonic() - start, 4)
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                await self.app(scope, receive_wrapper, send_wrapper)
            finally:
                # A client that left before its response began is logged as nginx does (499), not as
                # a failure of the server; one that left mid-stream keeps its status, marked.
                status = info["status"] if info["status"] is not None else (499 if info["client_closed"] else 500)
                if scope.get("path") not in ("/healthz", "/metrics") or status >= 400:
                    named = {"model": state["model_name"]} if state.get("model_name") else {}  # several models
                    log.info("access", **named, method=scope.get("method"), path=scope.get("path"),
                             status=status, response_id=state.get("response_id"),
                             client_closed=info["client_closed"], prompt_tokens=state.get("prompt_tokens"),
                             completion_tokens=state.get("completion_tokens"),
                             ttfb_s=info["first_byte_s"], duration_s=round(time.monotonic() - start, 4))


def _header(scope: Any, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            text = value.decode("latin-1")
            return text[:64] if text.isprintable() else None
    return None
