"""The engine and helpers that both pages of chapter 9 (serving metrics) start from.

`ServingLab.build()` makes what each page's hidden setup cell needs: the bundled model in
float32 on the CPU with 4 seats (as in chapter 4), the TTFT of the first three requests of
that fresh engine (for the section on warm-up), and mu, the rate at which the engine
completes requests when 16 arrive at once. Every page measures mu on its own machine, so its
loads, stated as fractions of mu, are the same on any machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minillm import LLM, SamplingParams
from minillm.engine.llm_engine import LLMEngine
from minillm.lab import loadgen
from minillm.lab.open_loop import OpenLoopRun, TimedRequest, run_open_loop
from minillm.lab.serving_metrics import RequestTiming


def fixed_length(n: int) -> SamplingParams:
    """Greedy, exactly n output tokens: ignore_eos fixes the length, as benchmarks do."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def timings_of(run: OpenLoopRun) -> list[RequestTiming]:
    """What the engine recorded of an open-loop run, as times since the run's start."""
    t0 = run.start_time
    return [
        RequestTiming(
            m.arrival_time - t0,
            m.arrival_time - t0,
            tuple(t - t0 for t in m.token_times),
            m.finished_time - t0,
        )
        for m in run.metrics
    ]


def ms(seconds: float) -> str:
    """Seconds as milliseconds with one decimal, for tables."""
    return f"{seconds * 1e3:.1f}"


@dataclass(slots=True)
class ServingLab:
    """The chapter's engine, its tokenizer, the warm-up record and mu (requests/s)."""

    llm: LLM
    first_ttft_s: list[float]  # TTFT of the first three requests of the fresh engine
    mu: float = math.nan

    @classmethod
    def build(cls) -> ServingLab:
        llm = LLM(dtype="float32", max_num_seqs=4, max_model_len=1024)
        first = [
            llm.generate("def fibonacci(n):", fixed_length(8), use_tqdm=False)[0].metrics.ttft_s
            for _ in range(3)
        ]
        lab = cls(llm, first)
        # mu: requests per second the engine completes when all arrive at once (chapter 4)
        burst = lab.sweep_run(math.inf, seed=10, n=16)
        lab.mu = len(burst.metrics) / burst.duration_s
        return lab

    @property
    def engine(self) -> LLMEngine:
        return self.llm.engine

    @property
    def tokenizer(self):
        return self.llm.get_tokenizer()

    def prompts(self, n: int, num_tokens: int, seed: int) -> list[str]:
        """n prompts of about num_tokens tokens of random words; a fresh seed gives fresh
        prompts, so no run finds another run's prompts in the prefix cache."""
        rng = np.random.default_rng(seed)
        return [loadgen.random_text(rng, num_tokens, self.tokenizer) for _ in range(n)]

    def sweep_run(self, rate_per_s: float, seed: int, n: int | None = None) -> OpenLoopRun:
        """An open-loop run of n requests (32-token prompts, 8 output tokens) at a Poisson
        rate (`math.inf`: all at once); n defaults to the sweep's SWEEP_REQUESTS."""
        n = SWEEP_REQUESTS if n is None else n
        arrivals = loadgen.arrival_times(n, rate_per_s, seed)
        requests = [
            TimedRequest(t, p, fixed_length(8))
            for t, p in zip(arrivals, self.prompts(n, 32, seed), strict=True)
        ]
        return run_open_loop(self.engine, requests)


# the load sweep of the page on metrics: offered loads as fractions of mu, closed-loop users,
# and how many interleaved rounds; the page on benchmarking states them in its report
SWEEP_FRACTIONS = (0.3, 0.6, 1.0, 1.5, 2.5)
CLOSED_CONCURRENCIES = (1, 2, 4, 8)
SWEEP_REPEATS = 3
# requests per open-loop run of the sweep. A run at fraction f of mu lasts about n / (f mu)
# (n / mu past mu), so a round costs about 8 n / mu seconds: 30 keeps the three rounds near
# a minute at the mu of a 2-core machine, and gives each p50 30 requests, each median of
# repeats 90 (a p99 would need several hundred: the sweep reports medians)
SWEEP_REQUESTS = 30


def sweep_seed(repeat: int, index: int) -> int:
    """The prompt and arrival seed of the sweep's open-loop run at SWEEP_FRACTIONS[index] in
    round `repeat`: fresh for every run, and the same on every page that repeats a run."""
    return 100 * repeat + index + 11
