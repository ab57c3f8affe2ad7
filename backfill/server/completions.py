"""OpenAI chat / text completions on the engine: request -> GenerationRequest -> response body or chunks.

Shared by the online endpoints and the Batch API worker, so a batch line's output is byte for
byte what the same body would get from POST /v1/chat/completions (bar ids and timestamps).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncGenerator, AsyncIterator, Literal

from backfill.engine.sampling_params import SamplingParams
from backfill.errors import ContextLengthError
from backfill.server.errors import APIError, not_found
from backfill.server.metrics import ServerMetrics
from backfill.server.schemas import ChatCompletionBody, CompletionBody, validate_body
from backfill.serving.api import FinishReason, GenerationRequest, RequestClass, TokenEvent
from backfill.serving.async_engine import AsyncEngine

Kind = Literal["chat", "text"]
# Like vLLM, temperatures this small mean greedy: dividing logits by e.g. 1e-300 overflows to inf.
GREEDY_BELOW_TEMPERATURE = 1e-5
DEFAULT_TEXT_MAX_TOKENS = 16   # OpenAI's legacy completions default; chat defaults to the rest of the context


@dataclass
class Prepared:
    """A validated request, tokenized, with what its response needs to echo."""

    kind: Kind
    request: GenerationRequest
    model: str
    response_id: str
    created: int
    stream: bool
    include_usage: bool

    @property
    def service_tier(self) -> str:
        return "flex" if self.request.request_class is RequestClass.OFFLINE else "default"


@dataclass
class Outcome:
    text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int


class CompletionService:
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, served_model: str) -> None:
        self.engine = engine
        self.metrics = metrics
        self.served_model = served_model

    # --- request -> GenerationRequest ----------------------------------------------------------

    def prepare(self, kind: Kind, data: object, request_class: RequestClass | None = None,
                arrival_time: float | None = None) -> Prepared:
        """Validate a JSON body and tokenize it; request_class overrides service_tier (batch lines).
        arrival_time (monotonic) is when the request reached the server: TTFT counts from there."""
        body = self.validate(kind, data)
        if isinstance(body, ChatCompletionBody):
            prompt_ids = self._encode_chat(body)
            default_max = None
        else:
            prompt = body.single_prompt()
            prompt_ids = prompt if isinstance(prompt, list) else self._encode_text(prompt)
            default_max = DEFAULT_TEXT_MAX_TOKENS
        if request_class is None:
            request_class = RequestClass.OFFLINE if body.offline else RequestClass.ONLINE
        try:
            params = self._sampling(body, len(prompt_ids), default_max)
        except ContextLengthError as exc:
            raise context_error(kind, exc) from None
        request = GenerationRequest(prompt_ids, params, request_class,
                                    request_id=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
                                    arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                                    adapter=self.adapter_for(body.model))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Prepared(kind, request, request.adapter or self.served_model, request.request_id, int(time.time()),
                        bool(body.stream), include_usage)

    def validate(self, kind: Kind, data: object) -> ChatCompletionBody | CompletionBody:
        """The body's schema and the model name, without tokenizing (cheap; batch validation uses it)."""
        body = validate_body(ChatCompletionBody if kind == "chat" else CompletionBody, data)
        self.adapter_for(body.model)
        if isinstance(body, CompletionBody):
            body.single_prompt()
        return body

    def adapter_for(self, model: str | None) -> str | None:
        """The LoRA adapter a model name selects (None: the base model); 404 for a model not served."""
        if model is None or model == self.served_model:
            return None
        if model in self.engine.adapters:
            return model
        raise not_found(f"the model {model!r} does not exist; this server serves {self.served_model!r}"
                        + (" and its adapters" if self.engine.adapters.names() else ""),
                        param="model", code="model_not_found")

    def _encode_chat(self, body: ChatCompletionBody) -> list[int]:
        # The chat templates of small models know system/user/assistant; developer is OpenAI's
        # newer name for system.
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        return list(self.engine.tokenizer.encode_chat(messages))

    def _encode_text(self, text: str) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=True))

    def _sampling(self, body: ChatCompletionBody | CompletionBody, prompt_len: int,
                  default_max: int | None) -> SamplingParams:
        max_len = self.engine.scheduler.max_model_len
        if prompt_len >= max_len:
            raise ContextLengthError(f"this model's maximum context length is {max_len} tokens, "
                                     f"but the prompt has {prompt_len}")
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:
            max_tokens = min(default_max, max_len - prompt_len) if default_max else max_len - prompt_len
        temperature = 1.0 if body.temperature is None else float(body.temperature)
        if temperature < GREEDY_BELOW_TEMPERATURE:
            temperature = 0.0
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0 if body.top_p is None else float(body.top_p),
            top_k=body.top_k or 0,
            seed=body.seed,
            stop=body.stop_strings(),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=bool(body.ignore_eos),
            min_tokens=body.min_tokens or 0,
        )

    # --- running ---------------------------------------------------------------------------------

    def submit(self, prepared: Prepared) -> "Generation":
        """Queue on the engine (typed errors raise here, before any response starts)."""
        try:
            return Generation(self, prepared)
        except ContextLengthError as exc:
            raise context_error(prepared.kind, exc) from None

    async def run(self, prepared: Prepared) -> Outcome:
        """Submit and run to the end (the batch worker's path)."""
        generation = self.submit(prepared)
        try:
            return await collect(prepared, generation)
        finally:
            await generation.aclose()

    async def complete(self, prepared: Prepared, generation: "Generation") -> dict:
        """The non-streaming response body of a submitted request (APIError if the engine gave up)."""
        outcome = await collect(prepared, generation)
        check_outcome(outcome.finish_reason)
        return response_body(prepared, outcome)

    async def stream_sse(self, prepared: Prepared, events: "Generation") -> AsyncGenerator[bytes, None]:
        """Server-sent events: chunks, an optional usage chunk, then [DONE]."""
        num_prompt = len(prepared.request.prompt_token_ids)
        num_output = 0
        if prepared.kind == "chat":
            yield _sse(chunk_body(prepared, {"role": "assistant", "content": ""}, None))
        async for event in events:
            num_output = max(num_output, event.num_output_tokens)
            if event.finished:
                error = outcome_error(event.finish_reason)
                if error is not None:
                    yield _sse(error.body())
                    break
                yield _sse(chunk_body(prepared, event.text, event.finish_reason.value))
                if prepared.include_usage:
                    yield _sse(usage_chunk(prepared, num_prompt, num_output))
                break
            if event.text:
                yield _sse(chunk_body(prepared, event.text, None))
        yield b"data: [DONE]\n\n"


