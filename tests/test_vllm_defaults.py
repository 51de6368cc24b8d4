"""vLLM's batch defaults by GPU: the 70 GiB rule, the A100 exception."""

import pytest

from minillm.lab.hardware import get_device
from minillm.lab.vllm_defaults import vllm_batch_defaults


@pytest.mark.parametrize(
    "name, seats, offline, server",
    [
        ("H100 SXM", 1024, 16384, 8192),  # 79.18 GiB reported: above 70 GiB
        ("H200 SXM", 1024, 16384, 8192),
        ("MI300X", 1024, 16384, 8192),
        ("A100 SXM 80GB", 256, 8192, 2048),  # large, but the A100 is excepted
        ("L40S", 256, 8192, 2048),
        ("L4", 256, 8192, 2048),  # chapter 1's small GPU
        ("T4", 256, 8192, 2048),
    ],
)
def test_defaults_follow_memory_and_the_a100_exception(name, seats, offline, server):
    got = vllm_batch_defaults(get_device(name))
    assert (got.max_num_seqs, got.max_num_batched_tokens_offline) == (seats, offline)
    assert got.max_num_batched_tokens_server == server
