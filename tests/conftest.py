"""Shared pytest configuration: hypothesis profiles and the GPU marker."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# A fixed example budget and derandomized runs, so CI is repeatable and bounded in time.
settings.register_profile(
    "ci",
    max_examples=25,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The tests use tiny models; one intra-op thread is as fast for them, and leaves the other
# core to the next process instead of two processes' threads spinning against each other.
torch.set_num_threads(int(os.environ.get("MINILLM_TEST_THREADS", "1")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
