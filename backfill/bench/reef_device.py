"""REEF on a CUDA device, one short check: DISB A (and B-E while time allows) with the same harness
as on the CPU (bench/realtime_bench.py's run_disb with device="cuda"): RT P99 against RT-only's.

    python -m backfill.bench.reef_device --out DIR [--budget-s 60]

The models are the DISB set at their DISB widths (realtime/config.py), random weights, moved to
the device after their idempotence analysis on the CPU; the LLM client is left out (its GGUF
weights are not on the device). Each workload is its own sub-part: an error or the time budget
ends it alone, and summary.json holds every row finished before.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

from backfill.bench.device_summary import PartSummary

PART = "harli-reef"
MODES = ["rt-only", "seq", "concurrent", "reef"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for reef_device.json and summary.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--workloads", default="A,B,C,D,E")
    p.add_argument("--duration", type=float, default=4.0, help="seconds per workload (split over modes' rounds)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=45.0, help="start no workload after this many seconds")
    p.add_argument("--size", choices=["disb", "tiny"], default="disb")
    p.add_argument("--dry-run", action="store_true", help="say what would run, run nothing")
    args = p.parse_args(argv)
    letters = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    what = (f"REEF DISB {', '.join(letters)} on {args.device}: modes {', '.join(MODES)}, {args.duration:g} s each "
            f"in {args.rounds} rounds, no workload started after {args.budget_s:g} s")
    if args.dry_run:
        print(what)
        return 0
    print(what, flush=True)
    summary = PartSummary(args.out, PART)
    out_json = Path(args.out) / "reef_device.json"
    result: dict = {"args": vars(args), "workloads": {}}
    started = time.perf_counter()
    try:
        from backfill.bench.realtime_bench import run_disb
        from backfill.realtime.config import ALL_MODELS, DISB_SCALES, TINY_SCALES

        scales = dict(TINY_SCALES if args.size == "tiny" else DISB_SCALES)
        models = tuple(m for m in ALL_MODELS if m != "llm")
        summary_skip_llm = "REEF: the LLM client of DISB C-E (its GGUF weights are not on the device)"
        summary.skip(summary_skip_llm)
        for letter in letters:
            spent = time.perf_counter() - started
            if spent > args.budget_s:
                summary.skip(f"REEF DISB {letter}: not started, {spent:.0f} s of the {args.budget_s:g} s budget spent")
                continue
            try:
                report = run_disb([letter], MODES, args.duration, args.rounds, scales=scales, all_models=models,
                                  metadata_dir=Path(args.out) / "idempotence", device=args.device,
                                  log=lambda m: print(m, flush=True))
                rows = report["workloads"][letter]["modes"]
                result["workloads"][letter] = report
                out_json.write_text(json.dumps(result, indent=1, default=str) + "\n")
                base = rows.get("rt-only", {}).get("rt_p99_norm")
                solo_ms = report["workloads"][letter]["solo_ms"]
                for mode in ("reef", "seq", "concurrent"):
                    r = rows.get(mode)
                    if not r or r["rt_p99_norm"] is None or not base:
                        continue
                    summary.row(f"REEF DISB {letter} {mode}: RT P99 (x standalone)", f"{r['rt_p99_norm']:.2f}",
                                f"RT-only {base:.2f} ({r['rt_p99_vs_rt_only']:.2f}x)",
                                f"BE throughput {r['throughput_norm']:.2f} (vs seq "
                                f"{r['throughput_vs_seq'] or 0:.2f}x); standalone ms "
                                + ", ".join(f"{k} {v:.2f}" for k, v in solo_ms.items()))
            except Exception as exc:
                result["workloads"][letter] = {"error": traceback.format_exc()}
                summary.skip(f"REEF DISB {letter}: {type(exc).__name__}: {exc}")
    except Exception as exc:
        result["error"] = traceback.format_exc()
        summary.skip(f"REEF on {args.device}: {type(exc).__name__}: {exc}")
    out_json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
