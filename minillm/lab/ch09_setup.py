"""The engine and helpers that both pages of chapter 9 (serving metrics) start from.

`ServingLab.build()` makes what each page's hidden setup cell needs: the bundled model in
float32 on the CPU with 4 seats (as in chapter 4), the TTFT of the first three requests of
that fresh engine (for the section on warm-up), and mu, the rate at which the engine
completes requests when 16 arrive at once. Every page measures mu on its own machine, so its
loads, stated as fractions of mu, are the same on any machine.

The load sweep runs every load several times. Its verdicts come from the medians of the
repeats, and the same rule applied to each repeat alone says how far to trust them:
`knee_verdict` and `peak_verdict` find the knee and the goodput peak both ways, and
`spread_words` and `agreement` put the repeats' range and agreement into the page's words.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from minillm import LLM, SamplingParams
from minillm.engine.llm_engine import LLMEngine
from minillm.lab import loadgen
from minillm.lab.open_loop import OpenLoopRun, TimedRequest, run_open_loop
from minillm.lab.serving_metrics import RequestTiming, knee_index


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


def spread_words(
    values: Sequence[float], scale: float = 1e3, digits: int = 0, unit: str = " ms"
) -> str:
    """The range of the repeats, as words to put after a median: "(repeats 12 to 15 ms)"."""
    low, high = min(values) * scale, max(values) * scale
    return f"(repeats {low:.{digits}f} to {high:.{digits}f}{unit})"


def agreement(count: int, total: int) -> str:
    """In how many of `total` repeats a verdict held, in words."""
    if not 0 <= count <= total:
        raise ValueError(f"a verdict holds in 0 to {total} repeats, not {count}")
    if count == total:
        return "in every repeat"
    if count == 0:
        return f"in none of the {total} repeats"
    return f"in {count} of {total} repeats"


@dataclass(frozen=True, slots=True)
class RepeatVerdict:
    """A load the sweep's verdict names (from the medians of the repeats), and the load the
    same rule names in each repeat alone."""

    value: float
    each: tuple[float, ...]

    @property
    def held(self) -> int:
        """The repeats that name the same load."""
        return sum(v == self.value for v in self.each)

    def agreement(self) -> str:
        return agreement(self.held, len(self.each))

    def each_words(self, unit: str = " μ") -> str:
        """Each repeat's load: "1.0 μ, 1.0 μ, 0.6 μ"."""
        return ", ".join(f"{v}{unit}" for v in self.each)


def _repeats(by_load: Mapping[float, Sequence[float]], loads: Sequence[float]) -> int:
    counts = {len(by_load[f]) for f in loads}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(f"every load needs the same number of repeats, got {sorted(counts)}")
    return counts.pop()


def knee_verdict(
    loads: Sequence[float], latency: Mapping[float, Sequence[float]], factor: float = 2.0
) -> RepeatVerdict:
    """The knee of a sweep (`knee_index`, loads in increasing order; `latency[f]` holds each
    repeat's latency at load f): on the medians of the repeats, and on each repeat alone."""
    repeats = _repeats(latency, loads)
    medians = [statistics.median(latency[f]) for f in loads]
    each = tuple(loads[knee_index([latency[f][r] for f in loads], factor)] for r in range(repeats))
    return RepeatVerdict(loads[knee_index(medians, factor)], each)


def peak_verdict(loads: Sequence[float], rate: Mapping[float, Sequence[float]]) -> RepeatVerdict:
    """Where a rate peaks (goodput; `rate[f]` holds each repeat's at load f): the load of the
    highest median, the lightest among equals, and each repeat's peak. A repeat that peaks at
    several loads names the sweep's, when it is one of them, else the lightest."""
    repeats = _repeats(rate, loads)
    best = max(loads, key=lambda f: statistics.median(rate[f]))  # max keeps the first of equals
    each = []
    for r in range(repeats):
        top = max(rate[f][r] for f in loads)
        peaks = [f for f in loads if rate[f][r] == top]
        each.append(best if best in peaks else peaks[0])
    return RepeatVerdict(best, tuple(each))
