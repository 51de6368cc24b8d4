"""Bad input to a multi-process engine fails where it enters; a rank that dies stops them all."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest
from dist_testing import build_hf_model, save_checkpoint

from minillm import LLM, SamplingParams
from minillm.distributed.executor import WorkerError
from minillm.distributed.parallel_state import ParallelConfig
from minillm.engine.args import EngineArgs
from minillm.model.loader import load_model


def bundled_config():
    return load_model("minillm-stdlib-target", "float32", weights=False).config


def test_more_ranks_than_the_machine_allows():
    with pytest.raises(ValueError, match="allows at most"):
        EngineArgs(device="cpu", tensor_parallel_size=(os.cpu_count() or 1) + 1)
    with pytest.raises(ValueError, match="allows at most 1"):
        ParallelConfig(tensor_parallel_size=2).check_options(1, "cpu")


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (ParallelConfig(tensor_parallel_size=3), "num_attention_heads"),  # 8 heads
        (ParallelConfig(pipeline_parallel_size=7), "6 layers"),
    ],
)
def test_sizes_that_do_not_divide_the_model(parallel, message):
    with pytest.raises(ValueError, match=message):
        parallel.check_model(bundled_config())


def test_kv_heads_and_ranks_must_divide_one_another():
    config = dataclasses.replace(bundled_config(), num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ParallelConfig(tensor_parallel_size=2).check_model(config)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be an int >= 1"),
        (dict(pipeline_parallel_size=True), "pipeline_parallel_size must be an int >= 1"),
        (dict(tensor_parallel_size=2, pipeline_parallel_size=2), "cannot both be > 1"),
        (dict(pipeline_micro_batches=2), "only with pipeline_parallel_size > 1"),
        (dict(tensor_parallel_size=2, quantization="int8"), "quantization runs on one process"),
    ],
)
def test_bad_parallel_options(options, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(device="cpu", **options)


def test_a_rank_that_dies_stops_the_engine_and_the_other_ranks(tmp_path):
    model = save_checkpoint(build_hf_model("llama", hidden_size=32), tmp_path / "llama")
    llm = LLM(model, tensor_parallel_size=2)
    processes = llm.engine.executor.processes
    params = SamplingParams(temperature=0, max_tokens=4)
    assert len(llm.generate(["w3 w4 w5"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    os.kill(processes[1].pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match=f"rank 1 exited with code {-signal.SIGKILL}"):
        llm.generate(["w3 w4 w5"], params, use_tqdm=False)
    assert not any(process.is_alive() for process in processes)
    with pytest.raises(WorkerError, match="shut down"):
        llm.generate(["w3"], params, use_tqdm=False)
    llm.shutdown()  # a second shutdown is harmless
