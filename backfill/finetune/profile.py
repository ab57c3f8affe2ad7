"""Fits HARLI's two-stage latency predictor (§5) on the real engine, time-sliced on this CPU.

Stage 1 (solo): batches of bs sequences at context seqlen decode back to back; with a share
s_infer < 1 each step is followed by idle time so decode holds s_infer of the token interval.
Stage 2 (co-located): each decode step is followed by n finetuning units of a real job instead,
so the split is what n units realise (share_ft = their time / the interval). Each grid point is
the median of a few token intervals (a shared machine only adds noise). Held-out points (other
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

    def interval(self, batch: int, seqlen: int, share_infer: float = 1.0, units: int = 0) -> tuple[float, float]:
        """Median token interval (ms) and median finetuning share of it."""
        chunks, tables = self._decode(batch, seqlen)
        try:
            self.runner.execute(chunks)  # warm-up
            intervals, shares = [], []
            for _ in range(self.repeats):
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
                intervals.append(total * 1e3)
                shares.append(ft_s / total)
            return statistics.median(intervals), statistics.median(shares)
        finally:
            for t in tables:
                self.runner.kv.free(t)


def profile_finetune(runner: ModelRunner, tokenizer, *, repeats: int = 7, model_name: str = "",
                     config: FinetuneConfig | None = None, log=print) -> ProfileResult:
    config = config or FinetuneConfig(batch_size=4, micro_batch_size=1, max_seq_len=128, max_steps=10_000,
                                      checkpoint_every_steps=10_000)
    with tempfile.TemporaryDirectory() as tmp:
        data = synthetic_training_file(Path(tmp) / "profile.jsonl", tokenizer)
        job = FinetuneJob(runner.model, tokenizer, data, config, Path(tmp) / "job")
        for _ in range(2 * runner.config.num_layers + 2):  # one micro-batch through: every piece kind timed
            job.run_unit()
        bench = _Bench(runner, job, repeats)
        solo = []
        for share in SHARES:
            for bs in BATCHES:
                for seq in SEQLENS:
                    solo.append((share, bs, seq, bench.interval(bs, seq, share)[0]))
        log(f"stage 1: {len(solo)} solo points")
        latency = HarliLatencyModel(HarliLatencyModel.fit_solo(solo), model_name=model_name,
                                    device=runner.device.type)
        colo = []
        for bs in BATCHES:
            for seq in SEQLENS:
                for n in UNITS:
                    ms, s_ft = bench.interval(bs, seq, units=n)
                    colo.append((bs, seq, 1 - s_ft, s_ft, ms))
        log(f"stage 2: {len(colo)} co-located points")
        latency.fit_colo(colo)
        held = []
        for bs, seq, n in HELD_OUT:
            ms, s_ft = bench.interval(bs, seq, units=n)
            held.append((bs, seq, 1 - s_ft, s_ft, ms))
        decode_ms = bench.interval(1, 32)[0]
        unit_ms = {k: statistics.median(v) for k, v in job.piece_ms.items() if v}
    grid = [(bs, seq, share, 0.0, ms) for share, bs, seq, ms in solo] + colo
    latency.errors = {"grid": latency.relative_errors(grid), "solo": latency.relative_errors(grid[:len(solo)]),
                      "colo": latency.relative_errors(colo), "held_out": latency.relative_errors(held)}
    latency.unit_ms = unit_ms
    return ProfileResult(latency, solo, colo, held, decode_ms, unit_ms)
