"""The benchmark's engine processes colocated by a node runtime (Valve §3-§5): the second node
topology, one engine per process driven by `backfill bench node` (bench/node_bench.py), beside
the node a user starts (`backfill serve --config`: node/host.py, runtime.py, model_server.py).

    EngineSpec     frozen config of one engine process (model, KV layout, batch limits, threads).
    EngineProcess  the driver's handle on one engine process (spawned, talks over a pipe):
                   start / send / messages / stop. stop() always leaves the process gone, even
                   when it was SIGSTOPped.

The gated runner and the handle-to-block map the engines run on are the node's (node/gated.py).
The engines themselves live in online_engine.py and offline_engine.py, started by engine_main.py.
Each process pins torch to `spec.threads` threads (1 by default), so two engines on a 2-core machine do not fight over
cores; the memory pool is logical here (each process owns a KV tensor the size of the whole
pool and only uses the blocks of handles it holds), the portable form of Valve's VMM handles.
With `kv_arena` (memory/kv_arena.py) every engine's KV tensor is a view of one allocation the
node shares (a /dev/shm segment, or device memory through CUDA IPC), so a reclaimed handle
changes owner without a byte moving. `device = "cuda"` runs the engine on the GPU; its gate
point drains the stream before it parks (Valve §4: a paused engine launches nothing more and
what it launched finishes before the runtime counts it as stopped).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from backfill.errors import EngineStoppedError, NodeError, PolicyInputError
from backfill.node.gated import GatedRunner

ROLES = ("online", "offline")
MODELS = ("default", "tiny")          # or random:SHAPE (engine/shapes.py): random weights of a real shape
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class EngineSpec:
    engine_id: str
    role: str                          # "online" or "offline"
    num_handles: int                   # the node's pool: handles x blocks_per_handle KV blocks
    blocks_per_handle: int
    block_size: int = 16
    model: str = "default"             # default: SmolLM2-135M; tiny: ModelConfig.tiny(), random weights
    seed: int = 0                      # weights seed of the tiny model
    policy: str = ""                   # scheduling policy; "" = online-only / fcfs by role
    max_batch_tokens: int = 256        # per step; bounds one layer's time, hence the pause latency
    max_batch_seqs: int = 8
    max_model_len: int = 1024
    threads: int = 1                   # torch threads of this process
    os_suspend: bool = False           # offline: ask the runtime to SIGSTOP us instead of only the flag
    device: str = "cpu"                # cpu, cuda or cuda:N
    dtype: str = "float32"             # weights, activations and KV
    kv_arena: dict | None = None       # ArenaDescriptor.to_json(): KV in memory shared by the node's engines

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise PolicyInputError("engine_id must be a non-empty string")
        if self.role not in ROLES:
            raise PolicyInputError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.model not in MODELS and not _is_random_shape(self.model):
            raise PolicyInputError(f"model must be one of {MODELS} or random:SHAPE, got {self.model!r}")
        if self.device.split(":")[0] not in DEVICES:
            raise PolicyInputError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        from backfill.memory.kv_arena import DTYPES
        if self.dtype not in DTYPES:
            raise PolicyInputError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("num_handles", "blocks_per_handle", "block_size", "max_batch_tokens", "max_batch_seqs",
                     "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PolicyInputError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len < 2:
            raise PolicyInputError(f"max_model_len must be >= 2, got {self.max_model_len}")
        allowed = {"online": ("online-only", "fcfs"), "offline": ("fcfs", "priority")}[self.role]
        if self.policy and self.policy not in allowed:
            raise PolicyInputError(f"a {self.role} engine runs one of {allowed}, got {self.policy!r}")
        if self.os_suspend and self.role != "offline":
            raise PolicyInputError("only an offline engine can be OS-suspended")

    @property
    def scheduling_policy(self) -> str:
        return self.policy or ("online-only" if self.role == "online" else "fcfs")

    @property
    def num_blocks(self) -> int:
        return self.num_handles * self.blocks_per_handle


def _is_random_shape(model: str) -> bool:
    from backfill.engine.shapes import SHAPES

    return model.startswith("random:") and model[len("random:"):] in SHAPES


def engine_model_config(model: str):
    """The ModelConfig of an EngineSpec.model, without loading weights."""
    from backfill.engine.config import ModelConfig

    if model == "tiny":
        return ModelConfig.tiny()
    if _is_random_shape(model):
        from backfill.engine.shapes import shape_config
        return shape_config(model[len("random:"):])
    return ModelConfig.smollm2_135m()


def engine_kv_layout(spec: "EngineSpec"):
    """The KV layout of an engine's pool: engines that share an arena must agree on it."""
    from backfill.memory.kv_arena import KVLayout

    return KVLayout.of(engine_model_config(spec.model), spec.num_blocks, spec.block_size, spec.dtype)


