"""kernels.flash_attention against a full-matrix float64 reference."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import ATTENTION_TOLERANCE, DEVICE, DTYPES, assert_close, random_block_tables

from kernels.device import ARCH_LIMITS
from kernels.flash_attention import (
    attended_pairs,
    flash_attention,
    flash_attention_bytes,
    flash_attention_flops,
    flash_attention_reference,
    tile_config,
    tile_shared_bytes,
    unfused_attention_bytes,
)
from minillm.lab.op_trace import total_bytes, trace_ops


def make_inputs(q_lens, prefix_lens, num_kv_heads, group, head_dim, block_size, dtype, seed):
    """Random q, k, v for packed sequences, and (when prefix_lens) a paged cache holding each
    sequence's prefix in shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_seqs = sum(q_lens), len(q_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    q = randn(num_tokens, num_kv_heads * group, head_dim)
    k, v = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    cu_seqlens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    prefix = {}
    if prefix_lens is not None:
        max_num_blocks = max(1, *(-(-p // block_size) for p in prefix_lens))
        num_blocks = max_num_blocks + 3
        prefix = {
            "kv_cache": randn(2, num_blocks, block_size, num_kv_heads, head_dim),
            "block_tables": random_block_tables(num_seqs, max_num_blocks, num_blocks, gen).to(
                DEVICE
            ),
            "prefix_lens": torch.tensor(prefix_lens, dtype=torch.int32, device=DEVICE),
        }
    return q, k, v, cu_seqlens.to(DEVICE), prefix


@given(
    data=st.data(),
    num_seqs=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([32, 64, 128]),
    block_size=st.sampled_from([8, 16, 32]),
    with_prefix=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_flash_attention_matches_reference(
    data, num_seqs, group, head_dim, block_size, with_prefix, dtype, seed
):
    # lengths straddle the interpreter's 32-row tiles; empty and one-token sequences included
    lengths = st.lists(st.integers(0, 45), min_size=num_seqs, max_size=num_seqs)
    q_lens = data.draw(lengths, label="q_lens")
    prefix_lens = data.draw(lengths, label="prefix_lens") if with_prefix else None
    num_kv_heads = 1 if group >= 4 else 2
    q, k, v, cu_seqlens, prefix = make_inputs(
        q_lens, prefix_lens, num_kv_heads, group, head_dim, block_size, dtype, seed
    )
    scale = head_dim**-0.5
    out = flash_attention(q, k, v, cu_seqlens, max(q_lens), scale, **prefix)
    expected = flash_attention_reference(q, k, v, cu_seqlens, scale, **prefix)
    assert_close(out, expected, ATTENTION_TOLERANCE[dtype])


@pytest.mark.parametrize("with_prefix", [False, True])
def test_empty_and_single_token_sequences(with_prefix):
    # an empty sequence between others, a one-token chunk, and one token after a prefix
    q_lens, prefix_lens = [0, 1, 33, 0, 1], [4, 0, 17, 9, 40]
    q, k, v, cu_seqlens, prefix = make_inputs(
        q_lens, prefix_lens if with_prefix else None, 2, 2, 32, 16, torch.float32, seed=5
    )
    out = flash_attention(q, k, v, cu_seqlens, 33, 0.2, **prefix)
    expected = flash_attention_reference(q, k, v, cu_seqlens, 0.2, **prefix)
    assert_close(out, expected, ATTENTION_TOLERANCE[torch.float32])
    if not with_prefix:  # a lone token attends to itself only: its own value
        assert torch.equal(out[0], v[0].repeat_interleave(2, dim=0))


def test_chunked_prefill_equals_prefill_in_one_go():
    # a 37-token prompt at once, or its first 20 tokens cached and the last 17 as a chunk
    q, k, v, cu_seqlens, _ = make_inputs([37], None, 2, 2, 32, 8, torch.float32, seed=1)
    whole = flash_attention(q, k, v, cu_seqlens, 37, 0.2)
    cache = torch.zeros(2, 5, 8, 2, 32, device=DEVICE)
    cache[0].view(-1, 2, 32)[:20], cache[1].view(-1, 2, 32)[:20] = k[:20], v[:20]
    chunk = flash_attention(
        q[20:],
        k[20:],
        v[20:],
        torch.tensor([0, 17], dtype=torch.int32, device=DEVICE),
        17,
        0.2,
        kv_cache=cache,
        block_tables=torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32, device=DEVICE),
        prefix_lens=torch.tensor([20], dtype=torch.int32, device=DEVICE),
    )
    torch.testing.assert_close(chunk, whole[20:], atol=1e-6, rtol=1e-5)


def test_equal_keys_average_the_visible_values():
    # all scores equal: query j (no prefix) averages values 0..j
    num_tokens = 40
    q = torch.ones(num_tokens, 1, 16, device=DEVICE)
    k = torch.ones(num_tokens, 1, 16, device=DEVICE)
    v = torch.arange(num_tokens, dtype=torch.float32, device=DEVICE)[:, None, None].expand(
        num_tokens, 1, 16
    )
    cu_seqlens = torch.tensor([0, num_tokens], dtype=torch.int32, device=DEVICE)
    out = flash_attention(q, k, v.contiguous(), cu_seqlens, num_tokens, 1.0)
    expected = torch.arange(num_tokens, dtype=torch.float32) / 2  # mean of 0..j
    torch.testing.assert_close(out[:, 0, 0].cpu(), expected, atol=1e-5, rtol=1e-6)


def test_query_heads_share_their_kv_head():
    # GQA: 4 query heads on 1 KV head equal 4 heads on 4 copies of it
    q, k, v, cu_seqlens, _ = make_inputs([9, 30], None, 1, 4, 64, 16, torch.float32, seed=2)
    gqa = flash_attention(q, k, v, cu_seqlens, 30, 0.125)
    k4, v4 = k.repeat(1, 4, 1), v.repeat(1, 4, 1)
    mha = flash_attention(q, k4, v4, cu_seqlens, 30, 0.125)
    torch.testing.assert_close(gqa, mha, atol=0, rtol=0)


def valid_args():
    q, k, v, cu_seqlens, prefix = make_inputs([3, 5], [4, 0], 2, 2, 32, 8, torch.float32, 0)
    return dict(q=q, k=k, v=v, cu_seqlens=cu_seqlens, max_seqlen=5, scale=0.1, **prefix)


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("q", lambda t: t.to(torch.int8), "q must be float16 or bfloat16 or float32"),
        ("q", lambda t: t[..., :16], r"k must have shape \[8, \*, 16\]"),
        ("k", lambda t: t.half(), "k must be float32"),
        ("k", lambda t: t[:, :1].expand(8, 3, 32), "num_kv_heads \\(3\\) must divide"),
        ("v", lambda t: t[:, :1], r"v must have shape \[8, 2, 32\]"),
        ("v", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), "v must be contiguous"),
        ("cu_seqlens", lambda t: t.long(), "cu_seqlens must be int32"),
        ("kv_cache", lambda t: t[:, :, :, :1], r"kv_cache must have shape \[2, \*, \*, 2, 32\]"),
        ("kv_cache", lambda t: t.half(), "kv_cache must be float32"),
        ("block_tables", lambda t: t[:1], r"block_tables must have shape \[2, \*\]"),
        ("block_tables", lambda t: t.long(), "block_tables must be int32"),
        ("prefix_lens", lambda t: t.long(), "prefix_lens must be int32"),
        ("prefix_lens", lambda t: None, "a prefix needs all of"),
        ("prefix_lens", lambda t: t.to("meta"), "prefix_lens must be on"),
    ],
)
def test_bad_input_is_rejected_before_launch(name, change, message):
    args = valid_args()
    args[name] = change(args[name])
    with pytest.raises(ValueError, match=message):
        flash_attention(**args)


