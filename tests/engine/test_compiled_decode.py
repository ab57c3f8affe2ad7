"""Decode of a few sequences through compiled pieces against the eager path, on tiny weights."""

import logging

import pytest
import torch

from backfill.engine import kernel_choice
from backfill.engine.compiled_decode import (DECODE_BATCH_SIZES, LARGE_STEP_CHOICE_ROWS, PACKED_DECODE_BATCH_SIZES,
                                           PACKED_DECODE_BUCKETS)
from backfill.engine.config import ModelConfig
from backfill.engine.kernel_choice import LINEAR, SMALL_BATCH, TILES, KernelChoice
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import LlamaModel
from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk
from tests.conftest import prefill_then_decode, random_weights

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="x86/Arm CPU build only")


@pytest.fixture(scope="module")
def weights(tiny_config):
    return random_weights(tiny_config, seed=3)


@pytest.fixture(scope="module")
def runners(tiny_config, weights):
    """The same weights twice: eager, and with compiled decode; each with its own pool."""
    eager = LlamaModel(tiny_config, weights)
    compiled = LlamaModel(tiny_config, weights, compile_decode=True)
    assert compiled.compiled_decode is not None, "torch.compile should work on the CI machine (gcc present)"
    return (ModelRunner(eager, KVBlockPool(tiny_config, 32, 8)),
            ModelRunner(compiled, KVBlockPool(tiny_config, 32, 8)))


def forced_choice(path: str) -> KernelChoice:
    """Every weight at every size through `path`, as if timed so."""
    cell = {p: (1.0 if p == path else 10.0) for p in (SMALL_BATCH, TILES, LINEAR)}
    sizes = PACKED_DECODE_BATCH_SIZES + PACKED_DECODE_BUCKETS
    return KernelChoice({name: {n: dict(cell) for n in sizes} for name in ("qkv", "o", "gate_up", "down", "lm_head")})


