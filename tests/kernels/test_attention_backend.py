"""The "triton" attention backend against the engine's reference backend, and the engine's
greedy outputs with either backend on a tiny model (under the interpreter without CUDA)."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import ATTENTION_TOLERANCE, DEVICE, DTYPES, assert_close
from tiny_llama import build_tiny_llama

from kernels.flash_attention import flash_attention
from kernels.kv_cache import reshape_and_cache
from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.model.attention import (
    AttentionMetadata,
    get_attention_backend,
    split_mixed_batch,
    torch_paged_attention,
)
from minillm.model.triton_backend import TritonAttentionBackend
from minillm.sampling_params import SamplingParams


def make_batch(chunks, block_size, num_kv_heads, group, head_dim, dtype, seed):
    """chunks: (num_computed_tokens, num_new_tokens) per sequence -> (q, k, v, kv_cache,
    meta) with the computed tokens already in a cache of shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    max_num_blocks = max(-(-(c + n) // block_size) for c, n in chunks)
    num_blocks = len(chunks) * max_num_blocks + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[i * max_num_blocks : (i + 1) * max_num_blocks] for i in range(len(chunks))]
    slots, query_start_loc = [], [0]
    for (computed, new), table in zip(chunks, tables, strict=True):
        positions = range(computed, computed + new)
        slots += [table[p // block_size] * block_size + p % block_size for p in positions]
        query_start_loc.append(query_start_loc[-1] + new)
    num_tokens = query_start_loc[-1]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    q = randn(num_tokens, num_kv_heads * group, head_dim)
    k, v = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    meta = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64),
        query_start_loc=tensor(query_start_loc, torch.int32),
        seq_lens=tensor([c + n for c, n in chunks], torch.int32),
        block_tables=tensor(tables, torch.int32),
        max_query_len=max(n for _, n in chunks),
        max_seq_len=max(c + n for c, n in chunks),
        block_size=block_size,
    )
    return q, k, v, kv_cache, meta


@settings(max_examples=10)
@given(
    chunks=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=3),
    decode_only=st.booleans(),
    group=st.sampled_from([1, 2, 4]),
    block_size=st.sampled_from([8, 16]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_triton_backend_matches_the_torch_backend(
    chunks, decode_only, group, block_size, dtype, seed
):
    if decode_only:  # every sequence brings one token after its context
        chunks = [(computed, 1) for computed, _ in chunks]
    q, k, v, kv_cache, meta = make_batch(chunks, block_size, 2, group, 32, dtype, seed)
    reference_cache = kv_cache.clone()
    out = TritonAttentionBackend().forward(q, k, v, kv_cache, meta, 0.2)
    expected = get_attention_backend("torch").forward(q, k, v, reference_cache, meta, 0.2)
    assert torch.equal(kv_cache, reference_cache)  # the same slots were written
    assert_close(out, expected, ATTENTION_TOLERANCE[dtype])


def test_decode_batch_with_a_missing_token_is_rejected():
    q, k, v, kv_cache, meta = make_batch([(5, 1), (3, 1)], 8, 1, 2, 32, torch.float32, 0)
    with pytest.raises(ValueError, match="one token per sequence: 1 tokens for 2 sequences"):
        TritonAttentionBackend().forward(q[:1], k[:1], v[:1], kv_cache, meta, 0.2)


def test_mixed_batch_through_the_flash_kernel_equals_reference():
    # a decode token, a chunk after a cached prefix, and a fresh prompt in one flat batch
    q, k, v, kv_cache, meta = make_batch([(30, 1), (17, 9), (0, 12)], 8, 2, 2, 64, torch.float32, 1)
    out = TritonAttentionBackend().forward(q, k, v, kv_cache, meta, 0.125)
    torch.testing.assert_close(
        out, torch_paged_attention(q, kv_cache, meta, 0.125), atol=1e-5, rtol=1e-5
    )


class KernelLog:
    """Wraps the backend's two attention kernels and records the query rows each receives."""

    def __init__(self, monkeypatch):
        import minillm.model.triton_backend as backend

        self.calls: list[tuple[str, int]] = []
        for name in ("paged_decode_attention", "flash_attention"):
            kernel = getattr(backend, name)

            def recorded(q, *args, _kernel=kernel, _name=name, **kwargs):
                self.calls.append((_name, q.shape[0]))
                return _kernel(q, *args, **kwargs)

            monkeypatch.setattr(backend, name, recorded)


def mixed_meta(meta):
    """`meta` with the host-built split the model runner attaches to a mixed batch."""
    meta.mixed = split_mixed_batch(meta.query_start_loc.tolist(), meta.seq_lens.tolist(), DEVICE)
    return meta


@pytest.mark.parametrize("with_split", [True, False])
def test_decode_rows_of_a_mixed_batch_reach_the_decode_kernel(monkeypatch, with_split):
    # decode tokens at 30 and 70 cached tokens, a chunk after 17, and a fresh prompt of 12
    chunks = [(30, 1), (17, 9), (70, 1), (0, 12)]
    q, k, v, kv_cache, meta = make_batch(chunks, 8, 2, 2, 64, torch.float32, 3)
    meta = mixed_meta(meta) if with_split else meta
    log = KernelLog(monkeypatch)
    written = kv_cache.clone()
    out = TritonAttentionBackend().forward(q, k, v, written, meta, 0.125)
    # without the host-built split the backend derives the same one
    assert log.calls == [("paged_decode_attention", 2), ("flash_attention", 21)]
    torch.testing.assert_close(
        out, torch_paged_attention(q, written, meta, 0.125), atol=1e-5, rtol=1e-5
    )
    # what one flash launch over the whole batch gave before the split
    cache = kv_cache.clone()
    reshape_and_cache(k, v, cache, meta.slot_mapping)
    q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    single = flash_attention(
        q,
        k,
        v,
        meta.query_start_loc,
        meta.max_query_len,
        0.125,
        kv_cache=cache,
        block_tables=meta.block_tables,
        prefix_lens=(meta.seq_lens - q_lens).to(torch.int32),
    )
    torch.testing.assert_close(out, single, atol=1e-5, rtol=1e-5)


def test_decode_only_and_prefill_only_batches_launch_one_kernel(monkeypatch):
    log = KernelLog(monkeypatch)
    for chunks in ([(30, 1), (5, 1)], [(0, 7), (9, 4)]):
        q, k, v, kv_cache, meta = make_batch(chunks, 8, 2, 2, 64, torch.float32, 1)
        TritonAttentionBackend().forward(q, k, v, kv_cache, mixed_meta(meta), 0.125)
    assert log.calls == [("paged_decode_attention", 2), ("flash_attention", 11)]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 6)), min_size=1, max_size=8))
