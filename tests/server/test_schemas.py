"""The request-field table in docs/server.md is the contract: every field it lists is honoured
(a field of the body models) or refused with a 400 naming it, and nothing else is taken. The
table is parsed here and checked against the code, so the two cannot drift."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient
from server_helpers import REPO_ROOT, assert_error, close_app, make_app

from backfill.server.schemas import REFUSED_FIELDS, ChatCompletionBody, CompletionBody

ENDPOINTS = {"chat": ("/v1/chat/completions", ChatCompletionBody),
             "completions": ("/v1/completions", CompletionBody)}
MINIMAL = {"chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
           "completions": {"prompt": "hi", "max_tokens": 2}}


def field_table() -> dict[str, tuple[frozenset[str], str]]:
    """docs/server.md's "Request fields" table: field -> (endpoints, "honoured" | "refused")."""
    text = (REPO_ROOT / "docs" / "server.md").read_text()
    section = text[text.index("### Request fields"):]
    rows: dict[str, tuple[frozenset[str], str]] = {}
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[2] not in ("honoured", "refused"):
            continue
        endpoints = frozenset(part.strip() for part in cells[1].split(","))
        assert endpoints <= set(ENDPOINTS), line
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            assert name not in rows, f"{name} is in the table twice"
            rows[name] = (endpoints, cells[2])
    assert len(rows) > 60, "the table was not found or not parsed"
    return rows


def honoured_fields(model) -> set[str]:
    return {info.alias or name for name, info in model.model_fields.items()}


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_table_matches_the_code(endpoint):
    table = field_table()
    listed = {name for name, (endpoints, handling) in table.items() if handling == "honoured" and endpoint in endpoints}
    assert listed == honoured_fields(ENDPOINTS[endpoint][1])
    refused = {name for name, (endpoints, handling) in table.items() if handling == "refused" and endpoint in endpoints}
    assert refused == set(REFUSED_FIELDS)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    app = make_app(tmp_path_factory.mktemp("schemas") / "s.db")
    with TestClient(app, base_url="http://127.0.0.1") as c:
        yield c
    close_app(app)


def refused_value(unused: tuple[object, ...]) -> object:
    """A value of the field that means "use it" (none of those that mean "not used")."""
    return next(v for v in (True, False, 2, "x", ["x"], {"x": 1})
                if not any(v == u and type(v) is type(u) for u in unused))


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_every_refused_field_is_400_naming_it(client, endpoint):
    path = ENDPOINTS[endpoint][0]
    for name, (endpoints, handling) in field_table().items():
        if handling != "refused" or endpoint not in endpoints:
            continue
        value = refused_value(REFUSED_FIELDS[name])
        assert_error(client.post(path, json={**MINIMAL[endpoint], name: value}), 400, param=name)
        for unused in REFUSED_FIELDS[name]:   # the "not used" values are taken
            response = client.post(path, json={**MINIMAL[endpoint], name: unused})
            assert response.status_code == 200, (name, unused, response.text)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_a_field_of_neither_api_is_400(client, endpoint):
    path = ENDPOINTS[endpoint][0]
    assert_error(client.post(path, json={**MINIMAL[endpoint], "max_token": 5}), 400, param="max_token")
    other = "prompt" if endpoint == "chat" else "tools"   # the other endpoint's field
    assert_error(client.post(path, json={**MINIMAL[endpoint], other: "x"}), 400, param=other)


def test_issue_46_fields_are_not_ignored(client):
    chat = MINIMAL["chat"]
    assert_error(client.post("/v1/chat/completions", json={**chat, "best_of": 3}), 400, param="best_of")
    assert client.post("/v1/chat/completions", json={**chat, "n": 2, "best_of": 2}).status_code == 200
    for name, value in (("echo", True), ("return_token_ids", True), ("request_id", "abc"),
                        ("skip_special_tokens", False)):
        assert_error(client.post("/v1/chat/completions", json={**chat, name: value}), 400, param=name)
        assert_error(client.post("/v1/completions", json={**MINIMAL["completions"], name: value}), 400, param=name)


def test_priority_above_zero_runs_offline(client):
    # vLLM's priority (larger is later), as the benchmark client marks best-effort work for vLLM.
    for priority, tier in ((5, "flex"), (0, "default"), (-1, "default")):
        response = client.post("/v1/completions", json={**MINIMAL["completions"], "priority": priority})
        assert response.json()["service_tier"] == tier, response.text


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(client, stream):
    body = {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[8:10]   # a string the greedy output is known to reach
    assert stop and stop in full
    expected = full[:full.index(stop) + len(stop)]

    def text(**extra) -> tuple[str, str]:
        request = {**body, "stop": [stop], **extra}
        if not stream:
            choice = client.post("/v1/completions", json=request).json()["choices"][0]
            return choice["text"], choice["finish_reason"]
        import json
        events = client.post("/v1/completions", json={**request, "stream": True}).text.split("\n\n")
        chunks = [json.loads(e[len("data: "):]) for e in events if e.startswith("data: {")]
        return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]

    assert text(include_stop_str_in_output=True) == (expected, "stop")
    assert text() == (expected[:-len(stop)], "stop")


@pytest.mark.parametrize("prompt", ["", [""], []])
def test_an_empty_prompt_is_400_naming_prompt(client, prompt):
    assert_error(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}), 400, param="prompt")
