"""Chapter 4's diagrams show the scheduler's real functions and the admission rules' state."""

import matplotlib

matplotlib.use("Agg")

import pytest

from minillm.core import kv_cache_manager, scheduler
from minillm.lab.admission import PoolRequest, admitted_at_start
from minillm.lab.diagrams.scheduling import (
    admission_bookings,
    draw_admission,
    draw_scheduler_loop,
    loop_function_names,
    slot_timeline_figure,
)
from minillm.lab.schedule_sim import simulate_schedule


def _resolve(qualname: str):
    cls_name, method = qualname.split(".")
    for module in (scheduler, kv_cache_manager):
        if hasattr(module, cls_name):
            return getattr(getattr(module, cls_name), method)
    raise AttributeError(qualname)


@pytest.mark.parametrize("qualname", loop_function_names())
def test_every_function_the_flowchart_names_exists(qualname):
    assert callable(_resolve(qualname))


def test_the_flowchart_draws_each_function_once_in_loop_order():
    names = [label.split("\n")[0] for label in draw_scheduler_loop().labels()]
    expected = [n.removeprefix("Scheduler.") for n in loop_function_names()]
    assert names == expected
    assert names[:4] == [
        "schedule",
        "_schedule_running",
        "_allocate_or_preempt",
        "_schedule_waiting",
    ]


# prompts of 100, 150, 200, 120 and 300 tokens, max_tokens 400, in a pool of 1,500 slots
REQUESTS = [PoolRequest(str(i), p, 400, 10) for i, p in enumerate((100, 150, 200, 120, 300))]


def test_bookings_follow_each_rule_on_the_empty_pool():
    # vLLM: prompts only, 100 + 150 + 200 + 120 + 300 = 870 fit
    assert admission_bookings("vllm", REQUESTS, 1500) == [
        ("0", 100, 0),
        ("1", 150, 0),
        ("2", 200, 0),
        ("3", 120, 0),
        ("4", 300, 0),
    ]
    # TensorRT-LLM: 500 + 550 = 1,050, the next 600 would need 1,650
    assert admission_bookings("trtllm", REQUESTS, 1500) == [("0", 100, 400), ("1", 150, 400)]
    # SGLang books new requests in full too, and must stay strictly below the free slots
    assert admission_bookings("sglang", REQUESTS, 1500) == [("0", 100, 400), ("1", 150, 400)]


def test_sglang_one_step_later_counts_running_requests_at_the_forecast_ratio():
    later = admission_bookings("sglang", REQUESTS, 1500, one_step_later=True)
    # the first two hold prompt + 1 slots and 0.7 x 399 = 279 booked
    assert later[:2] == [("0", 101, 279), ("1", 151, 279)]
    # free 1,248 - booked 558 = 690 > 200 + 400: the third is admitted, not the fourth
    assert [r for r, _, _ in later] == ["0", "1", "2"]


def test_admission_rows_caption_what_the_rules_admit():
    rows = [("vllm", "vLLM", False), ("trtllm", "TensorRT-LLM", False)]
    labels = draw_admission(REQUESTS, 1500, rows).labels()
    assert labels == [
        "vLLM: 5 admitted, 870 slots held, 870 of 1,500 taken",
        "TensorRT-LLM: 2 admitted, 250 slots held, 1,050 of 1,500 taken",
    ]
    assert admitted_at_start("trtllm", REQUESTS, 1500) == 2
    smaller = draw_admission(REQUESTS, 1000, rows[1:]).labels()
    assert smaller == ["TensorRT-LLM: 1 admitted, 100 slots held, 500 of 1,000 taken"]


def test_slot_timeline_draws_one_panel_per_run_titled_with_its_steps():
    requests = [(3, 2), (5, 8), (4, 2), (4, 2)]
    runs = {
        kind: simulate_schedule(
            requests, max_num_seqs=2, max_num_batched_tokens=16, batching_type=kind
        ).traces
        for kind in ("static", "continuous")
    }
    fig = slot_timeline_figure(runs, 2)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [f"{k}: {len(t)} steps" for k, t in runs.items()]
    # static batching waits for request 1's 8 tokens before seating 2 and 3
    assert len(runs["static"]) > len(runs["continuous"])
