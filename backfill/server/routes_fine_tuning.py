"""The fine-tuning API's routes: POST /v1/fine_tuning/jobs, list, read, events, checkpoints, cancel
(the jobs themselves run in fine_tuning.py's FineTuningWorker)."""

from __future__ import annotations

import asyncio
import random
import shutil
import uuid

from fastapi import APIRouter, Request

from backfill.errors import FinetuneError
from backfill.finetune.data import load_training_file
from backfill.server.errors import APIError, bad_request, not_found
from backfill.server.fine_tuning import FINE_TUNE_PURPOSE, SEED_MAX, FineTuningJobCreateBody, finetune_config
from backfill.server.fine_tuning_store import ACTIVE_STATUSES, fine_tuned_model_name
from backfill.server.http_helpers import int_param, json_body_openapi, page, read_json
from backfill.server.schemas import validate_body
from backfill.server.state import ServerState


def add_fine_tuning_routes(v1: APIRouter, state: ServerState) -> None:
    worker = state.fine_tuning
    jobs, files = worker.jobs, state.store
    base_models = (state.served_model, state.engine.model_name)

    async def existing_job(job_id: str) -> dict:
        job = await asyncio.to_thread(jobs.get_job, job_id)
        if job is None:
            raise not_found(f"no fine-tuning job with id {job_id!r}", param="fine_tuning_job_id",
                            code="fine_tuning_job_not_found")
        return job

    @v1.post("/fine_tuning/jobs", openapi_extra=json_body_openapi(FineTuningJobCreateBody))
    async def create_job(request: Request) -> dict:
        body = validate_body(FineTuningJobCreateBody, await read_json(request, state.limit_bytes,
                                                  state.config.body_timeout_s))
        if body.model not in base_models:
            hint = " (a fine-tuned model cannot be fine-tuned again)" if ":ft-" in body.model else ""
            raise not_found(f"the model {body.model!r} does not exist or cannot be fine-tuned here{hint}; "
                            f"this server fine-tunes {base_models[0]!r}", param="model", code="model_not_found")
        seed = body.seed if body.seed is not None else random.randint(0, SEED_MAX)
        config, shown = finetune_config(body, seed, body.model)
        file = await asyncio.to_thread(files.get_file, body.training_file)
        if file is None:
            raise not_found(f"no file with id {body.training_file!r}", param="training_file", code="file_not_found")
        if file["purpose"] != FINE_TUNE_PURPOSE:
            raise bad_request(f"file {body.training_file!r} has purpose {file['purpose']!r}; upload the training "
                              f"file with purpose {FINE_TUNE_PURPOSE!r}", param="training_file")
        state.check_not_draining()
        content = await asyncio.to_thread(files.file_content, body.training_file)
        staging = worker.root / f".upload-{uuid.uuid4().hex}"
        staging.mkdir(parents=True)
        try:
            path = staging / "training.jsonl"
            path.write_bytes(content)
            try:  # a malformed file is the caller's mistake: a 400 naming the line, not a failed job
                await asyncio.to_thread(load_training_file, path, worker.engine.tokenizer, config.max_seq_len)
            except FinetuneError as exc:
                raise bad_request(f"invalid training file {body.training_file}: {exc}", param="training_file",
                                  code="invalid_training_file") from None
            job = await asyncio.to_thread(jobs.create_job, body.model, body.training_file, shown, config.to_json(),
                                          body.suffix, seed, body.metadata)
            staging.rename(worker.job_dir(job["id"]))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        worker.wake()
        return job

    @v1.get("/fine_tuning/jobs")
    async def list_jobs(request: Request) -> dict:
        limit = int_param(request.query_params.get("limit"), "limit", 20, 1, 100)
        found, has_more = await asyncio.to_thread(jobs.list_jobs, limit, request.query_params.get("after"))
        return page(found, has_more)

    @v1.get("/fine_tuning/jobs/{job_id}")
    async def get_job(job_id: str) -> dict:
        return await existing_job(job_id)

    @v1.get("/fine_tuning/jobs/{job_id}/events")
    async def list_events(job_id: str, request: Request) -> dict:
        await existing_job(job_id)
        limit = int_param(request.query_params.get("limit"), "limit", 20, 1, 1000)
        events, has_more = await asyncio.to_thread(jobs.list_events, job_id, limit, request.query_params.get("after"))
        return {"object": "list", "data": events, "has_more": has_more}

    @v1.get("/fine_tuning/jobs/{job_id}/checkpoints")
    async def list_checkpoints(job_id: str, request: Request) -> dict:
        job = await existing_job(job_id)
        limit = int_param(request.query_params.get("limit"), "limit", 10, 1, 100)
        model = job["fine_tuned_model"] or fine_tuned_model_name(job["model"], job_id, job["user_provided_suffix"])
        found, has_more = await asyncio.to_thread(jobs.list_checkpoints, job_id, limit,
                                                  request.query_params.get("after"), model)
        return page(found, has_more)

    @v1.post("/fine_tuning/jobs/{job_id}/cancel")
    async def cancel_job(job_id: str) -> dict:
        job = await existing_job(job_id)
        if not await asyncio.to_thread(jobs.set_status, job_id, "cancelled", message="Fine-tuning job cancelled"):
            job = await existing_job(job_id)
            raise APIError(409, f"fine-tuning job {job_id} is already {job['status']} and cannot be cancelled",
                           code="fine_tuning_job_not_cancellable")
        if job["status"] in ACTIVE_STATUSES:
            worker.cancel(job_id)
        return await existing_job(job_id)
