"""An unknown key is refused at every depth of every JSON endpoint, with a 400 naming its path.

Generated from the one declaration of the request bodies: the server's OpenAPI document, which
FastAPI renders from the body models (backfill/server/schemas.py and the route modules) and
whose top-level completion fields docs/server.md's table lists (tests/server/test_schemas.py).
For every POST endpoint with a JSON body, and every object its schema holds (top level, inside
lists and unions), a body valid but for one unknown key there must get 400 with
`param` = that key's path (`messages[0].content[0].foo`). A new endpoint or nested object is
covered without touching this file; an endpoint with no minimal body here fails the test."""

from __future__ import annotations

import copy
from typing import Iterator

import pytest
from fastapi.testclient import TestClient
from server_helpers import assert_error, close_app, make_app

UNKNOWN = "zz_unknown"
# A valid body of each JSON endpoint (what the generated bodies start from).
MINIMAL = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/batches": {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    "/v1/fine_tuning/jobs": {"model": "m", "training_file": "file-x"},
    "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/nonexistent"},
    "/v1/unload_lora_adapter": {"lora_name": "a"},
}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    app = make_app(tmp_path_factory.mktemp("unknown") / "s.db")
    yield app
    close_app(app)


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, base_url="http://127.0.0.1") as c:
        yield c


def json_endpoints(app) -> dict[str, dict]:
    """path -> request body schema of every POST endpoint that takes JSON."""
    found = {}
    for path, operations in app.openapi()["paths"].items():
        body = operations.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
        if body is not None:
            found[path] = body["schema"]
    return found


def minimal(schema: dict) -> object:
    """A smallest valid value of a schema (its required properties only)."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    if "anyOf" in schema or "oneOf" in schema:
        branches = [b for b in schema.get("anyOf", schema.get("oneOf")) if b.get("type") != "null"]
        return minimal(branches[0])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties", {})
        return {name: minimal(properties[name]) for name in schema.get("required", ())}
    if kind == "array":
        return [minimal(schema["items"])] if schema.get("minItems") else []
    return {"string": "x", "integer": 1, "number": 1.0, "boolean": False}[kind]


def objects(schema: dict, path: tuple = ()) -> Iterator[tuple[tuple, dict]]:
    """(path, schema) of every object with declared properties, the schema's own included."""
    if "properties" in schema:
        yield path, schema
        for name, sub in schema["properties"].items():
            yield from objects(sub, path + (name,))
    for branch in schema.get("anyOf", schema.get("oneOf", ())):
        yield from objects(branch, path)
    if schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        yield from objects(schema["items"], path + (0,))


def with_unknown_key(schema: dict, path: tuple, value: object) -> object:
    """value (a valid instance of schema) with the object at path present, holding UNKNOWN."""
    if not path:
        if "properties" not in schema:   # a union: its object form
            schema = next(b for b in schema.get("anyOf", schema.get("oneOf", ())) if "properties" in b)
        return {**(value if isinstance(value, dict) else minimal(schema)), UNKNOWN: 1}
    step, rest = path[0], path[1:]
    if "properties" not in schema and schema.get("type") != "array":   # a union: the branch the path goes on in
        branches = schema.get("anyOf", schema.get("oneOf", ()))
        branch = next(b for b in branches if (isinstance(step, int) and b.get("type") == "array")
                      or (isinstance(step, str) and step in b.get("properties", {})))
        return with_unknown_key(branch, path, value if isinstance(value, (dict, list)) else None)
    if isinstance(step, int):
        items = schema["items"]
        first = value[0] if isinstance(value, list) and value else minimal(items)
        return [with_unknown_key(items, rest, first)]
    current = dict(value) if isinstance(value, dict) else minimal(schema)
    current[step] = with_unknown_key(schema["properties"][step], rest, current.get(step))
    return current


def param(path: tuple) -> str:
    text = ""
    for part in path + (UNKNOWN,):
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else part
    return text


def cases(app) -> list[tuple[str, tuple, dict]]:
    found = []
    for endpoint, schema in json_endpoints(app).items():
        assert endpoint in MINIMAL, f"{endpoint} takes JSON: give it a minimal body in MINIMAL"
        for path, _ in objects(schema):
            found.append((endpoint, path, with_unknown_key(schema, path, copy.deepcopy(MINIMAL[endpoint]))))
    return found


def test_every_json_endpoint_has_a_minimal_body(app):
    assert set(json_endpoints(app)) == set(MINIMAL)


def test_an_unknown_key_at_any_depth_is_400_naming_its_path(app, client):
    generated = cases(app)
    paths = {(endpoint, param(path)) for endpoint, path, _ in generated}
    # The nested objects the issue named are among those generated.
    for expected in [("/v1/chat/completions", f"messages[0].{UNKNOWN}"),
                     ("/v1/chat/completions", f"stream_options.{UNKNOWN}"),
                     ("/v1/chat/completions", f"messages[0].content[0].{UNKNOWN}"),
                     ("/v1/chat/completions", f"tools[0].function.{UNKNOWN}"),
                     ("/v1/fine_tuning/jobs", f"hyperparameters.{UNKNOWN}"),
                     ("/v1/fine_tuning/jobs", f"method.supervised.hyperparameters.{UNKNOWN}"),
                     ("/v1/batches", UNKNOWN)]:
        assert expected in paths, sorted(paths)
    assert len(generated) >= 20
    for endpoint, path, body in generated:
        if path and path[0] == "stream_options":
            body["stream"] = True
        response = client.post(endpoint, json=body)
        assert_error(response, 400, param=param(path))


@pytest.mark.parametrize("endpoint,body,expected", [
    ("/v1/fine_tuning/jobs", {"model": "m", "training_file": "file-x", "hyperparameter": {"n_epochs": 5}},
     "hyperparameter"),
    ("/v1/batches", {**MINIMAL["/v1/batches"], "metdata": {"a": "b"}}, "metdata"),
])
def test_the_typos_of_the_report_are_refused(client, endpoint, body, expected):
    assert_error(client.post(endpoint, json=body), 400, param=expected)


def test_the_openai_clients_extra_body_typo_is_refused(tmp_path):
    import openai
    from server_helpers import live_server

    with live_server(tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body={"top_kk": 5})
        assert refused.value.body["param"] == "top_kk"


def test_an_unknown_part_of_the_file_upload_is_400_naming_it(client):
    response = client.post("/v1/files", files={"file": ("in.jsonl", b'{"a": 1}\n')},
                           data={"purpose": "batch", "purpse": "batch"})
    assert_error(response, 400, param="purpse")
    ok = client.post("/v1/files", files={"file": ("in.jsonl", b'{"a": 1}\n')}, data={"purpose": "batch"})
    assert ok.status_code == 200, ok.text
