"""Chat-format training data (OpenAI's fine-tuning JSONL) and its deterministic order.

One conversation per line, `{"messages": [{"role": ..., "content": ...}, ...]}`. The loss
covers the assistant's tokens only (their closing end-of-turn token included, so the adapter
learns to stop); an assistant message with `"weight": 0` is context only, as in OpenAI's API.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from backfill.errors import BackfillError, TrainingFileError

ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class Sample:
    token_ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]  # mask[i]: token i is a training target (predicted from token i-1)

    @property
    def num_targets(self) -> int:
        return sum(self.loss_mask[1:])


def _check_messages(line_no: int, record) -> list[dict]:
    if not isinstance(record, dict) or "messages" not in record:
        raise TrainingFileError(f"line {line_no}: expected an object with a 'messages' list")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise TrainingFileError(f"line {line_no}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TrainingFileError(f"line {line_no}: messages[{i}] needs string 'role' and 'content'")
        if m["role"] not in ROLES:
            raise TrainingFileError(f"line {line_no}: messages[{i}] has unknown role {m['role']!r}")
        if m.get("weight", 1) not in (0, 1):
            raise TrainingFileError(f"line {line_no}: messages[{i}].weight must be 0 or 1")
    if not any(m["role"] == "assistant" and m.get("weight", 1) for m in messages):
        raise TrainingFileError(f"line {line_no}: no assistant message to train on")
    return [{"role": m["role"], "content": m["content"]} | ({"weight": m["weight"]} if "weight" in m else {})
            for m in messages]


def encode_conversation(tokenizer, messages: list[dict], max_seq_len: int) -> Sample:
    """Tokens of the rendered conversation and which of them are assistant targets.

    Message i's tokens are those its rendering adds to the rendering of messages[:i]; an
    assistant's generation prompt (its role header) is context, its content and end token targets.
    """
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    ids = tokenizer.encode(tokenizer.apply_chat_template(plain, add_generation_prompt=False))
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or not m.get("weight", 1):
            continue
        header = len(tokenizer.encode(tokenizer.apply_chat_template(plain[:i], add_generation_prompt=True))) if i else 0
        end = len(tokenizer.encode(tokenizer.apply_chat_template(plain[:i + 1], add_generation_prompt=False)))
        for t in range(header, min(end, len(ids))):
            mask[t] = True
    return Sample(tuple(ids[:max_seq_len]), tuple(mask[:max_seq_len]))


def load_training_file(path: Path, tokenizer, max_seq_len: int) -> list[Sample]:
    """Parse and tokenize every line; a malformed line raises TrainingFileError naming it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TrainingFileError(f"training file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TrainingFileError(f"training file {path} cannot be read as UTF-8 text: {exc}") from exc
    samples = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TrainingFileError(f"line {line_no}: not valid JSON ({exc.msg})") from None
        messages = _check_messages(line_no, record)
        try:
            sample = encode_conversation(tokenizer, messages, max_seq_len)
        except BackfillError as exc:
            raise TrainingFileError(f"line {line_no}: {exc}") from exc
        if sample.num_targets == 0:
            raise TrainingFileError(f"line {line_no}: no assistant token within max_seq_len={max_seq_len}")
        samples.append(sample)
    if not samples:
        raise TrainingFileError(f"training file {path} has no examples")
    return samples


@functools.lru_cache(maxsize=8)
def sample_order(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The epoch's permutation of the samples: a function of (seed, epoch) only, so a resumed job
    sees exactly the order the interrupted one would have."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return tuple(torch.randperm(num_samples, generator=generator).tolist())


def step_samples(num_samples: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The sample indices of optimizer step `step` (0-based): consecutive slots of the epochs'
    permutations laid end to end, so every epoch sees every sample once."""
    out = []
    for slot in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(slot, num_samples)
        out.append(sample_order(num_samples, seed, epoch)[offset])
    return out


def collate(samples: list[Sample], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, L] and target mask [B, L-1] (target t+1 predicted at position t).

    Right padding needs no attention mask: under the causal mask real tokens never see pads."""
    length = max(len(s.token_ids) for s in samples)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), length), dtype=torch.bool)
    for row, s in enumerate(samples):
        ids[row, :len(s.token_ids)] = torch.tensor(s.token_ids)
        mask[row, :len(s.loss_mask)] = torch.tensor(s.loss_mask)
    return ids, mask[:, 1:]
