"""Scheduling state: requests, the scheduler, the KV-cache manager, its block pool and prefix
caches. Block ids and token counts only; no tensors."""
