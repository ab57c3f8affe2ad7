"""Every request field does what OpenAI / vLLM documents or is refused with a 400 naming it:
logprobs, n, penalties, min_p and stop_token_ids through the openai client and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_helpers import assert_error, live_server, openai_client

MESSAGES = [{"role": "user", "content": "Count: one two three"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("fields")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"),
    ("guided_json", 5), ("guided_choice", "a"), ("guided_regex", "[a-"), ("guided_whitespace_pattern", " *"),
    ("repetition_penalty", "high"), ("prompt_logprobs", 1), ("chat_template", "{{ messages }}"),
    ("add_generation_prompt", False), ("reasoning_effort", "low"), ("modalities", ["text", "audio"]),
])
def test_unsupported_or_malformed_field_is_400_naming_it(http, field, value):
    body = {"messages": MESSAGES, "max_tokens": 2, field: value}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param=field)


def test_neutral_values_of_unsupported_fields_are_accepted(http):
    body = {"messages": MESSAGES, "max_tokens": 2, "add_generation_prompt": True, "modalities": ["text"],
            "functions": [], "n": 1, "presence_penalty": 0, "min_p": 0.0}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_openai_client_gets_bad_request_for_prompt_logprobs(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=2,
                                       extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"


def test_chat_logprobs_and_top_logprobs_through_openai(client):
    out = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token          # greedy picks the most likely token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    plain = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_raw_http(http):
    body = {"prompt": "one two", "max_tokens": 5, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    assert all(len(top) <= 2 and lp["tokens"][i] in top for i, top in enumerate(lp["top_logprobs"]))


def test_streamed_logprobs_cover_every_token(client):
    stream = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=5, temperature=0,
                                            logprobs=True, stream=True, extra_body={"ignore_eos": True})
    entries = [e for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert len(entries) == 5


def test_n_choices_non_streaming_and_streaming(client):
    out = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=4, n=3, temperature=1.0,
                                         seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 0
    again = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=4, n=3, temperature=1.0,
                                           seed=7, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    texts: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=4, n=2, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 8
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and set(texts) == {0, 1}


def test_n_for_text_completions(http):
    body = {"prompt": "a b c", "max_tokens": 3, "n": 2, "ignore_eos": True}
    out = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1] and out["usage"]["completion_tokens"] == 6


def test_penalties_change_greedy_output(http):
    base = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True}
    plain = http.post("/v1/chat/completions", json=base).json()["choices"][0]
    tokens = [e["token"] for e in plain["logprobs"]["content"]]
    assert len(set(tokens)) < len(tokens)          # the tiny random model repeats itself
    for field, value in (("repetition_penalty", 3.0), ("frequency_penalty", 2.0), ("presence_penalty", 2.0)):
        first = http.post("/v1/chat/completions", json={**base, field: value}).json()["choices"][0]
        assert first["message"] != plain["message"], field
        penalized = [e["token"] for e in first["logprobs"]["content"]]
        assert len(set(penalized)) > len(set(tokens)), field


def test_min_p_one_is_greedy(http):
    body = {"prompt": "one two", "max_tokens": 6, "ignore_eos": True}
    greedy = http.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    for seed in (1, 2, 3):
        out = http.post("/v1/completions", json={**body, "temperature": 1.5, "min_p": 1.0, "seed": seed}).json()
        assert out["choices"][0]["text"] == greedy


def test_stop_token_ids_end_generation(http, server):
    # The penalty makes the tiny model's greedy output vary, so there is a new token to stop at.
    body = {"prompt": "one two", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "repetition_penalty": 3.0}
    first = http.post("/v1/completions", json=body).json()["choices"][0]
    tokens = first["logprobs"]["tokens"]
    at = next(i for i, token in enumerate(tokens) if i and token not in tokens[:i])   # a token not seen before
    tokenizer = server.state.engine.tokenizer
    # Every id that prints as that token: stopping on them stops right there.
    stop_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i], skip_special_tokens=False) == tokens[at]]
    out = http.post("/v1/completions", json={**body, "stop_token_ids": stop_ids}).json()["choices"][0]
    assert out["finish_reason"] == "stop" and out["text"] == "".join(tokens[:at])   # the stop token is not shown
