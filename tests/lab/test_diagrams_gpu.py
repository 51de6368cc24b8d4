"""Chapter 5's diagrams carry the specs', the trace's and the kernels' numbers."""

import matplotlib

matplotlib.use("Agg")

import math

import pytest
import torch

from kernels import device as kdevice
from minillm.lab.diagrams.gpu import (
    cuda_graph_timeline,
    draw_cuda_graph,
    draw_flash_tiling,
    draw_fusion,
    draw_gpu_anatomy,
    draw_sm_fill,
    draw_split_kv,
    split_partials,
    split_ranges,
    tile_states,
)
from minillm.lab.hardware import get_device
from minillm.lab.op_trace import OpRecord


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        ("H100 SXM", ["132 SMs", "HBM3: 80 GiB at 3.35 TB/s", "shared memory / L1: 228 KiB"]),
        ("H200 SXM", ["132 SMs", "HBM3e: 141 GiB at 4.80 TB/s"]),
        ("A100 SXM 80GB", ["108 SMs", "shared memory / L1: 164 KiB"]),
    ],
)
def test_gpu_anatomy_labels_come_from_the_specs(gpu, expected):
    spec = get_device(gpu)
    arch = kdevice.ARCH_LIMITS[kdevice.DEVICE_COMPUTE_CAPABILITY[gpu]]
    labels = [line for label in draw_gpu_anatomy(spec, arch).labels() for line in label.split("\n")]
    for text in expected:
        assert any(line.startswith(text) for line in labels), (text, labels)
    assert f"up to {arch.max_warps_per_sm} resident warps of 32 threads" in labels


def test_fusion_draws_one_box_per_traced_operation_with_its_megabytes():
    ops = [
        OpRecord("add.Tensor", 4_000_000, 2_000_000),
        OpRecord("_to_copy.default", 2_000_000, 4_000_000),
        OpRecord("mul.Tensor", 4_000_000, 4_000_000),
    ]
    labels = draw_fusion(ops, 6_000_000).labels()
    assert labels[0] == "eager: 3 kernels, 20 MB through HBM"
    assert [x for x in labels if "\nr " in x] == [
        "add\nr 4\nw 2",
        "to_copy\nr 2\nw 4",
        "mul\nr 4\nw 4",
    ]
    assert "fused: 1 kernel, 6 MB through HBM (3.3x less)" in labels


def _oracle_state(q_block, k_block, bm, bn, n):
    """Causal: query t sees keys 0..t. A tile needs no mask iff every key <= every query."""
    queries = range(q_block * bm, min((q_block + 1) * bm, n))
    keys = range(k_block * bn, min((k_block + 1) * bn, n))
    visible = [k <= q for q in queries for k in keys]
    return "full" if all(visible) else "skipped" if not any(visible) else "diagonal"


@pytest.mark.parametrize(("n", "bm", "bn"), [(1024, 128, 64), (300, 64, 32), (100, 32, 32)])
def test_flash_tiles_match_the_causal_mask(n, bm, bn):
    states = tile_states(n, n, bm, bn)
    assert len(states) == math.ceil(n / bm) and len(states[0]) == math.ceil(n / bn)
    for i, row in enumerate(states):
        for j, state in enumerate(row):
            assert state == _oracle_state(i, j, bm, bn, n)


def test_flash_tiling_counts_and_programs_on_the_picture():
    labels = draw_flash_tiling(1024, 128, 64).labels()
    assert "program 7: queries\n896-1023" in labels
    assert "computed, no mask: 56" in labels
    assert "on the diagonal, masked: 16" in labels
    assert "skipped (causal): 56" in labels


def test_split_ranges_follow_the_kernel_and_cover_the_context():
    assert split_ranges(1000, 4, 64) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    # 100 keys in 4 splits of 64: the last two are empty
    assert split_ranges(100, 4, 64) == [(0, 64), (64, 100), (100, 100), (100, 100)]


def test_the_merge_of_the_partials_is_exact_attention():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(16, generator=g, dtype=torch.float64)
    k = torch.randn(100, 16, generator=g, dtype=torch.float64)
    v = torch.randn(100, 16, generator=g, dtype=torch.float64)
    _, lse, weights, merged = split_partials(q, k, v, split_ranges(100, 4, 32), 0.25)
    exact = torch.softmax((k @ q) * 0.25, 0) @ v
    assert torch.allclose(merged, exact, atol=1e-12)
    assert math.isclose(weights.sum().item(), 1.0)
    assert torch.allclose(torch.logsumexp(lse, 0), torch.logsumexp((k @ q) * 0.25, 0))


def test_split_kv_picture_shows_ranges_and_weights_that_sum_to_one():
    labels = draw_split_kv(1000, 4, 64).labels()
    assert [x for x in labels if x.startswith("keys")] == [
        "keys 0-255",
        "keys 256-511",
        "keys 512-767",
        "keys 768-999",
    ]
    weights = [float(x.rsplit("= ", 1)[1]) for x in labels if x.startswith("program")]
    assert len(weights) == 4 and abs(sum(weights) - 1) < 0.02


def test_sm_fill_counts_the_busy_sms():
    labels = draw_sm_fill([8, 264], ["no split", "33 splits"], 132).labels()
    assert labels == [
        "no split\n8 programs: 8 of 132 SMs busy",
        "33 splits\n264 programs: 132 of 132 SMs busy",
    ]


def test_cuda_graph_timeline_eager_waits_on_launches_graph_runs_back_to_back():
    t = cuda_graph_timeline(4, launch_us=5, kernel_us=2, graph_launch_us=8)
    assert t["eager"]["gpu"] == [(5, 7), (10, 12), (15, 17), (20, 22)]
    assert t["graph"]["gpu"] == [(8, 10), (10, 12), (12, 14), (14, 16)]
    # kernels longer than a launch: the GPU, not the CPU, sets the pace
    slow = cuda_graph_timeline(3, launch_us=1, kernel_us=4, graph_launch_us=8)
    assert slow["eager"]["gpu"] == [(1, 5), (5, 9), (9, 13)]
    labels = draw_cuda_graph(4, 5, 2, 8).labels()
    assert labels == [
        "eager: 4 launches, step done at 22 µs, GPU busy 8 of them",
        "graph: 1 launch, step done at 16 µs, GPU busy 8 of them",
    ]


def test_cascade_draws_the_prefix_once_per_request_without_and_once_with():
    from minillm.lab.diagrams.gpu import draw_cascade

    suffixes = [3, 40, 1]
    c = draw_cascade(suffixes, 512)
    # boxes: left panel a prefix and a suffix per request; right panel a suffix per request
    # and one shared prefix
    assert len(c.boxes) == 2 * len(suffixes) + len(suffixes) + 1
    assert c.labels() == ["shared prefix:\none pass, all queries"]
    widths = [b[2] for b in c.boxes]
    # to scale in tokens (a suffix too short to see is drawn 0.2 units wide)
    unit = widths[0] / 512
    assert widths[3] == pytest.approx(40 * unit) and widths[-1] == pytest.approx(512 * unit)
    assert widths[1] == widths[5] == 0.2
    with pytest.raises(ValueError, match="suffix"):
        draw_cascade([], 512)
