"""The small-batch matmul kernel (bf16 and fp32): its packed layout, its products against fp32, its errors, and the
compiled decode that runs on it."""

import pytest
import torch

from backfill.engine.compiled_decode import DECODE_BATCH_SIZES, PACKED_DECODE_BATCH_SIZES
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import LlamaModel
from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk
from backfill.engine.small_batch_matmul import (COLUMN_BLOCK, can_pack, can_tile, kernel_isa, load_small_batch_matmul,
                                                load_tiles_matmul, pack_for_small_batches, packed_matmul,
                                                packed_matmul_tiles)
from tests.conftest import prefill_then_decode, random_weights

# Built for AVX-512 BF16 or AVX2 CPUs, and only where a C++ toolchain is at hand (as the paged-attention kernel).
needs_kernel = pytest.mark.skipif(not load_small_batch_matmul(),
                                  reason="neither AVX-512 BF16 nor AVX2 on this CPU, or no C++ toolchain to build the kernel")


@pytest.mark.parametrize("dtype,step", [(torch.bfloat16, 2), (torch.float32, 1)])
def test_packing_puts_each_step_of_sixteen_outputs_side_by_side(dtype, step):
    """bf16 steps are pairs of input features (VDPBF16PS), fp32 steps single features."""
    out_features, in_features = 20, 6
    weight = torch.arange(out_features * in_features, dtype=torch.float32).view(out_features, in_features).to(dtype)
    packed = pack_for_small_batches(weight)
    assert packed.shape == (2, in_features * COLUMN_BLOCK) and packed.dtype == dtype  # 20 outputs -> 2 blocks of 16
    blocks = packed.view(2, in_features // step, COLUMN_BLOCK, step)
    for n in range(out_features):
        for k in range(in_features):
            assert blocks[n // COLUMN_BLOCK, k // step, n % COLUMN_BLOCK, k % step] == weight[n, k]
    assert blocks[1, :, out_features - COLUMN_BLOCK:].abs().sum() == 0  # the padding outputs are zero


@pytest.mark.parametrize("weight", [torch.zeros(8, 6, dtype=torch.float16), torch.zeros(8, 5, dtype=torch.bfloat16),
                                    torch.zeros(4, 2, 2, dtype=torch.bfloat16)])
def test_weights_the_kernel_cannot_take_are_refused(weight):
    assert not can_pack(weight)
    with pytest.raises(ValueError, match="cannot pack"):
        pack_for_small_batches(weight)


@needs_kernel
@pytest.mark.parametrize("dtype, x_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                            (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("out_features,in_features", [(3072, 576), (37, 64), (5, 2)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11, 16, 27, 64])
def test_products_match_fp32_matmul(dtype, x_dtype, out_features, in_features, rows):
    """Each row regime (one pass, chunks against a tile: on AVX2 a bf16 tile widened once), fp32 rows
    against bf16 weights too (a bf16 model computing in fp32 on a CPU without bf16 matmul kernels)."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)
    x = torch.randn(rows, in_features, generator=g).to(x_dtype)
    out = packed_matmul(pack_for_small_batches(weight), x, out_features)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    if dtype == torch.bfloat16 and kernel_isa() == "avx512-bf16":
        x = x.to(torch.bfloat16)  # VDPBF16PS multiplies bf16 pairs: fp32 rows are rounded first
    torch.testing.assert_close(out, x.float() @ weight.float().T, atol=1e-3, rtol=1e-4)


needs_tiles = pytest.mark.skipif(not load_tiles_matmul(), reason="no AMX tiles on this CPU (or the kernel did not build)")


@needs_tiles
@pytest.mark.parametrize("out_features,in_features", [(3072, 576), (37, 64), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 64, 70, 130])
def test_tile_products_match_fp32_matmul(out_features, in_features, rows):
    """Every row regime of the tile kernel (one x tile, two, passes of four), the last column block
    part-filled where out_features is no multiple of 16."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    out = packed_matmul_tiles(pack_for_small_batches(weight), x, out_features)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    torch.testing.assert_close(out, x.float() @ weight.float().T, atol=1e-3, rtol=1e-4)


def test_can_tile_takes_bf16_weights_with_whole_tiles_of_inputs():
    assert can_tile(torch.zeros(8, 64, dtype=torch.bfloat16))
    assert not can_tile(torch.zeros(8, 48, dtype=torch.bfloat16))  # 48 inputs: one and a half tiles
    assert not can_tile(torch.zeros(8, 64))  # fp32: the tiles multiply bf16 only


@needs_tiles
def test_tile_kernel_refuses_what_it_cannot_multiply():
    packed = pack_for_small_batches(torch.ones(32, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        packed_matmul_tiles(packed, torch.ones(2, 48, dtype=torch.bfloat16), 32)
    with pytest.raises(RuntimeError, match="bf16"):
        packed_matmul_tiles(pack_for_small_batches(torch.ones(32, 64)), torch.ones(2, 64), 32)
    with pytest.raises(RuntimeError, match="does not match"):
        packed_matmul_tiles(pack_for_small_batches(torch.ones(32, 64, dtype=torch.bfloat16)),
                            torch.ones(2, 64, dtype=torch.bfloat16), 64)


@needs_kernel
def test_bad_inputs_raise_clear_errors():
    packed = pack_for_small_batches(torch.ones(32, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x of its dtype or fp32"):
        packed_matmul(packed.float(), torch.ones(1, 8, dtype=torch.bfloat16), 32)
    with pytest.raises(RuntimeError, match="x of its dtype or fp32"):
        packed_matmul(packed.half(), torch.ones(1, 8, dtype=torch.float16), 32)
    with pytest.raises(RuntimeError, match="does not match"):
        packed_matmul(packed, torch.ones(1, 10, dtype=torch.bfloat16), 32)
    with pytest.raises(RuntimeError, match="does not match"):
        packed_matmul(packed, torch.ones(1, 8, dtype=torch.bfloat16), 64)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_decode_runs_up_to_eight_sequences_on_the_kernel(tiny_config, dtype):
    weights = random_weights(tiny_config, seed=5)
    model = LlamaModel(tiny_config, weights, dtype=dtype, compile_decode=True)
    assert model.compiled_decode.packed and model.compiled_decode.batch_sizes == PACKED_DECODE_BATCH_SIZES
    eager = LlamaModel(tiny_config, weights, dtype=dtype)
    runners = [ModelRunner(eager, KVBlockPool(tiny_config, 48, 8, dtype=eager.dtype)),
               ModelRunner(model, KVBlockPool(tiny_config, 48, 8, dtype=model.dtype))]
    if dtype == torch.bfloat16:  # the yardstick: the eager path in fp32
        runners.append(ModelRunner(LlamaModel(tiny_config, weights), KVBlockPool(tiny_config, 48, 8)))
    batch = 8
    # Prompts of 7 to 14 tokens: the shorter ones are prefilled through the compiled pieces too.
    prompts = [torch.randint(3, 256, (7 + i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(batch)]
    results = [prefill_then_decode(runner, prompts, 3) for runner in runners]
    if dtype == torch.float32:
        torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=1e-4)
    else:
        # bf16 paths round at different points: the compiled one must be about as close to fp32 as eager is.
        eager_error, compiled_error = ((r - results[2]).abs().max() for r in results[:2])
        assert compiled_error <= 1.5 * eager_error + 0.05, (compiled_error, eager_error)


def test_without_the_kernel_compiled_decode_takes_dot_products_up_to_three(tiny_config):
    from backfill.engine.compiled_decode import CompiledDecode, DecodeLayer

    hd, hidden, bf16 = tiny_config.head_dim, tiny_config.hidden_size, torch.bfloat16
    qkv_rows = (tiny_config.num_heads + 2 * tiny_config.num_kv_heads) * hd
    layer = DecodeLayer(qkv=torch.zeros(qkv_rows, hidden, dtype=bf16),
                        o=torch.zeros(hidden, tiny_config.num_heads * hd, dtype=bf16),
                        gate_up=torch.zeros(2 * tiny_config.intermediate_size, hidden, dtype=bf16),
                        down=torch.zeros(hidden, tiny_config.intermediate_size, dtype=bf16))
    lm_head = torch.zeros(tiny_config.vocab_size, hidden, dtype=bf16)
    decode = CompiledDecode([layer], lm_head, tiny_config.rms_norm_eps, tiny_config.num_heads,
                            tiny_config.num_kv_heads, hd, small_batch_kernel=False)
    assert not decode.packed and decode.batch_sizes == DECODE_BATCH_SIZES


def test_the_kernel_follows_the_instruction_set(monkeypatch):
    """AVX-512 BF16 where the CPU has it, else AVX2 with FMA, else no kernel at all."""
    from backfill.engine import small_batch_matmul

    monkeypatch.setattr(small_batch_matmul, "isa_capped_below_avx512", lambda: False)
    monkeypatch.setattr(small_batch_matmul, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512_bf16"})
    assert small_batch_matmul.kernel_isa() == "avx512-bf16"
    monkeypatch.setattr(small_batch_matmul, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})  # AVX-512, no BF16
    assert small_batch_matmul.kernel_isa() == "avx2"
    monkeypatch.setattr(small_batch_matmul, "cpu_flags", lambda: {"avx2", "fma"})
    assert not small_batch_matmul.cpu_has_avx512_bf16() and small_batch_matmul.kernel_isa() == "avx2"
    monkeypatch.setattr(small_batch_matmul, "cpu_flags", lambda: {"sse4_2", "avx"})
    assert small_batch_matmul.kernel_isa() is None
    assert small_batch_matmul.load_small_batch_matmul.__wrapped__() is False  # the uncached loader


def test_pytorch_held_to_avx2_holds_the_kernels_to_avx2_too():
    """ATEN_CPU_CAPABILITY=avx2 (how an AVX2-only machine is measured on an AVX-512 one) turns off the
    AVX-512 kernel and gives native builds a cache key of their own."""
    import os
    import subprocess
    import sys

    code = ("import torch; from backfill.engine import native_build, small_batch_matmul as m; "
            "print(torch.backends.cpu.get_cpu_capability(), m.cpu_has_avx512_bf16(), native_build.cpu_key())")
    out = {}
    for isa in ("avx2", "default"):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if isa != "default":
            env["ATEN_CPU_CAPABILITY"] = isa
        out[isa] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                  check=True).stdout.split()
    assert out["avx2"][:2] == ["AVX2", "False"]
    if out["default"][0] == "AVX512":
        assert out["avx2"][2] != out["default"][2]


@needs_kernel
def test_padded_buckets_match_eager_for_larger_decode_batches(tiny_config):
    """Batches of 9 to 33 sequences run in the smallest bucket that holds them, zero rows padded:
    every real sequence's logits equal the eager batch's. In fp32, where the two paths agree to
    1e-4, so a padding row leaking into a real one would show; in bf16 the paths round at different
    points and differ by about 5% of the largest logit on this random model (the eight-row test's
    bound), too loose to catch that."""
    dtype = torch.float32
    from backfill.engine.compiled_decode import PACKED_DECODE_BUCKETS

    weights = random_weights(tiny_config, seed=6)
    model = LlamaModel(tiny_config, weights, dtype=dtype, compile_decode=True)
    model.compiled_decode.compile_buckets(background=False)
    assert sorted(model.compiled_decode.buckets) == sorted(PACKED_DECODE_BUCKETS)
    assert model.decode_run_batches == tuple(sorted(PACKED_DECODE_BUCKETS))  # HARLI's stage 1 runs there
    assert model.compiled_decode.pieces_for(9)[0] == 16 and model.compiled_decode.pieces_for(33)[0] == 48
    assert model.compiled_decode.pieces_for(8)[0] == 8 and model.compiled_decode.pieces_for(65)[0] == 128
    # Past the largest bucket, the pieces compiled for any row count, unpadded.
    assert model.compiled_decode.pieces_for(129) == (129, model.compiled_decode.large)
    eager_model = LlamaModel(tiny_config, weights, dtype=dtype)
    eager = ModelRunner(eager_model, KVBlockPool(tiny_config, 160, 8, dtype=eager_model.dtype))
    fast = ModelRunner(model, KVBlockPool(tiny_config, 160, 8, dtype=model.dtype))
    calls = []
    real = model._forward_compiled
    model._forward_compiled = lambda *a, **k: calls.append(k.get("padded_to")) or real(*a, **k)
    padded = []  # the decode steps' buckets (prompts of 5 to 11 tokens run compiled too)
    for batch in (9, 16, 33):
        prompts = [torch.randint(3, 256, (5 + i % 7,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(batch)]
        results = []
        for runner in (eager, fast):
            tables = [runner.kv.allocate(2) for _ in prompts]
            for i, (ids, table) in enumerate(zip(prompts, tables)):
                runner.execute([SeqChunk(i, ids, 0, table)])
            before = len(calls)
            steps = [runner.execute([SeqChunk(i, [40 + s + i], len(ids) + s, table)
                                     for i, (ids, table) in enumerate(zip(prompts, tables))]).logits for s in range(3)]
            padded += calls[before:]
            results.append(torch.stack(steps))
            for table in tables:
                runner.kv.free(table)
        reference, compiled = results
        assert compiled.shape == reference.shape == (3, batch, tiny_config.vocab_size)
        torch.testing.assert_close(compiled, reference, atol=1e-4, rtol=1e-4)
    assert padded == [16] * 3 + [16] * 3 + [48] * 3


@needs_kernel  # a toolchain is at hand
def test_the_avx2_build_matches_fp32_matmul():
    """Held to AVX2 (as on a CPU without AVX-512), the kernel is built for AVX2 with FMA: a pass serves
    four rows and bf16 weights are widened in registers. Its products, at one pass, several passes
    and a ragged last column block, equal fp32 matmuls."""
    import os
    import subprocess
    import sys

    from backfill.engine.native_build import cpu_flags

    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2 with FMA")
    code = """
import torch
from backfill.engine import small_batch_matmul as m
assert m.kernel_isa() == "avx2", m.kernel_isa()
assert m.load_small_batch_matmul(), "the AVX2 kernel did not build"
for dtype in (torch.bfloat16, torch.float32):
    for out_features, in_features in ((37, 64), (5, 2), (200, 576)):
        for rows in (1, 2, 3, 4, 5, 8, 11, 64):
            g = torch.Generator().manual_seed(rows)
            weight = torch.randn(out_features, in_features, generator=g).to(dtype)
            x = torch.randn(rows, in_features, generator=g).to(dtype)
            out = m.packed_matmul(m.pack_for_small_batches(weight), x, out_features)
            torch.testing.assert_close(out, x.float() @ weight.float().T, atol=1e-3, rtol=1e-4)
print("ok")
"""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
