"""Content-addressed KV blocks on constructed pool states: addresses, reference counts, eviction
order (offline-only blocks first, least recently used first) and adapters never sharing."""

import pytest

from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.prefix_cache import block_hash, extend_hashes, root_hash
from backfill.errors import OutOfBlocksError

BS = 4


def _hashes(pool: KVBlockPool, tokens: list[int], extra: str = "") -> list[bytes]:
    out: list[bytes] = []
    extend_hashes(out, pool.hash_root, tokens, BS, len(tokens) // BS, extra)
    return out


def _cached_sequence(pool: KVBlockPool, tokens: list[int], online: bool = False, extra: str = "") -> list[int]:
    """Blocks for tokens, registered as a request would after computing them."""
    table = pool.allocate(len(tokens) // BS)
    for block, h in zip(table, _hashes(pool, tokens, extra)):
        assert pool.register(block, h, online)
    return table


def test_addresses_chain_the_prefix_and_the_extra_key():
    root = root_hash("m", "torch.bfloat16", "4")
    a = block_hash(root, [1, 2, 3, 4])
    assert a == block_hash(root, [1, 2, 3, 4]) and len(a) == 16
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(block_hash(root, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert block_hash(root, [1, 2, 3, 4], "adapter-a") != block_hash(root, [1, 2, 3, 4], "adapter-b") != a
    assert root != root_hash("m", "torch.float32", "4") and root != root_hash("other", "torch.bfloat16", "4")
    with pytest.raises(ValueError, match="need 8 tokens"):
        extend_hashes([], root, [1, 2, 3], BS, 2)


def test_shared_blocks_are_reference_counted(tiny_config):
    pool = KVBlockPool(tiny_config, num_blocks=8, block_size=BS)
    tokens = list(range(12))
    first = _cached_sequence(pool, tokens)
    second = pool.take_cached(_hashes(pool, tokens + [50, 51, 52, 53]), online=False)
    assert second == first and [pool.ref_count(b) for b in first] == [2, 2, 2]
    assert pool.num_free == 5
    pool.free(first)
    assert [pool.ref_count(b) for b in first] == [1, 1, 1] and pool.num_free == 5
    pool.free(second)
    # Free again, and still findable: a later prompt maps them without computing.
    assert pool.num_free == 8 and pool.num_cached_free == 3
    assert pool.cached_blocks(_hashes(pool, tokens)) == first
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([first[0]])
    with pytest.raises(ValueError, match="not allocated"):
        pool.register(first[0], b"x" * 16, online=False)


def test_a_duplicate_address_keeps_the_first_block_and_the_copy_is_plain(tiny_config):
    pool = KVBlockPool(tiny_config, num_blocks=4, block_size=BS)
    first = _cached_sequence(pool, [1, 2, 3, 4])
    twin = pool.allocate(1)
    assert not pool.register(twin[0], _hashes(pool, [1, 2, 3, 4])[0], online=False)
    assert not pool.register(first[0], _hashes(pool, [1, 2, 3, 4])[0], online=False)  # registered already
    pool.free(twin)
    assert pool.num_cached_free == 0 and pool.num_cached == 1


def test_eviction_takes_plain_blocks_then_offline_lru_then_online(tiny_config):
    pool = KVBlockPool(tiny_config, num_blocks=6, block_size=BS)
    online = _cached_sequence(pool, [9] * 8, online=True)            # 2 blocks an online request used
    old = _cached_sequence(pool, [1] * 4)                             # offline, freed first: least recent
    new = _cached_sequence(pool, [2] * 4)
    pool.free(online)
    pool.free(old)
    pool.free(new)
    assert pool.num_free == 6 and pool.num_cached_free == 4
    plain = pool.allocate(2)                                          # never-cached blocks go first
    assert set(plain).isdisjoint(online + old + new) and pool.evictions == 0
    assert pool.allocate(1) == old and pool.cached_blocks(_hashes(pool, [1] * 4)) == []
    assert pool.allocate(1) == new
    # Only now the online class, least recently used first; an offline burst cannot reach it before.
    assert pool.cached_blocks(_hashes(pool, [9] * 8)) == online
    assert pool.allocate(1) == [online[1]] and pool.evictions == 3  # a table's tail is freed as older
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)


def test_a_hit_refreshes_recency_and_an_online_hit_promotes_the_block(tiny_config):
    pool = KVBlockPool(tiny_config, num_blocks=3, block_size=BS)
    a, b, c = (_cached_sequence(pool, [t] * 4) for t in (1, 2, 3))
    for table in (a, b, c):
        pool.free(table)
    pool.free(pool.take_cached(_hashes(pool, [1] * 4), online=False))   # a: most recently used now
    pool.free(pool.take_cached(_hashes(pool, [2] * 4), online=True))    # b: online class
    assert pool.num_online_reused_free == 1
    assert pool.allocate(1) == c and pool.allocate(1) == a and pool.allocate(1) == b


def test_blocks_online_requests_found_cached_outlast_those_one_computed(tiny_config):
    pool = KVBlockPool(tiny_config, num_blocks=3, block_size=BS)
    shared = _cached_sequence(pool, [1] * 4, online=True)
    pool.free(shared)
    pool.free(pool.take_cached(_hashes(pool, [1] * 4), online=True))    # a second chat found it
    own = _cached_sequence(pool, [2] * 4, online=True)                  # one chat's own tail, newer
    pool.free(own)
    assert (pool.num_cached_free, pool.num_online_reused_free) == (2, 1)
    plain = pool.allocate(1)
    assert pool.allocate(1) == own and pool.allocate(1) == shared and plain not in (own, shared)


def test_blocks_never_match_across_adapters(tiny_config):
    pool = KVBlockPool(tiny_config, num_blocks=8, block_size=BS)
    tokens = list(range(8))
    table = _cached_sequence(pool, tokens, extra="adapter-a")
    assert pool.cached_blocks(_hashes(pool, tokens, "adapter-b")) == []
    assert pool.cached_blocks(_hashes(pool, tokens)) == []
    assert pool.take_cached(_hashes(pool, tokens, "adapter-a"), online=False) == table


def test_free_cached_blocks_are_reclaimable_and_forgotten(tiny_config):
    pool = KVBlockPool(tiny_config, num_blocks=4, block_size=BS)
    table = _cached_sequence(pool, list(range(8)))
    with pytest.raises(ValueError, match="cannot retire allocated"):
        pool.retire(table)
    pool.free(table)
    assert not any(pool.is_allocated(b) for b in table)   # what a node runtime checks before reclaiming
    pool.retire(table)
    assert pool.num_usable == 2 and pool.num_free == 2 and pool.num_cached == 0
    assert pool.cached_blocks(_hashes(pool, list(range(8)))) == []
    pool.admit(table)
    assert pool.num_free == 4


def test_with_caching_off_nothing_is_registered(tiny_config):
    pool = KVBlockPool(tiny_config, num_blocks=4, block_size=BS, prefix_caching=False)
    table = pool.allocate(1)
    assert not pool.register(table[0], _hashes(pool, [1, 2, 3, 4])[0], online=False)
    pool.free(table)
    assert pool.num_cached == 0 and pool.num_cached_free == 0


def test_clear_cache_makes_cached_blocks_plain(tiny_config):
    pool = KVBlockPool(tiny_config, num_blocks=4, block_size=BS)
    held = _cached_sequence(pool, list(range(4)))
    pool.free(_cached_sequence(pool, list(range(10, 14))))
    assert pool.clear_cache() == 2
    assert pool.num_cached == 0 and pool.num_free == 3 and pool.is_allocated(held[0])


# --- every family's tiny model: greedy tokens with the cache on equal those with it off ---------------

FAMILY_BS = 4
SHARED = [7 + (i * 13) % 300 for i in range(22)]   # five full blocks of 4 and two tokens


def _waves() -> list[list[list[int]]]:
    """A first prompt that fills the cache, then prompts sharing many, one and no blocks with it,
    the same prompt again (all cached but its last block) and a block-aligned cached prefix alone."""
    return [[SHARED + [40, 41, 42]],
            [SHARED + [90, 91, 92, 93, 94, 95, 96], SHARED[:4] + [200, 201, 202, 203, 204],
             [250, 251, 252, 253, 254, 255], SHARED + [40, 41, 42], SHARED[:8]]]


def _family_greedy(loaded, prefix_caching: bool, attention: str) -> tuple[list[list[int]], list[int], object]:
    from backfill.policy.baselines import FCFSPolicy
    from backfill.policy.planner import BatchLimits
    from backfill.sampling_params import SamplingParams
    from backfill.serving.build import build_runner
    from backfill.serving.config import ServingConfig
    from backfill.serving.scheduler import Scheduler
    from backfill.types import GenerationRequest

    cfg = ServingConfig(kv_cache_gb=0.002, max_model_len=128, block_size=FAMILY_BS, prefix_caching=prefix_caching,
                        decode_attention=attention, prompt_attention=attention)
    runner = build_runner(loaded.config, loaded.weights, cfg)
    # Chunks of 8: a cached prefix is the context of the first computed chunk, and of the later ones.
    scheduler = Scheduler(runner, FCFSPolicy(BatchLimits(max_batch_tokens=24, prefill_chunk_tokens=8)))
    params = SamplingParams.greedy_params(max_tokens=6, ignore_eos=True)
    tokens, cached = [], []
    for wave in _waves():
        requests = [GenerationRequest(ids, params) for ids in wave]
        for request in requests:
            scheduler.add(request)
        out: dict[str, list[int]] = {r.request_id: [] for r in requests}
        hits: dict[str, int] = {}
        while scheduler.has_work():
            for event in scheduler.step():
                out[event.request_id].extend(event.token_ids)
                if event.finished:
                    hits[event.request_id] = event.num_cached_tokens
        tokens += [out[r.request_id] for r in requests]
        cached += [hits[r.request_id] for r in requests]
    assert runner.kv.num_free == runner.kv.num_usable
    return tokens, cached, scheduler.stats


@pytest.fixture(scope="module", params=["llama3", "mistral", "qwen2", "qwen3"])
def family_model(request, tmp_path_factory):
    from family_models import build_tokenizer, hf_model, write_hf_dir
    from family_models import FAMILIES

    from backfill.engine.weights import load_model

    tokenizer = build_tokenizer(FAMILIES[request.param][3])
    model = hf_model(request.param, tokenizer.get_vocab_size())
    return load_model(write_hf_dir(tmp_path_factory.mktemp(request.param), model, tokenizer, request.param))


@pytest.mark.parametrize("attention", ["auto", "sdpa"])   # auto: the C++ paged kernels on CPU
def test_family_greedy_tokens_equal_with_the_cache_on_and_off(family_model, attention):
    off, off_cached, off_stats = _family_greedy(family_model, False, attention)
    on, on_cached, on_stats = _family_greedy(family_model, True, attention)
    assert on == off
    assert off_cached == [0] * 6 and sum(off_stats.prefix_cache_hits.values()) == 0
    # Many blocks (5), one, none, all but the block of the last token (6 of 7 full blocks: 24 tokens
    # cached, 1 computed), and an aligned prompt of 2 cached blocks recomputes its last block.
    assert on_cached == [0, 20, 4, 0, 24, 4]
    assert on_stats.prefix_cache_hits["online"] == 52
    assert on_stats.prefix_cache_queries["online"] == sum(len(p) for wave in _waves() for p in wave)
