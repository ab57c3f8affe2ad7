"""Prefix caching through the scheduler on a tiny random model: preemption and resume (with host
checkpoints, recomputing, or paging), LoRA adapters on one prefix, and what the policy and users see."""

import pytest

from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.runner import ModelRunner
from backfill.memory.pager import make_pager
from backfill.policy.baselines import FCFSPolicy, PriorityPolicy
from backfill.policy.checkpoint import AdaptiveCheckpointPolicy, CheckpointConfig
from backfill.sampling_params import SamplingParams
from backfill.serving.scheduler import Scheduler
from backfill.types import GenerationRequest, RequestClass

ONLINE, OFFLINE = RequestClass.ONLINE, RequestClass.OFFLINE
SYSTEM = [3 + (i * 11) % 240 for i in range(27)]   # three full blocks of 8 and three tokens


def _drain(scheduler: Scheduler, on_step=None) -> tuple[dict[str, list[int]], dict[str, int]]:
    out: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    steps = 0
    while scheduler.has_work():
        for event in scheduler.step():
            out.setdefault(event.request_id, []).extend(event.token_ids)
            if event.finished:
                cached[event.request_id] = event.num_cached_tokens
        steps += 1
        if on_step:
            on_step(steps)
        assert steps < 5000
    return out, cached


def _lines(n: int, cls=OFFLINE, max_tokens: int = 30, prefix: str = "o") -> list[GenerationRequest]:
    params = SamplingParams.greedy_params(max_tokens=max_tokens)
    return [GenerationRequest(SYSTEM + [100 + i, 50 + 3 * i, 7 + i], params, cls, request_id=f"{prefix}{i}")
            for i in range(n)]


def _pool(runner: ModelRunner, num_blocks: int, caching: bool) -> ModelRunner:
    return ModelRunner(runner.model, KVBlockPool(runner.config, num_blocks, 8, device=runner.kv.device,
                                                 prefix_caching=caching))


@pytest.mark.parametrize("resume", ["checkpoint", "recompute", "pager"])
def test_preempted_requests_sharing_a_prefix_resume_identically(tiny_runner, resume):
    """A small pool and an online burst force offline lines sharing a system prompt off the device;
    on resume shared blocks are re-found in the cache, the rest restored or recomputed."""
    def run(caching: bool):
        runner = _pool(tiny_runner, 22, caching)
        checkpoints = AdaptiveCheckpointPolicy(CheckpointConfig(start_usage=0.0, full_usage=0.01)) \
            if resume == "checkpoint" else None
        scheduler = Scheduler(runner, PriorityPolicy(), checkpoint_policy=checkpoints)
        if resume == "pager":
            scheduler.pager = make_pager("cpu")
        lines = _lines(4)
        scheduler.add(lines[0])

        def arrive(step: int) -> None:
            if step == 1:   # the first line's prompt is computed: the others map its system prompt
                for r in lines[1:]:
                    scheduler.add(r)
            if step == 10:
                for r in _lines(2, ONLINE, 12, prefix="on"):
                    scheduler.add(r)

        out, cached = _drain(scheduler, arrive)
        assert runner.kv.num_free == runner.kv.num_usable
        return out, cached, scheduler.stats

    off, _, off_stats = run(False)
    on, cached, stats = run(True)
    assert on == off
    assert stats.preempted_requests > 0 and off_stats.preempted_requests > 0
    # The first line computes the system prompt; every later one, online ones included, maps it.
    assert cached == {"o0": 0, "o1": 24, "o2": 24, "o3": 24, "on0": 24, "on1": 24}
    if resume == "checkpoint":
        assert stats.restored_tokens > 0


def _step(scheduler: Scheduler, out: dict[str, list[int]], steps: int = 1) -> None:
    for _ in range(steps):
        for event in scheduler.step():
            out.setdefault(event.request_id, []).extend(event.token_ids)


def _solo(tiny_runner, request: GenerationRequest) -> list[int]:
    scheduler = Scheduler(_pool(tiny_runner, 32, False), FCFSPolicy())
    scheduler.add(request)
    return _drain(scheduler)[0][request.request_id]


