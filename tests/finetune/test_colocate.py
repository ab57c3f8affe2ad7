"""attach_finetune on a real (tiny) engine: same adapter as undisturbed, no KV starvation."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from backfill.sampling_params import SamplingParams
from backfill.finetune.colocate import attach_finetune
from backfill.finetune.config import FinetuneConfig
from backfill.finetune.job import FinetuneJob
from backfill.policy.harli import HarliLatencyModel, HarliPolicy, SoloFit
from backfill.types import FinishReason, GenerationRequest
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_tiny_engine
from tests.finetune.helpers import TOKENIZER, write_chat_file

CONFIG = FinetuneConfig(rank=4, alpha=8, batch_size=4, micro_batch_size=2, max_steps=4, checkpoint_every_steps=2,
                        learning_rate=1e-2, seed=5, max_seq_len=64)
# A generous predicted decode step (2 ms a sequence) against a 60 ms target: HARLI runs a few units a gap.
LATENCY = HarliLatencyModel((SoloFit(1.0, 2.0, 1.0, 0.0),), b1=1.0, k1=1.05)


def _engine(kv_gb: float = 0.004):
    return build_tiny_engine(ServingConfig(policy="fcfs", kv_cache_gb=kv_gb, block_size=16, max_model_len=512))


def _requests(n: int, prompt_len: int, max_tokens: int) -> list[GenerationRequest]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [GenerationRequest([3 + (i * 7 + j * 5) % 250 for j in range(prompt_len)], params, request_id=f"r{i}")
            for i in range(n)]


async def _serve(engine, requests, gap_s: float = 0.0):
    async def one(r, delay):
        await asyncio.sleep(delay)
        return await engine.generate(r)
    return await asyncio.gather(*(one(r, i * gap_s) for i, r in enumerate(requests)))


def test_adapter_trained_under_colocation_equals_undisturbed(tmp_path):
    data = write_chat_file(tmp_path / "t.jsonl")
    engine = _engine()
    model = engine.scheduler.runner.model
    FinetuneJob(model, TOKENIZER, data, CONFIG, tmp_path / "alone").run()
    job = FinetuneJob(model, TOKENIZER, data, CONFIG, tmp_path / "colo")

    async def go():
        await engine.start()
        try:
            handle = attach_finetune(engine, job, HarliPolicy(LATENCY), tpot_target_ms=60.0)
            outs = await _serve(engine, _requests(6, 40, 24), gap_s=0.02)
            await asyncio.wait_for(handle.wait(), 120)
            return handle, outs
        finally:
            await engine.stop()

    handle, outs = asyncio.run(go())
    assert handle.done and handle.error is None and job.finished
    assert all(reason is FinishReason.LENGTH for _, _, reason in outs)
    assert handle.stats.units_during_decode > 0, "no unit ran between decode steps"
    want, got = (load_file(str(tmp_path / d / "adapter/adapter_model.safetensors")) for d in ("alone", "colo"))
    for key in want:  # same thread count, same data order, same arithmetic: equal to the bit
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


def test_burst_never_starves_inference_of_kv_blocks(tmp_path):
    data = write_chat_file(tmp_path / "t.jsonl", n=16)
    # The whole head in one unit: its logits make the lease big enough for the burst to need it back.
    config = replace(CONFIG, max_steps=1000, batch_size=4, micro_batch_size=2, max_seq_len=256, loss_rows_per_unit=512)
    requests = _requests(20, 120, 24)  # 9 blocks each: more than the pool keeps free while the job holds its share
    # Reference: the same burst with no finetuning.
    engine = _engine(kv_gb=0.008)
    kv = engine.scheduler.kv
    total = kv.num_usable

    async def run(with_job: bool):
        await engine.start()
        try:
            handle = None
            if with_job:
                job = FinetuneJob(engine.scheduler.runner.model, TOKENIZER, data, config, tmp_path / "job")
                handle = attach_finetune(engine, job, HarliPolicy(LATENCY), tpot_target_ms=60.0, max_batch=4)
                for _ in range(1000):  # the job holds its blocks before the burst comes
                    if handle.stats.units:
                        break
                    await asyncio.sleep(0.01)
                assert kv.retired, "the job should hold lent blocks before the burst"
            outs = await _serve(engine, requests)
            if handle is not None:
                handle.cancel()
                await asyncio.wait_for(handle.wait(), 30)
            return outs, handle
        finally:
            await engine.stop()

    alone, _ = asyncio.run(run(False))
    colo, handle = asyncio.run(run(True))
    assert [ids for ids, _, _ in colo] == [ids for ids, _, _ in alone]
    assert all(reason is FinishReason.LENGTH for _, _, reason in colo)
    assert handle.stats.blocks_given_back > 0, "the burst should have needed the lent blocks"
    assert kv.num_usable == total and not kv.retired  # everything lent came back


def test_the_driver_shows_the_policy_the_next_units(tmp_path):
    """HARLI's policy predicts with the kinds of the units it would run: the driver's snapshot
    lists the job's next units, and the units it then runs in that gap are those."""
    events = []

    class Recording(HarliPolicy):
        def plan(self, state):
            plan = super().plan(state)
            events.append(("plan", [tuple(k for k, _ in u) for u in state.next_units], plan.units))
            return plan

    engine = _engine()
    job = FinetuneJob(engine.scheduler.runner.model, TOKENIZER, write_chat_file(tmp_path / "t.jsonl"),
                      replace(CONFIG, max_steps=2), tmp_path / "job")
    run_unit = job.run_unit

    def recorded_run_unit():
        ran = run_unit()
        events.append(("ran", tuple(k for k, _ in job.last_unit_pieces)))
        return ran

    job.run_unit = recorded_run_unit

    async def go():
        await engine.start()
        try:
            handle = attach_finetune(engine, job, Recording(LATENCY), tpot_target_ms=60.0)
            await _serve(engine, _requests(3, 20, 12), gap_s=0.02)
            await asyncio.wait_for(handle.wait(), 120)
        finally:
            await engine.stop()

    asyncio.run(go())
    plans = [i for i, e in enumerate(events) if e[0] == "plan"]
    assert plans and any(events[i][2] > 0 for i in plans)
    for i in plans:
        _, upcoming, units = events[i]
        assert 0 < len(upcoming) <= 8
        ran = [e[1] for e in events[i + 1:i + 1 + units]]
        assert all(e[0] == "ran" for e in events[i + 1:i + 1 + units]) and ran == upcoming[:len(ran)]


