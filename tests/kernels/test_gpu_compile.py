"""What the compiler makes of every kernel for Hopper (sm_90), Ada (sm_89) and Turing (sm_75,
Colab's T4, the smallest shared memory of the targets), checked without a GPU: each
kernel is compiled ahead of time (minillm.lab.aot) the way the JIT compiles it at its first
launch there, with its launcher's configuration, in a process where the kernels are not
interpreted. The checks read the compiled kernel: shared memory against the architecture's
limit, registers and spills from the cubin, cp.async copies (software pipelining) and
load widths from the PTX, and the tensor-core instruction the dots became."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.flash_attention import tile_shared_bytes

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
NUM_CASES = 13  # per dtype, at one head_dim: minillm.lab.aot.cases ...
W8A8_CASES = 2  # ... and the W8A8 kernel's, from sm_80 on
# Turing has no tensor-core dots in Triton: its W4A16 kernel's FMA dots over a whole group
# of 128 spill registers (slow, still correct); every other kernel spills at most this
MAX_SPILL_BYTES = 256


def compile_ahead(*args: str) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-m", "minillm.lab.aot", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, dtypes",
    # Hopper and Ada in bfloat16; Turing (Colab's T4) has no bfloat16, and 64 KiB per program
    [(90, ["bf16", "fp32"]), (89, ["bf16", "fp32"]), (75, ["fp16", "fp32"])],
)
def test_kernels_compile_for_the_gpu(arch, dtypes):
    rows = compile_ahead(str(arch), "--dtypes", *dtypes)
    assert len(rows) == len(dtypes) * (NUM_CASES + (W8A8_CASES if arch >= 80 else 0))
    failed = [row for row in rows if not row["ok"] or row["shared_bytes"] > row["limit"]]
    assert not failed, failed
    for row in rows:
        name = f"{row['kernel']} {row['dtype']} sm_{arch}"
        assert row["registers"] <= 255 and row["programs_per_sm"] >= 1, name
        # Ada's W4A16 prefill tile (128 x 128 at 2 stages, every register taken) spills
        # 288 bytes since the zero points are loaded beside the codes; Hopper spills none
        ada_w4_prefill = arch == 89 and row["kernel"] == "w4a16 M=4096"
        if not (arch == 75 and row["kernel"].startswith("w4a16 ")):
            limit = 320 if ada_w4_prefill else MAX_SPILL_BYTES
            assert row["spill_bytes"] <= limit, (name, row["spill_bytes"])
        if arch >= 80 and row["num_stages"] > 1:  # a pipeline is asynchronous copies
            assert row["cp_async"] > 0, name
        # tensor cores for 16-bit dots from Ampere on: wgmma for Hopper's big tiles
        dots = row["kernel"].split()[0] in ("flash_attention", "paged_decode_split")
        dots |= row["kernel"].startswith(("w8a16", "w4a16 "))
        int8_dots = row["kernel"].startswith("w8a8")  # int8 operands whatever the output
        if (dots and row["dtype"] != "fp32" or int8_dots) and arch >= 80:
            assert row["tensor_cores"] in ("mma.sync", "wgmma"), name
        else:
            assert row["tensor_cores"] == "none", name
    if arch == 90:  # the benchmark's GPU: nothing spills in bfloat16
        assert not [r for r in rows if r["dtype"] == "bf16" and r["spill_bytes"]]


@pytest.mark.slow
def test_flash_attention_head_dims_on_hopper():
    rows = compile_ahead(
        "90", "--dtypes", "bf16", "--kernels", "flash_attention d=64", "flash_attention d=80",
        "flash_attention d=256", "--head-dims", "64", "80", "256",
    )  # fmt: skip
    assert [row["kernel"] for row in rows] == [
        "flash_attention d=64",
        "flash_attention d=80",
        "flash_attention d=256",
    ]
    for row in rows:
        assert row["ok"] and row["shared_bytes"] <= row["limit"], row
        assert row["tensor_cores"] == "wgmma" and row["cp_async"] > 0, row
    # head_dim 256 (Gemma) fills the 255 registers and spills a little; the others do not
    assert [row["spill_bytes"] == 0 for row in rows] == [True, True, False]
    assert rows[2]["spill_bytes"] <= MAX_SPILL_BYTES


@pytest.fixture(scope="module")
def hopper_bf16() -> dict[str, dict]:
    """The decode-path and W4A16 kernels compiled for sm_90 in bfloat16."""
    names = ["flash_attention", "paged_decode_split", "w8a16 M=1", "w4a16_gemv M=1"]
    names += ["w4a16 M=16", "w4a16 M=4096", "sum_splits"]
    rows = compile_ahead("90", "--dtypes", "bf16", "--kernels", *names)
    assert all(row["ok"] for row in rows), rows
    return {row["kernel"]: row for row in rows}


def test_w4a16_loads_are_16_bytes_and_pipelined(hopper_bf16):
    """The packed weights stream through shared memory in 16-byte cp.async copies, one per
    thread per 16 weight bytes, num_stages deep; no byte-wide loads are left."""
    w8 = hopper_bf16["w8a16 M=1"]  # the int8 weights stream the same way
    assert w8["num_stages"] >= 2 and w8["cp_async"] >= w8["num_stages"], w8
    assert "1" not in w8["global_load_bytes"] and w8["spill_bytes"] == 0
    gemv = hopper_bf16["w4a16_gemv M=1"]
    assert gemv["tensor_cores"] == "none" and gemv["num_stages"] >= 3
    assert set(gemv["cp_async_bytes"]) == {"16"} and gemv["cp_async"] >= gemv["num_stages"]
    # byte-wide loads: only the zero points, BLOCK_N bytes per group beside its 64 x 64
    assert gemv["global_load_bytes"].get("1", 0) <= 2
    assert gemv["spill_bytes"] == 0
    for name in ("w4a16 M=16", "w4a16 M=4096"):
        row = hopper_bf16[name]
        assert row["cp_async"] >= 2 * row["num_stages"], name  # x's tile and the weights'
        assert min(map(int, row["cp_async_bytes"])) >= 8, name
        assert row["global_load_bytes"].get("1", 0) <= 2, name  # the zero points
    # prefill-sized M: Hopper's wgmma on 128 x 128 tiles, every copy 16 bytes
    big = hopper_bf16["w4a16 M=4096"]
    assert big["tensor_cores"] == "wgmma" and set(big["cp_async_bytes"]) == {"16"}
    assert big["spill_bytes"] == 0 and big["shared_bytes"] <= big["limit"]


def test_w4a16_dequantizes_without_int_to_float_conversions(hopper_bf16, tmp_path):
    """The 4-bit codes become floats by the magic-number trick (an OR into a float's mantissa
    and a subtraction), not by an int-to-float conversion (SASS I2F) per weight. A kernel
    that converts nibbles with .to(tl.float32), as the W4A16 kernels once did, shows that
    the count sees them."""
    for name in ("w4a16_gemv M=1", "w4a16 M=16", "w4a16 M=4096"):
        assert hopper_bf16[name]["sass_i2f"] == 0, (name, hopper_bf16[name])
    code = """
