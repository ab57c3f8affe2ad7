"""Idempotence analysis (REEF §4.4): which ops can be restarted, and from where.

The model runs once under a `TorchDispatchMode` that records, for every aten call inside each op,
the bytes of tensor storage it reads and writes, in order. An op is idempotent when no byte it
reads first is written by it (re-running it sees the same inputs). For each non-idempotent op the
minimal idempotent group is found by the paper's search: start with the op, add predecessors one
at a time until no byte accessed by the group is read before the group writes it (no
clobber-anti-dependency), i.e. the group's inputs are never overwritten by the group. A preempted
op is restored by re-executing from its group's entry.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backfill.errors import RealtimeError
from backfill.realtime.models import OpModel

# In-place aten ops that overwrite their first argument without reading it.
_WRITE_ONLY_INPLACE = {"copy_", "fill_", "zero_", "uniform_", "normal_", "random_", "set_"}

View = tuple[int, tuple[int, ...], tuple[int, ...], int]  # storage offset, shape, strides, item size
Access = tuple[int, View, bool]  # (storage key, the view accessed, is_write)


def _byte_addresses(view: View) -> slice | np.ndarray:
    """The exact bytes of its storage that a tensor view covers: a slice when they are one dense
    range (the common case), else every byte's offset (strided views)."""
    offset, shape, strides, item = view
    if 0 in shape:
        return slice(0, 0)
    dims = sorted((st, n) for n, st in zip(shape, strides) if n > 1)
    expected = 1
    for st, n in dims:  # a permutation of a contiguous layout covers one dense range
        if st != expected:
            break
        expected *= n
    else:
        return slice(offset * item, (offset + expected) * item)
    offsets = np.zeros(1, dtype=np.int64) + offset
    for size, stride in zip(shape, strides):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    offsets = np.unique(offsets)
    return (offsets[:, None] * item + np.arange(item, dtype=np.int64)[None, :]).reshape(-1)


class _AccessTracer(TorchDispatchMode):
    """Records each aten call's reads (inputs) then writes (mutated args and fresh outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.accesses: list[Access] = []

    def _record(self, t: object, is_write: bool) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            view = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.element_size())
            self.accesses.append((t.untyped_storage().data_ptr(), view, is_write))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        returns_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        if returns_view:  # view ops touch no data
            return out
        bound = list(zip(schema.arguments, args)) + [(a, kwargs[a.name]) for a in schema.arguments if a.name in kwargs]
        written = []
        base = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
        for arg, value in bound:
            values = value if isinstance(value, (list, tuple)) else [value]
            is_write = arg.alias_info is not None and arg.alias_info.is_write
            for v in values:
                if is_write:
                    written.append(v)
                    if not (base in _WRITE_ONLY_INPLACE or arg.kwarg_only):
                        self._record(v, False)
                else:
                    self._record(v, False)
        for v in written:
            self._record(v, True)
        if not any(r.alias_info is not None for r in schema.returns):
            for v in (out if isinstance(out, (list, tuple)) else [out]):
                self._record(v, True)
        return out


@dataclass
class _OpSummary:
    read_first: dict[int, np.ndarray]   # key -> bool mask: bytes this op reads before writing
    write_first: dict[int, np.ndarray]  # key -> bool mask: bytes this op writes before reading
    written: dict[int, np.ndarray]      # key -> bool mask: bytes this op writes at all


def trace_ops(model: OpModel) -> list[list[Access]]:
    """Every op's ordered accesses, from one real run in private memory."""
    ws = model.workspace()
    ws.set_input(model.example_input)
    traces = []
    with torch.no_grad():
        for i in range(len(model)):
            with _AccessTracer() as tracer:
                ws.run_op(i)
            traces.append(tracer.accesses)
    return traces


