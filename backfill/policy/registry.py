"""The one list of scheduling policies: their names, what each needs, and how one is built.

The serving config's choices, the node config's, the coserve benchmark's modes and the CLI's
defaults all read this list. Free of torch and numpy at import: `--help` reads the names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backfill.errors import InvalidRequestError

if TYPE_CHECKING:
    from backfill.policy.config import CoServeConfig
    from backfill.policy.interface import SafepointLayout, SchedulingPolicy
    from backfill.policy.latency_model import LatencyModel
    from backfill.policy.planner import BatchLimits


@dataclass(frozen=True)
class PolicyEntry:
    name: str
    summary: str
    needs_latency_model: bool = False  # plans with a step-latency profile (measured at start if missing)
    pages_kv: bool = False             # preempts by paging KV out (the scheduler gets a pager)
    in_one_engine: bool = True         # serves online and offline work in one engine (node config, bench coserve)


POLICIES: tuple[PolicyEntry, ...] = (
    PolicyEntry("coserve", "ConServe: SLO-aware co-serving with layer-safepoint preemption",
                needs_latency_model=True),
    PolicyEntry("priority", "online first at iteration level, offline fills the rest (ConServe's vLLM++)"),
    PolicyEntry("fcfs", "one queue by arrival, no notion of class"),
    PolicyEntry("online-only", "serves online requests alone (the latency baseline)"),
    # AQUA §7's CFS is measured by its own benchmark (bench burst), not as a co-serving mode.
    PolicyEntry("cfs", "AQUA: time slices over all requests, KV paged to host or lent memory", pages_kv=True,
                in_one_engine=False),
)
BY_NAME = {entry.name: entry for entry in POLICIES}
NAMES: tuple[str, ...] = tuple(BY_NAME)
# The policies that serve both classes in one engine: a node engine's choices, the coserve benchmark's modes.
ONE_ENGINE_NAMES: tuple[str, ...] = tuple(e.name for e in POLICIES if e.in_one_engine)
BASELINE = "online-only"  # what the others are measured against: online work alone
# The coserve benchmark's default run order: the baseline first, then each admitting more offline work.
BENCH_ORDER: tuple[str, ...] = tuple(reversed(ONE_ENGINE_NAMES))


def entry(name: str) -> PolicyEntry:
    try:
        return BY_NAME[name]
    except KeyError:
        raise InvalidRequestError(f"unknown policy {name!r}; choose among {', '.join(NAMES)}") from None


def default_limits(name: str) -> BatchLimits:
    """The batch limits the policy called name runs with unless told: vLLM V1's server budget for
    the baselines ConServe §6.1 compares with (fcfs, priority) and for cfs; 512 tokens a step for the
    co-serving policy (which raises it to its offline batch in co-serving steps) and online-only."""
    entry(name)
    if name in ("fcfs", "priority", "cfs"):
        from backfill.policy.baselines import VLLM_DEFAULT_LIMITS
        return VLLM_DEFAULT_LIMITS
    from backfill.policy.planner import BatchLimits
    return BatchLimits()


def make_policy(name: str, *, limits: BatchLimits | None, latency: LatencyModel | None, layout: SafepointLayout,
                coserve: CoServeConfig) -> SchedulingPolicy:
    """The policy called name; limits None: the policy's own default batch limits."""
    entry(name)
    given = {} if limits is None else {"limits": limits}
    if name == "online-only":
        from backfill.policy.baselines import OnlineOnlyPolicy
        return OnlineOnlyPolicy(**given)
    if name == "fcfs":
        from backfill.policy.baselines import FCFSPolicy
        return FCFSPolicy(**given)
    if name == "priority":
        from backfill.policy.baselines import PriorityPolicy
        return PriorityPolicy(**given)
    if name == "cfs":
        from backfill.policy.cfs import CFSConfig, CFSPolicy
        return CFSPolicy(CFSConfig(**given))
    if latency is None:
        raise InvalidRequestError("the coserve policy needs a latency profile")
    from backfill.policy.coserve import CoServePolicy
    return CoServePolicy(latency, layout, coserve, **given)
