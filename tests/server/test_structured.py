"""Structured output and tool calls through the official openai client and raw HTTP (tiny model):
outputs stay inside the schema / regex / grammar, tool calls come back parsed (streamed as deltas),
and what cannot be compiled or does not fit together is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from server_helpers import assert_error, chat_line, live_server, openai_client, upload, wait_final

MESSAGES = [{"role": "user", "content": "Pick a color."}]
# Bounded (enums, booleans): a random-weight model finishes it well within max_tokens.
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                                                "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("structured"), max_model_len=2048) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_json_schema_through_openai_validates(client):
    out = client.chat.completions.create(
        model=None, messages=MESSAGES, max_tokens=120, n=2, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}})
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@pytest.mark.parametrize("field, value, check", [
    ("guided_json", SCHEMA, lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
    ("guided_regex", r"[0-9]{2}-[a-c]{3}", lambda text: __import__("re").fullmatch(r"[0-9]{2}-[a-c]{3}", text)),
    ("guided_choice", ["alpha", "beta"], lambda text: text in ("alpha", "beta")),
    ("guided_grammar", 'start: "go" ("!" | "?")', lambda text: text in ("go!", "go?")),
    ("guided_grammar", 'root ::= "yes" | "no"', lambda text: text in ("yes", "no")),
    ("structured_outputs", {"choice": ["up", "down"]}, lambda text: text in ("up", "down")),
])
def test_vllm_guided_fields_over_raw_http(http, field, value, check):
    for endpoint, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})):
        response = http.post(endpoint, json={**body, "max_tokens": 120, field: value})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert choice["finish_reason"] == "stop" and check(text) is not False, text


def test_json_object_streamed_concatenates_to_json(client):
    stream = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=200, stream=True,
                                            response_format={"type": "json_object"}, seed=1,
                                            extra_body={"guided_json": None})
    text, reason = "", None
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
    if reason == "stop":   # a random model may write a long object; what it wrote must still be JSON so far
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


def test_batch_line_with_guided_json(client):
    batch_file = upload(client, [chat_line("a", max_tokens=120, guided_json=SCHEMA),
                                 chat_line("b", max_tokens=120, guided_regex="[a-")])
    batch = client.batches.create(input_file_id=batch_file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = wait_final(client, batch.id, timeout_s=120)
    assert batch.status == "completed"
    (good,) = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    jsonschema.validate(json.loads(good["response"]["body"]["choices"][0]["message"]["content"]), SCHEMA)
    (bad,) = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert bad["custom_id"] == "b" and bad["response"]["status_code"] == 400


def test_tool_choice_named_forces_a_parsed_call(client):
    # The byte-level tiny model spends a token per byte: one tool keeps the prompt within its context.
    out = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Time?"}],
                                         tools=[CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_tool_choice_required_streams_call_deltas(client):
    stream = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Weather?"}],
                                            tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, stream=True)
    heads, arguments, reason = [], [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or ():
            if call.id:
                heads.append(call.function.name)
            arguments.append(call.function.arguments or "")
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "tool_calls" and len(heads) == 1 and heads[0] in ("get_weather", "get_time")
    assert sum(1 for piece in arguments if piece) > 3          # streamed as generated, not at the end
    assert json.loads("".join(arguments))


def test_tool_history_is_accepted(http):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                        "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = http.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER], "max_tokens": 3})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"minimum": "x"}}}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": SCHEMA, "ignore_eos": True}, "ignore_eos"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
])
def test_errors_are_400_naming_the_field(http, fields, param):
    error = assert_error(http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **fields}),
                         400, param=param)
    assert param in error["message"] or param.split("_")[0] in error["message"]


def test_unknown_tool_choice_function_through_openai(client):
    import openai
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=2, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "launch"}})
    assert err.value.body["param"] == "tool_choice" and "launch" in err.value.body["message"]


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "bad"}}])
def test_an_invalid_tool_schema_names_the_tool_not_tool_choice(http, tool_choice):
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}}
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "tools": [WEATHER, bad], "tool_choice": tool_choice,
                                                       "max_tokens": 3})
    error = assert_error(response, 400, param="tools[1].function.parameters")
    assert "properties/a/type" in error["message"]
    assert "%json" not in error["message"] and "start:" not in error["message"]   # no grammar internals
