"""The one loop every generation stream runs, whatever its wire format (completions, chat, Messages, Responses).

A stream reads its response's deltas as they come (ChoiceReader.deltas) and writes: the format's opening
frames; a ping whenever nothing comes for a while (a long prefill); for a choice the engine failed, the
format's error frames, after which the stream ends (a one-choice format) or goes on with the other choices;
each delta's frames; then the closing frames. A format gives only its frames, as a StreamFrames; the
lifetime (actors/http/lifetime.py) writes them as an event stream and ends the response with them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator

from actors.http.choice_reader import Choice, ChoiceReader
from forge.api.openai.openai_output import SSE_PING
from forge.errors import RequestError
from forge.messages import TextDelta


class StreamFrames(ABC):
    """One response's stream in one wire format: its frames for each part of the loop, and the state they
    keep between deltas (tool-call readers, open blocks, event numbers). Each method is a generator: its
    frames are made as they are written, so what one does (a response stored) happens in the order sent."""

    ping: bytes = SSE_PING              # what a silence sends (OpenAI's comment; the Messages API names one)
    failure_ends_stream: bool = False   # a failed choice ends the stream, not only its own part of it

    def __init__(self, reader: ChoiceReader) -> None:
        self.reader = reader

    def opening(self) -> Iterator[bytes]:
        """Frames before the first delta."""
        yield from ()

    @abstractmethod
    def delta(self, index: int, delta: TextDelta, choice: Choice) -> Iterator[bytes]:
        """Frames for one delta of choice `index` (`choice`: what the reader has read of it, this delta
        included)."""

    @abstractmethod
    def failed(self, error: RequestError) -> Iterator[bytes]:
        """Frames for a choice the engine failed (`error`: the response's failure, ChoiceReader.failure)."""

    def closing(self) -> Iterator[bytes]:
        """Frames after every choice has ended."""
        yield from ()

    async def stream(self) -> AsyncIterator[bytes]:
        """The loop: opening, each delta's frames (a ping while none comes, the error frames for a failed
        choice), closing."""
        reader = self.reader
        for frame in self.opening():
            yield frame
        async for item in reader.deltas():
            if item is None:
                yield self.ping
                continue
            index, delta, choice = item
            if delta.error is not None:
                failure = reader.failure()
                assert failure is not None
                for frame in self.failed(failure):
                    yield frame
                if self.failure_ends_stream:
                    return
                continue
            for frame in self.delta(index, delta, choice):
                yield frame
        for frame in self.closing():
            yield frame
