"""A benchmark Target for any OpenAI-compatible server (backfill's own, vLLM, ...).

Streams POST /v1/completions with `stream_options: {include_usage: true}`. Tokens are counted
per SSE chunk as vLLM's bench does: a chunk with `logprobs.tokens` counts that many, any other
chunk with text counts one. The final usage block is authoritative: if it reports more
completion tokens than were counted (several tokens in one chunk, or a token whose text was
held back), the difference is credited to the last chunk, which is why chunks are yielded one
step late (their receive times are kept exactly).

Offline requests are marked the way the server under test understands best-effort work
(OFFLINE_MARKS): OpenAI's `service_tier: "flex"` (backfill), vLLM's `priority` field (larger is
later under `--scheduling-policy priority`), or both; a server ignores the field it does not know.

sample_stats() reads gauges from the server's Prometheus /metrics (queue lengths, KV-cache use);
a server without /metrics yields {}.

The client is bench/sse_client.py's: the load generator shares the machine with the server under
test, and parsing the stream in the protocol with httptools costs it less CPU a token than
aiohttp's line reader or a pure-Python client (docs/peers.md measures them).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from prometheus_client.parser import text_string_to_metric_families

from backfill.bench.sse_client import StreamClient
from backfill.bench.target import StreamChunk
from backfill.bench.workload import BenchRequest
from backfill.errors import TargetError, WorkloadError
from backfill.types import RequestClass

# How offline requests are marked: OpenAI's best-effort tier, vLLM's request priority, or both.
OFFLINE_MARKS = ("flex", "priority", "both")
# vLLM's priority scheduling serves lower values first; online requests keep its default 0.
OFFLINE_PRIORITY = 1

# Gauges worth plotting next to throughput; matched as substrings of the metric name.
STAT_PATTERNS = ("running", "waiting", "swapped", "queue", "cache_usage", "kv_", "preempt")


class HttpTarget:
    def __init__(self, base_url: str, model: str, api_key: str | None = None, *, max_connections: int = 1024,
                 timeout_s: float = 6 * 3600.0, prompt_as: str = "text", temperature: float = 0.0,
                 extra_body: dict | None = None, offline_mark: str = "both") -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise WorkloadError(f"base_url must be an http(s) URL, got {base_url!r}")
        if prompt_as not in ("text", "token_ids"):
            raise WorkloadError(f"prompt_as must be 'text' or 'token_ids', got {prompt_as!r}")
        if not isinstance(max_connections, int) or max_connections < 1:
            raise WorkloadError(f"max_connections must be a positive integer, got {max_connections!r}")
        if offline_mark not in OFFLINE_MARKS:
            raise WorkloadError(f"offline_mark must be one of {', '.join(OFFLINE_MARKS)}, got {offline_mark!r}")
        self.base_url = _root(base_url)
        self.model = model
        self.prompt_as = prompt_as
        self.temperature = temperature
        self.extra_body = dict(extra_body or {})
        self.offline_mark = offline_mark
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = StreamClient(self.base_url, headers, max_connections=max_connections, timeout_s=timeout_s)
        self._metrics_available = True

    def payload(self, request: BenchRequest) -> dict:
        body = {"model": self.model,
                "prompt": list(request.prompt_token_ids) if self.prompt_as == "token_ids" else request.prompt_text,
                "max_tokens": request.max_tokens, "temperature": self.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if request.ignore_eos:
            body["ignore_eos"] = True  # vLLM / backfill extension; fixes output length to max_tokens
        if request.request_class is RequestClass.OFFLINE:
            if self.offline_mark in ("flex", "both"):
                body["service_tier"] = "flex"  # OpenAI's name for best-effort work
            if self.offline_mark in ("priority", "both"):
                body["priority"] = OFFLINE_PRIORITY
        body.update(self.extra_body)
        return body

    async def generate(self, request: BenchRequest) -> AsyncIterator[StreamChunk]:
        pending: StreamChunk | None = None
        counted = 0
        usage: dict | None = None
        events = self._client.events("/v1/completions", json.dumps(self.payload(request)).encode())
        try:
            async for when, data in events:
                if data == b"[DONE]":
                    continue   # the response ends right after it; reading to its end keeps the connection
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    shown = data[:200].decode(errors="replace")
                    raise TargetError(f"malformed SSE data from {self.base_url}: {shown!r}") from None
                if "error" in obj:
                    raise TargetError(f"server error from {self.base_url}: {obj['error']}")
                if obj.get("usage"):
                    usage = obj["usage"]
                n = _tokens_in(obj)
                if n:
                    if pending is not None:
                        yield pending
                    pending = StreamChunk(when, n)
                    counted += n
        finally:
            await events.aclose()   # closes the HTTP response too when the caller stops early
        extra = 0
        prompt_tokens = None
        if usage is not None:
            extra = max(0, int(usage.get("completion_tokens") or 0) - counted)
            prompt_tokens = usage.get("prompt_tokens")
        if pending is not None:
            yield StreamChunk(pending.time_s, pending.num_tokens + extra, prompt_tokens)
        elif extra or prompt_tokens is not None:
            yield StreamChunk(time.monotonic(), extra, prompt_tokens)

    async def sample_stats(self) -> dict[str, float]:
        if not self._metrics_available:
            return {}
        try:
            status, body = await self._client.get("/metrics")
        except (TargetError, asyncio.TimeoutError):
            return {}
        if status != 200:
            self._metrics_available = False
            return {}
        return parse_gauges(body.decode("utf-8", errors="replace"))

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> "HttpTarget":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def _root(base_url: str) -> str:
    """The server's root URL, given with or without a trailing /v1."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model an OpenAI-compatible server lists at /v1/models."""
    import httpx

    root = _root(base_url)
    try:
        return httpx.get(f"{root}/v1/models", timeout=timeout_s).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise TargetError(f"no model listed at {root}/v1/models: {type(exc).__name__}: {exc}") from None


def parse_gauges(text: str) -> dict[str, float]:
    """Gauges of a Prometheus text page whose names match STAT_PATTERNS, summed over label sets."""
    out: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return {}
    for family in families:
        if family.type != "gauge" or not any(p in family.name for p in STAT_PATTERNS):
            continue
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def _tokens_in(obj: dict) -> int:
    choices = obj.get("choices") or []
    if not choices:
        return 0
    choice = choices[0]
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        return len(logprobs["tokens"])
    return 1 if choice.get("text") else 0
