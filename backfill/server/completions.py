"""OpenAI chat / text completions on the engine: request -> GenerationRequest -> response body or chunks.

Shared by the online endpoints and the Batch API worker, so a batch line's output is byte for
byte what the same body would get from POST /v1/chat/completions (bar ids and timestamps).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, Literal, Mapping, Sequence

from backfill.engine.grammar import GrammarCompiler, InvalidGrammarError
from backfill.sampling_params import SamplingParams, TokenLogprob
from backfill.errors import ContextLengthError
from backfill.server.errors import APIError, bad_request, not_found
from backfill.server.metrics import ServerMetrics
from backfill.server.schemas import ChatCompletionBody, CompletionBody, validate_body
from backfill.server.sse import DONE, ChunkTemplate, sse
from backfill.server.structured import check_grammar, check_tool_schemas, requested_grammar
from backfill.server.tool_calls import (ToolCallStream, call_text, forced_grammar, parse_tool_calls,
                                        template_defines_tools, tool_schema, tools_system_prompt)
from backfill.types import FinishReason, GenerationRequest, RequestClass, TokenEvent
from backfill.serving.async_engine import AsyncEngine
from backfill.serving.event_queue import EventQueue

if TYPE_CHECKING:
    from backfill.server.tracing import RequestTracer

Kind = Literal["chat", "text"]
# Like vLLM, temperatures this small mean greedy: dividing logits by e.g. 1e-300 overflows to inf.
GREEDY_BELOW_TEMPERATURE = 1e-5
DEFAULT_TEXT_MAX_TOKENS = 16   # OpenAI's legacy completions default; chat defaults to the rest of the context


@dataclass
class Prepared:
    """A validated request, tokenized, with what its response needs to echo. It runs as one
    engine request per choice (n), all with the same prompt."""

    kind: Kind
    requests: list[GenerationRequest]
    model: str
    response_id: str
    created: int
    stream: bool
    include_usage: bool
    tool_names: frozenset[str] = frozenset()   # the tools the model may call (parsed out of its text)

    @property
    def request(self) -> GenerationRequest:
        return self.requests[0]

    @property
    def service_tier(self) -> str:
        return "flex" if self.request.request_class is RequestClass.OFFLINE else "default"


@dataclass
class Choice:
    text: str
    finish_reason: FinishReason | None
    num_output_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Outcome:
    choices: list[Choice]
    num_prompt_tokens: int
    num_cached_tokens: int = 0   # of the prompt, found in the prefix cache

    @property
    def trace_id(self) -> str | None:
        """The request's trace id (32 hex digits) when its span is exported, else None."""
        if self._span is None:
            return None
        return format(self._span.get_span_context().trace_id, "032x")

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    @property
    def finish_reason(self) -> FinishReason | None:
        """The first reason that has no answer (error, cancel), else the first choice's."""
        for choice in self.choices:
            if outcome_error(choice.finish_reason) is not None:
                return choice.finish_reason
        return self.choices[0].finish_reason


