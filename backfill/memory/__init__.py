"""Memory mechanisms: KV paging (pager), elastic tensors and lent regions (AQUA), the shared pool of KV
handles several engines draw from (Valve §3, §5), in memory shared between processes, and their
device forms (CUDA IPC, CUDA virtual memory)."""
