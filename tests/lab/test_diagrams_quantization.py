"""Chapter 6's diagrams show the engine's formats and tensors: the labels they draw are read
back and compared with the objects they were drawn from."""

import matplotlib
import torch

from minillm.lab.diagrams import quantization as dq
from minillm.model.quantization import formats as F
from minillm.model.quantization.gptq import gptq_quantize
from minillm.model.quantization.linear import Int4Linear
from minillm.model.quantization.rtn import find_grid, int4_spec, rtn

matplotlib.use("Agg")


def small_int4_layer(seed: int = 0, n: int = 4, k: int = 16, group_size: int = 4) -> Int4Linear:
    g = torch.Generator().manual_seed(seed)
    q, s, z = rtn(torch.randn(n, k, generator=g), int4_spec(group_size))
    return Int4Linear(q, s, z, group_size, None, torch.float32)


def test_bit_layouts_draw_each_formats_fields():
    formats = [F.BFLOAT16, F.FLOAT16, F.FP8_E4M3, F.FP8_E5M2, F.FP4_E2M1, F.INT4]
    labels = dq.draw_bit_layouts(formats).labels()
    assert labels == [
        "s",
        "exponent 8",
        "mantissa 7",
        "s",
        "exponent 5",
        "mantissa 10",
        "s",
        "exponent 4",
        "m3",
        "s",
        "exponent 5",
        "m2",
        "s",
        "e2",
        "m",
        "code 4",
    ]
    # the field widths come from the format: a format with other bits draws other fields
    other = F.FloatFormat("e3m4", 3, 4, "ieee")
    assert dq.draw_bit_layouts([other]).labels() == ["s", "e3", "mantissa 4"]


def test_group_scales_are_the_layers_stored_scales_and_zeros():
    layer = small_int4_layer()
    labels = dq.draw_group_scales(layer).labels()
    g, n = layer.scales.shape  # [K / group_size, N]
    assert (g, n) == (4, 4)
    assert dq.scale_exponent(layer.scales) == 0  # scales of N(0, 1) weights need no exponent
    expected = []
    for gi in range(g):
        for row in range(n):
            expected += [f"{float(layer.scales[gi, row]):.3g}", str(int(layer.zeros()[row, gi]))]
    assert labels == expected
    assert dq.draw_group_scales(small_int4_layer(seed=1)).labels() != labels


def test_small_scales_are_drawn_in_a_power_of_ten():
    g = torch.Generator().manual_seed(0)
    q, s, z = rtn(0.01 * torch.randn(4, 16, generator=g), int4_spec(4))
    layer = Int4Linear(q, s, z, 4, None, torch.float32)
    e = dq.scale_exponent(layer.scales)
    assert e == -3
    labels = dq.draw_group_scales(layer).labels()
    assert labels[0] == f"{float(layer.scales[0, 0]) * 1000:.3g}"


def test_int4_packing_reads_the_packed_bytes():
    layer = small_int4_layer()
    labels = dq.draw_int4_packing(layer, num_bytes=4).labels()
    codes = layer.codes()[0, :8].tolist()
    assert labels[:8] == [f"k{j}: {q}" for j, q in enumerate(codes)]
    packed = layer.packed[0, :4].to(torch.int32).tolist()
    nibbles = labels[8:]
    for i, byte in enumerate(packed):
        assert nibbles[2 * i] == f"lo {byte & 0xF:X}"
        assert nibbles[2 * i + 1] == f"hi {byte >> 4:X}"
        # the nibble order the engine uses: low nibble even k, high nibble odd k
        assert (byte & 0xF, byte >> 4) == (codes[2 * i], codes[2 * i + 1])


