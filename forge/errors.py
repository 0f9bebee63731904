"""forge's exception tree. Every error a user can cause maps to one class here.

    ForgeError
     +-- RequestError          one request's answer: HTTP status, OpenAI error fields, headers
     |    +-- InvalidRequest   400, with the offending parameter
     |    +-- PromptTooLong    400 context_length_exceeded
     |    +-- CapacityError    503 with Retry-After: retry later (overloaded, draining, loading)
     +-- EngineError           500: forge's own fault
     +-- ModelLoadError        a model file that is missing, corrupt or unsupported
     +-- ConfigError           a setting that cannot work

A RequestError raised anywhere on a request's path (the HTTP edge, the tokenizer, the scheduler)
reaches the client as the same OpenAI error envelope with its status and headers.
"""

from __future__ import annotations


class ForgeError(Exception):
    """Base of every error forge raises on purpose."""


class RequestError(ForgeError):
    """A request that cannot be served as sent, or not now. Class attributes are the defaults."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, status: int | None = None,
                 type: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status if status is not None else self.status
        self.type = type if type is not None else self.type
        self.code = code if code is not None else self.code
        self.headers = headers or {}


class InvalidRequest(RequestError):
    pass


class PromptTooLong(RequestError):
    code = "context_length_exceeded"


class CapacityError(RequestError):
    """Not now: the server is busy, draining or loading. The client should retry later."""

    status = 503
    type = "server_error"

    def __init__(self, message: str, *, code: str | None = None, retry_after_s: int | None = None) -> None:
        headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
        super().__init__(message, code=code, headers=headers)


class EngineError(ForgeError):
    status = 500


class ModelLoadError(ForgeError):
    """The model file cannot be used; the message is one line, fit for a user."""


class ConfigError(ForgeError):
    """A setting that cannot work (e.g. a KV budget too small for one sequence)."""
