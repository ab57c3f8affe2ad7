"""Assemble a serving stack (model, KV pool, policy, scheduler, engine) from one frozen config."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from backfill.engine.config import ModelConfig
from backfill.engine.cuda_graphs import DecodeGraphs
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.linear import matmul_kernel_for
from backfill.engine.model import LlamaModel
from backfill.engine.native_build import isa_capped_below_avx512
from backfill.engine.paged_attention import kernel_digest, prompt_kernel_digest
from backfill.engine.runner import ModelRunner
from backfill.engine.small_batch_matmul import load_small_batch_matmul
from backfill.engine.small_batch_matmul import kernel_digest as small_batch_digest
from backfill.paths import cache_root
from backfill.policy import registry
from backfill.progress import Heartbeat
from backfill.policy.checkpoint import AdaptiveCheckpointPolicy
from backfill.policy.interface import SafepointLayout, SchedulingPolicy
from backfill.policy.latency_model import LatencyModel
from backfill.serving.async_engine import AsyncEngine
from backfill.serving.config import ServingConfig
from backfill.serving.profiler import PROFILE_FORMAT, profile_latency
from backfill.serving.scheduler import Scheduler
from backfill.serving.torch_thread import run_on_torch_thread

log = logging.getLogger(__name__)

# The tiny random model's stand-in latency profile ((tokens), (ms)): policies that plan with one run.
TINY_LATENCY_PROFILE: tuple[tuple[int, int], tuple[float, float]] = ((1, 4096), (1.0, 41.0))


def default_profile_path(model_name: str, cfg: ServingConfig) -> Path:
    """Where the latency profile of this model and config is cached. The compiled pieces' kernel
    choice (engine/kernel_choice.py) is cached beside it per machine, so one profile goes with one
    choice; deleting the cache directory measures both again."""
    root = cache_root()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
    device = cfg.resolved_device()
    # Step times depend on which kernels run the weight matmuls (backfill/engine/linear.py) and attention.
    kernel = matmul_kernel_for(torch.device(device), cfg.torch_dtype).slug + ("-cd" if cfg.compile_decode else "")
    kernel += f"-pa{kernel_digest()}" if cfg.uses_paged_attention_kernel else ""
    kernel += f"-pp{prompt_kernel_digest()}" if cfg.uses_paged_prompt_kernel else ""
    if cfg.compile_decode and device == "cpu" and load_small_batch_matmul():  # built already by the runner
        kernel += f"-sb{small_batch_digest()}"  # compiled decode packs its weights for this kernel
    kernel += "-cg" if cfg.uses_cuda_graphs else ""
    kernel += "-mg" if cfg.uses_mixed_graphs else ""  # the profile has a mixed-step table
    kernel += "-triton" if cfg.uses_triton_kernels else ""
    if device == "cpu" and isa_capped_below_avx512():  # PyTorch held to AVX2 on an AVX-512 CPU: other step times
        kernel += f"-{torch.backends.cpu.get_cpu_capability().lower()}"
    return root / "profiles" / (f"{safe}-{cfg.resolved_dtype}-{device}-{kernel}-t{torch.get_num_threads()}"
                                f"-p{PROFILE_FORMAT}.json")


# Makes the runner from the built model, KV pool and captured graphs: a node passes a subclass
# whose steps pass through its gate (node/gated.py GatedRunner).
RunnerFactory = Callable[[LlamaModel, KVBlockPool, DecodeGraphs | None], ModelRunner]


def _plain_runner(model: LlamaModel, kv: KVBlockPool, graphs: DecodeGraphs | None) -> ModelRunner:
    return ModelRunner(model, kv, graphs)


@dataclass(frozen=True)
class ServingStack:
    """The parts of one serving stack, built together from one ServingConfig."""

    model: LlamaModel
    kv: KVBlockPool
    runner: ModelRunner
    scheduler: Scheduler
    engine: AsyncEngine


def build_model(model_config: ModelConfig, weights: dict[str, torch.Tensor], cfg: ServingConfig) -> LlamaModel:
    """The model alone, with the kernels cfg asks for (benchmarks that drive a runner of their own)."""
    # Building kernels, choosing among them and compiling decode take seconds to minutes: say so meanwhile.
    with Heartbeat(log.info, f"building {model_config.name} (weights, kernels, compiled decode)"):
        return LlamaModel(model_config, weights, dtype=cfg.torch_dtype, device=cfg.resolved_device(),
                          compile_decode=cfg.compile_decode,
                          paged_attention_kernel=cfg.uses_paged_attention_kernel,
                          paged_prompt_kernel=cfg.uses_paged_prompt_kernel,
                          cuda_kernels="triton" if cfg.uses_triton_kernels else "torch")


def build_eager_model(model_config: ModelConfig, weights: dict[str, torch.Tensor], dtype: str,
                      device: str) -> LlamaModel:
    """The model on torch's own kernels alone (no compiled steps, SDPA attention): for benchmarks of
    other parts (memory, paging, finetuning), whose figures must not move with the kernels."""
    cfg = ServingConfig(dtype=dtype, device=device, compile_decode=False, decode_attention="sdpa",
                        prompt_attention="sdpa", cuda_graphs=False, cuda_kernels="torch")
    return build_model(model_config, weights, cfg)


def build_kv_pool(model_config: ModelConfig, cfg: ServingConfig, *, num_blocks: int | None = None,
                  planes: tuple[torch.Tensor, torch.Tensor] | None = None) -> KVBlockPool:
    """cfg.kv_cache_gb of KV blocks, or num_blocks of them (a node's pool share), in planes when given
    (memory shared with the node's other engines)."""
    if num_blocks is None and planes is None:
        return KVBlockPool.for_memory(model_config, int(cfg.kv_cache_gb * 2**30), cfg.block_size,
                                      cfg.compute_dtype, cfg.resolved_device(), prefix_caching=cfg.prefix_caching)
    if num_blocks is None:
        raise ValueError("KV planes need num_blocks")
    return KVBlockPool(model_config, num_blocks, cfg.block_size, cfg.compute_dtype, cfg.resolved_device(), planes,
                       prefix_caching=cfg.prefix_caching)


def build_runner(model_config: ModelConfig, weights: dict[str, torch.Tensor], cfg: ServingConfig, *,
                 num_kv_blocks: int | None = None, kv_planes: tuple[torch.Tensor, torch.Tensor] | None = None,
                 make_runner: RunnerFactory = _plain_runner, compile_buckets: bool = True) -> ModelRunner:
    """Model, KV pool (see build_kv_pool) and runner; compile_buckets: compile the larger decode
    buckets in the background after load (off where a process must not spend cores on it)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model_config.check_context(cfg.max_model_len)  # a sliding window must not be reached
    model = build_model(model_config, weights, cfg)
    if model.compiled_decode is not None and compile_buckets:
        # Larger decode batches get padded buckets, compiled behind the server's start.
        model.compiled_decode.compile_buckets(background=True)
    kv = build_kv_pool(model_config, cfg, num_blocks=num_kv_blocks, planes=kv_planes)
    graphs = None
    if cfg.uses_cuda_graphs:
        graphs = DecodeGraphs(model, kv, mixed=cfg.uses_mixed_graphs)
        started = time.perf_counter()
        count = graphs.capture_all(cfg.max_model_len)
        log.info("captured decode graphs for %d buckets in %.1f s", count, time.perf_counter() - started)
    runner = make_runner(model, kv, graphs)
    if cfg.uses_triton_kernels:
        from backfill.engine.device_sampler import DeviceSampler

        runner.device_sampler = DeviceSampler(model.device)
    return runner


def make_policy(cfg: ServingConfig, latency: LatencyModel | None, layout: SafepointLayout) -> SchedulingPolicy:
    return registry.make_policy(cfg.policy, limits=cfg.batch_limits, latency=latency, layout=layout,
                                coserve=cfg.coserve)


def load_or_profile(runner: ModelRunner, cfg: ServingConfig, model_name: str) -> LatencyModel:
    path = Path(cfg.profile_path) if cfg.profile_path else default_profile_path(model_name, cfg)
    if path.exists():
        try:
            return LatencyModel.load(path)
        except Exception:  # a stale or corrupt profile is re-measured, not fatal
            pass
    # The first start on a machine measures for minutes: say so, or it looks hung.
    log.info("no latency profile at %s: measuring one (first start with this model and device; this takes "
             "a few minutes, once)", path)
    started = time.perf_counter()
    latency = profile_latency(runner, model_name=model_name)
    latency.save(path)
    log.info("latency profile measured in %.0f s and saved to %s", time.perf_counter() - started, path)
    return latency


def build_scheduler(runner: ModelRunner, cfg: ServingConfig, tokenizer=None, model_name: str = "model",
                    latency: LatencyModel | None = None) -> Scheduler:
    if registry.entry(cfg.policy).needs_latency_model and latency is None:
        latency = load_or_profile(runner, cfg, model_name)
    policy = make_policy(cfg, latency, runner.safepoint_layout)
    detok = None
    eos: tuple[int, ...] = ()
    if tokenizer is not None:
        from backfill.engine.byte_tokenizer import ByteDetokenizer, ByteTokenizer
        if isinstance(tokenizer, ByteTokenizer):
            detok = lambda: ByteDetokenizer(tokenizer)  # noqa: E731
        else:
            from backfill.engine.tokenizer import IncrementalDetokenizer
            detok = lambda: IncrementalDetokenizer(tokenizer)  # noqa: E731
        eos = tuple(tokenizer.stop_token_ids)
    checkpoint = AdaptiveCheckpointPolicy(cfg.checkpoint) if cfg.checkpoint.enabled else None
    scheduler = Scheduler(runner, policy, checkpoint_policy=checkpoint, detokenizer_factory=detok,
                          eos_token_ids=eos, max_model_len=cfg.max_model_len)
    if registry.entry(cfg.policy).pages_kv:
        from backfill.memory.pager import make_pager
        scheduler.pager = make_pager(runner.kv.device, cfg.offload_coordinator_url)
    return scheduler


def build_serving_stack(cfg: ServingConfig, model_config: ModelConfig, weights: dict[str, torch.Tensor],
                        tokenizer=None, *, model_name: str | None = None, latency: LatencyModel | None = None,
                        num_kv_blocks: int | None = None,
                        kv_planes: tuple[torch.Tensor, torch.Tensor] | None = None,
                        make_runner: RunnerFactory = _plain_runner, compile_buckets: bool = True) -> ServingStack:
    """Model, KV pool, runner, scheduler and engine from one ServingConfig; call on the torch thread.
    num_kv_blocks / kv_planes: a node's pool share instead of cfg.kv_cache_gb (build_kv_pool);
    make_runner: a runner subclass (a node's gated steps); latency: the policy's profile (None:
    the saved one, measured on first use, where the policy needs one)."""
    name = model_name or model_config.name
    runner = build_runner(model_config, weights, cfg, num_kv_blocks=num_kv_blocks, kv_planes=kv_planes,
                          make_runner=make_runner, compile_buckets=compile_buckets)
    scheduler = build_scheduler(runner, cfg, tokenizer, name, latency)
    engine = AsyncEngine(scheduler, tokenizer, name, cfg.arrival_gather_ms / 1e3)
    return ServingStack(runner.model, runner.kv, runner, scheduler, engine)


def build_engine(cfg: ServingConfig) -> AsyncEngine:
    """The serving stack on the configured model (the embedded default model when cfg.model is None)."""
    return run_on_torch_thread(_build_engine, cfg)


def _build_engine(cfg: ServingConfig) -> AsyncEngine:
    from backfill.engine.weights import load_model

    loaded = load_model(cfg.model)
    return build_serving_stack(cfg, loaded.config, loaded.weights, loaded.tokenizer).engine


def build_tiny_engine(cfg: ServingConfig, model_config: ModelConfig | None = None, seed: int = 0) -> AsyncEngine:
    """A tiny random-weight model with a byte tokenizer: the real stack, fast enough for tests."""
    return run_on_torch_thread(_build_tiny_engine, cfg, model_config, seed)


def _build_tiny_engine(cfg: ServingConfig, model_config: ModelConfig | None, seed: int) -> AsyncEngine:
    from backfill.engine.byte_tokenizer import ByteTokenizer
    from backfill.engine.weights import random_model

    model_config = model_config or ModelConfig.tiny()
    tokenizer = ByteTokenizer(model_config.vocab_size)
    latency = LatencyModel(*TINY_LATENCY_PROFILE) if registry.entry(cfg.policy).needs_latency_model else None
    # The tiny engine steps at once (no arrival gather), as its tests expect.
    stack = build_serving_stack(replace(cfg, device="cpu", arrival_gather_ms=0.0), model_config,
                                random_model(model_config, seed), tokenizer, latency=latency)
    return stack.engine
