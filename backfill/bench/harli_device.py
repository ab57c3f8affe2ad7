"""HARLI on a partitioned device, one short check: decode at its QoS with finetuning beside it,
on compute partitions (green contexts on a GPU, cores on a CPU) against pause-only.

    python -m backfill.bench.harli_device --out DIR [--device cuda] [--shape llama3.2-3b]

Random weights of a registered shape (engine/shapes.py), made on the device; synthetic token ids
for decode and the byte tokenizer for the training file, so nothing needs the model's tokenizer.
The online load is a duty cycle: in each period decode runs a batch for `busy` of it and the
device is idle for the rest (an online load with gaps, as HARLI's §8 traces have). Three runs of
the same cycle:
  solo         decode alone: its P99 step sets the QoS target (--target-x-solo times it)
  pause-only   finetuning on the whole device while decode is idle, paused while it runs
  partitioned  HARLI §6.2 (policy/harli_sm.py) over the partitions' realisable splits, re-planned
               every decode step, with the two-stage predictor profiled on those partitions first
Reported: finetuning samples/s (and tokens/s), decode P99 step against the target, the
partition path. Every sub-part catches its own errors and records them; summary.json is written
after each row. Needs none of the server's dependencies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from backfill.bench.device_summary import PartSummary

PART = "harli-reef"


def build_runner(shape: str, device: str, dtype: torch.dtype, kv_gb: float):
    from backfill.engine.kv_pool import KVBlockPool
    from backfill.engine.runner import ModelRunner
    from backfill.serving.build import build_eager_model
    from backfill.engine.shapes import shape_config
    from backfill.engine.weights import expected_weight_shapes

    config = shape_config(shape)
    g = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, dims in expected_weight_shapes(config).items():
        if len(dims) == 1 and not name.endswith(".bias"):
            weights[name] = torch.ones(dims, dtype=dtype, device=device)
        else:  # made on the device: a 3B model's weights take seconds there, minutes on a host CPU
            weights[name] = torch.randn(dims, generator=g, dtype=dtype, device=device) * 0.02
    model = build_eager_model(config, weights, str(dtype).removeprefix("torch."), device)
    del weights
    kv = KVBlockPool.for_memory(config, int(kv_gb * 2**30), 16, model.dtype, device)
    return ModelRunner(model, kv)


class SyntheticFinetune:
    """Stand-in when the LoRA job cannot run on this device: a LoRA-sized training unit of GEMMs
    (forward and the two backward products of one projection at the job's token count)."""

    def __init__(self, hidden: int, tokens: int, device: str, dtype: torch.dtype, gemms: int = 8) -> None:
        self.x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        self.w = torch.randn(hidden, hidden, device=device, dtype=dtype) * 0.02
        self.gemms = gemms
        self.units = 0
        self.units_per_step = 8
        self.batch_size = 1

    def run_unit(self) -> bool:
        for _ in range(self.gemms):
            y = self.x @ self.w
            self.x.t() @ y  # weight gradient
            y @ self.w.t()  # input gradient
        self.units += 1
        return True

    @property
    def progress_steps(self) -> float:
        return self.units / self.units_per_step

    def next_unit_estimate_ms(self, default_ms: float = 10.0) -> float:
        return default_ms


def make_job(runner, device: str, dtype: torch.dtype, tmp: Path, summary: PartSummary):
    """The LoRA job (finetune/job.py) on this model; the synthetic stand-in, said plainly, if it fails."""
    from backfill.engine.byte_tokenizer import ByteTokenizer
    from backfill.finetune.config import FinetuneConfig
    from backfill.finetune.job import FinetuneJob
    from backfill.finetune.profile import synthetic_training_file

    try:
        tokenizer = ByteTokenizer()
        data = synthetic_training_file(tmp / "train.jsonl", tokenizer, num=64)
        config = FinetuneConfig(rank=8, batch_size=4, micro_batch_size=2, max_seq_len=512, max_steps=100_000,
                                checkpoint_every_steps=100_000)
        job = FinetuneJob(runner.model, tokenizer, data, config, tmp / "job")
        while job.steps_done == 0:  # one whole step: every unit kind runs (and is timed) once
            if not job.run_unit():
                raise RuntimeError("the job finished before its first step")
        _sync(device)
        return job, config.batch_size, "LoRA job (finetune/job.py, rank 8, batch 4 x 512 tokens)"
    except Exception as exc:
        cfg = runner.model.config
        summary.skip(f"LoRA job on {device}: {type(exc).__name__}: {exc}; finetuning is a synthetic GEMM stand-in")
        return SyntheticFinetune(cfg.hidden_size, 2048, device, dtype), 1, "synthetic GEMM units (LoRA job failed)"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.current_stream().synchronize()  # this thread's stream only: never the other partition's


class DutyCycle:
    """Decode batches at a context for `busy` of each period, idle for the rest."""

    def __init__(self, runner, batch: int, context: int, period_s: float, busy: float, device: str) -> None:
        from backfill.engine.runner import SeqChunk

        self.runner, self.device = runner, device
        self.period_s, self.busy = period_s, busy
        self.batch, self.context = batch, context
        self.max_steps = 512  # positions wrap after this many steps: the KV a run needs stays bounded
        kv = runner.kv
        self.tables = [kv.allocate(kv.blocks_needed(context + self.max_steps + 1)) for _ in range(batch)]
        self.chunk = lambda step: [SeqChunk(f"d{i}", [5 + i], context + step % self.max_steps, t, want_logits=True)
                                   for i, t in enumerate(self.tables)]

    def close(self) -> None:
        for t in self.tables:
            self.runner.kv.free(t)

    def run(self, seconds: float, on_step) -> list[float]:
        """Decode steps (ms) over `seconds` of the cycle; on_step(decoding: bool, step) before each
        step and at each idle tick (every 5 ms)."""
        steps: list[float] = []
        t0 = time.perf_counter()
        k = 0
        while (now := time.perf_counter()) - t0 < seconds:
            decoding = ((now - t0) % self.period_s) < self.busy * self.period_s
            on_step(decoding, k)
            if not decoding:
                time.sleep(0.005)
                continue
            start = time.perf_counter()
            self.runner.execute(self.chunk(k))
            _sync(self.device)
            steps.append((time.perf_counter() - start) * 1e3)
            k += 1
        return steps


def p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


class FinetuneThread:
    """The job's units on a thread of their own, in the finetuning partition, at the share the
    plan last gave (0: paused; a unit in flight finishes where it started)."""

    def __init__(self, job, partitions) -> None:
        self.job, self.partitions = job, partitions
        self.share = 0.0
        self.units = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="finetune", daemon=True)
        self._thread.start()

    def set_share(self, share: float) -> None:
        with self._cond:
            self.share = share
            self._cond.notify_all()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    while self.share <= 0 and not self._stop.is_set():
                        self._cond.wait(timeout=0.05)
                if self._stop.is_set():
                    return
                self.partitions.enter("finetune")
                try:
                    self.job.run_unit()
                finally:
                    self.partitions.leave("finetune")
                # The next unit may run on another partition's stream: this one's work ends first.
                if torch.cuda.is_available() and getattr(self.partitions, "form", "") == "green-context":
                    torch.cuda.current_stream().synchronize()
                self.units += 1
        except BaseException as exc:  # reported by the run, which keeps going
            self.error = exc

    def stop(self, device: str) -> None:
        self._stop.set()
        self.set_share(0.0)
        self._thread.join(timeout=120)
        if device.startswith("cuda"):
            torch.cuda.synchronize()