class CompletionService:
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, served_model: str) -> None:
        self.engine = engine
        self.metrics = metrics
        self.served_model = served_model
        self._grammars: GrammarCompiler | None = None
        self.tracer: RequestTracer | None = None   # set by server/tracing.py when traces are exported

    @property
    def grammars(self) -> GrammarCompiler:
        """Grammars for the served model's tokenizer, built on first use (about a second)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler.for_tokenizer(self.engine.tokenizer,
                                                           self.engine.model_config.vocab_size)
        return self._grammars

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
        response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        arrived = time.monotonic() if arrival_time is None else arrival_time
        adapter = self.adapter_for(body.model)
        n = body.n or 1
        grammar = self._grammar(body)
        requests = [GenerationRequest(prompt_ids, params if n == 1 else choice_params(params, i), request_class,
                                      request_id=response_id if n == 1 else f"{response_id}-{i}",
                                      arrival_time=arrived, adapter=adapter,
                                      constraint=self._constraint(grammar))
                    for i in range(n)]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        tool_names = frozenset(t.function.name for t in body.tools or ()) \
            if isinstance(body, ChatCompletionBody) and body.tool_choice_mode() != "none" else frozenset()
        return Prepared(kind, requests, adapter or self.served_model, response_id, int(time.time()),
                        bool(body.stream), include_usage, tool_names)

    def _grammar(self, body: ChatCompletionBody | CompletionBody) -> tuple[str, str] | None:
        """(field, grammar) constraining this request's output, checked against the tokenizer; or None."""
        grammar = requested_grammar(body)
        tools_grammar = forced_grammar(body) if isinstance(body, ChatCompletionBody) else None
        if isinstance(body, ChatCompletionBody) and body.tool_choice_mode() != "none":
            check_tool_schemas(self.grammars, body, forced=tools_grammar is not None)
        if tools_grammar is not None:
            if grammar is not None:
                raise bad_request(f"{grammar[0]} cannot be combined with tool_choice {body.tool_choice_mode()!r} "
                                  "(both constrain the output)", param=grammar[0])
            grammar = ("tool_choice", tools_grammar)
        if grammar is None:
            return None
        if body.ignore_eos:
            raise bad_request("ignore_eos cannot be combined with structured output (the grammar ends the "
                              "output with EOS)", param="ignore_eos")
        check_grammar(self.grammars, *grammar)
        return grammar

    def _constraint(self, grammar: tuple[str, str] | None):
        if grammar is None:
            return None
        try:
            return self.grammars.constraint(grammar[1])
        except InvalidGrammarError as exc:
            raise bad_request(f"{grammar[0]}: {exc}", param=grammar[0]) from None

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
        tokenizer = self.engine.tokenizer
        native_tools = template_defines_tools(tokenizer)
        messages = []
        for m in body.messages:
            message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls and native_tools:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                    for c in m.tool_calls]
            elif m.tool_calls:
                message["content"] = "\n".join([message["content"], *(call_text(c.function.name, c.function.arguments)
                                                                       for c in m.tool_calls)]).strip()
            if m.role == "tool" and not native_tools:
                message["content"] = f"<tool_response>\n{message['content']}\n</tool_response>"
            if m.tool_call_id is not None and native_tools:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        tools = body.tools if body.tool_choice_mode() != "none" else None
        if tools and native_tools:
            return list(tokenizer.encode_chat(messages, tools=[tool_schema(t) for t in tools]))
        if tools:
            prompt = tools_system_prompt(tools)
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
            else:
                messages.insert(0, {"role": "system", "content": prompt})
        return list(tokenizer.encode_chat(messages))

    def _encode_text(self, text: str) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=True))

    def _sampling(self, body: ChatCompletionBody | CompletionBody, prompt_len: int,
                  default_max: int | None) -> SamplingParams:
        max_len = self.engine.max_model_len
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
            include_stop_str_in_output=bool(body.include_stop_str_in_output),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=bool(body.ignore_eos),
            min_tokens=body.min_tokens or 0,
            presence_penalty=float(body.presence_penalty or 0.0),
            frequency_penalty=float(body.frequency_penalty or 0.0),
            repetition_penalty=1.0 if body.repetition_penalty is None else float(body.repetition_penalty),
            min_p=float(body.min_p or 0.0),
            logprobs=body.num_logprobs(),
        )

    # --- running ---------------------------------------------------------------------------------

    def submit(self, prepared: Prepared, trace_attributes: Mapping[str, Any] | None = None,
               trace_carrier: Mapping[str, str] | None = None) -> "Generation":
        """Queue on the engine (typed errors raise here, before any response starts). When traces are
        exported, trace_attributes go on the request's span, and a `traceparent` among
        trace_carrier's headers makes it part of the caller's trace."""
        try:
            return Generation(self, prepared, trace_attributes, trace_carrier)
        except ContextLengthError as exc:
            raise context_error(prepared.kind, exc) from None

    async def run(self, prepared: Prepared, trace_attributes: Mapping[str, Any] | None = None) -> Outcome:
        """Submit and run to the end (the batch worker's path)."""
        generation = self.submit(prepared, trace_attributes)
        try:
            return await collect(prepared, generation)
        finally:
            await generation.aclose()

    async def complete(self, prepared: Prepared, generation: "Generation") -> dict:
        """The non-streaming response body of a submitted request (APIError if the engine gave up)."""
        outcome = await collect(prepared, generation)
        check_outcome(outcome.finish_reason)
        return response_body(prepared, outcome, self.token_text)

    async def stream_sse(self, prepared: Prepared, events: "Generation") -> AsyncGenerator[bytes, None]:
        """Server-sent events: chunks (each names its choice index), an optional usage chunk, [DONE].
        The events made at once by the stream's last engine event come as one item ending in DONE."""
        num_prompt = len(prepared.request.prompt_token_ids)
        num_choices = len(prepared.requests)
        chunk = ChunkTemplate(prepared).event
        if prepared.kind == "chat":
            for index in range(num_choices):
                yield chunk({"role": "assistant", "content": ""}, None, index)
        unfinished = num_choices
        tool_streams = [ToolCallStream(set(prepared.tool_names)) for _ in range(num_choices)] \
            if prepared.tool_names else None
        last: list[bytes] = []   # what the last engine event made, sent with DONE
        async for index, event in events:
            logprobs = self.logprobs_object(prepared.kind, event.logprobs) if event.logprobs else None
            if tool_streams is not None and not (event.finished and outcome_error(event.finish_reason)):
                # Tool calls: the text becomes content and tool-call deltas as it is generated.
                stream = tool_streams[index]
                deltas = stream.push(event.text) + (stream.finish() if event.finished else [])
                made = [chunk(delta, None, index) for delta in (deltas[:-1] if event.finished else deltas)]
                if event.finished:
                    reason = _finish_reason(event.finish_reason, bool(stream.calls))
                    made.append(chunk(deltas[-1] if deltas else "", reason, index, logprobs))
                    unfinished -= 1
                    if unfinished == 0:
                        if prepared.include_usage:
                            made.append(sse(usage_chunk(prepared, num_prompt, events.num_output_tokens,
                                                        events.num_cached_tokens)))
                        last = made
                        break
                elif logprobs:
                    made.append(chunk("", None, index, logprobs))
                for item in made:
                    yield item
                continue
            if event.finished:
                error = outcome_error(event.finish_reason)
                if error is not None:
                    last = [sse(error.body())]
                    break
                made = chunk(event.text, event.finish_reason.value, index, logprobs)
                unfinished -= 1
                if unfinished == 0:
                    last = [made, sse(usage_chunk(prepared, num_prompt, events.num_output_tokens,
                                                  events.num_cached_tokens))] \
                        if prepared.include_usage else [made]
                    break
                yield made
            elif event.text or logprobs:
                yield chunk(event.text, None, index, logprobs)
        yield b"".join((*last, DONE))

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs_object(self, kind: Kind, logprobs: Sequence[TokenLogprob]) -> dict:
        return logprobs_object(kind, logprobs, self.token_text)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice index's sampling: a seeded request's choices differ from each other, reproducibly."""
    if params.seed is None:
        return params
    return replace(params, seed=(params.seed + index) % 2**64 if params.seed >= 0 else params.seed - index)


class Generation:
    """The engine requests of one API request (one per choice), observed for the metrics and the
    access log; iterating yields (choice index, event); aclose() always (it cancels what is unfinished).

    Every choice's events arrive on one queue, which iterating reads directly: per token the
    event loop resumes one coroutine here, not a generator per choice plus a merging one (the
    loop's CPU per token runs on the cores the engine's step needs)."""

    def __init__(self, service: CompletionService, prepared: Prepared,
                 trace_attributes: Mapping[str, Any] | None = None,
                 trace_carrier: Mapping[str, str] | None = None) -> None:
        self.requests = prepared.requests
        self.request = prepared.request
        self._engine = service.engine
        self._metrics = service.metrics
        self._queue: EventQueue[TokenEvent] = EventQueue()
        self._index = {request.request_id: index for index, request in enumerate(self.requests)}
        self._closed = False
        self._unfinished = len(self.requests)
        self.finish_reasons: list[FinishReason | None] = [None] * len(self.requests)
        self.output_tokens: list[int] = [0] * len(self.requests)
        self.num_cached_tokens = 0   # prompt tokens the prefix cache supplied (the most of any choice)
        self.scheduled_s: float | None = None   # when a step first ran it
        self.first_token_s: float | None = None
        self.last_token_s: list[float | None] = [None] * len(self.requests)
        self.first_of: list[float | None] = [None] * len(self.requests)
        # Begun before the engine sees the requests: a preemption may reach the span at once.
        self._tracer = service.tracer
        self._span = self._tracer.begin(self, trace_attributes, trace_carrier) if self._tracer is not None else None
        opened = 0
        try:
            for request in self.requests:
                service.engine.open(request, self._queue)
                opened += 1
        except BaseException as exc:
            for request in self.requests[:opened]:
                service.engine.close(request.request_id, finished=False)
            if self._span is not None:
                self._tracer.end(self._span, self, refused=exc)
            raise
        self._class = prepared.request.request_class.value
        self._metrics.in_flight.labels(self._metrics.model_name, self._class).inc()

    @property
    def trace_id(self) -> str | None:
        """The request's trace id (32 hex digits) when its span is exported, else None."""
        if self._span is None:
            return None
        return format(self._span.get_span_context().trace_id, "032x")

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_tokens)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.finish_reasons[0]

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> tuple[int, TokenEvent]:
        if self._unfinished == 0 or self._closed:
            raise StopAsyncIteration
        event = await self._queue.get()
        index = self._index[event.request_id]
        while self.finish_reasons[index] is not None:   # end_now's end of a choice that had just finished
            event = await self._queue.get()
            index = self._index[event.request_id]
        if event.token_ids:
            if self.first_token_s is None:
                self.first_token_s = event.time
                self._metrics.observe_first_token(self._class, event.time - self.request.arrival_time,
                                                  len(self.request.prompt_token_ids))
            if self.first_of[index] is None:
                self.first_of[index] = event.time
            if event.scheduled_s is not None:
                if self.scheduled_s is None:
                    self.scheduled_s = event.scheduled_s
                self._metrics.observe_queued(self._class, event.scheduled_s - self.request.arrival_time)
            previous = self.last_token_s[index]
            if previous is not None:
                self._metrics.observe_token_gap(event.time - previous)
            self.last_token_s[index] = event.time
            self.output_tokens[index] = max(self.output_tokens[index], event.num_output_tokens)
        if event.finished:
            self.finish_reasons[index] = event.finish_reason
            self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
            self._unfinished -= 1
        return index, event

    def end_now(self) -> None:
        """End every unfinished choice now as cancelled (the drain deadline): the engine drops it and
        the reader gets its finished event, so a stream ends with an error chunk and [DONE] and a
        non-streamed request answers 503 (outcome_error), instead of a cut connection."""
        if self._closed:
            return
        for request in self.requests:
            if self.finish_reasons[self._index[request.request_id]] is None:
                self._engine.close(request.request_id, finished=False)
                self._queue.put_nowait(TokenEvent(request.request_id, (), "", finished=True,
                                                  finish_reason=FinishReason.CANCELLED))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for index, request in enumerate(self.requests):
            # Unfinished (the stream may never have started): cancelled, its blocks freed.
            self._engine.close(request.request_id, finished=self.finish_reasons[index] is not None)
            self._metrics.observe_finish(self._class, self.finish_reasons[index] or FinishReason.CANCELLED,
                                         self.first_of[index], self.last_token_s[index], self.output_tokens[index])
        self._metrics.in_flight.labels(self._metrics.model_name, self._class).dec()
        self._metrics.observe_request(self._class, len(self.request.prompt_token_ids),
                                      self.request.sampling.max_tokens, self.request.arrival_time, self.scheduled_s,
                                      self.first_token_s, max((t for t in self.last_token_s if t is not None),
                                                              default=None), time.monotonic())
        if self._span is not None:
            self._tracer.end(self._span, self)


