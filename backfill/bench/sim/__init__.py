"""Simulation of the serving stack and of devices and fleets: the real scheduler and policies on a costed,
virtual-time runner (coserve), HARLI's SM-partitioned device, the node pool, the Valve fleet."""
