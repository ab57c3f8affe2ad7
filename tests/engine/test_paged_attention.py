"""The C++ paged decode attention against gather + SDPA, and the model with it against the model without."""

import pytest
import torch
import torch.nn.functional as F

from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import LlamaModel
from backfill.engine.paged_attention import load_paged_decode_attention
from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk
from tests.conftest import random_weights

kernel = load_paged_decode_attention()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ toolchain to build the kernel")


def _reference(q, k_pool, v_pool, tables, lens):
    """One sequence at a time: gather its blocks, cut to length, SDPA in fp32 with the heads grouped."""
    n_q, n_kv, hd = q.shape[1], k_pool.shape[2], q.shape[2]
    out = []
    for b in range(q.shape[0]):
        keys = k_pool.index_select(0, tables[b]).view(-1, n_kv, hd)[:lens[b]].transpose(0, 1).unsqueeze(0)
        values = v_pool.index_select(0, tables[b]).view(-1, n_kv, hd)[:lens[b]].transpose(0, 1).unsqueeze(0)
        grouped = q[b].reshape(1, n_kv, n_q // n_kv, hd).float()
        out.append(F.scaled_dot_product_attention(grouped, keys.float(), values.float()).reshape(n_q, hd))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n_q, n_kv", [(9, 3), (4, 4), (8, 4), (8, 2), (8, 1)])  # groups 3, 1, 2, 4, 8
def test_kernel_matches_gather_and_sdpa(dtype, tol, n_q, n_kv):
    g = torch.Generator().manual_seed(n_q * 10 + n_kv)
    block_size, hd, num_blocks = 16, 64, 40
    k_pool = torch.randn(num_blocks, block_size, n_kv, hd, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, n_kv, hd, generator=g).to(dtype)
    # Lengths ending mid-block, on a block boundary and at one token; tables padded past the length.
    lens = torch.tensor([37, 64, 1, 80])
    tables = torch.randperm(num_blocks, generator=g)[:4 * 5].view(4, 5)
    q = torch.randn(4, n_q, hd, generator=g).to(dtype)
    out = kernel(q, k_pool, v_pool, tables, lens)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), _reference(q, k_pool, v_pool, tables, lens), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [8, 24, 64, 128])
def test_kernel_splits_a_lone_long_context_across_threads(dtype, tol, head_dim):
    """One sequence has too few (sequence, head) pairs for the threads: its context is cut into
    stretches whose partial softmaxes are merged. Head sizes off the vector width take the tail path."""
    g = torch.Generator().manual_seed(head_dim)
    block_size, n_q, n_kv, num_blocks = 16, 6, 2, 48
    k_pool = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:40].view(1, 40)
    q = torch.randn(1, n_q, head_dim, generator=g).to(dtype) * 3  # peaked scores: the merge must rescale
    for length in (1, 17, 333, 640):
        lens = torch.tensor([length])
        torch.testing.assert_close(kernel(q, k_pool, v_pool, tables, lens).float(),
                                   _reference(q, k_pool, v_pool, tables, lens), atol=tol, rtol=tol)


def test_kernel_reads_a_layer_of_the_pool_in_place(tiny_config):
    """The model passes kv.k[layer], a view into the whole pool: the kernel must read that layer."""
    pool = KVBlockPool(tiny_config, 12, 8)
    pool.k.normal_()
    pool.v.normal_()
    tables, lens = torch.tensor([[3, 7, 1]]), torch.tensor([20])
    q = torch.randn(1, tiny_config.num_heads, tiny_config.head_dim)
    for layer in (0, tiny_config.num_layers - 1):
        out = kernel(q, pool.k[layer], pool.v[layer], tables, lens)
        torch.testing.assert_close(out, _reference(q, pool.k[layer], pool.v[layer], tables, lens), atol=1e-5, rtol=1e-5)


def test_kernel_rejects_a_length_past_its_table():
    pool = torch.zeros(4, 16, 2, 8)
    with pytest.raises(RuntimeError, match="context length outside its block table"):
        kernel(torch.zeros(1, 2, 8), pool, pool, torch.tensor([[0, 1]]), torch.tensor([33]))


def test_model_with_kernel_equals_model_with_sdpa(tiny_config):
    """A step mixing a prefill chunk with decodes of different lengths: same logits either way."""
    weights = random_weights(tiny_config, seed=11)
    runners = [ModelRunner(LlamaModel(tiny_config, weights, paged_attention_kernel=use), KVBlockPool(tiny_config, 32, 8))
               for use in (False, True)]
    assert runners[0].model.paged_decode_attention is None and runners[1].model.paged_decode_attention is not None
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 19, 33)]
    logits = []
    for runner in runners:
        tables = [runner.kv.allocate(runner.kv.blocks_needed(len(p) + 2)) for p in prompts]
        for i, p in enumerate(prompts[:2]):
            runner.execute([SeqChunk(i, p, 0, tables[i])])
        step = [SeqChunk(0, [7], len(prompts[0]), tables[0]), SeqChunk(1, [9], len(prompts[1]), tables[1]),
                SeqChunk(2, prompts[2], 0, tables[2])]
        logits.append(runner.execute(step).logits)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


