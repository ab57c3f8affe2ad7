"""The multipart/form-data parser against what real clients (httpx, the openai client) send."""

from __future__ import annotations

import httpx
import pytest

from backfill.server.errors import APIError
from backfill.server.multipart import header_params, parse_multipart


def encoded(files: dict, data: dict) -> tuple[bytes, str]:
    request = httpx.Request("POST", "http://x/", files=files, data=data)
    return request.read(), request.headers["content-type"]


def test_parses_httpx_uploads_byte_exact():
    payload = b'{"a": 1}\r\n{"b": "\\u00e9"}\n\n--not-a-boundary\r\n'
    body, content_type = encoded({"file": ("in put.jsonl", payload, "application/jsonl")}, {"purpose": "batch"})
    parts = parse_multipart(body, content_type)
    assert parts["purpose"].data == b"batch" and parts["purpose"].filename is None
    assert parts["file"].data == payload
    assert parts["file"].filename == "in put.jsonl" and parts["file"].content_type == "application/jsonl"


def test_header_params_handle_quotes_and_escapes():
    kind, params = header_params('form-data; name="file"; filename="a \\"b\\".jsonl"; x=y')
    assert kind == "form-data" and params == {"name": "file", "filename": 'a "b".jsonl', "x": "y"}


def test_first_part_of_a_name_wins_and_preamble_is_ignored():
    body = (b"preamble\r\n--b\r\nContent-Disposition: form-data; name=\"k\"\r\n\r\none\r\n"
            b"--b\r\nContent-Disposition: form-data; name=\"k\"\r\n\r\ntwo\r\n--b--\r\n")
    assert parse_multipart(body, "multipart/form-data; boundary=b")["k"].data == b"one"


@pytest.mark.parametrize("body, content_type", [
    (b"x", "application/json"),
    (b"x", "multipart/form-data"),
    (b"--b\r\nContent-Disposition: form-data; name=\"k\"\r\n\r\nv", "multipart/form-data; boundary=b"),
    (b"--b\r\nno-colon-header\r\n\r\nv\r\n--b--", "multipart/form-data; boundary=b"),
    (b"--b\r\nContent-Disposition: attachment; name=\"k\"\r\n\r\nv\r\n--b--", "multipart/form-data; boundary=b"),
    (b"--bX\r\n", "multipart/form-data; boundary=b"),
    (b"".join(b"--b\r\nContent-Disposition: form-data; name=\"k%d\"\r\n\r\nv\r\n" % i for i in range(40)) + b"--b--",
     "multipart/form-data; boundary=b"),
])
def test_malformed_bodies_raise_400(body, content_type):
    with pytest.raises(APIError) as info:
        parse_multipart(body, content_type)
    assert info.value.status_code == 400
