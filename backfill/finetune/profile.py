"""Fits HARLI's two-stage latency predictor (§5) on the real engine, time-sliced on this CPU.

Stage 1 (solo): batches of bs sequences at context seqlen decode back to back; with a share
s_infer < 1 each step is followed by idle time so decode holds s_infer of the token interval.

Stage 2 (co-located): a token interval is n finetuning units of a real job and then the decode
step they delay, as the policy plans it. Its split is the one the policy computes before it runs
the units: share_ft = the units' time / (that time + the stage-1 decode step), not a share of the
measured interval (a decode step slowed by noise would lower its own share_ft, and the prediction
with it, the wrong way; on a GPU the SM share is likewise set before the step runs). A grid point
is (bs, seqlen, the kinds of its n units): the job's piece sequence is deterministic, so the
profiler walks through it and measures, at each position, a point whose kinds come next (a unit
of a kind no pending point needs is run untimed; a step whose remaining kinds none needs is
dropped), until every point has its intervals. Solo points are measured in the same walk, two
intervals at a time, so both stages see the same load.

Robust to outside load (a process that delays a wake-up or takes a core for a while): a point's
repeats are interleaved with every other point's (a burst hits a few repeats of many points, not
all of one); repeats further from the point's median than OUTLIER_MADS robust deviations are
rejected; a point whose kept repeats still disagree by more than its stage's stated spread is
measured again (up to REMEASURE_ROUNDS more rounds, pooled). A point is then its kept interval of
median length, with that interval's own finetuning time per kind. Held-out points (other batch
sizes, contexts and kind sequences, mixes included) measure the error on co-located intervals the
fit never saw.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk
from backfill.errors import LatencyProfileError
from backfill.finetune.config import FinetuneConfig
from backfill.finetune.job import FinetuneJob
from backfill.policy.harli import HarliLatencyModel

SHARES = (1.0, 0.8, 0.6, 0.4)      # stage-1 compute shares (time slices)
BATCHES = (1, 2, 4)                # three batch sizes suffice (HARLI §5.1)
SEQLENS = (32, 256, 512)
WARMUP_INTERVALS = 2               # untimed decode steps before each visit of a solo point, of its shape
PASSES = 6                         # visits a solo point's intervals are spread over (two intervals each)
OUTLIER_MADS = 3.0                 # a repeat further than this many robust deviations (1.4826 MAD) is rejected
OUTLIER_FLOOR = 0.02               # ... and never one within 2% of the point's median
# A point is measured again when its kept repeats' robust deviation exceeds this share of their
# median: a solo step repeats itself closely; a co-located interval's units differ step to step.
SOLO_SPREAD, COLO_SPREAD = 0.03, 0.08
REMEASURE_ROUNDS = 2
F, H, B, U = "forward", "head", "backward", "update"
# Stage 2: the kinds of the units in an interval. Layer pieces come 30 in a row, head slices two
# per micro-batch and the update once a step, so the rarer ones get fewer intervals (RARE_REPEATS).
KIND_SEQUENCES = ((F,), (F, F), (F, F, F), (B,), (B, B), (B, B, B), (H,), (U,))
RARE_REPEATS = {H: 7, U: 5}        # intervals of a point with these kinds (at most --repeats)
HELD_OUT = ((3, 128, (F, F)), (3, 384, (B, B)), (2, 384, (F, H)), (4, 128, (H, B)), (1, 384, (B, U)),
            (3, 32, (B, B, B)), (2, 128, (H, H)), (4, 384, (U, F)))
MAX_PIECES = 8_000                 # stop walking the job after this many pieces (a kind that never comes)


@dataclass
class ProfileResult:
    latency: HarliLatencyModel
    solo_points: list[tuple[float, float, float, float]]
    colo_points: list[tuple]        # (bs, seqlen, share_infer, share_ft, ms, {kind: ms})
    held_out: list[tuple]
    decode_ms: float               # a lone decode step at bs 1, seqlen 32 (for sizing units)
    unit_ms: dict[str, float]      # median duration of each kind of finetuning piece
    colo_samples: dict[str, list[float]]  # every interval (ms) measured for each stage-2 grid point
    solo_samples: dict[str, list[float]]  # every interval (ms) of each solo point, "share,bs,seqlen"
    remeasured: list[str]          # the points measured again for their spread, in the same keys
    rejected: int                  # repeats rejected as outliers, over all points


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


class _Walk:
    """Every interval of the profile, solo and co-located, measured in one walk along the job's
    own sequence of units, so a change of load during the profile reaches both stages alike.

    A spec is (bs, seqlen, share_infer, kinds). Solo (kinds empty): WARMUP_INTERVALS untimed
    decode steps, then a few timed intervals with decode at share_infer and the rest idle.
    Co-located (share_infer 1): the units of those kinds, then the decode step they delay; it can
    only be measured where the job's next units have those kinds (a unit is placed by the kind
    of its first piece; its time is split among the kinds of the pieces it ran)."""

    def __init__(self, runner: ModelRunner, job: FinetuneJob, log=None) -> None:
        self.model_runner, self.job, self.log = runner, job, log

    def measure(self, specs: list[tuple[int, int, float, tuple[str, ...]]], repeats: list[int]) -> list[list[tuple]]:
        job, kv = self.job, self.model_runner.kv
        decodes = {}
        for bs, seq, _, _ in specs:
            if (bs, seq) not in decodes:
                tables = [kv.allocate(kv.blocks_needed(seq + 1)) for _ in range(bs)]
                decodes[(bs, seq)] = [SeqChunk(f"p{i}", [5], seq, t, want_logits=True) for i, t in enumerate(tables)]
        measured: list[list[tuple]] = [[] for _ in specs]
        per_visit = -(-max(repeats, default=1) // PASSES)
        try:
            for chunks in decodes.values():  # untimed: each shape's first step
                self.model_runner.execute(chunks)
            left, order, pieces = list(repeats), 0, 0
            started = shown = time.perf_counter()
            total = sum(repeats)
            while any(left) and pieces < MAX_PIECES:
                now = time.perf_counter()
                if self.log is not None and now - shown >= PROGRESS_EVERY_S:  # minutes on a slow CPU
                    done = total - sum(left)
                    eta = f", about {(now - started) * (total - done) / done:.0f} s left" if done else ""
                    self.log(f"profiling: {done}/{total} intervals measured ({now - started:.0f} s{eta})")
                    shown = now
                upcoming = tuple(u[0][0] for u in job.next_units(3))
                # A solo spec fits anywhere; it is taken only while it is as far from done as the
                # co-located ones, so solo intervals spread over the walk as theirs do.
                behind = max((left[j] / repeats[j] for j, spec in enumerate(specs) if left[j] and spec[3]), default=0.0)
                fits = [i for i, (_, _, _, kinds) in enumerate(specs) if left[i] and upcoming[:len(kinds)] == kinds
                        and (kinds or left[i] / repeats[i] >= behind)]
                if not fits:
                    needed = {k for i, spec in enumerate(specs) if left[i] for k in spec[3]}
                    if job.step_in_flight and not needed & set(job.kinds_left_in_step()):
                        job.abandon_step()  # nothing left in this step is needed: start the next one
                    else:
                        job.run_unit()
                        pieces += 1
                    continue
                # The spec furthest from done, round-robin among equals, so each spec's intervals
                # spread over the whole walk (a disturbance hits a few of them, not all).
                order += 1
                i = max(fits, key=lambda j: (left[j] / repeats[j], -((j - order) % len(specs))))
                bs, seq, share, kinds = specs[i]
                if kinds:
                    measured[i].append(self._colo(decodes[(bs, seq)], len(kinds)))
                    left[i] -= 1
                    pieces += len(kinds)
                else:
                    count = min(left[i], per_visit)
                    measured[i] += self._solo(decodes[(bs, seq)], share, count)
                    left[i] -= count
        finally:
            for chunks in decodes.values():
                for c in chunks:
                    kv.free(c.block_table)
        return measured

    def _solo(self, chunks, share_infer: float, count: int) -> list[tuple[float, float, dict]]:
        out = []
        for n in range(WARMUP_INTERVALS + count):
            start = time.perf_counter()
            step_s = self.model_runner.execute(chunks).duration_s
            if share_infer < 1.0:
                time.sleep(step_s * (1 - share_infer) / share_infer)
            if n >= WARMUP_INTERVALS:
                out.append(((time.perf_counter() - start) * 1e3, 0.0, {}))
        return out

    def _colo(self, chunks, units: int) -> tuple[float, float, dict[str, float]]:
        """n units, then the decode step they delay: (interval ms, units' ms, {kind: ms})."""
        mix: dict[str, float] = {}
        start = time.perf_counter()
        for _ in range(units):
            if not self.job.run_unit():
                raise RuntimeError("the profiling job ran out of steps")
            for kind, ms in self.job.last_unit_pieces:
                mix[kind] = mix.get(kind, 0.0) + ms
        ft = time.perf_counter()
        self.model_runner.execute(chunks)
        return (time.perf_counter() - start) * 1e3, (ft - start) * 1e3, mix


def _median(samples: list[tuple]) -> tuple:
    """The sample of median interval, whole (medians taken apart would pair a long unit's
    interval with a short unit's time)."""
    return sorted(samples, key=lambda x: x[0])[len(samples) // 2]


def robust_repeats(samples: list[tuple]) -> list[tuple]:
    """A point's repeats (tuples, interval ms first) less outliers: those further from the median
    than OUTLIER_MADS robust deviations (1.4826 x the median absolute deviation) and OUTLIER_FLOOR
    of the median. A delayed wake-up or a burst of outside load lengthens a few repeats only."""
    if len(samples) < 3:
        return list(samples)
    median, deviation = _median_and_deviation(samples)
    limit = max(OUTLIER_MADS * deviation, OUTLIER_FLOOR * median)
    return [x for x in samples if abs(x[0] - median) <= limit]


def relative_spread(samples: list[tuple]) -> float:
    """The robust deviation (1.4826 MAD) of the repeats' intervals over their median."""
    if len(samples) < 2:
        return math.inf
    median, deviation = _median_and_deviation(samples)
    return deviation / median


def _median_and_deviation(samples: list[tuple]) -> tuple[float, float]:
    """The median of the repeats' intervals and their robust deviation (1.4826 x the median
    absolute deviation, the standard deviation's estimate for normal noise)."""
    ms = [x[0] for x in samples]
    median = statistics.median(ms)
    return median, 1.4826 * statistics.median(abs(m - median) for m in ms)


def point_of(samples: list[tuple]) -> tuple:
    """A point from its repeats: the kept repeat of median interval."""
    return _median(robust_repeats(samples))


PROGRESS_EVERY_S = 5.0


def measure_robustly(walk: "_Walk", specs: list[tuple], repeats: list[int]) -> tuple[list[list[tuple]], list[int]]:
    """Every spec's repeats, and the indices of those measured again: after the walk, a spec whose
    kept repeats spread more than its stage's limit gets its repeats once more (pooled), up to
    REMEASURE_ROUNDS times."""
    measured = walk.measure(specs, repeats)
    again_all: list[int] = []
    for _ in range(REMEASURE_ROUNDS):
        again = [i for i, m in enumerate(measured) if m and relative_spread(robust_repeats(m)) >
                 (COLO_SPREAD if specs[i][3] else SOLO_SPREAD)]
        if not again:
            break
        extra = walk.measure([specs[i] for i in again], [repeats[i] for i in again])
        for i, m in zip(again, extra):
            measured[i] += m
        again_all += [i for i in again if i not in again_all]
    return measured, again_all


def _points(specs: list[tuple[int, int, float, tuple[str, ...]]], measured: list[list[tuple]],
            latency: HarliLatencyModel) -> list[tuple]:
    """Each co-located spec's interval of median length with its units' time per kind, and the
    split the policy would compute for those units; specs never measured are left out."""
    out = []
    for (bs, seq, _, _), samples in zip(specs, measured):
        if samples:
            ms, ft_ms, mix = point_of(samples)
            solo = latency.solo_ms(bs, seq, 1.0)
            if not solo > 0:
                raise LatencyProfileError(f"stage 1 predicts a decode step of {solo:.3f} ms at batch {bs}, context "
                                          f"{seq}: the solo fit is unusable (a disturbed profile); run it again")
            s_ft = ft_ms / (ft_ms + solo)
            out.append((bs, seq, 1 - s_ft, s_ft, ms, mix))
    return out


def _repeats(specs: list[tuple[int, int, float, tuple[str, ...]]], repeats: int) -> list[int]:
    return [min([RARE_REPEATS.get(k, repeats) for k in kinds] + [repeats]) for *_, kinds in specs]


def profile_finetune(runner: ModelRunner, tokenizer, *, repeats: int = 11, model_name: str = "",
                     config: FinetuneConfig | None = None, log=print) -> ProfileResult:
    # One sample per step: an update every micro-batch, so its intervals come four times as often.
    config = config or FinetuneConfig(batch_size=1, micro_batch_size=1, max_seq_len=128, max_steps=10_000,
                                      checkpoint_every_steps=10_000)
    with tempfile.TemporaryDirectory() as tmp:
        data = synthetic_training_file(Path(tmp) / "profile.jsonl", tokenizer)
        job = FinetuneJob(runner.model, tokenizer, data, config, Path(tmp) / "job")
        while job.steps_done == 0:  # one step through: every piece kind timed
            job.run_unit()
        started = time.perf_counter()
        solo_specs = [(bs, seq, share, ()) for share in SHARES for bs in BATCHES for seq in SEQLENS]
        grid = [(bs, seq, 1.0, kinds) for bs in BATCHES for seq in SEQLENS for kinds in KIND_SEQUENCES]
        held_specs = [(bs, seq, 1.0, kinds) for bs, seq, kinds in HELD_OUT]
        specs = solo_specs + grid + held_specs
        log(f"profiling: {len(specs)} points, co-located and solo, {sum(_repeats(specs, repeats))} intervals")
        measured, again = measure_robustly(_Walk(runner, job, log), specs, _repeats(specs, repeats))
        rejected = sum(len(m) - len(robust_repeats(m)) for m in measured)
        log(f"measured {sum(map(len, measured))} intervals ({time.perf_counter() - started:.0f} s; "
            f"{len(again)} points measured again for their spread, {rejected} outlying repeats rejected)")
        m_solo, m_grid, m_held = (measured[:len(solo_specs)], measured[len(solo_specs):-len(held_specs)],
                                  measured[-len(held_specs):])
        solo = [(share, bs, seq, point_of(m)[0]) for (bs, seq, share, _), m in zip(solo_specs, m_solo)]
        # Stage 1 at the batch the engine runs each decode at (its padded rows or graph bucket).
        run_batches = runner.decode_run_batches
        latency = HarliLatencyModel(HarliLatencyModel.fit_solo(solo, run_batches), model_name=model_name,
                                    device=runner.device.type, run_batches=run_batches)
        colo = _points(grid, m_grid, latency)
        held = _points(held_specs, m_held, latency)
        colo_samples = {f"{bs},{seq},{'+'.join(kinds)}": [round(x[0], 2) for x in m]
                        for (bs, seq, _, kinds), m in zip(grid, m_grid)}
        solo_samples = {f"{share},{bs},{seq}": [round(x[0], 2) for x in m]
                        for (bs, seq, share, _), m in zip(solo_specs, m_solo)}
        remeasured = [f"{share},{bs},{seq},{'+'.join(kinds)}" for bs, seq, share, kinds in (specs[i] for i in again)]
        unit_ms = {k: statistics.median(v) for k, v in job.piece_ms.items() if v}
        latency.fit_colo(colo, kind_weights=step_time_by_kind(job, unit_ms))
        share_only = HarliLatencyModel(latency.solo, run_batches=run_batches)  # HARLI's single k1, same points
        share_only.fit_colo([p[:5] for p in colo])
        decode_ms = point_of(_Walk(runner, job).measure([(1, 32, 1.0, ())], [repeats])[0])[0]
    # Each stage is judged by its own prediction (HARLI §8.4): stage 1 on the solo points, stage 2
    # on the co-located ones; the grid is both together.
    # "kind_average" is this model without the kinds (what a caller that does not pass them gets);
    # "share_only" HARLI's single-k1 stage 2 fitted on the same points: the per-kind gain, same run.
    solo_err, colo_err = latency.solo_errors(solo), latency.relative_errors(colo)
    grid_errs = [abs(latency.solo_ms(bs, seq, share) - ms) / ms for share, bs, seq, ms in solo] + \
                [abs(latency.colo_ms(*p[:4], ft_mix=p[5]) - p[4]) / p[4] for p in colo]
    latency.errors = {"grid": {"mean": sum(grid_errs) / len(grid_errs), "max": max(grid_errs), "points": len(grid_errs)},
                      "solo": solo_err, "colo": colo_err, "held_out": latency.relative_errors(held),
                      "colo_kind_average": latency.relative_errors(colo, use_mix=False),
                      "held_out_kind_average": latency.relative_errors(held, use_mix=False),
                      "colo_share_only": share_only.relative_errors(colo),
                      "held_out_share_only": share_only.relative_errors(held)}
    latency.unit_ms = unit_ms
    return ProfileResult(latency, solo, colo, held, decode_ms, unit_ms, colo_samples, solo_samples, remeasured,
                         rejected)


def step_time_by_kind(job: FinetuneJob, unit_ms: dict[str, float]) -> dict[str, float]:
    """Each kind's time in one training step of the job (its pieces x their median time): the
    weights of the kind-average k1."""
    out: dict[str, float] = {}
    for kind in job.kinds_of_step(job.steps_done):
        out[kind] = out.get(kind, 0.0) + unit_ms.get(kind, 0.0)
    return out


# --- the predictor on compute partitions (HARLI §5 on a partitioned device) ------------------------

PARTITION_BATCHES = (1, 2, 4)
PARTITION_SEQLENS = (32, 256)


def profile_partitions(runner: ModelRunner, job: FinetuneJob, partitions, *, repeats: int = 7, passes: int = 2,
                       batches: tuple[int, ...] = PARTITION_BATCHES, seqlens: tuple[int, ...] = PARTITION_SEQLENS,
                       model_name: str = "", log=print) -> HarliLatencyModel:
    """HARLI's two-stage predictor over the partitions' realisable splits (§5, as §8.8 profiles SM
    shares), measured on this thread, which must be the one decode runs on.

    Stage 1: decode steps at every batch x context with decode on its partition of each realisable
    split, finetuning idle (and on the whole device, share 1). Stage 2: the same steps while a
    finetuning thread runs the job's units on its partition, at every split; the whole-device
    solo steps join them as splits with no finetuning, so b1 and k1 are told apart. The passes
    interleave the three kinds of point, so a burst of outside load reaches all of them."""

    kv = runner.kv
    shapes = [(bs, seq) for bs in batches for seq in seqlens]
    chunks = {}
    for bs, seq in shapes:
        tables = [kv.allocate(kv.blocks_needed(seq + 1)) for _ in range(bs)]
        chunks[(bs, seq)] = [SeqChunk(f"p{i}", [5], seq, t, want_logits=True) for i, t in enumerate(tables)]
    splits = [(round(1 - f, 6), f) for f in partitions.ft_shares()]
    if not splits:
        raise LatencyProfileError(f"the {partitions.form} partitions realise no split to profile")
    solo: dict[tuple, list[float]] = {}
    colo: dict[tuple, list[float]] = {}
    running = threading.Event()
    stop = threading.Event()

    def finetune() -> None:
        while not stop.is_set():
            if not running.wait(timeout=0.05):
                continue
            partitions.enter("finetune")
            try:
                more = job.run_unit()
            finally:
                partitions.leave("finetune")
            if not more:
                raise LatencyProfileError("the profiling job ran out of steps")
            if runner.device.type == "cuda":  # the next unit may run on another partition's stream
                torch.cuda.current_stream().synchronize()

    thread = threading.Thread(target=finetune, name="backfill-profile-finetune", daemon=True)
    thread.start()

    cuda = runner.device.type == "cuda"

    def steps(key: tuple, into: dict, n: int) -> None:
        runner.execute(chunks[key[:2]])  # untimed: the step after a change of partition
        for _ in range(n):
            start = time.perf_counter()
            runner.execute(chunks[key[:2]])
            if cuda:  # this thread's stream only: the finetuning partition's work runs on
                torch.cuda.current_stream().synchronize()
            into.setdefault(key, []).append((time.perf_counter() - start) * 1e3)

    per_pass = -(-repeats // passes)
    started = time.perf_counter()
    try:
        for _ in range(passes):
            for share_infer, share_ft in [(1.0, 0.0)] + splits:
                partitions.apply(share_infer, share_ft)
                partitions.enter("decode")
                for shape in shapes:
                    steps((*shape, share_infer), solo, per_pass)
                if share_ft:
                    running.set()
                    time.sleep(0.05)  # the finetuning thread is inside a unit
                    for shape in shapes:
                        steps((*shape, share_infer, share_ft), colo, per_pass)
                    running.clear()
    finally:
        stop.set()
        running.clear()
        thread.join(timeout=60)
        partitions.apply(1.0, 0.0)
        partitions.enter("decode")
        for cs in chunks.values():
            for c in cs:
                kv.free(c.block_table)
    solo_points = [(share, bs, seq, statistics.median(v)) for (bs, seq, share), v in solo.items()]
    colo_points = [(bs, seq, s_inf, s_ft, statistics.median(v)) for (bs, seq, s_inf, s_ft), v in colo.items()]
    colo_points += [(bs, seq, 1.0, 0.0, ms) for share, bs, seq, ms in solo_points if share == 1.0]
    latency = HarliLatencyModel(HarliLatencyModel.fit_solo(solo_points, runner.decode_run_batches),
                                model_name=model_name, device=f"{runner.device.type}-{partitions.form}",
                                run_batches=runner.decode_run_batches)
    latency.fit_colo(colo_points)
    latency.errors = {"solo": latency.solo_errors(solo_points), "colo": latency.relative_errors(colo_points),
                      "points": {"solo": solo_points, "colo": colo_points}}
    log(f"partition predictor: {len(solo_points)} solo and {len(colo_points)} co-located points in "
        f"{time.perf_counter() - started:.0f} s; stage 1 max {latency.errors['solo']['max']:.1%}, "
        f"stage 2 max {latency.errors['colo']['max']:.1%}")
    return latency