def test_smoothquant_moves_range_from_activations_to_weights():
    x_amax = torch.tensor([1.5, 40.0, 0.8, 2.0])
    w_amax = torch.tensor([0.06, 0.05, 0.3, 0.2])
    labels = dq.draw_smoothquant(x_amax, w_amax, 0.5, [0, 1, 2, 3]).labels()
    s = (x_amax**0.5) / (w_amax**0.5)  # Xiao et al.'s formula at alpha = 0.5
    rows = [labels[i : i + 4] for i in range(0, 20, 4)]
    assert rows[2] == [f"{v:.3g}" for v in s.tolist()]
    assert rows[3] == [f"{v:.3g}" for v in (x_amax / s).tolist()]
    assert rows[4] == [f"{v:.3g}" for v in (w_amax * s).tolist()]
    assert rows[3] == rows[4]  # alpha = 0.5 gives both the same range per channel


def test_gptq_snapshots_follow_gptq_quantize():
    g = torch.Generator().manual_seed(0)
    mixing = torch.randn(6, 6, generator=g)
    x = torch.randn(256, 6, generator=g, dtype=torch.float64) @ mixing.double()
    hessian = 2 * x.T @ x / x.shape[0]
    w = torch.randn(4, 6, generator=g, dtype=torch.float64)
    spec = int4_spec(6)
    snapshots, codes = dq.gptq_snapshots(w, hessian, spec)
    s, z = find_grid(w, spec)
    assert torch.equal(codes, gptq_quantize(w, hessian, s, z, spec, block_size=6))
    assert [snap.column for snap in snapshots] == list(range(6))
    assert torch.equal(torch.stack([snap.codes for snap in snapshots], 1), codes)
    # the first column is rounded as it came; later ones have absorbed earlier errors
    assert torch.allclose(snapshots[0].weights, w)
    assert not torch.allclose(snapshots[3].weights[:, 3], w[:, 3])
    labels = dq.draw_gptq_step(w, snapshots, 2).labels()
    drawn = [labels[2 * (col * 4 + row) + 1] for col in range(6) for row in range(4)]
    assert drawn[:8] == [f"q={int(codes[row, col])}" for col in range(2) for row in range(4)]
    assert drawn[12:] == [
        f"{float(snapshots[2].weights[row, col]):.3g}" for col in range(3, 6) for row in range(4)
    ]


def test_kv_fp8_scales_are_the_backends_scales():
    from minillm import LLM, SamplingParams

    llm = LLM(
        "minillm-stdlib-target",
        kv_cache_dtype="fp8_e4m3",
        calculate_kv_scales=True,
        num_gpu_blocks=64,
    )
    llm.generate(["import os"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    runner = llm.engine.model_runner
    model = runner.model
    scales = dq.kv_fp8_layer_scales(model)
    assert all(k != 1.0 and v != 1.0 for k, v in scales)  # calibrated on the first forward
    labels = dq.draw_kv_fp8_scales(model, runner.kv_caches).labels()
    assert labels[0] == f"float8_e4m3fn · k_scale {scales[0][0]:.3g}"
    assert labels[1::2] == [f"float8_e4m3fn · v_scale {v:.3g}" for _, v in scales]
    model.model.layers[0].self_attn.backend.k_scale = 0.5
    assert dq.draw_kv_fp8_scales(model, runner.kv_caches).labels()[0].endswith("k_scale 0.5")


def test_w8a8_diagram_shows_the_layers_tensors():
    from minillm.model.quantization import W8A8Linear

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (6, 10), generator=g)
    plain = W8A8Linear(codes, torch.rand(6), None, torch.float32)
    labels = dq.draw_w8a8(plain, tokens=3).labels()
    assert "x [3, 10] bfloat16" in labels and "y [3, 6] bfloat16" in labels
    assert "qw [6, 10] int8" in labels and "sw [6] float32" in labels
    assert "acc [3, 6] int32" in labels and "qx [3, 10] int8" in labels
    assert "s folded before" in labels and "x / s (SmoothQuant)" not in labels
    smoothed = W8A8Linear(codes, torch.rand(6), None, torch.float32, torch.rand(10) + 1)
    assert "x / s (SmoothQuant)" in dq.draw_w8a8(smoothed, 5, torch.float32).labels()
