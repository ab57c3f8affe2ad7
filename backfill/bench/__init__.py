"""Benchmark harness: workloads (arrivals, traces, lengths, prompts, DISB), a load driver,
metrics with vLLM `bench serve` conventions, and reports.

Names are imported lazily (PEP 562) so `backfill bench engine` does not pay for matplotlib
and the HTTP client; `from backfill.bench import run_workload` works as usual.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "arrivals": ("as_rng", "gamma_shape", "cv_from_burstiness", "gamma_arrivals", "poisson_arrivals",
                 "uniform_arrivals", "piecewise_arrivals", "step_arrivals", "on_off_arrivals", "ArrivalSpec",
                 "parse_arrival_spec"),
    "traces": ("Trace", "TraceRecord", "load_trace", "load_burstgpt", "load_azure", "load_mooncake"),
    "lengths": ("LengthSpec", "FixedLength", "UniformLength", "LognormalLength", "ZipfLength",
                "parse_length_spec"),
    "prompts": ("Prompt", "PromptSource", "bundled_corpus"),
    "workload": ("BenchRequest", "OfflineBacklog", "OfflineSpec", "Workload", "build_workload", "make_requests",
                 "requests_from_trace"),
    "disb": ("DisbClient", "DisbWorkload", "load_disb", "save_disb", "parse_disb", "disb_preset"),
    "target": ("StreamChunk", "Target", "StatsSource"),
    "http_target": ("HttpTarget",),
    "driver": ("RunResult", "run_workload"),
    "metrics": ("RequestRecord", "PreemptionEvent", "Summary", "ClassStats", "TimeSeries", "BenchMetrics",
                "compute_metrics"),
    "report": ("ModeResult", "ReportFiles", "write_report", "format_summary", "print_summary"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'backfill.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"backfill.bench.{_WHERE[name]}"), name)
