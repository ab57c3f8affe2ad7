"""The serving stack's one config tree: engine options here, the co-serving policy's in CoServeConfig.

Free of torch at import time: `backfill --help` and the server's option parsing read these
fields (backfill/options.py generates the flags from them) without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from backfill.errors import InvalidRequestError
from backfill.options import knob
from backfill.policy.checkpoint import CheckpointConfig
from backfill.policy.config import CoServeConfig
from backfill.policy.planner import BatchLimits
from backfill.policy import registry
from backfill.policy.registry import NAMES
from backfill.validation import check_non_negative

POLICIES = NAMES
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_CHOICES = ("auto", "sdpa")
CUDA_KERNELS_CHOICES = ("torch", "triton")


def auto_dtype(device: str, compile_decode: bool = True) -> str:
    """The fastest sound dtype on the device: bf16 on CUDA and on CPUs with bf16 matmul kernels. On a
    CPU without them, bf16 weights computed in fp32 where compiled steps read them through the
    small-batch kernel (AVX2 with FMA): a decode step of a few sequences reads half the bytes, and
    larger steps run as fast as fp32's (engine/linear.py). Else fp32."""
    import torch

    from backfill.engine.linear import cpu_has_bf16_matmul
    from backfill.engine.small_batch_matmul import kernel_isa

    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if cpu_has_bf16_matmul() or (compile_decode and kernel_isa() is not None):
        return "bfloat16"
    return "float32"


# What `backfill serve`, a node's models and every command run unless told: the fastest sound
# settings (bf16 as auto_dtype says, compiled steps on CPU). The dataclass keeps
# float32 and eager for the Python API and the tests, whose outputs must not change with the CPU;
# `--dtype float32 --no-compile-decode` gives those on the command line.
COMMAND_DEFAULTS: dict[str, object] = {"dtype": "auto", "compile_decode": True}


