"""Structured output and tool calls on the default model through a real server and the openai
client: schema-valid JSON, and a forced tool call whose arguments parse and validate."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from backfill.server.app import create_app
from backfill.server.config import ServerConfig
from backfill.server.store import Store
from backfill.serving.build import build_engine
from backfill.serving.config import ServingConfig

from server_helpers import LiveServer

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 30},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    serving = ServingConfig(policy="fcfs", kv_cache_gb=0.25)
    db = tmp_path_factory.mktemp("structured-real") / "server.db"
    app = create_app(build_engine(serving), ServerConfig(serving=serving, db=str(db)), Store(db))
    with LiveServer(app) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_json_schema_outputs_validate(client):
    for name in ("a painter", "a sailor", "a judge"):
        out = client.chat.completions.create(
            model=None, messages=[{"role": "user", "content": f"Invent {name}: give a name and an age."}],
            max_tokens=60, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_named_tool_call_parses_and_streams(client):
    request = dict(model=None, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                   max_tokens=80, temperature=0, tools=[WEATHER],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out = client.chat.completions.create(**request)
    assert out.choices[0].finish_reason == "tool_calls"
    (call,) = out.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    pieces = [c.function.arguments for chunk in client.chat.completions.create(**request, stream=True)
              for c in chunk.choices[0].delta.tool_calls or () if c.function.arguments]
    assert len(pieces) > 3 and json.loads("".join(pieces)) == arguments   # greedy: the same call, streamed


PLAIN_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                  "parameters": {"type": "object", "properties": {
                                                      "city": {"type": "string"},
                                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                      "required": ["city", "unit"]}}}
CLOSED_WEATHER = {"type": "function", "function": {**PLAIN_WEATHER["function"], "parameters": {
    **PLAIN_WEATHER["function"]["parameters"], "additionalProperties": False}}}


@pytest.mark.parametrize("tool", [CLOSED_WEATHER, PLAIN_WEATHER], ids=["additional_properties_false", "plain"])
def test_required_tool_call_is_one_complete_call(client, tool):
    """Issue 46: tool_choice required gave two identical calls and "<tool_call>" as content (closed
    schema), or arguments cut off mid-string with a key repeated until max_tokens (plain schema)."""
    out = client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=80, temperature=0, tools=[tool], tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