def test_saved_profiles_of_the_old_format_load_and_bad_ones_are_ignored(tmp_path, monkeypatch, caplog):
    import json
    import logging

    from backfill.finetune.colocate import harli_profile_path, load_saved_latency

    monkeypatch.setenv("BACKFILL_CACHE_DIR", str(tmp_path))
    path = harli_profile_path("m")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"solo": [{"share": 1.0, "b0": 2.0, "c0": 1.0, "k0": 0.0}], "b1": 1.0, "k1": 1.05}))
    with caplog.at_level(logging.WARNING):
        old = load_saved_latency("m")
    assert old is not None and not old.per_kind and "re-run `backfill finetune profile`" in caplog.text
    caplog.clear()
    path.write_text(json.dumps({"format": 9}))
    with caplog.at_level(logging.WARNING):
        assert load_saved_latency("m") is None
    assert "format 9" in caplog.text


def test_partitioned_driver_finetunes_on_its_own_core_beside_decode(tmp_path):
    """HARLI on core partitions, for real: decode on the engine's thread and the job on its own,
    each on its core while decode runs, re-planned per step; outputs as without finetuning."""
    import os
    import pytest

    from backfill.engine.compute_partition import CorePartitions
    from backfill.finetune.colocate import attach_finetune_partitioned
    from backfill.policy.harli_sm import HarliSmPolicy

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("core partitions need two cores")
    data = write_chat_file(tmp_path / "t.jsonl", n=4)
    requests = _requests(3, 24, 16)
    reference = _engine()

    async def serve(engine, handle_factory=None):
        await engine.start()
        try:
            handle = handle_factory(engine) if handle_factory else None
            outs = await _serve(engine, requests, gap_s=0.02)
            if handle is not None:
                await asyncio.wait_for(handle.wait(), 120)
            return handle, outs
        finally:
            await engine.stop()

    _, want = asyncio.run(serve(reference))
    engine = _engine()
    job = FinetuneJob(engine.scheduler.runner.model, TOKENIZER, data, replace(CONFIG, max_steps=2), tmp_path / "colo")
    partitions = CorePartitions(cores[:2], max_threads=1)
    # Decode beside finetuning is predicted well under the target: the plan is one core each.
    latency = HarliLatencyModel((SoloFit(0.5, 1.0, 2.0, 0.0), SoloFit(1.0, 0.5, 1.0, 0.0)), b1=1.0, k1=1.0)
    unit_cores: list[tuple[list[int], bool]] = []
    run_unit = job.run_unit

    def recorded_unit() -> bool:  # where each unit really ran, and whether decode held a core then
        unit_cores.append((sorted(os.sched_getaffinity(0)), partitions.current.share_infer > 0))
        return run_unit()

    job.run_unit = recorded_unit
    policy = HarliSmPolicy(latency, ft_shares=partitions.ft_shares())
    handle, got = asyncio.run(serve(engine, lambda e: attach_finetune_partitioned(
        e, job, policy, partitions, tpot_target_ms=500.0)))
    assert handle.done and handle.error is None and job.finished
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in want]  # decode unchanged by the job beside it
    assert handle.stats.splits.get("0.50/0.50", 0) > 0, handle.stats.splits
    beside = [c for c, decoding in unit_cores if decoding]
    assert beside and all(c == [cores[1]] for c in beside), unit_cores  # finetuning kept off decode's core
    assert (tmp_path / "colo" / "adapter" / "adapter_model.safetensors").exists()
    assert engine.between_steps_tasks == ()
