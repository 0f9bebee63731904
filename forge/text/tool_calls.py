"""Tool calls in chat: the tools shown to the model and the grammar that forces a call (reading the calls
back out of the generated text is forge/text/tool_reader.py's).

forge's tool-call format is the widespread "Hermes" one: each call is a JSON object
`{"name": <function name>, "arguments": <arguments object>}` between `<tool_call>` and `</tool_call>`
lines. A chat template that knows tools (it mentions `tools`) renders them itself; for one that does not,
forge puts the tool list and the format into the system prompt (`tool_system_prompt`), writes earlier calls
into assistant turns in that format and tool results as `<tool_response>` user turns. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from forge.sampling.nesting import check_schema
from forge.sampling.structured import JSON_OPTIONS, enforced_schema, lark_grammar, strict_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class Function:
    """One tool of a request: a function name, what it does, and its parameters' JSON schema."""
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False           # OpenAI's strict semantics for the arguments (structured.strict_schema)

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI tool object, as templates and the system prompt show it."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


# ---- the prompt -----------------------------------------------------------------------------------------

def tool_system_prompt(functions: Sequence[Function]) -> str:
    """The block forge adds to the system prompt for a template without tool syntax."""
    listing = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in functions)
    return ("# Tools\n\nYou may call one or more of the functions below to help with the user's request. "
            f"Their signatures, one JSON object per line:\n<tools>\n{listing}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments between tags, like this:\n"
            f'{OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}')


def messages_with_tools(messages: Sequence[dict[str, Any]], functions: Sequence[Function],
                        ) -> list[dict[str, Any]]:
    """Messages for a template without tool syntax: the tool block joins the system prompt (a first
    system message is added when there is none), assistant tool calls become text in forge's format,
    and each run of tool results becomes one user turn of `<tool_response>` blocks."""
    out: list[dict[str, Any]] = []
    block = tool_system_prompt(functions) if functions else ""
    if block:
        if messages and messages[0]["role"] in ("system", "developer"):
            first = messages[0]
            out.append({**first, "content": f"{first['content']}\n\n{block}" if first["content"] else block})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            calls = "\n".join(f"{OPEN}\n{_call_text(c)}\n{CLOSE}" for c in msg["tool_calls"])
            content = f"{msg['content']}\n{calls}" if msg.get("content") else calls
            out.append({"role": "assistant", "content": content})
        elif msg["role"] == "tool":
            response = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{response}"}
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
        else:
            out.append(msg)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    arguments = fn.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = arguments                    # the client's own text, kept as a string
    return json.dumps({"name": fn.get("name", ""), "arguments": parsed}, ensure_ascii=False)


# ---- the grammar ----------------------------------------------------------------------------------------

def tool_call_grammar(functions: Sequence[Function], *, parallel: bool, param: str) -> str:
    """Output that is one call (several, one per line, when `parallel`) to one of `functions`, each call's
    arguments valid under that function's parameter schema (its definitions, `$defs` or `definitions`,
    moved to the root of the call's schema, where its references now point). A parameter schema nested
    deeper than MAX_SCHEMA_DEPTH is refused before anything recursive reads it."""
    options, defs = [], {}
    for i, f in enumerate(functions):
        parameters = f.parameters if f.parameters is not None else {"type": "object"}
        check_schema(parameters, param=param)
        if f.strict:
            parameters = strict_schema(parameters)
        parameters, own = _hoisted(enforced_schema(parameters), f"f{i}_")
        defs.update(own)
        options.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                        "properties": {"name": {"const": f.name}, "arguments": parameters}})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": JSON_OPTIONS, **({"$defs": defs} if defs else {})}
    calls = 'call ("\\n" call)*' if parallel else "call"
    grammar = (f"start: {calls}\n"
               f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}\n"
               f"body: %json {json.dumps(schema)}\n")
    return lark_grammar(grammar, param=param)


def _hoisted(parameters: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A function's parameter schema without its `$defs` / `definitions`, and those definitions
    renamed with `prefix` (two functions may both define "Item"); every "#/$defs/X" or
    "#/definitions/X" reference inside now reads "#/$defs/<prefix>X", the combined schema's root."""
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        if isinstance(parameters.get(key), dict):
            defs.update({prefix + name: s for name, s in parameters[key].items()})
    if not defs:
        return parameters, {}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str):
                for key in ("$defs", "definitions"):
                    if ref.startswith(f"#/{key}/"):
                        out["$ref"] = f"#/$defs/{prefix}{ref[len(key) + 3:]}"
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    body = rewrite({k: v for k, v in parameters.items() if k not in ("$defs", "definitions")})
    return body, {name: rewrite(s) for name, s in defs.items()}