def _shared_prefix_batch(g, dtype, n_q, n_kv, head_dim, groups, num_blocks=200, block_size=16):
    """A pool and a batch whose sequences start with shared blocks: groups is a list of (members,
    shared blocks); each member then has blocks of its own and a length ending anywhere in its last."""
    k_pool = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, lens = [], []
    for members, shared in groups:
        prefix = [free.pop() for _ in range(shared)]
        for _ in range(members):
            own = int(torch.randint(1, 4, (), generator=g))
            tables.append(prefix + [free.pop() for _ in range(own)])
            lens.append(len(tables[-1]) * block_size - int(torch.randint(0, block_size, (), generator=g)))
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(tables), n_q, head_dim, generator=g).to(dtype) * 2  # peaked: the merge must rescale
    return q, k_pool, v_pool, table, torch.tensor(lens)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n_q, n_kv, head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 24)])
@pytest.mark.parametrize("tiles", [True, False])
def test_shared_prefixes_read_once_match_each_sequence_alone(dtype, tol, n_q, n_kv, head_dim, tiles):
    """Two groups sharing long prefixes (one of 21 members, more query rows than a tile), a pair
    sharing the minimum, and a sequence alone: the same attention as gather + SDPA, and as the
    kernel walking every table alone (AMX tiles where this CPU has them, else vectors)."""
    g = torch.Generator().manual_seed(n_q + head_dim)
    q, k_pool, v_pool, tables, lens = _shared_prefix_batch(g, dtype, n_q, n_kv, head_dim,
                                                           [(21, 9), (3, 30), (2, 2), (1, 5)])
    alone = kernel(q, k_pool, v_pool, tables, lens, min_shared_blocks=0)
    shared = kernel(q, k_pool, v_pool, tables, lens, tiles=tiles)
    torch.testing.assert_close(shared.float(), _reference(q, k_pool, v_pool, tables, lens), atol=tol, rtol=tol)
    torch.testing.assert_close(shared.float(), alone.float(), atol=tol, rtol=tol)


def test_a_member_that_diverges_early_runs_alone():
    """Among sequences with the same first block, one leaves the shared prefix after two blocks: the
    group keeps the long prefix for the others and that sequence walks its own table."""
    g = torch.Generator().manual_seed(3)
    q, k_pool, v_pool, tables, lens = _shared_prefix_batch(g, torch.float32, 6, 2, 64, [(4, 12)])
    tables[3, 2:12] = torch.tensor(range(150, 160))  # blocks no other sequence maps
    torch.testing.assert_close(kernel(q, k_pool, v_pool, tables, lens),
                               _reference(q, k_pool, v_pool, tables, lens), atol=1e-5, rtol=1e-5)


def test_a_shared_block_holding_a_members_newest_token_is_not_shared():
    """Two tables naming the same blocks throughout (one ending mid-block): only blocks before each
    one's newest token are read as shared; the rest each sequence reads alone."""
    g = torch.Generator().manual_seed(4)
    k_pool = torch.randn(12, 16, 2, 64, generator=g)
    v_pool = torch.randn(12, 16, 2, 64, generator=g)
    tables = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    lens = torch.tensor([64, 50])
    q = torch.randn(2, 4, 64, generator=g)
    torch.testing.assert_close(kernel(q, k_pool, v_pool, tables, lens),
                               _reference(q, k_pool, v_pool, tables, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_keys_written_then_attended_as_a_separate_write(dtype):
    """With k_new, v_new and slots the kernel writes the step's rows into the pools first: the pools
    and the outputs equal an index_copy followed by the plain call. q, k_new and v_new are slices of
    one wider product, as the compiled q/k/v piece hands them over."""
    g = torch.Generator().manual_seed(7)
    block_size, n_q, n_kv, hd, num_blocks = 16, 9, 3, 64, 24
    k_pool = torch.randn(num_blocks, block_size, n_kv, hd, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, n_kv, hd, generator=g).to(dtype)
    lens = torch.tensor([17, 32, 1, 40])
    tables = torch.randperm(num_blocks, generator=g)[:4 * 3].view(4, 3)
    slots = torch.stack([tables[b, (n - 1) // block_size] * block_size + (n - 1) % block_size
                         for b, n in enumerate(lens.tolist())])
    product = torch.randn(4, n_q + 2 * n_kv, hd, generator=g).to(dtype)
    q, k_new, v_new = product[:, :n_q], product[:, n_q:n_q + n_kv], product[:, n_q + n_kv:]
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    k_ref.view(-1, n_kv, hd).index_copy_(0, slots, k_new)
    v_ref.view(-1, n_kv, hd).index_copy_(0, slots, v_new)
    expected = kernel(q.contiguous(), k_ref, v_ref, tables, lens)
    out = kernel(q, k_pool, v_pool, tables, lens, k_new=k_new, v_new=v_new, slots=slots)
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="come together"):
        kernel(q, k_pool, v_pool, tables, lens, k_new=k_new)
    with pytest.raises(RuntimeError, match="slot outside the pool"):
        kernel(q, k_pool, v_pool, tables, lens, k_new=k_new, v_new=v_new, slots=slots + num_blocks * block_size)
