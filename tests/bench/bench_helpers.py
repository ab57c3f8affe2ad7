"""Real peers for the harness tests: tokenizers trained/built here and a small OpenAI-compatible SSE server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from backfill.bench.metrics import PreemptionEvent, RequestRecord, compute_metrics
from backfill.bench.prompts import bundled_corpus
from backfill.bench.report import ModeResult
from backfill.types import SLO, RequestClass


class BPETokenizer:
    """A byte-level BPE trained on the bundled corpus, with the encode/decode surface the harness uses."""

    def __init__(self, vocab_size: int = 400) -> None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(bundled_corpus().splitlines(), trainer)
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


class WhitespaceTokenizer:
    """One token per whitespace-separated word, vocabulary grown as words are seen."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeOpenAIServer:
    """A small OpenAI-compatible completions server streaming one word per `pace_s` seconds.

    Prompts starting with "FAIL" get HTTP 400; max_tokens is honoured (ignore_eos), the final
    chunk carries usage. `chunk_tokens` tokens go out per SSE chunk (to test usage reconciliation).
    /metrics serves Prometheus text with the live count of running streams.
    """

    def __init__(self, pace_s: float = 0.01, chunk_tokens: int = 1) -> None:
        self.pace_s = pace_s
        self.chunk_tokens = chunk_tokens
        self.running = 0
        self.max_running = 0
        self.bodies: list[dict] = []
        self.disconnects = 0
        self.metrics_reads = 0
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.bodies.append(body)
            prompt = body["prompt"]
            if isinstance(prompt, str) and prompt.startswith("FAIL"):
                return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)
            n = int(body["max_tokens"])
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            return StreamingResponse(self._stream(n, prompt_tokens), media_type="text/event-stream")

        @app.get("/metrics")
        async def metrics():
            self.metrics_reads += 1
            return PlainTextResponse("# HELP fake:num_requests_running Streams in flight.\n"
                                     "# TYPE fake:num_requests_running gauge\n"
                                     f'fake:num_requests_running{{model_name="m"}} {self.running}\n'
                                     "# HELP fake:requests_total Requests.\n# TYPE fake:requests_total counter\n"
                                     f"fake:requests_total {len(self.bodies)}\n")

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def _stream(self, n: int, prompt_tokens: int):
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        sent = 0
        try:
            while sent < n:
                await asyncio.sleep(self.pace_s)
                k = min(self.chunk_tokens, n - sent)
                sent += k
                chunk = {"id": "cmpl-1", "object": "text_completion", "model": "m",
                         "choices": [{"index": 0, "text": " w" * k, "logprobs": None,
                                      "finish_reason": "length" if sent == n else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            yield f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnects += 1
            raise
        finally:
            self.running -= 1

    def __enter__(self) -> "FakeOpenAIServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def mode_result(ttft_s: float, offline_tokens: int, preempt_ms: list[float]) -> ModeResult:
    """Ten online requests with this TTFT (and 50 ms between tokens), one offline request of
    offline_tokens over 4 s, and these preemption latencies, as one mode's result."""
    recs = []
    for i in range(10):
        send = i * 0.5
        times = [send + ttft_s + 0.05 * k for k in range(5)]
        recs.append(RequestRecord(f"on{i}", RequestClass.ONLINE, scheduled_s=send, send_s=send,
                                  first_token_s=times[0], chunk_times_s=times, chunk_tokens=[1] * 5,
                                  end_s=times[-1], prompt_tokens=8, output_tokens=5))
    if offline_tokens:
        times = [0.1 + 4.0 * k / offline_tokens for k in range(offline_tokens)]
        recs.append(RequestRecord("off0", RequestClass.OFFLINE, send_s=0.0, first_token_s=times[0],
                                  chunk_times_s=times, chunk_tokens=[1] * offline_tokens, end_s=times[-1],
                                  output_tokens=offline_tokens))
    events = [PreemptionEvent(1.0 + i, ms) for i, ms in enumerate(preempt_ms)]
    m = compute_metrics(recs, slo=SLO(200, 100), preemption_events=events,
                        engine_samples=[(0.5, {"num_running": 2.0}), (2.5, {"num_running": 3.0})])
    return ModeResult(m, recs, {"policy": "x"})
