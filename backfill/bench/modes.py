"""The coserve benchmark's modes: a policy, optionally with some of coserve's knobs changed.

    coserve                                     the policy, with the run's options
    coserve:rider_cost_share=1                  a variant: one knob changed
    coserve:interference_slack=0.1,release_suspended=false

A variant runs in the same rounds as the other modes, interleaved with them, so a knob's effect is
measured side by side on one trace. Across two runs minutes apart, this shared machine's drift
moves priority's offline throughput by up to 10% (docs/benchmarks.md), more than most knobs do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from backfill.errors import InvalidRequestError
from backfill.options import build, options_of
from backfill.policy.config import CoServeConfig
from backfill.policy.registry import BASELINE, BENCH_ORDER
from backfill.serving.config import ServingConfig

POLICIES = BENCH_ORDER
TUNABLE = "coserve"  # the policy the knobs belong to

# The knobs a variant may set, with the type of each value: coserve's options (the SLO is the run's).
KNOBS: Mapping[str, type] = MappingProxyType({o.name: o.type for o in options_of(CoServeConfig, "coserve")})
_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def _read_bool(text: str) -> bool:
    if text.lower() in _TRUE + _FALSE:
        return text.lower() in _TRUE
    raise ValueError(f"not a bool: {text!r}")


@dataclass(frozen=True)
class ModeSpec:
    label: str                                  # as given; names the mode in the report
    policy: str
    overrides: Mapping[str, float | int | bool] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def parse(cls, label: str) -> ModeSpec:
        policy, colon, knobs = label.partition(":")
        if policy not in POLICIES:
            raise InvalidRequestError(f"unknown mode {label!r}; a mode is a policy ({', '.join(POLICIES)}), "
                                      "optionally followed by :knob=value,...")
        overrides: dict[str, float | int | bool] = {}
        for item in filter(None, knobs.split(",")):
            key, eq, text = item.partition("=")
            if not eq or key not in KNOBS:
                raise InvalidRequestError(f"mode {label!r}: {item!r} is not knob=value with a knob among "
                                          f"{', '.join(KNOBS)}")
            try:
                overrides[key] = _read_bool(text) if KNOBS[key] is bool else KNOBS[key](text)
            except ValueError as e:
                raise InvalidRequestError(f"mode {label!r}: {key}: {e}") from None
        if overrides and policy != TUNABLE:
            raise InvalidRequestError(f"mode {label!r}: the knobs are {TUNABLE}'s; {policy} takes none")
        if colon and not overrides:
            raise InvalidRequestError(f"mode {label!r}: no knob=value after ':'")
        return cls(label, policy, MappingProxyType(overrides))

    @property
    def with_offline(self) -> bool:
        return self.policy != BASELINE

    def serving(self, base: ServingConfig, **changes) -> ServingConfig:
        """The run's serving config for this mode (validated again, so a bad value fails here)."""
        return build(ServingConfig, dict(self.overrides), base=replace(base, policy=self.policy, **changes))


def parse_modes(labels: tuple[str, ...]) -> tuple[ModeSpec, ...]:
    """Every mode of a run, checked before anything runs: typed errors name the bad one."""
    specs = tuple(ModeSpec.parse(label) for label in labels)
    if len({s.label for s in specs}) != len(specs):
        raise InvalidRequestError(f"a mode is named twice in {', '.join(labels)}")
    for spec in specs:  # a value ServingConfig refuses fails now, not after the model has loaded
        spec.serving(ServingConfig())
    return specs
