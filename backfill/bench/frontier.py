"""The co-serving frontier: SLO attainment against offline throughput, over SLO settings or loads.

ConServe's figures show the trade-off a user chooses from: at each online load and SLO, how many
online requests met their SLOs and how much offline work was harvested, for co-serving and for
the priority baseline (vLLM++). `bench coserve` and `sim coserve` take `--loads` and `--slos` and
run the scenario once per setting (their product), then print and save this table.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from backfill.bench.report import ModeResult
from backfill.bench.scenario import CoserveScenario
from backfill.errors import InvalidRequestError
from backfill.progress import Heartbeat


@dataclass(frozen=True)
class FrontierPoint:
    online_load: float
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None
    # mode label -> (SLO attainment, offline tok/s); attainment None for the baseline
    modes: Mapping[str, tuple[float | None, float]]
    model_error: Mapping[str, Mapping[str, dict]]  # mode -> step mode -> error summary
    # online-only's P50 and P99 TTFT and TPOT, ms, in the run: what the SLOs are measured against
    online_only_ms: Mapping[str, float | None] | None = None

    def to_dict(self) -> dict:
        return {"online_load": self.online_load, "ttft_slo_ms": self.ttft_slo_ms, "tpot_slo_ms": self.tpot_slo_ms,
                "modes": {m: {"slo_attainment": a, "offline_tokens_per_s": t} for m, (a, t) in self.modes.items()},
                "model_error": {m: dict(e) for m, e in self.model_error.items()},
                "online_only_ms": None if self.online_only_ms is None else dict(self.online_only_ms)}


def parse_slos(specs: list[str] | None) -> list[tuple[float | None, float | None]]:
    """'TTFT/TPOT' in ms, e.g. '200/15'; 'alone': online-only's own P99s in the run (strict mode)."""
    out: list[tuple[float | None, float | None]] = []
    for spec in specs or []:
        if spec.strip().lower() == "alone":
            out.append((None, None))
            continue
        parts = spec.split("/")
        try:
            ttft, tpot = (float(p) for p in parts)
        except ValueError:
            raise InvalidRequestError(f"an SLO setting is TTFT_MS/TPOT_MS, e.g. 200/15; got {spec!r}") from None
        if not (ttft > 0 and tpot > 0):
            raise InvalidRequestError(f"SLOs must be positive, got {spec!r}")
        out.append((ttft, tpot))
    return out


def settings(scenario: CoserveScenario, loads: list[float] | None,
             slos: list[tuple[float | None, float | None]] | None) -> list[CoserveScenario]:
    """The scenario at every (load, SLO) pair; an axis not given keeps the scenario's own value."""
    load_axis = loads or [scenario.online_load]
    slo_axis = slos or [(scenario.ttft_slo_ms, scenario.tpot_slo_ms)]
    return [replace(scenario, online_load=load, ttft_slo_ms=ttft, tpot_slo_ms=tpot)
            for load in load_axis for ttft, tpot in slo_axis]


def point(scenario: CoserveScenario, results: Mapping[str, ModeResult]) -> FrontierPoint:
    modes = {mode: (r.metrics.slo_attainment, r.metrics.offline.tokens_per_s) for mode, r in results.items()}
    errors = {mode: r.config.get("engine", {}).get("model_error") or {} for mode, r in results.items()}
    # Unset SLOs are online-only's P99s in the run: the table shows what they came to.
    slo = next((r.config["slo"] for r in results.values() if "slo" in r.config), {})
    alone = results.get("online-only")
    online_only = None if alone is None else {
        "ttft_p50": alone.metrics.online.ttft_ms.p50, "ttft_p99": alone.metrics.online.ttft_ms.p99,
        "tpot_p50": alone.metrics.online.tpot_ms.p50, "tpot_p99": alone.metrics.online.tpot_ms.p99}
    return FrontierPoint(scenario.online_load, scenario.ttft_slo_ms or slo.get("ttft_ms"),
                         scenario.tpot_slo_ms or slo.get("tpot_ms"), modes, {m: e for m, e in errors.items() if e},
                         online_only)


