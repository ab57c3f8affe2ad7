"""Run every command of the README tour, shortened, on a fresh clone, and check what a user sees.

    python scripts/readme_tour.py [--isa native avx2] [--fast] [--only demo "bench node"] [--json out.json]

The repository is cloned (`git clone` of its committed HEAD) into a temporary folder and each
command runs there as `PYTHON -m backfill.cli ...` with the venv given (--python, default: the one
running this script). With `--isa avx2` PyTorch, oneDNN and backfill's own kernels are held to AVX2
(ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2), as on a CPU without AVX-512.

Each command passes when it exits 0 (a server: answers a request, then stops on SIGINT), prints
its first output within FIRST_OUTPUT_LIMIT_S and is never silent for longer than SILENCE_LIMIT_S,
and, where the tour claims a harvest (demo, bench
node, bench burst), shows a non-zero one. The table gives per command the first output's time,
the longest silence, the wall time and the harvest. `--fast` runs the subset the test suite runs
(tests/test_readme_tour.py): seconds each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

FIRST_OUTPUT_LIMIT_S = 10.0      # python + torch import on a loaded 2-core machine take a few seconds
SILENCE_LIMIT_S = 10.0           # a user watching a command never waits longer than this for a line
AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
REPO = Path(__file__).resolve().parent.parent


def _harvest_demo(out: str) -> float | None:
    m = re.search(r"Harvested ([\d,]+) offline tokens", out)
    return float(m.group(1).replace(",", "")) if m else (0.0 if "Harvested no offline token" in out else None)


def _harvest_node(out: str) -> float | None:
    """The valve phase's offline tokens/s (the table's `off tok/s` column)."""
    column = None
    for line in out.splitlines():
        if column is None and "off tok/s" in line and line.split()[:1] == ["phase"]:
            column = [c for c in re.split(r"\s{2,}", line.strip())].index("off tok/s")
        elif column is not None and line.split()[:1] == ["valve"]:
            try:
                return float(line.split()[column])
            except (ValueError, IndexError):
                return None
    return None


def _harvest_burst(out: str) -> float | None:
    """Blocks cfs-lent paged out to the memory the producer lent (the table's 'paged out' column)."""
    for line in out.splitlines():
        if line.startswith("cfs-lent ") and "/" in line:
            cells = line.split()
            try:
                return float(cells[-2])
            except (ValueError, IndexError):
                return None
    return None


@dataclass(frozen=True)
class Step:
    name: str                          # the README line, as a user types it
    argv: tuple[str, ...]              # what runs: the line shortened
    timeout_s: float
    fast: bool = False                 # in the suite's subset
    harvest: Callable[[str], float | None] | None = None
    server: str | None = None          # a server: this path must answer on the port given as {port}
    setup: Callable[[Path], None] | None = None
    beside: tuple[str, ...] | None = None   # a server started first on {port}, stopped after


@dataclass
class Outcome:
    name: str
    isa: str
    command: str
    rc: int | None
    first_output_s: float | None
    longest_silence_s: float
    wall_s: float
    harvest: float | None
    passed: bool
    why: str = ""
    tail: list[str] = field(default_factory=list)


def _training_file(clone: Path) -> None:
    lines = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}]}
             for w in ("one", "two", "three", "four")]
    (clone / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _node_toml(clone: Path) -> None:
    (clone / "node.toml").write_text(
        "[node]\nmetrics_port = {metrics}\n\n[[models]]\nname = \"chat\"\nmodel = \"tiny\"\nport = {port}\n"
        "policy = \"coserve\"\n")


README_STEPS: tuple[Step, ...] = (
    Step("backfill generate \"Write a haiku about the sea.\"",
         ("generate", "Write a haiku about the sea.", "--max-tokens", "16"), 600),
    Step("backfill demo --duration 20", ("demo", "--duration", "20", "--out", "runs/demo"), 1200,
         harvest=_harvest_demo),
    Step("backfill serve --port 8000", ("serve", "--port", "{port}"), 600, server="/v1/models"),
    Step("backfill bench coserve --rounds 4 --duration 160",
         ("bench", "coserve", "--rounds", "1", "--duration", "20", "--warmup-s", "5", "--modes", "online-only",
          "coserve", "--out", "runs/coserve"), 1200),
    Step("backfill bench engine", ("bench", "engine", "--batches", "1", "8", "--new-tokens", "8", "--no-hf",
                                   "--dtypes", "float32"), 600),
    Step("backfill bench node --phases alone,valve,fifo --duration-s 100",
         ("bench", "node", "--phases", "alone,valve,fifo", "--duration-s", "100"), 1200, harvest=_harvest_node),
    Step("backfill profile", ("profile", "--out", "runs/profile.json"), 1200),
    Step("backfill sim coserve --rounds 4 --duration 240", ("sim", "coserve", "--rounds", "1", "--duration", "30",
                                                            "--out", "runs/sim-coserve"), 900),
    Step("backfill finetune run --training-file train.jsonl --out runs/ft1 --steps 100",
         ("finetune", "run", "--training-file", "train.jsonl", "--out", "runs/ft1", "--steps", "1",
          "--batch-size", "1", "--micro-batch-size", "1"), 900, setup=_training_file),
    Step("backfill finetune create train.jsonl --epochs 2",
         ("finetune", "create", "train.jsonl", "--epochs", "1", "--max-steps", "1", "--url", "http://127.0.0.1:{port}"),
         600, setup=_training_file, beside=("serve", "--port", "{port}")),
    Step("backfill bench finetune --sim", ("bench", "finetune", "--sim", "--duration", "10", "--rounds", "1",
                                           "--out", "runs/bench-finetune"), 300, fast=True),
    Step("backfill bench burst", ("bench", "burst", "--steady-s", "5", "--burst-s", "15", "--after-s", "5",
                                  "--modes", "fcfs", "cfs-lent", "--warmup-s", "2", "--producer-idle-s", "2",
                                  "--producer-tiny", "--json", "runs/burst.json"), 1200, harvest=_harvest_burst),
    Step("backfill offload coordinator --port 8700", ("offload", "coordinator", "--port", "{port}", "--db",
                                                      "runs/coordinator.db"), 120, fast=True, server="/v1/state"),
    Step("backfill bench disb --workload A B", ("bench", "disb", "--workload", "A", "--duration", "4",
                                                "--size", "tiny", "--json", "runs/disb.json"), 600),
    Step("backfill idempotence", ("idempotence", "--size", "tiny"), 300, fast=True),
    Step("backfill sim fleet --placers valve most-idle random",
         ("sim", "fleet", "--placers", "valve", "most-idle", "random", "--devices", "200", "--duration-s", "3600"),
         300, fast=True),
    Step("backfill bench cluster", ("bench", "cluster", "--model", "tiny"), 900),
    Step("backfill bench engine --random-weights --shape llama3-8b",
         ("bench", "engine", "--random-weights", "--shape", "llama3.1-tiny", "--batches", "1", "8",
          "--new-tokens", "8", "--no-hf", "--dtypes", "float32"), 600),
    Step("backfill serve --config node.toml", ("serve", "--config", "node.toml"), 600, server="/v1/models",
         setup=_node_toml),
    Step("backfill sim coserve --loads 0.1 0.3 0.6 --slos 1000/100",
         ("sim", "coserve", "--loads", "0.1", "0.3", "0.6", "--slos", "1000/100", "--duration", "30",
          "--out", "runs/frontier"), 900),
    Step("backfill bench structured", ("bench", "structured", "--requests", "4", "--groups", "1",
                                       "--max-tokens", "32"), 600),
    Step("backfill bench overload", ("bench", "overload", "--burst-s", "10", "--calm-s", "5", "--calibrate-s", "5",
                                     "--max-tokens", "16"), 900),
)

# The order they run in: the harvests the tour claims first, the minutes-long measurements last.
_LAST = ("backfill profile", "backfill bench cluster", "backfill bench overload", "backfill bench coserve")
_FIRST = ("backfill demo", "backfill bench node", "backfill bench burst")
STEPS: tuple[Step, ...] = tuple(sorted(README_STEPS, key=lambda s: (
    0 if s.name.startswith(_FIRST) else 2 if s.name.startswith(_LAST) else 1)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Reader:
    """Collects a process's merged output, timestamping every chunk (tqdm bars end in \\r, not \\n)."""

    def __init__(self, proc: subprocess.Popen, started: float) -> None:
        self.proc, self.started = proc, started
        self.chunks: list[tuple[float, bytes]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while chunk := os.read(self.proc.stdout.fileno(), 65536):
            self.chunks.append((time.monotonic() - self.started, chunk))

    def text(self) -> str:
        return b"".join(c for _, c in self.chunks).decode(errors="replace").replace("\r", "\n")

    def first_output_s(self) -> float | None:
        return next((t for t, c in self.chunks if c.strip()), None)

    def longest_silence_s(self, end_s: float) -> float:
        times = [0.0] + [t for t, c in self.chunks if c.strip()] + [end_s]
        return max(b - a for a, b in zip(times, times[1:]))


def run_step(step: Step, clone: Path, python: str, isa: str, extensions_dir: str | None = None) -> Outcome:
    env = {k: v for k, v in os.environ.items() if k not in AVX2_ENV}
    if extensions_dir:
        env["TORCH_EXTENSIONS_DIR"] = extensions_dir
    if isa == "avx2":
        env.update(AVX2_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    port = free_port()
    if step.setup is not None:
        step.setup(clone)
        if step.name.endswith("node.toml"):   # the node's ports, free now
            text = (clone / "node.toml").read_text()
            (clone / "node.toml").write_text(text.replace("{port}", str(port)).replace("{metrics}", str(free_port())))
    argv = [a.replace("{port}", str(port)) for a in step.argv]
    (clone / "runs").mkdir(exist_ok=True)
    beside = None
    if step.beside is not None:
        beside = subprocess.Popen([python, "-m", "backfill.cli", *(a.replace("{port}", str(port)) for a in step.beside)],
                                  cwd=clone, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        if why := _check_server(beside, port, "/v1/models", step.timeout_s):
            _stop(beside)
            return Outcome(step.name, isa, " ".join(step.beside), None, None, 0.0, 0.0, None, False,
                           f"the server it needs: {why}")
    started = time.monotonic()
    proc = subprocess.Popen([python, "-m", "backfill.cli", *argv], cwd=clone, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    reader = _Reader(proc, started)
    why = ""
    try:
        if step.server is not None:
            why = _check_server(proc, port, step.server, step.timeout_s)
            os.killpg(proc.pid, signal.SIGINT)
            rc = proc.wait(timeout=60)
            rc = 0 if rc in (0, -signal.SIGINT, 130) and not why else rc
        else:
            rc = proc.wait(timeout=step.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc, why = None, f"timed out after {step.timeout_s:.0f} s"
    finally:
        if beside is not None:
            _stop(beside)
    wall_s = time.monotonic() - started
    reader.thread.join(timeout=5)
    out = reader.text()
    first = reader.first_output_s()
    harvest = step.harvest(out) if step.harvest is not None else None
    if not why and rc != 0:
        why = f"exit status {rc}"
    if not why and (first is None or first > FIRST_OUTPUT_LIMIT_S):
        why = f"first output after {'never' if first is None else f'{first:.1f} s'}"
    silence = reader.longest_silence_s(wall_s)
    if not why and silence > SILENCE_LIMIT_S:
        why = f"silent for {silence:.0f} s (at most {SILENCE_LIMIT_S:.0f})"
    if not why and step.harvest is not None and not harvest:
        why = f"no harvest ({harvest})"
    return Outcome(step.name, isa, " ".join(["backfill", *argv]), rc, first, silence, wall_s, harvest, not why, why,
                   out.splitlines()[-60:])


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to the process group, SIGKILL after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _check_server(proc: subprocess.Popen, port: int, path: str, timeout_s: float) -> str:
    """'' once GET path answers 200 on the port; else why not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the server exited with status {proc.returncode} before answering"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                if r.status == 200:
                    return ""
        except OSError:
            pass
        time.sleep(1.0)
    return f"no answer on {path} within {timeout_s:.0f} s"


def fresh_clone(into: Path) -> Path:
    clone = into / "backfill"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    return clone


def table(outcomes: list[Outcome]) -> str:
    rows = ["| command (README) | ISA | exit | first output s | longest silence s | wall s | harvest | ok |",
            "|---|---|---|---:|---:|---:|---:|---|"]
    for o in outcomes:
        first = "-" if o.first_output_s is None else f"{o.first_output_s:.1f}"
        harvest = "-" if o.harvest is None else f"{o.harvest:g}"
        rows.append(f"| `{o.name}` | {o.isa} | {o.rc} | {first} | {o.longest_silence_s:.0f} | {o.wall_s:.0f} | "
                    f"{harvest} | {'yes' if o.passed else 'NO: ' + o.why} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", nargs="+", choices=("native", "avx2"), default=["native", "avx2"])
    ap.add_argument("--fast", action="store_true", help="only the suite's subset (seconds each)")
    ap.add_argument("--only", nargs="+", default=None, help="README commands starting with these, e.g. 'bench node'")
    ap.add_argument("--python", default=sys.executable, help="the venv's python (backfill's dependencies)")
    ap.add_argument("--json", default=None, help="write every outcome here")
    ap.add_argument("--extensions-dir", default=None,
                    help="TORCH_EXTENSIONS_DIR for the commands (default: the user's): a cache of its own keeps "
                         "other checkouts' kernel builds on a shared machine from rebuilding this one's")
    args = ap.parse_args(argv)
    steps = [s for s in STEPS if (not args.fast or s.fast)
             and (args.only is None or any(s.name.removeprefix("backfill ").startswith(o) for o in args.only))]
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="readme-tour-") as tmp:
        clone = fresh_clone(Path(tmp))
        print(f"fresh clone of {REPO} in {clone}; {len(steps)} commands x {len(args.isa)} ISA", flush=True)
        for isa in args.isa:
            for step in steps:
                print(f"[{time.strftime('%H:%M:%S')}] {isa}: {step.name}", flush=True)
                o = run_step(step, clone, args.python, isa, args.extensions_dir)
                outcomes.append(o)
                print(f"   {'ok' if o.passed else 'FAILED: ' + o.why}; first output {o.first_output_s} s, "
                      f"wall {o.wall_s:.0f} s, harvest {o.harvest}", flush=True)
                if not o.passed or step.harvest is not None:   # a harvest's figures, or what went wrong
                    print("   " + "\n   ".join(o.tail[-30:]), flush=True)
                if args.json:   # after every command: a run cut short keeps what it measured
                    Path(args.json).write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    print(table(outcomes))
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
