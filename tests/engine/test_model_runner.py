"""The model runner's flat batch, worked by hand (end-to-end runs are in test_engine.py)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.core.request import Request
from minillm.core.scheduler import ScheduledRequest
from minillm.sampling_params import SamplingParams
from minillm.worker.model_runner import prepare_inputs


def request(request_id, num_tokens, num_computed_tokens):
    r = Request(request_id, list(range(100, 100 + num_tokens)), SamplingParams(), 0.0)
    r.num_computed_tokens = num_computed_tokens
    return r


def test_prepare_inputs_packs_a_decode_chunk_and_a_prefill_chunk():
    # a: 8 tokens, 5 cached, computes its last 3 and samples; b: a 6-token prompt, first 2
    a, b = request("a", 8, 5), request("b", 6, 0)
    scheduled = [ScheduledRequest.plan(a, 3), ScheduledRequest.plan(b, 2)]
    scheduled[0].block_ids, scheduled[1].block_ids = [7, 2], [3]
    model_input = prepare_inputs(scheduled, block_size=4, device="cpu")
    assert model_input.input_ids.tolist() == [105, 106, 107, 100, 101]
    assert model_input.positions.tolist() == [5, 6, 7, 0, 1]
    meta = model_input.meta
    # a's positions 5..7 sit in its second block (2) at offsets 1..3; b's in block 3
    assert meta.slot_mapping.tolist() == [9, 10, 11, 12, 13]
    assert meta.query_start_loc.tolist() == [0, 3, 5]
    assert meta.seq_lens.tolist() == [8, 2]
    assert meta.block_tables.tolist() == [[7, 2], [3, 0]]
    assert (meta.max_query_len, meta.max_seq_len, meta.block_size) == (3, 8, 4)
    # only a reached its last token: sample from the hidden state of batch row 2
    assert model_input.logits_indices.tolist() == [2]
    assert meta.slot_mapping.dtype == torch.int64 and meta.seq_lens.dtype == torch.int32


class _Chunk:
    """What prepare_inputs reads of a scheduled request."""

    def __init__(self, tokens, computed, new, blocks, samples):
        self.request = type("R", (), {"all_token_ids": tokens})()
        self.num_computed_tokens, self.num_new_tokens = computed, new
        self.block_ids, self.samples = blocks, samples


@st.composite
def batches(draw):
    """A batch of chunks (cached tokens, new tokens, shuffled distinct blocks), block size."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    shapes = draw(
        st.lists(
            st.tuples(st.integers(0, 40), st.integers(1, 9), st.booleans()), min_size=1, max_size=6
        )
    )
    needs = [-(-(c + n) // block_size) for c, n, _ in shapes]
    pool = draw(st.permutations(range(sum(needs) + len(needs))))
    chunks, used = [], 0
    for (computed, new, samples), need in zip(shapes, needs, strict=True):
        extra = draw(st.integers(0, 1))  # a table may hold one block more than it fills
        blocks = list(pool[used : used + need + extra])
        used += need + extra
        tokens = [draw(st.integers(3, 4000)) for _ in range(computed + new)]
        chunks.append(_Chunk(tokens, computed, new, blocks, samples))
    return chunks, block_size


@settings(max_examples=60, deadline=None)
@given(batches())
def test_prepare_inputs_matches_a_token_by_token_build(batch):
    chunks, block_size = batch
    model_input = prepare_inputs(chunks, block_size, "cpu")
    ids, positions, slots, starts, rows = [], [], [], [0], []
    for chunk in chunks:
        for p in range(chunk.num_computed_tokens, chunk.num_computed_tokens + chunk.num_new_tokens):
            ids.append(chunk.request.all_token_ids[p])
            positions.append(p)
            slots.append(chunk.block_ids[p // block_size] * block_size + p % block_size)
        starts.append(len(ids))
        if chunk.samples:
            rows.append(len(ids) - 1)
    meta = model_input.meta
    assert model_input.input_ids.tolist() == ids
    assert model_input.positions.tolist() == positions
    assert meta.slot_mapping.tolist() == slots
    assert meta.query_start_loc.tolist() == starts
    lens = [c.num_computed_tokens + c.num_new_tokens for c in chunks]
    assert meta.seq_lens.tolist() == lens
    width = max(len(c.block_ids) for c in chunks)
    assert meta.block_tables.tolist() == [
        c.block_ids + [0] * (width - len(c.block_ids)) for c in chunks
    ]
    assert model_input.logits_indices.tolist() == rows
    assert (meta.max_query_len, meta.max_seq_len) == (
        max(c.num_new_tokens for c in chunks),
        max(lens),
    )
    # the torch backend's plan: which rows decode, and what each decode row may read
    plan = meta.torch_plan
    decodes = [i for i, c in enumerate(chunks) if c.num_new_tokens == 1]
    assert plan.decode_rows.tolist() == [starts[i] for i in decodes]
    assert plan.prefills == [
        (i, starts[i], starts[i + 1], lens[i]) for i, c in enumerate(chunks) if c.num_new_tokens > 1
    ]
    assert plan.all_decode == (len(decodes) == len(chunks))
    if not decodes:
        return
    num_blocks = -(-max(lens[i] for i in decodes) // block_size)
    mask = plan.decode_mask.view(len(decodes), -1)
    gathered = plan.decode_block_tables
    for row, i in enumerate(decodes):
        own = chunks[i].block_ids
        for position in range(num_blocks * block_size):
            visible = position < lens[i]
            assert mask[row, position].item() == (0.0 if visible else float("-inf"))
            if visible:  # the gathered slot is the token's own
                assert gathered[row, position // block_size].item() == own[position // block_size]
    # every slot gathered and never written is zeroed: its flat row index is listed
    unwritten = set(plan.decode_unwritten_rows.tolist())
    for row, i in enumerate(decodes):
        table = chunks[i].block_ids
        written = {table[p // block_size] * block_size + p % block_size for p in range(lens[i])}
        for position in range(num_blocks * block_size):
            block = gathered[row, position // block_size].item()
            slot = block * block_size + position % block_size
            flat = row * num_blocks * block_size + position
            if position >= lens[i] and slot not in written:
                assert flat in unwritten
            if position < lens[i]:
                assert flat not in unwritten