class Generation:
    """One request on the engine, observed for the metrics; aclose() always (it cancels if unfinished)."""

    def __init__(self, service: CompletionService, prepared: Prepared) -> None:
        self.request = prepared.request
        self._engine = service.engine
        self._metrics = service.metrics
        self._events = service.engine.submit(prepared.request)
        self._class = prepared.request.request_class.value
        self._metrics.in_flight.labels(self._class).inc()
        self._closed = False
        self.finish_reason: FinishReason | None = None
        self.num_output_tokens = 0
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenEvent]:
        async for event in self._events:
            if event.token_ids:
                if self.first_token_s is None:
                    self.first_token_s = event.time
                    self._metrics.observe_first_token(self._class, event.time - self.request.arrival_time)
                self.last_token_s = event.time
                self.num_output_tokens = max(self.num_output_tokens, event.num_output_tokens)
            if event.finished:
                self.finish_reason = event.finish_reason
            yield event

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._events.aclose()
        if self.finish_reason is None:
            # The stream may never have started (so its own cleanup never ran): cancel explicitly.
            self._engine.cancel(self.request.request_id)
        self._metrics.in_flight.labels(self._class).dec()
        self._metrics.observe_finish(self._class, self.finish_reason or FinishReason.CANCELLED,
                                     self.first_token_s, self.last_token_s, self.num_output_tokens)


async def collect(prepared: Prepared, generation: Generation) -> Outcome:
    parts = [event.text async for event in generation]
    return Outcome("".join(parts), generation.finish_reason, len(prepared.request.prompt_token_ids),
                   generation.num_output_tokens)


def context_error(kind: Kind, exc: ContextLengthError) -> APIError:
    return APIError(400, str(exc), param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")


def outcome_error(reason: FinishReason | None) -> APIError | None:
    """Why a finished request has no answer to give (None when it has one)."""
    if reason is FinishReason.ERROR:
        return APIError(500, "the engine failed while generating this response", code="engine_error",
                        type="server_error")
    if reason is FinishReason.CANCELLED or reason is None:
        return APIError(503, "the request was cancelled because the server is shutting down",
                        code="service_unavailable")
    return None


def check_outcome(reason: FinishReason | None) -> None:
    error = outcome_error(reason)
    if error is not None:
        raise error


def usage(num_prompt: int, num_output: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}


def response_body(prepared: Prepared, outcome: Outcome) -> dict:
    reason = outcome.finish_reason.value if outcome.finish_reason else None
    if prepared.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": outcome.text}, "logprobs": None,
                  "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": outcome.text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    return {"id": prepared.response_id, "object": obj, "created": prepared.created, "model": prepared.model,
            "choices": [choice], "usage": usage(outcome.num_prompt_tokens, outcome.num_output_tokens),
            "service_tier": prepared.service_tier, "system_fingerprint": None}


def chunk_body(prepared: Prepared, delta: str | dict, finish_reason: str | None) -> dict:
    if prepared.kind == "chat":
        if isinstance(delta, str):
            delta = {"content": delta} if delta else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    body = {"id": prepared.response_id, "object": obj, "created": prepared.created, "model": prepared.model,
            "choices": [choice], "service_tier": prepared.service_tier, "system_fingerprint": None}
    if prepared.include_usage:
        body["usage"] = None
    return body


def usage_chunk(prepared: Prepared, num_prompt: int, num_output: int) -> dict:
    obj = "chat.completion.chunk" if prepared.kind == "chat" else "text_completion"
    return {"id": prepared.response_id, "object": obj, "created": prepared.created, "model": prepared.model,
            "choices": [], "service_tier": prepared.service_tier, "system_fingerprint": None,
            "usage": usage(num_prompt, num_output)}


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"