def unreachable_slos(points: list[FrontierPoint]) -> list[str]:
    """One line per SLO setting that online-only itself misses for most requests at the lowest load:
    no co-serving mode can meet it on this machine, and the line says what to give instead."""
    lines = []
    for ttft, tpot in dict.fromkeys((p.ttft_slo_ms, p.tpot_slo_ms) for p in points):
        mine = [p for p in points if (p.ttft_slo_ms, p.tpot_slo_ms) == (ttft, tpot) and p.online_only_ms]
        if not mine or ttft is None or tpot is None:
            continue
        low = min(mine, key=lambda p: p.online_load)
        a = low.online_only_ms
        if (a["ttft_p50"] or 0) > ttft or (a["tpot_p50"] or 0) > tpot:
            need_ttft, need_tpot = max(ttft, 1.2 * (a["ttft_p99"] or 0)), max(tpot, 1.2 * (a["tpot_p99"] or 0))
            lines.append(f"SLO {ttft:g}/{tpot:g} ms is below what online-only reaches on this machine (at load "
                         f"{low.online_load:g} its median TTFT is {a['ttft_p50']:.0f} ms, TPOT {a['tpot_p50']:.1f} "
                         f"ms; P99 {a['ttft_p99']:.0f} / {a['tpot_p99']:.1f} ms): no mode can meet it. Give "
                         f"--slos {need_ttft:.0f}/{need_tpot:.0f} or looser, or simulate a faster machine "
                         f"(--machine and --profile with files from docs/sim/).")
    return lines


def run_frontier(scenarios: list[CoserveScenario], run: Callable[[CoserveScenario, str], Mapping[str, ModeResult]],
                 out_dir: str | Path, log=print) -> list[FrontierPoint]:
    """Run each setting (its report in out_dir/<setting>), then print and save the table."""
    points = []
    for k, scenario in enumerate(scenarios):
        slug = f"load{scenario.online_load:g}-slo{_slo(scenario).replace('/', '-')}"
        log(f"== frontier point {k + 1}/{len(scenarios)}: online load {scenario.online_load:g}, "
            f"SLO TTFT/TPOT {_slo(scenario)} ms")
        with Heartbeat(log, f"frontier point {k + 1}/{len(scenarios)}"):   # a simulated point prints nothing itself
            points.append(point(scenario, run(scenario, str(Path(out_dir) / slug))))
    table = frontier_table(points)
    log(table)
    for line in unreachable_slos(points):
        log(line)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps([p.to_dict() for p in points], indent=1) + "\n")
    (out / "frontier.md").write_text(table + "\n")
    log(f"frontier: {out / 'frontier.md'}")
    return points


def _slo(s: CoserveScenario) -> str:
    def f(x: float | None) -> str:
        return "alone" if x is None else f"{x:g}"

    return f"{f(s.ttft_slo_ms)}/{f(s.tpot_slo_ms)}"


def frontier_table(points: list[FrontierPoint]) -> str:
    """Markdown: per setting, each mode's SLO attainment and offline tok/s, and coserve vs priority."""
    if not points:
        raise InvalidRequestError("no frontier points to tabulate")
    modes = [m for m in points[0].modes if m != "online-only"]
    head = ["online load", "SLO TTFT/TPOT ms"]
    for m in modes:
        head += [f"{m} attainment", f"{m} offline tok/s"]
    if "priority" in modes:
        head += [f"{m} offline / priority" for m in modes if m != "priority"]
    head.append("coserve model error (median, co-serving steps)")
    rows = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for p in points:
        cells = [f"{p.online_load:g}", _slo_of(p)]
        for m in modes:
            att, tok = p.modes.get(m, (None, 0.0))
            cells += ["-" if att is None else f"{att:.1%}", f"{tok:,.0f}"]
        if "priority" in modes:
            base = p.modes["priority"][1]
            cells += [f"{p.modes[m][1] / base:.3f}x" if base > 0 else "-" for m in modes if m != "priority"]
        err = p.model_error.get("coserve", {}).get("co-serving")
        cells.append("-" if err is None else f"{err['median']:.1%}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _slo_of(p: FrontierPoint) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.4g}"

    return f"{f(p.ttft_slo_ms)} / {f(p.tpot_slo_ms)}"
