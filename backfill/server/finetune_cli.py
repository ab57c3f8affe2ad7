"""`backfill fine-tuning`: a job of the fine-tuning API on a running `backfill serve`, from the command line
(`backfill finetune` runs a job standalone, without a server).

    backfill fine-tuning train.jsonl --epochs 2 --rank 8       # upload, create, follow the events
    backfill fine-tuning train.jsonl --detach                  # print the job id and return
    backfill fine-tuning --list | --status ftjob-... | --cancel ftjob-...

It speaks the server's OpenAI fine-tuning API (docs/finetune-api.md) over plain HTTP, so a job
started here is the same durable job the API shows: it survives a server restart, and Ctrl+C
stops only the following, not the job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

FINAL = ("succeeded", "failed", "cancelled")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fine-tuning", help="a fine-tuning job on a running server (OpenAI's fine-tuning API)")
    p.add_argument("training_file", nargs="?", type=Path, help="chat-format JSONL, one {\"messages\": [...]} a line")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("BACKFILL_API_KEY"), help="its key (or BACKFILL_API_KEY)")
    p.add_argument("--model", help="the base model (default: the server's)")
    p.add_argument("--epochs", type=int, help="n_epochs")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr-multiplier", type=float, help="learning_rate_multiplier")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--checkpoint-every", type=int, help="checkpoint_every_steps")
    p.add_argument("--rank", type=int)
    p.add_argument("--alpha", type=float)
    p.add_argument("--targets", help="comma-separated target modules, e.g. q_proj,v_proj")
    p.add_argument("--seed", type=int)
    p.add_argument("--suffix")
    p.add_argument("--detach", action="store_true", help="create the job and return without following it")
    actions = p.add_mutually_exclusive_group()
    actions.add_argument("--list", action="store_true", help="list the server's jobs")
    actions.add_argument("--status", metavar="JOB_ID", help="show one job and its latest events")
    actions.add_argument("--cancel", metavar="JOB_ID", help="cancel a job")
    p.set_defaults(func=run)


class CommandError(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url.rstrip("/") + "/v1", headers=headers, timeout=60) as client:
        try:
            if args.list:
                for job in call(client, "GET", "/fine_tuning/jobs", params={"limit": 100})["data"]:
                    print(f"{job['id']}  {job['status']:<16} {job['model']}  {job['fine_tuned_model'] or ''}")
                return 0
            if args.status:
                return show(client, args.status)
            if args.cancel:
                job = call(client, "POST", f"/fine_tuning/jobs/{args.cancel}/cancel")
                print(f"{job['id']}: {job['status']}")
                return 0
            if args.training_file is None:
                raise CommandError("give a training file (or --list, --status, --cancel)")
            return create_and_follow(client, args)
        except CommandError as exc:
            print(f"backfill fine-tuning: error: {exc}", file=sys.stderr)
            return 2
        except httpx.HTTPError as exc:
            print(f"backfill fine-tuning: error: cannot reach {args.url}: {exc}", file=sys.stderr)
            return 2


def call(client: httpx.Client, method: str, path: str, **kwargs) -> dict:
    response = client.request(method, path, **kwargs)
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise CommandError(f"{response.status_code}: {message}")
    return response.json()


def create_and_follow(client: httpx.Client, args: argparse.Namespace) -> int:
    try:
        content = args.training_file.read_bytes()
    except OSError as exc:
        raise CommandError(f"cannot read {args.training_file}: {exc}") from None
    model = args.model or call(client, "GET", "/models")["data"][0]["id"]
    file = call(client, "POST", "/files", data={"purpose": "fine-tune"},
                files={"file": (args.training_file.name, content, "application/jsonl")})
    hyper = {key: value for key, value in {
        "n_epochs": args.epochs, "batch_size": args.batch_size, "learning_rate_multiplier": args.lr_multiplier,
        "max_steps": args.max_steps, "checkpoint_every_steps": args.checkpoint_every}.items() if value is not None}
    lora = {key: value for key, value in {
        "rank": args.rank, "alpha": args.alpha,
        "target_modules": args.targets.split(",") if args.targets else None}.items() if value is not None}
    body = {"model": model, "training_file": file["id"], "hyperparameters": hyper, "lora": lora}
    body.update({key: value for key, value in (("seed", args.seed), ("suffix", args.suffix)) if value is not None})
    job = call(client, "POST", "/fine_tuning/jobs", json=body)
    print(f"created {job['id']} on {model} (file {file['id']})", flush=True)
    if args.detach:
        return 0
    try:
        return follow(client, job["id"])
    except KeyboardInterrupt:
        print(f"\nstopped following; the job goes on (backfill fine-tuning --cancel {job['id']} stops it)")
        return 130


def follow(client: httpx.Client, job_id: str, poll_s: float = 1.0) -> int:
    """Print the job's events as they come, until it ends; 0 if it succeeded."""
    seen: set[str] = set()
    while True:
        job = call(client, "GET", f"/fine_tuning/jobs/{job_id}")
        events = call(client, "GET", f"/fine_tuning/jobs/{job_id}/events", params={"limit": 1000})["data"]
        for event in reversed(events):
            if event["id"] not in seen:
                seen.add(event["id"])
                print(f"[{time.strftime('%H:%M:%S', time.localtime(event['created_at']))}] {event['message']}",
                      flush=True)
        if job["status"] in FINAL:
            break
        time.sleep(poll_s)
    if job["status"] == "succeeded":
        print(f"fine-tuned model: {job['fine_tuned_model']}")
        return 0
    print(f"{job_id} {job['status']}" + (f": {job['error']['message']}" if job.get("error") else ""), file=sys.stderr)
    return 1


def show(client: httpx.Client, job_id: str) -> int:
    job = call(client, "GET", f"/fine_tuning/jobs/{job_id}")
    print(json.dumps(job, indent=2))
    for event in reversed(call(client, "GET", f"/fine_tuning/jobs/{job_id}/events", params={"limit": 5})["data"]):
        print(event["message"])
    return 0