def build_engine_runner(spec: EngineSpec, gate_point: Callable[[int], bool] | None = None):
    """Model, KV pool the size of the node pool, gated runner and scheduler of one engine process."""
    from backfill.engine.weights import load_model, random_model
    from backfill.policy.checkpoint import CheckpointConfig
    from backfill.policy.planner import BatchLimits
    from backfill.serving.config import ServingConfig
    from backfill.serving.build import build_serving_stack

    if spec.model == "tiny" or _is_random_shape(spec.model):
        config = engine_model_config(spec.model)
        weights = random_model(config, spec.seed)
    else:
        loaded = load_model()
        config, weights = loaded.config, loaded.weights
    planes = None
    if spec.kv_arena is not None:
        from backfill.errors import SharedMemoryError
        from backfill.memory.kv_arena import ArenaDescriptor, attach, kv_planes

        arena = ArenaDescriptor.from_json(spec.kv_arena)
        if arena.layout != engine_kv_layout(spec):
            raise SharedMemoryError(f"engine {spec.engine_id!r}: the node's KV arena has layout {arena.layout}, "
                                    f"this engine needs {engine_kv_layout(spec)}")
        planes = kv_planes(attach(arena), arena.layout)
    limits = BatchLimits(max_batch_tokens=spec.max_batch_tokens, max_batch_seqs=spec.max_batch_seqs,
                         prefill_chunk_tokens=spec.max_batch_tokens)
    # Valve §5: reclaimed offline KV is recomputed, not restored from host checkpoints. The engine
    # processes run the plain eager model (no compiled steps, SDPA attention, torch kernels).
    cfg = ServingConfig(device=spec.device, dtype=spec.dtype, block_size=spec.block_size, max_model_len=spec.max_model_len,
                        policy=spec.scheduling_policy, limits=limits, checkpoint=CheckpointConfig(enabled=False),
                        threads=spec.threads, compile_decode=False, decode_attention="sdpa",
                        prompt_attention="sdpa", cuda_graphs=False, cuda_kernels="torch")
    stack = build_serving_stack(cfg, config, weights, num_kv_blocks=spec.num_blocks, kv_planes=planes,
                                make_runner=lambda model, kv, graphs: GatedRunner(model, kv, gate_point))
    return stack.runner, stack.scheduler


def request_dict(request_id: str, prompt_token_ids: list[int], max_tokens: int,
                 arrival_s: float | None = None) -> dict[str, Any]:
    """A request as it travels to an engine process (greedy, fixed length: ignore_eos)."""
    return {"request_id": str(request_id), "prompt_token_ids": [int(t) for t in prompt_token_ids],
            "max_tokens": int(max_tokens), "arrival_s": time.monotonic() if arrival_s is None else float(arrival_s)}


def make_request(d: dict[str, Any], request_class: str):
    from backfill.sampling_params import SamplingParams
    from backfill.types import GenerationRequest, RequestClass

    return GenerationRequest(list(d["prompt_token_ids"]),
                             SamplingParams(max_tokens=d["max_tokens"], temperature=0.0, ignore_eos=True),
                             RequestClass(request_class), d["request_id"], d["arrival_s"])


def _package_root() -> str:
    import backfill

    return os.path.dirname(os.path.dirname(os.path.abspath(backfill.__file__)))


