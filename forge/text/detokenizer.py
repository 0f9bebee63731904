"""Generated ids -> text, incrementally, for streaming: whole characters only, stop strings withheld.

Owns one request's output text: a UTF-8 decoder fed with each token's raw bytes (O(1) work per
token), and the hold-back of text that might still become a stop string. Pure; no I/O.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol

from forge.messages import FinishReason
from forge.text.stops import stop_automaton


class TokenSource(Protocol):
    special_ids: frozenset[int]

    def token_bytes(self, token_id: int) -> bytes: ...


class IncrementalDetokenizer:
    """Turns pushed ids into newly completed text.

    Invariants:
    - Every returned string is whole characters: bytes of an unfinished UTF-8 character are held
      until it completes; an invalid byte sequence becomes U+FFFD, exactly as `Tokenizer.decode`.
    - No returned text is part of a stop string: the longest suffix of the pending text that is a
      prefix of some stop string is held back until it either completes (then `stopped` is True,
      `stop_reason` is that string, and the text before it is the last text emitted) or diverges.
      When several could match, the one whose end comes first wins, however the ids are chunked.
    - Without stop strings, the concatenation of all returns of `push` and `flush` equals
      `tokenizer.decode(all_ids, skip_special_tokens=...)`; `text` is that concatenation so far.

    `prompt_ids` only matter when the prompt ends inside a UTF-8 character (a prompt given as
    ids): its unfinished bytes are carried over, so the output starts with the completed character.
    """

    def __init__(
        self,
        tokenizer: TokenSource,
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_ids = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._stops = stop_automaton(tuple(stop)) if any(stop) else None
        self._stop_state = 0  # the automaton's state: its depth is the length of the text held back
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded text not yet emitted: a possible start of a stop string
        self._chunks: list[str] = []
        self.stopped = False
        self.stop_reason: str | None = None
        self._carry_prompt_tail(prompt_ids)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def push_run(self, ids: Sequence[int]) -> tuple[str, int]:
        """Feed one step's ids; return their text and how many were taken: all of them, or those
        up to the one that completes a stop string (what feeding them one by one would take)."""
        if self._stops is None or len(ids) <= 1:
            return self.push(ids), len(ids)
        text, taken = "", 0
        while taken < len(ids) and not self.stopped:
            text += self.push(ids[taken:taken + 1])
            taken += 1
        return text, taken

    def advance(self, ids: Sequence[int], finish_reason: FinishReason | None) -> tuple[str, int, FinishReason | None]:
        """One step's ids and the engine's finish reason for them (None: more to come) -> the text
        to send, how many ids it covers, and the reason the output ends (None: it goes on). A stop
        string ends it with "stop" at the id that completes it (`stopped` is then True: the engine
        still runs the request, and the caller must drop it); an end from the engine releases the
        text held back. The one rule of stop strings, for the offline engine and the daemon."""
        text, taken = self.push_run(ids)
        if self.stopped:
            return text, taken, "stop"
        if finish_reason is not None:
            text += self.flush()
        return text, taken, finish_reason

    def push(self, ids: Sequence[int]) -> str:
        """Feed generated ids; return the text they complete ("" once stopped)."""
        if self.stopped:
            return ""
        data = b"".join(self._tokenizer.token_bytes(i) for i in ids if i not in self._skip_ids)
        return self._emit(self._pending + self._decoder.decode(data), final=False)

    def flush(self) -> str:
        """End of output: release held text; an unfinished UTF-8 tail becomes U+FFFD."""
        if self.stopped:
            return ""
        return self._emit(self._pending + self._decoder.decode(b"", final=True), final=True)

    def _emit(self, pending: str, *, final: bool) -> str:
        """`pending` is the held text and the new text after it: the automaton has read the held part,
        so only the new part is fed."""
        stops = self._stops
        if stops is None:
            self._pending = ""
            return self._record(pending)
        held = stops.depth[self._stop_state]
        state, end, stop = stops.feed(self._stop_state, pending[held:] if held else pending)
        if stop is not None:
            self.stopped, self.stop_reason, self._pending = True, stop, ""
            return self._record(pending[: held + end - len(stop)])
        self._stop_state = state
        num_held = 0 if final else stops.depth[state]
        self._pending = pending[len(pending) - num_held :]
        return self._record(pending[: len(pending) - num_held])

    def _record(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text

    def _carry_prompt_tail(self, prompt_ids: Sequence[int]) -> None:
        """Prime the decoder with the prompt's unfinished UTF-8 character, if any."""
        pieces: list[bytes] = []
        for token_id in reversed(list(prompt_ids)[-4:]):  # 4 tokens hold at least 3 bytes
            if token_id in self._tokenizer.special_ids:
                break  # special text ends any character before it
            pieces.append(self._tokenizer.token_bytes(token_id))
        tail = b"".join(reversed(pieces))[-3:]
        for start in range(len(tail) - 1, -1, -1):
            lead = tail[start]
            if lead < 0x80:
                return  # ASCII: the prompt ends on a whole character
            if lead >= 0xC0:  # the last lead byte: carry it over if its character is unfinished
                width = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
                if len(tail) - start < width:
                    self._decoder.decode(tail[start:])  # returns "": the bytes are incomplete
                return