async def collect(prepared: Prepared, generation: Generation) -> Outcome:
    choices = [Choice("", None, 0) for _ in prepared.requests]
    parts: list[list[str]] = [[] for _ in prepared.requests]
    async for index, event in generation:
        parts[index].append(event.text)
        choices[index].logprobs.extend(event.logprobs)
    for index, choice in enumerate(choices):
        choice.text = "".join(parts[index])
        choice.finish_reason = generation.finish_reasons[index]
        choice.num_output_tokens = generation.output_tokens[index]
    return Outcome(choices, len(prepared.request.prompt_token_ids), generation.num_cached_tokens)


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


def usage(num_prompt: int, num_output: int, num_cached: int = 0) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: prompt tokens the prefix cache supplied."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


def response_body(prepared: Prepared, outcome: Outcome,
                  token_text: Callable[[int], str] | None = None) -> dict:
    choices = []
    for index, choice in enumerate(outcome.choices):
        reason = choice.finish_reason.value if choice.finish_reason else None
        logprobs = None
        if prepared.request.sampling.logprobs is not None and token_text is not None:
            logprobs = logprobs_object(prepared.kind, choice.logprobs, token_text)
        if prepared.kind == "chat":
            message = {"role": "assistant", "content": choice.text}
            if prepared.tool_names:
                content, calls = parse_tool_calls(choice.text, set(prepared.tool_names))
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = _finish_reason(choice.finish_reason, True)
            choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
        else:
            choices.append({"index": index, "text": choice.text, "logprobs": logprobs, "finish_reason": reason})
    return {"id": prepared.response_id, "object": "chat.completion" if prepared.kind == "chat" else "text_completion",
            "created": prepared.created, "model": prepared.model, "choices": choices,
            "usage": usage(outcome.num_prompt_tokens, outcome.num_output_tokens, outcome.num_cached_tokens),
            "service_tier": prepared.service_tier, "system_fingerprint": None}


