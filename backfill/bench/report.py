"""Reports of a co-serving comparison: JSON, a Markdown table with ratios, PNG timelines.

    write_report({"online-only": ModeResult(m0, recs0), "coserve": ModeResult(m1, recs1)}, "out/")

writes out/report.json (one object per mode: config, metrics, ratios to the baseline, and the
P99 latency ratios' bootstrap intervals),
out/report.md, out/requests-<mode>.jsonl (one record per request), and the timelines
(ConServe Figures 5-6): throughput.png (online/offline tokens/s per second, one row per mode),
latency.png (TTFT and TPOT of each online request against its send time, SLO lines dashed)
and, when the target reported engine stats, engine.png.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot loads)

from backfill.bench.ceiling import OfflineCeiling, offline_ceilings  # noqa: E402
from backfill.bench.confidence import RatioInterval, paired_values, percentile_ratio_interval  # noqa: E402
from backfill.bench.metrics import BenchMetrics, RequestRecord  # noqa: E402
from backfill.errors import WorkloadError  # noqa: E402
from backfill.types import RequestClass  # noqa: E402


@dataclass(frozen=True)
class ModeResult:
    metrics: BenchMetrics
    records: Sequence[RequestRecord]
    config: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class ReportFiles:
    json: Path
    markdown: Path
    requests: tuple[Path, ...]
    plots: tuple[Path, ...]


# (label, getter) of the headline columns, in table order.
KEY_METRICS: tuple[tuple[str, Callable[[BenchMetrics], float | None]], ...] = (
    ("P99 TTFT (ms)", lambda m: m.online.ttft_ms.p99),
    ("P99 TPOT (ms)", lambda m: m.online.tpot_ms.p99),
    ("online tok/s", lambda m: m.online.tokens_per_s),
    ("offline tok/s", lambda m: m.offline.tokens_per_s),
    ("total tok/s", lambda m: m.total_tokens_per_s),
    ("preempt/online req", lambda m: m.preemptions_per_online_request),
    ("P99 preempt lat (ms)", lambda m: m.preemption_latency_ms.p99),
    ("goodput (req/s)", lambda m: m.goodput_rps),
)


def ratios(metrics: BenchMetrics, baseline: BenchMetrics) -> dict[str, float | None]:
    """Each key metric divided by the baseline's (None where either is missing or the baseline is 0)."""
    out = {}
    for label, get in KEY_METRICS:
        a, b = get(metrics), get(baseline)
        out[label] = a / b if a is not None and b not in (None, 0) else None
    return out


# Online latencies whose P99 ratio to the baseline gets an interval (bench/confidence.py).
LATENCY_INTERVALS: tuple[tuple[str, Callable[[RequestRecord], float | None]], ...] = (
    ("P99 TTFT", lambda r: r.ttft_ms),
    ("P99 TPOT", lambda r: r.tpot_ms),
)


def ratio_intervals(records: Sequence[RequestRecord], baseline: Sequence[RequestRecord]) -> dict[str, RatioInterval]:
    """95% paired-bootstrap intervals of the P99 latency ratios; a latency with fewer than two
    requests measured in both runs is left out."""
    out = {}
    for label, value in LATENCY_INTERVALS:
        try:
            out[label] = percentile_ratio_interval(*paired_values(records, baseline, value))
        except WorkloadError:  # too few paired requests, or a zero baseline: no interval to give
            continue
    return out


def _intervals_by_mode(results: Mapping[str, ModeResult], baseline: str) -> dict[str, dict[str, RatioInterval]]:
    return {name: ratio_intervals(res.records, results[baseline].records)
            for name, res in results.items() if name != baseline}


def write_report(results: Mapping[str, ModeResult], out_dir: str | Path,
                 baseline: str | None = "online-only") -> ReportFiles:
    """Write the report files; ratios are left out when the baseline mode is absent."""
    if not results:
        raise WorkloadError("no mode results to report")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = results[baseline].metrics if baseline in results else None
    doc = {"baseline": baseline if base is not None else None, "modes": {}}
    intervals = _intervals_by_mode(results, baseline) if base is not None else {}
    for name, res in results.items():
        doc["modes"][name] = {"config": dict(res.config), "metrics": res.metrics.to_dict(),
                              "ratios_to_baseline": ratios(res.metrics, base) if base is not None else None}
        if name in intervals:
            doc["modes"][name]["ratio_intervals_95"] = {label: asdict(iv) for label, iv in intervals[name].items()}
    ceilings = offline_ceilings(results)
    doc["offline_ceiling"] = {mode: c.to_dict() for mode, c in ceilings.items()}
    json_path = out / "report.json"
    json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    md_path = out / "report.md"
    md_path.write_text(markdown_table(results, baseline if base is not None else None, intervals, ceilings),
                       encoding="utf-8")
    request_paths = []
    for name, res in results.items():
        p = out / f"requests-{_slug(name)}.jsonl"
        p.write_text("".join(json.dumps(r.to_json()) + "\n" for r in res.records), encoding="utf-8")
        request_paths.append(p)
    plots = [plot_throughput(results, out / "throughput.png"), plot_latency(results, out / "latency.png")]
    if any(res.metrics.timeseries.engine for res in results.values()):
        plots.append(plot_engine(results, out / "engine.png"))
    return ReportFiles(json_path, md_path, tuple(request_paths), tuple(plots))


