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


def _stop_and_expect_named(llm, rank: int, waiting: list[int] | None):
    processes = llm.engine.executor.processes
    llm.engine.executor.step_timeout_s = 2.0
    params = SamplingParams(temperature=0, max_tokens=4)
    assert len(llm.generate(["w3 w4"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    os.kill(processes[rank].pid, signal.SIGSTOP)
    try:
        with pytest.raises(WorkerError) as caught:
            llm.generate(["w3 w4 w5"], params, use_tqdm=False)
    finally:
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
    message = str(caught.value)
    assert f"rank {rank} did not finish the step within 2 s" in message
    assert "is not waiting on another rank" in message
    if waiting is not None:
        assert f"ranks {waiting} wait for it in a collective" in message
    assert not any(process.is_alive() for process in processes)


def test_a_stalled_tensor_parallel_rank_is_named_not_waited_for(tmp_path):
    model = save_checkpoint(build_hf_model("llama", hidden_size=32), tmp_path / "llama")
    # rank 0 waits in the step's first all-reduce for the stopped rank 1
    _stop_and_expect_named(LLM(model, tensor_parallel_size=2), 1, [0])


def test_a_stalled_decode_rank_is_named_not_waited_for(tmp_path):
    model = save_checkpoint(build_hf_model("llama", hidden_size=32), tmp_path / "llama")
    llm = LLM(model, kv_transfer_config={"kv_connector": "TorchDistributedConnector"})
    # a step without a KV transfer has no collective: nobody waits for rank 1, yet it is late
    _stop_and_expect_named(llm, 1, None)


def test_a_stalled_prefill_rank_is_named_not_waited_for(tmp_path):
    model = save_checkpoint(build_hf_model("llama", hidden_size=32), tmp_path / "llama")
    llm = LLM(model, kv_transfer_config={"kv_connector": "TorchDistributedConnector"})
    # the engine hands rank 0 its prompts without waiting, yet notices that none comes back
    _stop_and_expect_named(llm, 0, None)


@pytest.mark.parametrize(
    "options", [dict(pipeline_micro_batches=2), dict(pipeline_batches_in_flight=2)]
)
def test_a_stalled_first_pipeline_stage_is_named_not_waited_for(tmp_path, options):
    model = save_checkpoint(build_hf_model("llama", hidden_size=32), tmp_path / "llama")
    # the last stage waits for the stopped first stage's hidden states (a receive it posted
    # when the plan came)
    _stop_and_expect_named(LLM(model, pipeline_parallel_size=2, **options), 0, [1])


def test_a_stalled_last_pipeline_stage_is_named_not_waited_for(tmp_path):
    model = save_checkpoint(build_hf_model("llama", hidden_size=32), tmp_path / "llama")
    _stop_and_expect_named(
        LLM(model, pipeline_parallel_size=2, pipeline_batches_in_flight=2), 1, None
    )


def test_a_stalled_rank_prints_where_it_stands(tmp_path, monkeypatch, capfd):
    """A rank that hangs without waiting for the others (here: a step that never returns)
    prints the Python stack of its threads before the engine stops it."""
    import time

    from minillm.distributed.worker import Worker

    model = save_checkpoint(build_hf_model("llama", hidden_size=32), tmp_path / "llama")
    execute = Worker.execute_model

    def hang_in_rank_one(self, plan):
        if self.rank == 1 and plan.step >= 2:
            time.sleep(600)
        return execute(self, plan)

    monkeypatch.setattr(Worker, "execute_model", hang_in_rank_one)  # the forked ranks too
    llm = LLM(model, pipeline_parallel_size=2)
    llm.engine.executor.step_timeout_s = 2.0
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.raises(WorkerError, match="rank 1 did not finish the step within 2 s"):
        llm.generate(["w3 w4"], params, use_tqdm=False)
    assert "in hang_in_rank_one" in capfd.readouterr().err
    llm.shutdown()


def test_cpu_ranks_fork_and_gpu_ranks_spawn(monkeypatch):
    from minillm.distributed import executor

    assert executor.start_method("cuda") == "spawn"
    assert executor.start_method("cpu") == "fork"  # Linux, CUDA not initialized here
    monkeypatch.setattr("torch.cuda.is_initialized", lambda: True)
    assert executor.start_method("cpu") == "spawn"  # a forked child could not use CUDA


def test_spawn_failure_from_a_script_says_to_add_the_main_guard(monkeypatch, tmp_path):
    import sys
    import types

    from minillm.distributed import executor

    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "run.py")
    monkeypatch.setitem(sys.modules, "__main__", script)
    hint = executor.spawn_hint("spawn")
    assert 'if __name__ == "__main__":' in hint and "run.py" in hint
    assert executor.spawn_hint("fork") is None
    del script.__file__  # python -c: nothing to import again
    assert executor.spawn_hint("spawn") is None


@pytest.mark.parametrize("how", ["script", "-c"])
def test_tensor_parallel_from_a_script_without_a_main_guard(tmp_path, how):
    import subprocess
    import sys

    model = save_checkpoint(build_hf_model("llama", hidden_size=32), tmp_path / "llama")
    code = (
        "from minillm import LLM, SamplingParams\n"
        f"llm = LLM({str(model)!r}, tensor_parallel_size=2)\n"
        "out = llm.generate(['w3 w4'], SamplingParams(temperature=0, max_tokens=3))\n"
        "print('tokens', len(out[0].outputs[0].token_ids))\n"
    )
    script = tmp_path / "five_lines.py"
    script.write_text(code)
    command = [sys.executable, str(script)] if how == "script" else [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokens 3" in done.stdout
