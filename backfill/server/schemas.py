"""Request bodies of the OpenAI-compatible endpoints, validated strictly at the edge.

Strict mode: "5" is not an integer and true is not a number, as in OpenAI's API. Unknown
fields are ignored (as vLLM does) so clients that send newer OpenAI fields keep working; fields
backfill cannot honour (n > 1, logprobs, penalties, tools, ...) are refused with a 400 that
names them rather than silently ignored.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backfill.server.errors import bad_request, validation_error

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1   # what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 16
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    def check_supported(self) -> None:
        """Checks beyond the schema (values backfill cannot honour); APIError when one fails."""


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: Literal["text"]


class _GenerationBody(_Strict):
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
    n: int | None = Field(None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # OpenAI's name for the cheaper best-effort tier: "flex" runs as an offline request.
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise bad_request("only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported (send 0 or omit it)", param=name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
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
        return self.service_tier == "flex"

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
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise bad_request("logprobs are not supported", param="logprobs")
        if self.tools:
            raise bad_request("tools are not supported", param="tools")
        if self.tool_choice not in (None, "none"):
            raise bad_request("tool_choice is not supported", param="tool_choice")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionBody(_GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise bad_request("logprobs are not supported", param="logprobs")
        if self.echo:
            raise bad_request("echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise bad_request("only best_of=1 is supported", param="best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request, as text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return prompt
        if len(prompt) > 1:
            raise bad_request("one prompt per request (send several requests, or use the Batch API)",
                              param="prompt")
        return prompt[0]


class BatchCreateBody(_Strict):
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


class BatchLine(_Strict):
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


def validate_body(model: type[_Strict], data: object) -> _Strict:
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