def markdown_table(results: Mapping[str, ModeResult], baseline: str | None,
                   intervals: Mapping[str, Mapping[str, RatioInterval]] | None = None,
                   ceilings: Mapping[str, OfflineCeiling] | None = None) -> str:
    """The report's Markdown; `intervals` (mode -> label -> interval) and `ceilings` (mode -> offline
    ceiling) are computed when not given."""
    base = results[baseline].metrics if baseline in results else None
    lines = ["# Co-serving benchmark", ""]
    lines.append(f"Ratios are to `{baseline}`." if base is not None else "No baseline mode: ratios omitted.")
    lines += ["", "| mode | " + " | ".join(label for label, _ in KEY_METRICS) + " |",
              "|---|" + "---:|" * len(KEY_METRICS)]
    for name, res in results.items():
        cells = []
        for label, get in KEY_METRICS:
            value = get(res.metrics)
            cell = _fmt(value)
            if base is not None and value is not None and get(base) not in (None, 0):
                cell += f" ({value / get(base):.2f}x)"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if base is not None:
        lines += _interval_section(intervals if intervals is not None else _intervals_by_mode(results, baseline),
                                   baseline)
    lines += ["", "## Online latency (ms): mean / p50 / p90 / p99 / max", "",
              "| mode | TTFT | TPOT | ITL | E2E | send lag | SLO attainment |", "|---|---|---|---|---|---|---:|"]
    for name, res in results.items():
        m = res.metrics
        parts = [_summary(s) for s in (m.online.ttft_ms, m.online.tpot_ms, m.online.itl_ms, m.online.e2e_ms,
                                       m.send_lag_ms)]
        att = f"{m.slo_attainment:.1%}" if m.slo_attainment is not None else "-"
        lines.append(f"| {name} | " + " | ".join(parts) + f" | {att} |")
    lines += ["", "## Requests", "", "| mode | online sent / done / failed | offline sent / done / failed / cut "
              "| duration (s) | preemptions |", "|---|---|---|---:|---:|"]
    for name, res in results.items():
        m = res.metrics
        lines.append(f"| {name} | {m.online.requests} / {m.online.completed} / {m.online.failed} | "
                     f"{m.offline.requests} / {m.offline.completed} / {m.offline.failed} / {m.offline.cancelled} | "
                     f"{m.duration_s:.1f} | {m.preemptions} |")
    engines = {name: res.config["engine"] for name, res in results.items()
               if res.config.get("engine", {}).get("mode_busy_s")}
    if engines:
        lines += ["", "## Engine time by step mode", "",
                  "| mode | step mode | busy (s) | offline tokens | offline tok/s while in it |", "|---|---|---:|---:|---:|"]
        for name, engine in engines.items():
            made = engine.get("mode_offline_tokens", {})
            for step_mode, seconds in sorted(engine["mode_busy_s"].items()):
                tokens = made.get(step_mode, 0)
                rate = f"{tokens / seconds:.1f}" if seconds > 0 else "-"
                lines.append(f"| {name} | {step_mode} | {seconds:.1f} | {tokens} | {rate} |")
    errors = {name: res.config["engine"]["model_error"] for name, res in results.items()
              if res.config.get("engine", {}).get("model_error")}
    if errors:
        lines += _model_error_section(errors)
    drifts = {name: d for name, res in results.items() if (d := res.config.get("engine", {}).get("latency_drift"))}
    if drifts:
        lines += _drift_section(drifts)
    ceilings = offline_ceilings(results) if ceilings is None else ceilings
    if ceilings:
        lines += _ceiling_section(ceilings)
    return "\n".join(lines) + "\n"


