"""FinetuneJob: units, checkpoints, resume, PEFT files, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backfill.errors import CheckpointError, FinetuneConfigError, TrainingFileError
from backfill.finetune.config import FinetuneConfig
from backfill.finetune.job import FinetuneJob
from tests.finetune.helpers import TOKENIZER, tiny_model, write_chat_file

CONFIG = FinetuneConfig(rank=4, alpha=8, batch_size=4, micro_batch_size=2, max_steps=6, checkpoint_every_steps=2,
                        learning_rate=1e-2, seed=3, max_seq_len=64)


def _adapter_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "adapter_model.safetensors"))


def test_job_trains_checkpoints_and_writes_peft_files(tmp_path):
    model = tiny_model()
    job = FinetuneJob(model, TOKENIZER, write_chat_file(tmp_path / "t.jsonl"), CONFIG, tmp_path / "out")
    units = 0
    while job.run_unit():
        units += 1
    layers = model.config.num_layers
    # per micro-batch: `layers` forward pieces, the head (one slice here), `layers` backward pieces
    assert units == CONFIG.max_steps * (2 * (2 * layers + 1) + 1)  # + the optimizer update
    assert job.steps_done == job.total_steps == 6
    assert [e["step"] for e in job.events] == [1, 2, 3, 4, 5, 6]
    assert job.events[-1]["loss"] < job.events[0]["loss"]
    assert [s for s, _ in job.checkpoints()] == [2, 4, 6]
    config = json.loads((tmp_path / "out/adapter/adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    tensors = _adapter_tensors(tmp_path / "out/adapter")
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"]
    assert a.shape == (4, 64) and b.shape == (64, 4) and b.abs().sum() > 0


def test_head_in_slices_adds_units_not_changes(tmp_path):
    """HARLI §6.1: the LM head and loss in slices of a few targets; the step's gradients are the
    same up to the order of float sums (fp32: 1e-5 of the largest), only cut into more units."""
    data = write_chat_file(tmp_path / "t.jsonl")
    jobs = [FinetuneJob(tiny_model(), TOKENIZER, data, replace(CONFIG, max_steps=1, loss_rows_per_unit=rows),
                        tmp_path / f"rows-{rows}") for rows in (10_000, 4)]
    counts = []
    for job in jobs:
        units = 0
        while job.next_piece_kind != "update" or units == 0:
            assert job.run_unit()
            units += 1
            assert 0 <= job.progress_steps - job.steps_done < 1
        counts.append(units + 1)
    assert counts[1] == jobs[1].pieces_of_step(0) > counts[0] + 2
    assert counts[0] == jobs[0].pieces_of_step(0)
    for whole, sliced in zip(jobs[0].adapter.parameters(), jobs[1].adapter.parameters()):
        scale = whole.grad.abs().max().item()
        assert (sliced.grad - whole.grad).abs().max().item() <= 1e-5 * scale + 1e-12


def test_stopping_after_any_unit_and_resuming_changes_nothing(tmp_path):
    data = write_chat_file(tmp_path / "t.jsonl")
    ref = FinetuneJob(tiny_model(), TOKENIZER, data, CONFIG, tmp_path / "ref")
    ref.run()
    # Interrupted: a new job object (as after a crash) mid-step after step 3; it resumes from step 2.
    first = FinetuneJob(tiny_model(), TOKENIZER, data, CONFIG, tmp_path / "cut")
    while first.steps_done < 3:
        first.run_unit()
    for _ in range(5):
        first.run_unit()
    second = FinetuneJob(tiny_model(), TOKENIZER, data, CONFIG, tmp_path / "cut")
    assert second.steps_done == 2 and [e["step"] for e in second.events] == [1, 2]
    second.run()
    assert [e["step"] for e in second.events] == [1, 2, 3, 4, 5, 6]
    want, got = _adapter_tensors(tmp_path / "ref/adapter"), _adapter_tensors(tmp_path / "cut/adapter")
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


def test_kill_9_mid_job_then_resume_loses_and_repeats_no_step(tmp_path):
    data = write_chat_file(tmp_path / "t.jsonl")
    config = FinetuneConfig(**{**CONFIG.to_json(), "max_steps": 12, "checkpoint_every_steps": 3})
    ref = FinetuneJob(tiny_model(), TOKENIZER, data, config, tmp_path / "ref")
    ref.run()
    script = (
        "import sys, json, torch; torch.set_num_threads(1); sys.path.insert(0, '.')\n"
        "from pathlib import Path\n"
        "from backfill.finetune.config import FinetuneConfig\n"
        "from backfill.finetune.job import FinetuneJob\n"
        "from tests.finetune.helpers import TOKENIZER, tiny_model\n"
        f"job = FinetuneJob(tiny_model(), TOKENIZER, Path({str(data)!r}), "
        f"FinetuneConfig.from_json(json.loads({json.dumps(json.dumps(config.to_json()))})), Path({str(tmp_path / 'run')!r}))\n"
        "job.run()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2],
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    events = tmp_path / "run/events.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if events.exists() and len(events.read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the job ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    resumed = FinetuneJob(tiny_model(), TOKENIZER, data, config, tmp_path / "run")
    assert 3 <= resumed.steps_done < 12 and resumed.steps_done % 3 == 0
    resumed.run()
    assert [e["step"] for e in resumed.events] == list(range(1, 13))
    want, got = _adapter_tensors(tmp_path / "ref/adapter"), _adapter_tensors(tmp_path / "run/adapter")
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2: not valid JSON"),
    ('{"prompt": "x"}', "line 2: expected an object with a 'messages' list"),
    ('{"messages": []}', "line 2: 'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: no assistant message"),
    ('{"messages": [{"role": "wizard", "content": "hi"}]}', "line 2: messages[0] has unknown role"),
    ('{"messages": [{"role": "user", "content": 3}]}', "line 2: messages[0] needs string"),
])
def test_malformed_training_file_names_the_line(tmp_path, line, message):
    good = '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}'
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(TrainingFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        FinetuneJob(tiny_model(), TOKENIZER, path, CONFIG, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_and_empty_training_files(tmp_path):
    with pytest.raises(TrainingFileError, match="does not exist"):
        FinetuneJob(tiny_model(), TOKENIZER, tmp_path / "nope.jsonl", CONFIG, tmp_path / "out")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TrainingFileError, match="no examples"):
        FinetuneJob(tiny_model(), TOKENIZER, tmp_path / "empty.jsonl", CONFIG, tmp_path / "out")


@pytest.mark.parametrize("kw, message", [
    ({"rank": 0}, "rank must be a positive integer"),
    ({"alpha": 0}, "alpha must be positive"),
    ({"target_modules": ("q_proj", "lm_head")}, "unknown target modules"),
    ({"target_modules": ()}, "at least one"),
    ({"learning_rate": -1.0}, "learning_rate"),
    ({"micro_batch_size": 8, "batch_size": 4}, "exceeds batch_size"),
    ({"max_steps": 0}, "max_steps"),
])
def test_config_errors(kw, message):
    with pytest.raises(FinetuneConfigError, match=message):
        FinetuneConfig(**kw)


def test_resuming_with_another_rank_is_refused(tmp_path):
    data = write_chat_file(tmp_path / "t.jsonl")
    job = FinetuneJob(tiny_model(), TOKENIZER, data, CONFIG, tmp_path / "out")
    while job.steps_done < 2:
        job.run_unit()
    other = FinetuneConfig(**{**CONFIG.to_json(), "rank": 8})
    with pytest.raises(CheckpointError, match="rank=4"):
        FinetuneJob(tiny_model(), TOKENIZER, data, other, tmp_path / "out")


def test_assistant_tokens_only_are_targets(tmp_path):
    from backfill.finetune.data import encode_conversation
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "no", "weight": 0}]
    sample = encode_conversation(TOKENIZER, messages, 512)
    targets = bytes(t for t, m in zip(sample.token_ids, sample.loss_mask) if m).decode()
    assert targets == "yes\n"


@pytest.mark.parametrize("layers_per_unit", [1, 3])
def test_next_units_are_the_units_the_job_then_runs(tmp_path, layers_per_unit):
    """The piece sequence is a function of (seed, step): the kinds a scheduler is told come next are
    the kinds run_unit then runs, across step boundaries and after a dropped step."""
    config = replace(CONFIG, max_steps=3, loss_rows_per_unit=4, layers_per_unit=layers_per_unit)
    job = FinetuneJob(tiny_model(), TOKENIZER, write_chat_file(tmp_path / "t.jsonl"), config, tmp_path / "out")
    assert len(job.kinds_of_step(0)) == job.pieces_of_step(0)
    assert job.kinds_of_step(0).count("update") == 1 and job.kinds_of_step(0).count("head") > 2
    predicted = [tuple(k for k, _ in unit) for unit in job.next_units(10_000)]
    ran = []
    while job.run_unit():
        ran.append(tuple(k for k, _ in job.last_unit_pieces))
        if len(ran) == 5:  # a dropped step is redone from its start: the prediction says so
            job.abandon_step()
            predicted = ran + [tuple(k for k, _ in unit) for unit in job.next_units(10_000)]
        if len(ran) == 40:
            ahead = job.next_units(3)
            assert [tuple(k for k, _ in u) for u in ahead] == predicted[40:43]
            assert all(ms > 0 for u in ahead for _, ms in u)  # the recent median of each kind
    assert ran == predicted and job.next_units(4) == ()
    assert all(len(u) <= layers_per_unit for u in ran)


def test_a_step_paused_in_its_forward_leaves_autograd_on(tmp_path):
    """Grad mode is per thread: a job paused mid-forward (or dropped there) must not leave the
    engine's thread without autograd, or the next job's head slice has nothing to differentiate."""
    data = write_chat_file(tmp_path / "t.jsonl")
    first = FinetuneJob(tiny_model(), TOKENIZER, data, CONFIG, tmp_path / "first")
    first.run_unit()
    assert first.next_piece_kind == "forward" and torch.is_grad_enabled()
    second = FinetuneJob(tiny_model(), TOKENIZER, data, replace(CONFIG, max_steps=1), tmp_path / "second")
    second.run()  # its head's backward needs autograd
    assert second.finished and torch.is_grad_enabled()
