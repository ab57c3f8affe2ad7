"""LLM: synchronous generation for scripts and the CLI, on the same scheduler as serving."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

from backfill.sampling_params import SamplingParams
from backfill.types import FinishReason, GenerationRequest, RequestClass
from backfill.serving.config import ServingConfig
from backfill.serving.build import build_runner, build_scheduler
from backfill.serving.scheduler import Scheduler


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None


class LLM:
    def __init__(self, cfg: ServingConfig = ServingConfig(policy="fcfs"), loaded=None) -> None:
        from backfill.engine.weights import load_model

        self.loaded = loaded if loaded is not None else load_model(cfg.model)
        self.tokenizer = self.loaded.tokenizer
        self.config = cfg
        runner = build_runner(self.loaded.config, self.loaded.weights, cfg)
        self.scheduler: Scheduler = build_scheduler(runner, replace(cfg, policy="fcfs"), self.tokenizer,
                                                    self.loaded.config.name)

    def encode_prompt(self, prompt: str | list[int], chat: bool = True) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def stream(self, prompt: str | list[int], params: SamplingParams = SamplingParams(),
               chat: bool = True) -> Iterator[str]:
        """Yield text deltas as they are generated."""
        request = GenerationRequest(self.encode_prompt(prompt, chat), params, RequestClass.ONLINE)
        self.scheduler.add(request)
        done = False
        while not done:
            for event in self.scheduler.step():
                if event.request_id == request.request_id:
                    done = event.finished
                    if event.text:
                        yield event.text

    def generate(self, prompts: list[str | list[int]], params: SamplingParams = SamplingParams(),
                 chat: bool = True) -> list[Completion]:
        """Generate for all prompts in one continuous batch; results in prompt order."""
        requests = [GenerationRequest(self.encode_prompt(p, chat), params, RequestClass.OFFLINE) for p in prompts]
        for request in requests:
            self.scheduler.add(request)
        tokens = {r.request_id: [] for r in requests}
        texts = {r.request_id: [] for r in requests}
        reasons: dict[str, FinishReason | None] = {}
        while len(reasons) < len(requests):
            for event in self.scheduler.step():
                tokens[event.request_id].extend(event.token_ids)
                texts[event.request_id].append(event.text)
                if event.finished:
                    reasons[event.request_id] = event.finish_reason
        return [Completion(r.request_id, r.prompt_token_ids, tokens[r.request_id], "".join(texts[r.request_id]),
                           reasons[r.request_id]) for r in requests]
