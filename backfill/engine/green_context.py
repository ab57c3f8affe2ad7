"""SM partitions on a CUDA device through green contexts (HARLI §5-§6's device form).

For every realisable split, made up front (creating a green context takes milliseconds, too long
for a per-token re-partition): a finetuning partition of k SMs and a decode partition of the rest,
each with a stream; a unit's kernels are issued on its partition's stream (`enter` makes it the
calling thread's current torch stream).

Two paths, chosen in this order:
  driver  cuda.bindings' cuDevSmResourceSplitByCount splits the device's SMs ONCE per split into a
          group of k and the remaining SMs; a green context and a stream on each. The two
          partitions are disjoint, which is what HARLI's split means.
  torch   torch.cuda.green_contexts.GreenContext.create(num_sms, device): one green context per
          finetuning share; decode stays on the primary context's stream with every SM. torch
          creates each context from the whole device, so two of them would overlap: finetuning is
          confined to its k SMs, decode is not kept off them (a weaker isolation, reported).
Any failure while building either raises GreenContextUnavailable with the reason, and the caller
(compute_partition.make_partitions) falls back to the time-sliced form and logs it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from backfill.engine.compute_partition import EPS, RealisedSplit, UNITS, round_to_units

log = logging.getLogger(__name__)

# Hopper and later split SMs in groups of 8 (CUDA driver API, cuDevSmResourceSplitByCount: "on
# compute capability 9.0+ the minimum count is 8 and counts are multiples of 8"); older GPUs by 2.
SM_GROUP = {9: 8, 10: 8, 12: 8}
DEFAULT_SM_GROUP = 2


class GreenContextUnavailable(RuntimeError):
    """No green-context path works on this device (the reason is the message)."""


def sm_group_for(major: int) -> int:
    return SM_GROUP.get(major, 8 if major > 9 else DEFAULT_SM_GROUP)


def planned_ft_sms(total_sms: int, group: int, step: float) -> list[int]:
    """The finetuning SM counts made up front: each share step (10% by default, HARLI §5.2.1)
    rounded to the SM group, distinct, leaving decode at least one group."""
    out: list[int] = []
    k = 1
    while k * step < 1 - EPS:
        sms = round_to_units(1 - k * step, k * step, total_sms, group)[1]
        if 0 < sms <= total_sms - group and sms not in out:
            out.append(sms)
        k += 1
    return sorted(out)


@dataclass
class _Pair:
    ft_sms: int
    decode_sms: int
    ft_stream: object            # torch.cuda.Stream / ExternalStream
    decode_stream: object
    handles: list = field(default_factory=list)  # what close() must destroy (driver path)


class GreenContextPartitions:
    form = "green-context"

    def __init__(self, device: str = "cuda", step: float = 0.1) -> None:
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - torch is a dependency
            raise GreenContextUnavailable(f"torch: {exc}") from exc
        if not torch.cuda.is_available():
            raise GreenContextUnavailable("CUDA is not available")
        self.torch = torch
        self.device = torch.device(device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device_index = index
        props = torch.cuda.get_device_properties(index)
        self.total_sms = int(props.multi_processor_count)
        self.group = sm_group_for(int(props.major))
        self.full_stream = torch.cuda.Stream(device=index)  # every SM: a unit with the whole device
        self._pairs: dict[int, _Pair] = {}
        self._lock = threading.Lock()
        errors = []
        self.path = ""
        for path, build in (("driver", self._build_driver), ("torch", self._build_torch)):
            try:
                self._pairs = build(planned_ft_sms(self.total_sms, self.group, step))
                self.path = path
                break
            except Exception as exc:  # a path that fails leaves nothing behind; try the next
                errors.append(f"{path}: {type(exc).__name__}: {exc}")
                self.close()
        if not self.path:
            raise GreenContextUnavailable("; ".join(errors))
        self.errors = errors
        self.current = RealisedSplit(1.0, 0.0, self.form, "decode on every SM")
        self._current_pair: _Pair | None = None
        log.info("green contexts (%s path): %d SMs in groups of %d, finetuning partitions of %s SMs",
                 self.path, self.total_sms, self.group, sorted(self._pairs))

    # --- building -----------------------------------------------------------------------------

    def _build_driver(self, ft_counts: list[int]) -> dict[int, _Pair]:
        from cuda.bindings import driver as cu

        self._driver = cu  # close() destroys what a failed build made

        def ok(result):
            err, *rest = result if isinstance(result, tuple) else (result,)
            if int(err) != 0:
                raise RuntimeError(f"CUresult {int(err)}")
            return rest[0] if len(rest) == 1 else rest

        self.torch.cuda.init()
        ok(cu.cuInit(0))
        dev = ok(cu.cuDeviceGet(self.device_index))
        sm = ok(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        pairs: dict[int, _Pair] = {}
        self._pairs = pairs  # so close() destroys what was made if a later split fails
        for k in ft_counts:
            groups, count, remaining = ok(cu.cuDevSmResourceSplitByCount(1, sm, 0, k))
            if int(count) != 1 or int(groups[0].sm.smCount) != k:
                raise RuntimeError(f"asked for {k} SMs, the driver split {int(groups[0].sm.smCount)}")
            pair = _Pair(k, int(remaining.sm.smCount), None, None)
            pairs[k] = pair
            streams = []
            for resource in (groups[0], remaining):
                desc = ok(cu.cuDevResourceGenerateDesc([resource], 1))
                gctx = ok(cu.cuGreenCtxCreate(desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
                pair.handles.append(("ctx", gctx))
                stream = ok(cu.cuGreenCtxStreamCreate(gctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
                pair.handles.append(("stream", stream))
                streams.append(self.torch.cuda.ExternalStream(int(stream), device=self.device))
            pair.ft_stream, pair.decode_stream = streams
        return pairs

    def _build_torch(self, ft_counts: list[int]) -> dict[int, _Pair]:
        from torch.cuda.green_contexts import GreenContext

        pairs: dict[int, _Pair] = {}
        for k in ft_counts:
            try:
                ctx = GreenContext.create(k, self.device_index)  # torch 2.11: positional
            except TypeError:
                ctx = GreenContext.create(num_sms=k, device_id=self.device_index)
            pairs[k] = _Pair(k, self.total_sms, ctx.Stream(), self.full_stream, [("torch", ctx)])
        return pairs

    # --- the interface ------------------------------------------------------------------------

    def ft_shares(self) -> tuple[float, ...]:
        return tuple(k / self.total_sms for k in sorted(self._pairs))

    def _nearest_pair(self, share_ft: float) -> _Pair | None:
        if share_ft <= EPS or not self._pairs:
            return None
        want = round_to_units(max(1 - share_ft, 0.0), share_ft, self.total_sms, self.group)[1]
        k = min(self._pairs, key=lambda c: (abs(c - want), c))
        return self._pairs[k]

    def round_split(self, share_infer: float, share_ft: float) -> RealisedSplit:
        if share_infer <= EPS:  # no decode: finetuning on the whole device
            return RealisedSplit(0.0, 1.0 if share_ft > EPS else 0.0, self.form, "finetuning on every SM")
        pair = self._nearest_pair(share_ft)
        if pair is None:
            return RealisedSplit(1.0, 0.0, self.form, "decode on every SM")
        return RealisedSplit(pair.decode_sms / self.total_sms, pair.ft_sms / self.total_sms, self.form,
                             f"decode {pair.decode_sms} SMs, finetune {pair.ft_sms} SMs ({self.path})")

    def apply(self, share_infer: float, share_ft: float) -> RealisedSplit:
        split = self.round_split(share_infer, share_ft)
        with self._lock:
            self._current_pair = self._nearest_pair(split.share_ft) if 0 < split.share_infer else None
            self.current = split
        return split

    def stream_of(self, unit: str):
        if unit not in UNITS:
            raise ValueError(f"unknown compute unit {unit!r}")
        with self._lock:
            pair = self._current_pair
        if pair is None:
            return self.full_stream
        return pair.decode_stream if unit == "decode" else pair.ft_stream

    def enter(self, unit: str) -> None:
        self.torch.cuda.set_stream(self.stream_of(unit))

    def leave(self, unit: str) -> None:
        """Nothing to free: a partition's SMs are its own, whatever runs on the other."""
        if unit not in UNITS:
            raise ValueError(f"unknown compute unit {unit!r}")

    def close(self) -> None:
        cu = getattr(self, "_driver", None)
        for pair in list(self._pairs.values()):
            for kind, handle in reversed(pair.handles):
                try:
                    if kind == "stream" and cu is not None:
                        cu.cuStreamDestroy(handle)
                    elif kind == "ctx" and cu is not None:
                        cu.cuGreenCtxDestroy(handle)
                except Exception:  # closing is best effort: the process may be ending
                    pass
            pair.handles.clear()
        self._pairs = {}


__all__ = ["GreenContextPartitions", "GreenContextUnavailable", "planned_ft_sms", "sm_group_for"]
