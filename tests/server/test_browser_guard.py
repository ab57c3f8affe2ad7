"""A web page must not reach the server through the user's browser: cross-origin requests (a
foreign Origin, a body type a page can send without a preflight) and DNS rebinding (a foreign
Host) are refused by default, and allowed only when configured (--allowed-origins, --allowed-hosts)."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import assert_error, live_server

EVIL = "http://evil.example"
BODY = b'{"prompt": "hi", "max_tokens": 2}'


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("guard")) as server:
        yield server


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("guard_open"), allowed_origins=EVIL,
                     allowed_hosts="attacker.example") as server:
        yield server


def test_browser_shaped_cross_origin_post_is_refused(default_server):
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"origin": EVIL} | ({"content-type": content_type} if content_type else {})
        response = httpx.post(f"{default_server.url}/v1/completions", content=BODY, headers=headers)
        error = assert_error(response, 403, code="origin_not_allowed")
        assert "--allowed-origins" in error["message"]
        assert "access-control-allow-origin" not in response.headers


def test_json_endpoints_take_only_json(default_server):
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        response = httpx.post(f"{default_server.url}/v1/completions", content=BODY,
                              headers={"content-type": content_type})
        assert "application/json" in assert_error(response, 415, code="unsupported_media_type")["message"]
    response = httpx.post(f"{default_server.url}/v1/completions", content=BODY)   # no content-type at all
    assert_error(response, 415, code="unsupported_media_type")
    ok = httpx.post(f"{default_server.url}/v1/completions", content=BODY,
                    headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_uploads_take_only_multipart(default_server):
    response = httpx.post(f"{default_server.url}/v1/files", content=b"purpose=batch&file=x",
                          headers={"content-type": "application/x-www-form-urlencoded"})
    assert "multipart/form-data" in assert_error(response, 415, code="unsupported_media_type")["message"]


def test_dns_rebinding_host_is_refused(default_server):
    for path in ("/v1/files", "/health", "/metrics"):
        response = httpx.get(f"{default_server.url}{path}", headers={"host": "attacker.example"})
        assert "--allowed-hosts" in assert_error(response, 403, code="host_not_allowed")["message"]
    for host in (f"127.0.0.1:{default_server.port}", f"localhost:{default_server.port}", "localhost"):
        assert httpx.get(f"{default_server.url}/v1/files", headers={"host": host}).status_code == 200


def test_same_origin_is_not_cross_origin(default_server):
    response = httpx.post(f"{default_server.url}/v1/completions", content=BODY,
                          headers={"content-type": "application/json", "origin": default_server.url})
    assert response.status_code == 200, response.text
    assert "access-control-allow-origin" not in response.headers   # no CORS unless configured


def test_no_preflight_answer_by_default(default_server):
    response = httpx.options(f"{default_server.url}/v1/completions",
                             headers={"origin": EVIL, "access-control-request-method": "POST",
                                      "access-control-request-headers": "content-type"})
    assert_error(response, 403, code="origin_not_allowed")
    assert "access-control-allow-origin" not in response.headers


def test_configured_origin_gets_cors(open_server):
    preflight = httpx.options(f"{open_server.url}/v1/completions",
                              headers={"origin": EVIL, "access-control-request-method": "POST",
                                       "access-control-request-headers": "content-type, authorization"})
    assert preflight.status_code == 204, preflight.text
    assert preflight.headers["access-control-allow-origin"] == EVIL
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "content-type" in preflight.headers["access-control-allow-headers"].lower()
    response = httpx.post(f"{open_server.url}/v1/completions", content=BODY,
                          headers={"content-type": "application/json", "origin": EVIL})
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == EVIL
    assert "origin" in response.headers["vary"].lower()
    # Another site is still refused, and a configured one still cannot skip the preflight.
    assert_error(httpx.post(f"{open_server.url}/v1/completions", content=BODY,
                            headers={"content-type": "application/json", "origin": "http://other.example"}),
                 403, code="origin_not_allowed")
    assert_error(httpx.post(f"{open_server.url}/v1/completions", content=BODY,
                            headers={"content-type": "text/plain", "origin": EVIL}), 415)


def test_configured_host_is_allowed(open_server):
    response = httpx.get(f"{open_server.url}/v1/files", headers={"host": "attacker.example"})
    assert response.status_code == 200, response.text
    assert_error(httpx.get(f"{open_server.url}/v1/files", headers={"host": "other.example"}), 403,
                 code="host_not_allowed")