@dataclass(frozen=True)
class ServingConfig:
    model: str | None = knob(None, "GGUF file or HF directory; unset: the embedded SmolLM2-135M-Instruct",
                             group="engine")
    dtype: str = knob("float32", "weights and activations (a CPU without bf16 matmul kernels computes bfloat16 "
                      "weights in float32); auto: bfloat16 on CUDA, on CPUs with bf16 matmul kernels, and with "
                      "compiled steps on the small-batch kernel (AVX2), else float32", group="engine",
                      choices=DTYPE_CHOICES)
    device: str = knob("auto", "auto (cuda when present, else cpu), cpu or cuda[:N]", group="engine")
    kv_cache_gb: float = knob(1.0, "KV cache size, GiB", group="engine")
    # CPU: steps of a few tokens (up to 8 where the small-batch kernel builds, else 3) run
    # through compiled layer pieces (engine/compiled_decode.py), a second copy of the weights; with
    # the small-batch kernel (AVX-512 BF16 or AVX2), steps of 9 to 128 tokens run in padded buckets
    # compiled in the background after load. Prompt chunks run the same pieces as decodes.
    compile_decode: bool = knob(False, "CPU: compile steps of a few tokens (decodes and prompt chunks, up to "
                                "128 with the small-batch kernel) with inductor (compiled at load; the "
                                "matmul weights held twice)", group="engine")
    decode_attention: str = knob("auto", "auto: on CPU read the paged KV cache in place with a C++ kernel "
                                 "(engine/paged_attention.py, built on first use); sdpa: gather blocks, run SDPA",
                                 group="engine", choices=ATTENTION_CHOICES)
    prompt_attention: str = knob("auto", "auto: on CPU prompt chunks attend through a C++ kernel that reads the "
                                 "paged KV cache in place, every chunk of a step in one call per layer "
                                 "(engine/paged_attention.py, built on first use); sdpa: gather blocks, run SDPA "
                                 "per chunk", group="engine", choices=ATTENTION_CHOICES)
    # CUDA: per-layer graphs captured at load for every (batch, context) bucket (engine/cuda_graphs.py).
    cuda_graphs: bool = knob(True, "CUDA: replay captured graphs for decode steps of up to 64 sequences",
                             group="engine")
    # CUDA: steps with prompt chunks graphed as well, every token a row of the decode graphs' attention;
    # off until a GPU run of `bench engine` (mixed_steps) shows the graphed step correct and cheaper.
    mixed_graphs: bool = knob(False, "CUDA (with cuda_graphs): steps of up to 64 tokens that carry prompt chunks "
                              "beside decodes replay captured graphs too; off: such steps run eagerly",
                              group="engine")
    # CUDA: triton, faster than torch's kernels at batch 1 and 64 on the H200 device check (figures in
    # docs/gpu.md), where the kernels' CUDA tests pass. CPUs run torch's whatever this says.
    cuda_kernels: str = knob("triton", "CUDA: kernels of a decode step; triton: decode attention reading the paged "
                             "KV cache in place, fused RoPE + KV write, residual + RMSNorm and SwiGLU "
                             "(engine/triton_*.py) and sampling on the device", group="engine",
                             choices=CUDA_KERNELS_CHOICES)
    # vLLM's automatic prefix caching, on by default as there (engine/kv_pool.py, docs/prefix-caching.md).
    prefix_caching: bool = knob(True, "reuse the KV of full blocks of earlier prompts that start the same way "
                                "(the same tokens, adapter and model); only the rest of a prompt is computed",
                                group="engine")
    policy: str = knob("coserve", "scheduling policy", group="serving", choices=POLICIES)
    arrival_gather_ms: float = knob(5.0, "an idle engine gathers requests that arrive together before its first "
                                    "step: it starts once none has arrived for 1 ms, at most this long after the "
                                    "first; 0: at once", group="serving")
    max_model_len: int = knob(2048, "longest prompt + output, tokens", group="serving")
    # vLLM's max_num_batched_tokens: larger steps run the matmuls at more rows, so a burst's
    # prompts cost less, and make each decode in the step wait longer.
    max_batch_tokens: int | None = knob(None, "most tokens one step computes, decodes and prompt chunks together "
                                        "(vLLM's max_num_batched_tokens; a longer prompt is chunked); unset: "
                                        "the policy's own (coserve and online-only 512, coserve's co-serving "
                                        "steps up to its offline batch; fcfs, priority and cfs 2048)",
                                        group="serving")
    block_size: int = 16
    limits: BatchLimits | None = None  # every policy's batch limits; None: each policy's own default
    coserve: CoServeConfig = field(default_factory=CoServeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile_path: str | None = None   # latency profile; measured and saved on first use
    threads: int | None = None
    # AQUA §6: cfs pages preempted prompts' KV into memory lent through this coordinator.
    offload_coordinator_url: str | None = knob(None, "cfs: page preempted prompts' KV into memory lent "
                                               "through this offload coordinator; unset: host memory only",
                                               group="serving")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise InvalidRequestError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.policy not in POLICIES:
            raise InvalidRequestError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        check_non_negative(InvalidRequestError, "arrival_gather_ms", self.arrival_gather_ms)
        if not self.kv_cache_gb > 0:
            raise InvalidRequestError("kv_cache_gb must be positive")
        if self.block_size < 1 or self.max_model_len < 2:
            raise InvalidRequestError("block_size must be >= 1 and max_model_len >= 2")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise InvalidRequestError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.threads is not None and self.threads < 1:
            raise InvalidRequestError("threads must be >= 1")
        for name in ("decode_attention", "prompt_attention"):
            if getattr(self, name) not in ATTENTION_CHOICES:
                raise InvalidRequestError(f"{name} must be one of {', '.join(ATTENTION_CHOICES)}, "
                                          f"got {getattr(self, name)!r}")
        if self.cuda_kernels not in CUDA_KERNELS_CHOICES:
            raise InvalidRequestError(f"cuda_kernels must be one of {', '.join(CUDA_KERNELS_CHOICES)}, "
                                      f"got {self.cuda_kernels!r}")

    @property
    def resolved_dtype(self) -> str:
        return auto_dtype(self.resolved_device(), self.compile_decode) if self.dtype == "auto" else self.dtype

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.resolved_dtype)

    @property
    def compute_dtype(self):
        """The dtype of the activations and the KV cache: the weights', except bf16 on a CPU without bf16
        matmul kernels, which computes in fp32 over bf16 weights (engine/linear.py)."""
        import torch

        from backfill.engine.linear import matmul_kernel_for

        return matmul_kernel_for(torch.device(self.resolved_device()), self.torch_dtype).compute_dtype

    def resolved_device(self) -> str:
        if self.device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.cuda_graphs and self.resolved_device().startswith("cuda")

    @property
    def uses_mixed_graphs(self) -> bool:
        return self.mixed_graphs and self.uses_cuda_graphs

    @property
    def uses_triton_kernels(self) -> bool:
        return self.cuda_kernels == "triton" and self.resolved_device().startswith("cuda")

    @property
    def uses_paged_attention_kernel(self) -> bool:
        return self.decode_attention == "auto" and self.resolved_device() == "cpu"

    @property
    def uses_paged_prompt_kernel(self) -> bool:
        return self.prompt_attention == "auto" and self.resolved_device() == "cpu"

    def with_policy(self, policy: str) -> ServingConfig:
        return replace(self, policy=policy)

    @property
    def batch_limits(self) -> BatchLimits:
        """The policy's batch limits (the server's admission plans with them too): limits where set,
        else the policy's default; max_batch_tokens, where set, caps a step and a prompt chunk."""
        limits = registry.default_limits(self.policy) if self.limits is None else self.limits
        if self.max_batch_tokens is None:
            return limits
        return replace(limits, max_batch_tokens=self.max_batch_tokens, prefill_chunk_tokens=self.max_batch_tokens)
