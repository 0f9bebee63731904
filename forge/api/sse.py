"""Named server-sent events, as the Messages and Responses APIs write their streams: `event: <type>`, then
the payload as JSON on one `data:` line. (OpenAI's chat and completion chunks are unnamed `data:` frames:
forge/api/openai/openai_output.py's sse_frame.)
"""

from __future__ import annotations

from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event, named by the payload's own type."""
    name: str = event["type"]
    return b"event: " + name.encode() + b"\ndata: " + _encoder.encode(event) + b"\n\n"
