"""One table of a device check's figures (scripts/gpu_check.sh): every part's results folded together.

`python -m backfill.bench.gpu_summary OUT` reads what each part left in OUT/<part>/ and writes
OUT/summary.md and OUT/summary.json; a part that failed, timed out or was skipped is a row saying so.
`--check-imports` imports every module the parts run and fails if that pulls in a dependency the
device image lacks (the server's, the GGUF reader's, the grammar library's, Ray).

Parts with their own formats (engine, coserve, cuda-tests) are read here; any other part writes
OUT/<part>/summary.json: {"part", "rows": [{"measure", "value", "reference", "note"}], "skipped": [...]}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Modules a device check runs, and the packages its machine does not have.
DEVICE_CHECK_MODULES = ("backfill.cli", "backfill.bench.engine_bench", "backfill.bench.coserve_bench",
                        "backfill.serving.build", "backfill.serving.async_engine", "backfill.bench.harli_device",
                        "backfill.bench.reef_device", "backfill.bench.node_bench", "backfill.bench.device_burst",
                        "backfill.bench.node_burst_summary", "backfill.bench.cuda_vmm", "backfill.memory.cuda_ipc")
ABSENT_ON_DEVICE = ("gguf", "llguidance", "fastapi", "pydantic", "starlette", "uvicorn", "ray")


@dataclass
class Row:
    part: str
    measure: str
    value: str
    reference: str = ""
    note: str = ""


@dataclass
class GpuSummary:
    rows: list[Row] = field(default_factory=list)
    parts: dict[str, dict] = field(default_factory=dict)  # name -> {"outcome", "seconds", "detail"}
    skipped: list[str] = field(default_factory=list)

    def add(self, part: str, measure: str, value: str, reference: str = "", note: str = "") -> None:
        self.rows.append(Row(part, measure, value, reference, note))


def read_parts(out: Path) -> dict[str, dict]:
    parts = {}
    tsv = out / "parts.tsv"
    if tsv.is_file():
        for line in tsv.read_text().splitlines():
            name, outcome, seconds, detail = (line.split("\t") + ["", "", ""])[:4]
            parts[name] = {"outcome": outcome, "seconds": seconds, "detail": detail}
    return parts


def _ms(x: float) -> str:
    return f"{x:.2f} ms"


def engine_rows(summary: GpuSummary, path: Path) -> None:
    data = json.loads(path.read_text())
    bandwidth = data.get("read_bandwidth_gbs")
    for label, run in data.get("runs", {}).items():
        floor = run.get("bandwidth_floor_ms")
        reference = f"floor {_ms(floor)} ({bandwidth / 1000:.2f} TB/s read)" if floor and bandwidth else ""
        for step in run.get("decode", []):
            summary.add("engine", f"decode TPOT, batch {step['batch']}, {label}, whole-step graphs",
                        f"{_ms(step['tpot_ms'])} ({step['tpot_ms'] / floor:.2f}x floor), "
                        f"{step['tokens_per_s']:,.0f} tok/s", reference)
        for step in run.get("decode_per_layer_graphs", []):
            if step["batch"] in (1, 64):
                summary.add("engine", f"decode TPOT, batch {step['batch']}, {label}, per-layer graphs",
                            f"{_ms(step['tpot_ms'])}, {step['tokens_per_s']:,.0f} tok/s", reference)
        for step in run.get("decode_without_cuda_graphs", []):
            if step["batch"] in (1, 64):
                summary.add("engine", f"decode TPOT, batch {step['batch']}, {label}, no graphs",
                            f"{_ms(step['tpot_ms'])}, {step['tokens_per_s']:,.0f} tok/s", reference)
        for agree in run.get("greedy_triton_vs_torch", []):
            summary.add("engine", f"greedy tokens triton vs torch, batch {agree['batch']}",
                        f"{agree['identical']} of {agree['sequences']} identical",
                        f"shortest common prefix {agree['shortest_common_prefix']} of {agree['tokens_per_sequence']}")
        for mixed in run.get("mixed_steps", []):
            summary.add("engine", f"{mixed['batch']} decodes + {mixed['chunk_tokens']}-token chunk, {label}",
                        f"graphed {_ms(mixed['graphed_ms'])}", f"eager {_ms(mixed['eager_ms'])}",
                        f"logits differ by at most {mixed['max_abs_logit_diff']:.3g}")
        prefill = run.get("prefill")
        if prefill:
            summary.add("engine", f"prefill {prefill['prompt_tokens']} tokens, {label}",
                        f"{_ms(prefill['ms'])}, {prefill['tokens_per_s']:,.0f} tok/s")


def coserve_rows(summary: GpuSummary, path: Path) -> None:
    for point in json.loads(path.read_text()):
        modes = point.get("modes", {})
        setting = f"load {point['online_load']:g}, SLOs {point.get('ttft_slo_ms')}/{point.get('tpot_slo_ms')} ms"
        priority = modes.get("priority", {}).get("offline_tokens_per_s", 0.0)
        for mode, values in modes.items():
            attainment, tokens_per_s = values.get("slo_attainment"), values.get("offline_tokens_per_s", 0.0)
            against = ""
            if priority > 0 and mode not in ("priority", "online-only"):
                against = f"{tokens_per_s / priority:.3f}x priority's offline tok/s"
            summary.add("coserve", f"{mode}, {setting}",
                        ("-" if attainment is None else f"{attainment:.1%} attainment") +
                        f", {tokens_per_s:,.0f} offline tok/s", against)


def junit_rows(summary: GpuSummary, path: Path) -> None:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary.add("cuda-tests", "CUDA tests", f"{counts['tests'] - counts['failures'] - counts['errors'] - counts['skipped']}"
                f" passed of {counts['tests']}", "", f"{counts['failures']} failed, {counts['errors']} errors, "
                f"{counts['skipped']} skipped")


def part_rows(summary: GpuSummary, name: str, path: Path) -> None:
    data = json.loads(path.read_text())
    for row in data.get("rows", []):
        summary.add(name, str(row.get("measure", "")), str(row.get("value", "")), str(row.get("reference", "")),
                    str(row.get("note", "")))
    summary.skipped += [f"{name}: {s}" for s in data.get("skipped", [])]


READERS = {"engine": ("engine-bench.json", engine_rows), "coserve": ("frontier.json", coserve_rows),
           "cuda-tests": ("cuda-tests.xml", junit_rows)}


def summarize(out: Path) -> GpuSummary:
    summary = GpuSummary(parts=read_parts(out))
    names = list(summary.parts) or sorted(p.name for p in out.iterdir() if p.is_dir())
    for name in names:
        filename, reader = READERS.get(name, ("summary.json", None))
        path = out / name / filename
        try:
            if not path.is_file():
                raise FileNotFoundError(f"{path.name} not written")
            (reader or (lambda s, p: part_rows(s, name, p)))(summary, path)
        except Exception as exc:  # noqa: BLE001 - one part's damaged output must not hide the others
            outcome = summary.parts.get(name, {}).get("outcome", "?")
            summary.skipped.append(f"{name}: no figures ({outcome}; {type(exc).__name__}: {exc})")
    return summary


def markdown(summary: GpuSummary) -> str:
    lines = ["| part | outcome | seconds |", "|---|---|---:|"]
    lines += [f"| {n} | {p['outcome']} ({p['detail']}) | {p['seconds']} |" for n, p in summary.parts.items()]
    lines += ["", "| part | measure | value | against | note |", "|---|---|---|---|---|"]
    lines += [f"| {r.part} | {r.measure} | {r.value} | {r.reference} | {r.note} |" for r in summary.rows]
    if summary.skipped:
        lines += ["", "Skipped or missing:"] + [f"- {s}" for s in summary.skipped]
    return "\n".join(lines) + "\n"


def check_imports() -> list[str]:
    """The absent packages that importing the device check's modules pulls in, in a fresh interpreter
    (this one may have imported anything already)."""
    script = (f"import importlib, json, sys\nfor m in {list(DEVICE_CHECK_MODULES)!r}: importlib.import_module(m)\n"
              f"print(json.dumps([n for n in {list(ABSENT_ON_DEVICE)!r} if n in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the device check's modules do not import: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backfill.bench.gpu_summary", description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", help="the device check's output directory")
    parser.add_argument("--check-imports", action="store_true",
                        help="import the device check's modules; fail if they need what the device lacks")
    args = parser.parse_args(argv)
    if args.check_imports:
        pulled = check_imports()
        if pulled:
            print(f"gpu_check: the device check imports {', '.join(pulled)}, which the device image lacks")
            return 1
        print(f"gpu_check: the parts' modules import without {', '.join(ABSENT_ON_DEVICE)}")
        return 0
    if not args.out:
        parser.error("OUT is required unless --check-imports")
    out = Path(args.out)
    summary = summarize(out)
    (out / "summary.md").write_text(markdown(summary))
    (out / "summary.json").write_text(json.dumps({"parts": summary.parts, "rows": [asdict(r) for r in summary.rows],
                                                  "skipped": summary.skipped}, indent=1) + "\n")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
