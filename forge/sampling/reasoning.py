"""Reasoning models: a thinking section (`<think>` ... `</think>`) before the answer, split out of the text and
followed token by token so a budget can close it.

Two sides, one format. The reader (`ReasoningReader`, `split_reasoning`) turns generated text, whole or in
pieces, into reasoning and content; it holds back only what may be the start of a tag, so the pieces joined
equal the whole. The follower (`SectionFollower`) is the model runner's: it tracks, byte by byte over the
tokens, whether a sequence is inside the section and how many tokens it has spent there, and names the token
to force when the budget runs out (the closing tag and the newlines the template writes after it).
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from forge.sampling.sampling_params import Thinking

OPEN, CLOSE = "<think>", "</think>"
# What the runner forces when a budget runs out: the close as Qwen3's and DeepSeek-R1's templates write a past
# turn's section ('\n</think>\n\n'), so the answer that follows starts as it would after a section the model
# closed itself.
CLOSING_TEXT = "\n</think>\n\n"
# qwen3: the model opens the section itself (or, with the template's enable_thinking false, the prompt holds an
# empty one and there is none); deepseek_r1: the generation prompt ends in '<think>\n', so the output starts
# inside it; harmony: gpt-oss's channels (forge.text.harmony reads them; no budget closes its analysis).
FORMATS = ("qwen3", "deepseek_r1", "harmony")
PARSERS = ("auto", "none", *FORMATS)
# reasoning_effort (chat) and reasoning.effort (Responses) as a budget of thinking tokens, OpenAI's levels
# (docs/api.md, "Reasoning models"): none skips the section, max leaves it unbounded.
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 128, "low": 512, "medium": 2048, "high": 8192,
                                         "xhigh": 16384, "max": None}
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


def detect_format(template_source: str, generation_prompt: str) -> str:
    """The reasoning format `auto` picks for a chat template: "harmony" for one that writes harmony's channels
    (gpt-oss); "none" for one that never mentions `<think>`; "deepseek_r1" when its rendered generation prompt
    (`generation_prompt`, a one-message conversation) ends inside an open section; else "qwen3"."""
    if "<|channel|>" in template_source and "<|message|>" in template_source:
        return "harmony"
    if OPEN not in template_source:
        return "none"
    return "deepseek_r1" if ends_inside(generation_prompt) else "qwen3"


def ends_inside(text: str) -> bool:
    """Whether `text` ends inside a thinking section: its last `<think>` comes after its last `</think>`."""
    return text.rfind(OPEN) > text.rfind(CLOSE)


# ---- the reader ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ReasoningParts:
    """What one push (or finish) gave: new reasoning text and new content text (either may be "")."""
    reasoning: str = ""
    content: str = ""


class ReasoningReader:
    """Splits generated text, fed in pieces, into the thinking section's text and the content after it.

    `starts_inside`: the output begins inside the section (deepseek_r1); otherwise it is in one only if it
    opens with `<think>` (after whitespace). The tags never appear in either part; the whitespace after
    `<think>`, before `</think>` and before the content is dropped (as templates strip it when they write a
    past turn back), whitespace inside either part is kept. A `<think>` later in the content is content.
    Feeding the text whole or in any pieces gives the same parts, joined.
    """

    def __init__(self, *, starts_inside: bool) -> None:
        self._starts_inside = starts_inside
        self._buf = ""
        self._state = "start"            # start -> reasoning -> content
        self._pending = ""               # reasoning whitespace that waits for more reasoning
        self._begun = False              # the current part has had text that is not whitespace
        self.has_section = False         # a section was opened (by the prompt or the text)

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    def push(self, text: str) -> ReasoningParts:
        self._buf += text
        return self._consume(final=False)

    def finish(self) -> ReasoningParts:
        """The rest, at the end of the text: a section cut short keeps its text, less what began its tag."""
        return self._consume(final=True)

    def _consume(self, *, final: bool) -> ReasoningParts:
        reasoning, content = [], []
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(OPEN):
                self._buf, self._state = head[len(OPEN):], "reasoning"
            elif OPEN.startswith(head) and not final:
                return ReasoningParts()                      # may yet be the tag: wait
            else:
                self._state = "reasoning" if self._starts_inside else "content"
            self.has_section = self._state == "reasoning"
        if self._state == "reasoning":
            at = self._buf.find(CLOSE)
            if at < 0:
                cut = len(self._buf) - _partial_suffix(self._buf, CLOSE)    # at the end, a tag cut short goes
                reasoning.append(self._reasoning(self._buf[:cut]))
                self._buf = "" if final else self._buf[cut:]
                return ReasoningParts("".join(reasoning))
            reasoning.append(self._reasoning(self._buf[:at]))
            self._buf, self._state, self._begun, self._pending = self._buf[at + len(CLOSE):], "content", False, ""
        if self._state == "content":
            text = self._buf
            if not self._begun:
                text = text.lstrip()
                self._begun = bool(text)
            content.append(text)
            self._buf = ""
        return ReasoningParts("".join(reasoning), "".join(content))

    def _reasoning(self, text: str) -> str:
        """Reasoning text up to its trailing whitespace, which waits: sent with more reasoning, dropped before
        the closing tag or the end (so pieces and the whole agree)."""
        if not self._begun:
            text = text.lstrip()
            self._begun = bool(text)
            if not text:
                return ""
        text = self._pending + text
        kept = text.rstrip()
        self._pending = text[len(kept):]
        return kept


@dataclass(frozen=True, slots=True)
class SplitText:
    reasoning: str | None          # None: no section, or an empty one
    content: str


def split_reasoning(text: str, *, starts_inside: bool) -> SplitText:
    """A whole generated text as its reasoning and its content."""
    reader = ReasoningReader(starts_inside=starts_inside)
    a, b = reader.push(text), reader.finish()
    reasoning = a.reasoning + b.reasoning
    return SplitText(reasoning or None, a.content + b.content)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (it may yet become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---- the follower (model runner) ---------------------------------------------------------------------------

_OPEN_B, _CLOSE_B = OPEN.encode(), CLOSE.encode()


@dataclass(frozen=True, slots=True)
class Section:
    """Where one sequence's output stands with respect to its thinking section."""
    inside: bool = False
    tail: bytes = b""              # the last bytes, where a tag may be starting
    num_reasoning: int = 0         # tokens generated inside the section (the budget's count)
    num_forced: int = 0            # of the closing tokens, how many have been forced so far


