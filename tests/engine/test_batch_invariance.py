"""Batch-invariant mode (`batch_invariant=True`): a prompt's logits are bitwise the same alone,
in batches of any size and order, and under any chunked-prefill budget; its pieces agree with
the ordinary computation to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minillm.engine.args import EngineArgs
from minillm.lab.batch_invariance import (
    InvarianceRow,
    LogitsProbe,
    logits_difference,
    measure_batch_invariance,
)
from minillm.lab.kv_fp8_agreement import heldout_prompts
from minillm.model.attention import (
    AttentionMetadata,
    batch_invariant_attention,
    torch_paged_attention,
    write_kv_cache,
)
from minillm.model.batch_invariant import rowwise_linear

MODEL = "minillm-stdlib-target"
PROMPTS = heldout_prompts(MODEL, num_prompts=6, prompt_len=14)
# companions of other lengths, so that padding and chunk boundaries differ between batches
PROMPTS = [p[: 8 + i] for i, p in enumerate(PROMPTS)]
MAX_TOKENS = 2


def test_rowwise_linear_is_linear_and_each_row_ignores_the_others():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 24)
    weight, bias = torch.randn(10, 24), torch.randn(10)
    out = rowwise_linear(x, weight, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    # a row computed inside any batch is bitwise the row computed alone
    alone = rowwise_linear(x[2, 1:2], weight, bias)
    assert torch.equal(out[2, 1:2], alone)


def test_batch_invariant_attention_matches_the_reference_attention():
    torch.manual_seed(1)
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    seq_lens, q_lens, tables = [9, 3, 6], [4, 1, 6], [[2, 0, 5], [1], [3, 4]]
    cache = torch.randn(2, 6, block_size, kv_heads, dim)
    slots, starts = [], [0]
    for seq_len, q_len, table in zip(seq_lens, q_lens, tables, strict=True):
        slots += [
            table[p // block_size] * block_size + p % block_size
            for p in range(seq_len - q_len, seq_len)
        ]
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    num_tokens = sum(q_lens)
    write_kv_cache(
        torch.randn(num_tokens, kv_heads, dim),
        torch.randn(num_tokens, kv_heads, dim),
        cache,
        meta.slot_mapping,
    )
    q = torch.randn(num_tokens, heads, dim)
    got = batch_invariant_attention(q, cache, meta, 0.35)
    torch.testing.assert_close(
        got, torch_paged_attention(q, cache, meta, 0.35), rtol=1e-5, atol=1e-6
    )


@pytest.fixture(scope="module")
def probe():
    return LogitsProbe(MODEL, batch_invariant=True, dtype="bfloat16")


@pytest.fixture(scope="module")
def alone(probe):
    return probe.logits(PROMPTS[0], max_tokens=MAX_TOKENS)


@settings(max_examples=4, deadline=None)
# without the mode, this batch changes the prompt's logits on the torch backend here
@example(companions=[1, 2], position=1, budget=None)
@given(
    companions=st.lists(st.integers(1, len(PROMPTS) - 1), min_size=0, max_size=3),
    position=st.integers(0, 3),
    budget=st.sampled_from([None, 5, 9, 16]),
)
def test_logits_are_bitwise_equal_in_any_batch_and_chunking(
    probe, alone, companions, position, budget
):
    got = probe.logits(PROMPTS[0], [PROMPTS[i] for i in companions], position, budget, MAX_TOKENS)
    assert got.shape == alone.shape
    assert torch.equal(got, alone)


def test_the_lab_measure_reports_equality_with_the_mode_on():
    rows = measure_batch_invariance(
        MODEL,
        batch_sizes=(1, 3),
        budgets=(None, 6),
        batch_invariant=True,
        prompt_len=10,
        max_tokens=MAX_TOKENS,
        dtype="bfloat16",
    )
    assert [(r.batch_size, r.max_num_batched_tokens) for r in rows] == [
        (1, None),
        (3, None),
        (1, 6),
        (3, 6),
    ]
    assert all(r.bitwise_equal and r.max_abs_diff == 0.0 for r in rows)


def test_the_lab_measure_without_the_mode_reports_what_it_sees():
    rows = measure_batch_invariance(
        MODEL, batch_sizes=(1, 4), budgets=(None, 6), prompt_len=10, max_tokens=MAX_TOKENS
    )
    for row in rows:
        assert isinstance(row, InvarianceRow)
        assert row.bitwise_equal == (row.max_abs_diff == 0.0)
    # the same prompt alone with the same budget is the same computation: no difference
    assert rows[0].bitwise_equal


def test_logits_difference():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert logits_difference(a, a.clone()) == (0.0, True)
    assert logits_difference(a, a + torch.tensor([0.0, 0.5, -1.0])) == (1.0, False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(batch_invariant=1), "batch_invariant must be True or False"),
        (dict(batch_invariant=True, attention_backend="triton"), "torch attention backend"),
        (dict(batch_invariant=True, quantization="int8"), "float weights"),
    ],
)
def test_bad_batch_invariant_options_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(MODEL, **kwargs)
