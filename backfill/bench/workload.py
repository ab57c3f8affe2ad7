"""A co-serving workload: timed requests (open loop) plus closed-loop offline backlogs.

    prompts = PromptSource(tokenizer, seed=0)
    online = gamma_arrivals(4.0, cv=2.0, seed=0, duration_s=60)
    wl = build_workload(prompts, online, parse_length_spec("lognormal:256:0.6"),
                        parse_length_spec("uniform:32:128"), seed=0,
                        offline=OfflineSpec(concurrency=8, pool_size=500,
                                            prompt_len=FixedLength(512), output_len=FixedLength(128)))

Open-loop requests (`Workload.requests`, online or offline) are sent at `arrival_s` whatever
the target does; an `OfflineBacklog` keeps `concurrency` requests outstanding (ConServe §6:
offline requests are a standing batch of jobs) until the online side is done or its pool runs out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from backfill.bench.arrivals import Seed, as_rng
from backfill.bench.lengths import LengthSpec
from backfill.bench.prompts import PromptSource
from backfill.bench.traces import Trace
from backfill.errors import WorkloadError
from backfill.types import RequestClass


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    arrival_s: float | None          # None: sent by a closed loop, whenever a slot frees
    request_class: RequestClass
    prompt_token_ids: tuple[int, ...]
    prompt_text: str
    max_tokens: int
    ignore_eos: bool = True          # fixed output lengths, as in vLLM's `bench serve --ignore-eos`
    client: str = ""                 # which client (DISB) or stream issued it

    def __post_init__(self) -> None:
        object.__setattr__(self, "request_class", RequestClass(self.request_class))
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise WorkloadError(f"request {self.request_id}: empty prompt")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise WorkloadError(f"request {self.request_id}: max_tokens must be an integer >= 1, "
                                f"got {self.max_tokens!r}")
        if self.arrival_s is not None and not (np.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise WorkloadError(f"request {self.request_id}: arrival_s must be finite and >= 0")

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class OfflineBacklog:
    """A closed loop: `concurrency` requests outstanding, drawn in order from a finite pool."""

    concurrency: int
    requests: tuple[BenchRequest, ...]
    client: str = "offline"

    def __post_init__(self) -> None:
        if not isinstance(self.concurrency, int) or isinstance(self.concurrency, bool) or self.concurrency < 1:
            raise WorkloadError(f"backlog concurrency must be an integer >= 1, got {self.concurrency!r}")
        if not self.requests:
            raise WorkloadError("an offline backlog needs at least one request in its pool")
        if any(r.arrival_s is not None for r in self.requests):
            raise WorkloadError("backlog requests are closed-loop: their arrival_s must be None")


@dataclass(frozen=True)
class Workload:
    requests: tuple[BenchRequest, ...]                 # open loop, sorted by arrival_s
    offline_backlogs: tuple[OfflineBacklog, ...] = ()
    duration_s: float | None = None                    # backlogs run at least this long
    name: str = ""
    meta: Mapping[str, object] = field(default_factory=dict)  # how it was made, for the report

    def __post_init__(self) -> None:
        if any(r.arrival_s is None for r in self.requests):
            raise WorkloadError("open-loop requests need an arrival_s")
        reqs = tuple(sorted(self.requests, key=lambda r: r.arrival_s))
        object.__setattr__(self, "requests", reqs)
        object.__setattr__(self, "offline_backlogs", tuple(self.offline_backlogs))
        ids = [r.request_id for r in self.all_requests()]
        if len(set(ids)) != len(ids):
            raise WorkloadError("request ids must be unique across the workload")
        if not reqs and not self.offline_backlogs:
            raise WorkloadError("a workload needs at least one request")
        if not reqs and self.duration_s is None:
            raise WorkloadError("an offline-only workload needs duration_s to know when to stop")

    def all_requests(self) -> list[BenchRequest]:
        return list(self.requests) + [r for b in self.offline_backlogs for r in b.requests]

    @property
    def online(self) -> tuple[BenchRequest, ...]:
        return tuple(r for r in self.requests if r.request_class is RequestClass.ONLINE)


@dataclass(frozen=True)
class OfflineSpec:
    """How build_workload makes one offline backlog."""

    concurrency: int
    pool_size: int
    prompt_len: LengthSpec
    output_len: LengthSpec


def make_requests(prompts: PromptSource, arrivals_s: Sequence[float] | np.ndarray | None, *,
                  prompt_lengths: Sequence[int], output_lengths: Sequence[int],
                  request_class: RequestClass | str, first_index: int, id_prefix: str,
                  client: str = "", ignore_eos: bool = True) -> tuple[BenchRequest, ...]:
    """Requests with prompts index first_index, first_index+1, ... (arrivals None: closed loop)."""
    n = len(prompt_lengths)
    if len(output_lengths) != n or (arrivals_s is not None and len(arrivals_s) != n):
        raise WorkloadError("arrivals, prompt lengths and output lengths must have the same count")
    out = []
    for i in range(n):
        p = prompts.prompt(first_index + i, int(prompt_lengths[i]))
        out.append(BenchRequest(f"{id_prefix}{i}", None if arrivals_s is None else float(arrivals_s[i]),
                                RequestClass(request_class), p.token_ids, p.text, int(output_lengths[i]),
                                ignore_eos, client))
    return tuple(out)


def build_workload(prompts: PromptSource, online_arrivals_s: Sequence[float] | np.ndarray,
                   prompt_len: LengthSpec, output_len: LengthSpec, seed: Seed, *,
                   offline: OfflineSpec | None = None,
                   offline_arrivals_s: Sequence[float] | np.ndarray | None = None,
                   duration_s: float | None = None, name: str = "") -> Workload:
    """Online requests at the given arrivals; offline as a closed-loop backlog and/or open-loop arrivals.

    Open-loop offline requests take their lengths from the offline spec (or the online ones).
    """
    rng = as_rng(seed)
    n_on = len(online_arrivals_s)
    requests = list(make_requests(prompts, online_arrivals_s, prompt_lengths=prompt_len.sample(rng, n_on),
                                  output_lengths=output_len.sample(rng, n_on), request_class=RequestClass.ONLINE,
                                  first_index=0, id_prefix="online-", client="online"))
    index = n_on
    off_prompt = offline.prompt_len if offline else prompt_len
    off_output = offline.output_len if offline else output_len
    if offline_arrivals_s is not None:
        n = len(offline_arrivals_s)
        requests += make_requests(prompts, offline_arrivals_s, prompt_lengths=off_prompt.sample(rng, n),
                                  output_lengths=off_output.sample(rng, n), request_class=RequestClass.OFFLINE,
                                  first_index=index, id_prefix="offline-open-", client="offline-open")
        index += n
    backlogs = ()
    if offline is not None:
        pool = make_requests(prompts, None, prompt_lengths=off_prompt.sample(rng, offline.pool_size),
                             output_lengths=off_output.sample(rng, offline.pool_size),
                             request_class=RequestClass.OFFLINE, first_index=index, id_prefix="offline-",
                             client="offline")
        backlogs = (OfflineBacklog(offline.concurrency, pool),)
    meta = {"seed": seed if isinstance(seed, int) else None, "prompt_len": str(prompt_len),
            "output_len": str(output_len), "online_requests": n_on}
    if offline is not None:
        meta.update(offline_concurrency=offline.concurrency, offline_pool=offline.pool_size,
                    offline_prompt_len=str(offline.prompt_len), offline_output_len=str(offline.output_len))
    return Workload(tuple(requests), backlogs, duration_s, name, meta)


def requests_from_trace(prompts: PromptSource, trace: Trace, *, request_class: RequestClass | str = "online",
                        max_prompt_tokens: int | None = None, max_output_tokens: int | None = None,
                        first_index: int = 0, id_prefix: str = "trace-") -> tuple[BenchRequest, ...]:
    """Requests replaying a trace's arrivals and lengths, lengths clipped to fit the model's context."""
    for name, cap in (("max_prompt_tokens", max_prompt_tokens), ("max_output_tokens", max_output_tokens)):
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            raise WorkloadError(f"{name} must be an integer >= 1, got {cap!r}")
    prompt_lens = [max(1, min(r.prompt_tokens, max_prompt_tokens or r.prompt_tokens)) for r in trace.records]
    output_lens = [max(1, min(r.output_tokens, max_output_tokens or r.output_tokens)) for r in trace.records]
    return make_requests(prompts, trace.arrivals_s, prompt_lengths=prompt_lens, output_lengths=output_lens,
                         request_class=request_class, first_index=first_index, id_prefix=id_prefix,
                         client=f"trace:{trace.format}")
