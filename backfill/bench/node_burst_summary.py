"""The rows of the node / burst device check (scripts/gpu_check_node_burst.sh): what the node benchmark
(node.json) and the device burst (burst.json) measured, and which parts did not run and why.

    python -m backfill.bench.node_burst_summary OUT     writes OUT/summary.json and OUT/summary.md

OUT/summary.json is the shape bench/gpu_summary.py folds into the whole check's table:
{"part", "rows": [{"measure", "value", "reference", "note"}], "skipped": [...]}. Missing or partial
files give rows saying so; nothing here raises on what a cut-short run left.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PART = "node-burst"


def _read(path: Path) -> tuple[dict | None, str]:
    if not path.is_file():
        return None, f"{path.name} missing"
    try:
        return json.loads(path.read_text()), ""
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"{path.name} unreadable: {exc}"


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _f(x: Any, unit: str = "", digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def node_rows(data: dict) -> list[dict]:
    rows = []
    phases = data.get("phases", {})
    alone = phases.get("alone")
    note = "partial run" if data.get("partial") else ""
    for name, phase in phases.items():
        for metric, label, target in (("ttft_ms", "TTFT", 1.10), ("tpot_ms", "TPOT", 1.05)):
            v = _get(phase, "online", metric, "p99")
            base = _get(alone, "online", metric, "p99") if alone else None
            ratio = f" ({v / base:.2f}x alone)" if v is not None and base and name != "alone" else ""
            rows.append({"measure": f"online P99 {label}, {name}", "value": _f(v, " ms") + ratio,
                         "reference": f"alone {_f(base, ' ms')}; Valve target <= {target:.2f}x"
                         if name != "alone" else "", "note": note})
        if name == "alone":
            continue
        pre = phase.get("preemptions_per_online_request", {})
        rows.append({"measure": f"preemptions per online request, {name}",
                     "value": f"mean {_f(pre.get('mean'), digits=2)}, max {pre.get('max')}",
                     "reference": "Valve: at most 1", "note": note})
        rows.append({"measure": f"offline tokens/s, {name}", "value": _f(_get(phase, "offline", "tokens_per_s")),
                     "reference": "", "note": f"lost tokens {_get(phase, 'offline', 'lost_tokens')}"})
        rec = _get(phase, "memory", "reclaim_ms") or {}
        rows.append({"measure": f"reclamation latency, {name}",
                     "value": f"p50 {_f(rec.get('p50'), ' ms', 2)}, p99 {_f(rec.get('p99'), ' ms', 2)} "
                              f"over {rec.get('n', 0)}",
                     "reference": f"cooperative pause ack p99 {_f(_get(phase, 'pause', 'cooperative_ack_ms', 'p99'), ' ms', 2)}",
                     "note": "pause offline, choose, take, notify"})
    sel = _get(data, "summary", "selective_vs_fifo_lost_tokens")
    if sel:
        rows.append({"measure": "lost tokens, selective vs FIFO reclamation",
                     "value": f"{sel.get('selective')} vs {sel.get('fifo')} "
                              f"({_f(100 * sel['reduction'] if sel.get('reduction') is not None else None, '%', 0)} fewer)",
                     "reference": "Valve: >= 20% fewer (CPU: 31%)", "note": ""})
    return rows


def burst_rows(data: dict) -> list[dict]:
    rows = []
    link = data.get("link", {})
    peak = link.get("pcie_gb_per_s")
    note = f"{data.get('requests')} requests, steady {_f(data.get('steady_rate_per_s'), ' req/s', 2)}, 2x burst"
    for mode, m in data.get("modes", {}).items():
        rows.append({"measure": f"burst P99 TTFT, {mode}",
                     "value": f"{_f(_get(m, 'ttft_ms', 'p99'), ' ms')} (in the burst {_f(_get(m, 'burst_ttft_ms', 'p99'), ' ms')})",
                     "reference": "AQUA: CFS far below FCFS", "note": f"{m.get('completed')}/{m.get('requests')} done, "
                     f"{m.get('pages_out', 0)} pages out; {note}"})
    if "p99_ttft_fcfs_over_cfs_host" in data:
        rows.append({"measure": "burst P99 TTFT, FCFS / CFS-host", "value": f"{data['p99_ttft_fcfs_over_cfs_host']:.2f}x",
                     "reference": "CPU: 38x", "note": ""})
    largest = max((t["blocks"] for t in data.get("transfers", [])), default=None)
    for t in data.get("transfers", []):
        if t["blocks"] != largest:
            continue
        share = f" ({t['gb_per_s'] / peak:.0%} of peak)" if peak and t["destination"] == "host" else ""
        rows.append({"measure": f"KV page {t['direction']} to {t['destination']}, {t['bytes'] / 2**20:.0f} MB gathered",
                     "value": f"{t['gb_per_s']:.1f} GB/s{share}",
                     "reference": f"link peak {_f(peak, ' GB/s')} per direction (PCIe gen {link.get('pcie_gen')} "
                                  f"x{link.get('pcie_width')}, {link.get('source')})" if t["destination"] == "host"
                     else "device-to-device copy (neighbour's memory by CUDA IPC)", "note": ""})
    return rows


def summarize_dir(out: Path) -> dict:
    out = Path(out)
    rows: list[dict] = []
    skipped: list[str] = []
    status, _ = _read(out / "parts.json")
    for name, s in (status or {}).items():
        if s.get("outcome") != "ok":
            skipped.append(f"{name}: {s.get('outcome')} ({s.get('detail', '')})")
    for name, reader in (("node.json", node_rows), ("burst.json", burst_rows)):
        data, why = _read(out / name)
        if data is None:
            skipped.append(why)
            continue
        skipped += [f"{name}: {why}" for why in data.get("skipped", [])]
        if data.get("partial"):
            skipped.append(f"{name}: partial (the part was cut short; these rows are what it finished)")
        try:
            rows += reader(data)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            skipped.append(f"{name}: could not be read into rows ({type(exc).__name__}: {exc})")
    result = {"part": PART, "rows": rows, "skipped": skipped}
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    lines = ["| measure | value | reference | note |", "|---|---|---|---|"]
    lines += [f"| {r['measure']} | {r['value']} | {r['reference']} | {r['note']} |" for r in rows]
    if skipped:
        lines += ["", "Not run or not read:"] + [f"- {s}" for s in skipped]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    result = summarize_dir(Path(sys.argv[1]))
    print((Path(sys.argv[1]) / "summary.md").read_text())
