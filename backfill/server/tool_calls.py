"""Tool calls: tools into the prompt, a grammar that forces a call, and calls parsed out of the text.

The model writes each call as Hermes' tool-call block, the form chat templates that define tools
(Qwen 2.5, Hermes, SmolLM3) teach:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that renders `tools` gets them as it expects; one that does not (the default model's)
gets them described in the system message, in this same form. tool_choice "required" and a named
function are forced by a grammar (llguidance Lark with the functions' parameter schemas inside);
"auto" leaves the choice to the model and parses what it writes. ToolCallStream turns generated
text into OpenAI's deltas as it comes: content, then per call its name, then its arguments piece
by piece while they are generated.
"""

from __future__ import annotations

import json
import re
import uuid

from backfill.engine.grammar import JSON_OPTIONS
from backfill.server.schemas import ChatCompletionBody, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
_MAX_HEADER_CHARS = 256   # a block whose name has not shown by then is not a call: it is content
PARAMETERS_DEFAULT = {"type": "object"}


def template_defines_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return bool(template) and "tools" in template


def tool_schema(tool: Tool) -> dict:
    """The tool as chat templates receive it (OpenAI's shape, without None fields)."""
    function = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    function["parameters"] = tool.function.parameters or PARAMETERS_DEFAULT
    return {"type": "function", "function": function}


def tools_system_prompt(tools: list[Tool]) -> str:
    """How tools are described to a model whose chat template does not take them."""
    lines = ["To call a function, answer with:", OPEN, '{"name": <function name>, "arguments": <JSON object>}',
             CLOSE, "Functions:"]
    lines += [json.dumps(tool_schema(tool)["function"]) for tool in tools]
    return "\n".join(lines)


def call_text(name: str, arguments: str) -> str:
    """An earlier call, as the model would have written it (for generic prompts)."""
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CLOSE}'


