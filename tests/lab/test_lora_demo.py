"""The live multi-LoRA demonstration of chapter 10: random adapters in PEFT's layout, and
one engine serving a batch that mixes them with the base model."""

import json
import pathlib

import pytest
import torch

from minillm.lab import lora_demo
from minillm.model.loader import load_model
from minillm.model.lora import load_lora_adapter


def test_random_weights_cover_the_named_layers_at_the_rank():
    model = load_model(lora_demo.BUNDLED, "float32").model
    weights = lora_demo.random_lora_weights(model, ("q_proj", "v_proj"), rank=4, seed=1)
    layers = model.config.num_hidden_layers
    assert len(weights) == 2 * layers
    for name, (a, b) in weights.items():
        module = model.get_submodule(name)
        assert a.shape == (4, module.in_features) and b.shape == (module.out_features, 4)
    again = lora_demo.random_lora_weights(model, ("q_proj", "v_proj"), rank=4, seed=1)
    other = lora_demo.random_lora_weights(model, ("q_proj", "v_proj"), rank=4, seed=2)
    name = next(iter(weights))
    assert torch.equal(weights[name][0], again[name][0])
    assert not torch.equal(weights[name][0], other[name][0])


def test_adapters_are_written_in_peft_layout_and_load(tmp_path):
    requests = lora_demo.write_random_adapters(tmp_path, names=("a", "b"), rank=4)
    assert [(r.lora_name, r.lora_int_id) for r in requests.values()] == [("a", 1), ("b", 2)]
    config = json.loads((pathlib.Path(requests["a"].lora_path) / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (
        4,
        8.0,
        ["q_proj", "v_proj"],
    )
    adapter = load_lora_adapter(requests["b"])
    assert adapter.rank == 4 and adapter.scaling == pytest.approx(2.0)


def test_a_mixed_batch_gives_each_prompt_its_adapters_tokens_in_fewer_steps(tmp_path):
    requests = lora_demo.write_random_adapters(tmp_path, rank=4)
    prompts = ["def add(a, b):", "import os\n", "class Stack:"]
    run = lora_demo.mixed_batch_run(
        requests, prompts, ["sql", None, "chat"], max_tokens=6, max_lora_rank=4
    )
    assert run.identical  # batching adapters together changes no token
    assert run.changed_by_adapter == 2  # each adapter changes its prompt's greedy tokens
    assert run.mixed_tokens[1] == run.base_tokens[1]  # the base-model row is the base model
    assert all(len(t) == 6 for t in run.mixed_tokens)
    # one batch of three groups against three batches one after the other
    assert run.mixed_steps < run.alone_steps


def test_mixed_batch_run_refuses_bad_input(tmp_path):
    requests = {"sql": None}
    with pytest.raises(ValueError, match="2 prompts but 1 adapters"):
        lora_demo.mixed_batch_run(requests, ["a", "b"], ["sql"])
    with pytest.raises(ValueError, match=r"adapters \['nope'\] are not among \['sql'\]"):
        lora_demo.mixed_batch_run(requests, ["a"], ["nope"])


def test_adapter_step_timing_runs_each_count_of_distinct_adapters_in_one_batch(tmp_path):
    requests = lora_demo.write_random_adapters(tmp_path, names=("a", "b", "c"), rank=4)
    times = lora_demo.time_adapter_steps(
        requests, distinct=(0, 1, 3), batch_size=4, decode_steps=2, rounds=2, max_lora_rank=4
    )
    # the engine grouped the rows of every timed step into exactly k adapters
    assert times.seen == {0: {0}, 1: {1}, 3: {3}}
    assert sorted(times.round_ms) == [0, 1, 3]
    assert all(len(r) == 2 and all(ms > 0 for ms in r) for r in times.round_ms.values())
    assert (times.batch_size, times.decode_steps) == (4, 2)


def test_adapter_step_statistics_are_the_rounds_median_spread_and_wins():
    times = lora_demo.AdapterStepTimes(
        8, 4, {1: [10.0, 12.0, 11.0, 13.0, 9.0], 8: [15.0, 11.0, 16.0, 20.0, 14.0]}, {}
    )
    assert times.median_ms(1) == 11.0 and times.median_ms(8) == 15.0
    assert times.spread(1) == pytest.approx((12.0 - 10.0) / 11.0)  # quartiles 10 and 12
    assert times.slower_rounds(8, than=1) == 4  # round 2: 11 against 12


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(distinct=(0, 4)), "must be in 0..3"),
        (dict(distinct=(1, 3), batch_size=2), "do not fit a batch of 2"),
        (dict(distinct=(0, 1), rounds=1), "rounds >= 2"),
    ],
)
def test_adapter_step_timing_refuses_impossible_configurations(tmp_path, kwargs, message):
    requests = {n: None for n in ("a", "b", "c")}  # refused before any is used
    with pytest.raises(ValueError, match=message):
        lora_demo.time_adapter_steps(requests, **kwargs)