def run_mode(mode: str, cycle: DutyCycle, job, partitions, policy, target_ms: float, seconds: float,
             device: str) -> dict:
    from backfill.policy.harli import ColoState

    ft = FinetuneThread(job, partitions) if policy is not None else None
    splits: dict[str, int] = {}
    started_progress = job.progress_steps

    def on_step(decoding: bool, step: int) -> None:
        if ft is None:
            return
        state = ColoState(time.monotonic(), cycle.batch if decoding else 0, 0, float(cycle.context + step % cycle.max_steps),
                          target_ms, True, job.next_unit_estimate_ms())
        plan = policy.plan(state)
        split = partitions.apply(plan.share_infer, plan.share_ft)
        key = f"{split.share_infer:.2f}/{split.share_ft:.2f}"
        splits[key] = splits.get(key, 0) + 1
        partitions.enter("decode")
        ft.set_share(split.share_ft)

    start = time.perf_counter()
    try:
        steps = cycle.run(seconds, on_step)
    finally:
        if ft is not None:
            ft.stop(device)
        partitions.apply(1.0, 0.0)
        partitions.enter("decode")
    elapsed = time.perf_counter() - start
    out = {"mode": mode, "decode_steps": len(steps), "p50_step_ms": statistics.median(steps) if steps else None,
           "p99_step_ms": p99(steps), "elapsed_s": elapsed, "splits": splits,
           "finetune_steps": job.progress_steps - started_progress}
    if ft is not None and ft.error is not None:
        out["finetune_error"] = f"{type(ft.error).__name__}: {ft.error}"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for harli_device.json and summary.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama3.2-3b")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--seconds", type=float, default=10.0, help="per measured run")
    p.add_argument("--period-s", type=float, default=1.0)
    p.add_argument("--busy", type=float, default=0.6, help="share of each period decode runs")
    p.add_argument("--target-x-solo", type=float, default=1.5)
    p.add_argument("--kv-gb", type=float, default=8.0)
    p.add_argument("--dry-run", action="store_true", help="say what would run, run nothing")
    args = p.parse_args(argv)
    what = (f"HARLI on {args.device}: {args.shape} random weights, decode batch {args.batch} at context "
            f"{args.context}, busy {args.busy:.0%} of each {args.period_s:g} s; solo, pause-only, partitioned "
            f"runs of {args.seconds:g} s")
    if args.dry_run:
        print(what)
        return 0
    print(what, flush=True)
    summary = PartSummary(args.out, PART)
    result: dict = {"args": vars(args)}
    out_json = Path(args.out) / "harli_device.json"

    def save() -> None:
        out_json.write_text(json.dumps(result, indent=1, default=str) + "\n")

    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        from backfill.engine.partitions import make_partitions
        from backfill.finetune.profile import profile_partitions
        from backfill.policy.harli_sm import HarliSmPolicy, PauseOnlySmPolicy

        t = time.perf_counter()
        runner = build_runner(args.shape, device, dtype, args.kv_gb)
        result["build_s"] = time.perf_counter() - t
        partitions = make_partitions(device)
        result["partitions"] = {"form": partitions.form, "path": getattr(partitions, "path", ""),
                                "ft_shares": list(partitions.ft_shares()),
                                "errors": getattr(partitions, "errors", [])}
        summary.row("HARLI partition path", f"{partitions.form} {getattr(partitions, 'path', '')}".strip(),
                    "green contexts (driver API: disjoint SM partitions)",
                    f"{len(partitions.ft_shares())} finetuning shares realisable")
        if partitions.form == "time-sliced":
            summary.skip(f"HARLI partitions: none on {device} ({getattr(partitions, 'reason', '')}); "
                         "partitioned = time-sliced")
        with tempfile.TemporaryDirectory() as tmp:
            job, samples_per_step, job_kind = make_job(runner, device, dtype, Path(tmp), summary)
            result["finetune"] = job_kind
            cycle = DutyCycle(runner, args.batch, args.context, args.period_s, args.busy, device)
            try:
                cycle.run(0.5, lambda *_: None)  # warm-up (allocator, kernels)
                solo = run_mode("solo", cycle, job, partitions, None, 0.0, args.seconds / 2, device)
                target = args.target_x_solo * solo["p99_step_ms"]
                result["solo"], result["target_ms"] = solo, target
                save()
                summary.row("HARLI decode solo P99 step", f"{solo['p99_step_ms']:.2f} ms",
                            f"QoS target {target:.2f} ms ({args.target_x_solo}x solo)",
                            f"{args.shape}, batch {args.batch}, context {args.context}")
                rows = {}
                for mode in ("pause-only", "partitioned"):
                    try:
                        if mode == "pause-only":
                            policy = PauseOnlySmPolicy()
                        else:
                            lat = profile_partitions(runner, job, partitions, repeats=3, passes=1,
                                                     batches=(args.batch,), seqlens=(args.context,),
                                                     model_name=args.shape, log=lambda m: print(m, flush=True))
                            result["predictor"] = {"b1": lat.b1, "k1": lat.k1, "errors": lat.errors}
                            policy = HarliSmPolicy(lat, ft_shares=partitions.ft_shares())
                        r = run_mode(mode, cycle, job, partitions, policy, target, args.seconds, device)
                        r["samples_per_s"] = r["finetune_steps"] * samples_per_step / r["elapsed_s"]
                        rows[mode] = result[mode] = r
                        save()
                        met = "met" if r["p99_step_ms"] <= target else "MISSED"
                        summary.row(f"HARLI {mode}: finetuning samples/s", f"{r['samples_per_s']:.2f}",
                                    f"decode P99 {r['p99_step_ms']:.2f} ms vs target {target:.2f} ms: {met}",
                                    f"{job_kind}; splits {r['splits']}" + (f"; error {r['finetune_error']}"
                                                                            if "finetune_error" in r else ""))
                    except Exception as exc:
                        result[f"{mode}_error"] = traceback.format_exc()
                        summary.skip(f"HARLI {mode}: {type(exc).__name__}: {exc}")
                        save()
                if all(m in rows and rows[m]["samples_per_s"] > 0 for m in ("pause-only", "partitioned")):
                    ratio = rows["partitioned"]["samples_per_s"] / rows["pause-only"]["samples_per_s"]
                    result["partitioned_x_pause_only"] = ratio
                    summary.row("HARLI partitioned / pause-only finetuning", f"{ratio:.2f}x", "target >= 1.3x",
                                "decode QoS " + ("met" if rows["partitioned"]["p99_step_ms"] <= target else "MISSED"))
            finally:
                cycle.close()
            partitions.close()
    except Exception as exc:
        result["error"] = traceback.format_exc()
        summary.skip(f"HARLI on {device}: {type(exc).__name__}: {exc}")
    save()
    print(f"wrote {out_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