def _finish_reason(reason: FinishReason | None, called_tools: bool) -> str | None:
    """OpenAI's "tool_calls" when the model ended its turn on tool calls (a cut-off stays "length")."""
    if called_tools and reason is FinishReason.STOP:
        return "tool_calls"
    return reason.value if reason is not None else None


def _arguments_object(arguments: str) -> object:
    """An earlier call's arguments as chat templates expect them: a JSON value, else the raw text."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def logprobs_object(kind: Kind, logprobs: Sequence[TokenLogprob], text: Callable[[int], str]) -> dict:
    """OpenAI's logprobs of a choice (or of a chunk's tokens), in the endpoint's shape."""
    if kind == "chat":
        def entry(token_id: int, logprob: float) -> dict:
            token = text(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs],
                "refusal": None}
    tokens = [text(lp.token_id) for lp in logprobs]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{text(t): v for t, v in lp.top} for lp in logprobs], "text_offset": offsets}


def chunk_body(prepared: Prepared, delta: str | dict, finish_reason: str | None, index: int = 0,
               logprobs: dict | None = None) -> dict:
    """A streamed chunk's object (the SSE path serialises the same bytes from a template: sse.ChunkTemplate)."""
    if prepared.kind == "chat":
        if isinstance(delta, str):
            delta = {"content": delta} if delta else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    body = {"id": prepared.response_id, "object": obj, "created": prepared.created, "model": prepared.model,
            "choices": [choice], "service_tier": prepared.service_tier, "system_fingerprint": None}
    if prepared.include_usage:
        body["usage"] = None
    return body


def usage_chunk(prepared: Prepared, num_prompt: int, num_output: int, num_cached: int = 0) -> dict:
    obj = "chat.completion.chunk" if prepared.kind == "chat" else "text_completion"
    return {"id": prepared.response_id, "object": obj, "created": prepared.created, "model": prepared.model,
            "choices": [], "service_tier": prepared.service_tier, "system_fingerprint": None,
            "usage": usage(num_prompt, num_output, num_cached)}
