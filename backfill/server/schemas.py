"""Request bodies of the OpenAI-compatible endpoints, validated strictly at the edge.

Strict mode: "5" is not an integer and true is not a number, as in OpenAI's API. Every field
of OpenAI's and vLLM's request bodies is honoured or, if backfill cannot honour it (prompt
logprobs, custom chat templates, legacy functions, ...), refused with a 400 that names it; a
field of neither API is refused too. Nothing a client sends is silently ignored.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backfill.server.errors import bad_request, validation_error

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1   # what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 16
MAX_N = 16                  # choices per request
MAX_LOGPROBS = 20           # OpenAI's top_logprobs limit (vLLM's default max_logprobs is 20 too)
# Every field of OpenAI's and vLLM's completion and chat request bodies is either honoured (a
# field of the body models below) or refused with a 400 naming it unless it holds one of the
# values that mean "not used" (below). Fields of neither API are refused too: a misspelt field
# never runs as if it were absent. docs/server.md's field table lists the same fields and is
# tested against this (tests/server/test_schemas.py).
REFUSED_FIELDS: dict[str, tuple[object, ...]] = {
    # OpenAI
    "functions": (None, []), "function_call": (None, "none"), "logit_bias": (None, {}),
    "echo": (None, False), "suffix": (None, ""), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "web_search_options": (None,), "reasoning_effort": (None,), "verbosity": (None,),
    "store": (None, False), "metadata": (None,),
    # vLLM
    "guided_whitespace_pattern": (None,), "structural_tag": (None,),
    "prompt_logprobs": (None,), "chat_template": (None,), "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False), "documents": (None,),
    "add_special_tokens": (None,), "mm_processor_kwargs": (None,), "media_io_kwargs": (None,),
    "prompt_embeds": (None,), "logits_processors": (None, []), "bad_words": (None, []),
    "allowed_token_ids": (None,), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "truncate_prompt_tokens": (None,), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "request_id": (None,),
    "return_token_ids": (None, False), "return_tokens_as_token_ids": (None, False), "cache_salt": (None,),
    "kv_transfer_params": (None,), "vllm_xargs": (None,), "lora_request": (None,),
}
# Why some fields are refused, where it helps the caller (else: "not supported by this server").
REFUSAL_HINTS = {
    "functions": "OpenAI's deprecated form of tools; send tools instead",
    "function_call": "OpenAI's deprecated form of tool_choice; send tool_choice instead",
    "request_id": "send it as the x-request-id header, which the access log records",
    "skip_special_tokens": "special tokens are always skipped",
    "echo": "the output never repeats the prompt",
}
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
GRAMMAR_BACKENDS = ("auto", "llguidance", "guidance")   # vLLM's guided_decoding_backend values served here


class StrictBody(BaseModel):
    """A request object, or an object inside one: an unknown key is a 400 naming its path
    (`messages[0].foo`, `stream_options.foo`), so that a misspelt option never runs as if absent."""

    model_config = ConfigDict(strict=True, extra="forbid")

    def check_supported(self) -> None:
        """Checks beyond the schema (values backfill cannot honour); APIError when one fails."""


class OpenBody(StrictBody):
    """Keeps unknown top-level fields (in model_extra) so that check_supported can take the "not
    used" values of the fields it refuses and refuse the others with a 400 naming each."""

    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class FunctionCall(StrictBody):
    name: str
    arguments: str


class ToolCall(StrictBody):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None     # an assistant turn that called tools
    tool_call_id: str | None = None              # a tool's answer to that call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(StrictBody):
    include_usage: bool = False