@pytest.fixture(scope="module", params=[SMALL_BATCH, LINEAR])
def chosen(request, tiny_config, weights):
    """A compiled model whose kernel choice sends every matmul through one path, and an eager one."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel_choice, "load_or_measure", lambda signature, measure: forced_choice(request.param))
        compiled = LlamaModel(tiny_config, weights, compile_decode=True)
    if not compiled.compiled_decode.packed:
        pytest.skip("no small-batch kernel on this CPU: nothing to choose between")
    return request.param, ModelRunner(LlamaModel(tiny_config, weights), KVBlockPool(tiny_config, 32, 8)), \
        ModelRunner(compiled, KVBlockPool(tiny_config, 32, 8))


def test_either_kernel_choice_decodes_as_eager(chosen):
    """Every piece through the small-batch kernel, or every matmul through the model's Linear
    before the piece: the same greedy tokens and logits as the eager path."""
    path, eager, compiled = chosen
    assert compiled.model.compiled_decode.outside(4) == (frozenset() if path == SMALL_BATCH else
                                                        frozenset({"qkv", "o", "gate_up", "down", "lm_head"}))
    ids = _prompt(13, 5)
    tokens, logits = _decode(eager, ids, 12)
    fast_tokens, fast_logits = _decode(compiled, ids, 12)
    assert fast_tokens == tokens
    for a, b in zip(fast_logits, logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_tile_kernel_decodes_as_the_small_batch_kernel(tiny_config, weights):
    """bf16 pieces on AMX tiles, in the exact sizes and in padded buckets (the LM head too), against
    the same pieces on the vector kernel: both sum in fp32, so they differ by rounding only."""
    from backfill.engine.small_batch_matmul import load_tiles_matmul

    if not load_tiles_matmul():
        pytest.skip("no AMX tiles on this CPU")
    runners = {}
    for path in (SMALL_BATCH, TILES):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernel_choice, "load_or_measure", lambda signature, measure, p=path: forced_choice(p))
            model = LlamaModel(tiny_config, weights, dtype=torch.bfloat16, compile_decode=True)
        model.compiled_decode.compile_buckets(background=False)
        runners[path] = ModelRunner(model, KVBlockPool(tiny_config, 160, 8, dtype=model.dtype))
    fast = runners[TILES].model.compiled_decode
    assert fast.tiled == frozenset({"qkv", "o", "gate_up", "down", "lm_head"})
    assert fast.buckets[16].lm_head_logits is not None  # a bucket's LM head on the tiles too
    for batch in (5, 9, 33):
        prompts = [_prompt(4 + i % 5, 50 + i) for i in range(batch)]
        vector, tiles = (prefill_then_decode(runner, prompts, 2) for runner in runners.values())
        assert tiles.shape == (3, batch, tiny_config.vocab_size)
        scale = vector.abs().max()
        assert (tiles - vector).abs().max() <= 0.05 * scale, (batch, (tiles - vector).abs().max(), scale)


def test_kernel_choice_is_printed_per_weight_and_rows(runners):
    """The measured table names both paths' times for every weight at every compiled size."""
    choice = runners[1].model.compiled_decode.kernel_choice
    if choice is None:
        pytest.skip("no small-batch kernel on this CPU")
    table = choice.table()
    sizes = set(PACKED_DECODE_BATCH_SIZES + PACKED_DECODE_BUCKETS)
    # Large steps' kernels are chosen at LARGE_STEP_CHOICE_ROWS; their LM head is the model's own.
    expected = {(w, n) for w in ("qkv", "o", "gate_up", "down", "lm_head") for n in sizes}
    expected |= {(w, LARGE_STEP_CHOICE_ROWS) for w in ("qkv", "o", "gate_up", "down")}
    assert {(row["weight"], row["rows"]) for row in table} == expected
    for row in table:
        assert row["small-batch_us"] > 0 and row["linear_us"] > 0
        assert row["choice"] == choice.path(row["weight"], row["rows"])
    assert "choice" in choice.format().splitlines()[0]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode(runner: ModelRunner, ids: list[int], steps: int, forced: list[int] | None = None,
            safepoint=None) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ids, then decode `steps` tokens: greedy, or the `forced` tokens when given."""
    table = runner.kv.allocate(runner.kv.blocks_needed(len(ids) + steps))
    try:
        out = runner.execute([SeqChunk("s", ids, 0, table)])
        tokens, logits = [], []
        for i in range(steps):
            token = forced[i] if forced else int(out.logits[0].argmax())
            tokens.append(token)
            out = runner.execute([SeqChunk("s", [token], len(ids) + i, table)], safepoint=safepoint)
            logits.append(out.logits[0])
        return tokens, logits
    finally:
        runner.kv.free(table)


def test_greedy_decode_matches_eager(runners):
    eager, compiled = runners
    ids = _prompt(19, 0)
    tokens, logits = _decode(eager, ids, 24)
    fast_tokens, fast_logits = _decode(compiled, ids, 24)
    assert fast_tokens == tokens
    for a, b in zip(fast_logits, logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_compiled_path_runs_every_step_of_few_tokens(runners, monkeypatch):
    """Steps whose token count a compiled batch size holds run compiled, prompt chunks among them;
    larger steps stay eager."""
    _, compiled = runners
    model = compiled.model
    sizes = model.compiled_decode.batch_sizes
    assert sizes == (PACKED_DECODE_BATCH_SIZES if model.compiled_decode.packed else DECODE_BATCH_SIZES)
    calls = []
    real = model._forward_compiled
    monkeypatch.setattr(model, "_forward_compiled", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    n = max(sizes) + 1
    ids = [_prompt(9 + i, 1 + i) for i in range(n)]
    tables = [compiled.kv.allocate(3) for _ in ids]
    for i, t in enumerate(tables):
        compiled.execute([SeqChunk(i, ids[i], 0, t)])
    assert calls == []  # prompts longer than the largest compiled batch stay eager
    many = compiled.execute([SeqChunk(i, [5], len(ids[i]), t) for i, t in enumerate(tables)])
    assert calls == [] and many.logits.shape[0] == n  # so do more decodes than it
    mixed = compiled.execute([SeqChunk(0, [6], len(ids[0]) + 1, tables[0]),
                              SeqChunk(1, [7, 8], len(ids[1]) + 1, tables[1])])
    assert calls == [3] and mixed.logits.shape[0] == 2  # a decode beside a prompt chunk: three tokens
    quiet = compiled.execute([SeqChunk(2, [6], len(ids[2]) + 1, tables[2]),
                              SeqChunk(3, [6], len(ids[3]) + 1, tables[3], want_logits=False)])
    assert calls == [3, 2] and quiet.logits.shape[0] == 1  # only the rows that want logits
    alone = compiled.execute([SeqChunk(3, [6], len(ids[3]) + 2, tables[3])])
    assert calls == [3, 2, 1] and alone.logits.shape[0] == 1
    for t in tables:
        compiled.kv.free(t)


def test_prompt_chunks_and_mixed_steps_match_eager(runners):
    """Prompt chunks (from position 0 and further on) and a chunk beside decodes, run compiled: the
    logits equal the eager path's and so does the KV cache they leave behind."""
    eager, compiled = runners
    outs = []
    for runner in (eager, compiled):
        tables = [runner.kv.allocate(3) for _ in range(3)]
        a, b, c = _prompt(3, 40), _prompt(2, 41), _prompt(12, 42)
        steps = [
            [SeqChunk("a", a, 0, tables[0])],                                   # a whole short prompt
            [SeqChunk("b", b, 0, tables[1], want_logits=False)],                # a first chunk, no logits
            [SeqChunk("b", [9], 2, tables[1])],                                 # its next chunk, further on
            [SeqChunk("a", [5], 3, tables[0]), SeqChunk("b", [6], 3, tables[1])],  # two decodes
            [SeqChunk("c", c[:2], 0, tables[2]), SeqChunk("a", [7], 4, tables[0])],  # a chunk beside a decode
            [SeqChunk("c", c[2:], 2, tables[2])],                               # the rest, eager
            [SeqChunk("c", [8], 12, tables[2])],                                # a decode reading all of it
        ]
        outs.append([runner.execute(step).logits for step in steps])
        for t in tables:
            runner.kv.free(t)
    for fast, slow in zip(*outs):
        torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("batch", [2, 3])
