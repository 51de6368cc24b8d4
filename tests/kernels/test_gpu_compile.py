"""Every kernel compiles for Hopper (sm_90) and Ada (sm_89, the smallest shared memory of
the targets) with its launcher's configuration, and fits the shared memory: checked
without a GPU by compiling ahead of time in a process where the kernels are not
interpreted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("gpu_compile.py")


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 89])
def test_kernels_compile_for_the_gpu(arch):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(arch)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parents[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 2 * 10  # bfloat16 and float32, ten kernel configurations each
    failed = [row for row in rows if not row["ok"] or row["shared_bytes"] > row["limit"]]
    assert not failed, failed
