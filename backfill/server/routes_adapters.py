"""Loading and unloading LoRA adapters at run time, with vLLM's endpoints and bodies.

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}   (a PEFT directory)
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

A loaded adapter is a model: /v1/models lists it and a completion naming it as its model runs
with it, batched with requests of the base model and of other adapters (engine/lora.py).
Fine-tuned models (`<base>:ft-<job id>`) are loaded the same way by the fine-tuning worker.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from backfill.errors import AdapterLoadError
from backfill.server.errors import bad_request, not_found
from backfill.server.http_helpers import json_body_openapi, read_json
from backfill.server.schemas import StrictBody, validate_body
from backfill.server.state import ServerState


class LoadAdapterBody(StrictBody):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)


class UnloadAdapterBody(StrictBody):
    lora_name: str = Field(min_length=1)


def add_adapter_routes(v1: APIRouter, state: ServerState) -> None:
    engine = state.engine
    base_models = (state.served_model, engine.model_name)

    @v1.post("/load_lora_adapter", openapi_extra=json_body_openapi(LoadAdapterBody))
    async def load_adapter(request: Request) -> PlainTextResponse:
        body = validate_body(LoadAdapterBody, await read_json(request, state.limit_bytes,
                                                  state.config.body_timeout_s))
        if body.lora_name in base_models:
            raise bad_request(f"{body.lora_name!r} is the base model's name", param="lora_name")
        try:
            await engine.call_between_steps(lambda: engine.adapters.load(body.lora_name, body.lora_path))
        except AdapterLoadError as exc:
            raise bad_request(str(exc), param="lora_path", code="invalid_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @v1.post("/unload_lora_adapter", openapi_extra=json_body_openapi(UnloadAdapterBody))
    async def unload_adapter(request: Request) -> PlainTextResponse:
        body = validate_body(UnloadAdapterBody, await read_json(request, state.limit_bytes,
                                                  state.config.body_timeout_s))
        if body.lora_name not in engine.adapters:
            raise not_found(f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name",
                            code="adapter_not_found")
        engine.adapters.unload(body.lora_name)  # requests already holding it run to their end
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
