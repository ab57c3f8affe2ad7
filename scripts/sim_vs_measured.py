"""Measured vs simulated, mode by mode: offline tok/s and P99 TPOT / TTFT of a measured run's JSON
(`bench coserve --json`) against a simulated one's (`sim coserve --json`).

Usage: python scripts/sim_vs_measured.py MEASURED.json SIMULATED.json [MODE=SIM_MODE ...]
(MODE=SIM_MODE pairs a measured mode with a simulated variant of another name.)
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    measured, simulated = (json.load(open(p)) for p in sys.argv[1:3])
    pairs = dict(arg.split("=", 1) for arg in sys.argv[3:])
    print("| mode | offline tok/s measured / sim (diff) | P99 TPOT ms measured / sim (diff) | "
          "P99 TTFT ms measured / sim (diff) |")
    print("|---|---|---|---|")
    for mode, m in measured.items():
        sim_mode = pairs.get(mode, mode)
        if sim_mode not in simulated:
            continue
        s = simulated[sim_mode]["metrics"]
        m = m["metrics"]
        cells = []
        for get in (lambda x: x["offline"]["tokens_per_s"], lambda x: x["online"]["tpot_ms"]["p99"],
                    lambda x: x["online"]["ttft_ms"]["p99"]):
            a, b = get(m), get(s)
            diff = f"{b / a - 1:+.0%}" if a else "-"
            cells.append(f"{a:,.1f} / {b:,.1f} ({diff})")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
