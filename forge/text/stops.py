"""Stop strings found in a stream of text in time linear in the text and the stop strings.

An Aho-Corasick automaton over a request's stop strings: its state after reading some text is the
longest suffix of that text that is a prefix of some stop string, so the text the detokenizer must
hold back is exactly that state's length, and a stop string ends at the first character whose state
has one among its suffixes. Building it costs time and memory linear in the stop strings' total
length; feeding text costs amortised O(1) a character. Pure; the automaton is immutable and shared by
every stream with the same stop strings.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import lru_cache


class StopAutomaton:
    """The automaton of one set of stop strings. States are ints; 0 is the empty prefix."""

    __slots__ = ("_goto", "_fail", "depth", "_match", "stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))  # "" would match everywhere
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        own: list[str | None] = [None]           # the stop string that is exactly this state, if any
        for stop in self.stops:
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    depth.append(depth[state] + 1)
                    own.append(None)
                state = nxt
            own[state] = stop
        # Failure links by breadth: the longest proper suffix of a state that is also a state. Each
        # state's match is the longest stop string that is a suffix of it (its own, else its failure's).
        fail = [0] * len(goto)
        match: list[str | None] = list(own)
        queue = deque(goto[0].values())
        while queue:
            state = queue.popleft()
            for ch, nxt in goto[state].items():
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[nxt] = goto[f].get(ch, 0)
                if match[nxt] is None:
                    match[nxt] = match[fail[nxt]]
                queue.append(nxt)
        self._goto, self._fail, self.depth, self._match = goto, fail, depth, match

    def feed(self, state: int, text: str) -> tuple[int, int, str | None]:
        """Read `text` from `state`: (the new state, the index in `text` just past the first stop string
        completed, that string), or (state, len(text), None) when none completes. Of several stop strings
        ending at the same character, the longest wins."""
        goto, fail, match = self._goto, self._fail, self._match
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if (stop := match[state]) is not None:
                return state, i + 1, stop
        return state, len(text), None


@lru_cache(maxsize=16)
def stop_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of `stops`, built once for every request that asks for the same ones."""
    return StopAutomaton(stops)
