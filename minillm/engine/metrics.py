"""Counters and gauges of the whole engine, updated after every step (vLLM's names).

Per-request timestamps and the latencies derived from them are in `minillm.core.metrics`;
the scheduler records them as requests move.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minillm.core.metrics import StepTrace


@dataclass(slots=True)
class EngineStats:
    """Counters and gauges of the engine, updated after every step (names follow vLLM's)."""

    num_steps: int = 0
    num_batched_tokens: list[int] = field(default_factory=list)  # tokens run in each step
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found there
    kv_cache_usage_perc: float = 0.0  # fraction of KV blocks in use, 0 to 1, as in vLLM
    num_running: int = 0
    num_waiting: int = 0
    trace: list[StepTrace] = field(default_factory=list)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens whose KV came from the prefix cache."""
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
