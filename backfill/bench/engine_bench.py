"""`backfill bench engine`: raw engine speed against the memory-bandwidth floor and HF transformers.

Measured in one run, so ratios compare like with like on a shared, noisy machine:
  - read bandwidth of this machine (best of a few large reductions);
  - the bandwidth floor of one decode step (weight bytes / bandwidth);
  - decode tokens/s and TPOT at several batch sizes, through the real scheduler;
  - prefill tokens/s for 512-token prompts;
  - HF transformers `generate` on the same weights at batch 1 and 8;
  - on CUDA, per kernel set (`cuda_kernels`, torch and triton), whether graphs and eager decode, and
    triton and torch, give the same greedy tokens;
  - with mixed-step graphs (engine/cuda_graphs.py), steps of decodes beside a prompt chunk, replayed
    and eager, and how far their logits differ.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import replace

import torch

from backfill.progress import Heartbeat
from backfill.sampling_params import SamplingParams
from backfill.engine.paged_attention import shared_prefix_tiles_available
from backfill.engine.step import SeqChunk
from backfill.types import GenerationRequest, RequestClass
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_runner, build_scheduler


def _prompt(n: int, salt: int, vocab: int) -> list[int]:
    return [100 + (salt * 7919 + i * 104729) % (vocab - 200) for i in range(n)]


class BandwidthProbe:
    """One read of a buffer too big for the caches, between two decode steps.

    The shared machine's bandwidth drifts by 20% within minutes and bursts for seconds, so a floor
    measured once at the start can be far from the one a later measurement ran against. Probes
    interleaved with the steps read the bandwidth over the same window as the steps they pair with.
    """

    def __init__(self, device: str, size_mb: int = 256) -> None:
        self.device = device
        self.buffer = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32, device=device)
        self.read_gbs()  # first touch

    def read_gbs(self) -> float:
        _sync(self.device)
        start = time.perf_counter()
        self.buffer.sum()
        _sync(self.device)
        return self.buffer.nbytes / (time.perf_counter() - start) / 1e9


def bench_decode(runner, batch: int, prompt_len: int, new_tokens: int, probe: BandwidthProbe | None = None,
                 tokens: list[list[int]] | None = None) -> dict:
    """Decode steps through the scheduler (sampling and bookkeeping included); with a probe, a
    bandwidth read after each step (untimed), whose median is the step's paired bandwidth. With
    tokens, each request's greedy tokens are appended to it, in the requests' order."""
    scheduler = build_scheduler(runner, ServingConfig(policy="fcfs", max_model_len=prompt_len + new_tokens + 8,
                                                      limits=_limits(batch, prompt_len)))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    order = {}
    for i in range(batch):
        request = GenerationRequest(_prompt(prompt_len, i, runner.config.vocab_size), params, RequestClass.OFFLINE)
        order[request.request_id] = i
        scheduler.add(request)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    step_s, probe_gbs = [], []
    while scheduler.has_work():
        prefill = any(s.num_computed < len(s.prompt_ids) for s in scheduler.seqs.values())
        start = time.perf_counter()
        events = scheduler.step()
        if not prefill:
            step_s.append(time.perf_counter() - start)
            if probe is not None:
                probe_gbs.append(probe.read_gbs())
        for event in events:
            outputs[order[event.request_id]].extend(event.token_ids)
    if tokens is not None:
        tokens.extend(outputs)
    tpot_ms = statistics.median(step_s) * 1e3
    d = {"batch": batch, "tpot_ms": tpot_ms, "tokens_per_s": batch / (tpot_ms / 1e3),
         "decode_steps": len(step_s), "context_tokens": prompt_len + new_tokens}
    if probe_gbs:
        d["paired_read_bandwidth_gbs"] = statistics.median(probe_gbs)
        d["paired_floor_ms"] = runner.model.weight_bytes / (d["paired_read_bandwidth_gbs"] * 1e9) * 1e3
        d["tpot_over_paired_floor"] = tpot_ms / d["paired_floor_ms"]
    return d


def greedy_agreement(expected: list[list[int]], got: list[list[int]]) -> dict:
    """How far two runs' greedy tokens agree, sequence by sequence: how many are identical and how
    many tokens the sequences share before they part (bf16 rounding may flip a near tie)."""
    if len(expected) != len(got):
        raise ValueError(f"{len(expected)} sequences against {len(got)}")
    common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
              for x, y in zip(expected, got)]
    return {"sequences": len(expected), "identical": sum(x == y for x, y in zip(expected, got)),
            "tokens_per_sequence": max((len(x) for x in expected), default=0),
            "shortest_common_prefix": min(common, default=0),
            "mean_common_prefix": statistics.mean(common) if common else 0.0}


def _bench_without(owner, attr: str, runner, batch: int, prompt_len: int, new_tokens: int, floor_ms: float,
                   probe: BandwidthProbe | None = None, tokens: list[list[int]] | None = None) -> dict:
    """A batch with owner.attr (a fast path: compiled decode, CUDA graphs) set to None, right after
    the run that used it, on the same model: a side-by-side pair."""
    fast = getattr(owner, attr)
    setattr(owner, attr, None)
    try:
        d = bench_decode(runner, batch, prompt_len, new_tokens, probe, tokens)
    finally:
        setattr(owner, attr, fast)
    d["tpot_over_floor"] = d["tpot_ms"] / floor_ms
    return d


MIXED_STEP_TOKENS = 64  # a mixed step: the decodes and a prompt chunk filling the largest graph bucket
MIXED_CHUNK_MAX = 32


def bench_mixed(runner, batch: int, prompt_len: int, repeats: int = 20) -> dict:
    """Steps of `batch` decodes at prompt_len of context beside one prompt chunk (up to MIXED_CHUNK_MAX
    tokens, the step at most MIXED_STEP_TOKENS), timed with the mixed-step graphs and with them off
    (eager), in turns, on the same KV: each repeat writes the same positions again."""
    graphs, kv = runner.decode_graphs, runner.kv
    chunk = min(MIXED_CHUNK_MAX, MIXED_STEP_TOKENS - batch)
    if graphs is None or not graphs.mixed or chunk < 1:
        raise ValueError(f"mixed steps need mixed-step graphs and room for a chunk beside {batch} decodes")
    vocab = runner.config.vocab_size
    tables = [kv.allocate(kv.blocks_needed(prompt_len + 1)) for _ in range(batch + 1)]
    try:
        for i, table in enumerate(tables[:batch]):
            runner.execute([SeqChunk(i, _prompt(prompt_len, i, vocab), 0, table, want_logits=False)])
        # The chunk is the middle of a prompt: the step's attention reads its earlier context too.
        start = max(0, prompt_len - chunk)
        if start:
            runner.execute([SeqChunk("p", _prompt(start, batch, vocab), 0, tables[batch], want_logits=False)])
        step = [SeqChunk(i, [7], prompt_len, t) for i, t in enumerate(tables[:batch])]
        step.append(SeqChunk("p", _prompt(chunk, batch + 1, vocab), start, tables[batch]))
        times: dict[bool, list[float]] = {True: [], False: []}
        logits = {}
        for _ in range(2):  # warm-up of both paths
            for on in (True, False):
                graphs.mixed = on
                logits[on] = runner.execute(step).logits
        for _ in range(repeats):
            for on in (True, False):
                graphs.mixed = on
                times[on].append(runner.execute(step).duration_s * 1e3)
    finally:
        graphs.mixed = True
        for table in tables:
            kv.free(table)
    graphed, eager = statistics.median(times[True]), statistics.median(times[False])
    return {"batch": batch, "chunk_tokens": chunk, "chunk_start": start, "graphed_ms": graphed, "eager_ms": eager,
            "eager_over_graphed": eager / graphed, "max_abs_logit_diff": float((logits[True] - logits[False]).abs().max())}


def _limits(batch: int, prompt_len: int):
    from backfill.policy.planner import BatchLimits
    return BatchLimits(max_batch_tokens=max(batch * prompt_len, 512), max_batch_seqs=max(batch, 1),
                       prefill_chunk_tokens=prompt_len)


def bench_prefill(runner, prompt_len: int = 512, repeats: int = 3) -> dict:
    kv = runner.kv
    table = kv.allocate(kv.blocks_needed(prompt_len))
    try:
        ids = _prompt(prompt_len, 0, runner.config.vocab_size)
        runner.execute([SeqChunk("p", ids, 0, table)])
        times = [runner.execute([SeqChunk("p", ids, 0, table)]).duration_s for _ in range(repeats)]
    finally:
        kv.free(table)
    t = statistics.median(times)
    return {"prompt_tokens": prompt_len, "ms": t * 1e3, "tokens_per_s": prompt_len / t}


def bench_hf(loaded, batch: int, prompt_len: int, new_tokens: int, dtype: torch.dtype, device: str = "cpu") -> dict:
    """HF transformers `generate` (greedy) on the same weights: the same-run baseline."""
    import transformers

    from backfill.engine.hf_export import hf_config_dict

    cfg = loaded.config
    fields = hf_config_dict(loaded)  # the family's transformers config (Llama, Mistral, Qwen2, Qwen3)
    hf_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    model.load_state_dict(loaded.weights, strict=False)
    model = model.to(device=device, dtype=dtype).eval()
    ids = torch.tensor([_prompt(prompt_len, i, cfg.vocab_size) for i in range(batch)], device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=cfg.eos_token_id)
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        _sync(device)
        total = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, **{**kwargs, "max_new_tokens": 1, "min_new_tokens": 1})
        _sync(device)
        prefill = time.perf_counter() - start
    decode_s = max(total - prefill, 1e-9)
    return {"batch": batch, "tokens_per_s": batch * new_tokens / total,
            "decode_tokens_per_s": batch * (new_tokens - 1) / decode_s,
            "tpot_ms": decode_s / (new_tokens - 1) * 1e3}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_device_bandwidth_gbs(device: str) -> float:
    """Read bandwidth: the best of a few reads of 1 GiB, on the host or on the GPU for CUDA runs."""
    probe = BandwidthProbe(device, size_mb=1024)
    return max(probe.read_gbs() for _ in range(10 if device.startswith("cuda") else 5))


def run_engine_bench(model: str | None = None, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
                     batches: tuple[int, ...] = (1, 8, 32, 64), prompt_len: int = 128, new_tokens: int = 32,
                     device: str = "auto", with_hf: bool = True, random_weights: bool = False,
                     compile_decode: bool = False, decode_attention: str = "auto", cuda_graphs: bool = True,
                     cuda_kernels: tuple[str, ...] = ("torch",), log=print) -> dict:
    """Runs are keyed by dtype, with "+triton" for the Triton kernels (CUDA only: skipped elsewhere).
    A progress line every few seconds while a stretch runs (building kernels, compiling decode)."""
    with Heartbeat(log, "bench engine"):
        return _run_engine_bench(model, dtypes, batches, prompt_len, new_tokens, device, with_hf, random_weights,
                                 compile_decode, decode_attention, cuda_graphs, cuda_kernels, log)


def _run_engine_bench(model, dtypes, batches, prompt_len, new_tokens, device, with_hf, random_weights,
                      compile_decode, decode_attention, cuda_graphs, cuda_kernels, log) -> dict:
    from backfill.engine.shapes import DEFAULT_SHAPE
    from backfill.engine.weights import load_model
    from backfill.engine.shapes import random_model_name

    # model may be random:SHAPE (engine/shapes.py); random_weights alone is the default model's shape.
    loaded = load_model(random_model_name(DEFAULT_SHAPE) if random_weights else model)
    device = ServingConfig(device=device).resolved_device()
    result: dict = {"model": loaded.config.name, "source": loaded.source, "threads": torch.get_num_threads(),
                    "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                    # The instruction set PyTorch runs at (ATEN_CPU_CAPABILITY may hold it below the CPU's).
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "default"),
                    "prompt_tokens": prompt_len, "new_tokens": new_tokens, "runs": {}}
    bandwidth = measure_device_bandwidth_gbs(device)
    probe = BandwidthProbe(device)
    result["read_bandwidth_gbs"] = bandwidth
    log(f"read bandwidth: {bandwidth:.1f} GB/s")
    torch_tokens: dict[tuple[str, int], list[list[int]]] = {}  # (dtype, batch) -> the torch kernels' tokens
    for asked, kernels in [(d, k) for d in dtypes for k in cuda_kernels]:
        cfg = ServingConfig(dtype=asked, device=device, kv_cache_gb=2.0,
                            max_model_len=prompt_len + new_tokens + 8, compile_decode=compile_decode,
                            decode_attention=decode_attention, cuda_graphs=cuda_graphs, cuda_kernels=kernels)
        dtype_name = cfg.resolved_dtype
        if kernels != "torch" and not cfg.uses_triton_kernels:
            if "torch" in cuda_kernels:   # compared beside torch: nothing of its own to measure here
                log(f"[{dtype_name}] cuda_kernels={kernels} runs on CUDA only: skipped on {device}")
                continue
            kernels = "torch"   # the default kernel set on a CPU is torch's, whatever the knob says
            cfg = replace(cfg, cuda_kernels="torch")
        label = dtype_name if kernels == "torch" else f"{dtype_name}+{kernels}"
        runner = build_runner(loaded.config, loaded.weights, cfg)
        floor_ms = runner.model.weight_bytes / (bandwidth * 1e9) * 1e3
        run = {"device": cfg.resolved_device(), "weight_bytes": runner.model.weight_bytes,
               "compiled_decode": runner.model.compiled_decode is not None,
               "paged_attention_kernel": runner.model.paged_decode_attention is not None,
               "prompt_attention_kernel": runner.model.paged_prompt_attention is not None,
               "shared_prefix_tiles": runner.model.paged_decode_attention is not None and shared_prefix_tiles_available(),
               "cuda_graphs": runner.decode_graphs is not None, "cuda_kernels": kernels,
               "matmul_kernel": runner.model.matmul_kernel, "bandwidth_floor_ms": floor_ms,
               "decode": [], "hf": []}
        choice = runner.model.kernel_choice
        step_matmuls = None
        if choice is not None:  # each path's time per weight and rows, and the one the pieces take
            run["kernel_choice"] = choice.table()
            run["large_step_rows_us"] = {str(rows): t for rows, t in choice.large_rows_us.items()}
            run["large_step_row_multiple"] = choice.large_step_row_multiple
            log(f"[{label}] matmul kernel per weight and step rows (one thread), measured on this machine:\n"
                f"{choice.format()}")
            step_matmuls = runner.model.time_matmuls(tuple(batches))  # the same, on the engine's threads
        log(f"[{label}] weights {runner.model.weight_bytes / 1e6:.0f} MB, floor {floor_ms:.1f} ms/step, "
            f"matmuls via {runner.model.matmul_kernel}" + (", decode in CUDA graphs" if run["cuda_graphs"] else ""))
        tokens: dict[int, list[list[int]]] = {}
        for batch in batches:
            d = bench_decode(runner, batch, prompt_len, new_tokens, probe, tokens.setdefault(batch, []))
            d["tpot_over_floor"] = d["tpot_ms"] / floor_ms
            matmul_ms = step_matmuls.step_matmul_ms(batch, loaded.config.num_layers) if step_matmuls else None
            if matmul_ms is not None:  # the step against its weight matmuls alone (the rest is overhead)
                d["matmul_ms"], d["tpot_over_matmul"] = matmul_ms, d["tpot_ms"] / matmul_ms
            run["decode"].append(d)
            log(f"[{label}] batch {batch:3d}: TPOT {d['tpot_ms']:.2f} ms ({d['tpot_over_floor']:.2f}x floor, "
                f"{d['tpot_over_paired_floor']:.2f}x the paired floor of {d['paired_floor_ms']:.1f} ms), "
                f"{d['tokens_per_s']:.0f} tok/s" + (f"; {d['tpot_over_matmul']:.2f}x its matmuls' "
                                                     f"{d['matmul_ms']:.1f} ms" if "matmul_ms" in d else ""))
        if runner.model.compiled_decode is not None and 1 in batches:
            eager = run["decode_batch1_eager"] = _bench_without(
                runner.model, "compiled_decode", runner, 1, prompt_len, new_tokens, floor_ms, probe)
            log(f"[{label}] batch   1 without compiled decode: TPOT {eager['tpot_ms']:.1f} ms "
                f"({eager['tpot_over_floor']:.2f}x floor, {eager['tpot_over_paired_floor']:.2f}x paired)")
        if run["cuda_graphs"]:
            # The steps above replay one graph per step (no safepoint); offline steps replay per-layer ones.
            run["decode_per_layer_graphs"] = []
            runner.decode_graphs.whole_step = False
            try:
                for batch in batches:
                    d = bench_decode(runner, batch, prompt_len, new_tokens, probe)
                    d["tpot_over_floor"] = d["tpot_ms"] / floor_ms
                    run["decode_per_layer_graphs"].append(d)
                    log(f"[{label}] batch {batch:3d} with per-layer graphs: TPOT {d['tpot_ms']:.2f} ms, "
                        f"{d['tokens_per_s']:.0f} tok/s")
            finally:
                runner.decode_graphs.whole_step = True
            run["decode_without_cuda_graphs"], run["greedy_graphs_vs_eager"] = [], []
            for batch in batches:
                eager_tokens: list[list[int]] = []
                d = _bench_without(runner, "decode_graphs", runner, batch, prompt_len, new_tokens, floor_ms, probe,
                                   eager_tokens)
                run["decode_without_cuda_graphs"].append(d)
                agree = {"batch": batch, **greedy_agreement(eager_tokens, tokens[batch])}
                run["greedy_graphs_vs_eager"].append(agree)
                log(f"[{label}] batch {batch:3d} without CUDA graphs: TPOT {d['tpot_ms']:.2f} ms, "
                    f"{d['tokens_per_s']:.0f} tok/s; greedy tokens identical in {agree['identical']} of {batch}")
        if run["cuda_graphs"] and runner.decode_graphs.mixed:
            run["mixed_steps"] = []
            for batch in [b for b in batches if b < MIXED_STEP_TOKENS]:
                d = bench_mixed(runner, batch, prompt_len)
                run["mixed_steps"].append(d)
                log(f"[{label}] {batch:3d} decodes + a {d['chunk_tokens']}-token prompt chunk: graphed "
                    f"{d['graphed_ms']:.2f} ms, eager {d['eager_ms']:.2f} ms ({d['eager_over_graphed']:.2f}x); "
                    f"logits differ by at most {d['max_abs_logit_diff']:.3g}")
        if kernels == "torch":
            torch_tokens.update({(dtype_name, b): t for b, t in tokens.items()})
        elif all((dtype_name, b) in torch_tokens for b in batches):
            run["greedy_triton_vs_torch"] = [{"batch": b, **greedy_agreement(torch_tokens[dtype_name, b], tokens[b])}
                                             for b in batches]
            for agree in run["greedy_triton_vs_torch"]:
                log(f"[{label}] batch {agree['batch']:3d}: greedy tokens identical to torch's in "
                    f"{agree['identical']} of {agree['sequences']} (shortest common prefix "
                    f"{agree['shortest_common_prefix']} of {agree['tokens_per_sequence']})")
        run["prefill"] = bench_prefill(runner)
        log(f"[{label}] prefill 512: {run['prefill']['tokens_per_s']:.0f} tok/s")
        if with_hf and kernels == "torch":  # once per dtype
            for batch in (1, 8):
                h = bench_hf(loaded, batch, prompt_len, new_tokens, cfg.torch_dtype, run["device"])
                run["hf"].append(h)
                log(f"[{label}] HF generate batch {batch}: {h['tokens_per_s']:.0f} tok/s "
                    f"(decode {h['decode_tokens_per_s']:.0f} tok/s, TPOT {h['tpot_ms']:.1f} ms)")
        result["runs"][label] = run
        del runner
    return result
