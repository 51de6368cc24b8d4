"""The model runner's flat batch, worked by hand (end-to-end runs are in test_engine.py)."""

import torch

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
