"""A small multipart/form-data parser (RFC 7578) for POST /v1/files.

Starlette's form parsing needs the python-multipart package; uploads here are one JSONL file
plus a few text fields, already read into memory under the body size limit, so a strict
in-memory parser keeps the dependency list short. Malformed bodies raise a 400.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from backfill.server.errors import bad_request

_PARAM = re.compile(r';\s*([A-Za-z0-9_\-*]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;\s]*))')
_MAX_PARTS = 32


@dataclass(frozen=True)
class Part:
    name: str
    filename: str | None
    content_type: str | None
    data: bytes


def header_params(value: str) -> tuple[str, dict[str, str]]:
    """'form-data; name="file"; filename="a.jsonl"' -> ('form-data', {'name': 'file', ...})."""
    head, _, _ = value.partition(";")
    params = {}
    for match in _PARAM.finditer(value[len(head):]):
        key = match.group(1).lower()
        quoted, bare = match.group(2), match.group(3)
        params[key] = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else bare
    return head.strip().lower(), params


def parse_multipart(body: bytes, content_type: str) -> dict[str, Part]:
    kind, params = header_params(content_type)
    if kind != "multipart/form-data":
        raise bad_request(f"expected a multipart/form-data body, got {kind or 'no content type'}")
    boundary = params.get("boundary", "")
    if not boundary or len(boundary) > 200:
        raise bad_request("the multipart body has no valid boundary")
    delimiter = b"\r\n--" + boundary.encode("latin-1", "replace")
    segments = (b"\r\n" + body).split(delimiter)
    if len(segments) < 2:
        raise bad_request("malformed multipart body: no part boundary found")
    parts: dict[str, Part] = {}
    for segment in segments[1:]:
        if segment.startswith(b"--"):
            return parts
        if len(parts) >= _MAX_PARTS:
            raise bad_request(f"malformed multipart body: more than {_MAX_PARTS} parts")
        part = _parse_part(segment)
        parts.setdefault(part.name, part)
    raise bad_request("malformed multipart body: missing the closing boundary")


def _parse_part(segment: bytes) -> Part:
    line_end = segment.find(b"\r\n")
    if line_end < 0 or segment[:line_end].strip(b" \t"):
        raise bad_request("malformed multipart body: bad boundary line")
    head, sep, data = segment[line_end + 2:].partition(b"\r\n\r\n")
    if not sep:
        if not segment[line_end + 2:].startswith(b"\r\n"):
            raise bad_request("malformed multipart body: a part has no header terminator")
        head, data = b"", segment[line_end + 4:]
    headers: dict[str, str] = {}
    for raw in head.split(b"\r\n"):
        name, colon, value = raw.decode("utf-8", "replace").partition(":")
        if not colon:
            raise bad_request("malformed multipart body: bad part header")
        headers[name.strip().lower()] = value.strip()
    disposition, params = header_params(headers.get("content-disposition", ""))
    if disposition != "form-data" or not params.get("name"):
        raise bad_request("malformed multipart body: each part needs Content-Disposition: form-data with a name")
    return Part(params["name"], params.get("filename"), headers.get("content-type"), data)
