"""The fine-tuning API end to end through the official openai client, on real servers (tiny model).

Upload, create, poll, events, checkpoints, the resulting model in /v1/models and in a chat
completion; bad input answered with 4xx while a job and a completion run on; a kill -9 mid-job
and a restart that resumes it without losing or repeating a step.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_helpers import assert_error, live_server, openai_client

# Short conversations the tiny model (byte tokens) learns quickly; the first prompt is asked after.
EXAMPLES = [("What is the capital of France?", "Paris."), ("Name a color.", "Blue."),
            ("What is 2+2?", "Four."), ("Say hi.", "Hi!")]
TRAIN_PROMPT = EXAMPLES[0][0]


def training_jsonl(examples=EXAMPLES) -> bytes:
    return "".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                   + "\n" for q, a in examples).encode()


def upload_training(client, content: bytes | None = None):
    return client.files.create(file=("train.jsonl", io.BytesIO(content or training_jsonl())), purpose="fine-tune")


def create_job(client, file_id: str, model: str, max_steps: int = 8, seed: int = 7, **lora):
    # OpenAI's hyperparameters plus backfill's (max_steps, ...) and its "lora" extension field.
    return client.fine_tuning.jobs.create(
        model=model, training_file=file_id, seed=seed, suffix="capitals",
        extra_body={"hyperparameters": {"n_epochs": 3, "batch_size": 2, "learning_rate_multiplier": 1000.0,
                                        "max_steps": max_steps, "checkpoint_every_steps": 4},
                    "lora": {"rank": 4, "alpha": 8, **lora}})


def wait_status(client, job_id: str, statuses=("succeeded", "failed", "cancelled"), timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        assert time.monotonic() < deadline, f"job still {job.status}"
        time.sleep(0.1)


def chat(client, model: str, prompt: str = TRAIN_PROMPT) -> str:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=8, temperature=0)
    assert reply.model == model
    return reply.choices[0].message.content


def metrics_steps(client, job_id: str) -> list[int]:
    events = client.fine_tuning.jobs.list_events(job_id, limit=1000).data
    return sorted(e.data["step"] for e in events if e.type == "metrics")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("ft")) as live:
        yield live


def test_job_end_to_end_through_the_openai_client(server):
    client = openai_client(server.url)
    base = client.models.list().data[0].id
    file = upload_training(client)
    assert file.purpose == "fine-tune"
    job = create_job(client, file.id, base)
    assert job.object == "fine_tuning.job" and job.status in ("validating_files", "queued", "running")
    assert job.hyperparameters.n_epochs == 3 and job.hyperparameters.batch_size == 2
    assert job.model == base and job.training_file == file.id and job.seed == 7
    assert job.model_extra["lora"] == {"rank": 4, "alpha": 8.0, "target_modules": list(job.model_extra["lora"]
                                                                                          ["target_modules"])}
    seen = {job.status}
    deadline = time.monotonic() + 120
    while job.status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
        job = client.fine_tuning.jobs.retrieve(job.id)
        seen.add(job.status)
    assert job.status == "succeeded", job.error
    assert "running" in seen
    # The suffix ("capitals") is in the name, before the job id that keeps the name unique.
    assert job.fine_tuned_model == f"{base}:ft-capitals-{job.id}" and job.finished_at >= job.created_at
    assert job.trained_tokens > 0 and len(job.result_files) == 1
    results = client.files.content(job.result_files[0]).text.splitlines()
    assert results[0] == "step,train_loss,samples,tokens" and len(results) == 9

    assert metrics_steps(client, job.id) == list(range(1, 9))
    events = client.fine_tuning.jobs.list_events(job.id, limit=1000).data
    assert events[0].message.startswith("The job has successfully completed")  # newest first
    losses = [e.data["train_loss"] for e in sorted((e for e in events if e.type == "metrics"),
                                                   key=lambda e: e.data["step"])]
    print("losses", losses)
    assert sum(losses[-2:]) < sum(losses[:2])
    page = client.fine_tuning.jobs.list_events(job.id, limit=3)
    assert len(page.data) == 3 and page.has_more

    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [8, 4]
    assert checkpoints[0].fine_tuned_model_checkpoint == f"{job.fine_tuned_model}:ckpt-step-8"
    assert checkpoints[0].metrics.train_loss == pytest.approx(losses[-1])

    assert job.fine_tuned_model in [m.id for m in client.models.list().data]
    assert client.models.retrieve(job.fine_tuned_model).model_extra["parent"] == base
    tuned, plain = chat(client, job.fine_tuned_model), chat(client, base)
    assert tuned != plain
    print("base:", repr(plain), "tuned:", repr(tuned))

    listed = client.fine_tuning.jobs.list(limit=1)
    assert listed.data[0].id == job.id
    assert_error(httpx.post(f"{server.url}/v1/fine_tuning/jobs/{job.id}/cancel"), 409,
                 code="fine_tuning_job_not_cancellable")


def test_bad_input_is_4xx_and_disturbs_nothing(server):
    """Each mistake is a 4xx naming its cause, sent while a job trains and a completion streams."""
    client = openai_client(server.url)
    base = client.models.list().data[0].id
    file = upload_training(client)
    running = create_job(client, file.id, base, max_steps=6, seed=3)
    stream = client.chat.completions.create(model=base, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    url = f"{server.url}/v1/fine_tuning/jobs"

    def create(**body):
        return httpx.post(url, json={"model": base, "training_file": file.id, **body}, timeout=30)

    bad_file = upload_training(client, b'{"messages": [{"role": "user", "content": "q"}]}\n{"messages": oops}\n')
    error = assert_error(create(training_file=bad_file.id), 400, code="invalid_training_file", param="training_file")
    assert "line 1" in error["message"] and "assistant" in error["message"]
    assert "line 5" in assert_error(create(training_file=upload_training(client, training_jsonl() + b"{oops\n").id),
                                    400, param="training_file")["message"]
    assert "rank" in assert_error(create(lora={"rank": 0}), 400, param="lora.rank")["message"]
    assert_error(create(lora={"target_modules": ["lm_head"]}), 400, param="lora.target_modules")
    assert_error(create(hyperparameters={"n_epochs": 0}), 400, param="hyperparameters.n_epochs")
    assert_error(create(hyperparameters={"learning_rate_multiplier": -1.0}), 400,
                 param="hyperparameters.learning_rate_multiplier")
    assert "gpt-4o" in assert_error(create(model="gpt-4o"), 404, code="model_not_found", param="model")["message"]
    assert_error(create(training_file="file-nope"), 404, code="file_not_found", param="training_file")
    batch_file = client.files.create(file=("b.jsonl", io.BytesIO(b'{"a": 1}')), purpose="batch")
    assert "fine-tune" in assert_error(create(training_file=batch_file.id), 400, param="training_file")["message"]
    assert_error(create(validation_file=file.id), 400, param="validation_file")
    # A typo is refused, never a job trained with defaults.
    assert "bogus" in assert_error(create(hyperparameters={"bogus": 1}), 400,
                                   param="hyperparameters.bogus")["message"]
    assert_error(create(method={"type": "supervised", "supervised": {"hyperparameters": {"n_epoch": 2}}}), 400,
                 param="method.supervised.hyperparameters.n_epoch")
    assert_error(create(lora={"rnak": 4}), 400, param="lora.rnak")
    assert_error(create(suffix="a:b"), 400, param="suffix")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model=f"{base}:ft-ftjob-nope", messages=[{"role": "user", "content": "x"}])
    assert_error(httpx.get(f"{url}/ftjob-nope"), 404, code="fine_tuning_job_not_found")
    assert_error(httpx.get(f"{url}/ftjob-nope/events"), 404)
    assert_error(httpx.post(f"{url}/ftjob-nope/cancel"), 404)
    assert_error(httpx.get(url, params={"limit": 0}), 400, param="limit")
    # Nothing was disturbed: the stream finishes, the job trains to its end.
    text = first.choices[0].delta.content or ""
    text += "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert len(text) > 0
    done = wait_status(client, running.id)
    assert done.status == "succeeded" and metrics_steps(client, running.id) == list(range(1, 7))


def test_cancel_a_running_job(server):
    client = openai_client(server.url)
    base = client.models.list().data[0].id
    job = create_job(client, upload_training(client).id, base, max_steps=100_000)
    wait_status(client, job.id, ("running",))
    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.fine_tuned_model is None
    time.sleep(0.5)
    assert client.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    assert server.state.fine_tuning.running is None  # the worker let go of it
    assert "Fine-tuning job cancelled" in [e.message for e in client.fine_tuning.jobs.list_events(job.id).data]


def adapter_tensors(db: Path, job_id: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(db.with_name(db.name + ".fine_tuning") / job_id / "adapter" / "adapter_model.safetensors"))


@pytest.mark.slow
def test_kill_9_mid_job_then_restart_resumes_without_losing_a_step(tmp_path, server_processes):
    db = tmp_path / "ft.db"
    first = server_processes(db)
    client = openai_client(first.url)
    base = client.models.list().data[0].id
    file = upload_training(client)
    steps = 24
    # The same job run undisturbed first: the resumed job must end with its very adapter.
    undisturbed = wait_status(client, create_job(client, file.id, base, max_steps=steps, seed=11).id)
    assert undisturbed.status == "succeeded", undisturbed.error
    job = create_job(client, file.id, base, max_steps=steps, seed=11)
    deadline = time.monotonic() + 120
    while not client.fine_tuning.jobs.checkpoints.list(job.id).data or len(metrics_steps(client, job.id)) < 6:
        assert time.monotonic() < deadline, "the job never got past its first checkpoint"
        time.sleep(0.02)
    before = metrics_steps(client, job.id)
    first.stop()  # SIGKILL
    assert 6 <= len(before) < steps, before

    server_processes(db, port=first.port)
    # The finished job's model is loaded again at start-up.
    assert undisturbed.fine_tuned_model in [m.id for m in client.models.list().data]
    assert chat(client, undisturbed.fine_tuned_model)
    done = wait_status(client, job.id)
    assert done.status == "succeeded", done.error
    assert metrics_steps(client, job.id) == list(range(1, steps + 1))  # every step once, none lost
    messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=1000).data]
    assert any(m.startswith("Resumed fine-tuning from the checkpoint at step") for m in messages)
    assert chat(client, done.fine_tuned_model) == chat(client, undisturbed.fine_tuned_model)
    resumed, reference = adapter_tensors(db, job.id), adapter_tensors(db, undisturbed.id)
    assert resumed.keys() == reference.keys()
    for name, tensor in resumed.items():
        torch.testing.assert_close(tensor, reference[name], atol=1e-6, rtol=1e-5)


def test_jobs_list_pages_newest_first(server):
    client = openai_client(server.url)
    file = upload_training(client)
    base = client.models.list().data[0].id
    for seed in range(3):
        create_job(client, file.id, base, max_steps=1, seed=seed)
    listed = client.fine_tuning.jobs.list(limit=100).data
    assert len(listed) >= 3
    assert [j.created_at for j in listed] == sorted((j.created_at for j in listed), reverse=True)
    first = client.fine_tuning.jobs.list(limit=2)
    assert first.has_more and len(first.data) == 2
    rest = client.fine_tuning.jobs.list(limit=100, after=first.data[-1].id).data
    assert [j.id for j in first.data + rest] == [j.id for j in listed]
    assert [j.id for j in client.fine_tuning.jobs.list(limit=1)] == [j.id for j in listed]  # the client pages on


def test_adapters_load_and_unload_at_run_time(server, tmp_path):
    """vLLM's runtime LoRA endpoints: a PEFT adapter becomes a model, batched with the base model."""
    pytest.importorskip("peft")
    from lora_helpers import ALL_TARGETS, hf_llama, make_peft_adapter

    from backfill.engine.config import ModelConfig
    from backfill.engine.weights import random_model

    cfg = ModelConfig.tiny()
    make_peft_adapter(hf_llama(cfg, random_model(cfg, seed=0)), tmp_path / "sql", 4, 8, ALL_TARGETS, seed=5, std=1.0)
    client = openai_client(server.url)
    base = client.models.list().data[0].id
    load = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(tmp_path / "sql")})
    assert load.status_code == 200, load.text
    assert "sql" in [m.id for m in client.models.list().data]
    results = {}
    threads = [threading.Thread(target=lambda m=m: results.__setitem__(m, chat(client, m, "hello"))) for m in ("sql", base)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["sql"] == chat(client, "sql", "hello") and results[base] == chat(client, base, "hello")
    assert results["sql"] != results[base]
    assert_error(httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/nope"}),
                 400, code="invalid_adapter")
    assert_error(httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}),
                 400, param="lora_path")
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
    assert_error(httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "sql"}), 404,
                 code="adapter_not_found")
    with pytest.raises(openai.NotFoundError):
        chat(client, "sql")


