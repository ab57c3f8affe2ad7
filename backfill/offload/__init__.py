"""AQUA (seeds/aqua.txt): the offload coordinator and its client, the producer side of memory lending."""
