"""Fuzzing the API in-process: well over 1,000 generated requests, never a 5xx.

Bodies mix plausible values with arbitrary JSON in every field, so both the happy paths
(requests that generate tokens; small context keeps them short) and every validation branch run.
Batches created from fuzzed JSONL files must all reach a final status.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_helpers import ERROR_KEYS, close_app, make_app

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                derandomize=True)

# Text that may hold lone surrogates: valid JSON (as \\udXXX escapes), but not Unicode.
odd_text = st.text(st.characters(categories=["Cs", "Lu"]), max_size=3)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=12), odd_text)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                           max_leaves=8)


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(plausible, plausible, json_values)


roles = st.sampled_from(["user", "user", "system", "assistant", "developer"])
contents = st.one_of(st.text(max_size=12), odd_text, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                           "text": st.text(max_size=8)}), max_size=2))
PLAUSIBLE = {
    "model": st.sampled_from(["tiny-random", "tiny-random", "tiny-random", "gpt-4o"]),
    "max_tokens": st.one_of(st.integers(1, 6), st.integers(-1, 6)),
    "temperature": st.one_of(st.floats(0.0, 2.0), st.floats(-0.5, 2.5)),
    "top_p": st.floats(-0.1, 1.1),
    "top_k": st.integers(-3, 300),
    "seed": st.integers(-(2**65), 2**65),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.one_of(st.just(1), st.integers(0, 3)),
    "service_tier": st.sampled_from(["default", "flex", "auto", "priority", "turbo"]),
    "min_tokens": st.one_of(st.integers(0, 1), st.integers(-1, 4)),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.just(False), st.booleans()),
}
VALID = {  # values the API must accept: these requests have to generate
    "model": st.just("tiny-random"),
    "max_tokens": st.integers(1, 4),
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 300),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stream": st.booleans(),
    "service_tier": st.sampled_from(["default", "flex", "auto", "priority"]),
    "ignore_eos": st.booleans(),
}
prompts = st.one_of(st.text(max_size=20), odd_text, st.lists(st.integers(-5, 300), max_size=8),
                    st.lists(st.text(max_size=5), max_size=2))


def bodies(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Plausible bodies (edge values included) and bodies with arbitrary JSON in any field."""
    return st.one_of(st.fixed_dictionaries(required, optional=optional),
                     st.fixed_dictionaries({k: field(v) for k, v in required.items()},
                                           optional={k: field(v) for k, v in optional.items()}))


message = st.one_of(st.fixed_dictionaries({"role": roles, "content": contents}),
                    st.fixed_dictionaries({"role": field(st.one_of(roles, st.sampled_from(["tool", "wizard"]))),
                                           "content": field(contents)}))
chat_bodies = bodies({"messages": st.lists(message, min_size=1, max_size=3)}, PLAUSIBLE)
completion_bodies = bodies({"prompt": prompts}, {**PLAUSIBLE, "echo": st.booleans(), "suffix": st.text(max_size=3)})
ascii_text = st.text(st.characters(codec="ascii"), max_size=4)   # the chat template adds up to 23 tokens
valid_chat_bodies = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": roles, "content": ascii_text}), min_size=1, max_size=1)},
    optional=VALID)
valid_completion_bodies = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(st.characters(codec="ascii"), min_size=1, max_size=12),
                         st.lists(st.integers(0, 255), min_size=1, max_size=8))}, optional=VALID)
batch_lines = st.one_of(
    st.builds(lambda cid, url, body: json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}),
              field(st.text(min_size=1, max_size=6)), st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
              st.one_of(chat_bodies, completion_bodies)),
    json_values.map(json.dumps),
    st.text(max_size=20).filter(lambda s: "\n" not in s))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    # A 32-token context bounds every generated response, so valid requests stay cheap.
    app = make_app(tmp_path_factory.mktemp("fuzz") / "fuzz.db", max_model_len=32, max_body_mb=1.0)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        yield c
        batch_ids = [b["id"] for b in c.get("/v1/batches", params={"limit": 100}).json()["data"]]
        deadline = time.monotonic() + 60
        pending = list(batch_ids)
        while pending and time.monotonic() < deadline:
            pending = [b for b in pending if c.get(f"/v1/batches/{b}").json()["status"] not in
                       ("completed", "failed", "cancelled", "expired")]
            time.sleep(0.05)
        assert not pending, f"batches never finished: {pending}"
    # The fuzzer must reach both sides: requests that generate and requests that are refused.
    assert sum(STATUSES.values()) >= 1000, STATUSES
    for path in ("chat", "completions", "files", "batches"):
        assert STATUSES[(path, 200)] >= 10 and STATUSES[(path, 400)] >= 10, STATUSES
    close_app(app)