def test_checkpoints_skip_shared_blocks_and_restore_re_finds_them(tiny_runner):
    runner = _pool(tiny_runner, 32, True)
    always = AdaptiveCheckpointPolicy(CheckpointConfig(start_usage=0.0, full_usage=0.01))
    scheduler = Scheduler(runner, FCFSPolicy(), checkpoint_policy=always)
    out = _second_line_mapping_the_first(scheduler)
    seq = scheduler.seqs["o1"]
    shared = seq.block_table[:3]
    assert [runner.kv.ref_count(b) for b in seq.block_table] == [2, 2, 2, 1, 1]
    # Only its own whole block went to the host: the shared ones stay cached while o0 maps them.
    assert seq.checkpoint.num_tokens == 32
    assert seq.checkpoint.blocks[:3] == [None] * 3 and seq.checkpoint.blocks[3] is not None
    scheduler.request_preemption.preempt(seq)   # copies its partial last block too
    restored = scheduler.stats.restored_tokens
    _step(scheduler, out)
    # The shared blocks and its own cached full block are mapped again; the partial block copied back.
    assert seq.block_table[:3] == shared and scheduler.stats.restored_tokens - restored == 39 - 32
    out_rest, _ = _drain(scheduler)
    for key, tokens in out_rest.items():
        out.setdefault(key, []).extend(tokens)
    assert out["o1"] == _solo(tiny_runner, _lines(2)[1]) and out["o0"] == _solo(tiny_runner, _lines(1)[0])


def _second_line_mapping_the_first(scheduler: Scheduler, steps: int = 10) -> dict[str, list[int]]:
    """o0 computes the system prompt; o1 maps its three blocks and runs `steps` steps."""
    first, second = _lines(2)
    out: dict[str, list[int]] = {}
    scheduler.add(first)
    _step(scheduler, out)
    scheduler.add(second)
    _step(scheduler, out, steps)
    return out


def _paged_second_line(tiny_runner) -> tuple[Scheduler, dict[str, list[int]]]:
    """o1 of _second_line_mapping_the_first, paged out."""
    scheduler = Scheduler(_pool(tiny_runner, 32, True), FCFSPolicy())
    scheduler.pager = make_pager("cpu")
    out = _second_line_mapping_the_first(scheduler)
    assert [scheduler.kv.ref_count(b) for b in scheduler.seqs["o1"].block_table] == [2, 2, 2, 1, 1]
    scheduler.request_preemption.preempt(scheduler.seqs["o1"])
    return scheduler, out


def _finish(tiny_runner, scheduler: Scheduler, out: dict[str, list[int]]) -> None:
    for key, tokens in _drain(scheduler)[0].items():
        out.setdefault(key, []).extend(tokens)
    assert out["o1"] == _solo(tiny_runner, _lines(2)[1])


def test_a_paged_request_pages_its_shared_blocks_once(tiny_runner):
    """AQUA §7 with prefix caching: the three blocks o0 also maps stay cached, only o1's own two go
    to the swap space, and on return the page follows the re-found shared blocks."""
    scheduler, out = _paged_second_line(tiny_runner)
    pager, seq = scheduler.pager, scheduler.seqs["o1"]
    assert pager.num_blocks("o1") == 2 and pager.first_block("o1") == 3
    assert pager.stats.bytes_out == 2 * scheduler.kv.nbytes // scheduler.kv.num_blocks
    shared = [b for b in scheduler.seqs["o0"].block_table[:3]]
    _step(scheduler, out)
    assert seq.block_table[:3] == shared and not pager.holds("o1")
    assert scheduler.stats.restored_tokens > 0 and scheduler.stats.recomputed_tokens == 0
    _finish(tiny_runner, scheduler, out)
    assert out["o0"] == _solo(tiny_runner, _lines(1)[0])


def test_a_page_whose_shared_blocks_were_evicted_is_recomputed(tiny_runner):
    scheduler, out = _paged_second_line(tiny_runner)
    seq = scheduler.seqs["o1"]
    computed = seq.num_computed
    scheduler.request_preemption.preempt(scheduler.seqs["o0"], save_tail=False)   # nobody maps the prompt ...
    scheduler.cancel("o0")        # ... nor will again
    scheduler.kv.clear_cache()    # ... and its blocks are forgotten (evicted)
    recomputed = scheduler.stats.recomputed_tokens
    _step(scheduler, out)
    assert not scheduler.pager.holds("o1")   # the page was dropped: it cannot follow the gap
    assert scheduler.stats.recomputed_tokens - recomputed >= computed - 1
    _finish(tiny_runner, scheduler, out)


