"""Colocation on one device: the node runtime that owns the compute gate and the shared memory
pool for several engines (processes), and the client engines use to talk to it (Valve §3-§5)."""

from backfill.node.ipc import EngineState, NodeClient, PauseFlag
from backfill.node.memory_pool import EngineRole, Invalidation, PoolConfig, SharedMemoryPool, StaticMemPool
from backfill.node.runtime import NodeRuntime, RuntimeConfig
from backfill.node.suspend import ProcessSuspender, resume_all

__all__ = [
    "EngineRole", "EngineState", "Invalidation", "NodeClient", "NodeRuntime", "PauseFlag", "PoolConfig",
    "ProcessSuspender", "RuntimeConfig", "SharedMemoryPool", "StaticMemPool", "resume_all",
]
