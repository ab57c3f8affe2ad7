"""The paged-attention model against HF transformers' Llama on tiny random weights."""

import pytest
import torch

from backfill.engine.config import ModelConfig
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import LM_HEAD_SLICES, LlamaModel
from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk

transformers = pytest.importorskip("transformers")


def _hf_reference(cfg: ModelConfig):
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=True)
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(hf_cfg).eval()


@pytest.fixture(scope="module")
def setup(tiny_config, device):
    hf = _hf_reference(tiny_config)
    model = LlamaModel(tiny_config, dict(hf.state_dict()), device=device)
    return hf, ModelRunner(model, KVBlockPool(tiny_config, num_blocks=128, block_size=8, device=device))


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # TF32 / reduced-precision kernels on GPUs differ from the CPU reference in the 4th digit.
    tol = 1e-4 if actual.device.type == "cpu" else 2e-2
    torch.testing.assert_close(actual.cpu(), expected, atol=tol, rtol=tol)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_logits_match_hf(setup):
    hf, runner = setup
    ids = _prompt(37, 0)
    table = runner.kv.allocate(runner.kv.blocks_needed(len(ids)))
    out = runner.execute([SeqChunk("a", ids, 0, table)])
    _close(out.logits[0], _hf_logits(hf, ids)[-1])
    runner.kv.free(table)


def test_chunked_prefill_equals_whole_prefill(setup):
    hf, runner = setup
    ids = _prompt(45, 1)
    table = runner.kv.allocate(runner.kv.blocks_needed(len(ids)))
    for start, end in [(0, 11), (11, 12), (12, 30)]:
        runner.execute([SeqChunk("a", ids[start:end], start, table, want_logits=False)])
    out = runner.execute([SeqChunk("a", ids[30:], 30, table)])
    _close(out.logits[0], _hf_logits(hf, ids)[-1])
    runner.kv.free(table)


def test_mixed_batch_equals_one_at_a_time(setup):
    hf, runner = setup
    prompts = [_prompt(n, 10 + n) for n in (5, 17, 33, 8)]
    tables = [runner.kv.allocate(runner.kv.blocks_needed(len(p) + 1)) for p in prompts]
    # Sequences 0 and 1 are already prefilled and decode; 2 and 3 prefill in the same step.
    for i in (0, 1):
        runner.execute([SeqChunk(i, prompts[i][:-1], 0, tables[i], want_logits=False)])
    chunks = [SeqChunk(0, prompts[0][-1:], len(prompts[0]) - 1, tables[0]),
              SeqChunk(2, prompts[2], 0, tables[2]),
              SeqChunk(1, prompts[1][-1:], len(prompts[1]) - 1, tables[1]),
              SeqChunk(3, prompts[3][:4], 0, tables[3])]
    out = runner.execute(chunks)
    assert out.logit_seq_ids == [0, 2, 1, 3]
    expected = [prompts[0], prompts[2], prompts[1], prompts[3][:4]]
    for row, ids in enumerate(expected):
        _close(out.logits[row], _hf_logits(hf, ids)[-1])
    for t in tables:
        runner.kv.free(t)


def test_abort_at_safepoint_then_rerun_equals_no_abort(setup):
    _, runner = setup
    ids = _prompt(20, 3)
    clean = runner.kv.allocate(3)
    runner.execute([SeqChunk("c", ids, 0, clean, want_logits=False)])
    expected = runner.execute([SeqChunk("c", [7], 20, clean)]).logits

    table = runner.kv.allocate(3)
    runner.execute([SeqChunk("x", ids, 0, table, want_logits=False)])
    seen = []

    def stop_at_two(layer: int) -> bool:
        seen.append(layer)
        return layer == 2

    aborted = runner.execute([SeqChunk("x", [9], 20, table)], safepoint=stop_at_two)
    assert aborted.aborted and aborted.aborted_at_layer == 2 and aborted.logits is None
    # Checked before each layer and twice inside it (after attention, after gate/up).
    assert seen == [0, 0, 1, 1, 1, 2]
    # The aborted step wrote KV for position 20 in layers 0-1 only; re-running overwrites it.
    rerun = runner.execute([SeqChunk("x", [7], 20, table)], safepoint=lambda layer: False)
    torch.testing.assert_close(rerun.logits, expected)
    runner.kv.free(clean)
    runner.kv.free(table)