def test_shared_blocks_are_re_found_after_a_preemption(tiny_runner):
    runner = _pool(tiny_runner, 32, True)
    scheduler = Scheduler(runner, FCFSPolicy())
    out = _second_line_mapping_the_first(scheduler, steps=3)
    seq = scheduler.seqs["o1"]
    shared = seq.block_table[:3]
    assert [runner.kv.ref_count(b) for b in shared] == [2, 2, 2]
    scheduler.request_preemption.preempt(seq)
    assert seq.num_computed == 0 and not seq.block_table  # no checkpoint: recompute what is not cached
    assert scheduler.snapshot().seqs[1].num_cached_tokens == 32   # its own full blocks are still cached
    _step(scheduler, out)
    assert seq.block_table[:3] == shared and seq.num_computed == seq.num_tokens - 1   # 32 mapped, 1 computed
    for key, tokens in _drain(scheduler)[0].items():
        out[key].extend(tokens)
    assert out["o1"] == _solo(tiny_runner, _lines(2)[1])


def test_the_policy_is_charged_only_uncached_tokens(tiny_runner):
    scheduler = Scheduler(_pool(tiny_runner, 32, True), FCFSPolicy())
    scheduler.add(_lines(1)[0])
    _drain(scheduler)
    scheduler.add(_lines(2)[1])
    scheduler.add(GenerationRequest([9] * 30, SamplingParams.greedy_params(max_tokens=2), request_id="fresh"))
    scheduler._take_inbox()
    views = {v.seq_id: v for v in scheduler.snapshot().seqs}
    assert views["o1"].num_cached_tokens == 24 and views["o1"].num_pending_tokens == 6
    assert views["fresh"].num_cached_tokens == 0 and views["fresh"].num_pending_tokens == 30
    plan = scheduler.policy.schedule(scheduler.snapshot())
    assert {item.seq_id: item.num_tokens for item in plan.scheduled} == {"o1": 6, "fresh": 30}


def test_a_request_not_yet_added_is_probed_without_taking_blocks(tiny_runner):
    """What admission asks before a request is added: the cached leading tokens, and nothing mapped."""
    scheduler = Scheduler(_pool(tiny_runner, 32, True), FCFSPolicy())
    first, second = _lines(2)
    assert scheduler.cached_prompt_tokens(first) == 0
    scheduler.add(first)
    _drain(scheduler)
    free = scheduler.kv.num_free
    refs = [scheduler.kv.ref_count(b) for b in range(scheduler.kv.num_blocks)]
    assert scheduler.cached_prompt_tokens(second) == 24   # SYSTEM's three full blocks of 8
    assert scheduler.kv.num_free == free and [scheduler.kv.ref_count(b) for b in range(scheduler.kv.num_blocks)] == refs
    short = GenerationRequest(SYSTEM[:8], SamplingParams.greedy_params(max_tokens=2))
    assert scheduler.cached_prompt_tokens(short) == 0   # its one block holds its last token: computed
    assert Scheduler(_pool(tiny_runner, 32, False), FCFSPolicy()).cached_prompt_tokens(second) == 0


def test_with_caching_off_nothing_is_found(tiny_runner):
    scheduler = Scheduler(_pool(tiny_runner, 32, False), FCFSPolicy())
    for r in _lines(3):
        scheduler.add(r)
    _, cached = _drain(scheduler)
    assert set(cached.values()) == {0}
    assert scheduler.stats.prefix_cache_hits == {"online": 0, "offline": 0}
    assert scheduler.stats.prefix_cache_queries == {"online": 0, "offline": 0}