STATUSES: Counter[tuple[str, int]] = Counter()


def post_json(client, path: str, body: object):
    # ASCII-escaped JSON, so lone surrogates reach the server as \\udXXX escapes (as any client may send).
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def check(response) -> None:
    STATUSES[(response.request.url.path.split("/")[2], response.status_code)] += 1
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS


def check_generation(response, stream: object) -> None:
    check(response)
    if response.status_code != 200:
        return
    if stream is True:
        events = [line for line in response.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event[len("data: "):])
    else:
        usage = response.json()["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@settings(FUZZ, max_examples=250)
@given(body=chat_bodies)
def test_fuzz_chat_completions(client, body):
    check_generation(post_json(client, "/v1/chat/completions", body), body.get("stream"))


@settings(FUZZ, max_examples=250)
@given(body=completion_bodies)
def test_fuzz_completions(client, body):
    check_generation(post_json(client, "/v1/completions", body), body.get("stream"))


@settings(FUZZ, max_examples=100)
@given(body=valid_chat_bodies)
def test_fuzz_valid_chat_completions_generate(client, body):
    response = post_json(client, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    check_generation(response, body.get("stream"))


@settings(FUZZ, max_examples=100)
@given(body=valid_completion_bodies)
def test_fuzz_valid_completions_generate(client, body):
    response = post_json(client, "/v1/completions", body)
    assert response.status_code == 200, response.text
    check_generation(response, body.get("stream"))


@settings(FUZZ, max_examples=120)
@given(raw=st.one_of(st.binary(max_size=40), json_values.map(lambda v: json.dumps(v).encode())),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/batches", "/v1/files"]),
       content_type=st.sampled_from(["application/json", "text/plain", "multipart/form-data; boundary=b",
                                     "multipart/form-data"]))
def test_fuzz_raw_bodies(client, raw, path, content_type):
    check(client.post(path, content=raw, headers={"content-type": content_type}))


@settings(FUZZ, max_examples=120)
@given(lines=st.lists(batch_lines, max_size=4), purpose=field(st.sampled_from(["batch", "fine-tune"])),
       endpoint=field(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])),
       window=field(st.just("24h")), metadata=field(st.dictionaries(st.text(max_size=4), st.text(max_size=4))))
def test_fuzz_files_and_batches(client, lines, purpose, endpoint, window, metadata):
    upload = client.post("/v1/files", files={"file": ("in.jsonl", "\n".join(lines).encode("utf-8", "replace"))},
                         data={"purpose": purpose if isinstance(purpose, str) else json.dumps(purpose)})
    check(upload)
    file_id = upload.json()["id"] if upload.status_code == 200 else "file-missing"
    batch = post_json(client, "/v1/batches", {"input_file_id": file_id, "endpoint": endpoint,
                                              "completion_window": window, "metadata": metadata})
    check(batch)
    if batch.status_code == 200:
        check(client.get(f"/v1/batches/{batch.json()['id']}"))


@settings(FUZZ, max_examples=120)
@given(resource=st.sampled_from(["files", "batches"]), ident=st.text(max_size=12),
       query=st.dictionaries(st.sampled_from(["limit", "after", "order", "purpose"]), st.text(max_size=6),
                             max_size=3),
       action=st.sampled_from(["get", "list", "content", "cancel", "delete"]))
def test_fuzz_lookups(client, resource, ident, query, action):
    ident = quote(ident, safe="") or "x"
    if action == "list":
        response = client.get(f"/v1/{resource}", params=query)
    elif action == "content":
        response = client.get(f"/v1/files/{ident}/content")
    elif action == "cancel":
        response = client.post(f"/v1/batches/{ident}/cancel")
    elif action == "delete":
        response = client.delete(f"/v1/files/{ident}")
    else:
        response = client.get(f"/v1/{resource}/{ident}")
    check(response)
