"""Eager and traced decode steps side by side: chapter 5's measurement of the CPU's counterpart
of CUDA graphs (`minillm.worker.decode_trace`).

Two engines load the same model, one with `enforce_eager=True`; both get the same requests
and step in turns, so that the machine's load falls on both alike. The steps timed are whole
engine steps (scheduling, the forward, sampling, outputs) of a decode batch.
"""

from __future__ import annotations

import pathlib
import statistics
import time
from dataclasses import dataclass

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.sampling_params import SamplingParams


@dataclass(slots=True)
class TraceComparison:
    num_seqs: int
    eager_ms: list[float]  # the median step of each round, milliseconds
    traced_ms: list[float]
    identical: bool  # every request's tokens the same on both engines
    num_replays: int  # decode steps the traced engine replayed

    @property
    def speedups(self) -> list[float]:
        """Each round's eager step time over its traced one."""
        return [e / t for e, t in zip(self.eager_ms, self.traced_ms, strict=True)]

    @property
    def saved_ms(self) -> float:
        """The median, over rounds, of the time a traced step saves."""
        return statistics.median(e - t for e, t in zip(self.eager_ms, self.traced_ms, strict=True))


def compare_decode_steps(
    model: str | pathlib.Path,
    num_seqs: int = 16,
    rounds: int = 5,
    steps: int = 6,
    prompt_len: int = 24,
    threads: int | None = None,
) -> TraceComparison:
    """Decode steps of `num_seqs` sequences, eager and traced, `rounds` interleaved rounds of
    `steps` steps each; the prompts are token ids 3.. of the model's vocabulary."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    options = dict(model=model, device="cpu", dtype="float32", max_num_seqs=num_seqs)
    engines = {
        "eager": LLMEngine(EngineArgs(**options, enforce_eager=True)),
        "traced": LLMEngine(EngineArgs(**options)),
    }
    vocab = engines["eager"].config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=rounds * steps + 4, ignore_eos=True)
    tokens = {name: {} for name in engines}
    for engine in engines.values():
        for i in range(num_seqs):
            prompt = [3 + (7 * i + 13 * j) % (vocab - 3) for j in range(prompt_len)]
            engine.add_request(f"seq-{i}", prompt, params)
        engine.step()  # the prompts: one prefill step (they fit its token budget)
    times = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            step_ms = []
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                step_ms.append((time.perf_counter() - start) * 1e3)
            times[name].append(statistics.median(step_ms))
    for name, engine in engines.items():
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    tokens[name][output.request_id] = list(output.outputs[0].token_ids)
    return TraceComparison(
        num_seqs=num_seqs,
        eager_ms=times["eager"],
        traced_ms=times["traced"],
        identical=tokens["eager"] == tokens["traced"] and len(tokens["eager"]) == num_seqs,
        num_replays=engines["traced"].model_runner.decode_trace.num_replays,
    )
