"""`backfill finetune create | list | get | events | cancel`: jobs of the fine-tuning API on a running
`backfill serve`, from the command line (`backfill finetune run` trains standalone, without a server).

    backfill finetune create train.jsonl --epochs 2 --rank 8    # upload, create, follow the events
    backfill finetune create train.jsonl --detach               # print the job id and return
    backfill finetune list
    backfill finetune get ftjob-...
    backfill finetune events ftjob-... --follow
    backfill finetune cancel ftjob-...

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
from typing import TYPE_CHECKING

from backfill.cli.command_parser import CommandParser

if TYPE_CHECKING:
    import httpx

FINAL = ("succeeded", "failed", "cancelled")


def add_commands(commands: CommandParser) -> None:
    """The server-side subcommands of `backfill finetune` (the group is declared by cli/finetune.py)."""
    commands.defer("finetune create", "upload a training file and start a job on a running server, then follow it",
                   _fill_create)
    commands.defer("finetune list", "list the server's fine-tuning jobs", _fill_list)
    commands.defer("finetune get", "show one job of the server as JSON", _fill_get)
    commands.defer("finetune events", "print a job's events (--follow: until it ends)", _fill_events)
    commands.defer("finetune cancel", "cancel a job on the server", _fill_cancel)


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("BACKFILL_API_KEY"), help="its key (or BACKFILL_API_KEY)")


def _fill_create(p: argparse.ArgumentParser) -> None:
    p.add_argument("training_file", type=Path, help="chat-format JSONL, one {\"messages\": [...]} a line")
    _add_server_args(p)
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
    p.set_defaults(func=_command(create_and_follow))


def _fill_list(p: argparse.ArgumentParser) -> None:
    _add_server_args(p)
    p.set_defaults(func=_command(list_jobs))


def _fill_get(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")
    _add_server_args(p)
    p.set_defaults(func=_command(get_job))


def _fill_events(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")
    _add_server_args(p)
    p.add_argument("--limit", type=int, default=20, help="the latest this many events (without --follow)")
    p.add_argument("--follow", action="store_true", help="print events as they come until the job ends")
    p.set_defaults(func=_command(show_events))


def _fill_cancel(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")
    _add_server_args(p)
    p.set_defaults(func=_command(cancel_job))


class CommandError(Exception):
    pass


def _command(action):
    """A subcommand's func: action(client, args) on a client of the server's /v1, errors printed."""

    def run(args: argparse.Namespace) -> int:
        import httpx

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        with httpx.Client(base_url=args.url.rstrip("/") + "/v1", headers=headers, timeout=60) as client:
            try:
                return action(client, args)
            except CommandError as exc:
                print(f"backfill finetune: error: {exc}", file=sys.stderr)
                return 2
            except httpx.HTTPError as exc:
                print(f"backfill finetune: error: cannot reach {args.url}: {exc}", file=sys.stderr)
                return 2

    return run


def list_jobs(client: httpx.Client, args: argparse.Namespace) -> int:
    for job in call(client, "GET", "/fine_tuning/jobs", params={"limit": 100})["data"]:
        print(f"{job['id']}  {job['status']:<16} {job['model']}  {job['fine_tuned_model'] or ''}")
    return 0


def get_job(client: httpx.Client, args: argparse.Namespace) -> int:
    print(json.dumps(call(client, "GET", f"/fine_tuning/jobs/{args.job_id}"), indent=2))
    return 0


def show_events(client: httpx.Client, args: argparse.Namespace) -> int:
    if args.follow:
        return follow(client, args.job_id)
    events = call(client, "GET", f"/fine_tuning/jobs/{args.job_id}/events", params={"limit": args.limit})["data"]
    for event in reversed(events):
        print(_event_line(event))
    return 0


def cancel_job(client: httpx.Client, args: argparse.Namespace) -> int:
    job = call(client, "POST", f"/fine_tuning/jobs/{args.job_id}/cancel")
    print(f"{job['id']}: {job['status']}")
    return 0


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
        print(f"\nstopped following; the job goes on (backfill finetune cancel {job['id']} stops it)")
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
                print(_event_line(event), flush=True)
        if job["status"] in FINAL:
            break
        time.sleep(poll_s)
    if job["status"] == "succeeded":
        print(f"fine-tuned model: {job['fine_tuned_model']}")
        return 0
    print(f"{job_id} {job['status']}" + (f": {job['error']['message']}" if job.get("error") else ""), file=sys.stderr)
    return 1


def _event_line(event: dict) -> str:
    return f"[{time.strftime('%H:%M:%S', time.localtime(event['created_at']))}] {event['message']}"
