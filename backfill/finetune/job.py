"""FinetuneJob: LoRA training on the engine's frozen weights, in scheduling units, resumable.

A step (one optimizer update over `batch_size` samples) is a generator that yields after every
transformer layer of every micro-batch's forward and backward (HARLI §6.1); `run_unit` advances
it by `layers_per_unit` such pieces, so a scheduler may stop the job after any unit. Every
`checkpoint_every_steps` steps the adapter, the optimizer state and the step count are written
atomically (a directory renamed into place); a job built on the same out_dir resumes from the
newest checkpoint, and since the data order is a function of (seed, step) only, no step is
repeated or skipped: the steps after that checkpoint are redone from the very state they had.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import torch

from backfill.engine.model import LlamaModel
from backfill.errors import CheckpointError
from backfill.finetune.config import FinetuneConfig
from backfill.finetune.data import Sample, collate, load_training_file, step_samples
from backfill.finetune.layerwise import embed, head_loss_sum, layer_forward, target_slices
from backfill.finetune.lora import TrainableLoraAdapter

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "step-"
KEEP_CHECKPOINTS = 3  # older ones are deleted (the final adapter is kept apart)


class FinetuneJob:
    def __init__(self, model: LlamaModel, tokenizer, training_file: Path, config: FinetuneConfig,
                 out_dir: Path, samples: list[Sample] | None = None) -> None:
        """samples: training_file already read (load_training_file with the same tokenizer and
        config.max_seq_len), where the caller checked it before building the model."""
        self.model = model
        self.config = config
        self.out_dir = Path(out_dir)
        self.samples = samples if samples is not None else load_training_file(Path(training_file), tokenizer,
                                                                                config.max_seq_len)
        self.pad_id = 0
        num_batches = -(-len(self.samples) // config.batch_size)
        self.total_steps = config.max_steps or config.epochs * num_batches
        generator = torch.Generator().manual_seed(config.seed)
        self.adapter = TrainableLoraAdapter(config, TrainableLoraAdapter.shapes_for(model.config), model.config.num_layers,
                                            generator, device=model.device)
        self.optimizer = torch.optim.AdamW(self.adapter.parameters(), lr=config.learning_rate,
                                           betas=config.betas, weight_decay=config.weight_decay)
        self.steps_done = 0
        self.events: list[dict] = []
        self.units_run = 0
        self.unit_ms: list[float] = []   # durations of recent units (for the QoS policy)
        # Recent durations of each kind of piece (forward / head / backward / update), for estimates.
        self.piece_ms: dict[str, list[float]] = {}
        self.last_unit_pieces: list[tuple[str, float]] = []  # (kind, ms) of each piece of the last unit
        self._next_kind = "forward"
        self._pieces_in_step = 0
        self._kinds_cache: tuple[int, tuple[str, ...]] | None = None
        self._pieces_this_step = 0       # pieces of the step in flight (known once it starts)
        self._step: Iterator[None] | None = None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._resume()

    # --- progress ---------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.steps_done >= self.total_steps

    @property
    def samples_done(self) -> int:
        return self.steps_done * self.config.batch_size

    @property
    def step_in_flight(self) -> bool:
        return self._step is not None

    @property
    def next_piece_kind(self) -> str:
        """forward, head, backward or update: what the next unit runs."""
        return self._next_kind

    def run_unit(self) -> bool:
        """Run one scheduling unit; False once the job is finished (nothing was run)."""
        if self.finished:
            return False
        started = time.perf_counter()
        if self._step is None:
            self._step = self._train_step()
        self.last_unit_pieces = []
        for _ in range(self.config.layers_per_unit):
            kind, piece_started = self._next_kind, time.perf_counter()
            done = next(self._step, StopIteration) is StopIteration
            self._pieces_in_step = 0 if done else self._pieces_in_step + 1
            piece_ms = (time.perf_counter() - piece_started) * 1e3
            self.last_unit_pieces.append((kind, piece_ms))
            recent = self.piece_ms.setdefault(kind, [])
            recent.append(piece_ms)
            del recent[:-16]
            if done:
                self._step, self._next_kind = None, "forward"
                break
        self.units_run += 1
        self.unit_ms.append((time.perf_counter() - started) * 1e3)
        del self.unit_ms[:-64]
        return True

    def next_unit_estimate_ms(self, default_ms: float = 10.0) -> float:
        """The expected duration of the next unit: the median of recent pieces of its kind."""
        piece = self._piece_estimate_ms(self._next_kind, default_ms)
        return piece * (self.config.layers_per_unit if self._next_kind in ("forward", "backward") else 1)

    def _piece_estimate_ms(self, kind: str, default_ms: float = 10.0) -> float:
        recent = self.piece_ms.get(kind) or self.piece_ms.get("backward") or []
        return sorted(recent)[len(recent) // 2] if recent else default_ms

    def next_units(self, count: int, default_ms: float = 10.0) -> tuple[tuple[tuple[str, float], ...], ...]:
        """The next `count` units (fewer near the end of the job), each as its pieces' (kind,
        expected ms): the step's piece sequence is a function of (seed, step), so a scheduler can
        predict with the kinds it would actually run (HARLI §5.2, §6.2)."""
        units: list[tuple[tuple[str, float], ...]] = []
        step, index = self.steps_done, (self._pieces_in_step if self._step is not None else 0)
        while len(units) < count and step < self.total_steps:
            kinds = self.kinds_of_step(step)
            while len(units) < count and index < len(kinds):
                # A unit never spans two steps: run_unit stops at the step's end.
                pieces = kinds[index:index + self.config.layers_per_unit]
                units.append(tuple((k, self._piece_estimate_ms(k, default_ms)) for k in pieces))
                index += len(pieces)
            step, index = step + 1, 0
        return tuple(units)

    def kinds_left_in_step(self) -> tuple[str, ...]:
        """The kinds of the pieces of the step in flight not run yet (empty between steps)."""
        return self.kinds_of_step(self.steps_done)[self._pieces_in_step:] if self._step is not None else ()

    def kinds_of_step(self, step: int) -> tuple[str, ...]:
        """The kind of every unit-sized piece of a step, in the order they run: per micro-batch
        each layer's forward, the head's slices, each layer's backward; then the optimizer update."""
        if self._kinds_cache is not None and self._kinds_cache[0] == step:
            return self._kinds_cache[1]
        c, layers = self.config, self.model.config.num_layers
        batch = [self.samples[i] for i in step_samples(len(self.samples), c.batch_size, c.seed, step)]
        kinds: list[str] = []
        for start in range(0, len(batch), c.micro_batch_size):
            targets = sum(s.num_targets for s in batch[start:start + c.micro_batch_size])
            kinds += ["forward"] * layers + ["head"] * max(1, -(-targets // c.loss_rows_per_unit)) + ["backward"] * layers
        kinds.append("update")
        self._kinds_cache = (step, tuple(kinds))
        return self._kinds_cache[1]

    def pieces_of_step(self, step: int) -> int:
        """Unit-sized pieces of a step: per micro-batch every layer forward and backward and the
        head's slices, then the optimizer update."""
        return len(self.kinds_of_step(step))

    @property
    def progress_steps(self) -> float:
        """Steps done, with the step in flight counted by the share of its pieces that ran."""
        if not self._pieces_this_step:
            return float(self.steps_done)
        return self.steps_done + min(self._pieces_in_step / self._pieces_this_step, 1.0)

    def run(self) -> None:
        """Run to the end undisturbed (the standalone job)."""
        while self.run_unit():
            pass

    def abandon_step(self) -> None:
        """Drop the step in flight (its activations and gradients): its memory is needed elsewhere.
        It is redone from its start later, with the same data, so nothing is lost or doubled."""
        if self._step is not None:
            self._step.close()
            self._step, self._next_kind, self._pieces_in_step = None, "forward", 0
            self.optimizer.zero_grad(set_to_none=True)

    def memory_bytes(self) -> int:
        """An upper bound of the memory the job holds while a step is in flight (HARLI §4.1):
        adapter, its gradients and AdamW's two moments, the saved layer inputs, one layer's
        recomputed activations with their gradients, and one head slice's logits (with gradients)."""
        c, m = self.config, self.model.config
        tokens = c.micro_batch_size * c.max_seq_len
        item = self.model.dtype.itemsize
        state = 4 * self.adapter.nbytes
        saved = (m.num_layers + 1) * tokens * m.hidden_size * item
        layer = 2 * tokens * (m.hidden_size * 8 + m.intermediate_size * 4) * max(item, 4)
        logits = 2 * min(tokens, c.loss_rows_per_unit) * m.vocab_size * 4  # one head slice at a time
        return state + saved + layer + logits

    # --- one optimizer step, as a generator of layer-sized pieces -----------------------------------

    def _train_step(self) -> Iterator[None]:
        c, model = self.config, self.model
        indices = step_samples(len(self.samples), c.batch_size, c.seed, self.steps_done)
        batch = [self.samples[i] for i in indices]
        num_targets = sum(s.num_targets for s in batch)
        self._pieces_this_step = self.pieces_of_step(self.steps_done)
        self.optimizer.zero_grad(set_to_none=True)
        layers = model.config.num_layers
        loss_sum = 0.0
        tokens = 0
        for start in range(0, len(batch), c.micro_batch_size):
            ids, mask = (t.to(model.device) for t in collate(batch[start:start + c.micro_batch_size], self.pad_id))
            tokens += int(ids.numel())
            saved = [embed(model, ids)]
            for li in range(layers):
                # no_grad around the layer only: grad mode is per thread, and a `with` held across a
                # yield would leave the caller's thread without autograd while the step is paused.
                with torch.no_grad():
                    saved.append(layer_forward(model, self.adapter, li, saved[-1]))
                self._next_kind = "forward" if li < layers - 1 else "head"
                yield
            top = saved.pop().requires_grad_()
            slices = target_slices(mask, c.loss_rows_per_unit)
            for si, part in enumerate(slices):  # gradients of the slices add up in top.grad
                loss = head_loss_sum(model, top, ids, part) / num_targets
                loss.backward()
                loss_sum += float(loss.detach())
                del loss
                self._next_kind = "head" if si < len(slices) - 1 else "backward"
                yield
            grad = top.grad
            for li in reversed(range(layers)):
                x = saved.pop().requires_grad_()
                out = layer_forward(model, self.adapter, li, x)
                torch.autograd.backward(out, grad)  # HARLI §6.1: the layer's output gradient, explicitly
                grad = x.grad
                del out, x
                last = li == 0 and start + c.micro_batch_size >= len(batch)
                self._next_kind = "backward" if li > 0 else ("update" if last else "forward")
                yield
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        event = {"step": self.steps_done, "loss": loss_sum, "time": time.time(), "samples": len(batch),
                 "tokens": tokens, "targets": num_targets}
        self.events.append(event)
        with open(self.out_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")
        if self.steps_done % c.checkpoint_every_steps == 0 or self.finished:
            self._checkpoint()
        if self.finished:
            self.save_adapter(self.out_dir / "adapter")

    # --- checkpoints ------------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        return self.out_dir / "checkpoints"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, adapter directory) of every complete checkpoint, oldest first."""
        if not self.checkpoint_root.is_dir():
            return []
        out = []
        for d in self.checkpoint_root.iterdir():
            if d.name.startswith(CHECKPOINT_PREFIX) and (d / "trainer_state.json").exists():
                out.append((int(d.name.removeprefix(CHECKPOINT_PREFIX)), d))
        return sorted(out)

    def save_adapter(self, directory: Path) -> Path:
        """The adapter as it is now, in PEFT's LoRA format."""
        return self.adapter.save(Path(directory))

    def _checkpoint(self) -> None:
        final = self.checkpoint_root / f"{CHECKPOINT_PREFIX}{self.steps_done:06d}"
        tmp = self.checkpoint_root / f".tmp-{self.steps_done:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        self.adapter.save(tmp)
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        state = {"step": self.steps_done, "total_steps": self.total_steps, "num_samples": len(self.samples),
                 "config": self.config.to_json()}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        for f in tmp.iterdir():  # durable before it becomes visible: a kill -9 leaves the old one or this one
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in self.checkpoints()[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)

    def _resume(self) -> None:
        """Load the newest checkpoint, if any, and keep only the events up to its step."""
        found = self.checkpoints()
        if found:
            step, directory = found[-1]
            try:
                state = json.loads((directory / "trainer_state.json").read_text())
                saved = FinetuneConfig.from_json(state["config"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"checkpoint {directory} is unreadable: {exc}") from exc
            mine, theirs = self.config.to_json(), saved.to_json()
            for key in ("rank", "alpha", "target_modules", "seed", "batch_size", "micro_batch_size", "max_seq_len"):
                if mine[key] != theirs[key]:
                    raise CheckpointError(f"{self.out_dir} holds a job with {key}={theirs[key]!r}, not {mine[key]!r}")
            if state.get("num_samples") != len(self.samples):
                raise CheckpointError(f"{self.out_dir} was trained on {state.get('num_samples')} samples, "
                                      f"this training file has {len(self.samples)}")
            self.adapter.load(directory)
            try:
                self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
            except (OSError, RuntimeError, ValueError) as exc:
                raise CheckpointError(f"optimizer state in {directory} is unreadable: {exc}") from exc
            self.steps_done = step
            log.info("resuming finetuning from step %d of %d (%s)", step, self.total_steps, directory)
        events_file = self.out_dir / "events.jsonl"
        if events_file.exists():
            kept = []
            for line in events_file.read_text().splitlines():
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a kill
                    continue
                if event.get("step", 0) <= self.steps_done:
                    kept.append(event)
            self.events = kept
            events_file.write_text("".join(json.dumps(e) + "\n" for e in kept))
