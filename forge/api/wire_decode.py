"""A request body's bytes to a validated Struct of any of forge's wire schemas (OpenAI's, the Responses and
Messages APIs', embeddings), or an InvalidRequest whose param is the JSON path of the bad field. One
decoder for every route, so that every API treats invalid UTF-8, invalid JSON, nulls and nesting alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from forge.errors import InvalidRequest

_W = TypeVar("_W", bound=msgspec.Struct)
_AT_PATH = re.compile(r"^(?P<detail>.*?) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]*)`$")
_NULL_DEPTH = 5  # body -> messages -> message -> content -> part: nulls count as absent down to parts
# JSON schemas and tool inputs: null is a value there
_SCHEMA_KEYS = frozenset({"schema", "parameters", "json", "guided_json", "input_schema", "input",
                          "arguments"})     # Ollama's calls' arguments are an object


def decode_body(body: bytes, kind: type[_W], *, normalise: Callable[[Any], Any] | None = None,
                schema_keys: frozenset[str] = frozenset()) -> _W:
    """Bytes -> a validated Struct of any wire schema, or InvalidRequest naming the bad field. Never raises
    anything else. Unknown fields are ignored and a null field counts as absent (down to a message's
    content parts; inside JSON schemas and tool inputs null is a value, and inside `schema_keys`, the
    wire format's own fields that hold a schema). `normalise` rewrites the parsed JSON before it is typed
    (a wire format whose union members may leave their tag out)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("request body is not valid UTF-8") from None
    try:
        raw = _drop_nulls(msgspec.json.decode(body), _NULL_DEPTH, _SCHEMA_KEYS | schema_keys)
        return msgspec.convert(normalise(raw) if normalise is not None else raw, kind)
    except msgspec.ValidationError as exc:
        raise _invalid(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None


def _drop_nulls(obj: Any, depth: int, kept: frozenset[str]) -> Any:
    """Remove null-valued keys from objects, so that `"n": null` means the same as leaving n out."""
    if depth <= 0:
        return obj
    if isinstance(obj, dict):
        return {k: v if k in kept else _drop_nulls(v, depth - 1, kept) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_nulls(v, depth - 1, kept) for v in obj]
    return obj


def _invalid(message: str) -> InvalidRequest:
    """Turn msgspec's "<detail> - at `$.a[0].b`" into a message plus the param "a[0].b"."""
    detail, path = message, ""
    if m := _AT_PATH.match(message):
        detail, path = m["detail"], m["path"].removeprefix(".").replace("[...]", "")   # [...]: a dict's value
    if m := _MISSING.match(detail):
        param = f"{path}.{m['field']}" if path else m["field"]
        return InvalidRequest(f"missing required field '{param}'", param=param)
    if not path:
        return InvalidRequest(f"invalid request: {detail}")
    return InvalidRequest(f"invalid '{path}': {detail}", param=path)
