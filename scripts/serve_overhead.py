"""The server's own overhead: the same bursts against `backfill serve` over HTTP and against the
engine in-process, one after the other in one run, with the ratios side by side.

    flock /tmp/bench.lock nice -n -5 python scripts/serve_overhead.py runs/overhead
    python scripts/serve_overhead.py runs/overhead --parts serve --py-spy 64   # profile the server
    python scripts/serve_overhead.py runs/all --medians-of runs/a runs/b runs/c  # medians of runs
    flock /tmp/bench.lock nice -n -5 python scripts/serve_overhead.py runs/paired --interleave 8  # paired

--interleave PAIRS (paired mode) starts the server, then one client process that holds the engine
in-process too (`python -m backfill.bench.paired_bursts`) and, per level, alternates single
bursts between the two in ABBA order with --settle-s of idle before each; OUTDIR/paired.json has
per level the median of the per-pair ratios (tok/s and P50 TPOT, server over in-process) with an
order-statistic 95% interval, and the CPU ms per token of the load generator's loop, the
server's loop and the in-process loop. --aa runs both arms on the engine in-process (no server):
the design's own ratio for two equal arms. --client-loop picks the client's event loop.

Starts `python -m backfill.server` (`backfill serve`) (bf16, compiled decode, the default policy) on a free 127.0.0.1
port, runs `python -m backfill.bench.concurrency_burst --url ... --server-pid ...`, stops the
server, then runs the same bursts `--in-process`. Writes OUTDIR/burst-serve.json,
OUTDIR/burst-in-process.json and OUTDIR/overhead.json (per level: tok/s and P50 TPOT of each,
the overhead in percent, the CPU the load generator and the server used), and prints the table.
--py-spy LEVEL records the server with py-spy (`--gil --threads`, raw) during that level's bursts.
--baseline-root DIR first runs the same bursts against the server of another checkout (its
figures are rows "serve-baseline"), so a change and its base are measured in the same run; the
load generator of that part runs from that checkout too, and --baseline-python names the
interpreter of both (e.g. a venv without aiohttp, uvloop and httptools, as the base was run).
--parts in-process in-process-side-load: the engine in-process alone and with a process beside
it that uses --side-load-ms of CPU in every 10 ms (what the HTTP load generator uses per token
at 1 stream), writing OUTDIR/side-load.json: the cost of that CPU alone, with no HTTP.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # this checkout's backfill, as the `-m` subprocesses (cwd ROOT) get
from backfill.bench.server_process import free_port, stop, wait_healthy  # noqa: E402
ENGINE_FLAGS = ["--dtype", "bfloat16", "--compile-decode"]
SEED_PROFILE = "docs/results/profile-cpu-zen5-bf16-cd-p6.json"


def seed_profile() -> None:
    """coserve plans with a step-latency profile, measured for minutes on first use; where none is
    cached for these flags, the one docs/results holds for this machine kind seeds the cache."""
    import shutil

    from backfill.engine.weights import load_model
    from backfill.serving.build import default_profile_path
    from backfill.serving.config import ServingConfig

    config = ServingConfig(dtype="bfloat16", compile_decode=True)   # ENGINE_FLAGS
    path = default_profile_path(load_model(config.model).config.name, config)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / SEED_PROFILE, path)
        print(f"seeded {path} from {SEED_PROFILE}")


def burst_args(args: argparse.Namespace, json_path: Path, python: str = sys.executable) -> list[str]:
    return [python, "-m", "backfill.bench.concurrency_burst", "--concurrency", *map(str, args.concurrency),
            "--bursts", str(args.bursts), "--json", str(json_path), *ENGINE_FLAGS]


def start_server(args: argparse.Namespace, out: Path, root: Path = ROOT, name: str = "serve",
                 python: str = sys.executable) -> tuple[str, subprocess.Popen]:
    """`backfill serve` (ENGINE_FLAGS) from the checkout at root on a free port; stop() it after."""
    port = free_port()
    log = open(out / f"{name}.log", "w")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=f"/tmp/torch-ext-{root.name}")
    server = subprocess.Popen([python, "-m", "backfill.server", "--host", "127.0.0.1", "--port", str(port),
                               *ENGINE_FLAGS, "--db", str(out / f"{name}.db"), "--fresh-db",
                               # The engine in-process admits every request: so does the server here,
                               # or bursts past the TTFT prediction get 429 and the workloads differ.
                               "--max-online-queue", "100000", "--admission-ttft-share", "inf",
                               "--log-level", "warning", *args.serve_args],
                              cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return f"http://127.0.0.1:{port}", server


def run_interleaved(args: argparse.Namespace, out: Path) -> None:
    """One client process holds the engine in-process and drives the server: per level, --interleave
    pairs of one burst each, in ABBA order (backfill.bench.paired_bursts). --aa: both arms in-process."""
    url, server = (None, None) if args.aa else start_server(args, out)
    try:
        if server is not None:
            wait_healthy(url, server, 600)
        cmd = [sys.executable, "-m", "backfill.bench.paired_bursts", "--concurrency", *map(str, args.concurrency),
               "--pairs", str(args.interleave), "--settle-s", str(args.settle_s), "--client-loop", args.client_loop,
               "--json", str(out / "paired.json"), *ENGINE_FLAGS]
        cmd += ["--arms", "in-process", "in-process"] if args.aa else ["--url", url, "--server-pid", str(server.pid)]
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            raise SystemExit("the paired bursts failed")
    finally:
        if server is not None:
            stop(server)


def print_paired(rows: list[dict], arms: dict) -> None:
    a, b = arms["a"], arms["b"]
    print(f"| streams | pairs | tok/s {a} / {b} | tok/s ratio [interval] | throughput overhead "
          f"| P50 TPOT ms {a} / {b} | TPOT ratio [interval] | TPOT overhead "
          f"| CPU ms/token: client loop / server loop / in-process loop |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    g = lambda c: f"{c:.3f}" if c is not None else "-"   # noqa: E731
    for r in rows:
        print(f"| {r['concurrency']} | {r['pairs']} | {r['a_tok_s']:.1f} / {r['b_tok_s']:.1f} | "
              f"{r['tok_s_ratio']:.3f} [{r['tok_s_ratio_low']:.3f}, {r['tok_s_ratio_high']:.3f}] | "
              f"{r['throughput_overhead_pct']:.1f}% | {r['a_p50_tpot_ms']:.1f} / {r['b_p50_tpot_ms']:.1f} | "
              f"{r['tpot_ratio']:.3f} [{r['tpot_ratio_low']:.3f}, {r['tpot_ratio_high']:.3f}] | "
              f"{r['tpot_overhead_pct']:.1f}% | {g(r['a_loop_ms_per_token'])} / {g(r['a_server_loop_ms_per_token'])} "
              f"/ {g(r['b_loop_ms_per_token'])} |")


def run_serve(args: argparse.Namespace, out: Path, root: Path = ROOT, name: str = "serve",
              python: str = sys.executable, settle_s: float = 0.0) -> None:
    """Bursts against a server run from the checkout at root, by a client from the same checkout."""
    url, server = start_server(args, out, root, name, python)
    spy = None
    try:
        wait_healthy(url, server, 600)
        # A server whose /health does not wait for the background compile gets the time it takes.
        time.sleep(settle_s)
        client = subprocess.Popen([*burst_args(args, out / f"burst-{name}.json", python), "--url", url,
                                   "--server-pid", str(server.pid), "--label", name],
                                  cwd=root, stdout=subprocess.PIPE, text=True)
        for line in client.stdout:
            print(f"  {name}: {line}", end="", flush=True)
            if args.py_spy and spy is None and line.split(":")[0].split() == ["concurrency", _previous(args, args.py_spy)]:
                spy_started = time.monotonic()
                spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(server.pid), "--gil", "--threads",
                                        "--rate", "200", "--format", "raw", "--nonblocking",
                                        "--output", str(out / f"py-spy-{args.py_spy}-{name}.txt")],
                                       stdout=subprocess.DEVNULL, stderr=open(out / "py-spy.log", "w"))
        if client.wait() != 0:
            raise SystemExit("the HTTP bursts failed")
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)   # py-spy writes its file on SIGINT
            spy.wait(60)
            profile = out / f"py-spy-{args.py_spy}-{name}.txt"
            if profile.exists():
                summary = {"level": args.py_spy, "rate_hz": 200, "seconds": time.monotonic() - spy_started,
                           **py_spy_summary(profile)}
                (out / f"py-spy-{args.py_spy}-{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
                print(json.dumps(summary, indent=1))
        stop(server)


def _previous(args: argparse.Namespace, level: int) -> str:
    """The level whose result line is printed just before `level`'s bursts start."""
    index = args.concurrency.index(level)
    if index == 0:
        raise SystemExit("--py-spy needs a level after the first (the one before it marks its start)")
    return str(args.concurrency[index - 1])


