"""AQUA (seeds/aqua.txt): elastic tensors, the offload coordinator, the producer/consumer profiler."""
