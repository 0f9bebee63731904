"""Tool calls in chat: the tools shown to the model, the grammar that forces a call, and the calls read back
out of the generated text (whole, or incrementally for a stream).

forge's tool-call format is the widespread "Hermes" one: each call is a JSON object
`{"name": <function name>, "arguments": <arguments object>}` between `<tool_call>` and `</tool_call>`
lines. A chat template that knows tools (it mentions `tools`) renders them itself; for one that does not,
forge puts the tool list and the format into the system prompt (`tool_system_prompt`), writes earlier calls
into assistant turns in that format and tool results as `<tool_response>` user turns. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from forge.sampling.nesting import check_schema
from forge.sampling.structured import JSON_OPTIONS, enforced_schema, lark_grammar, strict_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The head of a call as forge's grammar writes it (and as models trained on the format do).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.DOTALL)


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


# ---- reading calls back ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = ContentDelta | CallStart | ArgumentsDelta


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class ParsedMessage:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallReader:
    """Splits generated text, fed in pieces, into content and tool calls as they become certain.

    Content never includes a call's tags; whitespace-only content (the newlines around calls) is
    dropped. A call's name is sent once its head is complete, its arguments as they come, holding back
    only what may be the call's closing brace and tag. A block that is not a call in forge's format is
    content. Feeding the text whole or in any pieces gives the same events, joined.
    """

    def __init__(self, *, max_calls: int | None = None) -> None:
        self._buf = ""
        self._state = "text"                  # text -> head -> arguments -> text ...
        self._pending = ""                    # content that is whitespace so far
        self._num_calls = 0
        self._max_calls = max_calls
        self._args_begun = False
        self._arguments = ""                  # the current call's arguments sent so far

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def push(self, text: str) -> list[ToolEvent]:
        self._buf += text
        events: list[ToolEvent] = []
        while self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[ToolEvent]:
        """The rest, at the end of the text (a call cut short keeps the arguments it has)."""
        events: list[ToolEvent] = []
        while self._step(events, final=True):
            pass
        if self._state == "head":                             # a block cut short before its head ended
            self._content(events, OPEN + self._buf)
        elif self._state == "arguments":
            # Cut short (the length limit): drop what began the closing tag, and the call's own closing
            # brace where the arguments sent so far are whole JSON without it.
            rest = self._buf.rstrip()
            rest = rest[: len(rest) - _partial_suffix(rest, CLOSE)].rstrip()
            if rest.endswith("}") and _is_json(self._arguments + rest[:-1]):
                rest = rest[:-1].rstrip()
            if rest:
                self._emit_arguments(events, rest)
        else:
            self._content(events, self._buf)
        self._buf, self._state = "", "text"
        return events

    def _step(self, events: list[ToolEvent], *, final: bool) -> bool:
        """Consume what is certain; True if the state changed (call again)."""
        buf = self._buf
        if self._state == "text":
            at = buf.find(OPEN)
            if at < 0:
                keep = 0 if final else _partial_suffix(buf, OPEN)
                self._content(events, buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            self._content(events, buf[:at])
            self._buf = buf[at + len(OPEN):]
            if self._max_calls is not None and self._num_calls >= self._max_calls:
                self._buf, self._state = "", "ignored"      # past the calls asked for: dropped
                return False
            self._state, self._pending = "head", ""        # whitespace before a call is dropped
            return True
        if self._state == "head":
            if m := _HEAD.match(buf):
                self._start_call(events, _unescape(m["name"]))
                self._buf, self._state = buf[m.end():], "arguments"
                return True
            end = buf.find(CLOSE)
            if end < 0:
                return False                                  # wait for the head, or the block's end
            self._whole_block(events, buf[:end])
            self._buf, self._state = buf[end + len(CLOSE):], "text"
            return True
        if self._state == "arguments":
            if not self._args_begun:                          # whitespace after the head is not arguments
                buf = self._buf = buf.lstrip()
                self._args_begun = bool(buf) and not CLOSE.startswith(buf[: len(CLOSE)])
            end = buf.find(CLOSE)
            if end >= 0:
                args = buf[:end].rstrip()
                if args.endswith("}"):
                    args = args[:-1].rstrip()
                if args:
                    self._emit_arguments(events, args)
                self._buf, self._state = buf[end + len(CLOSE):], "text"
                return True
            cut = len(buf) - _partial_suffix(buf, CLOSE)
            cut = len(buf[:cut].rstrip())
            if buf[:cut].endswith("}"):
                cut = len(buf[: cut - 1].rstrip())
            if cut > 0:
                self._emit_arguments(events, buf[:cut])
                self._buf = buf[cut:]
            return False
        self._buf = ""                                        # "ignored": everything after the last call
        return False

    def _start_call(self, events: list[ToolEvent], name: str) -> None:
        self._args_begun, self._arguments = False, ""
        events.append(CallStart(self._num_calls, new_call_id(), name))
        self._num_calls += 1

    def _emit_arguments(self, events: list[ToolEvent], text: str) -> None:
        self._arguments += text
        events.append(ArgumentsDelta(self._num_calls - 1, text))

    def _whole_block(self, events: list[ToolEvent], body: str) -> None:
        """A block whose head is not in forge's format: a call if it is the JSON of one, else content."""
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and "arguments" in obj:
            self._start_call(events, obj["name"])
            arguments = obj["arguments"]
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            events.append(ArgumentsDelta(self._num_calls - 1, text))
        else:
            self._content(events, OPEN + body + CLOSE)

    def _content(self, events: list[ToolEvent], text: str) -> None:
        """Content up to its trailing whitespace, which waits: sent with more content, dropped before a
        call or the end (so pieces and the whole agree)."""
        text = self._pending + text
        kept = text.rstrip()
        if kept:
            events.append(ContentDelta(kept))
        self._pending = text[len(kept):]


def read_message(text: str, *, max_calls: int | None = None) -> ParsedMessage:
    """A whole generated message as content (None when it is only calls and whitespace) and calls."""
    reader = ToolCallReader(max_calls=max_calls)
    events = reader.push(text) + reader.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, CallStart):
            calls.append(ToolCall(e.id, e.name))
        elif isinstance(e, ArgumentsDelta):
            calls[e.index].arguments += e.text
    return ParsedMessage(content or None, calls)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (it may yet become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _unescape(name: str) -> str:
    try:
        return str(json.loads(f'"{name}"'))
    except ValueError:
        return name


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
