"""The server-sent events of one streamed completion, from a template serialised once per request.

A stream sends one chunk per token. Serialising the whole chunk dict per token (json.dumps with
ensure_ascii=False builds a new encoder on every call, many times the cost of filling in the
template) is event-loop work, and the event loop shares the GIL and the
CPU with the engine's step. Of a chunk only the choice index, the delta text, the logprobs and
the finish reason change: the rest (id, object, created, model, service tier, usage) is
serialised once, and per token only the delta text is JSON-escaped with the C escaper
json.dumps itself uses. The bytes equal
`data: json.dumps(chunk_body(...), ensure_ascii=False)` exactly.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring   # json.dumps(..., ensure_ascii=False)'s string escaper
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backfill.server.completions import Prepared

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    """One event of any JSON payload (the usage chunk, an error mid-stream)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class ChunkTemplate:
    """Chunk events of one response: ChunkTemplate(prepared).event(delta, finish_reason, index, logprobs)."""

    def __init__(self, prepared: Prepared) -> None:
        self.chat = prepared.kind == "chat"
        head = {"id": prepared.response_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": prepared.created, "model": prepared.model}
        tail = {"service_tier": prepared.service_tier, "system_fingerprint": None}
        if prepared.include_usage:
            tail["usage"] = None
        # '{"id": ..., "model": "m"' + ', "choices": [{"index": ' ... '}], ' + '"service_tier": ...}'
        self._head = "data: " + json.dumps(head, ensure_ascii=False)[:-1] + ', "choices": [{"index": '
        self._tail = "}], " + json.dumps(tail, ensure_ascii=False)[1:] + "\n\n"
        self._text_key = ', "delta": ' if self.chat else ', "text": '

    def event(self, delta: str | dict, finish_reason: str | None, index: int = 0,
              logprobs: dict | None = None) -> bytes:
        """The event of chunk_body(prepared, delta, finish_reason, index, logprobs), serialised."""
        if not self.chat:
            value = encode_basestring(delta)
        elif isinstance(delta, dict):
            value = json.dumps(delta, ensure_ascii=False)
        else:
            value = '{"content": ' + encode_basestring(delta) + "}" if delta else "{}"
        return "".join((self._head, str(index), self._text_key, value,
                        ', "logprobs": ', "null" if logprobs is None else json.dumps(logprobs, ensure_ascii=False),
                        ', "finish_reason": ', "null" if finish_reason is None else encode_basestring(finish_reason),
                        self._tail)).encode()
