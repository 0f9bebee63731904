"""A response's choices fed to the engine a window at a time.

A response of many choices (prompts x n, embedding inputs) never puts them all in the waiting queue:
at most `window` of them are in the engine at once (sent and not ended), and each that ends lets the
next one in, in index order, so other requests interleave with it and admission sees it as the one
unit it was charged for (actors/http/admission.py). Its reader tops the window up as deltas come
(ChoiceReader); `abort` drops what is in the engine and sends nothing more. It owns no state the
demultiplexer or the actors keep (the lifetime opens and closes the group): a choice never sent costs nothing
to forget.
"""

from __future__ import annotations

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from actors.runtime.stream_demux import ResponseGroup
from forge.messages import Abort, FlushCache, Submit


class ChoiceFeed:
    def __init__(self, group: ResponseGroup, submits: list[Submit],
                 to_tokenizer: MemoryObjectSendStream[Submit | Abort | FlushCache], *, window: int) -> None:
        """`submits`: one per choice, in the group's order; `window`: most choices in the engine at once."""
        assert len(submits) == len(group.request_ids) and window >= 1
        self.group = group
        self._submits = submits
        self._to_tokenizer = to_tokenizer
        self._window = window
        self._num_sent = 0
        self._in_engine: set[int] = set()          # sent and not ended
        self._aborted = False

    @property
    def num_sent(self) -> int:
        return self._num_sent

    def top_up(self) -> None:
        """Send choices in order until the window is full (none after a refusal or an abort). A daemon
        that stopped meanwhile ends the response as its drain would (ResponseGroup.fail)."""
        group = self.group
        self._in_engine &= group.unfinished
        if self._aborted or group.rejected is not None:
            return
        while len(self._in_engine) < self._window and self._num_sent < len(self._submits):
            i = self._num_sent
            self._num_sent += 1
            if i not in group.unfinished:            # ended unsent (the daemon stopped)
                continue
            try:
                self._to_tokenizer.send_nowait(self._submits[i])
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                group.fail()
                return
            self._in_engine.add(i)

    def abort(self) -> None:
        """Send nothing more; the choices in the engine are dropped behind their Submits."""
        self._aborted = True
        for i in sorted(self._in_engine & self.group.unfinished):
            try:
                self._to_tokenizer.send_nowait(Abort(request_id=self.group.request_ids[i]))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return                        # the daemon stopped (drain timed out): nothing to free
        self._in_engine.clear()
