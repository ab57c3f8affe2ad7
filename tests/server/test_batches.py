"""The Batch API: a full round trip with the openai client, cancel, listing, and validation of the
input file as OpenAI does it (a malformed file fails as a whole, with every reason listed)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest

from backfill.server.batches import (MAX_LISTED_ERRORS, PREFIX_KEY_MAX_STRETCHES, BatchWorker, parse_batch_input,
                                     prefix_order_key)
from backfill.server.app import create_app
from backfill.server.config import ServerConfig
from backfill.server.store import Store
from backfill.serving.build import build_tiny_engine
from backfill.serving.config import ServingConfig
from server_helpers import (LiveServer, sample_value, chat_line, live_server, make_app, openai_client, upload,
                            wait_final)


def jsonl(client, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("batches")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def test_batch_round_trip_with_refused_bodies(client, server):
    good = [chat_line(f"req-{i}", f"question {i}") for i in range(5)]
    lines = good[:2] + [
        chat_line("bad-temperature", temperature="hot"),
        chat_line("too-long", "x" * 600),                     # beyond the tiny model's 512-token context
        "",
    ] + good[2:]
    file = upload(client, lines)
    assert file.purpose == "batch" and file.bytes > 0
    assert client.files.retrieve(file.id).filename == "input.jsonl"
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "test"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "test"}
    batch = wait_final(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (7, 5, 2)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at

    output = jsonl(client, batch.output_file_id)
    assert sorted(r["custom_id"] for r in output) == sorted(f"req-{i}" for i in range(5))
    for record in output:
        assert set(record) == {"id", "custom_id", "response", "error"}
        assert record["error"] is None and record["id"].startswith("batch_req_")
        response = record["response"]
        assert response["status_code"] == 200 and response["request_id"]
        assert response["body"]["object"] == "chat.completion"
        assert response["body"]["service_tier"] == "flex"     # batch lines run as offline requests
        assert 1 <= response["body"]["usage"]["completion_tokens"] <= 4
    assert batch.usage.output_tokens == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in output)

    metrics = httpx.get(f"{server.url}/metrics").text
    offline_tokens = server.state.engine.scheduler.stats.output_tokens["offline"]
    assert sample_value(metrics, "backfill_output_tokens_total", **{"class": "offline"}) == offline_tokens
    assert offline_tokens >= batch.usage.output_tokens

    errors = {r["custom_id"]: r for r in jsonl(client, batch.error_file_id)}
    assert set(errors) == {"bad-temperature", "too-long"}
    assert errors["bad-temperature"]["response"]["status_code"] == 400
    assert errors["bad-temperature"]["response"]["body"]["error"]["param"] == "temperature"
    assert errors["too-long"]["response"]["body"]["error"]["code"] == "context_length_exceeded"


def test_malformed_file_fails_validation_with_every_reason(client, server):
    finished_before = server.state.engine.scheduler.stats.finished["offline"]
    lines = [
        chat_line("ok-1"),
        "{not json",
        json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        chat_line("ok-1"),                                    # duplicate custom_id
        chat_line("other-model", model="gpt-4o"),
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),   # no custom_id
        chat_line("ok-2"),
    ]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = wait_final(client, batch.id)
    assert batch.status == "failed" and batch.failed_at
    assert batch.output_file_id is None and batch.error_file_id is None
    assert batch.request_counts.total == 0
    reasons = [(e.code, e.line, e.param) for e in batch.errors.data]
    assert reasons == [("invalid_json_line", 2, None), ("invalid_url", 3, "url"),
                       ("duplicate_custom_id", 4, "custom_id"), ("model_not_found", 5, "body.model"),
                       ("invalid_request", 6, "custom_id")]
    assert all(e.message.startswith(f"line {e.line}: ") for e in batch.errors.data)
    assert server.state.engine.scheduler.stats.finished["offline"] == finished_before   # nothing ran


def test_completions_endpoint_batch(client):
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"item {i}", "max_tokens": 3, "temperature": 0}}) for i in range(3)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/completions",
                                  completion_window="24h")
    batch = wait_final(client, batch.id)
    assert batch.status == "completed" and batch.error_file_id is None
    output = jsonl(client, batch.output_file_id)
    assert [r["custom_id"] for r in output] == ["c0", "c1", "c2"]
    assert all(r["response"]["body"]["object"] == "text_completion" for r in output)


def test_cancel_keeps_finished_lines(client):
    lines = [chat_line(f"long-{i}", max_tokens=200, ignore_eos=True) for i in range(150)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_final(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert batch.request_counts.completed < 150
    finished = jsonl(client, batch.output_file_id) if batch.output_file_id else []
    assert len(finished) == batch.request_counts.completed


def test_list_batches_paginates(client):
    file = upload(client, [chat_line("p")])
    ids = [client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == ids[0]
    seen = [b.id for b in client.batches.list(limit=1)]   # the client follows has_more / after
    assert seen[:3] == ids[::-1] and len(seen) == len(set(seen))
    for batch_id in ids:
        wait_final(client, batch_id)


def test_files_list_and_delete(client):
    file = upload(client, [chat_line("d")])
    assert file.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(file.id).deleted
    assert file.id not in [f.id for f in client.files.list()]


def test_parse_batch_input_lists_every_malformed_line():
    content = "\n".join([chat_line("a"), "[1, 2]", "", chat_line("b"), '{"custom_id": 5}']).encode()
    runnable, failures, errors = parse_batch_input(content, "/v1/chat/completions", lambda body: None)
    assert [(line, cid) for line, cid, _, _ in runnable] == [(0, "a"), (3, "b")] and failures == []
    assert [(e["code"], e["line"]) for e in errors] == [("invalid_request", 2), ("invalid_request", 5)]


def test_lines_sharing_a_prompt_prefix_get_keys_that_sort_together():
    system_a, system_b = "rules of A " * 60, "rules of B " * 60     # each longer than a key stretch
    def chat(system: str, question: str, model: str = "m") -> dict:
        return {"model": model, "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": question}]}
    bodies = [chat(system_a, "q1"), chat(system_b, "q2"), chat(system_a, "q3"), chat(system_b, "q4"),
              chat(system_a, "q5", model="other")]
    keys = [prefix_order_key("/v1/chat/completions", body) for body in bodies]
    assert keys[0][:8] == keys[2][:8] and keys[0][:8] != keys[1][:8] and keys[0] != keys[2]
    assert keys[4][:8] != keys[0][:8]    # another model (or adapter) shares no KV
    grouped = [i for i in sorted(range(5), key=lambda i: (keys[i], i)) if i != 4]
    assert {frozenset(grouped[:2]), frozenset(grouped[2:])} == {frozenset({0, 2}), frozenset({1, 3})}
    text = prefix_order_key("/v1/completions", {"model": "m", "prompt": "x" * 100_000})
    assert len(text) == 8 * PREFIX_KEY_MAX_STRETCHES   # bounded however long the prompt


def test_a_file_mixing_two_system_prompts_runs_each_one_s_lines_together(tmp_path):
    """One line in flight and a KV pool that holds one prompt's blocks: in file order (A, B, A, B) each
    line would evict the other prompt before its second line came; grouped, the second of each finds
    its whole system prompt cached."""
    serving = ServingConfig(kv_cache_gb=24 * 16 * 1024 / 2**30, max_model_len=512)   # 24 tiny-model blocks
    db = tmp_path / "mixed.db"
    app = create_app(build_tiny_engine(serving), ServerConfig(serving=serving, db=str(db), max_offline_in_flight=1,
                                                              drain_timeout_s=2.0), Store(db))
    systems = {"A": "Always answer as a lighthouse keeper would. " * 5, "B": "Reply in the voice of a ship's cook. " * 6}
    lines = [json.dumps({"custom_id": f"{name}{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "system", "content": systems[name]},
                                               {"role": "user", "content": f"q{i}"}], "max_tokens": 2}})
             for i, name in enumerate("ABAB")]
    with LiveServer(app) as server:
        client = openai_client(server.url)
        batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        batch = wait_final(client, batch.id)
        assert batch.status == "completed"
        cached = {r["custom_id"]: r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
                  for r in jsonl(client, batch.output_file_id)}
    assert len(systems["A"]) >= 200 and len(systems["B"]) >= 200     # byte tokens: 12 or more full blocks
    assert cached["A2"] >= 12 * 16 and cached["B3"] >= 12 * 16, cached


def test_parse_batch_input_caps_the_listed_errors():
    content = "\n".join(["nope"] * (MAX_LISTED_ERRORS + 7)).encode()
    errors = parse_batch_input(content, "/v1/chat/completions", lambda body: None)[2]
    assert len(errors) == MAX_LISTED_ERRORS + 1 and errors[-1]["message"] == "and 7 more invalid lines"


@pytest.mark.parametrize("content", [b"\n \n", b""])
def test_parse_batch_input_empty_file(content):
    errors = parse_batch_input(content, "/v1/chat/completions", lambda body: None)[2]
    assert [e["code"] for e in errors] == ["empty_file"]


def test_worker_fails_batch_whose_input_file_vanished(tmp_path):
    app = make_app(tmp_path / "w.db")
    state = app.state.backfill
    store = state.store
    file = store.create_file("batch", "in.jsonl", chat_line("x").encode())
    batch = store.create_batch(file["id"], "/v1/chat/completions", "24h", None)
    store.delete_file(file["id"])

    async def run() -> None:
        await state.engine.start()
        worker = BatchWorker(store, state.service, max_in_flight=4, poll_interval_s=0.01)
        worker.start()
        deadline = time.monotonic() + 20
        while store.get_batch(batch["id"])["status"] == "validating" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await worker.stop(time.monotonic())
        await state.engine.stop()

    asyncio.run(run())
    failed = store.get_batch(batch["id"])
    store.close()
    assert failed["status"] == "failed" and failed["failed_at"]
    assert failed["errors"]["data"][0]["code"] == "file_not_found"


def test_worker_stops_even_when_woken_as_it_is_cancelled(tmp_path):
    """A line finishing during shutdown wakes the worker's loop just as stop() cancels it; on
    Python 3.11 asyncio.wait_for then swallows the cancel, and the loop must still end."""
    app = make_app(tmp_path / "s.db")
    state = app.state.backfill

    async def run() -> None:
        worker = BatchWorker(state.store, state.service, max_in_flight=4, poll_interval_s=30.0)
        worker.start()
        await asyncio.sleep(0.05)   # the loop now waits on its wake-up event
        worker.wake()               # woken and cancelled in the same turn of the event loop
        await asyncio.wait_for(worker.stop(time.monotonic()), timeout=10)

    asyncio.run(run())
    state.store.close()


def test_idle_worker_polls_rarely_and_wakes_for_a_new_batch(tmp_path):
    """With no batch open the worker looks at the store every idle_poll_interval_s, not every
    poll_interval_s; a batch created (which wakes it) is still picked up at once."""
    app = make_app(tmp_path / "idle.db")
    state = app.state.backfill
    store = state.store
    looks = []
    running_batches = store.running_batches

    def counted():
        looks.append(time.monotonic())
        return running_batches()

    store.running_batches = counted

    async def run() -> dict:
        await state.engine.start()
        worker = BatchWorker(store, state.service, max_in_flight=4, poll_interval_s=0.01, idle_poll_interval_s=30.0)
        worker.start()
        await asyncio.sleep(0.5)
        idle_looks = len(looks)
        file = store.create_file("batch", "in.jsonl", chat_line("x").encode())
        batch = store.create_batch(file["id"], "/v1/chat/completions", "24h", None)
        worker.wake()
        deadline = time.monotonic() + 60
        while store.get_batch(batch["id"])["status"] != "completed" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        busy_looks = len(looks) - idle_looks
        await worker.stop(time.monotonic())
        await state.engine.stop()
        return {"idle": idle_looks, "busy": busy_looks, "status": store.get_batch(batch["id"])["status"]}

    result = asyncio.run(run())
    store.close()
    # 0.5 s idle at a 0.01 s poll would be ~50 looks; at 30 s, the first one only.
    assert result["idle"] == 1
    assert result["status"] == "completed" and result["busy"] >= 2


def test_batch_on_damaged_input_fails_at_once_and_others_proceed(tmp_path, caplog):
    """Stored bytes of one input file change on disk: its batch fails within 5 s with an error
    naming the damage, logged once without a traceback; a batch on a good file created after it
    completes, and the worker polls on as before (no tight retry loop)."""
    import sqlite3

    caplog.set_level(logging.INFO, logger="backfill.server.batches")
    with live_server(tmp_path) as server:
        client = openai_client(server.url)
        damaged = upload(client, [chat_line("a"), chat_line("b")])
        with sqlite3.connect(tmp_path / "server.db") as raw:   # the bytes change; their checksum does not
            raw.execute("UPDATE files SET content = CAST(replace(content, 'hi', 'hj') AS BLOB) WHERE id = ?",
                        (damaged.id,))
        created = time.monotonic()
        bad = client.batches.create(input_file_id=damaged.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
        good = client.batches.create(input_file_id=upload(client, [chat_line("c")]).id,
                                     endpoint="/v1/chat/completions", completion_window="24h")
        failed = wait_final(client, bad.id, timeout_s=5.0)
        assert time.monotonic() - created < 5.0
        assert failed.status == "failed", failed
        (error,) = failed.errors.data
        assert error.code == "input_file_damaged" and error.param == "input_file_id"
        assert damaged.id in error.message and "damaged" in error.message and "SHA-256" in error.message
        assert wait_final(client, good.id).status == "completed"
        time.sleep(1.5)   # several polls later: still one line
        lines = [r for r in caplog.records if bad.id in r.getMessage()]
        assert len(lines) == 1 and lines[0].exc_info is None and "\n" not in lines[0].getMessage(), \
            [r.getMessage() for r in lines]
