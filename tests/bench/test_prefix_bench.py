"""bench prefix's workload and its two request paths (in-process, and over HTTP to a live server),
on the tiny random model: prompts of the asked sizes, and cached_tokens read as a client reads them."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn

from backfill.bench.prefix_bench import (_batch_api, _batch_http, _batch_inprocess, _coserve, chat_body, iter_questions,
                                        mixed_batch_file, questions, system_prompt)
from backfill.engine.byte_tokenizer import ByteTokenizer
from backfill.server.app import create_app
from backfill.server.config import ServerConfig
from backfill.server.store import Store
from backfill.serving.build import build_tiny_engine
from backfill.serving.config import ServingConfig
from bench_helpers import free_port

SERVING = ServingConfig(policy="fcfs", kv_cache_gb=0.0625, max_model_len=512)


def _bodies(tokenizer, lines: int) -> list[dict]:
    system = system_prompt(tokenizer, 120, seed=1)
    return [chat_body(system, q, 4) for q in questions(tokenizer, lines, seed=2)]


def test_prompts_have_the_asked_sizes_and_questions_differ():
    tokenizer = ByteTokenizer()
    system = system_prompt(tokenizer, 300, seed=1)
    assert len(tokenizer.encode(system)) == 300 and system != system_prompt(tokenizer, 300, seed=2)
    asked = questions(tokenizer, 50, seed=2)
    assert len(set(asked)) == 50
    assert all(len(tokenizer.encode(q)) <= 40 for q in asked) and max(len(tokenizer.encode(q)) for q in asked) >= 30


def test_in_process_lines_after_the_first_find_the_system_prompt_cached():
    engine = build_tiny_engine(SERVING)
    result = asyncio.run(_batch_inprocess(engine, _bodies(engine.tokenizer, 4), concurrency=4))
    assert result["requests"] == 4 and result["output_tokens"] == 16 and result["completion_s"] > 0
    block = engine.scheduler.kv.block_size
    # The first line computes the system prompt's full blocks; the other three map them.
    assert result["cached_tokens"] >= 3 * (120 // block) * block


def test_coserving_counts_offline_tokens_streamed_in_the_window():
    """Offline throughput is what streamed inside the window, whether or not a line finished in it."""
    engine = build_tiny_engine(SERVING)
    tokenizer = engine.tokenizer
    online = [chat_body(system_prompt(tokenizer, 60, seed=3), q, 4) for q in questions(tokenizer, 20, seed=4)]
    offline_system = system_prompt(tokenizer, 120, seed=5)
    offline = (chat_body(offline_system, q, 300) for q in iter_questions(tokenizer, seed=6))
    result = asyncio.run(_coserve(engine, online, 4.0, offline, 2.0, seed=7))
    assert result["online"]["requests"] >= 1 and result["online"]["ttft_ms_p99"] is not None
    # 64 lines in flight stream tokens whether or not they finish in the window.
    assert result["offline"]["output_tokens"] > 300 * result["offline"]["lines_finished"]
    assert result["offline"]["output_tok_s"] == pytest.approx(result["offline"]["output_tokens"] / 2.0)


def test_a_mixed_file_through_the_batch_api_caches_more_in_prefix_order(tmp_path):
    """Two system prompts, one line in flight, a pool that holds one prompt's blocks: in file order
    each line evicts the other prompt; in the server's prefix order the second line of each finds it."""
    serving = ServingConfig(policy="fcfs", kv_cache_gb=24 * 16 * 1024 / 2**30, max_model_len=512)
    content = mixed_batch_file(ByteTokenizer(), lines=4, prompts=2, system_tokens=200, max_tokens=2)
    assert len(content.splitlines()) == 4
    results = {order: asyncio.run(_batch_api(build_tiny_engine(serving), content, 1, tmp_path / f"{order}.db",
                                             order == "prefix", order))
               for order in ("prefix", "file")}
    for r in results.values():
        assert r["status"] == "completed" and r["requests"] == 4 and r["output_tokens"] == 8
    assert results["prefix"]["cached_tokens"] >= 2 * 12 * 16 > results["file"]["cached_tokens"]


@pytest.fixture()
def live_url(tmp_path):
    app = create_app(build_tiny_engine(SERVING), ServerConfig(serving=SERVING, db=str(tmp_path / "db")),
                     Store(tmp_path / "db"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)
    app.state.backfill.store.close()


def test_over_http_usage_carries_cached_tokens(live_url):
    result = asyncio.run(_batch_http(live_url, "tiny-random", _bodies(ByteTokenizer(), 4), concurrency=2,
                                     api_key=None))
    assert result["requests"] == 4 and result["output_tokens"] == 16
    assert result["cached_tokens"] > 0 and 0 < result["cached_share"] < 1
