"""Tool-call text -> OpenAI's tool_calls, whole and streamed piece by piece (no model needed)."""

from __future__ import annotations

import json

import pytest

from backfill.server.schemas import ChatCompletionBody, validate_body
from backfill.server.tool_calls import ToolCallStream, closed_schema, forced_grammar, parse_tool_calls

NAMES = {"get_weather", "get_time"}
TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", '
             '"days": [1, {"x": "\\"q\\""}]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_parse_two_calls_with_content():
    content, calls = parse_tool_calls(TWO_CALLS, NAMES)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Pa}ris", "days": [1, {"x": '"q"'}]}
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


@pytest.mark.parametrize("text", ["no tools here", "a <tool_call> not json </tool_call>",
                                  '<tool_call>\n{"name": "unknown_fn", "arguments": {}}\n</tool_call>', "ends with <tool"])
def test_text_that_is_not_a_call_stays_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streaming_gives_the_same_calls_piece_by_piece(piece):
    stream = ToolCallStream(NAMES)
    deltas = []
    for start in range(0, len(TWO_CALLS), piece):
        deltas += stream.push(TWO_CALLS[start:start + piece])
    deltas += stream.finish()
    _, whole = parse_tool_calls(TWO_CALLS, NAMES)
    content = "".join(d.get("content", "") for d in deltas)
    assert content.strip() == "Let me check."
    heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [h["function"]["name"] for h in heads] == ["get_weather", "get_time"]
    for index, call in enumerate(whole):
        pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas
                  if "tool_calls" in d and d["tool_calls"][0]["index"] == index]
        assert "".join(pieces) == call["function"]["arguments"]
        # Arguments arrive as they are generated, not in one piece at the end.
        assert len(pieces) > 2 or call["function"]["arguments"] == "{}"


def body(**fields) -> ChatCompletionBody:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "get_time"}}]
    return validate_body(ChatCompletionBody, {"messages": [{"role": "user", "content": "hi"}], "tools": tools, **fields})


def test_forced_grammar_only_for_required_and_named():
    assert forced_grammar(body()) is None
    assert forced_grammar(body(tool_choice="auto")) is None
    assert forced_grammar(body(tool_choice="none")) is None
    required = forced_grammar(body(tool_choice="required"))
    assert "get_weather" in required and "get_time" in required
    named = forced_grammar(body(tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert "get_time" in named and "get_weather" not in named
    # One call ends the turn unless parallel_tool_calls asks for more.
    assert required.startswith("start: call\n")
    assert forced_grammar(body(tool_choice="required", parallel_tool_calls=False)).startswith("start: call\n")
    assert 'start: call ("\\n" call)*' in forced_grammar(body(tool_choice="required", parallel_tool_calls=True))


def test_forced_call_arguments_are_closed_to_the_listed_properties():
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {
        "type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer"}}}}},
              "required": ["city"]}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["days"]["items"]["additionalProperties"] is False
    assert schema.get("additionalProperties") is None   # the caller's schema is left alone
    open_on_purpose = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}}
    assert closed_schema(open_on_purpose)["additionalProperties"] == {"type": "string"}
    assert closed_schema({"type": "object"}) == {"type": "object"}   # nothing listed: nothing to close to