@pytest.mark.skipif(DEVICE != "cpu", reason="checked where cu_seqlens is on the host")
def test_an_understated_max_seqlen_is_rejected():
    args = valid_args() | {"max_seqlen": 4}  # the second sequence brings 5 tokens
    with pytest.raises(ValueError, match=r"max_seqlen \(4\) is less than the longest .* \(5\)"):
        flash_attention(**args)


def test_cost_model():
    # one sequence: 3 new tokens after a 4-token prefix sees 4*3 + (1 + 2 + 3) = 18 pairs
    assert attended_pairs(3, 4) == 18
    assert flash_attention_flops([3, 2], [4, 0], 8, 64) == 4 * 64 * 8 * (18 + 3)
    # bytes: q and out (2 * 5 * 8 heads), k and v (2 * 5 * 2), prefix k and v (2 * 4 * 2)
    assert flash_attention_bytes([3, 2], [4, 0], 8, 2, 64, 2) == (80 + 20 + 16) * 64 * 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_attention_at_real_sizes(dtype, head_dim):
    q_lens, prefix_lens = [1000, 1, 2048, 77], [0, 4000, 512, 1000]
    q, k, v, cu_seqlens, prefix = make_inputs(
        q_lens, prefix_lens, 8, 4, head_dim, 16, dtype, seed=0
    )
    scale = head_dim**-0.5
    out = flash_attention(q, k, v, cu_seqlens, max(q_lens), scale, **prefix)
    expected = flash_attention_reference(q, k, v, cu_seqlens, scale, **prefix)
    assert_close(out, expected, ATTENTION_TOLERANCE[dtype])


