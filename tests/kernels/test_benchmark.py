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
