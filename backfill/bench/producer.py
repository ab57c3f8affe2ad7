"""A producer engine process (AQUA §4, §6): serves its own steady closed-loop load and lends a
shared-memory segment through the coordinator. It prints cumulative counters as JSON lines
({"t": monotonic s, "tokens": n, "steps": n, "run_s": s, "wait_s": s}) so a benchmark can measure
its throughput, with and without consumers paging into its memory, and tell where it loses:
run_s is the engine thread's time on a core, wait_s its time runnable but waiting for one
(something else ran on its core).

Run: python -m backfill.bench.producer --coordinator URL --lend-mb 512 [--tiny]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

import torch


def thread_schedstat() -> tuple[float, float]:
    """The calling thread's seconds on a core and runnable but waiting for one (Linux
    schedstat); zeros where the kernel does not provide it."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", default=None, help="offload coordinator URL (none: lend nothing)")
    p.add_argument("--lend-mb", type=float, default=256.0)
    p.add_argument("--concurrency", type=int, default=4, help="requests it keeps running (its steady load)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="a tiny random model instead of the default model")
    p.add_argument("--report-every-s", type=float, default=0.5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from backfill.policy.checkpoint import CheckpointConfig
    from backfill.sampling_params import SamplingParams
    from backfill.serving.build import build_serving_stack
    from backfill.serving.config import ServingConfig
    from backfill.types import GenerationRequest, RequestClass

    if args.tiny:
        from backfill.engine.config import ModelConfig
        from backfill.engine.weights import random_model

        config = ModelConfig.tiny()
        weights = random_model(config)
    else:
        from backfill.engine.weights import load_model

        loaded = load_model(None)
        config, weights = loaded.config, loaded.weights
    tokens_per_request = args.prompt_tokens + args.output_tokens
    # The plain eager float32 model on CPU under FCFS: a steady producer, not a tuned server.
    serving = ServingConfig(device="cpu", policy="fcfs", block_size=16, max_model_len=config.max_position_embeddings,
                            compile_decode=False, decode_attention="sdpa", prompt_attention="sdpa",
                            checkpoint=CheckpointConfig(enabled=False))
    stack = build_serving_stack(serving, config, weights,
                                num_kv_blocks=args.concurrency * (-(-tokens_per_request // 16) + 1))
    scheduler = stack.scheduler

    agent = None
    stop = threading.Event()
    if args.coordinator:
        from backfill.offload.client import CoordinatorClient, ProducerAgent

        agent = ProducerAgent(CoordinatorClient(args.coordinator), int(args.lend_mb * 2**20), ttl_s=10.0)

        def heartbeat() -> None:
            while not stop.wait(2.0):
                try:
                    agent.heartbeat()
                except Exception:  # noqa: BLE001 - the coordinator may come back
                    pass

        threading.Thread(target=heartbeat, daemon=True).start()

    def finish(*_args) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish)
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    next_id = 0

    def submit() -> None:
        nonlocal next_id
        prompt = [3 + (next_id * 7 + j * 5) % (config.vocab_size - 3) for j in range(args.prompt_tokens)]
        scheduler.add(GenerationRequest(prompt, params, RequestClass.ONLINE, request_id=f"p{next_id}"))
        next_id += 1

    for _ in range(args.concurrency):
        submit()
    print(json.dumps({"ready": True, "offer_id": agent.offer_id if agent else None,
                      "segment": agent.segment.path if agent else None}), flush=True)
    tokens, steps, last_report = 0, 0, 0.0
    try:
        while not stop.is_set():
            steps += 1
            for event in scheduler.step():
                tokens += len(event.token_ids)
                if event.finished:
                    submit()
            now = time.monotonic()
            if now - last_report >= args.report_every_s:
                run_s, wait_s = thread_schedstat()
                print(json.dumps({"t": now, "tokens": tokens, "steps": steps, "run_s": run_s, "wait_s": wait_s}),
                      flush=True)
                last_report = now
    finally:
        if agent is not None:
            agent.close()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
