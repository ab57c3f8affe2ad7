"""Where a 64-stream burst's time goes beyond its matmuls (docs/peers.md), one part at a time.

    python scripts/burst_gap_probe.py step-breakdown [--batch 64]
    python scripts/burst_gap_probe.py attention-prefetch-ab
    python scripts/burst_gap_probe.py elementwise
    python scripts/burst_gap_probe.py step-budget [--budgets 256 512 1024]

bf16 with compiled decode, the engine in-process, the default model.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _runner():
    from backfill.engine.weights import load_model
    from backfill.serving.build import build_runner
    from backfill.serving.config import ServingConfig

    cfg = ServingConfig(dtype="bfloat16", compile_decode=True)
    loaded = load_model(cfg.model)
    runner = build_runner(loaded.config, loaded.weights, cfg)
    runner.wait_until_warm()
    return runner


def step_breakdown(batch: int) -> None:
    """Scheduler decode steps of `batch` sequences under cProfile: step, execute and the top callees."""
    from backfill.bench.engine_bench import _limits, _prompt
    from backfill.sampling_params import SamplingParams
    from backfill.serving.build import build_scheduler
    from backfill.serving.config import ServingConfig
    from backfill.types import GenerationRequest, RequestClass

    runner = _runner()
    scheduler = build_scheduler(runner, ServingConfig(policy="fcfs", max_model_len=200, limits=_limits(batch, 128)))
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        scheduler.add(GenerationRequest(_prompt(128, i, runner.config.vocab_size), params, RequestClass.OFFLINE))
    while any(s.num_computed < len(s.prompt_ids) for s in scheduler.seqs.values()):
        scheduler.step()
    for _ in range(3):
        scheduler.step()
    execute, executed_ms = runner.execute, []

    def timed(*args, **kwargs):
        out = execute(*args, **kwargs)
        executed_ms.append(out.duration_s * 1e3)
        return out

    runner.execute = timed
    step_ms = []
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(20):
        start = time.perf_counter()
        scheduler.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
    profile.disable()
    print(f"batch {batch}: step {statistics.median(step_ms):.1f} ms, execute {statistics.median(executed_ms):.1f} ms "
          f"(medians of 20; the callees below are totals over the 20 steps)")
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


def attention_prefetch_ab() -> None:
    """The paged-attention kernel against a variant that prefetches a block's KV heads as one
    contiguous read, swapped in turn (ABBA) on decode steps whose blocks interleave as a burst's do."""
    from backfill.engine.native_build import build_cpu_extension
    from backfill.engine.paged_attention import SOURCE
    from backfill.engine.step import SeqChunk

    source = SOURCE.read_text()
    anchor = "  const int64_t token_stride = s.n_kv * hd, row_bytes = hd * static_cast<int64_t>(sizeof(T));\n"
    whole_block = anchor + """  if (head == 0) {
    const int64_t block_bytes = s.block_size * token_stride * static_cast<int64_t>(sizeof(T));
    const char* keys = reinterpret_cast<const char*>(k_pool + block * s.block_size * token_stride);
    const char* values = reinterpret_cast<const char*>(v_pool + block * s.block_size * token_stride);
    for (int64_t byte = 0; byte < block_bytes; byte += 64) {
      __builtin_prefetch(keys + byte);
      __builtin_prefetch(values + byte);
    }
    return;
  }
"""
    if source.count(anchor) != 1:
        raise SystemExit("the kernel's prefetch changed: this probe no longer applies")
    variant = Path("/tmp/backfill_pa_whole_block.cpp")
    variant.write_text(source.replace(anchor, whole_block))
    kernels = {"per head": build_cpu_extension("backfill_pa_per_head", SOURCE).paged_decode_attention,
               "whole block": build_cpu_extension("backfill_pa_whole_block", variant).paged_decode_attention}
    runner = _runner()
    kv, vocab = runner.kv, runner.config.vocab_size
    for batch in (8, 32, 64, 128):
        context = 160
        tables: list[list[int]] = [[] for _ in range(batch)]
        for _ in range(-(-(context + 2) // kv.block_size)):  # blocks handed out in turn, as in a burst
            for table in tables:
                table += kv.allocate(1)
        for i in range(0, batch, 8):
            runner.execute([SeqChunk(j, [100 + (j * 7919 + t * 104729) % (vocab - 200) for t in range(context)], 0,
                                     tables[j], want_logits=False) for j in range(i, min(batch, i + 8))])
        step = [SeqChunk(j, [7], context, tables[j]) for j in range(batch)]
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for r in range(12):
            for name in (list(kernels) if r % 2 == 0 else list(kernels)[::-1]):
                runner.model.paged_decode_attention = kernels[name]
                times[name].append(runner.execute(step).duration_s * 1e3)
        print(f"decode step of {batch}: " + ", ".join(f"{n} {statistics.median(v):.1f} ms" for n, v in times.items()))
        for table in tables:
            kv.free(table)


def _median_ms(fn, n: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def elementwise() -> None:
    """A 512-token step's elementwise work, eager against inductor (dynamic shapes), and prompt
    attention one SDPA call per prompt against one call for four."""
    def residual_norm(h, y, w):
        h = h + y
        return h, F.rms_norm(h, (h.shape[-1],), w, 1e-5)

    def silu_product(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    dtype = torch.bfloat16
    compiled_norm = torch.compile(residual_norm, dynamic=True, fullgraph=True)
    compiled_silu = torch.compile(silu_product, dynamic=True, fullgraph=True)
    with torch.inference_mode():
        for rows in (128, 512):
            h, y, w = torch.randn(rows, 576, dtype=dtype), torch.randn(rows, 576, dtype=dtype), torch.randn(576, dtype=dtype)
            gate_up = torch.randn(rows, 3072, dtype=dtype)
            print(f"{rows} rows: RMSNorm + residual eager {_median_ms(lambda: residual_norm(h, y, w)):.3f} ms, "
                  f"inductor {_median_ms(lambda: compiled_norm(h, y, w)):.3f} ms; SiLU x up eager "
                  f"{_median_ms(lambda: silu_product(gate_up)):.3f} ms, inductor {_median_ms(lambda: compiled_silu(gate_up)):.3f} ms")
        q = torch.randn(4, 9, 128, 64, dtype=dtype)
        k, v = torch.randn(4, 3, 128, 64, dtype=dtype), torch.randn(4, 3, 128, 64, dtype=dtype)
        one = _median_ms(lambda: F.scaled_dot_product_attention(q[:1], k[:1], v[:1], is_causal=True, enable_gqa=True))
        four = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        print(f"causal SDPA, 128 tokens, 9 query / 3 KV heads: one prompt {one:.3f} ms, four in one call {four:.3f} ms")


def step_budget(budgets: list[int]) -> None:
    """One in-process burst of 64 at each step token budget."""
    from backfill.bench.concurrency_burst import BurstShape, run_bursts
    from backfill.bench.inprocess_target import InProcessTarget
    from backfill.policy.planner import BatchLimits
    from backfill.serving.build import build_engine
    from backfill.serving.config import ServingConfig

    for budget in budgets:
        engine = build_engine(ServingConfig(dtype="bfloat16", compile_decode=True,
                                            limits=BatchLimits(max_batch_tokens=budget, prefill_chunk_tokens=budget)))
        engine.wait_until_warm()

        async def go():
            await engine.start()
            try:
                return await run_bursts(InProcessTarget(engine), engine.tokenizer, (64,), BurstShape(bursts=1))
            finally:
                await engine.stop()

        (level,) = asyncio.run(go())
        print(f"budget {budget} tokens a step: {level.tokens_per_s:.1f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parts = parser.add_subparsers(dest="part", required=True)
    parts.add_parser("step-breakdown").add_argument("--batch", type=int, default=64)
    parts.add_parser("attention-prefetch-ab")
    parts.add_parser("elementwise")
    parts.add_parser("step-budget").add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    args = parser.parse_args()
    if args.part == "step-breakdown":
        step_breakdown(args.batch)
    elif args.part == "attention-prefetch-ab":
        attention_prefetch_ab()
    elif args.part == "elementwise":
        elementwise()
    else:
        step_budget(args.budgets)


if __name__ == "__main__":
    main()