def test_decode_batch_matches_eager(runners, batch):
    """Sequences of different lengths decoding together: each one's logits equal the eager batch's."""
    eager, compiled = runners
    lengths = [7, 19, 12][:batch]
    prompts = [_prompt(n, 10 + n) for n in lengths]
    logits = []
    for runner in (eager, compiled):
        tables = [runner.kv.allocate(runner.kv.blocks_needed(n + 4)) for n in lengths]
        for i, (ids, t) in enumerate(zip(prompts, tables)):
            runner.execute([SeqChunk(i, ids, 0, t)])
        steps = []
        for step in range(4):
            out = runner.execute([SeqChunk(i, [20 + step + i], n + step, t)
                                  for i, (n, t) in enumerate(zip(lengths, tables))])
            steps.append(out.logits)
        logits.append(torch.stack(steps))
        for t in tables:
            runner.kv.free(t)
    # fp32 sums reassociated by inductor's fused kernels differ from eager in the last bits.
    torch.testing.assert_close(logits[1], logits[0], atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("batch", [1, 3])
def test_each_compiled_piece_equals_its_python_function(chosen, tiny_config, batch):
    """The pieces run without guards or size checks, so each must compute exactly its function on
    distinct inputs (an example that passed one tensor twice once made cos and sin one input),
    with its matmul inside or through the model's Linear before it."""
    from backfill.engine import compiled_decode as cd

    _, _, runner = chosen
    decode = runner.model.compiled_decode
    fast, li = decode.pieces[batch], 1

    def mm(name):
        return decode.matmul(name, batch)

    layer, linears = decode.layers[li], decode.linears[li]
    eps, n_q, n_kv = decode.eps, tiny_config.num_heads, tiny_config.num_kv_heads
    g = torch.Generator().manual_seed(7)
    h = torch.randn(batch, tiny_config.hidden_size, generator=g)
    attn = torch.randn(batch, n_q * tiny_config.head_dim, generator=g)
    act = torch.randn(batch, tiny_config.intermediate_size, generator=g)
    norm = torch.rand(tiny_config.hidden_size, generator=g) + 0.5
    cos, sin = (torch.randn(batch, 1, tiny_config.head_dim, generator=g) for _ in range(2))

    def project_then_norm(h, x, name):
        if name in fast.outside:
            out = linears[name].add_to(h, x)
            return out, cd._norm(out, norm, eps)
        return cd._project_then_norm(h, x, getattr(layer, name), norm, eps, mm(name))

    with torch.inference_mode():
        qkv = (cd._rope_split(linears["qkv"](h), cos, sin, n_q, n_kv) if "qkv" in fast.outside else
               cd._qkv_rope(h, layer.qkv, cos, sin, n_q, n_kv, mm("qkv")))
        gate_up = (cd._silu_mul(linears["gate_up"](h), h.dtype) if "gate_up" in fast.outside else
                   cd._gate_up_silu(h, layer.gate_up, mm("gate_up")))
        pairs = [
            ((fast.norm(h, norm),), (cd._norm(h, norm, eps),)),
            (fast.qkv_rope(h, li, cos, sin), qkv),
            (fast.o_then_norm(h, attn, li, norm), project_then_norm(h, attn, "o")),
            ((fast.gate_up_silu(h, li),), (gate_up,)),
            (fast.down_then_norm(h, act, li, norm), project_then_norm(h, act, "down")),
        ]
        if fast.lm_head_logits is not None:
            pairs.append(((fast.lm_head_logits(h, decode.lm_head),), (cd._lm_head(h, decode.lm_head, mm("lm_head")),)))
    for compiled, reference in pairs:
        assert len(compiled) == len(reference)
        for a, b in zip(compiled, reference):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_abort_at_safepoint_then_rerun_equals_no_abort(runners):
    eager, compiled = runners
    ids = _prompt(20, 3)
    expected = _decode(eager, ids, 1)[1][0]
    table = compiled.kv.allocate(3)
    compiled.execute([SeqChunk("x", ids, 0, table)])
    seen = []

    def stop_at_two(layer: int) -> bool:
        seen.append(layer)
        return layer == 2

    token = int(_decode(eager, ids, 1)[0][0])
    aborted = compiled.execute([SeqChunk("x", [token], 20, table)], safepoint=stop_at_two)
    assert aborted.aborted and aborted.aborted_at_layer == 2 and aborted.logits is None
    # The eager path's safepoints before each layer and before its down projection; the one
    # between attention and the MLP is left out (a lone sequence's o and gate/up projections are short).
    assert seen == [0, 1, 1, 2]
    rerun = compiled.execute([SeqChunk("x", [token], 20, table)], safepoint=lambda layer: False)
    torch.testing.assert_close(rerun.logits[0], expected, atol=1e-4, rtol=1e-4)
    compiled.kv.free(table)


def test_bfloat16_compiled_decode_close_to_eager(tiny_config, weights):
    eager_model = LlamaModel(tiny_config, weights, dtype=torch.bfloat16)
    compiled_model = LlamaModel(tiny_config, weights, dtype=torch.bfloat16, compile_decode=True)
    eager = ModelRunner(eager_model, KVBlockPool(tiny_config, 16, 8, dtype=eager_model.dtype))
    compiled = ModelRunner(compiled_model, KVBlockPool(tiny_config, 16, 8, dtype=compiled_model.dtype))
    ids = _prompt(15, 4)
    # The same tokens fed to both: bf16 rounding may flip a greedy choice between near-equal logits.
    forced = _prompt(4, 6)
    _, reference = _decode(eager, ids, 4, forced)
    _, fast = _decode(compiled, ids, 4, forced)
    for a, b in zip(fast, reference):
        assert a.dtype == torch.float32
        assert (a - b).abs().max() < 0.05 * b.abs().max() + 0.05


def test_no_compiler_leaves_decode_eager(caplog):
    """Where inductor cannot build its C++ (no compiler), loading still works and decode stays eager."""
    import torch._inductor.config as inductor_config

    cfg = ModelConfig.tiny(hidden_size=48, intermediate_size=80)  # shapes no other test compiled
    torch._dynamo.reset()
    # inductor's own patch(): it restores its config on exit (pytest's monkeypatch deletes entries).
    try:
        with inductor_config.patch({"fx_graph_cache": False, "cpp.cxx": ("/nonexistent/c++",)}), \
                caplog.at_level(logging.WARNING):
            model = LlamaModel(cfg, random_weights(cfg), compile_decode=True)
    finally:
        torch._dynamo.reset()
    assert model.compiled_decode is None
    assert "compiled decode unavailable" in caplog.text
    runner = ModelRunner(model, KVBlockPool(cfg, 8, 8))
    assert len(_decode(runner, _prompt(6, 5), 3)[0]) == 3


@pytest.fixture(scope="module")
def large_steps(tiny_config, weights):
    """A compiled model with the pieces for steps past every bucket (no buckets compiled), and an
    eager one."""
    compiled = LlamaModel(tiny_config, weights, compile_decode=True)
    compiled.compiled_decode.compile_large_steps()
    assert compiled.compiled_decode.large is not None
    return (ModelRunner(LlamaModel(tiny_config, weights), KVBlockPool(tiny_config, 32, 8)),
            ModelRunner(compiled, KVBlockPool(tiny_config, 32, 8)))


def _large_step(runner: ModelRunner, safepoint=None):
    """A 150-token prompt chunk beside a 40-token one and a decode: 191 rows, past every bucket."""
    tables = [runner.kv.allocate(runner.kv.blocks_needed(n + 1)) for n in (150, 40, 30)]
    runner.execute([SeqChunk("c", _prompt(29, 62), 0, tables[2])])
    step = [SeqChunk("a", _prompt(150, 60), 0, tables[0]), SeqChunk("b", _prompt(40, 61), 0, tables[1]),
            SeqChunk("c", [7], 29, tables[2])]
    return tables, step, runner.execute(step, safepoint=safepoint)


def _large_step_rows_and_logits(large_steps, monkeypatch, large_rows_us: dict[int, float]):
    """The row counts the dynamic pieces ran at, and the logits of the large step and of a decode
    after it on the eager and the compiled runner, with the kernel choice's large-row times set."""
    from backfill.engine.kernel_choice import KernelChoice
    eager, compiled = large_steps
    fast = compiled.model.compiled_decode
    choice = fast.kernel_choice or KernelChoice()
    monkeypatch.setattr(fast, "kernel_choice", KernelChoice(choice.times_us, choice.linear_name, large_rows_us))
    rows = []
    run = fast.large.qkv_rope
    monkeypatch.setattr(fast.large, "qkv_rope", lambda x, *rest: rows.append(x.shape[0]) or run(x, *rest))
    outs = []
    for runner in (eager, compiled):
        tables, _, out = _large_step(runner)
        # The cache the step left: a decode reading all of each sequence.
        after = runner.execute([SeqChunk(name, [9], n, t) for name, n, t in zip("abc", (150, 40, 30), tables)])
        outs.append((out.logits, after.logits))
        for t in tables:
            runner.kv.free(t)
    return rows, outs


def test_large_steps_run_the_dynamic_pieces_and_match_eager(large_steps, monkeypatch):
    rows, outs = _large_step_rows_and_logits(large_steps, monkeypatch, {})  # no padding measured
    assert rows and set(rows) == {191}  # the step ran the dynamic pieces at its own row count
    for fast, slow in zip(*outs):
        torch.testing.assert_close(fast, slow, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("faster", ["small-batch", "linear"])
def test_large_steps_multiply_as_the_choice_at_their_size_says(tiny_config, weights, faster):
    """The pieces for large steps fuse the small-batch kernel where the choice timed it faster at
    LARGE_STEP_CHOICE_ROWS, else leave the matmuls to the model's Linear; both match eager."""
    compiled = LlamaModel(tiny_config, weights, compile_decode=True)
    fast = compiled.compiled_decode
    if fast.kernel_choice is None:
        pytest.skip("no small-batch kernel on this CPU")
    slow_us = {SMALL_BATCH: 2.0, LINEAR: 1.0} if faster == "linear" else {SMALL_BATCH: 1.0, LINEAR: 2.0}
    times = {name: {**cells, LARGE_STEP_CHOICE_ROWS: dict(slow_us)} for name, cells in fast.kernel_choice.times_us.items()
             if name != "lm_head"}
    fast.kernel_choice = KernelChoice(times, fast.kernel_choice.linear_name)
    fast.compile_large_steps()
    assert fast.large.outside == (frozenset(("qkv", "o", "gate_up", "down")) if faster == "linear" else frozenset())
    eager = ModelRunner(LlamaModel(tiny_config, weights), KVBlockPool(tiny_config, 32, 8))
    runner = ModelRunner(compiled, KVBlockPool(tiny_config, 32, 8))
    expected, got = _large_step(eager)[2], _large_step(runner)[2]
    torch.testing.assert_close(got.logits, expected.logits, atol=2e-4, rtol=1e-3)


def test_large_steps_padded_to_the_measured_multiple_match_eager(large_steps, monkeypatch):
    """Where the kernel choice measured a multiple of 16 rows faster, a step of 191 rows runs the
    dynamic pieces at 192 (one zero row) and gives the logits the eager step gives."""
    from backfill.engine.kernel_choice import LARGE_STEP_ROW_PAIRS
    faster = {rows: 1.0 if rows % 16 == 0 else 2.0 for pair in LARGE_STEP_ROW_PAIRS for rows in pair}
    rows, outs = _large_step_rows_and_logits(large_steps, monkeypatch, faster)
    fast = large_steps[1].model.compiled_decode
    assert fast.large_step_rows(191) == 192 and fast.large_step_rows(192) == 192
    assert set(rows) == {192}
    for padded, slow in zip(*outs):
        torch.testing.assert_close(padded, slow, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("layer, stage", [(2, 0), (1, 2), (None, 0)])
def test_compiled_step_aborted_then_resumed_equals_no_abort(large_steps, tiny_config, layer, stage):
    """An abort in a compiled step carries its rows: resumed (on the eager path) from that safepoint,
    the step gives the logits it would have given without stopping. layer None: before the LM head."""
    eager, compiled = large_steps
    stop_layer = tiny_config.num_layers if layer is None else layer
    tables, step, expected = _large_step(eager)
    for t in tables:
        eager.kv.free(t)
    calls = []

    def stop_once(at: int) -> bool:
        calls.append(at)
        return at == stop_layer and calls.count(at) == (2 if stage == 2 else 1)

    tables, step, aborted = _large_step(compiled, safepoint=stop_once)
    assert aborted.aborted and aborted.aborted_at_layer == stop_layer
    suspended = aborted.suspended
    assert suspended is not None and (suspended.layer, suspended.stage) == (stop_layer, stage)
    resumed = compiled.execute(step, resume=suspended)
    torch.testing.assert_close(resumed.logits, expected.logits, atol=2e-4, rtol=1e-3)
    for t in tables:
        compiled.kv.free(t)
