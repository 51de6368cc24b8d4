"""The shared setup of chapter 9's pages: times re-based on the run's start, the sweep's
seeds, and a lab whose engine, warm-up record and mu come from real runs."""

from __future__ import annotations

import itertools
import math

import pytest

from minillm.core.metrics import RequestMetrics
from minillm.lab import ch09_setup
from minillm.lab.open_loop import OpenLoopRun
from minillm.lab.serving_metrics import RequestTiming


def test_timings_of_rebases_on_the_run_start():
    run = OpenLoopRun(
        start_time=100.0,
        end_time=101.0,
        metrics=[RequestMetrics(100.25, 100.3, [100.5, 100.75], 100.8)],
        queued_times=[100.25],
    )
    [timing] = ch09_setup.timings_of(run)
    assert timing == RequestTiming(0.25, 0.25, (0.5, 0.75), pytest.approx(0.8))
    assert timing.end_s == pytest.approx(0.8)
    assert run.metrics[0].token_times == [100.5, 100.75]  # the run is not changed


def test_fixed_length_is_greedy_and_ignores_eos():
    params = ch09_setup.fixed_length(7)
    assert (params.temperature, params.max_tokens, params.ignore_eos) == (0.0, 7, True)


def test_ms_formats_milliseconds():
    assert ch09_setup.ms(0.01234) == "12.3"
    assert ch09_setup.ms(1.5) == "1500.0"


def test_sweep_seeds_are_fresh_for_every_run():
    grid = itertools.product(
        range(ch09_setup.SWEEP_REPEATS), range(len(ch09_setup.SWEEP_FRACTIONS))
    )
    seeds = [ch09_setup.sweep_seed(r, i) for r, i in grid]
    assert len(set(seeds)) == len(seeds)
    assert ch09_setup.sweep_seed(0, 4) == 15  # the heaviest run of the first round


@pytest.fixture(scope="module")
def lab():
    return ch09_setup.ServingLab.build()


def test_lab_measures_mu_and_the_first_requests(lab):
    assert len(lab.first_ttft_s) == 3 and all(t > 0 for t in lab.first_ttft_s)
    assert math.isfinite(lab.mu) and lab.mu > 0
    assert lab.engine.scheduler.max_num_seqs == 4


def test_prompts_repeat_by_seed_and_differ_across_seeds(lab):
    a, again, other = lab.prompts(3, 32, 1), lab.prompts(3, 32, 1), lab.prompts(3, 32, 2)
    assert a == again and a != other and len(set(a)) == 3
    for text in a:
        assert len(lab.tokenizer.encode(text, add_special_tokens=False)) in range(30, 34)


def test_sweep_run_has_the_sweep_shape(lab):
    run = lab.sweep_run(math.inf, seed=3, n=4)
    assert len(run.metrics) == 4
    assert all(m.num_output_tokens == 8 for m in run.metrics)


def test_sweep_runs_default_to_the_sweep_size(lab):
    assert ch09_setup.SWEEP_REQUESTS >= 30  # the page states its medians rest on them
    run = lab.sweep_run(math.inf, seed=5)
    assert len(run.metrics) == ch09_setup.SWEEP_REQUESTS