def test_finetune_commands_create_follow_get_and_cancel_a_server_job(server, tmp_path, capsys):
    from backfill.cli import main

    path = tmp_path / "train.jsonl"
    path.write_bytes(training_jsonl())
    common = ["finetune", "create", str(path), "--url", server.url, "--batch-size", "2", "--max-steps", "3"]
    assert main(common + ["--rank", "0"]) == 2
    assert "rank must be a positive integer" in capsys.readouterr().err
    assert main(common + ["--rank", "2", "--targets", "q_proj,v_proj", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "Step 3/3: training loss=" in out and "fine-tuned model: " in out
    job_id = out.split("created ", 1)[1].split()[0]
    assert main(["finetune", "list", "--url", server.url]) == 0
    assert job_id in capsys.readouterr().out
    assert main(["finetune", "get", job_id, "--url", server.url]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "succeeded"
    assert main(["finetune", "events", job_id, "--url", server.url, "--limit", "1"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert main(["finetune", "cancel", job_id, "--url", server.url]) == 2
    assert "already succeeded" in capsys.readouterr().err
    assert main(["finetune", "get", "ftjob-nope", "--url", server.url]) == 2
    assert "404" in capsys.readouterr().err


@pytest.mark.slow
def test_real_model_learns_the_training_answer(tmp_path):
    """On the real default model: a few steps on one conversation change its answer to that prompt."""
    from server_helpers import LiveServer

    from backfill.server.app import create_app
    from backfill.server.config import ServerConfig
    from backfill.server.store import Store
    from backfill.serving.config import ServingConfig
    from backfill.serving.build import build_engine

    serving = ServingConfig(policy="priority", kv_cache_gb=0.5, max_model_len=512)
    db = tmp_path / "real.db"
    app = create_app(build_engine(serving), ServerConfig(serving=serving, db=str(db), drain_timeout_s=2.0), Store(db))
    with LiveServer(app) as server:
        client = openai_client(server.url)
        base = client.models.list().data[0].id
        prompt, answer = "What is the secret word?", "The secret word is BANANAPHONE."
        file = upload_training(client, training_jsonl([(prompt, answer)]))
        job = client.fine_tuning.jobs.create(
            model=base, training_file=file.id, seed=1,
            extra_body={"hyperparameters": {"batch_size": 1, "max_steps": 6, "learning_rate_multiplier": 30.0,
                                            "max_seq_len": 64},
                        "lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}})
        done = wait_status(client, job.id, timeout_s=float(os.environ.get("BACKFILL_TEST_FT_TIMEOUT_S", 300)))
        assert done.status == "succeeded", done.error
        tuned, plain = chat(client, done.fine_tuned_model, prompt), chat(client, base, prompt)
        assert "BANANAPH" in tuned.upper() and "BANANAPH" not in plain.upper(), (tuned, plain)  # 8 tokens