class EngineProcess:
    """The driver's side of one engine process (a child interpreter). Messages are (kind, payload) tuples:

    to the engine    ("submit", request_dict)        online: serve this request
                     ("add", [request_dict, ...])    offline: append to the backlog
                     ("report", None)                offline: send ("counters", dict) now
                     ("stop", None)                  finish up, send ("stats", dict), exit
    from the engine  ("ready", info) once, ("done", record) per finished request,
                     ("counters", dict), ("stats", dict) last, ("error", text) on a crash.
    """

    def __init__(self, spec: EngineSpec, socket_path: str) -> None:
        self.spec = spec
        self.socket_path = socket_path
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._inbox: list[tuple[str, Any]] = []
        self.done: list[dict[str, Any]] = []
        self.info: dict[str, Any] | None = None
        self.stats: dict[str, Any] | None = None
        self.error: str | None = None
        self._reader: threading.Thread | None = None
        self._stopped = False

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 120.0) -> "EngineProcess":
        """Spawn `python -m backfill.bench.node_engines.engine_main` (a fresh interpreter: no fork of
        our threads, no re-import of the caller's main module) connected by a socket pair; wait until ready."""
        self.launch()
        return self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 120.0) -> "EngineProcess":
        """After launch(): block until the engine said ready (several engines load at once)."""
        try:
            self.wait_for("ready", timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> "EngineProcess":
        if self._proc is not None:
            raise NodeError(f"engine {self.spec.engine_id!r} was already started")
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "backfill.bench.node_engines.engine_main", str(theirs.fileno()),
                 self.socket_path, json.dumps(asdict(self.spec))], pass_fds=[theirs.fileno()], env=env)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name=f"engine-{self.spec.engine_id}")
        self._reader.start()
        return self

    def send(self, kind: str, payload: Any = None) -> None:
        if self._stopped or not self.alive:
            raise EngineStoppedError(f"engine {self.spec.engine_id!r} is not running")
        try:
            self._conn.send((kind, payload))
        except (OSError, EOFError) as exc:
            raise EngineStoppedError(f"engine {self.spec.engine_id!r} went away: {exc}") from exc

    def wait_for(self, kind: str, timeout_s: float) -> Any:
        """Block until a message of this kind arrives; returns its payload."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while True:
                for i, (k, payload) in enumerate(self._inbox):
                    if k == kind:
                        del self._inbox[i]
                        return payload
                if self.error is not None:
                    raise NodeError(f"engine {self.spec.engine_id!r} failed: {self.error}")
                left = deadline - time.monotonic()
                if left <= 0 or (self._reader is not None and not self._reader.is_alive()):
                    raise NodeError(f"engine {self.spec.engine_id!r}: no {kind!r} within {timeout_s} s")
                self._arrived.wait(min(left, 0.1))

    def counters(self, timeout_s: float = 5.0) -> dict[str, Any]:
        self.send("report")
        return self.wait_for("counters", timeout_s)

    def stop(self, timeout_s: float = 30.0) -> dict[str, Any] | None:
        """Ask the engine to finish and collect its stats; the process is gone afterwards, always."""
        if self._stopped:
            return self.stats
        self._stopped = True
        if self._proc is None:
            return None
        try:
            if self.alive and self.error is None:
                self._conn.send(("stop", None))
                self.stats = self.wait_for("stats", timeout_s)
        except (NodeError, OSError, EOFError):
            pass
        finally:
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                # A stopped (SIGSTOP) process ignores everything but SIGKILL until continued.
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(self._proc.pid, sig)
                    except ProcessLookupError:
                        break
                self._proc.wait(timeout=10.0)
            self._conn.close()
            if self._reader is not None:
                self._reader.join(timeout=5.0)
        return self.stats

    def __enter__(self) -> "EngineProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _read_loop(self) -> None:
        while True:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._arrived:
                if kind == "done":
                    self.done.append(payload)
                elif kind == "ready":
                    self.info = payload
                    self._inbox.append((kind, payload))
                elif kind == "error":
                    self.error = payload
                else:
                    self._inbox.append((kind, payload))
                self._arrived.notify_all()
        with self._arrived:
            self._arrived.notify_all()


def run_child(spec: EngineSpec, conn, body: Callable[[], dict[str, Any]]) -> None:
    """Run an engine body in the child; send its stats, or the error that ended it."""
    import traceback

    try:
        stats = body()
        conn.send(("stats", stats))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc(limit=8)))
        except (OSError, EOFError):
            pass
        raise
    finally:
        conn.close()
