"""Fine-tuning jobs, their events and checkpoints in the server's SQLite database (store.py's file).

A job row is the durable truth of its status; events and checkpoints are mirrored from the running
FinetuneJob (backfill/finetune/job.py). Metrics events are keyed by (job, step): a job resumed
after a crash redoes the steps after its newest checkpoint, and their events replace the ones
lost with the process instead of appearing twice.
"""

from __future__ import annotations

import json
import time
import uuid
from sqlite3 import Row

from backfill.server.store import Store

SCHEMA = """
CREATE TABLE IF NOT EXISTS fine_tuning_jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    model TEXT NOT NULL,
    training_file TEXT NOT NULL,
    status TEXT NOT NULL,
    hyperparameters TEXT NOT NULL,
    config TEXT NOT NULL,
    suffix TEXT,
    seed INTEGER NOT NULL,
    metadata TEXT,
    fine_tuned_model TEXT,
    error TEXT,
    trained_tokens INTEGER,
    result_file_id TEXT,
    created_at INTEGER NOT NULL,
    finished_at INTEGER
);
CREATE INDEX IF NOT EXISTS fine_tuning_jobs_status ON fine_tuning_jobs (status, seq);
CREATE TABLE IF NOT EXISTS fine_tuning_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL,
    step INTEGER,
    created_at INTEGER NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    type TEXT NOT NULL,
    data TEXT,
    UNIQUE (job_id, step)
);
CREATE TABLE IF NOT EXISTS fine_tuning_checkpoints (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    path TEXT NOT NULL,
    metrics TEXT NOT NULL,
    UNIQUE (job_id, step)
);
"""

ACTIVE_STATUSES = ("validating_files", "queued", "running")
FINAL_STATUSES = ("succeeded", "failed", "cancelled")


class FineTuningStore:
    """The fine-tuning tables, sharing the Store's connections, lock file and transactions."""

    def __init__(self, store: Store) -> None:
        self.store = store
        store._conn().executescript(SCHEMA)

    def create_job(self, model: str, training_file: str, hyperparameters: dict, config: dict,
                   suffix: str | None, seed: int, metadata: dict | None) -> dict:
        job_id = f"ftjob-{uuid.uuid4().hex[:24]}"
        with self.store._write() as conn:
            conn.execute("INSERT INTO fine_tuning_jobs (id, model, training_file, status, hyperparameters, config, "
                         "suffix, seed, metadata, created_at) VALUES (?, ?, ?, 'validating_files', ?, ?, ?, ?, ?, ?)",
                         (job_id, model, training_file, json.dumps(hyperparameters), json.dumps(config), suffix,
                          seed, json.dumps(metadata) if metadata else None, int(time.time())))
            _insert_event(conn, job_id, None, "info", f"Created fine-tuning job: {job_id}")
        return self.get_job(job_id)

    def job_row(self, job_id: str) -> Row | None:
        return self.store._conn().execute("SELECT * FROM fine_tuning_jobs WHERE id = ?", (job_id,)).fetchone()

    def get_job(self, job_id: str) -> dict | None:
        row = self.job_row(job_id)
        return job_object(row) if row else None

    def list_jobs(self, limit: int, after: str | None) -> tuple[list[dict], bool]:
        return self._page("fine_tuning_jobs", "", (), limit, after, job_object)

    def job_ids(self, *statuses: str) -> list[str]:
        marks = ",".join("?" * len(statuses))
        rows = self.store._conn().execute(f"SELECT id FROM fine_tuning_jobs WHERE status IN ({marks}) ORDER BY seq",
                                          statuses).fetchall()
        return [r["id"] for r in rows]

    def set_status(self, job_id: str, status: str, *, message: str | None = None, level: str = "info",
                   only_from: tuple[str, ...] = ACTIVE_STATUSES, **fields) -> bool:
        """Move an active job to status (with extra columns), logging message; False if it was not active."""
        if status in FINAL_STATUSES:
            fields.setdefault("finished_at", int(time.time()))
        assignments = "".join(f", {name} = ?" for name in fields)
        marks = ",".join("?" * len(only_from))
        with self.store._write() as conn:
            moved = conn.execute(f"UPDATE fine_tuning_jobs SET status = ?{assignments} WHERE id = ? "
                                 f"AND status IN ({marks})", (status, *fields.values(), job_id, *only_from)).rowcount
            if moved and message:
                _insert_event(conn, job_id, None, level, message)
            return bool(moved)

    # --- events ----------------------------------------------------------------------------------

    def add_message(self, job_id: str, message: str, level: str = "info") -> None:
        with self.store._write() as conn:
            _insert_event(conn, job_id, None, level, message)

    def record_steps(self, job_id: str, events: list[dict], total_steps: int) -> None:
        """Metrics events of finished optimizer steps; a step already recorded is replaced."""
        with self.store._write() as conn:
            for event in events:
                step = int(event["step"])
                data = {"step": step, "total_steps": total_steps, "train_loss": event.get("loss"),
                        "samples": event.get("samples"), "tokens": event.get("tokens")}
                conn.execute("DELETE FROM fine_tuning_events WHERE job_id = ? AND step = ?", (job_id, step))
                _insert_event(conn, job_id, step, "info",
                              f"Step {step}/{total_steps}: training loss={event.get('loss', float('nan')):.4f}",
                              "metrics", data, int(event.get("time", time.time())))

    def forget_steps_after(self, job_id: str, step: int) -> int:
        """Drop the metrics of steps after `step` (a resumed job redoes them); how many were dropped."""
        with self.store._write() as conn:
            return conn.execute("DELETE FROM fine_tuning_events WHERE job_id = ? AND step > ?",
                                (job_id, step)).rowcount

    def last_step(self, job_id: str) -> int:
        row = self.store._conn().execute("SELECT MAX(step) AS s FROM fine_tuning_events WHERE job_id = ?",
                                         (job_id,)).fetchone()
        return row["s"] or 0

    def step_metrics(self, job_id: str) -> list[dict]:
        rows = self.store._conn().execute("SELECT data FROM fine_tuning_events WHERE job_id = ? AND step IS NOT NULL "
                                          "ORDER BY step", (job_id,)).fetchall()
        return [json.loads(r["data"]) for r in rows]

    def list_events(self, job_id: str, limit: int, after: str | None) -> tuple[list[dict], bool]:
        return self._page("fine_tuning_events", "job_id = ?", (job_id,), limit, after, event_object)

    # --- checkpoints -----------------------------------------------------------------------------

    def record_checkpoint(self, job_id: str, step: int, path: str, metrics: dict) -> bool:
        with self.store._write() as conn:
            return conn.execute("INSERT INTO fine_tuning_checkpoints (id, job_id, step, created_at, path, metrics) "
                                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (job_id, step) DO NOTHING",
                                (f"ftckpt_{uuid.uuid4().hex[:24]}", job_id, step, int(time.time()), path,
                                 json.dumps(metrics))).rowcount > 0

    def list_checkpoints(self, job_id: str, limit: int, after: str | None, model: str) -> tuple[list[dict], bool]:
        return self._page("fine_tuning_checkpoints", "job_id = ?", (job_id,), limit, after,
                          lambda row: checkpoint_object(row, model))

    def checkpoint_path(self, job_id: str, step: int) -> str | None:
        row = self.store._conn().execute("SELECT path FROM fine_tuning_checkpoints WHERE job_id = ? AND step = ?",
                                         (job_id, step)).fetchone()
        return row["path"] if row else None

    def _page(self, table: str, where: str, args: tuple, limit: int, after: str | None, to_object) -> tuple[list, bool]:
        """Newest first, as OpenAI lists jobs, events and checkpoints; after = the last id already seen."""
        clauses = [where] if where else []
        params = list(args)
        if after is not None:
            clauses.append(f"seq < COALESCE((SELECT seq FROM {table} WHERE id = ?), -1)")
            params.append(after)
        sql = f"SELECT * FROM {table} {'WHERE ' + ' AND '.join(clauses) if clauses else ''} ORDER BY seq DESC LIMIT ?"
        rows = self.store._conn().execute(sql, (*params, limit + 1)).fetchall()
        return [to_object(r) for r in rows[:limit]], len(rows) > limit


