"""Assemble a serving stack (model, KV pool, policy, scheduler, engine) from one frozen config."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from backfill.engine.config import ModelConfig
from backfill.engine.cuda_graphs import DecodeGraphs
from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.linear import cpu_has_bf16_matmul, matmul_kernel_for
from backfill.engine.model import LlamaModel
from backfill.engine.paged_attention import kernel_digest
from backfill.engine.runner import ModelRunner
from backfill.engine.small_batch_matmul import load_small_batch_matmul
from backfill.engine.small_batch_matmul import kernel_digest as small_batch_digest
from backfill.errors import InvalidRequestError
from backfill.policy.baselines import FCFSPolicy, OnlineOnlyPolicy, PriorityPolicy
from backfill.policy.checkpoint import AdaptiveCheckpointPolicy, CheckpointConfig
from backfill.policy.coserve import CoServeConfig, CoServePolicy
from backfill.policy.latency_model import LatencyModel
from backfill.policy.planner import BatchLimits
from backfill.serving.api import SLO
from backfill.serving.engine import AsyncEngine
from backfill.serving.profiler import PROFILE_FORMAT, profile_latency
from backfill.serving.scheduler import Scheduler
from backfill.serving.torch_thread import run_on_torch_thread

log = logging.getLogger(__name__)

POLICIES = ("coserve", "priority", "fcfs", "online-only")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
DECODE_ATTENTION_CHOICES = ("auto", "sdpa")


def auto_dtype(device: str) -> str:
    """The fastest sound dtype on the device: bf16 on CUDA and on CPUs with bf16 matmul kernels, else fp32."""
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_bf16_matmul() else "float32"


@dataclass(frozen=True)
class ServingConfig:
    model: str | None = None          # GGUF file or HF directory; None = embedded default model
    dtype: str = "float32"            # or auto: see auto_dtype
    device: str = "auto"              # auto = cuda when present, else cpu
    kv_cache_gb: float = 1.0
    block_size: int = 16
    max_model_len: int = 2048
    policy: str = "coserve"
    slo: SLO = SLO(ttft_ms=1000.0, tpot_ms=100.0)
    limits: BatchLimits | None = None  # None: each policy's own default (baselines: vLLM's)
    preempt_target_ms: float = CoServeConfig.preempt_target_ms
    # coserve: a co-serving step takes at most 1.05x its online work alone (inf or None: no cap).
    interference_slack: float | None = 0.05
    online_reserve_fraction: float = 0.1
    # coserve: co-serving steps may take requests of the offline step an arrival suspended (policy/coserve.py).
    release_suspended: bool = CoServeConfig.release_suspended
    # coserve: offline decodes ride in co-serving steps only when they add at most this share of what
    # an offline batch spends on a token (policy/riders.py).
    rider_cost_share: float = CoServeConfig.rider_cost_share
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile_path: str | None = None   # latency profile; measured and saved on first use
    threads: int | None = None
    # CPU: decode steps of a few sequences (up to 8 where the CPU has AVX-512 BF16, else 3) through
    # compiled layer pieces (engine/compiled_decode.py); compiles at load and keeps a second copy
    # of the matmul weights.
    compile_decode: bool = False
    # Decode attention: "auto" reads the paged KV pool in place with a C++ kernel on CPU (built on
    # first use; engine/paged_attention.py), gather + SDPA elsewhere or if it cannot be built;
    # "sdpa" always gathers.
    decode_attention: str = "auto"
    # CUDA: decode steps of up to 64 sequences replay per-layer graphs, captured at load for every
    # (batch, context) bucket up to max_model_len (engine/cuda_graphs.py); takes one KV block as the
    # padding rows' scratch.
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise InvalidRequestError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.policy not in POLICIES:
            raise InvalidRequestError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.kv_cache_gb > 0:
            raise InvalidRequestError("kv_cache_gb must be positive")
        if self.block_size < 1 or self.max_model_len < 2:
            raise InvalidRequestError("block_size must be >= 1 and max_model_len >= 2")
        if self.threads is not None and self.threads < 1:
            raise InvalidRequestError("threads must be >= 1")
        if not self.preempt_target_ms > 0:
            raise InvalidRequestError(f"preempt_target_ms must be positive, got {self.preempt_target_ms}")
        if self.interference_slack is not None and not self.interference_slack >= 0:
            raise InvalidRequestError(f"interference_slack must be >= 0, got {self.interference_slack}")
        if not 0.0 <= self.online_reserve_fraction < 1.0:
            raise InvalidRequestError(f"online_reserve_fraction must be in [0, 1), got {self.online_reserve_fraction}")
        if not self.rider_cost_share >= 0:
            raise InvalidRequestError(f"rider_cost_share must be >= 0, got {self.rider_cost_share}")
        if self.decode_attention not in DECODE_ATTENTION_CHOICES:
            raise InvalidRequestError(f"decode_attention must be one of {', '.join(DECODE_ATTENTION_CHOICES)}, "
                                      f"got {self.decode_attention!r}")

    @property
    def resolved_dtype(self) -> str:
        return auto_dtype(self.resolved_device()) if self.dtype == "auto" else self.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.resolved_dtype]

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.cuda_graphs and self.resolved_device().startswith("cuda")

    @property
    def uses_paged_attention_kernel(self) -> bool:
        return self.decode_attention == "auto" and self.resolved_device() == "cpu"

    def with_policy(self, policy: str) -> "ServingConfig":
        return replace(self, policy=policy)


def default_profile_path(model_name: str, cfg: ServingConfig) -> Path:
    root = Path(os.environ.get("BACKFILL_CACHE_DIR", Path.home() / ".cache" / "backfill"))
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
    device = cfg.resolved_device()
    # Step times depend on which kernels run the weight matmuls (backfill/engine/linear.py) and attention.
    kernel = matmul_kernel_for(torch.device(device), cfg.torch_dtype).slug + ("-cd" if cfg.compile_decode else "")
    kernel += f"-pa{kernel_digest()}" if cfg.uses_paged_attention_kernel else ""
    if cfg.compile_decode and device == "cpu" and load_small_batch_matmul():  # built already by the runner
        kernel += f"-sb{small_batch_digest()}"  # compiled decode packs its weights for this kernel
    kernel += "-cg" if cfg.uses_cuda_graphs else ""
    return root / "profiles" / (f"{safe}-{cfg.resolved_dtype}-{device}-{kernel}-t{torch.get_num_threads()}"
                                f"-p{PROFILE_FORMAT}.json")


def build_runner(model_config: ModelConfig, weights: dict[str, torch.Tensor], cfg: ServingConfig) -> ModelRunner:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = cfg.resolved_device()
    model = LlamaModel(model_config, weights, dtype=cfg.torch_dtype, device=device,
                       compile_decode=cfg.compile_decode,
                       paged_attention_kernel=cfg.uses_paged_attention_kernel)
    kv = KVBlockPool.for_memory(model_config, int(cfg.kv_cache_gb * 2**30), cfg.block_size,
                                cfg.torch_dtype, device)
    graphs = None
    if cfg.uses_cuda_graphs:
        graphs = DecodeGraphs(model, kv)
        started = time.perf_counter()
        count = graphs.capture_all(cfg.max_model_len)
        log.info("captured decode graphs for %d buckets in %.1f s", count, time.perf_counter() - started)
    return ModelRunner(model, kv, graphs)


def make_policy(cfg: ServingConfig, latency: LatencyModel | None, num_layers: int):
    limits = {} if cfg.limits is None else {"limits": cfg.limits}
    if cfg.policy == "online-only":
        return OnlineOnlyPolicy(**limits)
    if cfg.policy == "fcfs":
        return FCFSPolicy(**limits)
    if cfg.policy == "priority":
        return PriorityPolicy(**limits)
    if latency is None:
        raise InvalidRequestError("the coserve policy needs a latency profile")
    return CoServePolicy(latency, CoServeConfig(
        slo=cfg.slo, preempt_target_ms=cfg.preempt_target_ms, **limits,
        interference_slack=cfg.interference_slack, online_reserve_fraction=cfg.online_reserve_fraction,
        release_suspended=cfg.release_suspended, rider_cost_share=cfg.rider_cost_share, num_layers=num_layers))


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
    if cfg.policy == "coserve" and latency is None:
        latency = load_or_profile(runner, cfg, model_name)
    policy = make_policy(cfg, latency, runner.config.num_layers)
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
    return Scheduler(runner, policy, checkpoint_policy=checkpoint, detokenizer_factory=detok,
                     eos_token_ids=eos, max_model_len=cfg.max_model_len)


def build_engine(cfg: ServingConfig) -> AsyncEngine:
    """The serving stack on the configured model (the embedded default model when cfg.model is None)."""
    return run_on_torch_thread(_build_engine, cfg)


def _build_engine(cfg: ServingConfig) -> AsyncEngine:
    from backfill.engine.weights import load_model

    loaded = load_model(cfg.model)
    runner = build_runner(loaded.config, loaded.weights, cfg)
    name = loaded.config.name
    return AsyncEngine(build_scheduler(runner, cfg, loaded.tokenizer, name), loaded.tokenizer, name)


def build_tiny_engine(cfg: ServingConfig, model_config: ModelConfig | None = None, seed: int = 0) -> AsyncEngine:
    """A tiny random-weight model with a byte tokenizer: the real stack, fast enough for tests."""
    return run_on_torch_thread(_build_tiny_engine, cfg, model_config, seed)


def _build_tiny_engine(cfg: ServingConfig, model_config: ModelConfig | None, seed: int) -> AsyncEngine:
    from backfill.engine.byte_tokenizer import ByteTokenizer
    from backfill.engine.weights import random_model

    model_config = model_config or ModelConfig.tiny()
    runner = build_runner(model_config, random_model(model_config, seed), replace(cfg, device="cpu"))
    tokenizer = ByteTokenizer(model_config.vocab_size)
    latency = LatencyModel((1, 4096), (1.0, 41.0)) if cfg.policy == "coserve" else None
    return AsyncEngine(build_scheduler(runner, cfg, tokenizer, model_config.name, latency), tokenizer,
                       model_config.name)
