"""DISB-style workload files (REEF §6.2, Table 2), adapted to LLM co-serving.

A DISB workload is a set of clients. Real-time (RT) clients send requests open loop, evenly
spaced ("uniform", DISB A-D) or Poisson (DISB E); best-effort (BE) clients are usually closed
loop, always keeping `concurrency` requests outstanding. Here RT maps to online requests and BE
to offline ones; a model name of a DNN becomes a model plus a task (a prompt/output length shape).

    {"name": "A", "duration_s": 60,
     "clients": [
       {"name": "rt0", "model": "default", "task": "chat", "priority": "real-time",
        "arrival": "uniform", "rate_per_s": 2.0, "prompt_len": "fixed:128", "output_len": "fixed:32"},
       {"name": "be0", "model": "default", "task": "summarize", "priority": "best-effort",
        "arrival": "closed-loop", "concurrency": 1, "pool_size": 1000,
        "prompt_len": "fixed:512", "output_len": "fixed:48"}]}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backfill.bench.arrivals import poisson_arrivals, uniform_arrivals
from backfill.bench.lengths import LengthSpec, parse_length_spec
from backfill.bench.prompts import PromptSource
from backfill.bench.workload import OfflineBacklog, Workload, make_requests
from backfill.errors import WorkloadError
from backfill.types import RequestClass

ARRIVALS = ("uniform", "poisson", "closed-loop", "trace")
# DNN models (backfill.realtime.models) take a fixed-shape input: their clients need no lengths.
DNN_MODELS = ("resnet152", "vgg19", "bert", "gpt2", "llm")
PRIORITIES = ("real-time", "best-effort")
_CLIENT_KEYS = {"name", "model", "task", "priority", "arrival", "rate_per_s", "concurrency", "pool_size",
                "prompt_len", "output_len", "arrivals_s"}

# Five task shapes standing in for REEF's five DNN models ("5/ALL"); lengths fit a 2k context.
TASKS: dict[str, tuple[str, str]] = {
    "chat": ("fixed:128", "fixed:32"),
    "qa": ("fixed:256", "fixed:16"),
    "summarize": ("fixed:512", "fixed:48"),
    "code": ("fixed:192", "fixed:96"),
    "extract": ("fixed:384", "fixed:8"),
}


@dataclass(frozen=True)
class DisbClient:
    name: str
    priority: str                 # "real-time" (online) or "best-effort" (offline)
    arrival: str                  # "uniform", "poisson" or "closed-loop"
    prompt_len: LengthSpec
    output_len: LengthSpec
    model: str = "default"
    task: str = ""
    rate_per_s: float | None = None   # open-loop clients
    concurrency: int | None = None    # closed-loop clients
    pool_size: int = 1000             # closed-loop: requests available to the loop
    arrivals_s: tuple[float, ...] = ()  # trace clients: arrival times from the start (e.g. an Apollo log)

    def __post_init__(self) -> None:
        where = f"client {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise WorkloadError("every client needs a non-empty string name")
        if self.priority not in PRIORITIES:
            raise WorkloadError(f"{where}: priority must be one of {PRIORITIES}, got {self.priority!r}")
        if self.arrival not in ARRIVALS:
            raise WorkloadError(f"{where}: arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.arrival == "closed-loop":
            if self.priority == "real-time":
                raise WorkloadError(f"{where}: real-time clients are open loop (uniform or poisson), not closed-loop")
            if not isinstance(self.concurrency, int) or isinstance(self.concurrency, bool) or self.concurrency < 1:
                raise WorkloadError(f"{where}: closed-loop clients need an integer concurrency >= 1")
            if self.rate_per_s is not None:
                raise WorkloadError(f"{where}: closed-loop clients take concurrency, not rate_per_s")
        elif self.arrival == "trace":
            times = self.arrivals_s
            if (not isinstance(times, tuple) or not times
                    or any(not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0
                           for t in times) or list(times) != sorted(times)):
                raise WorkloadError(f"{where}: trace clients need arrivals_s, a non-empty sorted list of times >= 0")
            if self.rate_per_s is not None or self.concurrency is not None:
                raise WorkloadError(f"{where}: trace clients take arrivals_s, not rate_per_s or concurrency")
        else:
            r = self.rate_per_s
            if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r) or r <= 0:
                raise WorkloadError(f"{where}: {self.arrival} clients need a positive rate_per_s, got {r!r}")
            if self.concurrency is not None:
                raise WorkloadError(f"{where}: open-loop clients take rate_per_s, not concurrency")
        if not isinstance(self.pool_size, int) or isinstance(self.pool_size, bool) or self.pool_size < 1:
            raise WorkloadError(f"{where}: pool_size must be an integer >= 1")
        for key in ("model", "task"):
            if not isinstance(getattr(self, key), str):
                raise WorkloadError(f"{where}: {key} must be a string")

    @property
    def request_class(self) -> RequestClass:
        return RequestClass.ONLINE if self.priority == "real-time" else RequestClass.OFFLINE

    def to_json(self) -> dict:
        out = {"name": self.name, "model": self.model, "task": self.task, "priority": self.priority,
               "arrival": self.arrival, "prompt_len": str(self.prompt_len), "output_len": str(self.output_len)}
        if self.arrival == "closed-loop":
            out.update(concurrency=self.concurrency, pool_size=self.pool_size)
        elif self.arrival == "trace":
            out["arrivals_s"] = list(self.arrivals_s)
        else:
            out["rate_per_s"] = self.rate_per_s
        return out


@dataclass(frozen=True)
class DisbWorkload:
    name: str
    duration_s: float
    clients: tuple[DisbClient, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "clients", tuple(self.clients))
        d = self.duration_s
        if not isinstance(d, (int, float)) or isinstance(d, bool) or not math.isfinite(d) or d <= 0:
            raise WorkloadError(f"duration_s must be a positive number, got {d!r}")
        if not self.clients:
            raise WorkloadError("a DISB workload needs at least one client")
        names = [c.name for c in self.clients]
        if len(set(names)) != len(names):
            raise WorkloadError(f"client names must be unique, got {names}")
        if not any(c.arrival != "closed-loop" for c in self.clients):
            raise WorkloadError("a DISB workload needs at least one open-loop client to time the run")

    def to_json(self) -> dict:
        return {"name": self.name, "duration_s": self.duration_s, "clients": [c.to_json() for c in self.clients]}

    def to_workload(self, prompts: PromptSource, seed: int) -> Workload:
        """Requests of every client; client i draws from its own stream seeded by (seed, i)."""
        requests, backlogs, index = [], [], 0
        n_uniform = sum(c.arrival == "uniform" for c in self.clients)
        k_uniform = 0
        for i, c in enumerate(self.clients):
            rng = np.random.default_rng([seed, i])
            if c.arrival == "closed-loop":
                n = c.pool_size
                arrivals = None
            elif c.arrival == "uniform":
                # Stagger the phases of uniform clients so they do not all fire at the same instant.
                offset_s = (k_uniform / n_uniform) / c.rate_per_s
                k_uniform += 1
                arrivals = uniform_arrivals(c.rate_per_s, duration_s=self.duration_s, offset_s=offset_s)
                n = len(arrivals)
            elif c.arrival == "trace":
                arrivals = np.asarray([t for t in c.arrivals_s if t < self.duration_s], dtype=np.float64)
                n = len(arrivals)
            else:
                arrivals = poisson_arrivals(c.rate_per_s, rng, duration_s=self.duration_s)
                n = len(arrivals)
            reqs = make_requests(prompts, arrivals, prompt_lengths=c.prompt_len.sample(rng, n),
                                 output_lengths=c.output_len.sample(rng, n), request_class=c.request_class,
                                 first_index=index, id_prefix=f"{c.name}-", client=c.name)
            index += n
            if arrivals is None:
                backlogs.append(OfflineBacklog(c.concurrency, reqs, c.name))
            else:
                requests.extend(reqs)
        return Workload(tuple(requests), tuple(backlogs), self.duration_s, f"disb-{self.name}",
                        {"disb": self.to_json(), "seed": seed})


def parse_disb(obj: object, source: str = "<json>") -> DisbWorkload:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{source}: a DISB workload is a JSON object")
    unknown = set(obj) - {"name", "duration_s", "clients"}
    if unknown:
        raise WorkloadError(f"{source}: unknown top-level field(s) {sorted(unknown)}")
    clients = obj.get("clients")
    if not isinstance(clients, list):
        raise WorkloadError(f"{source}: 'clients' must be a list")
    parsed = []
    for i, c in enumerate(clients):
        where = f"{source}: clients[{i}]"
        if not isinstance(c, dict):
            raise WorkloadError(f"{where} must be an object")
        unknown = set(c) - _CLIENT_KEYS
        if unknown:
            raise WorkloadError(f"{where}: unknown field(s) {sorted(unknown)}")
        lengths = () if c.get("model") in DNN_MODELS else ("prompt_len", "output_len")
        for key in ("name", "priority", "arrival", *lengths):
            if key not in c:
                raise WorkloadError(f"{where}: missing field {key!r}")
        trace = c.get("arrivals_s", ())
        try:
            parsed.append(DisbClient(
                name=c["name"], priority=c["priority"], arrival=c["arrival"],
                prompt_len=parse_length_spec(c.get("prompt_len", "fixed:1")),
                output_len=parse_length_spec(c.get("output_len", "fixed:1")),
                model=c.get("model", "default"), task=c.get("task", ""), rate_per_s=c.get("rate_per_s"),
                concurrency=c.get("concurrency"), pool_size=c.get("pool_size", 1000),
                arrivals_s=tuple(trace) if isinstance(trace, list) else trace))
        except WorkloadError as exc:
            raise WorkloadError(f"{where}: {exc}") from None
    try:
        return DisbWorkload(str(obj.get("name", "")), obj.get("duration_s", 60.0), tuple(parsed))
    except WorkloadError as exc:
        raise WorkloadError(f"{source}: {exc}") from None


def load_disb(path: str | Path) -> DisbWorkload:
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such DISB workload file") from None
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg})") from None
    return parse_disb(obj, str(path))


def save_disb(workload: DisbWorkload, path: str | Path) -> None:
    Path(path).write_text(json.dumps(workload.to_json(), indent=2) + "\n", encoding="utf-8")


def disb_preset(letter: str, max_rate_per_s: float, *, duration_s: float = 60.0,
                model: str = "default") -> DisbWorkload:
    """DISB A-E of REEF Table 2; max_rate_per_s is the RT request rate that saturates the engine alone.

    A: 1 RT at 50% uniform + 1 BE    B: 1 RT at 100% uniform + 1 BE    C: 1 RT at 50% uniform + 5 BE
    D: 5 RT at 10% uniform each + 5 BE    E: 5 RT at 10% Poisson each + 5 BE   (BE: closed loop, 1 each)
    """
    table = {"A": (1, 0.5, "uniform", 1), "B": (1, 1.0, "uniform", 1), "C": (1, 0.5, "uniform", 5),
             "D": (5, 0.1, "uniform", 5), "E": (5, 0.1, "poisson", 5)}
    key = letter.upper() if isinstance(letter, str) else letter
    if key not in table:
        raise WorkloadError(f"unknown DISB workload {letter!r}; known: A, B, C, D, E")
    if not isinstance(max_rate_per_s, (int, float)) or not math.isfinite(max_rate_per_s) or max_rate_per_s <= 0:
        raise WorkloadError(f"max_rate_per_s must be a positive number, got {max_rate_per_s!r}")
    n_rt, share, arrival, n_be = table[key]
    tasks = list(TASKS)
    # Single-client workloads use one fixed pair, as REEF pins VGG (RT) and RNET (BE).
    rt_tasks = ["chat"] if n_rt == 1 else tasks
    be_tasks = ["summarize"] if n_be == 1 else tasks
    clients = [DisbClient(f"rt{i}", "real-time", arrival, parse_length_spec(TASKS[t][0]),
                          parse_length_spec(TASKS[t][1]), model, t, rate_per_s=share * max_rate_per_s)
               for i, t in enumerate(rt_tasks)]
    clients += [DisbClient(f"be{i}", "best-effort", "closed-loop", parse_length_spec(TASKS[t][0]),
                           parse_length_spec(TASKS[t][1]), model, t, concurrency=1)
                for i, t in enumerate(be_tasks)]
    return DisbWorkload(key, float(duration_s), tuple(clients))
