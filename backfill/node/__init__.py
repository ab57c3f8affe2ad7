"""Colocation on one device: the node runtime that owns the compute gate for several engines
(processes), and the client engines use to talk to it (Valve §3-§5). The shared KV pool they draw
from is a memory mechanism (backfill/memory/shared_pool.py)."""

from backfill.node.ipc import EngineState, NodeClient, PauseFlag
from backfill.node.runtime import NodeRuntime, RuntimeConfig
from backfill.node.suspend import ProcessSuspender, resume_all

__all__ = ["EngineState", "NodeClient", "NodeRuntime", "PauseFlag", "ProcessSuspender", "RuntimeConfig", "resume_all"]
