"""forge's exception tree. Every error a user can cause maps to one class here.

    ForgeError
     +-- RequestError          4xx: the request itself is wrong
     |    +-- InvalidRequest   400, with the offending parameter
     |    +-- PromptTooLong    400 context_length_exceeded
     +-- CapacityError         503: retry later (queue full, draining)
     +-- EngineError           500: forge's own fault
     +-- ModelLoadError        a model file that is missing, corrupt or unsupported
"""

from __future__ import annotations


class ForgeError(Exception):
    """Base of every error forge raises on purpose."""


class RequestError(ForgeError):
    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(RequestError):
    pass


class PromptTooLong(RequestError):
    code = "context_length_exceeded"


class CapacityError(ForgeError):
    status = 503


class EngineError(ForgeError):
    status = 500


class ModelLoadError(ForgeError):
    """The model file cannot be used; the message is one line, fit for a user."""


class ConfigError(ForgeError):
    """A setting that cannot work (e.g. a KV budget too small for one sequence)."""
