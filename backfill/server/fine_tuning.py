"""OpenAI's fine-tuning API on the serving engine: LoRA jobs co-located with inference (HARLI).

    POST /v1/fine_tuning/jobs                  create (training_file from POST /v1/files, purpose fine-tune)
    GET  /v1/fine_tuning/jobs                  list, newest first (after, limit)
    GET  /v1/fine_tuning/jobs/{id}             one job
    GET  /v1/fine_tuning/jobs/{id}/events      its events, newest first (after, limit)
    GET  /v1/fine_tuning/jobs/{id}/checkpoints its checkpoints, newest first (after, limit)
    POST /v1/fine_tuning/jobs/{id}/cancel      cancel

Statuses: validating_files -> queued -> running -> succeeded | failed | cancelled. One job trains
at a time, on the engine's own weights, interleaved with its decode steps by harli-core's
attach_finetune (backfill/finetune/colocate.py). A job's row in SQLite is its durable state; its
adapter checkpoints live under `<db>.fine_tuning/<job id>/`, so after a crash or kill -9 a
restarted server resumes a running job from its newest checkpoint (FinetuneJob redoes the steps
after it, with the same data, so no step is lost or doubled). A succeeded job's adapter is loaded
into the engine's adapter registry and served as `<base-model>:ft-<job id>`
(`<base-model>:ft-<suffix>-<job id>` with a suffix).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from backfill.errors import BackfillError, FinetuneConfigError, FinetuneError
from backfill.finetune.config import ALL_TARGETS, FinetuneConfig
from backfill.finetune.data import load_training_file
from backfill.server.errors import bad_request
from backfill.server.fine_tuning_store import FineTuningStore, fine_tuned_model_name
from backfill.server.schemas import StrictBody
from backfill.server.store import Store
from backfill.serving.async_engine import AsyncEngine

log = logging.getLogger(__name__)

FINE_TUNE_PURPOSE = "fine-tune"
RESULTS_PURPOSE = "fine-tune-results"
SEED_MAX = 2**31 - 1  # OpenAI's range for a job's seed
SUFFIX_PATTERN = r"^[A-Za-z0-9_-]+$"   # part of a model name: no ':' (the name's separator)


class Hyperparameters(StrictBody):
    """OpenAI's three, plus backfill's training-loop knobs (ignored by OpenAI's own API)."""

    n_epochs: Literal["auto"] | int = "auto"
    batch_size: Literal["auto"] | int = "auto"
    learning_rate_multiplier: Literal["auto"] | float = "auto"
    max_steps: int | None = None
    checkpoint_every_steps: int | None = None
    micro_batch_size: int | None = None
    max_seq_len: int | None = None


class LoraOptions(StrictBody):
    """backfill's extension field: the adapter's shape (FinetuneConfig's defaults where left out)."""

    rank: int | None = None
    alpha: float | None = None
    target_modules: list[str] | None = None


class SupervisedMethod(StrictBody):
    hyperparameters: Hyperparameters | None = None


class Method(StrictBody):
    type: Literal["supervised"]
    supervised: SupervisedMethod | None = None


class FineTuningJobCreateBody(StrictBody):
    model: str
    training_file: str
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    suffix: str | None = Field(default=None, min_length=1, max_length=64, pattern=SUFFIX_PATTERN)
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    validation_file: str | None = None
    integrations: list | None = None
    metadata: dict[str, str] | None = None
    lora: LoraOptions | None = None

    def check_supported(self) -> None:
        if self.validation_file is not None:
            raise bad_request("validation_file is not supported: backfill reports the training loss only",
                              param="validation_file")
        if self.integrations:
            raise bad_request("integrations are not supported", param="integrations")
        if self.hyperparameters is not None and self.method is not None and self.method.supervised is not None \
                and self.method.supervised.hyperparameters is not None:
            raise bad_request("give hyperparameters either at the top level or in method.supervised, not both",
                              param="hyperparameters")
        if self.metadata is not None and (len(self.metadata) > 16 or any(
                len(k) > 64 or len(v) > 512 for k, v in self.metadata.items())):
            raise bad_request("metadata holds at most 16 pairs, keys of at most 64 characters, values of at most "
                              "512", param="metadata")

    def resolved_hyperparameters(self) -> Hyperparameters:
        if self.method is not None and self.method.supervised is not None \
                and self.method.supervised.hyperparameters is not None:
            return self.method.supervised.hyperparameters
        return self.hyperparameters or Hyperparameters()


# FinetuneConfig's field -> the request field a user sets it by (for the param of a 400).
_PARAM_OF = {"rank": "lora.rank", "alpha": "lora.alpha", "target_modules": "lora.target_modules",
             "epochs": "hyperparameters.n_epochs", "batch_size": "hyperparameters.batch_size",
             "learning_rate": "hyperparameters.learning_rate_multiplier", "max_steps": "hyperparameters.max_steps",
             "checkpoint_every_steps": "hyperparameters.checkpoint_every_steps",
             "micro_batch_size": "hyperparameters.micro_batch_size", "max_seq_len": "hyperparameters.max_seq_len"}


def finetune_config(body: FineTuningJobCreateBody, seed: int, base_model: str) -> tuple[FinetuneConfig, dict]:
    """The job's FinetuneConfig and its hyperparameters as the job object shows them (auto resolved)."""
    hyper = body.resolved_hyperparameters()
    lora = body.lora or LoraOptions()
    defaults = FinetuneConfig()
    multiplier = 1.0 if hyper.learning_rate_multiplier == "auto" else hyper.learning_rate_multiplier
    if not multiplier > 0:
        raise bad_request(f"learning_rate_multiplier must be positive, got {multiplier}",
                          param="hyperparameters.learning_rate_multiplier")
    batch_size = defaults.batch_size if hyper.batch_size == "auto" else hyper.batch_size
    fields = dict(
        rank=defaults.rank if lora.rank is None else lora.rank,
        alpha=defaults.alpha if lora.alpha is None else lora.alpha,
        target_modules=tuple(lora.target_modules) if lora.target_modules is not None else ALL_TARGETS,
        learning_rate=defaults.learning_rate * multiplier,
        epochs=defaults.epochs if hyper.n_epochs == "auto" else hyper.n_epochs,
        batch_size=batch_size, seed=seed, base_model=base_model, max_steps=hyper.max_steps,
        micro_batch_size=min(defaults.micro_batch_size, batch_size) if hyper.micro_batch_size is None
        else hyper.micro_batch_size)
    for name in ("checkpoint_every_steps", "max_seq_len"):
        if getattr(hyper, name) is not None:
            fields[name] = getattr(hyper, name)
    try:
        config = FinetuneConfig(**fields)
    except FinetuneConfigError as exc:
        message = str(exc)
        field = "target_modules" if "target modules" in message else message.split(" ", 1)[0]
        raise bad_request(message, param=_PARAM_OF.get(field), code="invalid_hyperparameters") from None
    shown = {"n_epochs": config.epochs, "batch_size": config.batch_size, "learning_rate_multiplier": multiplier,
             "max_steps": config.max_steps, "checkpoint_every_steps": config.checkpoint_every_steps,
             "micro_batch_size": config.micro_batch_size, "max_seq_len": config.max_seq_len}
    return config, shown


@dataclass
class RunningJob:
    job_id: str
    handle: object  # colocate.FinetuneHandle
    job: object     # finetune.job.FinetuneJob


class FineTuningWorker:
    """Runs the stored jobs one at a time on the engine and mirrors their progress into SQLite."""

    def __init__(self, jobs: FineTuningStore, files: Store, engine: AsyncEngine, base_model: str, root: Path,
                 poll_interval_s: float = 0.2) -> None:
        self.jobs = jobs
        self.files = files
        self.engine = engine
        self.base_model = base_model
        self.root = root
        self.poll_interval_s = poll_interval_s
        self.running: RunningJob | None = None
        self._wake = asyncio.Event()
        self._stopped = False
        # The adapters of jobs finished before this start are served models: /ready waits for them.
        self.finished_adapters_loaded = False
        self._main: asyncio.Task | None = None

    def job_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def start(self) -> None:
        self._stopped = False
        self._main = asyncio.create_task(self._loop(), name="backfill-fine-tuning")

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        """Stop training (a running job stays `running` in the database and resumes on restart)."""
        self._stopped = True
        if self.running is not None:
            self.running.handle.cancel()
        self._wake.set()
        if self._main is not None:
            try:
                await asyncio.wait_for(self._main, timeout=30)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._main.cancel()
            except Exception:
                log.exception("fine-tuning worker failed while stopping")
            self._main = None

    def cancel(self, job_id: str) -> None:
        if self.running is not None and self.running.job_id == job_id:
            self.running.handle.cancel()

    async def _loop(self) -> None:
        try:
            await self._load_finished_adapters()
        except Exception:
            log.exception("could not load the adapters of finished fine-tuning jobs")
        finally:
            self.finished_adapters_loaded = True
        while not self._stopped:
            self._wake.clear()
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a database or file hiccup must not end fine-tuning for good
                log.exception("fine-tuning worker tick failed; retrying")
            if self._stopped:
                break
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_interval_s * 5)
            except asyncio.TimeoutError:
                pass

    async def _load_finished_adapters(self) -> None:
        for job_id in await asyncio.to_thread(self.jobs.job_ids, "succeeded"):
            row = await asyncio.to_thread(self.jobs.job_row, job_id)
            adapter_dir = self.job_dir(job_id) / "adapter"
            if row["fine_tuned_model"] and adapter_dir.is_dir():
                await self._serve(row["fine_tuned_model"], adapter_dir)

    async def _serve(self, name: str, adapter_dir: Path) -> None:
        await self.engine.call_between_steps(lambda: self.engine.adapters.load(name, adapter_dir, replace=True))

    async def _tick(self) -> None:
        for job_id in await asyncio.to_thread(self.jobs.job_ids, "validating_files"):
            await self._validate(job_id)
        if not self.engine.running:
            return
        # A job that was running when the server stopped comes first: it resumes from its checkpoint.
        candidates = await asyncio.to_thread(self.jobs.job_ids, "running") or \
            await asyncio.to_thread(self.jobs.job_ids, "queued")
        if candidates:
            await self._train(candidates[0])

    async def _validate(self, job_id: str) -> None:
        row = await asyncio.to_thread(self.jobs.job_row, job_id)
        config = FinetuneConfig.from_json(json.loads(row["config"]))
        try:
            await asyncio.to_thread(load_training_file, self.job_dir(job_id) / "training.jsonl",
                                    self.engine.tokenizer, config.max_seq_len)
        except (FinetuneError, OSError) as exc:
            await self._fail(job_id, "invalid_training_file", str(exc), "training_file")
            return
        await asyncio.to_thread(self.jobs.set_status, job_id, "queued", only_from=("validating_files",),
                                message="Validated training file; job queued")

    async def _fail(self, job_id: str, code: str, message: str, param: str | None = None) -> None:
        error = json.dumps({"code": code, "message": message, "param": param})
        await asyncio.to_thread(self.jobs.set_status, job_id, "failed", error=error, level="error",
                                message=f"Fine-tuning job failed: {message}")

    async def _train(self, job_id: str) -> None:
        from backfill.finetune.colocate import attach_finetune
        from backfill.finetune.job import FinetuneJob

        row = await asyncio.to_thread(self.jobs.job_row, job_id)
        config = FinetuneConfig.from_json(json.loads(row["config"]))
        out_dir = self.job_dir(job_id)
        model = self.engine.model
        try:
            job = await self.engine.call_between_steps(
                lambda: FinetuneJob(model, self.engine.tokenizer, out_dir / "training.jsonl", config, out_dir))
        except BackfillError as exc:
            await self._fail(job_id, "job_setup_failed", str(exc))
            return
        resumed = row["status"] == "running"
        if self._stopped or not await asyncio.to_thread(self.jobs.set_status, job_id, "running", only_from=("queued", "running")):
            return  # cancelled meanwhile
        # Steps after the checkpoint it resumed from are redone; their old metrics go with them.
        await asyncio.to_thread(self.jobs.forget_steps_after, job_id, job.steps_done)
        await asyncio.to_thread(
            self.jobs.add_message, job_id,
            f"Resumed fine-tuning from the checkpoint at step {job.steps_done} of {job.total_steps}" if resumed
            else f"Fine-tuning started: {job.total_steps} steps on {len(job.samples)} examples")
        handle = attach_finetune(self.engine, job)
        self.running = RunningJob(job_id, handle, job)
        told_stalled = False
        try:
            while not handle.done:
                if self._stopped:
                    handle.cancel()
                if not told_stalled and handle.stats.units == 0 and handle.stats.stalled_calls >= 20:
                    # HARLI §4: the job trains only in KV blocks inference leaves idle; say so if it gets none.
                    told_stalled = True
                    await asyncio.to_thread(
                        self.jobs.add_message, job_id, f"Waiting for memory: a step needs "
                        f"{job.memory_bytes() / 2**20:.0f} MiB of the KV pool's idle blocks (raise --kv-cache-gb, or "
                        f"lower hyperparameters.max_seq_len / micro_batch_size)", "warn")
                try:
                    await asyncio.wait_for(asyncio.shield(handle.wait()), self.poll_interval_s)
                except asyncio.TimeoutError:
                    pass
                except Exception:
                    break  # handle.error says what happened
                await asyncio.to_thread(self._sync, job_id, job)
            await asyncio.to_thread(self._sync, job_id, job)
        finally:
            self.running = None
        if not job.finished:
            # Close the step left in flight by a cancel or a stop: its generator is suspended inside
            # torch.no_grad, whose thread-local grad mode would stay off on the engine's thread.
            await self.engine.call_between_steps(job.abandon_step)
        await self._finish(job_id, job, handle)

    def _sync(self, job_id: str, job) -> None:
        """Mirror the job's new step events and checkpoints into the database (a worker thread)."""
        last = self.jobs.last_step(job_id)
        events = [e for e in list(job.events) if e["step"] > last]
        if events:
            self.jobs.record_steps(job_id, events, job.total_steps)
        losses = {e["step"]: e.get("loss") for e in job.events}
        for step, path in job.checkpoints():
            metrics = {"step": step, "train_loss": losses.get(step), "total_steps": job.total_steps}
            self.jobs.record_checkpoint(job_id, step, str(path), metrics)

    async def _finish(self, job_id: str, job, handle) -> None:
        row = await asyncio.to_thread(self.jobs.job_row, job_id)
        if row["status"] != "running":
            return  # cancelled by a user (the cancel route wrote the status)
        if handle.error is not None:
            log.error("fine-tuning job %s failed: %r", job_id, handle.error)
            await self._fail(job_id, "training_failed", f"{type(handle.error).__name__}: {handle.error}")
            return
        if not job.finished:
            return  # the server is stopping: the job resumes from its checkpoint on restart
        adapter_dir = self.job_dir(job_id) / "adapter"
        if not (adapter_dir / "adapter_model.safetensors").exists():
            await self.engine.call_between_steps(lambda: job.save_adapter(adapter_dir))
        name = fine_tuned_model_name(row["model"], job_id, row["suffix"])
        try:
            await self._serve(name, adapter_dir)
        except BackfillError as exc:
            await self._fail(job_id, "adapter_load_failed", str(exc))
            return
        metrics = await asyncio.to_thread(self.jobs.step_metrics, job_id)
        csv = "step,train_loss,samples,tokens\n" + "".join(
            f"{m['step']},{m['train_loss']},{m['samples']},{m['tokens']}\n" for m in metrics)
        results = await asyncio.to_thread(self.files.create_file, RESULTS_PURPOSE, f"{job_id}-results.csv",
                                          csv.encode())
        await asyncio.to_thread(
            self.jobs.set_status, job_id, "succeeded", only_from=("running",), fine_tuned_model=name,
            trained_tokens=sum(m["tokens"] or 0 for m in metrics), result_file_id=results["id"],
            message=f"The job has successfully completed; the model is served as {name}")
