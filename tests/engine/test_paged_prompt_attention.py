"""The C++ prompt attention (every prompt chunk of a step in one call) against causal SDPA per chunk,
its errors, and the model with it against the model without."""

import pytest
import torch
import torch.nn.functional as F

from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import LlamaModel
from backfill.engine.paged_attention import load_paged_prompt_attention
from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk
from tests.conftest import random_weights

kernel = load_paged_prompt_attention()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ toolchain to build the kernel")


def _reference(q, k_pool, v_pool, spans, tables):
    """One chunk at a time: gather its blocks, cut to its context, SDPA in fp32 with a causal mask
    that starts at the chunk's first position."""
    n_kv, hd = k_pool.shape[2], q.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for (start, count, first_pos), table in zip(spans.tolist(), tables):
        context = first_pos + count
        keys = k_pool.index_select(0, table).view(-1, n_kv, hd)[:context].transpose(0, 1).unsqueeze(0).float()
        values = v_pool.index_select(0, table).view(-1, n_kv, hd)[:context].transpose(0, 1).unsqueeze(0).float()
        queries = q[start:start + count].transpose(0, 1).unsqueeze(0).float()
        visible = torch.arange(context).unsqueeze(0) <= torch.arange(first_pos, context).unsqueeze(1)
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, enable_gqa=True)
        out[start:start + count] = o.squeeze(0).transpose(0, 1)
    return out


