"""Fits HARLI's two-stage latency predictor (§5) on the real engine, time-sliced on this CPU.

Stage 1 (solo): batches of bs sequences at context seqlen decode back to back; with a share
s_infer < 1 each step is followed by idle time so decode holds s_infer of the token interval.
Stage 2 (co-located): each decode step is followed by n finetuning units of a real job instead,
so the split is what n units realise (share_ft = their time / the interval). Each grid point is
the median of `repeats` token intervals, taken in a few passes over the grid. Held-out points (other
batch sizes, contexts and unit counts) measure the error on co-located steps the fit never saw.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backfill.engine.runner import ModelRunner, SeqChunk
from backfill.finetune.config import FinetuneConfig
from backfill.finetune.job import FinetuneJob
from backfill.policy.harli import HarliLatencyModel

SHARES = (1.0, 0.8, 0.6, 0.4)      # stage-1 compute shares (time slices)
BATCHES = (1, 2, 4)                # three batch sizes suffice (HARLI §5.1)
SEQLENS = (32, 256, 512)
UNITS = (1, 2, 3)                  # finetuning units per token interval (stage 2)
WARMUP_INTERVALS = 2               # untimed intervals before each run of a point, of its own shape
PASSES = 3                         # passes through the grid the repeats are spread over
HELD_OUT = ((3, 128, 1), (3, 384, 2), (2, 384, 3), (4, 128, 2), (1, 384, 2), (3, 32, 3))


@dataclass
class ProfileResult:
    latency: HarliLatencyModel
    solo_points: list[tuple[float, float, float, float]]
    colo_points: list[tuple[float, float, float, float, float]]
    held_out: list[tuple[float, float, float, float, float]]
    decode_ms: float               # a lone decode step at bs 1, seqlen 32 (for sizing units)
    unit_ms: dict[str, float]      # median duration of each kind of finetuning piece


def synthetic_training_file(path: Path, tokenizer, num: int = 32, words: int = 60, seed: int = 0) -> Path:
    """Chat examples of pseudo-random words (profiling needs realistic lengths, not meaning)."""
    g = torch.Generator().manual_seed(seed)
    vocab = ["data", "model", "train", "token", "layer", "river", "stone", "light", "green", "seven",
             "music", "paper", "north", "cloud", "bread", "glass"]
    lines = []
    for i in range(num):
        pick = lambda n: " ".join(vocab[int(j)] for j in torch.randint(len(vocab), (n,), generator=g))  # noqa: E731
        lines.append(json.dumps({"messages": [{"role": "user", "content": pick(words // 3)},
                                              {"role": "assistant", "content": pick(words)}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


class _Bench:
    def __init__(self, runner: ModelRunner, job: FinetuneJob, repeats: int) -> None:
        self.runner, self.job, self.repeats = runner, job, repeats

    def _decode(self, batch: int, seqlen: int):
        kv = self.runner.kv
        tables = [kv.allocate(kv.blocks_needed(seqlen + 1)) for _ in range(batch)]
        chunks = [SeqChunk(f"p{i}", [5], seqlen, t, want_logits=True) for i, t in enumerate(tables)]
        return chunks, tables

    def intervals(self, batch: int, seqlen: int, share_infer: float, units: int, count: int) -> list[tuple[float, float]]:
        """`count` token intervals (ms) with the finetuning share of each, after WARMUP_INTERVALS
        untimed ones of the same shape (so the first timed one follows the same pattern)."""
        chunks, tables = self._decode(batch, seqlen)
        try:
            measured = []
            for _ in range(WARMUP_INTERVALS + count):
                start = time.perf_counter()
                step_s = self.runner.execute(chunks).duration_s
                ft_s = 0.0
                if units:
                    t = time.perf_counter()
                    for _ in range(units):
                        if not self.job.run_unit():
                            raise RuntimeError("the profiling job ran out of steps")
                    ft_s = time.perf_counter() - t
                elif share_infer < 1.0:
                    time.sleep(step_s * (1 - share_infer) / share_infer)
                total = time.perf_counter() - start
                measured.append((total * 1e3, ft_s / total))
            return measured[WARMUP_INTERVALS:]
        finally:
            for t in tables:
                self.runner.kv.free(t)

    def points(self, specs: list[tuple[int, int, float, int]]) -> list[tuple[float, float]]:
        """For each (bs, seqlen, share_infer, units): the median interval and the finetuning share of
        that same interval (medians taken apart would pair a long unit's interval with a short
        unit's share). The repeats are spread over PASSES passes through all the specs, so a
        disturbance lasting a second or two hits one pass of a few points, not all repeats of one."""
        measured: list[list[tuple[float, float]]] = [[] for _ in specs]
        per_pass = -(-self.repeats // PASSES)
        for _ in range(PASSES):
            for i, (bs, seq, share, units) in enumerate(specs):
                measured[i] += self.intervals(bs, seq, share, units, per_pass)
        return [sorted(m)[len(m) // 2] for m in measured]


def profile_finetune(runner: ModelRunner, tokenizer, *, repeats: int = 11, model_name: str = "",
                     config: FinetuneConfig | None = None, log=print) -> ProfileResult:
    config = config or FinetuneConfig(batch_size=4, micro_batch_size=1, max_seq_len=128, max_steps=10_000,
                                      checkpoint_every_steps=10_000)
    with tempfile.TemporaryDirectory() as tmp:
        data = synthetic_training_file(Path(tmp) / "profile.jsonl", tokenizer)
        job = FinetuneJob(runner.model, tokenizer, data, config, Path(tmp) / "job")
        while job.steps_done == 0:  # one step through: every piece kind timed
            job.run_unit()
        bench = _Bench(runner, job, repeats)
        specs = [(bs, seq, share, 0) for share in SHARES for bs in BATCHES for seq in SEQLENS]
        solo = [(share, bs, seq, ms) for (bs, seq, share, _), (ms, _) in zip(specs, bench.points(specs))]
        log(f"stage 1: {len(solo)} solo points")
        latency = HarliLatencyModel(HarliLatencyModel.fit_solo(solo), model_name=model_name,
                                    device=runner.device.type)
        specs = [(bs, seq, 1.0, n) for bs in BATCHES for seq in SEQLENS for n in UNITS]
        colo = [(bs, seq, 1 - s_ft, s_ft, ms) for (bs, seq, _, _), (ms, s_ft) in zip(specs, bench.points(specs))]
        log(f"stage 2: {len(colo)} co-located points")
        latency.fit_colo(colo)
        specs = [(bs, seq, 1.0, n) for bs, seq, n in HELD_OUT]
        held = [(bs, seq, 1 - s_ft, s_ft, ms) for (bs, seq, _, _), (ms, s_ft) in zip(specs, bench.points(specs))]
        decode_ms = bench.points([(1, 32, 1.0, 0)])[0][0]
        unit_ms = {k: statistics.median(v) for k, v in job.piece_ms.items() if v}
    # Each stage is judged by its own prediction (HARLI §8.4): stage 1 on the solo points, stage 2
    # on the co-located ones; the grid is both together.
    solo_err, colo_err = latency.solo_errors(solo), latency.relative_errors(colo)
    grid_errs = [abs(latency.solo_ms(bs, seq, share) - ms) / ms for share, bs, seq, ms in solo] + \
                [abs(latency.colo_ms(*p[:4]) - p[4]) / p[4] for p in colo]
    latency.errors = {"grid": {"mean": sum(grid_errs) / len(grid_errs), "max": max(grid_errs), "points": len(grid_errs)},
                      "solo": solo_err, "colo": colo_err, "held_out": latency.relative_errors(held)}
    latency.unit_ms = unit_ms
    return ProfileResult(latency, solo, colo, held, decode_ms, unit_ms)