class JsonSchemaFormat(StrictBody):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictBody):
    """vLLM's newer spelling of the guided_* fields."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(StrictBody):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


class _GenerationBody(OpenBody):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)            # vLLM extension; 0 or -1 disables
    min_tokens: int | None = Field(None, ge=0)        # vLLM extension
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None           # vLLM extension
    ignore_eos: bool | None = None                    # vLLM extension
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)   # vLLM extension; 1 = off
    min_p: float | None = Field(None, ge=0.0, le=1.0)                # vLLM extension; 0 = off
    best_of: int | None = None                        # only 1 or n: every choice is returned
    include_stop_str_in_output: bool | None = None    # vLLM extension
    # Structured output: OpenAI's response_format, vLLM's guided_* fields (at most one of them).
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # OpenAI's name for the cheaper best-effort tier: "flex" runs as an offline request.
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    # vLLM's: larger is handled later; above 0 it runs as best-effort work, as "flex" does.
    priority: int | None = None
    # Identifiers OpenAI takes for abuse monitoring and cache routing; no effect on the output.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            unused = REFUSED_FIELDS.get(name)
            if unused is None:
                raise bad_request(f"{name} is not a field of this endpoint (OpenAI's and vLLM's fields are "
                                  f"listed in docs/server.md); remove it", param=name)
            if not any(value == u and type(value) is type(u) for u in unused):
                hint = REFUSAL_HINTS.get(name, "omit it")
                raise bad_request(f"{name} is not supported by this server ({hint})", param=name)
        if self.best_of not in (None, 1, self.n or 1):
            raise bad_request("best_of other than n is not supported (every choice is returned)", param="best_of")
        if self.guided_decoding_backend is not None and self.guided_decoding_backend not in GRAMMAR_BACKENDS:
            raise bad_request(f"guided_decoding_backend {self.guided_decoding_backend!r} is not available; this "
                              f"server decodes with llguidance ({', '.join(map(repr, GRAMMAR_BACKENDS))})",
                              param="guided_decoding_backend")
        if self.response_format is not None and self.response_format.type == "json_schema" \
                and self.response_format.json_schema is None:
            raise bad_request("response_format of type json_schema needs json_schema", param="response_format")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
        if any(not s for s in stops):
            raise bad_request("stop strings must be non-empty", param="stop")
        if any(t < 0 for t in self.stop_token_ids or ()):
            raise bad_request("stop_token_ids must be non-negative", param="stop_token_ids")

    @property
    def offline(self) -> bool:
        return self.service_tier == "flex" or (self.priority or 0) > 0

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionBody(_GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        names = [tool.function.name for tool in self.tools or ()]
        for name in names:
            if not FUNCTION_NAME.match(name):
                raise bad_request(f"tools: function name {name!r} must be 1 to 64 letters, digits, '_' or '-'",
                                  param="tools")
        if len(set(names)) != len(names):
            raise bad_request("tools: function names must be unique", param="tools")
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise bad_request("tool_choice needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                              f"in tools ({', '.join(names)})", param="tool_choice")
        for index, message in enumerate(self.messages):
            if message.role == "tool" and not message.tool_call_id:
                raise bad_request(f"messages[{index}]: a tool message needs tool_call_id", param="messages")
            if message.tool_calls and message.role != "assistant":
                raise bad_request(f"messages[{index}]: only assistant messages carry tool_calls", param="messages")

    def tool_choice_mode(self) -> str:
        """none, auto, required or named (OpenAI's default: auto with tools, none without)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def num_logprobs(self) -> int | None:
        """How many alternatives each token's logprobs list (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionBody(_GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request, as text or token ids."""
        prompt = self.prompt
        if prompt and not isinstance(prompt, str) and not isinstance(prompt[0], int):
            if len(prompt) > 1:
                raise bad_request("one prompt per request (send several requests, or use the Batch API)",
                                  param="prompt")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise bad_request("prompt must not be empty", param="prompt")
        return prompt


class BatchCreateBody(StrictBody):
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None

    def check_supported(self) -> None:
        if self.metadata is None:
            return
        if len(self.metadata) > 16:
            raise bad_request("metadata holds at most 16 pairs", param="metadata")
        for key, value in self.metadata.items():
            if len(key) > 64 or len(value) > 512:
                raise bad_request("metadata keys are at most 64 characters, values at most 512",
                                  param="metadata")


class BatchLine(StrictBody):
    """One line of a batch input file."""

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict


def parse_json(raw: bytes) -> object:
    """JSON text -> Python value; 400 for malformed JSON (NaN and Infinity are not JSON)."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):
        # JSON may spell a lone UTF-16 surrogate (\ud800); such a string is not Unicode text and
        # cannot be tokenized. Escaped pairs decode to one character and pass this check.
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("the body contains a lone UTF-16 surrogate escape; strings must be valid "
                              "Unicode") from None
    return data


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def validate_body(model: type[StrictBody], data: object) -> StrictBody:
    """A JSON object -> a validated request model, or a 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, got {type(data).__name__}")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None
    except RecursionError:
        raise bad_request("the body is nested too deeply") from None
    body.check_supported()
    return body

