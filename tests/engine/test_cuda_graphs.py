"""Decode through DecodeGraphs: fixed-shape buckets, padding rows, safepoints.

On CPU the parts run eagerly (capture=False), which checks the bucketing and padding the graphs
replay; with BACKFILL_TEST_DEVICE=cuda the last tests capture and replay real graphs.
"""

import pytest
import torch

from backfill.engine.cuda_graphs import BATCH_BUCKETS, DecodeGraphs, batch_bucket, blocks_bucket
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import LlamaModel
from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk
from runner_greedy import greedy_decode
from tests.conftest import random_weights


@pytest.fixture(scope="module")
def model(tiny_config, device):
    return LlamaModel(tiny_config, random_weights(tiny_config), device=device)


def _runners(model, tiny_config, device, capture: bool):
    eager = ModelRunner(model, KVBlockPool(tiny_config, 96, 8, device=device))
    kv = KVBlockPool(tiny_config, 96, 8, device=device)
    return eager, ModelRunner(model, kv, DecodeGraphs(model, kv, capture=capture))


def _prompts(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = 1e-4 if actual.device.type == "cpu" else 2e-2  # padded keys change the summation order
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def test_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64]
    assert batch_bucket(BATCH_BUCKETS[-1] + 1) is None
    assert [blocks_bucket(n) for n in (1, 4, 5, 9, 100)] == [4, 4, 8, 16, 128]


