"""Counters and gauges of the whole engine, updated after every step (vLLM's names).

Per-request timestamps and the latencies derived from them are in `minillm.core.metrics`;
the scheduler records them as requests move.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minillm.core.kv_cache_manager import KVCacheManager
from minillm.core.metrics import StepTrace
from minillm.core.scheduler import Scheduler, SchedulerOutput


@dataclass(slots=True)
class EngineStats:
    """Counters and gauges of the engine, updated after every step (names follow vLLM's).

    The per-step records (`num_batched_tokens`, `trace`) keep the last `window` to 2 * `window`
    steps, so that a long-running engine's memory does not grow with the number of steps.
    """

    window: int = 1024
    num_steps: int = 0
    num_batched_tokens: list[int] = field(default_factory=list)  # tokens run in recent steps
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found there
    kv_cache_usage_perc: float = 0.0  # fraction of KV blocks in use, 0 to 1, as in vLLM
    num_running: int = 0
    num_waiting: int = 0
    trace: list[StepTrace] = field(default_factory=list)  # what recent steps did

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens whose KV came from the prefix cache."""
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    def record_step(self, plan: SchedulerOutput, scheduler: Scheduler, kv: KVCacheManager) -> None:
        """Read the counters after a step from where they are kept (the scheduler, the
        KV-cache manager); append the step to the bounded records."""
        self.num_steps = scheduler.num_steps
        self.num_preemptions = scheduler.num_preemptions
        self.prefix_cache_queries = kv.prefix_cache_stats.num_queried_tokens
        self.prefix_cache_hits = kv.prefix_cache_stats.num_hit_tokens
        self.kv_cache_usage_perc = kv.usage
        self.num_running = len(scheduler.running)
        self.num_waiting = len(scheduler.waiting)
        self.num_batched_tokens.append(plan.num_batched_tokens)
        self.trace.append(plan.trace())
        for records in (self.num_batched_tokens, self.trace):
            if len(records) > 2 * self.window:  # trimmed in batches: amortized O(1) a step
                del records[: len(records) - self.window]
