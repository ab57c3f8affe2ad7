"""`backfill bench prefix`: what prefix caching buys, with the cache on and off, on three scenarios.

- batch: a Batch-style file of N lines sharing one system prompt (1,024 tokens by default), each
  with a distinct 16-40-token question, 64 output tokens each (ignore_eos), run as offline
  requests at the Batch worker's concurrency: completion time and offline output tok/s. With
  --url the same requests go to an OpenAI-compatible server (/v1/chat/completions, N in flight at
  the same concurrency), e.g. vLLM's, for a side-by-side figure.
- coserve: online chat sharing one system prompt (Poisson arrivals) beside a backlog of offline
  lines sharing another: online P99 TTFT and TPOT against the SLOs, offline tok/s streamed in the
  window. One online chat outside the trace runs first, alone, and computes the system prompt.
- mixed: a Batch file whose lines cycle through several system prompts, run through the Batch API
  in-process (the server's worker and SQLite store) twice: in the order the server runs a file's
  lines (grouped by prompt prefix) and in file order; completion time, output tok/s, cached share.
- stream: the same online chat beside offline lines that each bring a distinct long prefix, on a
  small KV cache: the online system prompt's hit rate (Echo: the blocks online requests find cached
  are evicted last, and offline allocations leave them alone).

In-process requests go through the server's request path (CompletionService: chat template,
validation, the usage object), so cached_tokens is read as a client reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Iterator

from backfill.progress import Heartbeat
from backfill.server.completions import CompletionService, collect
from backfill.server.metrics import ServerMetrics
from backfill.serving.async_engine import AsyncEngine
from backfill.serving.config import ServingConfig
from backfill.types import RequestClass

if TYPE_CHECKING:
    from backfill.server.store import Store

WORDS = ("harbour", "ledger", "quartz", "meadow", "lantern", "orbit", "cedar", "violet", "canyon", "ember",
         "glacier", "pepper", "saddle", "tundra", "walnut", "zephyr", "anchor", "bramble", "cobalt", "dune",
         "falcon", "granite", "hazel", "iris", "juniper", "kelp", "lagoon", "marble", "nutmeg", "onyx")
TOPICS = ("tides", "bread", "volcanoes", "chess openings", "bees", "glass", "rivers", "clocks", "comets",
          "maps", "tea", "bridges", "owls", "salt", "kites", "copper", "moss", "violins", "deserts", "sails")
BATCH_CONCURRENCY = 64   # the Batch worker's lines in flight (server/batches.py max_in_flight)


def filler_text(seed: int, num_words: int) -> str:
    """Deterministic prose-like text (a system prompt's rules and examples), different per seed."""
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < num_words:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        sentences.append(f"Rule {len(sentences) + 1}: the {words[0]} " + " ".join(words[1:]) + ".")
    return " ".join(sentences)


def system_prompt(tokenizer, num_tokens: int, seed: int) -> str:
    """A system prompt of about num_tokens tokens under this tokenizer (cut at a token boundary)."""
    text = filler_text(seed, num_tokens)
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < num_tokens:
        text += " " + filler_text(seed + len(ids), num_tokens)
        ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode(ids[:num_tokens])


def iter_questions(tokenizer, seed: int, low: int = 16, high: int = 40) -> Iterator[str]:
    """Distinct questions of low..high tokens each, without end."""
    rng = random.Random(seed)
    for i in itertools.count():
        want = rng.randint(low, high)
        text = f"Q{i}: why {rng.choice(TOPICS)}"
        while len(tokenizer.encode(text + "?", add_special_tokens=False)) < want:
            longer = f"{text} {rng.choice(WORDS)}"
            if len(tokenizer.encode(longer + "?", add_special_tokens=False)) > high:
                break
            text = longer
        yield text + "?"


def questions(tokenizer, n: int, seed: int) -> list[str]:
    return list(itertools.islice(iter_questions(tokenizer, seed), n))


def chat_body(system: str, question: str, max_tokens: int, model: str | None = None) -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    return body


@dataclass
class Result:
    request_class: str
    arrival_s: float
    ttft_ms: float | None
    tpot_ms: float | None
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    done_s: float


async def _one(service: CompletionService, body: dict, cls: RequestClass, semaphore: asyncio.Semaphore | None,
               origin: float) -> Result:
    async def run() -> Result:
        prepared = service.prepare("chat", body, cls)
        generation = service.submit(prepared)
        try:
            outcome = await collect(prepared, generation)
        finally:
            await generation.aclose()
        arrived = prepared.request.arrival_time
        first, last, tokens = generation.first_of[0], generation.last_token_s[0], generation.output_tokens[0]
        return Result(cls.value, arrived - origin, (first - arrived) * 1e3 if first is not None else None,
                      (last - first) * 1e3 / (tokens - 1) if first is not None and last is not None and tokens > 1
                      else None, tokens, outcome.num_prompt_tokens, outcome.num_cached_tokens,
                      time.monotonic() - origin)

    if semaphore is None:
        return await run()
    async with semaphore:
        return await run()


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _class_summary(results: list[Result], cls: str, window_s: float) -> dict:
    mine = [r for r in results if r.request_class == cls]
    ttft = [r.ttft_ms for r in mine if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in mine if r.tpot_ms is not None]
    prompt = sum(r.prompt_tokens for r in mine)
    return {"requests": len(mine), "output_tokens": sum(r.output_tokens for r in mine),
            "output_tok_s": sum(r.output_tokens for r in mine) / window_s if window_s > 0 else 0.0,
            "ttft_ms_p50": statistics.median(ttft) if ttft else None, "ttft_ms_p99": _p99(ttft),
            "tpot_ms_p50": statistics.median(tpot) if tpot else None, "tpot_ms_p99": _p99(tpot),
            "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in mine),
            "cached_share": sum(r.cached_tokens for r in mine) / prompt if prompt else 0.0}


@contextlib.asynccontextmanager
async def _serving(engine: AsyncEngine, warm_up_class: RequestClass,
                   warm_up_body: dict | None = None) -> AsyncIterator[tuple[CompletionService, Result]]:
    """The engine started and warm, as a server reports ready only then (the background compile
    would take a core from the run), with first-use costs (kernels, the template) paid on one
    request served alone (default: one sharing nothing with the workload); stopped on exit."""
    service = CompletionService(engine, ServerMetrics(engine, engine.model_name), engine.model_name)
    await engine.start()
    try:
        await asyncio.to_thread(engine.wait_until_warm)
        warm_up = await _one(service, warm_up_body or chat_body("warm up", "hello", 4), warm_up_class, None,
                             time.monotonic())
        yield service, warm_up
    finally:
        await engine.stop()


# --- the batch scenario -----------------------------------------------------------------------------

async def _batch_inprocess(engine: AsyncEngine, bodies: list[dict], concurrency: int) -> dict:
    async with _serving(engine, RequestClass.OFFLINE) as (service, _):
        semaphore = asyncio.Semaphore(concurrency)
        origin = time.monotonic()
        results = await asyncio.gather(*(_one(service, body, RequestClass.OFFLINE, semaphore, origin)
                                         for body in bodies))
        wall_s = time.monotonic() - origin
    summary = _class_summary(list(results), "offline", wall_s)
    return {"completion_s": wall_s, **summary}


async def _batch_http(url: str, model: str, bodies: list[dict], concurrency: int, api_key: str | None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    semaphore = asyncio.Semaphore(concurrency)
    done = [0]
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=3600) as client:
        async def one(body: dict) -> dict:
            async with semaphore:
                reply = await client.post("/v1/chat/completions", json={**body, "model": model})
                reply.raise_for_status()
                done[0] += 1
                return reply.json()["usage"]

        await one(chat_body("warm up", "hello", 4))
        done[0] = 0
        origin = time.monotonic()
        with Heartbeat(print, f"batch over HTTP ({url})", lambda: f"{done[0]}/{len(bodies)} lines done"):
            usages = await asyncio.gather(*(one(body) for body in bodies))
        wall_s = time.monotonic() - origin
    output = sum(u["completion_tokens"] for u in usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for u in usages)
    return {"completion_s": wall_s, "requests": len(usages), "output_tokens": output, "output_tok_s": output / wall_s,
            "prompt_tokens": prompt, "cached_tokens": cached, "cached_share": cached / prompt if prompt else 0.0}


def run_batch_scenario(cfg: ServingConfig, lines: int, system_tokens: int, max_tokens: int, concurrency: int,
                       caching: tuple[bool, ...] = (True, False), url: str | None = None,
                       served_model: str | None = None, api_key: str | None = None) -> dict:
    from backfill.engine.weights import load_model
    from backfill.serving.build import build_engine

    tokenizer = load_model(cfg.model).tokenizer   # prompts sized in the served model's tokens
    system = system_prompt(tokenizer, system_tokens, seed=1)
    bodies = [chat_body(system, q, max_tokens) for q in questions(tokenizer, lines, seed=2)]
    out: dict = {"lines": lines, "system_tokens": system_tokens, "max_tokens": max_tokens,
                 "concurrency": concurrency}
    if url is not None:
        out["http"] = asyncio.run(_batch_http(url, served_model or "default", bodies, concurrency, api_key))
        out["http"]["url"] = url
        return out
    for on in caching:
        label = "cache on" if on else "cache off"
        print(f"batch, {label}: {lines} lines, {concurrency} in flight", flush=True)
        engine = build_engine(replace(cfg, prefix_caching=on))
        # finished counts the warm-up request too
        with Heartbeat(print, f"batch, {label}",
                       lambda: f"{max(0, engine.stats.finished['offline'] - 1)}/{lines} lines done"):
            out["cache_on" if on else "cache_off"] = asyncio.run(_batch_inprocess(engine, bodies, concurrency))
    if "cache_on" in out and "cache_off" in out:
        out["speedup_tok_s"] = out["cache_on"]["output_tok_s"] / out["cache_off"]["output_tok_s"]
    return out


# --- the mixed-prefix Batch file ----------------------------------------------------------------

MIXED_ORDERS = ("prefix_order", "file_order")


async def _batch_api(engine: AsyncEngine, content: bytes, concurrency: int, db_path: Path, prefix_order: bool,
                     label: str) -> dict:
    """One Batch file through the server's Batch worker and store; prefix_order False gives every line
    an empty prefix key, so the worker takes them in file order."""
    from backfill.server.store import Store

    endpoint = "/v1/chat/completions"
    store = Store(db_path)
    try:
        async with _serving(engine, RequestClass.OFFLINE) as (service, _):
            batch = await _run_batch_file(service, store, endpoint, content, concurrency, prefix_order, label)
    finally:
        store.close()
    usage = batch["usage"]
    cached = usage["input_tokens_details"]["cached_tokens"]
    return {"status": batch["status"], "completion_s": batch["completion_s"],
            "requests": batch["request_counts"]["completed"],
            "output_tokens": usage["output_tokens"], "output_tok_s": usage["output_tokens"] / batch["completion_s"],
            "prompt_tokens": usage["input_tokens"], "cached_tokens": cached,
            "cached_share": cached / usage["input_tokens"] if usage["input_tokens"] else 0.0}


async def _run_batch_file(service: CompletionService, store: Store, endpoint: str, content: bytes, concurrency: int,
                          prefix_order: bool, label: str) -> dict:
    """Validate the file, store its lines (with their prefix keys, or none) and run them to the end
    through the Batch worker: the final Batch object, with the run's completion_s."""
    from backfill.errors import WorkloadError
    from backfill.server.batches import BatchWorker, parse_batch_input

    lines, failures, errors = parse_batch_input(content, endpoint, lambda body: service.validate("chat", body))
    if errors or failures:
        raise WorkloadError(f"the mixed batch file does not validate: {(errors or failures)[0]}")
    if not prefix_order:
        lines = [(number, custom_id, body, "") for number, custom_id, body, _ in lines]
    batch_id = store.create_batch(store.create_file("batch", "mixed.jsonl", content)["id"], endpoint, "24h",
                                  None)["id"]
    store.start_batch(batch_id, lines, [])
    worker = BatchWorker(store, service, max_in_flight=concurrency, poll_interval_s=0.05)
    origin = time.monotonic()
    worker.start()
    try:
        with Heartbeat(print, label, lambda: f"{store.get_batch(batch_id)['request_counts']['completed']}/"
                                             f"{len(lines)} lines done"):
            while store.get_batch(batch_id)["status"] not in ("completed", "failed", "expired", "cancelled"):
                await asyncio.sleep(0.1)
        wall_s = time.monotonic() - origin
    finally:
        await worker.stop(time.monotonic() + 5)
    return {**store.get_batch(batch_id), "completion_s": wall_s}


def mixed_batch_file(tokenizer, lines: int, prompts: int, system_tokens: int, max_tokens: int) -> bytes:
    """A Batch input file whose line i asks question i under system prompt i % prompts."""
    systems = [system_prompt(tokenizer, system_tokens, seed=100 + k) for k in range(prompts)]
    return "\n".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": chat_body(systems[i % prompts], q, max_tokens)})
                      for i, q in enumerate(questions(tokenizer, lines, seed=2))).encode()


