"""The step profiler ranks operators by self time and counts their calls."""

from __future__ import annotations

import torch

from minillm.lab.step_profile import profile_step


def test_profile_counts_calls_and_ranks_by_self_time():
    a, b = torch.randn(256, 256), torch.randn(8)

    def step():
        for _ in range(3):
            a @ a
        for _ in range(5):
            b + 1

    ops, total_us = profile_step(step)
    by_name = {op.name: op for op in ops}
    assert by_name["aten::mm"].calls == 3
    assert by_name["aten::add"].calls == 5
    times = [op.self_cpu_us for op in ops]
    assert times == sorted(times, reverse=True)
    assert total_us == sum(times) > 0
    assert by_name["aten::mm"].self_cpu_us > by_name["aten::add"].self_cpu_us