class SectionFollower:
    """Follows sequences' thinking sections over one vocabulary's token bytes. A tag may span tokens (the
    bytes are matched, not ids), though reasoning models have each tag as one added token."""

    def __init__(self, vocabulary: Sequence[bytes]) -> None:
        self._vocab = vocabulary

    def start(self, prompt_ids: Sequence[int]) -> Section:
        """The section state after the prompt: inside when the generation prompt opened one (deepseek_r1)."""
        text = b"".join(self._bytes(t) for t in prompt_ids)
        return Section(inside=text.rfind(_OPEN_B) > text.rfind(_CLOSE_B), tail=_tag_tail(text))

    def forced(self, section: Section, thinking: Thinking) -> int | None:
        """The token the next position must be: a closing token while a close is under way, the first one
        once the budget is spent inside the section; None when the model chooses."""
        close = thinking.close_ids
        if not close:
            return None
        if section.num_forced:
            return close[section.num_forced]
        if section.inside and thinking.budget is not None and section.num_reasoning >= thinking.budget:
            return close[0]
        return None

    def advance(self, section: Section, token_id: int, thinking: Thinking) -> tuple[Section, bool]:
        """The state once `token_id` follows, and whether that token counts as reasoning (generated inside
        the section, not the tag that closed it, not forced)."""
        forced = self.forced(section, thinking)
        text = section.tail + self._bytes(token_id)
        inside = section.inside
        # The last tag in the new bytes decides; a tag wholly inside the tail was seen before.
        opened, closed = text.rfind(_OPEN_B), text.rfind(_CLOSE_B)
        if opened > closed:
            inside = True
        elif closed > opened:
            inside = False
        tail = _tag_tail(text)
        if forced is not None:
            num_forced = section.num_forced + 1
            if num_forced >= len(thinking.close_ids):     # the close is written: out, whatever the bytes say
                return Section(inside=False, tail=tail), False
            return replace(section, tail=tail, num_forced=num_forced), False
        counts = section.inside and inside
        return Section(inside=inside, tail=tail, num_reasoning=section.num_reasoning + counts), counts

    def _bytes(self, token_id: int) -> bytes:
        return self._vocab[token_id] if 0 <= token_id < len(self._vocab) else b""


def _tag_tail(text: bytes) -> bytes:
    """The end of `text` that may begin a tag (kept for the next token's bytes)."""
    keep = max(len(_CLOSE_B), len(_OPEN_B)) - 1
    return text[-keep:] if keep else b""
