"""scripts/fuzz_api.py, short: 100 requests generated from the server's OpenAPI document reach
every operation, and none gets a 5xx or hangs (the full run, >= 1,000 requests, is in
docs/server.md)."""

from __future__ import annotations

import importlib.util
import sys

import httpx
import pytest
from server_helpers import REPO_ROOT, live_server

pytest.importorskip("schemathesis")
pytestmark = pytest.mark.fuzz


def load_fuzzer():
    spec = importlib.util.spec_from_file_location("fuzz_api", REPO_ROOT / "scripts" / "fuzz_api.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_fuzzed_api_has_no_5xx_and_no_hangs(tmp_path):
    fuzzer = load_fuzzer()
    with live_server(tmp_path, max_model_len=128) as server:
        findings = fuzzer.fuzz(server.url, 100, timeout_s=60)
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        document = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    summary = findings.summary()
    assert summary["requests"] >= 100
    assert summary["responses_5xx"] == 0, summary["examples_5xx"]
    assert summary["hangs"] == 0, summary["examples_hangs"]
    operations = {f"{method.upper()} {path}" for path, ops in document["paths"].items() for method in ops}
    assert {operation for operation, _ in findings.statuses} == operations   # every one was reached
