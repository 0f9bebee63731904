"""The Responses API's store: stored responses by id, bounded in count and in age, held in memory.

Each entry keeps the response body (what GET returns) and the conversation it ends (its input items
and output items after everything it continued), which previous_response_id continues. Conversations
share their items, so a long chain costs its items once and a tuple of references per response.
Pure: the caller passes the clock's reading; nothing here does I/O or knows about HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from forge.api.responses.responses_schema import Conversation

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict[str, Any]
    conversation: Conversation
    expires_at: float


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    num_stored: int
    max_responses: int
    ttl_s: float


class ResponseStore:
    """At most `max_responses` responses (the oldest go first), each for `ttl_s` seconds after it was
    stored. max_responses 0 stores nothing. Entries are in the order stored, which with one TTL is also
    the order they expire, so expiry only ever looks at the front."""

    def __init__(self, *, max_responses: int = DEFAULT_MAX_RESPONSES, ttl_s: float = DEFAULT_TTL_S) -> None:
        if max_responses < 0:
            raise ValueError("the responses store's size must not be negative")
        if ttl_s <= 0:
            raise ValueError("the responses store's TTL must be positive")
        self.max_responses, self.ttl_s = max_responses, ttl_s
        self._entries: dict[str, StoredResponse] = {}

    def put(self, response_id: str, body: dict[str, Any], conversation: Conversation, *, now: float) -> None:
        self._expire(now)
        if self.max_responses == 0:
            return
        while len(self._entries) >= self.max_responses:
            del self._entries[next(iter(self._entries))]
        self._entries[response_id] = StoredResponse(body, conversation, now + self.ttl_s)

    def get(self, response_id: str, *, now: float) -> StoredResponse | None:
        self._expire(now)
        return self._entries.get(response_id)

    def delete(self, response_id: str, *, now: float) -> bool:
        """Whether it was there."""
        self._expire(now)
        return self._entries.pop(response_id, None) is not None

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(len(self._entries), self.max_responses, self.ttl_s)

    def _expire(self, now: float) -> None:
        while self._entries:
            oldest = next(iter(self._entries))
            if self._entries[oldest].expires_at > now:
                return
            del self._entries[oldest]
