"""Ctrl-C during a disaggregated step whose prompt's KV is still on its way.

The engine hands the prefill rank a prompt's last chunk and, before the decode rank answers,
the step is interrupted and taken back. The prefill rank still runs that chunk and sends its
KV (it runs every command it was sent), so the transfer lands late, after the scheduler has
taken the step back. If the request's blocks went back to the pool then, another request
could be given them and the late transfer would overwrite its KV on the decode rank.

Here the prefill rank is stopped (SIGSTOP) while the step is interrupted, so its transfer is
as slow as we like; the pool has just the blocks of the two requests, so a block given back
is the next one a growing request takes. A request already decoding then runs to the end;
its tokens must be those of a fresh one-process engine, no block may stay held, and the
engine must serve a new request exactly as a fresh engine does.
"""

from __future__ import annotations

import os
import signal

import pytest

from minillm import LLM, SamplingParams
from minillm.distributed.disaggregation import DECODE_RANK, PREFILL_RANK
from tests.faults.invariants import leftovers

KV_TRANSFER = {"kv_connector": "TorchDistributedConnector"}
BLOCK = 16
# a request that decodes past its first block while the late transfer is on its way
DECODER = list(range(5, 15))  # 10 prompt tokens: block 1 holds positions 0-15
DECODER_PARAMS = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
# the interrupted prompt: two blocks
VICTIM = list(range(40, 72))
PROBE = list(range(100, 120))
PROBE_PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_model_len=3 * BLOCK, block_size=BLOCK, num_gpu_blocks=3)


def reference(prompt: list[int], params: SamplingParams) -> list[int]:
    llm = LLM(**OPTIONS)
    engine = llm.engine
    engine.add_request("ref", prompt, params)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    return tokens


def run_to_end(engine, request_id: str, max_steps: int = 2000) -> list[int]:
    tokens = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return tokens
        for out in engine.step():
            if out.request_id == request_id:
                tokens = list(out.outputs[0].token_ids)
    raise AssertionError(f"the engine did not finish within {max_steps} steps")


@pytest.mark.slow
def test_ctrl_c_with_a_kv_transfer_in_flight_holds_its_blocks_until_it_lands(monkeypatch):
    expected_decoder = reference(DECODER, DECODER_PARAMS)
    expected_probe = reference(PROBE, PROBE_PARAMS)
    llm = LLM(**OPTIONS, kv_transfer_config=KV_TRANSFER)
    try:
        engine = llm.engine
        executor = engine.executor
        engine.add_request("decoder", DECODER, DECODER_PARAMS)
        decoder = engine.scheduler.requests["decoder"]
        while decoder.num_output_tokens < 2:
            engine.step()  # its KV is on the decode rank; it decodes in its first block

        # the next decode step answers with Ctrl-C, as if the signal came while it ran
        real_receive = executor._receive
        armed = {"on": False}

        def receive(rank, timeout_s):
            if armed["on"] and rank == DECODE_RANK:
                armed["on"] = False
                raise KeyboardInterrupt
            return real_receive(rank, timeout_s)

        monkeypatch.setattr(executor, "_receive", receive)
        prefill_rank = executor.processes[PREFILL_RANK]
        os.kill(prefill_rank.pid, signal.SIGSTOP)  # the victim's transfer will be late
        try:
            engine.add_request("victim", VICTIM, SamplingParams(temperature=0, max_tokens=4))
            armed["on"] = True
            with pytest.raises(KeyboardInterrupt):
                engine.step()  # the victim's only chunk goes to rank 0, then Ctrl-C
            assert not armed["on"], "the step that was interrupted is the one armed"
            engine.abort_request("victim")  # the caller gives up on it
            # the decoder goes on decoding into its second block while the transfer is late
            for _ in range(40):
                engine.step()
        finally:
            os.kill(prefill_rank.pid, signal.SIGCONT)
        tokens = run_to_end(engine, "decoder")
        assert tokens == expected_decoder
        assert_clean_and_probe(llm, engine, expected_probe)
    finally:
        llm.shutdown()


# a pool with room for all three at once, so that nothing is preempted
ROOMY = dict(OPTIONS, num_gpu_blocks=12)
REQUESTS = {
    "decoder": (DECODER, DECODER_PARAMS),
    "victim": (VICTIM, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
    "late": (list(range(60, 81)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["arrivals_taken", "prompt_sent"])
def test_ctrl_c_while_a_step_is_processed_strands_no_request_waiting_for_kv(where):
    """Ctrl-C while a disaggregated step's results are processed: either after the KV
    transfers that landed were taken from the executor, before the scheduler saw them, or as
    processing begins in the step that sent a prompt's last chunk to the prefill rank. The step
    is taken back; no request may be left waiting for a transfer that was already taken, nor
    recompute into blocks a transfer still writes into. Every request ends with a colocated
    engine's tokens, within a bounded number of steps, and nothing stays held."""
    expected = {rid: reference(prompt, params) for rid, (prompt, params) in REQUESTS.items()}
    expected_probe = reference(PROBE, PROBE_PARAMS)
    llm = LLM(**ROOMY, kv_transfer_config=KV_TRANSFER)
    try:
        engine = llm.engine
        fired = []
        if where == "arrivals_taken":
            update = engine.scheduler.update_from_remote_kvs

            def interrupted(arrived):
                if arrived and not fired:
                    fired.append([seq_id for seq_id, _ in arrived])
                    raise KeyboardInterrupt
                return update(arrived)

            engine.scheduler.update_from_remote_kvs = interrupted
        else:
            process = engine._process

            def interrupted(plan, *args, **kwargs):
                finishing = [s for s in plan.scheduled if s.samples and s.phase == "prefill"]
                if finishing and not fired:
                    fired.append([s.request.request_id for s in finishing])
                    raise KeyboardInterrupt
                return process(plan, *args, **kwargs)

            engine._process = interrupted
        for request_id, (prompt, params) in REQUESTS.items():
            engine.add_request(request_id, prompt, params)
        final = {}
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            try:
                outputs = engine.step()
            except KeyboardInterrupt:
                continue  # as a user re-runs the cell
            final.update((o.request_id, o) for o in outputs if o.finished)
        else:
            raise AssertionError(f"stranded: {sorted(engine.scheduler.waiting_for_remote_kvs)}")
        assert fired, "the interrupt was never injected"
        for request_id in REQUESTS:
            assert final[request_id].error is None
            assert list(final[request_id].outputs[0].token_ids) == expected[request_id]
        assert_clean_and_probe(llm, engine, expected_probe)
    finally:
        llm.shutdown()


def assert_clean_and_probe(llm, engine, expected_probe) -> None:
    """No block, transfer or arrival left over, and the next request is a fresh engine's."""
    assert leftovers(llm) == []
    assert not engine.scheduler.finished_awaiting_kvs
    engine.add_request("probe", PROBE, PROBE_PARAMS)
    assert run_to_end(engine, "probe") == expected_probe
    assert leftovers(llm) == []
