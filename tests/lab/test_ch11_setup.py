"""Chapter 11's stage timing: steps split into parts, a request's stages, the recorder that
wraps an engine and puts it back, and one traced request through a live in-process server."""

from __future__ import annotations

import httpx
import pytest

from minillm import LLM, SamplingParams
from minillm.core.metrics import RequestMetrics
from minillm.lab import ch11_setup, loadgen
from minillm.serve import run_server

CALLS = [
    ("schedule", 10.0, 10.5),
    ("execute", 10.5, 17.0),
    ("forward", 11.0, 15.0),
    ("sample", 15.5, 16.5),
    ("detokenize", 17.25, 17.5),
    ("step", 10.0, 18.0),
    ("forward", 20.0, 21.0),  # a later step's: not part of the one above
]


def test_split_step_takes_each_part_from_its_calls():
    step = ch11_setup.split_step(10.0, 18.0, CALLS)
    assert step.parts == {
        "schedule": 0.5,
        "prepare inputs": 0.5,  # execute's start to forward's start
        "forward": 4.0,
        "logits": 0.5,  # forward's end to sample's start
        "sample": 1.0,
        "detokenize": 0.25,
        "other": 1.25,  # the rest of the 8 s step
    }
    assert sum(step.parts.values()) == 8.0


def test_split_step_of_a_step_without_a_forward_is_all_other_but_scheduling():
    step = ch11_setup.split_step(30.0, 31.0, [("schedule", 30.0, 30.25), ("step", 30.0, 31.0)])
    assert step.parts["schedule"] == 0.25 and step.parts["forward"] == 0.0
    assert step.parts["prepare inputs"] == 0.0 and step.parts["other"] == 0.75


def trace() -> ch11_setup.RequestTrace:
    metrics = RequestMetrics(1.0, 1.5, [3.0, 4.0, 5.0], 5.0)
    return ch11_setup.RequestTrace(0.25, [3.25, 4.25, 5.5], 6.0, metrics)


def test_stages_are_differences_of_the_timestamps_and_add_up_to_the_total():
    stages = trace().stages()
    assert stages == {
        "HTTP in, parse, tokenize": 0.75,
        "queue": 0.5,
        "prefill step": 1.5,
        "first token to client": 0.25,
        "decode steps": 1.75,
        "last token to client": 1.0,
    }
    assert sum(stages.values()) == trace().total_s == 5.75


def test_median_and_spread_and_the_median_trace():
    assert ch11_setup.median_and_spread([3.0, 1.0, 2.0, 10.0]) == (2.5, 1.0, 10.0)
    traces = [trace() for _ in range(4)]
    for t, done in zip(traces, (9.0, 6.0, 7.0, 8.0), strict=True):
        t.client_done = done
    assert ch11_setup.median_trace(traces).client_done == 7.0  # the lower middle of 4
    table = ch11_setup.stage_table(traces)
    assert table["queue"] == (0.5, 0.5, 0.5)
    assert table["last token to client"] == (2.5, 1.0, 4.0)


def test_interleaved_runs_the_kinds_in_turn():
    order = []
    traces = ch11_setup.interleaved(2, ["a", "b"], lambda kind: order.append(kind) or kind)
    assert order == ["a", "b", "a", "b"]
    assert traces == {"a": ["a", "a"], "b": ["b", "b"]}


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_num_seqs=2, max_model_len=256)


def test_a_traced_request_matches_the_engine_and_the_recorder_leaves_no_trace(llm):
    engine = llm.engine
    prompt, n = "def add(a, b):", 5
    want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    with run_server(llm) as server, httpx.Client() as client:
        model = loadgen.server_model(server.url)
        with ch11_setup.StageRecorder(engine) as recorder:
            assert "step" in vars(engine) and "schedule" in vars(engine.scheduler)
            t = ch11_setup.traced_request(client, server.url, model, recorder, prompt, n)
    assert "step" not in vars(engine) and "schedule" not in vars(engine.scheduler)
    assert "forward" not in vars(engine.runner)
    assert t.text == want[0].outputs[0].text
    assert t.metrics.num_output_tokens == n == len(t.steps)  # one step per token
    stages = t.stages()
    assert all(v >= 0 for v in stages.values()), stages
    assert sum(stages.values()) == pytest.approx(t.total_s)
    for step in t.steps:
        assert step.parts["forward"] > 0 and step.parts["sample"] > 0
        assert sum(step.parts.values()) == pytest.approx(step.end - step.start)
    assert t.steps[0].start <= t.metrics.first_scheduled_time <= t.steps[0].end
