"""The node config of `backfill serve --config node.toml`: one device, several models (Valve §3).

    [node]                      # NodeSettings: the runtime's gate and shared memory pool
    metrics_port = 9100
    num_handles = 64
    device = "cuda"             # every model on one GPU (or `backfill serve --config node.toml --device cuda`)

    [[models]]                  # one ModelEntry per model: its own OpenAI endpoint and Batch API
    name = "chat"
    model = "default"           # default (embedded SmolLM2-135M), tiny (random weights), a path
    port = 8001
    policy = "coserve"

Every key is a `knob` of NodeSettings or ModelEntry (backfill/options.py), so the schema is the
dataclasses; whatever is wrong with the file (unknown key, bad type or value, duplicate model
name or port, a model file that does not exist) raises NodeConfigError naming it, at start.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from backfill.errors import BackfillError, NodeConfigError
from backfill.options import Option, build, knob, options_of
from backfill.policy.registry import ONE_ENGINE_NAMES
from backfill.serving.config import ATTENTION_CHOICES, COMMAND_DEFAULTS, DTYPE_CHOICES, ServingConfig
from backfill.validation import check_int, check_positive

GATES = ("lifecycle", "timeslice")
NODE_POLICIES = ONE_ENGINE_NAMES  # a node engine serves both classes itself
BUILTIN_MODELS = ("default", "tiny")
TOP_LEVEL = ("node", "models")


@dataclass(frozen=True)
class NodeSettings:
    host: str = knob("127.0.0.1", "address every endpoint of the node binds")
    metrics_port: int = knob(9100, "port of the node's /metrics (idle compute, free memory, offline tokens/s)")
    num_handles: int = knob(64, "shared KV pool: memory handles (Valve §5), the unit models take and give back")
    blocks_per_handle: int = knob(4, "KV blocks per handle")
    block_size: int = knob(16, "tokens per KV block")
    gate: str = knob("lifecycle", "compute gate (Valve §4.2): lifecycle (cooldown after online idles) or "
                     "timeslice (reopen whenever online is idle)", choices=GATES)
    sample_interval_s: float = knob(0.02, "how often the node samples online busy and free memory, s")
    window_s: float = knob(10.0, "window of the node's idle fraction and offline tokens/s, s")
    db_dir: str | None = knob(None, "folder of each model's SQLite store (<name>.db); unset: a fresh temp folder")
    device: str = knob("cpu", "where every model of the node runs: cpu, cuda or cuda:N (one GPU shared by "
                       "the model processes; each model's dtype says in what)")

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise NodeConfigError("node.host must be a non-empty string")
        check_int(NodeConfigError, "node.metrics_port", self.metrics_port, 0, 65535)
        check_int(NodeConfigError, "node.num_handles", self.num_handles, 1)
        check_int(NodeConfigError, "node.blocks_per_handle", self.blocks_per_handle, 1)
        check_int(NodeConfigError, "node.block_size", self.block_size, 1)
        if self.gate not in GATES:
            raise NodeConfigError(f"node.gate must be one of {', '.join(GATES)}, got {self.gate!r}")
        check_positive(NodeConfigError, "node.sample_interval_s", self.sample_interval_s)
        check_positive(NodeConfigError, "node.window_s", self.window_s)
        if not isinstance(self.device, str) or not (self.device in ("cpu", "cuda") or (
                self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise NodeConfigError(f"node.device must be cpu, cuda or cuda:N, got {self.device!r}")

    @property
    def num_blocks(self) -> int:
        return self.num_handles * self.blocks_per_handle


@dataclass(frozen=True)
class ModelEntry:
    name: str = knob("", "model id clients send (and the node's name for the model); unique on the node")
    port: int = knob(0, "port of this model's OpenAI endpoint and Batch API; unique on the node")
    model: str = knob("default", "default (embedded SmolLM2-135M-Instruct), tiny (random weights, tests), "
                      "random:SHAPE, or a GGUF file / HF directory")
    policy: str = knob("coserve", "the engine's scheduling policy (online and offline in one engine)",
                       choices=NODE_POLICIES)
    threads: int = knob(1, "torch threads of this model's process")
    max_model_len: int = knob(1024, "longest prompt + output, tokens")
    max_offline_in_flight: int = knob(8, "batch lines in the engine at once")
    max_online_queue: int = knob(64, "online requests in flight before new ones get 429")
    decode_attention: str = knob("sdpa", "auto (a C++ kernel reading the paged KV cache in place, built on first "
                                 "use) or sdpa", choices=ATTENTION_CHOICES)
    prompt_attention: str = knob("sdpa", "attention of prompt chunks: auto (a C++ kernel reading the paged KV cache "
                                 "in place, built on first use) or sdpa", choices=ATTENTION_CHOICES)
    profile_path: str | None = knob(None, "coserve latency profile; unset: the cached one (measured on first use)")
    # As `backfill serve` (COMMAND_DEFAULTS): bf16 (auto_dtype), compiled steps on CPU.
    dtype: str = knob(str(COMMAND_DEFAULTS["dtype"]), "weights, activations and KV; auto: as `backfill serve`'s "
                      "--dtype", choices=DTYPE_CHOICES)
    compile_decode: bool = knob(bool(COMMAND_DEFAULTS["compile_decode"]),
                                "CPU: steps of a few tokens through compiled pieces, as `backfill serve`")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise NodeConfigError("a model needs a non-empty name")
        check_int(NodeConfigError, f"models[{self.name}].port", self.port, 1, 65535)
        if self.policy not in NODE_POLICIES:
            raise NodeConfigError(f"models[{self.name}].policy must be one of {', '.join(NODE_POLICIES)}, "
                                  f"got {self.policy!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise NodeConfigError(f"models[{self.name}].dtype must be one of {', '.join(DTYPE_CHOICES)}")
        for name in ("decode_attention", "prompt_attention"):
            if getattr(self, name) not in ATTENTION_CHOICES:
                raise NodeConfigError(f"models[{self.name}].{name} must be one of {', '.join(ATTENTION_CHOICES)}")
        check_int(NodeConfigError, f"models[{self.name}].threads", self.threads, 1)
        check_int(NodeConfigError, f"models[{self.name}].max_model_len", self.max_model_len, 2)
        check_int(NodeConfigError, f"models[{self.name}].max_offline_in_flight", self.max_offline_in_flight, 1)
        check_int(NodeConfigError, f"models[{self.name}].max_online_queue", self.max_online_queue, 1)
        if not isinstance(self.model, str) or not self.model:
            raise NodeConfigError(f"models[{self.name}].model must be a non-empty string")
        if self.model not in BUILTIN_MODELS and not self.model.startswith("random:") \
                and not Path(self.model).expanduser().exists():
            raise NodeConfigError(f"models[{self.name}].model: no model file or directory at {self.model!r}")

    def serving_config(self, node: NodeSettings) -> ServingConfig:
        """This model's engine on the node: the one place the entry's fields become a ServingConfig."""
        # No CUDA graphs or Triton kernels: every model process of the node shares the device, and
        # its steps pass through the node's gate between layers.
        return ServingConfig(device=node.device, dtype=self.dtype, block_size=node.block_size,
                             max_model_len=self.max_model_len, policy=self.policy, threads=self.threads,
                             decode_attention=self.decode_attention, prompt_attention=self.prompt_attention,
                             profile_path=self.profile_path,
                             compile_decode=self.compile_decode and node.device == "cpu",
                             cuda_graphs=False, cuda_kernels="torch")


@dataclass(frozen=True)
class NodeConfig:
    node: NodeSettings
    models: tuple[ModelEntry, ...]

    def __post_init__(self) -> None:
        if not self.models:
            raise NodeConfigError("a node config needs at least one [[models]] entry")
        seen_names: set[str] = set()
        seen_ports = {self.node.metrics_port: "node.metrics_port"} if self.node.metrics_port else {}
        for m in self.models:
            if m.name in seen_names:
                raise NodeConfigError(f"model name {m.name!r} appears twice")
            seen_names.add(m.name)
            if m.port in seen_ports:
                raise NodeConfigError(f"models[{m.name}].port {m.port} is already used by {seen_ports[m.port]}")
            seen_ports[m.port] = f"models[{m.name}]"

    def model(self, name: str) -> ModelEntry:
        for m in self.models:
            if m.name == name:
                return m
        raise NodeConfigError(f"no model named {name!r} on this node")


def _typed(where: str, opts: tuple[Option, ...], table: Any) -> dict[str, Any]:
    """A TOML table checked against the options of a dataclass: known keys, right types."""
    if not isinstance(table, dict):
        raise NodeConfigError(f"{where} must be a table, got {type(table).__name__}")
    by_name = {o.name: o for o in opts}
    values: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = str(raw_key).replace("-", "_")
        option = by_name.get(key)
        if option is None:
            raise NodeConfigError(f"{where}: unknown key {raw_key!r} (known: {', '.join(sorted(by_name))})")
        if option.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, option.type) or (option.type is int and isinstance(value, bool)):
            raise NodeConfigError(f"{where}.{raw_key} must be a {option.type.__name__}, got {value!r}")
        values[key] = value
    return values


def node_config_from_dict(data: dict[str, Any]) -> NodeConfig:
    for key in data:
        if key not in TOP_LEVEL:
            raise NodeConfigError(f"unknown top-level key {key!r} (a node config has [node] and [[models]])")
    node_values = _typed("[node]", options_of(NodeSettings), data.get("node", {}))
    models_raw = data.get("models", [])
    if not isinstance(models_raw, list):
        raise NodeConfigError("models must be an array of tables ([[models]])")
    try:
        node = build(NodeSettings, node_values)
        models = []
        for i, table in enumerate(models_raw):
            where = f"models[{table.get('name', i) if isinstance(table, dict) else i}]"
            models.append(build(ModelEntry, _typed(where, options_of(ModelEntry), table)))
        return NodeConfig(node, tuple(models))
    except NodeConfigError:
        raise
    except (BackfillError, TypeError, ValueError) as exc:
        raise NodeConfigError(str(exc)) from exc


def load_node_config(path: str | Path) -> NodeConfig:
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NodeConfigError(f"cannot read node config {path}: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise NodeConfigError(f"node config {path} is not valid TOML: {exc}") from None
    return node_config_from_dict(data)


def on_device(config: NodeConfig, device: str | None) -> NodeConfig:
    """The config with every model on `device` (the command line's --device); None or "auto"
    keeps the file's node.device."""
    if device is None or device == "auto":
        return config
    try:
        return replace(config, node=replace(config.node, device=device))
    except NodeConfigError:
        raise
    except (BackfillError, TypeError, ValueError) as exc:
        raise NodeConfigError(str(exc)) from exc


def is_node_config(path: str | Path) -> bool:
    """Whether a `--config` file describes a node (it has a [[models]] array) rather than one server."""
    try:
        data = tomllib.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return "models" in data or "node" in data
