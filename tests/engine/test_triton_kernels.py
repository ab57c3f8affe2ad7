"""The Triton kernels (engine/triton_attention.py, engine/triton_fused.py) against the torch path.

On CPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), on tiny shapes;
BACKFILL_TEST_DEVICE=cuda runs the same tests compiled on a GPU. Each family's layout is covered:
plain Llama (GQA), Qwen2's q/k/v biases, Qwen3's q/k norm with a head size that is no power of two.
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from backfill.engine.config import ModelConfig  # noqa: E402
from backfill.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from backfill.engine.kv_pool import KVBlockPool  # noqa: E402
from backfill.engine.model import AttentionMetadata, LlamaModel  # noqa: E402
from backfill.engine.runner import ModelRunner  # noqa: E402
from backfill.engine.triton_attention import (MIN_SPLIT_TOKENS, paged_decode_attention, split_count,  # noqa: E402
                                              tokens_per_step)
from backfill.engine.triton_fused import add_rms_norm_, qkv_rope_write, silu_mul  # noqa: E402
from backfill.engine.weights import random_model  # noqa: E402
from runner_greedy import greedy_decode  # noqa: E402

FAMILIES = {  # two layers keep the interpreter's whole-step tests short
    "llama-gqa": dict(num_layers=2),
    "qwen2-bias": dict(num_layers=2, qkv_bias=True),
    "qwen3-qk-norm": dict(num_layers=2, qk_norm=True, head_dim=24),
}


def _family_model(name: str, device: str, cuda_kernels: str = "torch") -> LlamaModel:
    cfg = ModelConfig.tiny(**FAMILIES[name])
    weights = random_model(cfg, seed=1)
    g = torch.Generator().manual_seed(2)
    for key, value in weights.items():  # norms and biases away from 1 and 0, so a dropped one shows
        if key.endswith("norm.weight") or key.endswith(".bias"):
            weights[key] = value + 0.3 * torch.randn(value.shape, generator=g)
        elif value.dim() == 2:
            weights[key] = value * 25  # std 0.5: logits far apart, so greedy tokens are not near ties
    return LlamaModel(cfg, weights, device=device, cuda_kernels=cuda_kernels)


def _reference_attention(q, k_pool, v_pool, tables, lens):
    """Gather each sequence's context and run SDPA over it (GQA by repeating the KV heads)."""
    out = []
    n_q, n_kv = q.shape[1], k_pool.shape[2]
    for i, n in enumerate(lens.tolist()):
        keys = k_pool[tables[i]].flatten(0, 1)[:n].transpose(0, 1).float()    # [n_kv, n, hd]
        values = v_pool[tables[i]].flatten(0, 1)[:n].transpose(0, 1).float()
        keys, values = (t.repeat_interleave(n_q // n_kv, 0) for t in (keys, values))
        out.append(F.scaled_dot_product_attention(q[i].float().unsqueeze(1), keys, values).squeeze(1))
    return torch.stack(out).to(q.dtype)


@pytest.mark.parametrize("n_q, n_kv, hd", [(4, 2, 16), (4, 4, 16), (8, 1, 24), (6, 2, 32)])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_attention_matches_gather_and_sdpa(device, n_q, n_kv, hd, splits):
    g = torch.Generator().manual_seed(n_q * 100 + hd)
    blocks, bs = 40, 8
    k_pool = torch.randn(blocks, bs, n_kv, hd, generator=g).to(device)
    v_pool = torch.randn(blocks, bs, n_kv, hd, generator=g).to(device)
    lens = torch.tensor([1, 9, 70, 33], device=device)
    width = 10  # blocks per table: 80 tokens, scattered over the pool
    tables = torch.randperm(blocks, generator=g)[:4 * width].view(4, width).to(device)
    q = torch.randn(4, n_q, hd, generator=g).to(device)
    got = paged_decode_attention(q, k_pool, v_pool, tables, lens, num_splits=splits)
    torch.testing.assert_close(got, _reference_attention(q, k_pool, v_pool, tables, lens), atol=1e-5, rtol=1e-5)


def test_paged_attention_in_bfloat16(device):
    g = torch.Generator().manual_seed(5)
    k_pool, v_pool = (torch.randn(12, 16, 2, 16, generator=g).to(device, torch.bfloat16) for _ in range(2))
    tables = torch.arange(12, device=device).view(2, 6)
    lens = torch.tensor([90, 17], device=device)
    q = torch.randn(2, 4, 16, generator=g).to(device, torch.bfloat16)
    got = paged_decode_attention(q, k_pool, v_pool, tables, lens, num_splits=2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, _reference_attention(q, k_pool, v_pool, tables, lens), atol=2e-2, rtol=2e-2)


def test_split_count_fills_the_device_and_keeps_stretches_long():
    assert split_count(1, 8, 4096, target_programs=528) == 4096 // MIN_SPLIT_TOKENS  # capped by stretch length
    assert split_count(1, 8, 128, target_programs=528) == 1
    assert split_count(64, 8, 8192, target_programs=528) == 2
    assert split_count(64, 8, 8192, target_programs=1) == 1
    with pytest.raises(ValueError, match="non-empty"):
        split_count(0, 8, 128, target_programs=4)
    assert [tokens_per_step(g, d) for g, d in ((4, 128), (1, 128), (1, 64), (8, 24), (16, 256))] == [16, 64, 64, 32, 16]


def test_paged_attention_rejects_mismatched_shapes(device):
    pool = torch.zeros(4, 8, 2, 16, device=device)
    tables = torch.zeros(2, 2, dtype=torch.long, device=device)
    lens = torch.ones(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="does not fit the pool"):
        paged_decode_attention(torch.zeros(2, 3, 16, device=device), pool, pool, tables, lens)
    with pytest.raises(ValueError, match="batch of 3"):
        paged_decode_attention(torch.zeros(3, 4, 16, device=device), pool, pool, tables, lens)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_qkv_rope_write_matches_split_qkv_and_kv_write(device, family):
    model = _family_model(family, device)
    cfg = model.config
    layer = model.layers[1]
    g = torch.Generator().manual_seed(3)
    tokens = 5
    qkv = torch.randn(tokens, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, generator=g).to(device)
    positions = torch.tensor([0, 7, 100, 33, 511], device=device)
    slots = torch.tensor([3, 17, 40, 8, 63], device=device)
    kv_ref, kv_got = (KVBlockPool(cfg, 8, 8, device=device) for _ in range(2))
    cos = model.rope_cos.index_select(0, positions).unsqueeze(1)
    sin = model.rope_sin.index_select(0, positions).unsqueeze(1)
    q_ref, k_ref, v_ref = model.split_qkv(layer, qkv, cos, sin)
    meta = AttentionMetadata(positions, slots, None, None, None, [], slots)
    model._write_kv(1, k_ref, v_ref, meta, kv_ref)
    q = qkv_rope_write(qkv, layer.get("qkv_bias"), layer.get("qk_norm"), cfg.rms_norm_eps, model.rope_cos,
                       model.rope_sin, positions, slots, kv_got.k_slots[1], kv_got.v_slots[1],
                       cfg.num_heads, cfg.num_kv_heads)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_got.k, kv_ref.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_got.v, kv_ref.v, atol=1e-5, rtol=1e-5)


def test_add_rms_norm_and_silu_mul_match_torch(device):
    g = torch.Generator().manual_seed(4)
    residual = torch.randn(3, 96, generator=g).to(device)  # 96: no power of two
    delta, weight = torch.randn(3, 96, generator=g).to(device), torch.randn(96, generator=g).to(device)
    expected_residual = residual + delta
    expected = F.rms_norm(expected_residual, (96,), weight, 1e-5)
    normed = add_rms_norm_(residual, delta, weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(normed, expected, atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(3, 2 * 1500, generator=g).to(device)  # two column blocks, the second ragged
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        add_rms_norm_(residual, delta[:, :8], weight, 1e-5)
    with pytest.raises(ValueError, match="even"):
        silu_mul(gate_up[:, :-1])


@pytest.mark.parametrize("family, graphed", [(family, True) for family in sorted(FAMILIES)]
                         + [("llama-gqa", False)])  # eagerly only the attention kernel runs: one family
def test_triton_decode_matches_the_torch_path(device, family, graphed):
    """Whole decode steps: the fused layers in the CUDA-graph parts (captured on a GPU, eager on CPU),
    or the eager forward with the Triton attention; greedy tokens equal, logits close."""
    torch_model, triton_model = _family_model(family, device), _family_model(family, device, "triton")
    cfg = torch_model.config
    runners = []
    for model in (torch_model, triton_model):
        kv = KVBlockPool(cfg, 40, 8, device=device)
        graphs = DecodeGraphs(model, kv, capture=device == "cuda") if graphed else None
        runners.append(ModelRunner(model, kv, graphs))
    prompts = [[5 + i for i in range(n)] for n in (3, 21, 9)]
    expected_tokens, expected_logits = greedy_decode(runners[0], prompts, steps=3)
    tokens, logits = greedy_decode(runners[1], prompts, steps=3)
    assert tokens == expected_tokens
    tol = 1e-4 if device == "cpu" else 2e-2
    for got, want in zip(logits, expected_logits):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if graphed:
        assert runners[1].decode_graphs.whole_step_runs == 3


def test_model_rejects_unknown_kernels(tiny_config):
    with pytest.raises(ValueError, match="torch or triton"):
        LlamaModel(tiny_config, random_model(tiny_config), cuda_kernels="cutlass")