def _decodes_like_the_eager_path(eager: ModelRunner, graphed: ModelRunner, lengths: list[int]) -> None:
    prompts = _prompts(lengths)
    expected_tokens, expected_logits = greedy_decode(eager, prompts, steps=12)
    tokens, logits = greedy_decode(graphed, prompts, steps=12)
    assert tokens == expected_tokens
    for got, want in zip(logits, expected_logits):
        _close(got, want)
    # One batch bucket; a block-table bucket for each width the longest context passed through.
    widths = {blocks_bucket((max(lengths) + step) // 8 + 1) for step in range(12)}
    assert set(graphed.decode_graphs.captured_buckets) == {(batch_bucket(len(lengths)), w) for w in widths}
    buckets = graphed.decode_graphs.captured_buckets
    assert greedy_decode(graphed, prompts, steps=12)[0] == expected_tokens  # the buckets built are reused
    assert graphed.decode_graphs.captured_buckets == buckets


@pytest.mark.parametrize("lengths", [[5], [9, 30, 17], [3, 41, 12, 8, 26]])
def test_padded_buckets_decode_like_the_eager_path(model, tiny_config, device, lengths):
    _decodes_like_the_eager_path(*_runners(model, tiny_config, device, capture=False), lengths)


def test_padding_rows_write_only_the_scratch_block(model, tiny_config, device):
    kv = KVBlockPool(tiny_config, 16, 8, device=device)
    first = kv.allocate(3)
    graphs = DecodeGraphs(model, kv, capture=False)  # takes block 3: blocks 0-2 go to the sequence
    kv.free(first)
    runner = ModelRunner(model, kv, graphs)
    ids = _prompts([13])[0]
    table = kv.allocate(3)
    assert graphs.scratch_block == 3 and sorted(table) == [0, 1, 2]
    runner.execute([SeqChunk("a", ids, 0, table, want_logits=False)])
    k_before, v_before = kv.k.clone(), kv.v.clone()
    # Three rows pad to a bucket of four; all three are the same sequence at the same position, so
    # its one new slot and the scratch block are the only places the step may write.
    chunks = [SeqChunk(s, [7], len(ids), table) for s in ("a", "b", "c")]
    assert batch_bucket(len(chunks)) == 4
    runner.execute(chunks)
    changed = (kv.k != k_before).flatten(3).any(-1) | (kv.v != v_before).flatten(3).any(-1)  # [layer, block, slot]
    written = {(int(b), int(s)) for b, s in changed.any(0).nonzero()}
    own_slot = (table[len(ids) // kv.block_size], len(ids) % kv.block_size)
    assert own_slot in written
    assert written - {own_slot} <= {(graphs.scratch_block, 0)}


def test_scratch_block_is_taken_from_the_pool(model, tiny_config, device):
    kv = KVBlockPool(tiny_config, 16, 8, device=device)
    graphs = DecodeGraphs(model, kv, capture=False)
    assert kv.num_free == 15 and kv.is_allocated(graphs.scratch_block)


def test_safepoint_aborts_between_layers_and_a_rerun_equals_no_abort(model, tiny_config, device):
    _, runner = _runners(model, tiny_config, device, capture=False)
    kv = runner.kv
    ids = _prompts([20])[0]
    table = kv.allocate(3)
    runner.execute([SeqChunk("x", ids, 0, table, want_logits=False)])
    expected = runner.execute([SeqChunk("x", [7], 20, table)]).logits
    seen = []

    def stop_at_two(layer: int) -> bool:
        seen.append(layer)
        return layer == 2

    aborted = runner.execute([SeqChunk("x", [9], 20, table)], safepoint=stop_at_two)
    assert aborted.aborted and aborted.aborted_at_layer == 2 and aborted.suspended is None
    assert seen == [1, 2]  # once before each layer after the first, as the compiled decode path does
    every = []
    rerun = runner.execute([SeqChunk("x", [7], 20, table)], safepoint=lambda layer: every.append(layer) or False)
    assert every == list(range(1, tiny_config.num_layers + 1))  # the last is before the LM head
    _close(rerun.logits, expected)
    kv.free(table)


def test_steps_that_do_not_fit_run_eagerly(model, tiny_config, device):
    _, runner = _runners(model, tiny_config, device, capture=False)
    graphs, kv = runner.decode_graphs, runner.kv
    table = kv.allocate(2)
    prefill = SeqChunk("p", [5, 6, 7], 0, table)
    assert not graphs.fits([prefill])
    assert not graphs.fits([SeqChunk("d", [5], 3, table, want_logits=False)])
    assert not graphs.fits([SeqChunk(i, [5], 3, table) for i in range(BATCH_BUCKETS[-1] + 1)])
    runner.execute([prefill])
    assert graphs.captured_buckets == []


def test_bad_chunks_get_the_eager_paths_errors(model, tiny_config, device):
    _, runner = _runners(model, tiny_config, device, capture=False)
    table = runner.kv.allocate(1)
    with pytest.raises(ValueError, match="block table holds 8 tokens"):
        runner.execute([SeqChunk("a", [5], 8, table)])
    with pytest.raises(ValueError, match="beyond"):
        runner.execute([SeqChunk("a", [5], tiny_config.max_position_embeddings, table)])


def _capture_all_then_decode(model, tiny_config, device, capture: bool) -> None:
    eager, graphed = _runners(model, tiny_config, device, capture=capture)
    graphs = graphed.decode_graphs
    max_context = 100  # 13 blocks of 8: widths 4, 8 and 16
    assert graphs.capture_all(max_context) == len(BATCH_BUCKETS) * 3
    every = graphs.captured_buckets
    assert every == sorted((b, w) for b in BATCH_BUCKETS for w in (4, 8, 16))
    prompts = _prompts([9, 30, 17])
    expected_tokens, expected_logits = greedy_decode(eager, prompts, steps=12)
    tokens, logits = greedy_decode(graphed, prompts, steps=12)
    assert tokens == expected_tokens
    for got, want in zip(logits, expected_logits):
        _close(got, want)
    assert graphs.captured_buckets == every  # nothing left to build on first use


def test_capture_all_builds_every_bucket_up_front(model, tiny_config, device):
    _capture_all_then_decode(model, tiny_config, device, capture=False)


def test_capture_needs_cuda(model, tiny_config, device):
    if device != "cpu":
        pytest.skip("checks the CPU refusal")
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(model, KVBlockPool(tiny_config, 8, 8), capture=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("lengths", [[5], [9, 30, 17], [3, 41, 12, 8, 26]])
def test_captured_graphs_decode_like_the_eager_path(tiny_config, lengths):
    model = LlamaModel(tiny_config, random_weights(tiny_config), device="cuda")
    _decodes_like_the_eager_path(*_runners(model, tiny_config, "cuda", capture=True), lengths)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphs_captured_at_load_decode_like_the_eager_path(tiny_config):
    model = LlamaModel(tiny_config, random_weights(tiny_config), device="cuda")
    _capture_all_then_decode(model, tiny_config, "cuda", capture=True)


def test_steps_without_a_safepoint_run_as_one_whole_step(model, tiny_config, device):
    """A step no safepoint may stop replays the bucket's whole-step graph; one with a safepoint the
    per-layer graphs, checking between them; both give the same logits (run eagerly on CPU)."""
    _, runner = _runners(model, tiny_config, device, capture=device == "cuda")
    graphs, kv = runner.decode_graphs, runner.kv
    ids = _prompts([20])[0]
    table = kv.allocate(3)
    runner.execute([SeqChunk("x", ids, 0, table, want_logits=False)])
    whole = runner.execute([SeqChunk("x", [7], 20, table)]).logits
    assert graphs.whole_step_runs == 1
    seen = []
    layered = runner.execute([SeqChunk("x", [7], 20, table)],
                             safepoint=lambda layer: seen.append(layer) or False).logits
    assert graphs.whole_step_runs == 1 and seen == list(range(1, tiny_config.num_layers + 1))
    graphs.whole_step = False
    per_layer = runner.execute([SeqChunk("x", [7], 20, table)]).logits
    assert graphs.whole_step_runs == 1
    _close(whole, layered)
    _close(whole, per_layer)


@pytest.mark.parametrize("policy, request_class", [("fcfs", "online"), ("coserve", "offline")])
def test_the_scheduler_replays_whole_steps_only_where_no_safepoint_may_stop_them(model, tiny_config, device,
                                                                                policy, request_class):
    """Online decode steps have no safepoint and replay the whole-step graph; coserve's offline
    batches are preemptible (ConServe §4.3) and replay the per-layer graphs, checking between them."""
    from backfill.sampling_params import SamplingParams
    from backfill.policy.latency_model import LatencyModel
    from backfill.types import GenerationRequest, RequestClass
    from backfill.serving.build import build_scheduler
    from backfill.serving.config import ServingConfig

    _, runner = _runners(model, tiny_config, device, capture=device == "cuda")
    scheduler = build_scheduler(runner, ServingConfig(policy=policy, max_model_len=64),
                                latency=LatencyModel((1, 4096), (1.0, 41.0)))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for prompt in _prompts([7, 12]):
        scheduler.add(GenerationRequest(prompt, params, RequestClass(request_class)))
    while scheduler.has_work():
        scheduler.step()
    graphs = runner.decode_graphs
    assert graphs.captured_buckets  # the decode steps ran through the graphs
    assert graphs.whole_step_runs == (5 if request_class == "online" else 0)


def _mixed_steps(lengths: dict[str, int]) -> list[list[tuple[str, int, int, bool]]]:
    """Steps of (sequence, first token, tokens, wants logits): prompt chunks beside decodes."""
    return [
        [("a", 0, 12, False), ("b", 0, lengths["b"], True)],                 # two prompt chunks
        [("a", 12, 8, True), ("b", lengths["b"], 1, True), ("c", 0, 5, False)],  # chunk, decode, chunk
        [("a", 20, 1, True), ("b", lengths["b"] + 1, 1, True), ("c", 5, 25, True)],  # decodes + the rest of c
        [("c", 30, 1, True), ("a", 21, 1, True), ("b", lengths["b"] + 2, 1, False)],  # decodes, one without logits
    ]


def _run_mixed(runner: ModelRunner, safepoint=None) -> list[torch.Tensor]:
    lengths = {"a": 20, "b": 7, "c": 30}
    tokens = dict(zip(lengths, _prompts(list(lengths.values()))))
    tables = {s: runner.kv.allocate(runner.kv.blocks_needed(n + 4)) for s, n in lengths.items()}
    out = []
    for step in _mixed_steps(lengths):
        chunks = [SeqChunk(s, (tokens[s] + [11, 12, 13, 14])[first:first + n], first, tables[s], want_logits=w)
                  for s, first, n, w in step]
        result = runner.execute(chunks, safepoint=safepoint)
        assert result.logit_seq_ids == [s for s, _, _, w in step if w]
        assert result.num_tokens == sum(n for _, _, n, _ in step)
        out.append(result.logits)
    return out


@pytest.mark.parametrize("per_layer", [False, True])
def test_mixed_steps_replay_the_buckets_with_the_eager_logits(model, tiny_config, device, per_layer):
    """Prompt chunks beside decodes, one row per token (capture off on CPU: the staging, padding and
    bucket choice the graphs replay). fp32 logits within 1e-4 of the eager forward's on CPU: only the
    summation order differs (padded keys, decode attention in place of causal SDPA)."""
    eager = ModelRunner(model, KVBlockPool(tiny_config, 96, 8, device=device))
    kv = KVBlockPool(tiny_config, 96, 8, device=device)
    graphs = DecodeGraphs(model, kv, capture=device == "cuda", mixed=True)
    graphed = ModelRunner(model, kv, graphs)
    safepoint = (lambda layer: False) if per_layer else None
    expected = _run_mixed(eager)
    got = _run_mixed(graphed, safepoint)
    for g, e in zip(got, expected):
        _close(g, e)
    assert graphs.mixed_runs == 4  # the last step is decodes only, one without logits: a mixed step too
    assert graphs.whole_step_runs == (0 if per_layer else 4)
    # Steps of 19, 14, 27 and 3 tokens padded to 32, 16, 32 and 4 rows; contexts up to 31 tokens: 4 blocks of 8.
    assert graphs.captured_buckets == [(4, 4), (16, 4), (32, 4)]


def test_mixed_steps_fit_up_to_the_largest_bucket_in_tokens(model, tiny_config, device):
    kv = KVBlockPool(tiny_config, 96, 8, device=device)
    graphs = DecodeGraphs(model, kv, capture=False, mixed=True)
    table = kv.allocate(12)
    largest = BATCH_BUCKETS[-1]
    assert graphs.fits([SeqChunk("p", [5] * largest, 0, table)])
    assert graphs.fits([SeqChunk("p", [5] * (largest - 1), 0, table), SeqChunk("d", [5], 3, table)])
    assert not graphs.fits([SeqChunk("p", [5] * largest, 0, table), SeqChunk("d", [5], 3, table)])
    assert not graphs.fits([])
    assert not DecodeGraphs(model, kv, capture=False).fits([SeqChunk("p", [5] * 4, 0, table)])  # mixed off
    runner = ModelRunner(model, kv, graphs)
    runner.execute([SeqChunk("p", [5] * (largest + 1), 0, table, want_logits=False)])  # eager: no bucket
    assert graphs.captured_buckets == [] and graphs.mixed_runs == 0
