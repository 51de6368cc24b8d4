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


def eager_and_traced(model: str | pathlib.Path, num_seqs: int) -> dict[str, LLMEngine]:
    """Two float32 CPU engines on `model`, the first with `enforce_eager=True`."""
    options = dict(model=model, device="cpu", dtype="float32", max_num_seqs=num_seqs)
    return {
        "eager": LLMEngine(EngineArgs(**options, enforce_eager=True)),
        "traced": LLMEngine(EngineArgs(**options)),
    }


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
    engines = eager_and_traced(model, num_seqs)
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


def overhead_share_rounds(
    model: str | pathlib.Path, num_seqs: int = 64, rounds: int = 3, seed: int = 0
) -> dict[str, list[float]]:
    """`python_overhead_share` of a decode step of `num_seqs` sequences (the prompts of
    `minillm bench offline`'s workload), eager and traced, in `rounds` interleaved rounds."""
    from minillm.lab.bench import make_workload
    from minillm.lab.step_breakdown import python_overhead_share

    engines = eager_and_traced(model, num_seqs)
    specials = {0, 1, 2}  # the bundled tokenizer's BOS, EOS and PAD
    vocab = engines["eager"].config.vocab_size
    prompts = make_workload(num_seqs, (32, 256), (16, 128), vocab, specials, seed).prompts
    shares = {name: [] for name in engines}
    for i in range(rounds):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for name in order:
            shares[name].append(python_overhead_share(engines[name], prompts))
    return shares


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    import os

    import torch

    from minillm.lab.bench import machine_record
    from minillm.model.loader import DEFAULT_MODEL, resolve_model_path

    parser = argparse.ArgumentParser(
        prog="python -m minillm.lab.trace_demo",
        description="eager against traced decode steps, interleaved: step time and the share "
        "outside every aten operator",
    )
    parser.add_argument("--model", default=None, help="HF directory or bundled name")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = resolve_model_path(args.model or DEFAULT_MODEL)
    load_before = list(os.getloadavg())
    shares = overhead_share_rounds(model, 64, args.rounds)
    steps = {n: compare_decode_steps(model, n, args.rounds, steps=8) for n in (16, 64)}
    record = {
        **machine_record(),
        "load_average": [load_before, list(os.getloadavg())],
        "model": str(args.model or DEFAULT_MODEL),
        "overhead_share_64_seqs": shares,
        "decode_steps": {
            str(n): {
                "eager_ms": r.eager_ms,
                "traced_ms": r.traced_ms,
                "speedups": r.speedups,
                "identical": r.identical,
            }
            for n, r in steps.items()
        },
    }
    print(f"share of a 64-sequence decode step outside every aten operator, {args.rounds} rounds")
    for name, values in shares.items():
        print(
            f"  {name:<7} median {statistics.median(values):.1%}  rounds "
            + ", ".join(f"{v:.1%}" for v in values)
        )
    for n, r in steps.items():
        print(
            f"decode step of {n} sequences: eager {statistics.median(r.eager_ms):.2f} ms, "
            f"traced {statistics.median(r.traced_ms):.2f} ms; eager/traced per round "
            + ", ".join(f"{s:.2f}" for s in r.speedups)
            + f"; same tokens: {r.identical}"
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
