"""P99 latency ratios with 95% paired-bootstrap intervals, for co-serving runs already saved.

`backfill bench coserve` puts these intervals in its report; this script computes them from a
saved run's per-request files (`<out>/requests-<mode>.jsonl`), e.g. for runs made before.

    .venv/bin/python scripts/ratio_intervals.py runs/r1 [runs/q4 ...] [--baseline online-only]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from backfill.bench.metrics import RequestRecord
from backfill.bench.report import ratio_intervals


def load_records(path: Path) -> list[RequestRecord]:
    with path.open(encoding="utf-8") as f:
        return [RequestRecord.from_json(json.loads(line)) for line in f if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="directories written by `backfill bench coserve --out`")
    parser.add_argument("--baseline", default="online-only")
    args = parser.parse_args()
    for run in args.runs:
        base_path = run / f"requests-{args.baseline}.jsonl"
        if not base_path.is_file():
            raise SystemExit(f"{base_path} not found")
        baseline = load_records(base_path)
        for path in sorted(run.glob("requests-*.jsonl")):
            if path == base_path:
                continue
            mode = path.stem.removeprefix("requests-")
            cells = [f"{label} {iv.ratio:.2f}x [{iv.low:.2f}, {iv.high:.2f}]"
                     for label, iv in ratio_intervals(load_records(path), baseline).items()]
            print(f"{run} {mode}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