def _runs(addr: slice | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The byte ranges [start, end) an access covers (sorted byte offsets come in runs)."""
    if isinstance(addr, slice):
        return np.array([addr.start]), np.array([addr.stop])
    if len(addr) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(addr) != 1) + 1
    return addr[np.r_[0, breaks]], addr[np.r_[breaks - 1, len(addr) - 1]] + 1


def _segment_masks(runs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[int, list[np.ndarray]]:
    """Compress one storage's accesses to the segments between all their range boundaries.

    Every access covers whole segments, so read-before-write questions have the same answers on
    segments as on bytes, with masks of a few hundred entries instead of the storage's bytes (a
    model's workspace is one storage of tens of MB, and the group search is quadratic in ops).
    """
    bounds = np.unique(np.concatenate([np.concatenate([a, b]) for a, b in runs] or [np.zeros(0, np.int64)]))
    n = max(len(bounds) - 1, 0)
    masks = []
    for starts, ends in runs:
        edge = np.zeros(n + 1, dtype=np.int64)
        np.add.at(edge, np.searchsorted(bounds, starts), 1)
        np.add.at(edge, np.searchsorted(bounds, ends), -1)
        masks.append(np.cumsum(edge[:n]) > 0)
    return n, masks


def _summaries(traces: list[list[Access]]) -> list[_OpSummary]:
    # Storages never written (weights, constants) cannot break idempotence; skip them.
    written_keys = {key for trace in traces for key, _, w in trace if w}
    per_key: dict[int, list] = {}
    for trace in traces:
        for key, view, _ in trace:
            if key in written_keys:
                per_key.setdefault(key, []).append(_runs(_byte_addresses(view)))
    size, masks = {}, {}
    for key, runs in per_key.items():
        size[key], masks[key] = _segment_masks(runs)
        masks[key].reverse()  # popped in trace order below
    out = []
    for trace in traces:
        seen: dict[int, np.ndarray] = {}
        rf: dict[int, np.ndarray] = {}
        wf: dict[int, np.ndarray] = {}
        wr: dict[int, np.ndarray] = {}
        for key, _, is_write in trace:
            if key not in written_keys:
                continue
            addr = masks[key].pop()
            if not addr.any():
                continue
            for d in (seen, rf, wf, wr):
                d.setdefault(key, np.zeros(size[key], dtype=bool))
            first = addr & ~seen[key]  # segments this op touches here for the first time
            target = (wf if is_write else rf)[key]
            target |= first
            seen[key] |= addr
            if is_write:
                wr[key] |= addr
        out.append(_OpSummary(rf, wf, wr))
    return out


def minimal_groups(summaries: list[_OpSummary]) -> list[int]:
    """Entry op of each op's minimal idempotent group (REEF §4.4's backward search)."""
    entries = []
    for i in range(len(summaries)):
        violations: dict[int, np.ndarray] = {}
        written: dict[int, np.ndarray] = {}
        j = i
        while True:
            s = summaries[j]
            # Prepending op j: its write-first bytes stop being group inputs; its read-first bytes
            # become group inputs, which are clobbered if the group (op j included) writes them.
            for key, mask in s.written.items():
                written[key] = written[key] | mask if key in written else mask.copy()
            for key in list(violations):
                if key in s.write_first:
                    violations[key] &= ~s.write_first[key]
            for key, mask in s.read_first.items():
                bad = mask & written.get(key, False)
                if bad.any():
                    violations[key] = violations[key] | bad if key in violations else bad
            if not any(v.any() for v in violations.values()):
                break
            if j == 0:
                raise RealtimeError(f"op {i} has no idempotent group: the model overwrites its own input")
            j -= 1
        entries.append(j)
    return entries


@dataclass(frozen=True)
class IdempotenceMap:
    """Per model: each op's idempotence and the entry of its minimal idempotent group."""

    model: str
    op_names: tuple[str, ...]
    idempotent: tuple[bool, ...]
    group_entry: tuple[int, ...]

    def entry(self, op_index: int) -> int:
        """Where to re-execute from when `op_index` was interrupted (Fig. 8, find_idem_entry)."""
        return self.group_entry[op_index]

    def summary(self) -> dict:
        n = len(self.op_names)
        sizes = [i - self.group_entry[i] + 1 for i in range(n) if not self.idempotent[i]]
        return {"model": self.model, "ops": n, "idempotent": sum(self.idempotent),
                "idempotent_share": sum(self.idempotent) / n if n else 1.0,
                "non_idempotent": n - sum(self.idempotent),
                "group_sizes": dict(sorted(Counter(sizes).items())), "max_group": max(sizes, default=1),
                "non_idempotent_ops": dict(Counter(self.op_names[i] for i in range(n) if not self.idempotent[i]))}

    def to_json(self) -> dict:
        return {"model": self.model, "op_names": list(self.op_names), "idempotent": list(self.idempotent),
                "group_entry": list(self.group_entry)}

    @classmethod
    def from_json(cls, obj: dict) -> "IdempotenceMap":
        try:
            m = cls(obj["model"], tuple(obj["op_names"]), tuple(bool(x) for x in obj["idempotent"]),
                    tuple(int(x) for x in obj["group_entry"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise RealtimeError(f"malformed idempotence metadata: {exc}") from None
        if not (len(m.op_names) == len(m.idempotent) == len(m.group_entry)):
            raise RealtimeError("malformed idempotence metadata: field lengths differ")
        if any(not 0 <= e <= i for i, e in enumerate(m.group_entry)):
            raise RealtimeError("malformed idempotence metadata: a group entry lies after its op")
        return m

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json()) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path, model: OpModel | None = None) -> "IdempotenceMap":
        try:
            m = cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError) as exc:
            raise RealtimeError(f"{path}: cannot read idempotence metadata: {exc}") from None
        if model is not None and (m.model != model.name or m.op_names != tuple(op.name for op in model.ops)):
            raise RealtimeError(f"{path}: idempotence metadata is for another model than {model.name!r}")
        return m


def analyze(model: OpModel) -> IdempotenceMap:
    summaries = _summaries(trace_ops(model))
    idempotent = tuple(not any((s.read_first[k] & s.written[k]).any() for k in s.read_first) for s in summaries)
    entries = minimal_groups(summaries)
    return IdempotenceMap(model.name, tuple(op.name for op in model.ops), idempotent, tuple(entries))


def format_table(maps: list[IdempotenceMap]) -> str:
    """REEF Table 1 / Fig. 10 for our models: ops, idempotent share, group sizes."""
    lines = ["| model | ops | idempotent | share | non-idempotent (by op) | group sizes (size: count) | max group |",
             "|---|---|---|---|---|---|---|"]
    for m in maps:
        s = m.summary()
        ops = ", ".join(f"{k} {v}" for k, v in s["non_idempotent_ops"].items()) or "-"
        pairs = [f"{k}: {v}" for k, v in s["group_sizes"].items()]
        if len(pairs) > 6:  # a residual stream updated in place: one group size per layer
            pairs = pairs[:2] + [f"... ({len(pairs)} sizes)"] + pairs[-1:]
        sizes = ", ".join(pairs) or "-"
        lines.append(f"| {s['model']} | {s['ops']} | {s['idempotent']} | {s['idempotent_share']:.1%} | {ops} | "
                     f"{sizes} | {s['max_group']} |")
    return "\n".join(lines)
