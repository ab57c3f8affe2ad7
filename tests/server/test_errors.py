"""Every 4xx the API promises, in OpenAI's error shape, on a real app in-process."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from backfill.server.errors import validation_error
from server_helpers import assert_error, close_app, make_app

MESSAGES = [{"role": "user", "content": "hi"}]


JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    app = make_app(tmp_path_factory.mktemp("errors") / "e.db", max_body_mb=0.01)
    with TestClient(app, base_url="http://127.0.0.1") as c:   # a loopback Host: the server answers no other
        yield c
    close_app(app)


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **body})


@pytest.mark.parametrize("raw", [b"{", b"", b"[1, 2]", b"null", b'{"messages": NaN}', b"\xff\xfe", b"1" * 5000,
                                 b'{"messages": [{"role": "user", "content": "\\ud800"}]}'])
def test_malformed_json_is_400(client, raw):
    assert_error(client.post("/v1/chat/completions", content=raw, headers=JSON), 400)


@pytest.mark.parametrize("field, value, param", [
    ("max_tokens", "5", "max_tokens"),
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", 2.0, "max_tokens"),
    ("temperature", -0.5, "temperature"),
    ("temperature", True, "temperature"),
    ("top_p", 0, "top_p"),
    ("top_k", -2, "top_k"),
    ("seed", 2**70, "seed"),
    ("stop", 5, "stop"),
    ("stop", [""], "stop"),
    ("stop", ["s"] * 17, "stop"),
    ("n", 17, "n"),
    ("n", 0, "n"),
    ("logprobs", 1, "logprobs"),
    ("top_logprobs", 3, "top_logprobs"),              # without logprobs: true
    ("top_logprobs", 21, "top_logprobs"),
    ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", -3, "frequency_penalty"),
    ("repetition_penalty", 0, "repetition_penalty"),
    ("min_p", 1.5, "min_p"),
    ("stop_token_ids", [-1], "stop_token_ids"),
    ("response_format", {"type": "xml"}, "response_format.type"),
    ("stream_options", {"include_usage": True}, "stream_options"),
    ("messages", [], "messages"),
    ("messages", "hi", "messages"),
    ("messages", [{"role": "wizard", "content": "x"}], "messages[0].role"),
    ("messages", [{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ("service_tier", "gold", "service_tier"),
    ("tools", [{"type": "function"}], "tools[0].function"),
    ("tool_choice", "sometimes", "tool_choice"),
])
def test_invalid_field_is_400_naming_it(client, field, value, param):
    error = assert_error(chat(client, **{field: value}), 400, param=param)
    assert param.split(".")[0] in error["message"]
    assert "pydantic" not in error["message"] and "input_value" not in error["message"]


def test_missing_required_field_is_400(client):
    error = assert_error(client.post("/v1/chat/completions", json={"max_tokens": 1}), 400, param="messages")
    assert "required" in error["message"].lower()
    assert_error(client.post("/v1/completions", json={"max_tokens": 1}), 400, param="prompt")


def test_min_tokens_above_max_tokens_is_400(client):
    assert_error(chat(client, min_tokens=5, max_tokens=2), 400)


def test_prompt_beyond_context_is_400(client):
    error = assert_error(client.post("/v1/completions", json={"prompt": "x" * 600}), 400,
                         code="context_length_exceeded", param="prompt")
    assert "512" in error["message"]
    assert_error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 600}), 400,
                 code="context_length_exceeded")
    assert_error(client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 600}), 400,
                 code="context_length_exceeded", param="messages")


@pytest.mark.parametrize("prompt", [[], [[1], [2]], ["a", "b"], [10**9], [-1], ""])
def test_bad_prompts_are_400(client, prompt):
    assert_error(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}), 400)


def test_unknown_model_is_404(client):
    assert_error(chat(client, model="gpt-17"), 404, code="model_not_found", param="model")
    assert_error(client.get("/v1/models/gpt-17"), 404, code="model_not_found")


@pytest.mark.parametrize("path", ["/v1/files/file-nope", "/v1/files/file-nope/content", "/v1/batches/batch_nope"])
def test_unknown_ids_are_404(client, path):
    assert_error(client.get(path), 404)


def test_unknown_ids_on_write_are_404(client):
    assert_error(client.post("/v1/batches/batch_nope/cancel"), 404, code="batch_not_found")
    assert_error(client.delete("/v1/files/file-nope"), 404, code="file_not_found")
    assert_error(client.post("/v1/batches", json={"input_file_id": "file-nope", "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h"}), 404, param="input_file_id")


def test_unknown_route_and_method_are_openai_shaped(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/chat/completions"), 405)


def test_oversized_body_is_413(client):
    body = json.dumps({"messages": MESSAGES, "padding": "x" * 20_000})
    assert_error(client.post("/v1/chat/completions", content=body, headers=JSON), 413, code="request_too_large")

    def chunks():   # no Content-Length: the limit applies while reading
        for _ in range(20):
            yield b" " * 1024

    assert_error(client.post("/v1/chat/completions", content=chunks(), headers=JSON), 413)


def test_query_parameters_are_400_not_422(client):
    assert_error(client.get("/v1/batches", params={"limit": "abc"}), 400, param="limit")
    assert_error(client.get("/v1/batches", params={"limit": 0}), 400, param="limit")
    assert_error(client.get("/v1/files", params={"order": "sideways"}), 400, param="order")


@pytest.mark.parametrize("files, data, param", [
    ({"file": ("a.jsonl", b'{"a": 1}')}, {"purpose": "assistants"}, "purpose"),
    ({"file": ("a.jsonl", b'{"a": 1}')}, {}, "purpose"),
    (None, {"purpose": "batch"}, "file"),
    ({"file": ("a.jsonl", b"  \n")}, {"purpose": "batch"}, "file"),
    ({"file": ("a.jsonl", b"\xff\xfe\x00")}, {"purpose": "batch"}, "file"),
])
def test_bad_uploads_are_400(client, files, data, param):
    if files is None:   # a multipart body with only the purpose field
        files = {"purpose": (None, b"batch")}
        data = {}
    assert_error(client.post("/v1/files", files=files, data=data), 400, param=param)


@pytest.mark.parametrize("content_type, body", [
    ("multipart/form-data", b"--x\r\n"),
    ("multipart/form-data; boundary=x", b"garbage"),
    ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data\r\n\r\nv\r\n--x--"),
    ("multipart/form-data; boundary=x", b'--x\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch'),
])
def test_malformed_multipart_is_400(client, content_type, body):
    assert_error(client.post("/v1/files", content=body, headers={"content-type": content_type}), 400)


def test_bad_batch_requests_are_400(client):
    file_id = client.post("/v1/files", files={"file": ("a.jsonl", b'{"custom_id": "a"}')},
                          data={"purpose": "batch"}).json()["id"]
    base = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    assert_error(client.post("/v1/batches", json={**base, "endpoint": "/v1/embeddings"}), 400, param="endpoint")
    assert_error(client.post("/v1/batches", json={**base, "completion_window": "48h"}), 400,
                 param="completion_window")
    assert_error(client.post("/v1/batches", json={**base, "metadata": {"k": 1}}), 400, param="metadata.k")
    assert_error(client.post("/v1/batches", json={**base, "metadata": {str(i): "v" for i in range(17)}}), 400,
                 param="metadata")
    assert_error(client.post("/v1/batches", json={"endpoint": "/v1/completions"}), 400, param="input_file_id")


def test_cancelling_a_finished_batch_is_409(client):
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "x", "max_tokens": 1}})
    file_id = client.post("/v1/files", files={"file": ("a.jsonl", line.encode())},
                          data={"purpose": "batch"}).json()["id"]
    batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                             "completion_window": "24h"}).json()
    for _ in range(400):
        batch = client.get(f"/v1/batches/{batch['id']}").json()
        if batch["status"] == "completed":
            break
        client.get("/health")
    assert batch["status"] == "completed"
    assert_error(client.post(f"/v1/batches/{batch['id']}/cancel"), 409, code="batch_not_cancellable")


def test_validation_error_message_for_union_fields():
    error = validation_error([{"loc": ("body", "stop", "str"), "msg": "Input should be a valid string"},
                              {"loc": ("body", "stop", "list[str]"), "msg": "Input should be a valid list"}])
    assert error.param == "stop" and "str or list[str]" in error.message


def test_escaped_surrogate_pairs_are_fine(client):
    response = client.post("/v1/completions", content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}', headers=JSON)
    assert response.status_code == 200, response.text
