"""What serving LoRA adapters costs a step, and that base-only steps cost what they did before.

On the real model, interleaved in one process (a shared machine drifts): decode steps of B
sequences and one prefill, each (a) through main's model.py (the code before LoRA, loaded from
git), (b) base-only through today's model.py, (c) every sequence with one rank-r adapter on all
seven projections, (d) half the sequences on each of two adapters, half on none. Prints medians
and ratios to (a); writes JSON with --json.

    .venv/bin/python scripts/lora_step_cost.py [--batch 8] [--rank 8] [--rounds 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from backfill.engine.kv_pool import KVBlockPool
from backfill.engine.model import LlamaModel
from backfill.engine.runner import ModelRunner
from backfill.engine.step import SeqChunk
from backfill.engine.weights import load_model


def old_model_class(ref: str):
    """LlamaModel as it is at git ref (main: before the LoRA hooks)."""
    source = subprocess.run(["git", "show", f"{ref}:backfill/engine/model.py"], capture_output=True, text=True,
                            check=True).stdout
    path = Path(tempfile.mkdtemp()) / "model_before_lora.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("model_before_lora", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.LlamaModel


def write_adapter(directory: Path, config, rank: int, seed: int) -> None:
    """A PEFT-format adapter with random A and B on all seven projections."""
    from safetensors.torch import save_file

    from backfill.engine.lora import site_parts

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for parts in site_parts(config).values():
            for module, n_in, n_out in parts:
                group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{group}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=generator) * 0.01
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "bias": "none"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prefill", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--ref", default="main")
    parser.add_argument("--json")
    args = parser.parse_args()
    loaded = load_model(None)
    cfg = loaded.config
    runners = {"before": ModelRunner(old_model_class(args.ref)(cfg, loaded.weights), KVBlockPool(cfg, 256, 16)),
               "now": ModelRunner(LlamaModel(cfg, loaded.weights), KVBlockPool(cfg, 256, 16))}
    now = runners["now"]
    root = Path(tempfile.mkdtemp())
    adapters = []
    for i in range(2):
        write_adapter(root / f"a{i}", cfg, args.rank, i)
        adapters.append(now.adapters.load(f"a{i}", root / f"a{i}"))
    modes = {"before": ("before", [None] * args.batch), "base-only": ("now", [None] * args.batch),
             "one adapter": ("now", [adapters[0]] * args.batch),
             "mixed": ("now", [adapters[i % 2] if i % 4 < 2 else None for i in range(args.batch)])}
    context = 64
    prompts = [torch.randint(3, cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(args.batch)]
    tables = {name: [r.kv.allocate(r.kv.blocks_needed(context + 1)) for _ in range(args.batch)]
              for name, r in runners.items()}
    prefill_tables = {name: r.kv.allocate(r.kv.blocks_needed(args.prefill)) for name, r in runners.items()}
    for name, runner in runners.items():
        for i, table in enumerate(tables[name]):
            runner.execute([SeqChunk(i, prompts[i], 0, table, want_logits=False)])
    times: dict[str, dict[str, list[float]]] = {mode: {"decode": [], "prefill": []} for mode in modes}
    prefill_ids = list(range(3, 3 + args.prefill))
    for _ in range(args.rounds):
        for mode, (which, per_seq) in modes.items():
            runner = runners[which]
            chunks = [SeqChunk(i, [7], context, tables[which][i], adapter=per_seq[i]) for i in range(args.batch)]
            started = time.perf_counter()
            runner.execute(chunks)
            times[mode]["decode"].append((time.perf_counter() - started) * 1e3)
            started = time.perf_counter()
            runner.execute([SeqChunk("p", prefill_ids, 0, prefill_tables[which], adapter=per_seq[0])])
            times[mode]["prefill"].append((time.perf_counter() - started) * 1e3)
    result = {"batch": args.batch, "rank": args.rank, "prefill_tokens": args.prefill, "rounds": args.rounds,
              "threads": torch.get_num_threads(), "median_ms": {}, "ratio_to_before": {}}
    print(f"decode of {args.batch} (context {context}) and a {args.prefill}-token prefill, rank {args.rank}, "
          f"{args.rounds} interleaved rounds, medians:")
    for mode in modes:
        medians = {kind: statistics.median(values) for kind, values in times[mode].items()}
        ratios = {kind: medians[kind] / statistics.median(times["before"][kind]) for kind in medians}
        result["median_ms"][mode], result["ratio_to_before"][mode] = medians, ratios
        print(f"  {mode:<12} decode {medians['decode']:7.2f} ms ({ratios['decode']:.3f}x)   "
              f"prefill {medians['prefill']:7.2f} ms ({ratios['prefill']:.3f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
