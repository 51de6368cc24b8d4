"""TTFT and ITL of a colocated engine against a prefill/decode-disaggregated one, under a
small mixed load: short requests decoding while long prompts keep arriving.

`run_mixed_load(llm)` drives an engine step by step: `num_decoders` short prompts start at
once, and one long prompt joins every `arrival_every` steps. In a colocated engine a long
prompt's prefill shares the step with the decoders, so their inter-token latency (ITL) grows
in those steps; with disaggregation the prefill runs on its own process and the decoders'
steps only wait for the slower of the two ranks plus the KV transfer. Whether that pays
depends on the machine: two processes on two busy CPU cores compete for the same cores, and
each KV transfer is a copy. The numbers are measured, never assumed:
`compare_colocated_disaggregated` runs both engines on the same load and returns both
summaries (no thresholds anywhere).
"""

from __future__ import annotations

import dataclasses
import statistics

from minillm import LLM, SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class LatencySummary:
    """Median and largest TTFT and ITL (seconds) of the requests of one run."""

    num_requests: int
    num_itl: int  # inter-token gaps measured
    ttft_median_s: float
    ttft_max_s: float
    itl_median_s: float
    itl_max_s: float
    kv_transfer_bytes: int  # 0 for a colocated engine
    kv_transfer_s: float


def mixed_load_prompts(
    num_decoders: int, num_long: int, long_len: int, vocab_size: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Token-id prompts: short ones (4 tokens) and long ones (long_len tokens), deterministic."""
    short = [[(7 * i + j) % (vocab_size - 3) + 3 for j in range(4)] for i in range(num_decoders)]
    long = [
        [(13 * i + 5 * j) % (vocab_size - 3) + 3 for j in range(long_len)] for i in range(num_long)
    ]
    return short, long


def run_mixed_load(
    llm: LLM,
    num_decoders: int = 3,
    num_long: int = 3,
    long_len: int = 48,
    max_tokens: int = 12,
    arrival_every: int = 3,
) -> LatencySummary:
    """Drive `llm`'s engine through the mixed load; TTFT and ITL from its request metrics."""
    engine = llm.engine
    short, long = mixed_load_prompts(num_decoders, num_long, long_len, engine.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(short):
        engine.add_request(f"short-{i}", prompt, params)
    metrics, step, pending = {}, 0, list(enumerate(long))
    while pending or engine.has_unfinished_requests():
        if pending and step % arrival_every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"long-{i}", prompt, params)
        for output in engine.step():
            if output.finished:
                metrics[output.request_id] = output.metrics
        step += 1
    ttft = [m.ttft_s for m in metrics.values()]
    itl = [gap for m in metrics.values() for gap in m.itl_s]
    transfers = [] if engine.executor is None else engine.executor.kv_transfer_records()
    return LatencySummary(
        num_requests=len(metrics),
        num_itl=len(itl),
        ttft_median_s=statistics.median(ttft),
        ttft_max_s=max(ttft),
        itl_median_s=statistics.median(itl),
        itl_max_s=max(itl),
        kv_transfer_bytes=sum(t.num_bytes for t in transfers),
        kv_transfer_s=sum(t.seconds for t in transfers),
    )


def compare_colocated_disaggregated(
    model: str = "minillm-stdlib-target", dtype: str = "float32", **load
) -> dict[str, LatencySummary]:
    """The same mixed load on a colocated engine and on a disaggregated one (prefix caching
    off in both, so that both compute every prompt)."""
    options = dict(dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=64)
    colocated = run_mixed_load(LLM(model, **options), **load)
    disaggregated_llm = LLM(
        model, kv_transfer_config={"kv_connector": "TorchDistributedConnector"}, **options
    )
    try:
        disaggregated = run_mixed_load(disaggregated_llm, **load)
    finally:
        disaggregated_llm.shutdown()
    return {"colocated": colocated, "disaggregated": disaggregated}