def test_lm_head_has_safepoints_and_aborts_cleanly(setup, tiny_config):
    _, runner = setup
    ids = _prompt(12, 5)
    table = runner.kv.allocate(2)
    expected = runner.execute([SeqChunk("h", ids, 0, table)]).logits
    layers = tiny_config.num_layers
    seen = []

    def record(layer: int) -> bool:
        seen.append(layer)
        return False

    sliced = runner.execute([SeqChunk("h", ids, 0, table)], safepoint=record)
    # After the last layer, once more between each pair of LM head slices.
    assert seen[-LM_HEAD_SLICES:] == [layers] * LM_HEAD_SLICES
    torch.testing.assert_close(sliced.logits, expected)
    calls = []

    def stop_in_lm_head(layer: int) -> bool:
        calls.append(layer)
        return len(calls) == len(seen)  # the last check: between the last two slices

    aborted = runner.execute([SeqChunk("h", ids, 0, table)], safepoint=stop_in_lm_head)
    assert aborted.aborted and aborted.aborted_at_layer == layers
    torch.testing.assert_close(runner.execute([SeqChunk("h", ids, 0, table)]).logits, expected)
    runner.kv.free(table)


def test_bfloat16_close_to_fp32(setup, tiny_config, device):
    hf, _ = setup
    model = LlamaModel(tiny_config, dict(hf.state_dict()), dtype=torch.bfloat16, device=device)
    runner = ModelRunner(model, KVBlockPool(tiny_config, 16, 8, dtype=model.dtype, device=device))
    ids = _prompt(12, 4)
    out = runner.execute([SeqChunk("b", ids, 0, runner.kv.allocate(2))])
    ref = _hf_logits(hf, ids)[-1]
    assert out.logits.dtype == torch.float32
    assert (out.logits[0].cpu() - ref).abs().max() < 0.05 * ref.abs().max() + 0.05


def test_runner_rejects_short_block_table(setup):
    _, runner = setup
    with pytest.raises(ValueError, match="block table"):
        runner.execute([SeqChunk("s", list(range(3, 30)), 0, [0])])


def test_runner_rejects_positions_beyond_context(setup, tiny_config):
    _, runner = setup
    with pytest.raises(ValueError, match="beyond"):
        runner.execute([SeqChunk("s", [3], tiny_config.max_position_embeddings, list(range(100)))])


def test_plain_blas_layout_matches_hf_too(tiny_config, device, monkeypatch):
    """BACKFILL_CPU_MATMUL=blas (or a device without oneDNN packing) keeps the plain layout."""
    monkeypatch.setenv("BACKFILL_CPU_MATMUL", "blas")
    hf = _hf_reference(tiny_config)
    model = LlamaModel(tiny_config, dict(hf.state_dict()), device=device)
    assert model.matmul_kernel == "torch.mm"
    runner = ModelRunner(model, KVBlockPool(tiny_config, num_blocks=16, block_size=8, device=device))
    ids = _prompt(21, 5)
    out = runner.execute([SeqChunk("a", ids, 0, runner.kv.allocate(runner.kv.blocks_needed(len(ids))))])
    _close(out.logits[0], _hf_logits(hf, ids)[-1])


@pytest.mark.parametrize("stop_at_call", [1, 3, 5, 6, "head-1", "head-2", "head-4"])
def test_aborted_step_continued_from_its_safepoint_equals_no_abort(setup, tiny_config, stop_at_call):
    """Each stage (before attention, before the MLP, before the down projection) and, at "head-k",
    the k-th safepoint past the last layer: before the final norm, then between LM head slices."""
    _, runner = setup
    prompts = [_prompt(9, 20), _prompt(14, 21)]
    tables = [runner.kv.allocate(3) for _ in prompts]
    for i, ids in enumerate(prompts):
        runner.execute([SeqChunk(i, ids[:-1], 0, tables[i], want_logits=False)])
    chunks = [SeqChunk(i, ids[-1:], len(ids) - 1, tables[i]) for i, ids in enumerate(prompts)]
    chunks.append(SeqChunk("p", _prompt(6, 22), 0, runner.kv.allocate(1)))  # and a prefill
    expected = runner.execute(chunks).logits
    calls = []

    def stop_once(layer: int) -> bool:
        calls.append(layer)
        if isinstance(stop_at_call, str):
            return layer == tiny_config.num_layers and calls.count(layer) == int(stop_at_call.removeprefix("head-"))
        return len(calls) == stop_at_call

    aborted = runner.execute(chunks, safepoint=stop_once)
    assert aborted.aborted and aborted.suspended is not None
    resumed = runner.execute(chunks, safepoint=lambda layer: False, resume=aborted.suspended)
    assert not resumed.aborted and resumed.logit_seq_ids == [0, 1, "p"]
    torch.testing.assert_close(resumed.logits, expected)
    runner.kv.free(chunks[2].block_table)
    for t in tables:
        runner.kv.free(t)
