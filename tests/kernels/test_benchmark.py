"""minillm/lab/kernel_bench.py: what runs without a GPU (the device lookup, the goals, the
refusal), and the whole benchmark in its quick form on a GPU."""

import dataclasses
import json

import pytest
import torch

from minillm.lab.kernel_bench import (
    Measurement,
    device_slug,
    evaluate_goals,
    main,
    run,
    spec_for_cuda_name,
)


@pytest.mark.parametrize(
    ("cuda_name", "spec_name"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("Tesla T4", "T4"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        # variants with other bandwidths or clocks than the table's rows: measured instead
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA A100-SXM4-40GB", None),
        ("NVIDIA L40", None),
        ("NVIDIA GeForce RTX 3090", None),
    ],
)
def test_spec_for_cuda_name(cuda_name, spec_name):
    spec = spec_for_cuda_name(cuda_name)
    assert (spec.name if spec else None) == spec_name


def test_device_slug():
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"


def measurement(kernel, case, impl, time_ms, pct_of_bandwidth=0.0):
    return Measurement(kernel, case, impl, time_ms, 0, 0, 0.0, 0.0, pct_of_bandwidth, 0.0, 0.0)


def test_goals_from_measurements():
    goals = evaluate_goals(
        [
            measurement("decode", "64x4096", "triton paged, 1 split(s)", 1.0, 72.5),
            measurement("decode", "64x4096", "torch sdpa, contiguous KV", 1.0, 80.0),
            measurement("prefill", "4x2048 causal", "triton flash", 3.0),
            measurement("prefill", "4x2048 causal", "torch sdpa flash", 2.0),
            measurement("quant_matmul", "M=1 N=4096 K=4096", "triton w4a16", 0.01),
            measurement("quant_matmul", "M=1 N=4096 K=4096", "torch bf16 matmul", 0.02),
        ]
    )
    assert goals["decode_64x4096_pct_of_hbm"] == 72.5 and goals["decode_goal_met"]
    assert goals["prefill_time_over_sdpa_flash"] == {"4x2048 causal": 1.5}
    assert goals["prefill_goal_met"]
    assert goals["w4a16_batch1_speedup_over_bf16"] == {"M=1 N=4096 K=4096": 2.0}
    assert goals["w4a16_goal_met"]


def test_measurements_have_the_fields_chapter_5_shows():
    shown = {"kernel", "case", "impl", "time_ms", "gb_per_s", "tflop_per_s", "roofline_pct"}
    assert shown <= {field.name for field in dataclasses.fields(Measurement)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_without_cuda_it_says_so(capsys):
    assert main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_quick_benchmark_writes_its_results(tmp_path):
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("kernels_*.json")
    results = json.loads(path.read_text())
    assert results["versions"]["triton"] and results["measurements"]
    # what chapter 5 shows from a recorded file
    assert {"device", "dtype", "date", "versions", "goals", "measurements"} <= set(results)
    assert results["versions"]["torch"]
    assert {m["kernel"] for m in results["measurements"]} == {
        "rmsnorm",
        "rope",
        "prefill",
        "decode",
        "quant_matmul",
    }
    assert all(m["time_ms"] > 0 for m in results["measurements"])


def test_run_rejects_unknown_kernels_before_running_anything():
    with pytest.raises(ValueError, match=r"unknown kernels \['flash'\]"):
        run(quick=True, only=["decode", "flash"])


@pytest.mark.gpu
def test_run_only_some_kernels():
    results = run(quick=True, only=["decode"], graphs=False)
    assert {m["kernel"] for m in results["measurements"]} == {"decode"}
    assert results["decode_step_cuda_graphs"] == []


class UntimedBench:
    """Bench's interface without a GPU: runs each callable once, records a notional time."""

    def __init__(self) -> None:
        self.measurements = []

    def run(self, kernel, case, impl, fn, bytes_, flops):
        fn()
        m = measurement(kernel, case, impl, 1.0)
        self.measurements.append(m)
        return m


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the sweeps under the interpreter")
def test_the_sweeps_run_every_configuration_and_agree(monkeypatch):
    """Each sweep forces the launcher's configuration function, runs the launcher in every
    configuration and restores it; all configurations compute the same result."""
    from kernels import flash_attention, paged_decode, quant_matmul
    from minillm.lab import kernel_bench

    monkeypatch.setattr(kernel_bench, "DEVICE", "cpu")
    monkeypatch.setattr(kernel_bench, "DTYPE", torch.float32)
    monkeypatch.setattr(kernel_bench, "NUM_HEADS", 4)
    monkeypatch.setattr(kernel_bench, "NUM_KV_HEADS", 2)
    monkeypatch.setattr(kernel_bench, "HEAD_DIM", 32)
    saved = (flash_attention._launch_config, paged_decode._launch_config)
    saved += (quant_matmul._gemv_config, quant_matmul.choose_split_k)
    bench = UntimedBench()
    prefill = kernel_bench.sweep_prefill(bench, batch=1, seq_len=40)
    decode = kernel_bench.sweep_decode(bench, batch=2, context=40)
    gemv = kernel_bench.sweep_w4a16_gemv(bench, shapes=((40, 256),))
    assert (flash_attention._launch_config, paged_decode._launch_config) == saved[:2]
    assert (quant_matmul._gemv_config, quant_matmul.choose_split_k) == saved[2:]
    assert len(prefill) == 7 and [row["shipped"] for row in prefill].count(True) == 1
    assert len(decode) == 8 and len(gemv) >= 9
    assert {tuple(row["config"]) for row in decode} >= {(16, 4, 4), (128, 8, 3)}
    assert all(row["max_abs_diff"] < 1e-5 for row in prefill + decode)
    assert all(row["max_abs_err"] < 1e-4 for row in gemv)
    assert {row["plan"]["split_k"] for row in gemv} >= {1, 2, 4, 8}
    assert {row["plan"]["block_n"] for row in gemv} >= {32, 64, 128, 256}


@pytest.mark.skipif(torch.cuda.is_available(), reason="replaces the GPU parts with stand-ins")
def test_run_checkpoints_after_every_part_and_records_failures(monkeypatch):
    from minillm.lab import kernel_bench

    def works(bench, quick):
        bench.measurements.append(measurement("rope", "c", "triton", 1.0))

    def breaks(bench, quick):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(kernel_bench, "KERNEL_BENCHMARKS", {"rope": works, "decode": breaks})
    snapshots = []
    results = kernel_bench.run(
        quick=True, graphs=False, checkpoint=lambda r: snapshots.append(json.dumps(r))
    )
    assert [json.loads(s)["complete"] for s in snapshots] == [False, False, True]
    assert len(json.loads(snapshots[0])["measurements"]) == 1  # saved before decode broke
    assert results["errors"] == {"decode": "RuntimeError: out of resources"}
    assert results["spec"] == "H200 SXM" and results["measurements"][0]["kernel"] == "rope"


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the step under the interpreter")
def test_the_mixed_step_splits_the_batch_and_agrees_with_its_halves(monkeypatch):
    """The mixed-batch benchmark's batches, on a tiny model under the interpreter: the mixed
    batch really is mixed (decode rows beside a chunk), and each sequence's outputs in it
    match the same sequence's outputs in the decode-only and prefill-only batches."""
    from minillm.lab import kernel_bench
    from minillm.model.llama import LlamaForCausalLM
    from tests.model.quant_testing import tiny_config

    monkeypatch.setattr(kernel_bench, "DEVICE", "cpu")
    monkeypatch.setattr(kernel_bench, "DTYPE", torch.float32)
    torch.manual_seed(0)
    config = tiny_config()
    model = LlamaForCausalLM(config, "triton").eval()
    forwards = kernel_bench.mixed_step_forwards(model, decodes=3, context=40, chunk=20, prefix=16)
    (mixed, n_mixed), (decode, n_decode), (prefill, n_prefill) = forwards.values()
    assert (n_mixed, n_decode, n_prefill) == (23, 3, 20)
    both = mixed()
    assert both.shape[0] == 23
    torch.testing.assert_close(both[:3], decode(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[3:], prefill(), atol=1e-5, rtol=1e-5)
    assert both.abs().max() > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the cases under the interpreter")
def test_the_w4a16_decision_times_three_implementations_and_compares_them(monkeypatch):
    from minillm.lab import kernel_bench

    monkeypatch.setattr(kernel_bench, "DEVICE", "cpu")
    bench = UntimedBench()
    kernel_bench.w4a16_decision_case(bench, 1, 48, 256, "tiny")
    kernel_bench.w4a16_decision_case(bench, 16, 48, 256, "tiny")
    assert [m.impl for m in bench.measurements[:3]] == [
        "triton w4a16",
        "triton w4a16 zero points",
        "torch fp16 matmul",
    ]
    # the goal: the fp16 matmul's time over each W4A16 variant's, per shape
    bench.measurements[2].time_ms = 2.0  # M=1: fp16 twice as slow; M=16 ties (1.0)
    goals = kernel_bench.evaluate_goals(bench.measurements)
    speedups = goals["w4a16_speedup_over_fp16_by_shape"]
    assert speedups["tiny up M=1 N=48 K=256"] == {
        "triton w4a16": 2.0,
        "triton w4a16 zero points": 2.0,
    }
    assert goals["w4a16_faster_on_every_shape"] is False  # M=16 is a tie