@pytest.mark.parametrize("policy", [FCFSPolicy, PriorityPolicy])
def test_an_offline_stream_does_not_flush_the_online_system_prompt(tiny_runner, policy):
    """Echo: offline lines with distinct prompts that need more blocks than are free take none of the
    blocks of the system prompt online requests share; the next online request finds it."""
    scheduler = Scheduler(_pool(tiny_runner, 24, True), policy())
    chats = _lines(3, ONLINE, max_tokens=4, prefix="chat")
    for chat in chats[:2]:   # the second finds the system prompt the first computed
        scheduler.add(chat)
        _drain(scheduler)
    assert scheduler.kv.num_online_reused_free == 3
    params = SamplingParams.greedy_params(max_tokens=10)
    stream = [GenerationRequest([200 + i] + [(17 * i + 5 * j) % 240 + 3 for j in range(59)], params, OFFLINE,
                                request_id=f"distinct{i}") for i in range(6)]
    for r in stream:
        scheduler.add(r)
    out, _ = _drain(scheduler)
    assert out == {r.request_id: _solo(tiny_runner, r) for r in stream}
    assert scheduler.kv.num_online_reused_free == 3
    scheduler.add(chats[2])
    _, cached = _drain(scheduler)
    assert cached == {"chat2": 24}


pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    from lora_helpers import ALL_TARGETS, hf_llama, make_peft_adapter

    from backfill.engine.config import ModelConfig
    from tests.conftest import random_weights

    cfg = ModelConfig.tiny()
    root = tmp_path_factory.mktemp("prefix-adapters")
    make_peft_adapter(hf_llama(cfg, random_weights(cfg)), root / "a", 4, 8, ALL_TARGETS, seed=1, std=1.0)
    make_peft_adapter(hf_llama(cfg, random_weights(cfg)), root / "b", 2, 4, ["k_proj", "v_proj"], seed=2, std=1.5)
    return root


def test_two_adapters_on_one_prefix_never_share_blocks(tiny_runner, adapter_dirs):
    """Both adapters change K and V: a block computed under one must never be read under the other."""
    def run(caching: bool):
        runner = _pool(tiny_runner, 48, caching)
        runner.adapters.load("a", adapter_dirs / "a")
        runner.adapters.load("b", adapter_dirs / "b")
        scheduler = Scheduler(runner, FCFSPolicy())
        params = SamplingParams.greedy_params(max_tokens=8)
        outs, hits = {}, {}
        for i, adapter in enumerate(["a", "b", None, "a", "b"]):
            scheduler.add(GenerationRequest(SYSTEM + [60 + i], params, adapter=adapter, request_id=f"r{i}"))
            out, cached = _drain(scheduler)
            outs |= out
            hits |= cached
        return outs, hits

    off, _ = run(False)
    on, hits = run(True)
    assert on == off
    assert len({tuple(off[f"r{i}"]) for i in range(3)}) == 3   # the adapters change the output
    # Only the same adapter's earlier request supplies cached blocks.
    assert hits == {"r0": 0, "r1": 0, "r2": 0, "r3": 24, "r4": 24}


def test_the_probe_keys_by_adapter(tiny_runner, adapter_dirs):
    runner = _pool(tiny_runner, 48, True)
    runner.adapters.load("a", adapter_dirs / "a")
    runner.adapters.load("b", adapter_dirs / "b")
    scheduler = Scheduler(runner, FCFSPolicy())
    params = SamplingParams.greedy_params(max_tokens=2)
    scheduler.add(GenerationRequest(SYSTEM + [60], params, adapter="a"))
    _drain(scheduler)
    probe = {adapter: scheduler.cached_prompt_tokens(GenerationRequest(SYSTEM + [61], params, adapter=adapter))
             for adapter in ("a", "b", None)}
    assert probe == {"a": 24, "b": 0, None: 0}


def test_lines_sharing_an_uncached_prefix_compute_it_once(tiny_runner):
    """HyGen: submitted together, the first line computes the system prompt and the others wait a
    step to map it, rather than all computing it in one step."""
    scheduler = Scheduler(_pool(tiny_runner, 48, True), FCFSPolicy())
    lines = _lines(4)
    for r in lines:
        scheduler.add(r)
    out, cached = _drain(scheduler)
    assert cached == {"o0": 0, "o1": 24, "o2": 24, "o3": 24}
    assert out == {r.request_id: _solo(tiny_runner, r) for r in lines}