def _model_error_section(errors: Mapping[str, Mapping[str, dict]]) -> list[str]:
    lines = ["", "## Latency model error", "",
             "What the policy predicted for each step it planned against what the step took, over the steps "
             "the run executed: |predicted - measured| / measured; bias is the median signed error (> 0: the "
             "model expected slower steps).", "",
             "| mode | step mode | steps | median | P90 | bias |", "|---|---|---:|---:|---:|---:|"]
    for name, by_mode in errors.items():
        for step_mode, e in sorted(by_mode.items()):
            lines.append(f"| {name} | {step_mode} | {e['steps']} | {e['median']:.1%} | {e['p90']:.1%} | "
                         f"{e['bias']:+.1%} |")
    return lines


def _drift_section(drifts: Mapping[str, dict]) -> list[str]:
    lines = ["", "## Latency model corrected online", "",
             "The factor the policy applied to its profile's step estimates, from measured over predicted step "
             "time (backfill/policy/drift.py); a drift flagged is one that lasted long enough to re-profile.", "",
             "| mode | steps | largest factor | at the end | drifts flagged | factor over time (s: x) |",
             "|---|---:|---:|---:|---:|---|"]
    for name, d in drifts.items():
        points = d["timeline"]
        every = max(1, len(points) // 12)
        trace = ", ".join(f"{t:.0f}: {f:.2f}" for t, f in points[::every])
        lines.append(f"| {name} | {d['steps']} | {d['max_factor']:.2f} | {d['end_factor']:.2f} | {d['flags']} | "
                     f"{trace} |")
    return lines


def _ceiling_section(ceilings: Mapping[str, OfflineCeiling]) -> list[str]:
    def vs_priority(ratio: float | None) -> str:
        return f" ({ratio:.3f}x priority)" if ratio is not None else ""

    rows = [f"| {mode} | {c.online_busy_s:.1f} | {c.duration_s:.1f} | {c.batching_tokens_per_s:.1f} | "
            f"{c.ceiling_tokens_per_s:.1f}{vs_priority(c.ceiling_vs_priority)} | "
            f"{c.measured_tokens_per_s:.1f}{vs_priority(c.measured_vs_priority)} |" for mode, c in ceilings.items()]
    return ["", "## Offline ceiling", "",
            "The most offline tokens/s a mode could reach, riders aside: its offline batches run only while no "
            "online request is present, and online work takes at least online-only's busy time "
            "(backfill/bench/ceiling.py).", "",
            "| mode | online-only busy (s) | duration (s) | batching tok/s | ceiling offline tok/s | "
            "offline tok/s reached |", "|---|---:|---:|---:|---:|---:|", *rows]


def _interval_section(intervals: Mapping[str, Mapping[str, RatioInterval]], baseline: str) -> list[str]:
    rows = []
    for name, by_label in intervals.items():
        cells = [f"{iv.ratio:.2f}x [{iv.low:.2f}, {iv.high:.2f}]" if (iv := by_label.get(label)) else "-"
                 for label, _ in LATENCY_INTERVALS]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return ["", f"P99 latency ratios to `{baseline}` with 95% intervals: a paired bootstrap over the online "
            "requests (the same requests resampled in both runs), i.e. how much the ratio depends on which "
            "few requests land in the tail. It does not cover the machine drifting between runs.", "",
            "| mode | " + " | ".join(label for label, _ in LATENCY_INTERVALS) + " |",
            "|---|" + "---:|" * len(LATENCY_INTERVALS), *rows]


def format_summary(name: str, m: BenchMetrics) -> str:
    """A vLLM-style text block of one mode's results."""
    rows = [("Duration (s)", m.duration_s),
            ("Online requests sent / completed / failed", f"{m.online.requests} / {m.online.completed} / "
                                                          f"{m.online.failed}"),
            ("Offline requests sent / completed / cut", f"{m.offline.requests} / {m.offline.completed} / "
                                                        f"{m.offline.cancelled}"),
            ("Online output tokens/s", m.online.tokens_per_s),
            ("Offline output tokens/s", m.offline.tokens_per_s),
            ("Total output tokens/s", m.total_tokens_per_s)]
    if m.slo is not None:
        rows += [(f"Goodput req/s (TTFT<={m.slo.ttft_ms:g}ms, TPOT<={m.slo.tpot_ms:g}ms)", m.goodput_rps),
                 ("SLO attainment", f"{m.slo_attainment:.1%}" if m.slo_attainment is not None else "-")]
    for label, s in (("TTFT", m.online.ttft_ms), ("TPOT", m.online.tpot_ms), ("ITL", m.online.itl_ms),
                     ("E2E", m.online.e2e_ms)):
        rows += [(f"Mean {label} (ms)", s.mean), (f"P50 {label} (ms)", s.p50), (f"P99 {label} (ms)", s.p99)]
    rows += [("Preemptions", m.preemptions), ("Preemptions per online request", m.preemptions_per_online_request),
             ("P99 preemption latency (ms)", m.preemption_latency_ms.p99),
             ("Send lag p50 / p99 / max (ms)", " / ".join(_fmt(v) for v in (m.send_lag_ms.p50, m.send_lag_ms.p99,
                                                                           m.send_lag_ms.max)))]
    width = 50
    head = f" {name} ".center(width + 14, "=")
    body = [f"{label:<{width}}{value if isinstance(value, str) else _fmt(value):>14}" for label, value in rows]
    return "\n".join([head, *body, "=" * (width + 14)])


def print_summary(name: str, metrics: BenchMetrics) -> None:
    print(format_summary(name, metrics))


def plot_throughput(results: Mapping[str, ModeResult], path: Path) -> Path:
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.4 * len(results) + 0.6), sharex=True,
                             sharey=True, squeeze=False)
    # One scale for every mode, set from all of them: a limit set while drawing the first mode froze
    # the shared axis at online-only's range, and offline throughput ran off the top.
    top = max((max(values, default=0.0) for res in results.values()
               for values in res.metrics.timeseries.tokens_per_s.values()), default=0.0)
    for ax, (name, res) in zip(axes[:, 0], results.items()):
        ts = res.metrics.timeseries
        edges = ts.t_s + [ts.t_s[-1] + ts.bucket_s]  # repeat the last value so its bucket is drawn too
        for cls, color in ((RequestClass.ONLINE.value, "tab:blue"), (RequestClass.OFFLINE.value, "tab:orange")):
            values = ts.tokens_per_s[cls]
            ax.step(edges, values + values[-1:], where="post", color=color, label=cls)
        ax.set_ylim(0, 1.05 * top or 1.0)
        ax.axvline(res.metrics.duration_s, color="grey", linestyle=":", linewidth=1)
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("tokens/s")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("time (s)")
    return _save(fig, path)