def closed_schema(schema: object) -> object:
    """The schema with every object that lists its properties closed to them (additionalProperties
    false where it says nothing): a forced call then ends when its arguments are complete, instead
    of a small model adding (or repeating) keys until max_tokens. Its output still validates
    against the original schema, as OpenAI's strict function calling does."""
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_schema(value) if key in _SUBSCHEMA_KEYS else value for key, value in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            closed[key] = {name: closed_schema(sub) for name, sub in schema[key].items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "patternProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


# Not allOf or not: closing their parts would change what they accept.
_SUBSCHEMA_KEYS = ("items", "prefixItems", "anyOf", "oneOf", "additionalProperties")


def forced_grammar(body: ChatCompletionBody) -> str | None:
    """A Lark grammar for tool_choice required or a named function: exactly one call, whose block
    and the turn end as soon as its arguments are complete; required with parallel_tool_calls
    true allows more calls after it. None when the model chooses."""
    mode = body.tool_choice_mode()
    if mode not in ("required", "named"):
        return None
    tools = body.tools or []
    if mode == "named":
        tools = [t for t in tools if t.function.name == body.tool_choice.function.name]
    rules, alternatives = [], []
    for index, tool in enumerate(tools):
        schema = closed_schema(tool.function.parameters or PARAMETERS_DEFAULT)
        prefix = json.dumps('{"name": ' + json.dumps(tool.function.name) + ', "arguments": ')
        rules.append(f"fn{index}: {prefix} args{index} \"}}\"")
        rules.append(f"args{index}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}")
        alternatives.append(f"fn{index}")
    call = f'call: {json.dumps(OPEN + chr(10))} ({" | ".join(alternatives)}) {json.dumps(chr(10) + CLOSE)}'
    # More calls only when asked for: left to a small model, "another call?" is answered by
    # repeating the first one until max_tokens.
    many = mode == "required" and body.parallel_tool_calls is True
    start = 'start: call ("\\n" call)*' if many else "start: call"
    return "\n".join([start, call, *rules])


class ToolCallStream:
    """Generated text -> OpenAI delta dicts ({"content": ...} or {"tool_calls": [...]}), incrementally."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.calls: list[dict] = []    # {"id", "type", "function": {"name", "arguments"}} as parsed so far
        self._buf = ""
        self._state = "text"
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._started_args = False

    def push(self, text: str) -> list[dict]:
        self._buf += text
        out: list[dict] = []
        progressed = True
        while progressed:
            progressed = getattr(self, f"_{self._state}")(out)
        return _merge_deltas(out)

    def finish(self) -> list[dict]:
        """The rest at the end of generation: an unfinished block is content after all."""
        out: list[dict] = []
        if self._state == "text" and self._buf:
            out.append({"content": self._buf})
        elif self._state == "header":
            out.append({"content": OPEN + self._buf})
        self._buf = ""
        return out

    # --- states: each consumes what it can and says whether it moved on ---------------------------

    def _text(self, out: list[dict]) -> bool:
        at = self._buf.find(OPEN)
        if at >= 0:
            if at:
                out.append({"content": self._buf[:at]})
            self._buf = self._buf[at + len(OPEN):]
            self._state = "header"
            return True
        keep = _partial_suffix(self._buf, OPEN)
        if len(self._buf) > keep:
            out.append({"content": self._buf[:len(self._buf) - keep]})
            self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _header(self, out: list[dict]) -> bool:
        match = _HEADER.match(self._buf)
        stripped = self._buf.lstrip()
        if match is None or match.end() == len(self._buf):   # the name may be followed by more space
            if CLOSE in self._buf or len(self._buf) > _MAX_HEADER_CHARS or (stripped and stripped[0] != "{"):
                out.append({"content": OPEN})   # not a call after all
                self._state = "text"
                return True
            return False
        name = match.group(1)
        if name not in self.names:
            out.append({"content": OPEN})
            self._state = "text"
            return True
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        out.append({"tool_calls": [{"index": len(self.calls) - 1, **call,
                                    "function": {"name": name, "arguments": ""}}]})
        self._buf = self._buf[match.end():]
        self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
        self._started_args = False
        return True

    def _arguments(self, out: list[dict]) -> bool:
        """Stream the arguments' JSON text until its value closes (strings and nesting tracked)."""
        skipped = taken = 0
        done = False
        for char in self._buf:
            if not self._started_args and char.isspace():
                skipped += 1
                taken += 1
                continue
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                if self._depth == 0:   # a scalar's end: this brace closes the envelope, not the arguments
                    done = True
                    break
                self._depth -= 1
            self._started_args = True
            taken += 1
            if self._depth == 0 and not self._in_string and char in "}]":
                done = True
                break
        piece = self._buf[skipped:taken]
        if piece:
            self.calls[-1]["function"]["arguments"] += piece
            out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})
        self._buf = self._buf[taken:]
        if done:
            self._state = "closing"
            return True
        return False

    def _closing(self, out: list[dict]) -> bool:
        at = self._buf.find(CLOSE)
        if at < 0:
            return False
        self._buf = self._buf[at + len(CLOSE):].lstrip("\n")
        self._state = "text"
        return True


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that could begin tag."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _merge_deltas(deltas: list[dict]) -> list[dict]:
    """Adjacent content pieces as one delta (fewer chunks for the same text)."""
    merged: list[dict] = []
    for delta in deltas:
        if merged and "content" in delta and "content" in merged[-1]:
            merged[-1] = {"content": merged[-1]["content"] + delta["content"]}
        elif "content" not in delta or delta["content"]:
            merged.append(delta)
    return merged


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """A whole generation -> (content or None, tool calls), exactly what streaming it would give."""
    stream = ToolCallStream(names)
    parts = [d.get("content", "") for d in stream.push(text) + stream.finish()]
    content = "".join(parts)
    if stream.calls:
        content = content.strip() or None
    return content, stream.calls
