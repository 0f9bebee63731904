"""The Responses API's tools as forge offers them to the model, and the calls named back as the client
expects.

Functions come flat (`{"type": "function", "name", ...}`) or grouped in namespaces (`{"type": "namespace",
"name", "description", "tools": [functions]}`, as coding agents send their MCP servers' tools). A
namespaced function is offered to the model under one flat name, `<namespace>__<name>` (Codex's own
flattening: the namespace's trailing and the name's leading underscores trimmed), and a call of it is
named back as the API names it: `name` the function's own, `namespace` its group's. Every other tool
type (web_search, file_search, code_interpreter, computer_use, image_generation, mcp, local_shell,
custom, ...) is a tool forge does not run: it is left out of what the model is offered, and the response
says so in `warnings` (and a `Warning` header) instead of refusing the request. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from forge.errors import InvalidRequest
from forge.sampling.nesting import check_schema

ToolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]   # as chat's function names
NAMESPACE_SEPARATOR = "__"
SERVED_TYPES = ("function", "namespace")
_UNSERVED = "unserved"                          # the type a tool forge does not run is decoded under


class _ToolWire(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """A tool, told apart by its "type". Unknown fields are ignored (defer_loading, ...)."""


class FunctionTool(_ToolWire, frozen=True, kw_only=True, tag="function"):
    """A function in the Responses API's flat shape (chat nests it under "function")."""
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class UnservedTool(_ToolWire, frozen=True, kw_only=True, tag=_UNSERVED):
    """A tool of a type forge does not run, its type as sent (normalise_tools renames it)."""
    declared_type: str


class NamespaceTool(_ToolWire, frozen=True, kw_only=True, tag="namespace"):
    """Functions grouped under a name the calls carry back (`namespace` on a function_call item)."""
    name: ToolName
    description: str | None = None
    tools: list[FunctionTool | UnservedTool]


Tool = FunctionTool | NamespaceTool | UnservedTool


def normalise_tools(tools: Any, *, nested: bool = False) -> Any:
    """The request's tools with each of a type forge does not run as {"type": "unserved", "declared_type"}
    (a namespace's members too), so that decoding keeps them apart instead of refusing the request. A tool
    with no string type is left as it is: the decoder names it (tools[i].type)."""
    if not isinstance(tools, list):
        return tools
    served = ("function",) if nested else SERVED_TYPES
    out = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind not in served:
            tool = {"type": _UNSERVED, "declared_type": kind}
        elif isinstance(tool, dict) and kind == "namespace":
            tool = {**tool, "tools": normalise_tools(tool.get("tools"), nested=True)}
        out.append(tool)
    return out


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model is offered a function under: its own, or `<namespace>__<name>` in a namespace."""
    if namespace is None:
        return name
    return f"{namespace.rstrip('_')}{NAMESPACE_SEPARATOR}{name.lstrip('_')}"


def offered(tools: Sequence[Tool] | None) -> list[tuple[str | None, FunctionTool, str | None]]:
    """Every function the model is offered, in order: (its namespace or None, the function, the namespace's
    description)."""
    out: list[tuple[str | None, FunctionTool, str | None]] = []
    for tool in tools or ():
        if isinstance(tool, FunctionTool):
            out.append((None, tool, None))
        elif isinstance(tool, NamespaceTool):
            out += [(tool.name, member, tool.description) for member in tool.tools if isinstance(member, FunctionTool)]
    return out


def call_names(tools: Sequence[Tool] | None) -> dict[str, tuple[str | None, str]]:
    """A called name -> (namespace, name) as a function_call item carries them: every flat name offered,
    and a namespaced function's own name where no other function has it (a model may drop the prefix)."""
    names: dict[str, tuple[str | None, str]] = {}
    own: dict[str, list[tuple[str | None, str]]] = {}
    for namespace, function, _ in offered(tools):
        names[flat_name(namespace, function.name)] = (namespace, function.name)
        own.setdefault(function.name, []).append((namespace, function.name))
    for name, holders in own.items():
        if len(holders) == 1 and name not in names:
            names[name] = holders[0]
    return names


def check_tools(tools: Sequence[Tool] | None) -> None:
    """InvalidRequest naming the tool: two functions offered under one name, or parameters that are not a
    JSON schema of type object (or nest too deep)."""
    seen: set[str] = set()
    for i, tool in enumerate(tools or ()):
        members = [(f"tools[{i}]", tool)] if isinstance(tool, FunctionTool) else (
            [(f"tools[{i}].tools[{j}]", m) for j, m in enumerate(tool.tools)] if isinstance(tool, NamespaceTool)
            else [])
        for path, member in members:
            if not isinstance(member, FunctionTool):
                continue
            name = flat_name(tool.name if isinstance(tool, NamespaceTool) else None, member.name)
            if name in seen:
                raise InvalidRequest(f"tool names must be unique: {name!r} is offered twice", param="tools")
            seen.add(name)
            if member.parameters is not None:
                if member.parameters.get("type", "object") != "object":
                    raise InvalidRequest("a function's parameters must be a JSON schema of type object",
                                         param=f"{path}.parameters")
                check_schema(member.parameters, param=f"{path}.parameters")


def declined(tools: Sequence[Tool] | None) -> list[tuple[str, str]]:
    """Every tool forge does not run: (its path, its type as sent)."""
    out: list[tuple[str, str]] = []
    for i, tool in enumerate(tools or ()):
        if isinstance(tool, UnservedTool):
            out.append((f"tools[{i}]", tool.declared_type))
        elif isinstance(tool, NamespaceTool):
            out += [(f"tools[{i}].tools[{j}]", m.declared_type) for j, m in enumerate(tool.tools)
                    if isinstance(m, UnservedTool)]
    return out


def warnings(tools: Sequence[Tool] | None) -> list[dict[str, str]]:
    """The response's `warnings`: one per tool left out of what the model is offered."""
    return [{"code": "tool_not_served", "param": path,
             "message": f"the {_printable(kind)!r} tool is not run by this server: it was left out of the tools "
                        "offered to the model"} for path, kind in declined(tools)]


def warning_header(items: Sequence[Mapping[str, str]]) -> str | None:
    """The warnings as one HTTP Warning header (code 299, "miscellaneous persistent warning"); None if none."""
    if not items:
        return None
    text = "; ".join(f"{w['param']}: {w['message']}" for w in items).replace('"', "'")
    return f'299 forge "{text}"'


def echoed(tools: Sequence[Tool] | None) -> list[dict[str, Any]]:
    """The tools a response repeats: those offered to the model, as sent."""
    out: list[dict[str, Any]] = []
    for tool in tools or ():
        if isinstance(tool, FunctionTool):
            out.append(msgspec.to_builtins(tool))
        elif isinstance(tool, NamespaceTool):
            kept = msgspec.structs.replace(tool, tools=[m for m in tool.tools if isinstance(m, FunctionTool)])
            out.append(msgspec.to_builtins(kept))
    return out


def _printable(kind: str) -> str:
    """A tool type as a header and a message may carry it (the client's text, so only its plain characters)."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "", kind)[:64]
