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


# the sweep's verdicts on hand-made sweeps: loads as fractions of mu, one value per repeat
LOADS = (0.3, 0.6, 1.0, 1.5, 2.5)


def sweep(*repeats):
    """{load: (repeat 0's value, repeat 1's, ...)} from each repeat's curve over LOADS."""
    return {f: tuple(curve[i] for curve in repeats) for i, f in enumerate(LOADS)}


def test_a_knee_every_repeat_puts_at_the_same_load():
    latency = sweep([10, 12, 15, 50, 90], [11, 13, 16, 60, 99], [10, 14, 18, 45, 80])
    verdict = ch09_setup.knee_verdict(LOADS, latency)
    assert verdict == ch09_setup.RepeatVerdict(1.0, (1.0, 1.0, 1.0))
    assert verdict.held == 3
    assert verdict.agreement() == "in every repeat"
    assert verdict.each_words() == "1.0 μ, 1.0 μ, 1.0 μ"


def test_a_knee_one_repeat_of_three_agrees_with():
    # medians 10, 12, 30, 60, 90: past 2 x 10 at 1.0, so the knee is 0.6; alone, the
    # repeats put it at 1.0, 0.3 and 0.6
    latency = sweep([10, 12, 15, 50, 90], [10, 25, 30, 60, 90], [10, 12, 30, 60, 90])
    verdict = ch09_setup.knee_verdict(LOADS, latency)
    assert verdict == ch09_setup.RepeatVerdict(0.6, (1.0, 0.3, 0.6))
    assert verdict.agreement() == "in 1 of 3 repeats"


def test_a_knee_no_repeat_agrees_with():
    # medians 10, 12, 12, 12, 50: the knee is 1.5; alone: 0.3, 0.6, and no knee (2.5)
    latency = sweep([10, 25, 12, 12, 50], [10, 12, 25, 12, 50], [10, 12, 12, 12, 15])
    verdict = ch09_setup.knee_verdict(LOADS, latency)
    assert verdict == ch09_setup.RepeatVerdict(1.5, (0.3, 0.6, 2.5))
    assert verdict.held == 0
    assert verdict.agreement() == "in none of the 3 repeats"


def test_a_knee_is_read_off_the_medians_not_the_means():
    # one wild repeat at 0.6 pulls the mean past 2 x 10 but not the median
    latency = sweep([10, 12, 15, 50, 90], [10, 12, 15, 50, 90], [10, 200, 15, 50, 90])
    assert ch09_setup.knee_verdict(LOADS, latency).value == 1.0


def test_a_goodput_peak_that_moves_between_repeats():
    goodput = sweep([0.3, 0.6, 0.5, 0.2, 0.1], [0.3, 0.5, 0.55, 0.2, 0.1], [0.3, 0.58, 0.4, 0.2, 0])
    verdict = ch09_setup.peak_verdict(LOADS, goodput)
    assert verdict == ch09_setup.RepeatVerdict(0.6, (0.6, 1.0, 0.6))
    assert verdict.agreement() == "in 2 of 3 repeats"
    assert verdict.each_words() == "0.6 μ, 1.0 μ, 0.6 μ"


def test_goodput_peaks_that_tie():
    # the medians tie at 0.6 and 1.0: the lighter load is the peak; a repeat tied at 0.6 and
    # 1.0 agrees with it, a repeat tied at 0.3 and 1.0 names its lightest peak
    goodput = sweep([0.3, 0.6, 0.6, 0.2, 0.1], [0.3, 0.6, 0.6, 0.2, 0.1], [0.7, 0.5, 0.7, 0.2, 0.1])
    verdict = ch09_setup.peak_verdict(LOADS, goodput)
    assert verdict == ch09_setup.RepeatVerdict(0.6, (0.6, 0.6, 0.3))
    assert verdict.agreement() == "in 2 of 3 repeats"
    # the peak of the medians at 1.0; a repeat tied at 0.6 and 1.0 holds it, though its
    # lightest peak is 0.6
    goodput = sweep([0.3, 0.5, 0.6, 0.2, 0.1], [0.3, 0.5, 0.6, 0.2, 0.1], [0.3, 0.7, 0.7, 0.2, 0.1])
    verdict = ch09_setup.peak_verdict(LOADS, goodput)
    assert verdict == ch09_setup.RepeatVerdict(1.0, (1.0, 1.0, 1.0))
    assert verdict.agreement() == "in every repeat"


def test_a_sweep_needs_the_same_repeats_at_every_load():
    with pytest.raises(ValueError, match="same number of repeats"):
        ch09_setup.knee_verdict((0.3, 0.6), {0.3: (1, 2), 0.6: (3,)})
    with pytest.raises(ValueError, match="same number of repeats"):
        ch09_setup.peak_verdict((0.3,), {0.3: ()})


def test_the_words_for_the_spread_and_the_agreement():
    assert ch09_setup.spread_words([0.0131, 0.012, 0.0149]) == "(repeats 12 to 15 ms)"
    assert ch09_setup.spread_words([0.51, 0.456], scale=1, digits=2, unit="") == (
        "(repeats 0.46 to 0.51)"
    )
    assert ch09_setup.agreement(3, 3) == "in every repeat"
    assert ch09_setup.agreement(1, 1) == "in every repeat"
    assert ch09_setup.agreement(0, 3) == "in none of the 3 repeats"
    assert ch09_setup.agreement(2, 5) == "in 2 of 5 repeats"
    with pytest.raises(ValueError):
        ch09_setup.agreement(4, 3)
