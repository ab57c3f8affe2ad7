"""Simulation of the serving stack: the real scheduler and policies on a costed, virtual-time runner."""
