"""LoRA finetuning on harvested capacity (HARLI): jobs in scheduling units, co-located with decode."""
