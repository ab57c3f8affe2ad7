"""A decode step of many sequences on the runner alone, against what the machine can read.

Builds the default model as `backfill serve` runs it (bf16 where the CPU has bf16 kernels,
compiled steps), maps block tables for --sequences sequences (each a shared prefix of
--shared-tokens, then --own-tokens of its own), times --steps decode steps, and reads 1 GiB of
memory with torch on one and on every thread: the step's bytes (weights and the KV it reads) over
that rate is its memory floor. About a minute (the model build and compiled buckets first).
With --prompt-tokens P it times prompt steps instead: --sequences prompts of P distinct tokens
each, prefilled together in one step (the rows a burst's prompts make), and their tok/s; with
--compare-row-padding as well, in turns padded to the kernel choice's row multiple and not.

    python scripts/decode_step.py --sequences 64 --shared-tokens 0 --own-tokens 100 --json step.json
    python scripts/decode_step.py --sequences 8 --prompt-tokens 128 --json prompt-step.json
    python scripts/decode_step.py --sequences 8 --prompt-tokens 79 --compare-row-padding --json padding.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from backfill.engine.step import SeqChunk
from backfill.engine.weights import load_model
from backfill.progress import Heartbeat
from backfill.serving.build import build_runner
from backfill.serving.config import ServingConfig


def read_gb_s(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Streaming read rate: a float32 sum over gib GiB, the best of repeats."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_prompt_steps(runner, args, threads: int) -> int:
    """Steps that prefill --sequences prompts of --prompt-tokens tokens from position 0."""
    kv, n, length = runner.kv, args.sequences, args.prompt_tokens

    def step(k: int) -> float:
        tables = [list(kv.allocate(kv.blocks_needed(length))) for _ in range(n)]
        chunks = [SeqChunk(i, [3 + (k * 7919 + i * 104729 + t) % 40000 for t in range(length)], 0, table)
                  for i, table in enumerate(tables)]
        elapsed = _timed(lambda: runner.execute(chunks))
        for table in tables:
            kv.free(table)
        return elapsed * 1e3

    if args.compare_row_padding:
        fast, rows = runner.model.compiled_decode, n * length
        if fast is None or fast.large is None or fast.large_step_rows(rows) == rows:
            print(f"{rows} rows run unpadded here (no compiled large steps, or the kernel choice pads nothing "
                  f"at this count): nothing to compare")
            return 1
        return compare_row_padding(runner, args, threads, step)
    for k in range(2):
        step(k)
    times_ms = []
    for k in range(2, 2 + args.steps):
        times_ms.append(step(k))
        print(f"  step {k - 1}/{args.steps}: {times_ms[-1]:.1f} ms", flush=True)  # a line a step: seconds each
    median = statistics.median(times_ms)
    print(f"{n} prompts of {length} tokens in one step ({n * length} rows), {threads} threads: median step "
          f"{median:.1f} ms of {args.steps}, {n * length / median * 1e3:.0f} prompt tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "threads": threads, "step_ms": times_ms, "median_step_ms": median,
                       "prompt_tokens_per_s": n * length / median * 1e3}, f, indent=1)
    return 0


def compare_row_padding(runner, args, threads: int, step_fn) -> int:
    """Prompt steps in turns, padded to the kernel choice's row multiple and at their own rows."""
    fast, rows = runner.model.compiled_decode, args.sequences * args.prompt_tokens
    padded_to = fast.large_step_rows(rows)
    times: dict[str, list[float]] = {"own rows": [], "padded": []}
    for k in range(2):
        step_fn(k)
    for k in range(2 * args.steps):
        mode = "padded" if k % 2 else "own rows"
        fast.set_large_step_padding(mode == "padded")
        times[mode].append(step_fn(k + 2))
        print(f"  step {k + 1}/{2 * args.steps} ({mode}): {times[mode][-1]:.1f} ms", flush=True)  # seconds each
    fast.set_large_step_padding(True)
    medians = {mode: statistics.median(ts) for mode, ts in times.items()}
    ratios = sorted(a / b for a, b in zip(times["own rows"], times["padded"]))
    print(f"{rows} rows in one step, {threads} threads, in turns: at their own rows {medians['own rows']:.1f} ms, "
          f"padded to {padded_to} {medians['padded']:.1f} ms (medians of {args.steps}); paired ratio "
          f"{ratios[len(ratios) // 2]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "threads": threads, "rows": rows, "padded_rows": padded_to,
                       "step_ms": times, "median_step_ms": medians,
                       "paired_ratio_median": ratios[len(ratios) // 2]}, f, indent=1)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--shared-tokens", type=int, default=0, help="a prefix every table maps (whole blocks)")
    p.add_argument("--own-tokens", type=int, default=100, help="each sequence's context after it (plus 0-58)")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: every core")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--prompt-tokens", type=int, default=0, help="time prompt steps of this many tokens a sequence")
    p.add_argument("--compare-row-padding", action="store_true",
                   help="with --prompt-tokens: steps in turns padded to the kernel choice's row multiple and not")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    cores = torch.get_num_threads()
    threads = args.threads or cores
    if args.prompt_tokens:
        print(f"building the model (about a minute), then {args.steps + 2} prompt steps", flush=True)
    else:
        print(f"reading 1 GiB on 1 and {cores} threads, then building the model (about a minute)", flush=True)
    rates = {} if args.prompt_tokens else {1: read_gb_s(1), cores: read_gb_s(cores)}
    torch.set_num_threads(threads)
    with Heartbeat(lambda line: print(line, flush=True), "building the model and its compiled steps"):
        loaded = load_model()
        cfg = ServingConfig(dtype="auto", compile_decode=True, threads=threads)
        runner = build_runner(loaded.config, loaded.weights, cfg)
        runner.wait_until_warm()
    kv = runner.kv
    if args.prompt_tokens:
        return time_prompt_steps(runner, args, threads)
    shared = kv.allocate(args.shared_tokens // kv.block_size) if args.shared_tokens else []
    longest = args.shared_tokens + args.own_tokens + 60
    tables = [list(shared) + list(kv.allocate(kv.blocks_needed(longest) - len(shared))) for _ in range(args.sequences)]

    def step(k: int) -> list[SeqChunk]:  # contexts spread over 30 tokens, as a batch's are, and held there
        base = args.shared_tokens + args.own_tokens + k % 30
        return [SeqChunk(i, [5], base + i % 30, t) for i, t in enumerate(tables)]

    for k in range(3):
        runner.execute(step(k))
    times_ms = []
    for k in range(args.steps):
        times_ms.append(_timed(lambda: runner.execute(step(k))) * 1e3)
        if k % 10 == 9:
            print(f"  {k + 1}/{args.steps} steps", flush=True)
    cfg_model = loaded.config
    kv_token_bytes = 2 * cfg_model.num_layers * cfg_model.num_kv_heads * cfg_model.head_dim * kv.k[0].element_size()
    context = args.shared_tokens + args.own_tokens + 30  # on average
    kv_bytes = kv_token_bytes * (args.shared_tokens + args.sequences * (context - args.shared_tokens))
    step_bytes = runner.model.weight_bytes + kv_bytes
    median = statistics.median(times_ms)
    floor_ms = step_bytes / (rates[cores] * 1e9) * 1e3
    print(f"{args.sequences} sequences, {args.shared_tokens} shared + {args.own_tokens}-{args.own_tokens + 58} own "
          f"tokens, {threads} threads: median step {median:.1f} ms of {args.steps}")
    print(f"memory read: {rates[1]:.1f} GB/s on 1 thread, {rates[cores]:.1f} GB/s on {cores}; the step reads "
          f"{step_bytes / 1e6:.0f} MB (weights {runner.model.weight_bytes / 1e6:.0f}, KV {kv_bytes / 1e6:.0f}): "
          f"floor {floor_ms:.1f} ms, step / floor {median / floor_ms:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "threads": threads, "dtype": str(cfg.torch_dtype),
                       "step_ms": times_ms, "median_step_ms": median, "read_gb_s": rates,
                       "step_bytes": step_bytes, "weight_bytes": runner.model.weight_bytes, "kv_bytes": kv_bytes,
                       "floor_ms": floor_ms}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
