"""GET /v1/models and /v1/models/{id}: the served model and its loaded LoRA adapters."""

from __future__ import annotations

from fastapi import APIRouter

from backfill.server.errors import not_found
from backfill.server.state import ServerState


def add_model_routes(v1: APIRouter, state: ServerState) -> None:
    engine, served_model = state.engine, state.served_model

    def model_card(model_id: str = served_model) -> dict:
        card = {"id": model_id, "object": "model", "created": state.started_at, "owned_by": "backfill",
                "max_model_len": engine.max_model_len}
        if model_id != served_model:  # a LoRA adapter (a fine-tuned model) on the base model, as vLLM lists them
            card.update(root=model_id, parent=served_model)
        return card

    @v1.get("/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(), *(model_card(name) for name in engine.adapters.names())]}

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        if model_id != served_model and model_id not in engine.adapters:
            raise not_found(f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return model_card(model_id)
