"""An online-only baseline over HTTP, kept in a file between the two phases of `bench coserve --url`.

Strict co-serving gives the policy SLOs equal to online-only's own P99 TTFT and TPOT ("keep my
latency where it is alone"; ConServe §6.1 calibrates the same way). In-process the harness sets
them between its modes; a server takes its SLOs when it starts. So a user measuring a server in
strict mode runs the online-only phase, restarts the server with `--ttft-slo-ms/--tpot-slo-ms`
from this file, then runs the co-served phase against it. The file keeps every request's record,
so the second phase computes its ratios exactly as one invocation would.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

from backfill.bench.metrics import RequestRecord, compute_metrics
from backfill.bench.report import ModeResult
from backfill.errors import WorkloadError
from backfill.types import RequestClass

FORMAT = "backfill-http-online-baseline/1"
_RECORD_FIELDS = {f.name for f in fields(RequestRecord)}


def write_baseline(path: str | Path, label: str, result: ModeResult, scenario: dict, duration_s: float) -> Path:
    """The online-only run's records and its P99s (the SLOs a strict server is started with)."""
    online = result.metrics.online
    doc = {"format": FORMAT, "label": label, "scenario": scenario, "duration_s": duration_s,
           "p99_ttft_ms": online.ttft_ms.p99, "p99_tpot_ms": online.tpot_ms.p99, "config": dict(result.config),
           "records": [asdict(r) | {"request_class": r.request_class.value} for r in result.records]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def read_baseline(path: str | Path, scenario: dict | None = None) -> tuple[str, ModeResult, dict]:
    """(label, the run as a ModeResult, the file's document); scenario, when given, must be the
    one the baseline ran (the same trace), else the ratios would compare different workloads."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise WorkloadError(f"online-only baseline file {path} does not exist (write it with --phase online-only)") \
            from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WorkloadError(f"online-only baseline file {path} is not readable JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise WorkloadError(f"{path} is not an online-only baseline file (format {FORMAT!r})")
    try:
        records = [_record(r) for r in doc["records"]]
        duration_s = float(doc["duration_s"])
        label = str(doc["label"])
        for key in ("p99_ttft_ms", "p99_tpot_ms"):
            if doc[key] is not None:
                float(doc[key])
    except (KeyError, TypeError, ValueError) as exc:
        raise WorkloadError(f"online-only baseline file {path} is malformed: {type(exc).__name__}: {exc}") from None
    if not records or doc["p99_ttft_ms"] is None or doc["p99_tpot_ms"] is None:
        raise WorkloadError(f"online-only baseline file {path} holds no completed online request")
    if scenario is not None and doc.get("scenario") != scenario:
        changed = sorted(k for k in set(scenario) | set(doc.get("scenario") or {})
                         if scenario.get(k) != (doc.get("scenario") or {}).get(k))
        raise WorkloadError(f"online-only baseline file {path} ran another scenario (differs in {', '.join(changed)})")
    metrics = compute_metrics(records, duration_s=duration_s)
    return label, ModeResult(metrics, records, dict(doc.get("config") or {})), doc


def _record(raw: dict) -> RequestRecord:
    if not isinstance(raw, dict) or not set(raw) <= _RECORD_FIELDS:
        raise ValueError(f"not a request record: {str(raw)[:100]}")
    return RequestRecord(**{**raw, "request_class": RequestClass(raw["request_class"])})