def test_unfused_attention_bytes_are_what_three_eager_ops_move():
    # the oracle: trace S = q k^T, P = softmax(S), out = P v as eager ops and add up their
    # bytes (one KV head per query head, so no head is repeated)
    heads, q_len, kv_len, head_dim = 3, 5, 7, 8
    q = torch.randn(heads, q_len, head_dim)
    k, v = torch.randn(heads, kv_len, head_dim), torch.randn(heads, kv_len, head_dim)

    def three_kernels():
        return torch.bmm(torch.bmm(q, k.transpose(1, 2)).softmax(-1), v)

    _, ops = trace_ops(three_kernels)
    assert [op.name for op in ops] == ["bmm.default", "_softmax.default", "bmm.default"]
    assert unfused_attention_bytes(q_len, kv_len, heads, heads, head_dim, 4) == total_bytes(ops)
    # GQA shrinks only the compulsory K/V part; the score matrix is per query head
    assert unfused_attention_bytes(2, 3, 8, 2, 4, 2) == 4 * 8 * 2 * 3 * 2 + (32 + 12) * 4 * 2
    # FlashAttention moves only the compulsory part
    flash = flash_attention_bytes([q_len], [0], heads, heads, head_dim, 4)
    assert unfused_attention_bytes(q_len, q_len, heads, heads, head_dim, 4) - flash == (
        4 * heads * q_len * q_len * 4
    )


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_tile_config_fits_every_architecture(head_dim, itemsize):
    for cc, arch in [*ARCH_LIMITS.items(), (None, ARCH_LIMITS[(9, 0)])]:
        budget = arch.shared_memory_per_program
        block_m, block_n, _, stages = tile_config(head_dim, itemsize, budget, cc)
        assert block_m % block_n == 0
        q_in_shared = cc is None or cc >= (9, 0)
        assert tile_shared_bytes(block_m, block_n, head_dim, itemsize, stages, q_in_shared) <= (
            budget
        )


def test_tile_config_worked_example():
    # head_dim 128 in bfloat16 on Hopper (227 KiB): the q tile that wgmma reads from shared
    # memory, 128 x 128 (32 KiB), plus 3 stages of 64 x 128 K and V tiles (32 KiB a stage)
    assert tile_config(128, 2, 227 * 1024, (9, 0)) == (128, 64, 8, 3)
    assert tile_shared_bytes(128, 64, 128, 2, 3, True) == 128 * 1024
    # Ada (99 KiB): mma.sync keeps q in registers, so 3 stages fit (96 KiB) and pipeline
    assert tile_config(128, 2, 99 * 1024, (8, 9)) == (128, 64, 8, 3)
    assert tile_shared_bytes(128, 64, 128, 2, 3, False) == 96 * 1024
    # Turing and float32: dots on CUDA cores, small tiles, no pipeline (Turing has no cp.async)
    assert tile_config(128, 2, 64 * 1024, (7, 5)) == (32, 32, 8, 1)
    assert tile_config(128, 4, 227 * 1024, (9, 0)) == (32, 32, 8, 1)
    assert tile_config(256, 4, 227 * 1024, (9, 0)) == (16, 16, 4, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_flash_attention_tile_edges_on_the_gpu(dtype, head_dim):
    """The GPU's tiles, which the interpreter never runs: BLOCK_M 128 over BLOCK_N 64 gives
    two diagonal tiles per block of rows, the second fully masked for its first rows; query
    lengths around 64 and 128, paged prefixes around them, and real models' head sizes (80
    is padded to 128 with masked dimensions, 256 is Gemma's)."""
    q_lens, prefix_lens = [1, 63, 64, 65, 127, 128, 129, 300], [0, 5, 4000, 64, 0, 129, 1, 2048]
    scale = head_dim**-0.5
    for prefixes in (prefix_lens, None):
        q, k, v, cu_seqlens, prefix = make_inputs(
            q_lens, prefixes, 2, 4, head_dim, 16, dtype, seed=head_dim
        )
        out = flash_attention(q, k, v, cu_seqlens, max(q_lens), scale, **prefix)
        expected = flash_attention_reference(q, k, v, cu_seqlens, scale, **prefix)
        assert_close(out, expected, ATTENTION_TOLERANCE[dtype])