def _case(dtype, n_q, n_kv, head_dim, chunks, seed, block_size=16, num_blocks=96):
    """Pools, a q that is a view into a wider q/k/v tensor (as the model passes it), and spans laid
    end to end: chunks are (tokens, first position) pairs."""
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    spans, tables, start = [], [], 0
    for count, first_pos in chunks:
        blocks = -(-(first_pos + count) // block_size)
        tables.append(torch.tensor([free.pop() for _ in range(blocks)]))
        spans.append((start, count, first_pos))
        start += count
    width = max(len(t) for t in tables)
    padded = torch.stack([F.pad(t, (0, width - len(t))) for t in tables])
    qkv = torch.randn(start, n_q + 2 * n_kv, head_dim, generator=g).to(dtype)
    return qkv[:, :n_q], k_pool, v_pool, torch.tensor(spans), padded, tables


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("n_q, n_kv", [(9, 3), (4, 4), (8, 1)])
def test_kernel_matches_causal_sdpa_per_chunk(dtype, tol, n_q, n_kv):
    """Whole prompts and later chunks of long ones in one call: lengths of one token, of whole key
    tiles and off them, first positions inside and on block boundaries."""
    chunks = [(128, 0), (37, 0), (5, 40), (1, 0), (70, 200), (64, 64), (1, 300)]
    q, k_pool, v_pool, spans, padded, tables = _case(dtype, n_q, n_kv, 64, chunks, seed=n_q * 10 + n_kv)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    kernel(q, k_pool, v_pool, spans, padded, out)
    torch.testing.assert_close(out.float(), _reference(q, k_pool, v_pool, spans, tables), atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tiles", [True, False])
def test_keys_before_a_chunk_on_tiles_match_causal_sdpa(head_dim, tiles):
    """bf16 chunks after long contexts: on an AMX machine the keys before each chunk (whole key
    tiles) go through the tile routine for more query rows than one of its tasks takes, and the
    causal rest carries on from its softmax state; elsewhere, and with tiles=False, vectors only."""
    chunks = [(100, 700), (30, 1024), (3, 64), (16, 130)]
    q, k_pool, v_pool, spans, padded, tables = _case(torch.bfloat16, 9, 3, head_dim, chunks, seed=head_dim,
                                                     num_blocks=160)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    kernel(q * 2, k_pool, v_pool, spans, padded, out, tiles=tiles)
    torch.testing.assert_close(out.float(), _reference(q * 2, k_pool, v_pool, spans, tables), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tiles", [True, False])
def test_chunks_after_one_cached_prefix_match_causal_sdpa(dtype, tol, tiles):
    """Chunks whose tables start with the same blocks (one cached prompt, then each its own
    question), beside one with a different prefix and one that differs only in the prefix's last
    block: those sharing the blocks share one conversion of them (on tiles, on an AMX machine, one
    pass for all their rows), each still seeing only its own tokens after them."""
    chunks = [(30, 1024), (17, 1030), (90, 1024), (40, 1024), (5, 1060), (20, 1024)]
    q, k_pool, v_pool, spans, padded, tables = _case(dtype, 9, 3, 64, chunks, seed=7, num_blocks=500)
    for i in (1, 2, 4):  # the first 64 blocks of spans 1, 2 and 4 are span 0's
        padded[i, :64] = padded[0, :64]
        tables[i][:64] = tables[0][:64]
    padded[5, :63] = padded[0, :63]  # span 5 shares all but the prefix's last block
    tables[5][:63] = tables[0][:63]
    out = torch.empty(q.shape, dtype=dtype)
    kernel(q, k_pool, v_pool, spans, padded, out, tiles=tiles)
    torch.testing.assert_close(out.float(), _reference(q, k_pool, v_pool, spans, tables), atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", [8, 24, 128])
def test_kernel_takes_head_sizes_off_the_fixed_ones(head_dim):
    """64 and 128 are compiled with the head size fixed; others take the generic loops."""
    q, k_pool, v_pool, spans, padded, tables = _case(torch.float32, 6, 2, head_dim, [(33, 0), (20, 17)], seed=head_dim)
    out = torch.empty(q.shape)
    kernel(q * 3, k_pool, v_pool, spans, padded, out)  # peaked scores: the running softmax must rescale
    torch.testing.assert_close(out, _reference(q * 3, k_pool, v_pool, spans, tables), atol=1e-5, rtol=1e-5)


def test_kernel_leaves_rows_outside_the_spans():
    """A step's decode tokens sit between its prompt chunks; their rows are the decode kernel's."""
    q, k_pool, v_pool, _, padded, _ = _case(torch.float32, 4, 2, 16, [(3, 0), (4, 0)], seed=1)
    spans = torch.tensor([[0, 3, 0], [4, 3, 0]])  # token 3 is a decode
    out = torch.full(q.shape, 7.0)
    kernel(q, k_pool, v_pool, spans, padded, out)
    assert torch.equal(out[3], torch.full((4, 16), 7.0))
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("spans, tables, message", [
    ([[0, 4, 2]], [[0]], "context is longer than its block table"),
    ([[2, 3, 0]], [[0]], "lies outside q"),
    ([[0, 0, 0]], [[0]], "lies outside q"),
    ([[0, 3, 0]], [[9]], "block outside the pool"),
])
def test_kernel_rejects_spans_it_cannot_serve(spans, tables, message):
    pool = torch.zeros(4, 4, 2, 8)
    with pytest.raises(RuntimeError, match=message):
        kernel(torch.zeros(4, 2, 8), pool, pool, torch.tensor(spans), torch.tensor(tables), torch.zeros(4, 2, 8))


def test_kernel_rejects_mixed_dtypes():
    pool = torch.zeros(4, 4, 2, 8)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(torch.zeros(4, 2, 8, dtype=torch.bfloat16), pool, pool, torch.tensor([[0, 4, 0]]), torch.tensor([[0]]),
               torch.zeros(4, 2, 8, dtype=torch.bfloat16))


def test_model_with_kernel_equals_model_with_sdpa(tiny_config):
    """A step with a whole prompt, the second chunk of a longer one and decodes beside them."""
    weights = random_weights(tiny_config, seed=13)
    runners = [ModelRunner(LlamaModel(tiny_config, weights, paged_attention_kernel=True, paged_prompt_kernel=use),
                           KVBlockPool(tiny_config, 48, 8)) for use in (False, True)]
    assert runners[0].model.paged_prompt_attention is None and runners[1].model.paged_prompt_attention is not None
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 19, 41, 30)]
    logits = []
    for runner in runners:
        tables = [runner.kv.allocate(runner.kv.blocks_needed(len(p) + 2)) for p in prompts]
        for i, p in enumerate(prompts[:2]):
            runner.execute([SeqChunk(i, p, 0, tables[i])])
        runner.execute([SeqChunk(2, prompts[2][:20], 0, tables[2], want_logits=False)])
        step = [SeqChunk(0, [7], len(prompts[0]), tables[0]), SeqChunk(2, prompts[2][20:], 20, tables[2]),
                SeqChunk(1, [9], len(prompts[1]), tables[1]), SeqChunk(3, prompts[3], 0, tables[3])]
        logits.append(runner.execute(step).logits)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