def plot_latency(results: Mapping[str, ModeResult], path: Path) -> Path:
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 2.4 * len(results) + 0.6), sharex=True,
                             sharey="col", squeeze=False)
    for row, (name, res) in zip(axes, results.items()):
        online = [r for r in res.records if r.request_class is RequestClass.ONLINE and r.ok]
        slo = res.metrics.slo
        for ax, label, get, limit in ((row[0], "TTFT (ms)", lambda r: r.ttft_ms, slo.ttft_ms if slo else None),
                                      (row[1], "TPOT (ms)", lambda r: r.tpot_ms, slo.tpot_ms if slo else None)):
            pts = [(r.send_s, get(r)) for r in online if get(r) is not None]
            if pts:
                ax.scatter(*zip(*pts), s=6, color="tab:blue")
            if limit is not None:
                ax.axhline(limit, color="tab:red", linestyle="--", linewidth=1, label="SLO")
                ax.legend(loc="upper right", fontsize=8)
            ax.set_ylabel(label)
            # One log scale per column: priority's TTFTs run far above coserve's, and on a shared linear
            # axis that froze at the first row's range they fell off the plot.
            ax.set_yscale("log")
            ax.set_title(name, fontsize=10)
    for ax in axes[-1]:
        ax.set_xlabel("send time (s)")
    return _save(fig, path)


def plot_engine(results: Mapping[str, ModeResult], path: Path) -> Path:
    keys = sorted({k for res in results.values() for k in res.metrics.timeseries.engine})
    fig, axes = plt.subplots(len(keys), len(results), figsize=(5 * len(results), 2.0 * len(keys) + 0.6),
                             sharex=True, squeeze=False)
    for col, (name, res) in enumerate(results.items()):
        ts = res.metrics.timeseries
        for row, key in enumerate(keys):
            ax = axes[row, col]
            series = ts.engine.get(key)
            if series is not None:
                pts = [(t, v) for t, v in zip(ts.t_s, series) if v is not None]
                if pts:
                    ax.plot(*zip(*pts), color="tab:green")
            ax.set_title(f"{name}: {key}", fontsize=9)
        axes[-1, col].set_xlabel("time (s)")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _summary(s) -> str:
    return " / ".join(_fmt(v) for v in (s.mean, s.p50, s.p90, s.p99, s.max)) if s.count else "-"


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.1f}"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "mode"