import torch, triton, triton.language as tl
from minillm.lab import aot
@triton.jit
def convert(packed_ptr, out_ptr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, (tl.load(packed_ptr + i) & 0xF).to(tl.float32))
args = aot.tensors(packed_ptr=torch.uint8, out_ptr=torch.float32)
case = aot.Case("convert", convert, args, 4, 1)
print(aot.sass_opcodes(aot.compile_like_jit(case, 90).asm["cubin"])["I2F"])
"""
    script = tmp_path / "convert.py"  # (Triton reads a kernel's source from its file)
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], env=ENV, capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout) >= 2  # 256 conversions over 128 threads


def test_the_split_k_sum_is_vectorized(hopper_bf16):
    row = hopper_bf16["sum_splits"]
    assert set(row["global_load_bytes"]) == {"16"} and row["spill_bytes"] == 0


def test_attention_uses_what_its_launcher_budgets(hopper_bf16):
    flash = hopper_bf16["flash_attention"]
    assert (flash["BLOCK_M"], flash["BLOCK_N"], flash["num_warps"], flash["num_stages"]) == (
        128,
        64,
        8,
        3,
    )
    # the q tile wgmma reads from shared memory, plus 3 stages of K and V tiles: 128 KiB,
    # one program per SM; registers (225 x 256 threads) would allow no second one either
    budget = tile_shared_bytes(128, 64, 128, 2, 3, q_in_shared=True)
    assert flash["shared_bytes"] == budget == 128 * 1024
    assert flash["tensor_cores"] == "wgmma" and flash["cp_async"] >= 64
    assert flash["programs_per_sm"] == 1 and flash["spill_bytes"] == 0
    decode = hopper_bf16["paged_decode_split"]
    assert decode["cp_async"] > 0 and set(decode["cp_async_bytes"]) >= {"16"}
    assert decode["spill_bytes"] == 0 and decode["programs_per_sm"] >= 4


def test_the_jit_specializations_are_applied():
    """Aligned pointers and multiples of 16 carry tt.divisibility 16; M = 1 is a constant:
    what the JIT derives at a launch, and what an ahead-of-time compile without them lacks."""
    code = """
import json, torch, kernels.device
from minillm.lab import aot
with kernels.device.assume_gpu((9, 0), 132):
    case = next(c for c in aot.cases(torch.bfloat16, [128]) if c.name == "w4a16_gemv M=1")
    source, target, options = aot.specialize(case, 90)
names = case.fn.arg_names
divisible = sorted(names[i] for (i,), a in source.attrs.items() if ["tt.divisibility", 16] in a)
constants = sorted(names[i] for (i,) in source.constants)
print(json.dumps([divisible, constants, options["num_stages"]]))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], env=ENV, capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    divisible, constants, num_stages = json.loads(result.stdout)
    assert divisible == ["K", "N", "out_ptr", "packed_ptr", "scales_ptr", "x_ptr", "zeros_ptr"]
    assert "M" in constants and "SPLIT_K" in constants
    assert num_stages >= 3
