"""The engine's health after anything: nothing left behind, and the next request served as a
fresh engine serves it.

`leftovers(target)` lists what an idle engine should not hold (KV blocks, queued or running
requests, output-processor or grammar state, blocks held for a forward in flight, an
`LLM`'s stream queues); `probe(target, ...)` runs one request to the end through the public
`LLMEngine` API; `assert_healthy(target, expected)` checks both. `target` is an `LLM` or an
`LLMEngine`, so a harness that drives the engine some other way (an HTTP server's engine
loop, once it is idle) can reuse them.
"""

from __future__ import annotations

from minillm.engine.llm_engine import LLMEngine
from minillm.llm import LLM
from minillm.sampling_params import SamplingParams

PROBE_ID = "__health_probe__"


def engine_of(target: LLM | LLMEngine) -> LLMEngine:
    return target.engine if isinstance(target, LLM) else target


def leftovers(target: LLM | LLMEngine) -> list[str]:
    """Everything an idle engine still holds, one line each; empty when it is clean."""
    engine = engine_of(target)
    found = []
    pool = engine.kv_cache_manager.block_pool
    held = [block.block_id for block in pool.blocks if block.ref_cnt != 0]
    if held:
        found.append(f"KV blocks with ref_cnt != 0: {held[:10]}")
    if pool.get_num_free_blocks() != pool.num_blocks:
        found.append(f"free blocks {pool.get_num_free_blocks()} of {pool.num_blocks}")
    scheduler, manager, processor = (
        engine.scheduler,
        engine.kv_cache_manager,
        engine.output_processor,
    )
    for name, value in (
        ("scheduler.waiting", scheduler.waiting),
        ("scheduler.running", scheduler.running),
        ("scheduler.requests", scheduler.requests),
        ("scheduler.held_blocks", scheduler.held_blocks),
        ("scheduler.in_flight_ids", scheduler.in_flight_ids),
        ("kv_cache_manager.req_to_blocks", manager.req_to_blocks),
        ("kv_cache_manager.req_to_block_hashes", manager.req_to_block_hashes),
        ("kv_cache_manager.pending_block_copies", manager.pending_block_copies),
        ("output_processor.states", processor.states),
        ("output_processor.state_of_seq", processor.state_of_seq),
        ("output_processor.to_report", processor.to_report),
        ("structured_output_manager.matchers", engine.structured_output_manager.matchers),
    ):
        if value:
            found.append(f"{name}: {sorted(map(str, value))[:10]}")
    if engine._arrived:
        found.append(f"engine._arrived: KV arrivals never applied: {engine._arrived[:10]}")
    for name in ("_plan_lengths", "_plan_generators"):
        if getattr(engine, name):
            found.append(f"engine.{name}: plans neither processed nor put back")
    if engine._in_flight is not None:
        found.append("a step is still in flight (async scheduling)")
    if engine.has_unfinished_requests():
        found.append("has_unfinished_requests() is True")
    if isinstance(target, LLM) and target._queues:
        found.append(f"LLM stream queues: {sorted(target._queues)}")
    return found


def probe(
    target: LLM | LLMEngine, prompt: list[int], params: SamplingParams, max_steps: int = 1000
) -> list[list[int]]:
    """Run one request alone to its end; the token ids of each of its completions."""
    engine = engine_of(target)
    engine.add_request(PROBE_ID, list(prompt), params)
    final = None
    for _ in range(max_steps):
        for output in engine.step():
            if output.request_id == PROBE_ID and output.finished:
                final = output
        if final is not None and not engine.has_unfinished_requests():
            break
    if final is None:
        raise AssertionError(f"the probe did not finish in {max_steps} steps")
    if final.error is not None:
        raise AssertionError(f"the probe failed: {final.error}")
    return [list(completion.token_ids) for completion in final.outputs]


def assert_healthy(
    target: LLM | LLMEngine,
    expected: list[list[int]],
    prompt: list[int],
    params: SamplingParams,
) -> None:
    """Clean before and after a probe request whose tokens are `expected` (what a fresh
    engine of the same options gives for `prompt` and `params`)."""
    before = leftovers(target)
    assert not before, f"left behind: {before}"
    got = probe(target, prompt, params)
    assert got == expected, f"the next request's tokens {got} differ from a fresh engine's"
    after = leftovers(target)
    assert not after, f"left behind by the probe: {after}"


def run_all(engine: LLMEngine, requests: dict, interrupts: tuple = (), on_step=None) -> dict:
    """Queue the requests, step until idle (stepping again after an interrupt, as a user
    re-runs a cell; `on_step` after each step); the final output of each."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    final = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return final
        try:
            outputs = engine.step()
        except interrupts:
            continue
        final.update((o.request_id, o) for o in outputs if o.finished)
        if on_step is not None:
            on_step()
    raise AssertionError("the engine never became idle")
