"""kernels.kv_cache: the cache store, padding slots skipped."""

import pytest
import torch
from kernel_testing import DEVICE, DTYPES

from kernels.kv_cache import kv_cache_write_bytes, reshape_and_cache, reshape_and_cache_reference


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_matches_reference_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(6, 2, 24, generator=gen).to(DEVICE, dtype)
    v = torch.randn(6, 2, 24, generator=gen).to(DEVICE, dtype)
    # slots in shuffled blocks of 4; tokens 2 and 5 are padding
    slot_mapping = torch.tensor([13, 0, -1, 7, 30, -1], device=DEVICE)
    cache = torch.randn(2, 8, 4, 2, 24, generator=gen).to(DEVICE, dtype)
    expected = cache.clone()
    reshape_and_cache(k, v, cache, slot_mapping)
    reshape_and_cache_reference(k, v, expected, slot_mapping)
    assert torch.equal(cache, expected)
    assert torch.equal(cache[0, 3, 1], k[0]) and torch.equal(cache[1, 7, 2], v[4])


def test_reshape_and_cache_agrees_with_the_engine_write():
    from minillm.model.attention import write_kv_cache

    k, v = torch.randn(5, 1, 32, device=DEVICE), torch.randn(5, 1, 32, device=DEVICE)
    slot_mapping = torch.tensor([3, 4, 5, 16, 17], device=DEVICE)
    ours, engine = (
        torch.zeros(2, 3, 8, 1, 32, device=DEVICE),
        torch.zeros(2, 3, 8, 1, 32, device=DEVICE),
    )
    reshape_and_cache(k, v, ours, slot_mapping)
    write_kv_cache(k, v, engine, slot_mapping)
    assert torch.equal(ours, engine)


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("k", lambda t: t.half(), "k must be float32"),
        ("k", lambda t: t[:, :1], r"k must have shape \[\*, 2, 16\]"),
        ("v", lambda t: t[:2], r"v must have shape \[4, 2, 16\]"),
        ("slot_mapping", lambda t: t.int(), "slot_mapping must be int64"),
        ("slot_mapping", lambda t: t[:3], r"slot_mapping must have shape \[4\]"),
        ("kv_cache", lambda t: t[0], "kv_cache must have shape"),
        ("kv_cache", lambda t: t.transpose(1, 2), "kv_cache must be contiguous"),
    ],
)
def test_bad_input_is_rejected_before_launch(name, change, message):
    args = dict(
        k=torch.randn(4, 2, 16),
        v=torch.randn(4, 2, 16),
        kv_cache=torch.zeros(2, 4, 4, 2, 16),
        slot_mapping=torch.arange(4),
    )
    args = {key: value.to(DEVICE) for key, value in args.items()}
    args[name] = change(args[name])
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(**args)


def test_cost_model():
    assert kv_cache_write_bytes(3, 8, 128, 2) == 4 * 3 * 8 * 128 * 2 + 8 * 3