def _insert_event(conn, job_id: str, step: int | None, level: str, message: str, type: str = "message",
                  data: dict | None = None, created_at: int | None = None) -> None:
    conn.execute("INSERT INTO fine_tuning_events (id, job_id, step, created_at, level, message, type, data) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                 (f"ftevent-{uuid.uuid4().hex[:24]}", job_id, step, created_at or int(time.time()), level, message,
                  type, json.dumps(data) if data is not None else None))


def job_object(row: Row) -> dict:
    """OpenAI's fine_tuning.job, with backfill's LoRA options under "lora"."""
    hyper = json.loads(row["hyperparameters"])
    config = json.loads(row["config"])
    openai_hyper = {k: hyper[k] for k in ("n_epochs", "batch_size", "learning_rate_multiplier")}
    return {
        "id": row["id"], "object": "fine_tuning.job", "created_at": row["created_at"],
        "error": json.loads(row["error"]) if row["error"] else None,
        "fine_tuned_model": row["fine_tuned_model"], "finished_at": row["finished_at"],
        "hyperparameters": hyper, "model": row["model"], "organization_id": "backfill",
        "result_files": [row["result_file_id"]] if row["result_file_id"] else [],
        "seed": row["seed"], "status": row["status"], "trained_tokens": row["trained_tokens"],
        "training_file": row["training_file"], "validation_file": None, "integrations": None,
        "estimated_finish": None, "user_provided_suffix": row["suffix"],
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
        "method": {"type": "supervised", "supervised": {"hyperparameters": openai_hyper}},
        "lora": {"rank": config["rank"], "alpha": config["alpha"], "target_modules": config["target_modules"]},
    }


def event_object(row: Row) -> dict:
    return {"id": row["id"], "object": "fine_tuning.job.event", "created_at": row["created_at"],
            "level": row["level"], "message": row["message"], "type": row["type"],
            "data": json.loads(row["data"]) if row["data"] else None}


def checkpoint_object(row: Row, fine_tuned_model: str) -> dict:
    return {"id": row["id"], "object": "fine_tuning.job.checkpoint", "created_at": row["created_at"],
            "fine_tuned_model_checkpoint": checkpoint_model_name(fine_tuned_model, row["step"]),
            "fine_tuning_job_id": row["job_id"], "metrics": json.loads(row["metrics"]),
            "step_number": row["step"]}


def fine_tuned_model_name(base_model: str, job_id: str, suffix: str | None = None) -> str:
    """The name a finished job's adapter is served under: <base-model>:ft-<job id>, with the
    job's suffix before the id (<base-model>:ft-<suffix>-<job id>), as OpenAI puts it before its id."""
    return f"{base_model}:ft-{suffix}-{job_id}" if suffix else f"{base_model}:ft-{job_id}"


def checkpoint_model_name(fine_tuned_model: str, step: int) -> str:
    return f"{fine_tuned_model}:ckpt-step-{step}"
