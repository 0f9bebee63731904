"""OpenAI's harmony format (gpt-oss) read by channel: a reply's reasoning, its answer, and its tool calls.

A harmony reply is a run of messages after the prompt's `<|start|>assistant`, each a header, `<|message|>`,
a body and an end:

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

(the recipient, `to=...`, may also stand before `<|channel|>`). HarmonyReader splits such text, fed in
pieces, into forge.sampling.reasoning's two parts, so that the routes that read a <think> section read
this too:

    analysis, or a message to a tool forge does not run (browser, python)   -> reasoning
    final, or commentary to no one (a preamble for the user)                 -> content
    to=functions.NAME                                                        -> content, as forge's own tool
                                                                                call (forge.text.tool_calls),
                                                                                which the tool-call reader
                                                                                then takes out as a call

The markers are the vocabulary's control tokens, so the text must be detokenized with them kept. Feeding
the text whole or in any pieces gives the same parts, joined; only what may be the start of a marker is
held back. Pure: no I/O.
"""

from __future__ import annotations

import json
import re

from forge.sampling.reasoning import ReasoningParts
from forge.text.tool_calls import CLOSE as CALL_CLOSE
from forge.text.tool_calls import OPEN as CALL_OPEN

MESSAGE = "<|message|>"
# What ends a message's body: its end (<|end|>, or the reply's: <|return|>, a tool call's: <|call|>), or the
# next message's header where a model skips the end.
ENDS = ("<|end|>", "<|call|>", "<|return|>")
HEADS = ("<|start|>", "<|channel|>")
MARKERS = (*ENDS, *HEADS, MESSAGE, "<|constrain|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w.-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
FUNCTIONS = "functions."


def is_harmony(template_source: str) -> bool:
    """Whether a chat template writes harmony (gpt-oss's): its messages have channels."""
    return "<|channel|>" in template_source and MESSAGE in template_source


class HarmonyReader:
    """Splits a harmony reply, fed in pieces, into reasoning and content (tool calls in forge's format)."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "header"          # header -> body -> header ...
        self._kind = ""                 # the body's: "reasoning", "content" or "call"
        self.has_section = False        # a reasoning message was read

    def push(self, text: str) -> ReasoningParts:
        self._buf += text
        return self._consume(final=False)

    def finish(self) -> ReasoningParts:
        """The rest, at the end of the text: a message cut short keeps its body (a call is closed); a header
        with no body is dropped, and text that never had a marker is content."""
        return self._consume(final=True)

    def _consume(self, *, final: bool) -> ReasoningParts:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == "header":
                at = self._buf.find(MESSAGE)
                if at < 0:
                    if final:
                        if not _MARKER.search(self._buf):         # no harmony at all: the text is the answer
                            content.append(self._buf)
                        self._buf = ""
                    break
                self._open(self._buf[:at], content)
                self._buf, self._state = self._buf[at + len(MESSAGE):], "body"
                continue
            out = reasoning if self._kind == "reasoning" else content
            at, marker = _first(self._buf, (*ENDS, *HEADS))
            if at < 0:
                keep = 0 if final else _partial_marker(self._buf)
                out.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                if final:
                    self._close(content)
                break
            out.append(self._buf[:at])
            self._close(content)
            self._buf = self._buf[at + len(marker):] if marker in ENDS else self._buf[at:]
            self._state = "header"
        return ReasoningParts("".join(reasoning), "".join(content))

    def _open(self, header: str, content: list[str]) -> None:
        """A message's header read: where its body goes (a call's head written out now)."""
        channel = m[1] if (m := _CHANNEL.search(header)) else ""
        recipient = m[1] if (m := _RECIPIENT.search(header)) else ""
        if recipient.startswith(FUNCTIONS):
            self._kind = "call"
            name = recipient[len(FUNCTIONS):]
            content.append(f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ')
        elif channel == "final" or (channel == "commentary" and not recipient):
            self._kind = "content"
        else:
            self._kind = "reasoning"
            self.has_section = True

    def _close(self, content: list[str]) -> None:
        if self._kind == "call":
            content.append(f"}}\n{CALL_CLOSE}")
        self._kind = ""


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The earliest of `markers` in text and where it is; (-1, "") for none."""
    found = [(at, m) for m in markers if (at := text.find(m)) >= 0]
    return min(found) if found else (-1, "")


def _partial_marker(text: str) -> int:
    """Length of the longest suffix of text that may begin a marker (held back until the next piece)."""
    for n in range(min(max(len(m) for m in MARKERS) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
    return 0