# A process that uses spin_ms of CPU in every 10 ms, as the HTTP load generator does per token at
# 1 stream: what that much CPU beside the engine costs it, with no HTTP anywhere.
SIDE_LOAD = """import sys, time
spin_s = float(sys.argv[1]) / 1e3
while True:
    end = time.perf_counter() + spin_s
    while time.perf_counter() < end:
        pass
    time.sleep(0.010 - spin_s)
"""


def run_in_process(args: argparse.Namespace, out: Path, side_load_ms: float = 0.0) -> None:
    name = "in-process" if not side_load_ms else "in-process-side-load"
    side = subprocess.Popen([sys.executable, "-c", SIDE_LOAD, str(side_load_ms)]) if side_load_ms else None
    try:
        client = subprocess.Popen([*burst_args(args, out / f"burst-{name}.json"), "--in-process",
                                   "--label", name], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for line in client.stdout:
            print(f"  {name}: {line}", end="", flush=True)
        if client.wait() != 0:
            raise SystemExit("the in-process bursts failed")
    finally:
        if side is not None:
            side.kill()
            side.wait()


def compare(out: Path, name: str = "serve") -> dict:
    serve = {lv["concurrency"]: lv for lv in json.loads((out / f"burst-{name}.json").read_text())["levels"]}
    local = {lv["concurrency"]: lv for lv in json.loads((out / "burst-in-process.json").read_text())["levels"]}
    rows = []
    for level in sorted(set(serve) & set(local)):
        s, i = serve[level], local[level]
        rows.append({"concurrency": level, "server": name,
                     "serve_tok_s": s["tokens_per_s"], "in_process_tok_s": i["tokens_per_s"],
                     "throughput_overhead_pct": 100 * (1 - s["tokens_per_s"] / i["tokens_per_s"]),
                     "serve_p50_tpot_ms": s["p50_tpot_ms"], "in_process_p50_tpot_ms": i["p50_tpot_ms"],
                     "tpot_overhead_pct": 100 * (s["p50_tpot_ms"] / i["p50_tpot_ms"] - 1),
                     "serve_mean_ttft_ms": s["mean_ttft_ms"], "in_process_mean_ttft_ms": i["mean_ttft_ms"],
                     "client_cores": _cores(s.get("cpu_s"), s["wall_s"]),
                     "server_cores": _cores(s.get("server_cpu_s"), s["wall_s"]),
                     "server_loop_cores": _cores(s.get("server_loop_cpu_s"), s["wall_s"]),
                     "in_process_cores": _cores(i.get("cpu_s"), i["wall_s"]),
                     "in_process_loop_cores": _cores(i.get("loop_cpu_s"), i["wall_s"]),
                     # CPU per output token: what the load generator and the server's loop cost, whatever the speed.
                     "client_ms_per_token": _per_token(s.get("cpu_s"), s["output_tokens"]),
                     "server_loop_ms_per_token": _per_token(s.get("server_loop_cpu_s"), s["output_tokens"]),
                     "in_process_loop_ms_per_token": _per_token(i.get("loop_cpu_s"), i["output_tokens"])})
    return rows


def _cores(cpu_s: float | None, wall_s: float) -> float | None:
    return cpu_s / wall_s if cpu_s is not None and wall_s > 0 else None


def _per_token(cpu_s: float | None, tokens: int) -> float | None:
    return 1e3 * cpu_s / tokens if cpu_s is not None and tokens > 0 else None


def print_table(rows: list[dict]) -> None:
    print("| server | concurrency | serve tok/s | in-process tok/s | throughput overhead | P50 TPOT ms serve / in-process "
          "| TPOT overhead | cores: client / server (its loop) / in-process (its loop) "
          "| CPU ms/token: client / server loop / in-process loop |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        f = lambda c: f"{c:.2f}" if c is not None else "-"   # noqa: E731
        cores = (f"{f(r['client_cores'])} / {f(r['server_cores'])} ({f(r['server_loop_cores'])}) / "
                 f"{f(r['in_process_cores'])} ({f(r['in_process_loop_cores'])})")
        g = lambda c: f"{c:.3f}" if c is not None else "-"   # noqa: E731
        per_token = " / ".join(g(r.get(k)) for k in ("client_ms_per_token", "server_loop_ms_per_token",
                                                      "in_process_loop_ms_per_token"))
        print(f"| {r['server']} | {r['concurrency']} | {r['serve_tok_s']:.1f} | {r['in_process_tok_s']:.1f} | "
              f"{r['throughput_overhead_pct']:.1f}% | {r['serve_p50_tpot_ms']:.1f} / {r['in_process_p50_tpot_ms']:.1f} | "
              f"{r['tpot_overhead_pct']:.1f}% | {cores} | {per_token} |")


# Where the event loop's samples go, by the first of these found in a sample's stack.
SSE = "SSE stream (generator, chunks)"
LOOP_PARTS = (("h11", "uvicorn's h11 protocol"), ("backfill/server/sse.py", SSE), ("stream_sse", SSE),
              ("chunk_body", SSE), ("batches.py", "Batch API worker"), ("fine_tuning", "fine-tuning worker"),
              ("_deliver", "token delivery"), ("access_log", "access log"), ("starlette", "ASGI stack"),
              ("fastapi", "ASGI stack"))


def py_spy_summary(path: Path) -> dict:
    """Samples of a `py-spy record --gil --threads --format raw` file: per thread, and the event
    loop's (MainThread) by part of the server. With --gil a sample is taken only while some thread
    holds the GIL, so samples / (rate x seconds) is a thread's share of the wall time holding it."""
    threads: dict[str, int] = {}
    loop: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        name = frames[0].split(":", 1)[-1].strip().rstrip("_0123456789") or frames[0]
        threads[name] = threads.get(name, 0) + int(count)
        if "MainThread" in frames[0]:
            part = next((label for key, label in LOOP_PARTS if key in stack), "asyncio and other")
            loop[part] = loop.get(part, 0) + int(count)
    return {"samples_by_thread": dict(sorted(threads.items(), key=lambda kv: -kv[1])),
            "event_loop_samples_by_part": dict(sorted(loop.items(), key=lambda kv: -kv[1]))}


def medians(runs: list[Path]) -> list[dict]:
    """Per server and level, the median over runs (each an OUTDIR/overhead.json) of every figure."""
    import statistics

    groups: dict[tuple[str, int], list[dict]] = {}
    for run in runs:
        for row in json.loads((run / "overhead.json").read_text())["rows"]:
            groups.setdefault((row["server"], row["concurrency"]), []).append(row)
    out = []
    for (server, level), rows in groups.items():
        merged = {"server": server, "concurrency": level, "runs": len(rows)}
        for key, value in rows[0].items():
            if isinstance(value, float):
                values = [r[key] for r in rows if r.get(key) is not None]
                merged[key] = statistics.median(values) if values else None
                if key.endswith("_pct"):
                    merged[key + "_each"] = [round(r[key], 1) for r in rows]
        out.append(merged)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--medians-of", nargs="+", type=Path, default=None, metavar="RUN",
                        help="measure nothing: write OUT/medians.json and print the medians of these runs' figures")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--bursts", type=int, default=2)
    parser.add_argument("--parts", nargs="+", choices=("serve-baseline", "serve", "in-process", "in-process-side-load"),
                        default=None,
                        help="what to run, in this order (default: serve-baseline with --baseline-root, serve, "
                             "in-process)")
    parser.add_argument("--py-spy", type=int, default=None, metavar="LEVEL",
                        help="profile the server with py-spy during this level's bursts")
    parser.add_argument("--baseline-root", type=Path, default=None,
                        help="also run the server of this checkout (e.g. `git archive` of the base commit), first")
    parser.add_argument("--baseline-python", default=sys.executable,
                        help="the interpreter of the serve-baseline part (server and load generator)")
    parser.add_argument("--baseline-settle-s", type=float, default=25.0,
                        help="wait this long after the baseline server is healthy (a /health that does not "
                             "wait for compiled decode's background compile)")
    parser.add_argument("--side-load-ms", type=float, default=0.55,
                        help="in-process-side-load: CPU ms in every 10 ms of a process beside the engine")
    parser.add_argument("--interleave", type=int, default=0, metavar="PAIRS",
                        help="paired mode: one process drives the server and holds the engine in-process, "
                             "PAIRS ABBA-ordered pairs of one burst each per level (writes OUT/paired.json)")
    parser.add_argument("--settle-s", type=float, default=1.0, help="paired mode: idle before each burst")
    parser.add_argument("--client-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                        help="paired mode: the load generator's event loop (auto: uvloop where installed)")
    parser.add_argument("--aa", action="store_true",
                        help="paired mode: both arms on the engine in-process, no server (the design's own A/A)")
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="extra `backfill serve` flags (last on the line)")
    args = parser.parse_args()
    # A run stopped by SIGTERM (e.g. `timeout`) still stops its server: it runs in its own session.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out = args.out.resolve()   # the baseline part's client runs in the baseline checkout
    if args.medians_of:
        rows = medians(args.medians_of)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "medians.json").write_text(json.dumps({"runs": [str(r) for r in args.medians_of], "rows": rows},
                                                          indent=1) + "\n")
        print_table(rows)
        return 0
    if args.parts is None:
        args.parts = [*(["serve-baseline"] if args.baseline_root else []), "serve", "in-process"]
    if "serve-baseline" in args.parts and args.baseline_root is None:
        parser.error("serve-baseline needs --baseline-root")
    if args.interleave < 0 or (args.aa and not args.interleave):
        parser.error("--interleave takes a positive number of pairs; --aa needs it")
    if args.py_spy is not None and args.py_spy not in args.concurrency:
        parser.error("--py-spy must name one of the --concurrency levels")
    args.out.mkdir(parents=True, exist_ok=True)
    seed_profile()
    # A kernel cache per checkout: checkouts sharing one rebuild each other's kernels.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", f"/tmp/torch-ext-{ROOT.name}")
    started = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg": os.getloadavg()}
    if args.interleave:
        run_interleaved(args, args.out)
        paired = json.loads((args.out / "paired.json").read_text())
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        doc = {"started": started, "ended": {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                             "loadavg": os.getloadavg()},
               "machine": f"{_cpu_model()}, {os.cpu_count()} cores", "python": platform.python_version(),
               "commit": commit.stdout.strip(), "engine_flags": ENGINE_FLAGS, **paired}
        (args.out / "paired.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"load average {started['loadavg'][0]:.2f} at the start, {doc['ended']['loadavg'][0]:.2f} at the end; "
              f"client loop {doc['client_loop']}")
        print_paired(doc["levels"], doc["arms"])
        return 0
    for part in args.parts:
        if part == "serve-baseline":
            run_serve(args, args.out, args.baseline_root.resolve(), "serve-baseline", args.baseline_python,
                      args.baseline_settle_s)
        elif part == "serve":
            run_serve(args, args.out)
        elif part == "in-process-side-load":
            run_in_process(args, args.out, args.side_load_ms)
        else:
            run_in_process(args, args.out)
    if (args.out / "burst-in-process-side-load.json").exists() and (args.out / "burst-in-process.json").exists():
        side = compare(args.out, "in-process-side-load")
        print(f"in-process with {args.side_load_ms:g} ms of CPU in every 10 ms beside it (as 'serve'):")
        print_table(side)
        (args.out / "side-load.json").write_text(json.dumps(
            {"started": started, "ended": {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                           "loadavg": os.getloadavg()},
             "machine": f"{_cpu_model()}, {os.cpu_count()} cores", "parts": args.parts,
             "side_load_ms_per_10ms": args.side_load_ms, "rows": side}, indent=1) + "\n")
    if not ((args.out / "burst-serve.json").exists() and (args.out / "burst-in-process.json").exists()):
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    doc = {"started": started, "ended": {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                         "loadavg": os.getloadavg()},
           "machine": f"{_cpu_model()}, {os.cpu_count()} cores", "python": platform.python_version(),
           "commit": commit.strip(), "baseline_root": str(args.baseline_root) if args.baseline_root else None,
           "baseline_python": args.baseline_python if args.baseline_root else None,
           "parts": args.parts, "engine_flags": ENGINE_FLAGS, "bursts": args.bursts,
           "rows": [*(compare(args.out, "serve-baseline") if (args.out / "burst-serve-baseline.json").exists() else []),
                    *compare(args.out)]}
    (args.out / "overhead.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"load average {started['loadavg'][0]:.2f} at the start, {doc['ended']['loadavg'][0]:.2f} at the end")
    print_table(doc["rows"])
    return 0


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
