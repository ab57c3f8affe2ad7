"""`backfill bench structured`: JSON-schema output on the default model, validated, and what the
grammar costs per token.

Requests go through the server's own request path (CompletionService.prepare: the same fields,
schema checks and grammar as POST /v1/chat/completions) on an in-process engine, so HTTP adds no
noise to the per-token figure. Phases alternate: a group with the schema, then the same prompts
without it, each plain request generating exactly as many tokens as its structured twin did
(ignore_eos), so both phases run the same batch shapes and the TPOT ratio is the grammar's cost.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import jsonschema

from backfill.progress import Heartbeat
from backfill.server.completions import CompletionService, collect
from backfill.server.metrics import ServerMetrics
from backfill.serving.async_engine import AsyncEngine

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
SUBJECTS = ("a baker", "a pilot", "a retired teacher", "a chess player", "a marine biologist", "a violinist",
            "a farmer", "a software engineer", "a nurse", "a mountain guide")


@dataclass
class StructuredSample:
    text: str
    finish_reason: str | None
    output_tokens: int
    tpot_ms: float | None


def prompt(index: int) -> str:
    return (f"Invent {SUBJECTS[index % len(SUBJECTS)]} from a city of your choice (person {index}). Answer with "
            "a JSON object with the person's name, age, city and up to three hobbies.")


async def _one(service: CompletionService, body: dict, semaphore: asyncio.Semaphore) -> StructuredSample:
    async with semaphore:
        prepared = service.prepare("chat", body)
        generation = service.submit(prepared)
        try:
            outcome = await collect(prepared, generation)
        finally:
            await generation.aclose()
        first, last = generation.first_of[0], generation.last_token_s[0]
        tokens = generation.output_tokens[0]
        tpot = (last - first) * 1e3 / (tokens - 1) if first is not None and last is not None and tokens > 1 else None
        choice = outcome.choices[0]
        return StructuredSample(choice.text, choice.finish_reason.value if choice.finish_reason else None, tokens, tpot)


async def _phase(service: CompletionService, bodies: list[dict], concurrency: int,
                 done: list[int] | None = None) -> list[StructuredSample]:
    semaphore = asyncio.Semaphore(concurrency)

    async def counted(body: dict) -> StructuredSample:
        sample = await _one(service, body, semaphore)
        if done is not None:
            done[0] += 1
        return sample

    return list(await asyncio.gather(*(counted(body) for body in bodies)))


async def _run(engine: AsyncEngine, model: str, num_requests: int, groups: int, concurrency: int,
               max_tokens: int, done: list[int] | None = None) -> dict:
    service = CompletionService(engine, ServerMetrics(engine, model), model)
    await engine.start()
    try:
        structured: list[StructuredSample] = []
        plain: list[StructuredSample] = []
        per_group = -(-num_requests // groups)
        # Warm-up (first-use costs: the grammar library's tokenizer, kernels) outside the figures.
        await _phase(service, [{"messages": [{"role": "user", "content": prompt(0)}], "max_tokens": 8,
                                "response_format": {"type": "json_object"}}], 1)
        started = time.perf_counter()
        for group in range(groups):
            indices = range(group * per_group, min(num_requests, (group + 1) * per_group))
            with_schema = [{"messages": [{"role": "user", "content": prompt(i)}], "max_tokens": max_tokens,
                            "temperature": 0,
                            "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}}
                           for i in indices]
            samples = await _phase(service, with_schema, concurrency, done)
            structured += samples
            twins = [{"messages": body["messages"], "max_tokens": max(sample.output_tokens, 1), "temperature": 0,
                      "ignore_eos": True} for body, sample in zip(with_schema, samples)]
            plain += await _phase(service, twins, concurrency, done)
            print(f"   group {group + 1}/{groups}: {len(samples)} requests with the schema and their plain twins done",
                  flush=True)
        wall_s = time.perf_counter() - started
    finally:
        await engine.stop()
    valid = 0
    failures = []
    for sample in structured:
        try:
            jsonschema.validate(json.loads(sample.text), PERSON_SCHEMA)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            failures.append({"text": sample.text[:200], "finish_reason": sample.finish_reason, "error": str(exc)[:200]})
    tpot_with = [s.tpot_ms for s in structured if s.tpot_ms is not None]
    tpot_without = [s.tpot_ms for s in plain if s.tpot_ms is not None]
    median_with, median_without = statistics.median(tpot_with), statistics.median(tpot_without)
    return {"requests": len(structured), "valid": valid, "failures": failures[:5],
            "finish_reasons": {r: sum(1 for s in structured if s.finish_reason == r)
                               for r in {s.finish_reason for s in structured}},
            "output_tokens_mean": statistics.mean(s.output_tokens for s in structured),
            "tpot_ms_median_with_grammar": median_with, "tpot_ms_median_without": median_without,
            "tpot_ratio": median_with / median_without,
            "tpot_ms_mean_with_grammar": statistics.mean(tpot_with), "tpot_ms_mean_without": statistics.mean(tpot_without),
            "concurrency": concurrency, "groups": groups, "wall_s": wall_s, "schema": PERSON_SCHEMA,
            "example": structured[0].text}


def run_structured_bench(engine: AsyncEngine, model: str, num_requests: int = 100, groups: int = 4,
                         concurrency: int = 8, max_tokens: int = 160, json_path: str | Path | None = None) -> dict:
    print(f"bench structured: {num_requests} requests with a JSON schema in {groups} group(s), each followed by "
          f"its plain twins, {concurrency} at a time, at most {max_tokens} tokens each", flush=True)
    done = [0]
    with Heartbeat(print, "bench structured", lambda: f"{done[0]}/{2 * num_requests} requests done"):
        result = asyncio.run(_run(engine, model, num_requests, groups, concurrency, max_tokens, done))
    print(f"structured output: {result['valid']}/{result['requests']} valid against the schema "
          f"(finish reasons {result['finish_reasons']}, {result['output_tokens_mean']:.1f} tokens on average)")
    print(f"TPOT median with grammar {result['tpot_ms_median_with_grammar']:.2f} ms, without "
          f"{result['tpot_ms_median_without']:.2f} ms: ratio {result['tpot_ratio']:.3f}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1))
    return result
