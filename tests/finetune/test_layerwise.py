"""The layer-wise backward (HARLI §6.1) equals one ordinary loss.backward()."""

from __future__ import annotations

import pytest
import torch

from backfill.finetune.config import FinetuneConfig
from backfill.finetune.data import collate, load_training_file
from backfill.finetune.layerwise import embed, full_loss, head_loss_sum, layer_forward, target_slices
from backfill.finetune.lora import TrainableLoraAdapter
from tests.finetune.helpers import TOKENIZER, tiny_model, write_chat_file

# fp32 throughout; the two paths sum the same products in different orders (the layer-wise one
# recomputes each layer), so they agree to rounding: relative 1e-5 of the largest gradient.
RTOL = 1e-5


def _adapter(model, **kw):
    config = FinetuneConfig(rank=4, alpha=8, **kw)
    adapter = TrainableLoraAdapter(config, TrainableLoraAdapter.shapes_for(model.config), model.config.num_layers,
                          torch.Generator().manual_seed(0))
    with torch.no_grad():  # B = 0 at init would make every A gradient zero: test a trained-looking adapter
        for _, b in adapter.params.values():
            b.normal_(0, 0.05)
    return adapter


@pytest.mark.parametrize("packed", [True, False], ids=["onednn-packed", "plain"])
def test_layerwise_gradients_equal_autograd(tmp_path, packed):
    model = tiny_model(packed=packed)
    samples = load_training_file(write_chat_file(tmp_path / "t.jsonl", 4), TOKENIZER, 128)
    adapter = _adapter(model)
    ids, mask = collate(samples)
    n = int(mask.sum())
    full_loss(model, adapter, ids, mask, n).backward()
    expected = [p.grad.clone() for p in adapter.parameters()]
    for p in adapter.parameters():
        p.grad = None
    # layer-wise, two micro-batches of two, explicit output gradients
    for start in (0, 2):
        mb_ids, mb_mask = collate(samples[start:start + 2])
        saved = [embed(model, mb_ids)]
        with torch.no_grad():
            for li in range(model.config.num_layers):
                saved.append(layer_forward(model, adapter, li, saved[-1]))
        top = saved.pop().requires_grad_()
        slices = target_slices(mb_mask, 5)  # the head in slices of 5 targets, as the job's units run it
        assert len(slices) > 1 and sum(int(m.sum()) for m in slices) == int(mb_mask.sum())
        for part in slices:
            (head_loss_sum(model, top, mb_ids, part) / n).backward()
        grad = top.grad
        for li in reversed(range(model.config.num_layers)):
            x = saved.pop().requires_grad_()
            torch.autograd.backward(layer_forward(model, adapter, li, x), grad)
            grad = x.grad
    for p, want in zip(adapter.parameters(), expected):
        scale = want.abs().max().item()
        assert scale > 0
        assert (p.grad - want).abs().max().item() <= RTOL * scale + 1e-12