def run_mixed_batch_scenario(cfg: ServingConfig, lines: int, prompts: int, system_tokens: int, max_tokens: int,
                             concurrency: int) -> dict:
    import tempfile

    from backfill.engine.weights import load_model
    from backfill.serving.build import build_engine

    content = mixed_batch_file(load_model(cfg.model).tokenizer, lines, prompts, system_tokens, max_tokens)
    out: dict = {"lines": lines, "prompts": prompts, "system_tokens": system_tokens, "max_tokens": max_tokens,
                 "concurrency": concurrency, "kv_cache_gb": cfg.kv_cache_gb}
    for order in MIXED_ORDERS:
        label = f"mixed batch, {order.replace('_', ' ')}"
        print(f"{label}: {lines} lines cycling through {prompts} system prompts, {concurrency} in flight",
              flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out[order] = asyncio.run(_batch_api(build_engine(cfg), content, concurrency, Path(tmp) / "batch.db",
                                                order == "prefix_order", label))
    out["speedup_tok_s"] = out["prefix_order"]["output_tok_s"] / out["file_order"]["output_tok_s"]
    return out


# --- the co-serving scenarios -------------------------------------------------------------------

async def _coserve(engine: AsyncEngine, online_bodies: list[dict], online_rate: float, offline_bodies,
                   duration_s: float, seed: int, warm_up_body: dict | None = None) -> dict:
    """Online requests at Poisson arrivals for duration_s beside an offline backlog kept at the Batch
    worker's concurrency; offline throughput counts the output tokens streamed in the window (as
    bench coserve), and the lines finished in it are counted apart. warm_up_body: the request served
    alone before the window (default: one sharing nothing with the trace)."""
    rng = random.Random(seed)
    async with _serving(engine, RequestClass.ONLINE, warm_up_body) as (service, warm_up):
        origin = time.monotonic()
        stats = engine.stats
        queries0, hits0 = dict(stats.prefix_cache_queries), dict(stats.prefix_cache_hits)
        offline_tokens0 = stats.output_tokens["offline"]
        offline_done: list[Result] = []
        stop = asyncio.Event()

        async def offline_worker() -> None:
            while not stop.is_set():
                result = await _one(service, next(offline_bodies), RequestClass.OFFLINE, None, origin)
                if result.done_s <= duration_s:
                    offline_done.append(result)

        workers = [asyncio.create_task(offline_worker()) for _ in range(BATCH_CONCURRENCY)]
        online: list[asyncio.Task] = []
        at, i = 0.0, 0
        while True:
            at += rng.expovariate(online_rate)
            if at >= duration_s:
                break
            await asyncio.sleep(max(0.0, origin + at - time.monotonic()))
            online.append(asyncio.create_task(_one(service, online_bodies[i % len(online_bodies)],
                                                   RequestClass.ONLINE, None, origin)))
            i += 1
        await asyncio.sleep(max(0.0, origin + duration_s - time.monotonic()))
        offline_tokens = stats.output_tokens["offline"] - offline_tokens0
        online_results = await asyncio.gather(*online)
        stop.set()
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        queries = {k: v - queries0[k] for k, v in stats.prefix_cache_queries.items()}
        hits = {k: v - hits0[k] for k, v in stats.prefix_cache_hits.items()}
    offline = _class_summary(offline_done, "offline", duration_s)
    offline["lines_finished"] = offline.pop("requests")
    offline["output_tokens"], offline["output_tok_s"] = offline_tokens, offline_tokens / duration_s
    return {"warm_up": {"ttft_ms": warm_up.ttft_ms, "prompt_tokens": warm_up.prompt_tokens,
                        "cached_tokens": warm_up.cached_tokens},
            "online": _class_summary(list(online_results), "online", duration_s), "offline": offline,
            "online_results": list(online_results), "prefix_cache_queries": queries, "prefix_cache_hits": hits}


def run_coserve_scenario(cfg: ServingConfig, kind: str, duration_s: float, online_rate: float,
                         online_system_tokens: int, offline_system_tokens: int, online_max_tokens: int,
                         offline_max_tokens: int, caching: tuple[bool, ...] = (True, False)) -> dict:
    """kind "coserve": offline lines share one system prompt; "stream": each brings its own."""
    from backfill.serving.build import build_engine

    out: dict = {"scenario": kind, "duration_s": duration_s, "online_rate_rps": online_rate,
                 "online_system_tokens": online_system_tokens, "offline_system_tokens": offline_system_tokens,
                 "slo": {"ttft_ms": cfg.coserve.slo.ttft_ms, "tpot_ms": cfg.coserve.slo.tpot_ms}}
    for on in caching:
        engine = build_engine(replace(cfg, prefix_caching=on))
        tokenizer = engine.tokenizer
        online_system = system_prompt(tokenizer, online_system_tokens, seed=3)
        online_bodies = [chat_body(online_system, q, online_max_tokens) for q in questions(tokenizer, 400, seed=4)]
        # The window measures steady co-serving: an online chat outside the trace computes the system
        # prompt first, as the traffic a server has been taking would have (its TTFT is reported).
        warm_up = chat_body(online_system, next(iter_questions(tokenizer, seed=8)), online_max_tokens)
        block = engine.kv_block_size
        shared_full = len(tokenizer.encode_chat([{"role": "system", "content": online_system}])) // block * block

        def offline_lines():
            offline_system = system_prompt(tokenizer, offline_system_tokens, seed=5)
            for i, q in enumerate(iter_questions(tokenizer, seed=6)):
                system = offline_system if kind == "coserve" else system_prompt(tokenizer, offline_system_tokens,
                                                                                seed=1000 + i)
                yield chat_body(system, q, offline_max_tokens)

        print(f"{kind}, cache {'on' if on else 'off'}: {duration_s:g} s of online chat beside offline lines",
              flush=True)
        with Heartbeat(print, f"{kind}, cache {'on' if on else 'off'}", expected_s=duration_s):
            result = asyncio.run(_coserve(engine, online_bodies, online_rate, offline_lines(), duration_s, seed=7,
                                          warm_up_body=warm_up))
        online_results = result.pop("online_results")
        # The online system prompt's hit rate: the window's requests that found its full blocks cached.
        result["online_prefix_hit_rate"] = (sum(1 for r in online_results if r.cached_tokens >= shared_full)
                                            / len(online_results) if online_results else None)
        slo = cfg.coserve.slo
        online = result["online"]
        result["online_within_slo"] = (online["ttft_ms_p99"] is not None and online["ttft_ms_p99"] <= slo.ttft_ms
                                       and (online["tpot_ms_p99"] or 0.0) <= slo.tpot_ms)
        out["cache_on" if on else "cache_off"] = result
    if "cache_on" in out and "cache_off" in out and out["cache_off"]["offline"]["output_tok_s"]:
        out["offline_speedup_tok_s"] = (out["cache_on"]["offline"]["output_tok_s"]
                                        / out["cache_off"]["offline"]["output_tok_s"])
    return out


def print_summary(name: str, result: dict) -> None:
    if name == "mixed":
        for order in MIXED_ORDERS:
            r = result[order]
            print(f"mixed {order}: {r['requests']} lines in {r['completion_s']:.1f} s, {r['output_tok_s']:.1f} "
                  f"output tok/s, {r['cached_share']:.0%} of prompt tokens cached")
        print(f"mixed: prefix order / file order output tok/s = {result['speedup_tok_s']:.2f}x")
        return
    for mode in ("cache_on", "cache_off", "http"):
        r = result.get(mode)
        if r is None:
            continue
        if name == "batch":
            print(f"batch {mode}: {r['requests']} lines in {r['completion_s']:.1f} s, {r['output_tok_s']:.1f} "
                  f"output tok/s, {r['cached_share']:.0%} of prompt tokens cached")
        else:
            on, off = r["online"], r["offline"]
            print(f"{name} {mode}: online {on['requests']} req, P99 TTFT {on['ttft_ms_p99']} ms, P99 TPOT "
                  f"{on['tpot_ms_p99']} ms (within SLO: {r['online_within_slo']}), prefix hit rate "
                  f"{r['online_prefix_hit_rate']}; offline {off['output_tok_s']:.1f} tok/s, {off['lines_finished']} "
                  f"lines finished")
    for key in ("speedup_tok_s", "offline_speedup_tok_s"):
        if key in result:
            print(f"{name}: cache on / off offline tok/s = {result[key]:.2f}x")


def write_json(path: str | Path, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=str))