def test_split_mixed_batch_against_brute_force(chunks):
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    seq_lens = [c + n for c, n in chunks]
    split = split_mixed_batch(starts, seq_lens, "cpu")
    decodes = [i for i, (_, n) in enumerate(chunks) if n == 1]
    prefills = [i for i, (_, n) in enumerate(chunks) if n > 1]
    if not decodes or not prefills:
        assert split is None
        return
    assert split.decode_seqs.tolist() == decodes
    assert split.decode_tokens.tolist() == [starts[i] for i in decodes]
    assert split.decode_max_seq_len == max(seq_lens[i] for i in decodes)
    assert split.prefill_seqs.tolist() == prefills
    rows = [t for i in prefills for t in range(starts[i], starts[i + 1])]
    assert split.prefill_tokens.tolist() == rows
    # every row of the batch is in exactly one of the two parts
    assert sorted(rows + split.decode_tokens.tolist()) == list(range(starts[-1]))
    lens = [chunks[i][1] for i in prefills]
    assert split.prefill_query_start_loc.tolist() == [sum(lens[:j]) for j in range(len(lens) + 1)]
    assert split.prefill_max_query_len == max(lens)


def test_the_model_runner_attaches_the_split_to_mixed_batches_only():
    from minillm.worker.model_runner import prepare_inputs

    class Chunk:
        def __init__(self, tokens, computed, new, blocks):
            self.request = type("R", (), {"all_token_ids": tokens})()
            self.num_computed_tokens, self.num_new_tokens = computed, new
            self.block_ids, self.samples = blocks, True

    mixed = prepare_inputs(
        [Chunk(list(range(9)), 8, 1, [0, 1]), Chunk(list(range(5)), 0, 5, [2])], 8, "cpu"
    )
    assert mixed.meta.mixed.decode_seqs.tolist() == [0]
    assert mixed.meta.mixed.prefill_tokens.tolist() == [1, 2, 3, 4, 5]
    decode = prepare_inputs([Chunk(list(range(9)), 8, 1, [0, 1])], 8, "cpu")
    assert decode.meta.mixed is None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def generate(model_dir, attention_backend, prompts, **engine_kwargs):
    engine = LLMEngine(
        EngineArgs(
            model=model_dir,
            device=DEVICE,
            attention_backend=attention_backend,
            max_model_len=128,
            **engine_kwargs,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
    return [outputs[str(i)] for i in range(len(prompts))], engine.stats


def test_greedy_outputs_are_identical_with_either_backend(model_dir):
    shared = list(range(40, 60))
    # several blocks, one token, a shared prefix (a prefix-cache hit for the second), and
    # chunked prefill (a 16-token budget splits the 33-token prompt)
    prompts = [list(range(2, 9)), [5], list(range(100, 133)), shared + [7, 8], shared + [9]]
    kwargs = dict(max_num_batched_tokens=16, block_size=8)
    torch_outputs, _ = generate(model_dir, "torch", prompts, **kwargs)
    triton_outputs, stats = generate(model_dir, "triton", prompts, **kwargs)
    assert triton_outputs == torch_outputs
    assert all(len(tokens) == 6 for tokens in triton_outputs)
    assert stats.prefix_cache_hits > 0


def run_fresh_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a new interpreter that has neither TRITON_INTERPRET nor a visible GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_the_triton_backend_runs_from_a_fresh_python_on_a_cpu():
    # building the model loads torch._dynamo, which imports triton: minillm.model.llama must have
    # switched the interpreter on before that, or tl.sum & co. cannot be interpreted
    code = (
        "from minillm import LLM, SamplingParams\n"
        "llm = LLM(attention_backend='triton', dtype='float32', max_model_len=64)\n"
        "out = llm.generate(['def add(a, b):'], SamplingParams(temperature=0.0, max_tokens=2),"
        " use_tqdm=False)\n"
        "print(len(out[0].outputs[0].token_ids))\n"
    )
    result = run_fresh_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "2"


def test_triton_imported_before_the_kernels_gets_a_clear_error():
    code = (
        "import torch, triton, kernels\n"
        "from kernels.rmsnorm import rms_norm\n"
        "rms_norm(torch.ones(2, 8), torch.ones(8), 1e-5)\n"
    )
    result = run_fresh_python(code)
    assert result.returncode != 0
    assert "triton was imported before the kernels package" in result.stderr
    assert "TRITON_INTERPRET=1" in result.stderr
