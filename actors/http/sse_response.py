"""A server-sent-event response that watches for its client in every phase.

The stream ends when its frames end, when the client goes away (noticed at once, not at the next
write), or when the server cancels it; `cleanup` runs exactly once in every case.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse


class SSEResponse(StreamingResponse):
    """An event stream that always watches for the client going away, in every phase, and runs
    `cleanup` exactly once however the stream ends (finished, disconnected, cancelled)."""

    def __init__(self, frames: AsyncIterator[bytes], cleanup: Callable[[], None], *,
                 media_type: str = "text/event-stream") -> None:
        """`media_type`: the stream's (Ollama's routes stream NDJSON the same way)."""
        super().__init__(frames, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, _scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass                      # the client is gone
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._cleanup()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
