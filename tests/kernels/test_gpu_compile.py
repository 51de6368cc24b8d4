"""Every kernel compiles for Hopper (sm_90), Ada (sm_89) and Turing (sm_75, Colab's T4,
the smallest shared memory of the targets) with its launcher's configuration, and fits the
shared memory: checked without a GPU by compiling ahead of time in a process where the
kernels are not interpreted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}


def compile_ahead(*args: str) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-m", "minillm.lab.aot", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
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
    assert len(rows) == 2 * 10  # two dtypes, ten kernel configurations each
    failed = [row for row in rows if not row["ok"] or row["shared_bytes"] > row["limit"]]
    assert not failed, failed


def test_one_kernel_one_dtype():
    (row,) = compile_ahead("90", "--kernels", "flash_attention", "--dtypes", "bf16")
    assert row["ok"] and row["kernel"] == "flash_attention" and row["dtype"] == "bf16"
    assert (row["BLOCK_M"], row["BLOCK_N"], row["num_warps"], row["num_stages"]) == (128, 64, 8, 3)
    # the compiler allocates no more than the launcher budgeted for the tiles
    assert 0 < row["shared_bytes"] <= 144 * 1024
