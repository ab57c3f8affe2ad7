"""Memory mechanisms: the node's shared KV pool in memory shared between processes and its
device forms (CUDA IPC, CUDA virtual memory)."""
