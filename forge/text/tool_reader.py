"""Tool calls read back out of generated text, whole or incrementally for a stream (the format is
forge/text/tool_calls.py's: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`).

A call's arguments end where their JSON value ends, found by following its structure (strings with their
escapes, the nesting of objects and arrays), never by searching for the closing tag: the arguments are
any JSON the model writes, and a string in them may hold `</tool_call>`, `}` or `<tool_call>` (a small
model writes them into a string it wants to leave). After the value come the call's own `}` and the tag.

How sure the reader may be depends on the request:

- `strict` (the output was constrained by the call grammar: tool_choice required or named, the Messages
  API's any or tool): the text is well-formed, so the structure is followed strictly and the arguments
  are sent as they come. A tag inside a string is only text. If the text nevertheless leaves the format
  after the value, the call ends at its value and the rest is content (a missing `}` before the tag is
  let pass; JSON that breaks inside the value falls back as below, with what was sent kept).
- not strict (tool_choice auto, or no grammar): the model may write broken JSON. The structure is still
  followed, but where the JSON breaks (a bracket closing the wrong thing; after the value anything but the
  call's `}` and the tag, that `}` missing included; the text ending inside the value after a closing tag)
  the call is read as before structure was followed: its arguments end at the first `</tool_call>` after
  them, less the call's `}`. So that a stream agrees with either reading, arguments are sent only up to
  what both readings hold (nothing from a closing tag inside a string on, until the value closes).

Either way, the text fed whole or in any pieces gives the same events, joined (for strict reading, of
text the grammar allows).

Pure: no I/O.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from forge.text.tool_calls import CLOSE, OPEN

# The head of a call as forge's grammar writes it (and as models trained on the format do).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.DOTALL)
_SCALAR = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-.")
_PAIRS = {"}": "{", "]": "["}


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


class JsonValueScanner:
    """Follows one JSON value character by character, fed in pieces: where it ends, or that it broke.
    Lenient inside (it checks strings, escapes and brackets, not every token): enough to know the end."""

    def __init__(self) -> None:
        self.began = False
        self.broken = False
        self._stack: list[str] = []           # open brackets
        self._kind = ""                       # "container", "string" (a top-level one) or "scalar"
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> int | None:
        """How much of `text` belongs to the value when it ends in `text` (the rest is not the value's),
        else None (it goes on, or it broke: see `broken`). Leading whitespace belongs to nothing: the
        caller strips it before the value begins."""
        for i, c in enumerate(text):
            if self.broken:
                return None
            if not self.began:
                self.began = True
                if c in "{[":
                    self._kind, self._stack = "container", [c]
                elif c == '"':
                    self._kind, self._in_string = "string", True
                elif c in _SCALAR:
                    self._kind = "scalar"
                else:
                    self.broken = True
                continue
            if self._kind == "scalar":
                if c not in _SCALAR:
                    return i
            elif self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._kind == "string":
                        return i + 1
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._stack.append(c)
            elif c in "}]":
                if self._stack.pop() != _PAIRS[c]:
                    self.broken = True
                    return None
                if not self._stack:
                    return i + 1
        return None


class ToolCallReader:
    """Splits generated text, fed in pieces, into content and tool calls as they become certain.

    Content never includes a call's tags; whitespace-only content (the newlines around calls) is
    dropped. A call's name is sent once its head is complete, its arguments as they come, holding back
    only what may not be theirs (the module's docstring: `strict` for output the call grammar
    constrained). A block that is not a call in forge's format is content. Feeding the text whole or in
    any pieces gives the same events, joined.
    """

    def __init__(self, *, max_calls: int | None = None, strict: bool = False) -> None:
        self._buf = ""                        # text not yet consumed (in a call: arguments not yet sent)
        self._state = "text"                  # text -> head -> arguments [-> fallback] -> text ...
        self._pending = ""                    # content that is whitespace so far
        self._num_calls = 0
        self._max_calls = max_calls
        self._strict = strict
        self._scan = JsonValueScanner()
        self._scanned = 0                     # how much of _buf the scanner has seen
        self._value_end: int | None = None    # where in _buf the arguments' value ended
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
            # Cut short (the length limit) inside the value, or just after it: what the value has.
            end = self._value_end if self._value_end is not None else len(self._buf)
            if self._scan.began and self._buf[:end]:
                self._emit_arguments(events, self._buf[:end])
        elif self._state == "fallback":
            # Cut short: drop what began the closing tag, and the call's own closing brace where the
            # arguments sent so far are whole JSON without it.
            rest = self._buf.rstrip()
            rest = rest[: len(rest) - _partial_suffix(rest, CLOSE)].rstrip()
            if rest.endswith("}") and _is_json(self._arguments + rest[:-1]):
                rest = rest[:-1].rstrip()
            if rest:
                self._emit_arguments(events, rest)
        elif self._state == "text":
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
            return self._step_arguments(events, final=final)
        if self._state == "fallback":
            return self._step_fallback(events)
        self._buf = ""                                        # "ignored": everything after the last call
        return False

    def _step_arguments(self, events: list[ToolEvent], *, final: bool) -> bool:
        """The arguments' value, followed by its structure, then the call's `}` and closing tag."""
        if not self._scan.began:                              # whitespace after the head is not arguments
            self._buf = self._buf.lstrip()
            self._scanned = 0
        buf = self._buf
        if self._value_end is None and self._scanned < len(buf):
            end = self._scan.feed(buf[self._scanned:])
            self._value_end = None if end is None else self._scanned + end
            self._scanned = len(buf)
        if self._scan.broken:
            self._state = "fallback"
            return True
        if self._value_end is not None:
            rest = buf[self._value_end:]
            tail = _tail(rest, brace=not self._strict)
            if tail is not None:                              # the call's end: the whole value is its arguments
                self._emit_arguments(events, buf[: self._value_end])
                self._buf, self._state = rest[tail:], "text"
                return True
            if not _may_become_tail(rest, brace=not self._strict):
                if not self._strict:
                    self._state = "fallback"
                    return True
                self._emit_arguments(events, buf[: self._value_end])  # out of the format: the rest is content
                self._buf, self._state = rest.lstrip().removeprefix("}"), "text"
                return True
        elif final and not self._strict and CLOSE in buf:     # the text ended inside the value: broken
            self._state = "fallback"
            return True
        # Send what is certain: in strict mode the value so far; else only what the tag search would
        # also give (nothing from the first closing tag on, nor a brace and whitespace just before it).
        cut = len(buf) if self._value_end is None else self._value_end
        if not self._strict:
            cut = min(cut, _tag_cut(buf))
        if cut > 0 and self._scan.began:
            self._emit_arguments(events, buf[:cut])
            self._buf = buf[cut:]
            self._scanned -= cut
            if self._value_end is not None:
                self._value_end -= cut
        return False

    def _step_fallback(self, events: list[ToolEvent]) -> bool:
        """Broken JSON in unconstrained output: the arguments end at the first closing tag."""
        buf = self._buf
        end = buf.find(CLOSE)
        if end >= 0:
            args = buf[:end].rstrip()
            if args.endswith("}"):
                args = args[:-1].rstrip()
            if args:
                self._emit_arguments(events, args)
            self._buf, self._state = buf[end + len(CLOSE):], "text"
            return True
        cut = _tag_cut(buf)
        if cut > 0:
            self._emit_arguments(events, buf[:cut])
            self._buf = buf[cut:]
        return False

    def _start_call(self, events: list[ToolEvent], name: str) -> None:
        self._scan, self._scanned, self._value_end, self._arguments = JsonValueScanner(), 0, None, ""
        events.append(CallStart(self._num_calls, new_call_id(), name))
        self._num_calls += 1

    def _emit_arguments(self, events: list[ToolEvent], text: str) -> None:
        if text:
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


def read_message(text: str, *, max_calls: int | None = None, strict: bool = False) -> ParsedMessage:
    """A whole generated message as content (None when it is only calls and whitespace) and calls."""
    reader = ToolCallReader(max_calls=max_calls, strict=strict)
    events = reader.push(text) + reader.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, CallStart):
            calls.append(ToolCall(e.id, e.name))
        elif isinstance(e, ArgumentsDelta):
            calls[e.index].arguments += e.text
    return ParsedMessage(content or None, calls)


def _tail(text: str, *, brace: bool) -> int | None:
    """The length of the call's end (whitespace, its `}`, whitespace, the closing tag) at the start of
    `text`, if it is there whole; the `}` may be missing unless `brace`."""
    rest = text.lstrip()
    if rest.startswith("}"):
        rest = rest[1:].lstrip()
    elif brace:
        return None
    if rest.startswith(CLOSE):
        return len(text) - len(rest) + len(CLOSE)
    return None


def _may_become_tail(text: str, *, brace: bool) -> bool:
    """Whether more text may yet make `text` the call's end (_tail)."""
    rest = text.lstrip()
    if rest.startswith("}"):
        return CLOSE.startswith(rest[1:].lstrip())
    return not rest if brace else CLOSE.startswith(rest)


def _tag_cut(buf: str) -> int:
    """How much of `buf` (arguments not yet sent) the tag search holds to be arguments already: all
    before the first closing tag, or before what may begin one, less a `}` and whitespace before it."""
    end = buf.find(CLOSE)
    cut = end if end >= 0 else len(buf) - _partial_suffix(buf, CLOSE)
    cut = len(buf[:cut].rstrip())
    if buf[:cut].endswith("}"):
        cut = len(buf[: cut - 1].rstrip())
    return cut


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
