"""Chapter 5's shared setup: the exercise points as the notebook states them, and the
RMSNorm trace moves more than the fused kernel."""

from __future__ import annotations

import json
import pathlib
import re

import torch

from kernels.rmsnorm import rms_norm_bytes
from minillm.lab.catalog import get_model_config
from minillm.lab.ch05_setup import exercise_points, paged_prefix, rmsnorm_fusion_trace
from minillm.lab.op_trace import total_bytes

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_exercise_points_match_the_markers():
    path = ROOT / "exercises" / "ch05_kernels.ipynb"
    cells = json.loads(path.read_text())["cells"]
    marks = [
        int(m.group(1))
        for c in cells
        if c["cell_type"] == "code"
        for m in [re.search(r"# GRADED: (\d+) point", "".join(c["source"]))]
        if m
    ]
    assert exercise_points(path) == (len(marks), sum(marks))
    assert exercise_points(ROOT / "exercises" / "no_such.ipynb") is None


def test_rmsnorm_trace_moves_more_than_the_fused_round_trip():
    config = get_model_config("Llama 3.1 8B")
    ops = rmsnorm_fusion_trace(config, tokens=16)
    assert len(ops) > 3
    assert total_bytes(ops) > 2 * rms_norm_bytes(16, config.hidden_size, 2, residual=True)


def test_paged_prefix_gives_every_sequence_its_own_blocks():
    cache, table = paged_prefix([0, 45, 16], 2, 8, block_size=16)
    assert cache.shape == (2, 1 + 3 + 1, 16, 2, 8)
    assert table.dtype == torch.int32 and table.shape == (3, 3)
    used = [table[0, :1], table[1, :3], table[2, :1]]
    blocks = torch.cat(used).tolist()
    assert sorted(blocks) == list(range(5))  # each block belongs to exactly one sequence
