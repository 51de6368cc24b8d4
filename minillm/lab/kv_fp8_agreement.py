"""What the engine's FP8 KV cache does to greedy decoding: agreement with the float cache.

Two engines on the same model and prompts, one storing keys and values in the model's dtype
(`kv_cache_dtype="auto"`) and one in float8_e4m3fn (`kv_cache_dtype="fp8_e4m3"`), decode the
same prompts greedily. Greedy decoding is deterministic, so the two outputs are equal until
the first position where FP8 rounding flips the argmax; after that the continuations are
conditioned on different text and comparing them says little. The measure is therefore the
common prefix:

    agreement = mean over prompts of (common prefix length / max_tokens),

1.0 when every output is the same. `token_agreement` (the share of positions holding the
same token, after a divergence too) is reported beside it.

The prompts are the first tokens of the bundled model's held-out windows (text it never
trained on). Run as `python -m minillm.lab.kv_fp8_agreement` to record
benchmarks/results/kv_fp8_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from dataclasses import asdict, dataclass

from minillm.lab.bench import machine_record
from minillm.lab.recorded import RESULTS_DIR, weights_record
from minillm.llm import LLM
from minillm.model.loader import resolve_model_path
from minillm.model.perplexity import heldout_windows
from minillm.sampling_params import SamplingParams

MODEL = "minillm-stdlib-target"


@dataclass(frozen=True, slots=True)
class GreedyAgreement:
    """Greedy outputs of a reference engine and a candidate engine on the same prompts."""

    agreement: float  # mean common-prefix fraction, in [0, 1]
    token_agreement: float  # share of positions with the same token
    common_prefix: list[int]  # per prompt: tokens before the first difference
    max_tokens: int
    reference: list[list[int]]
    candidate: list[list[int]]


def heldout_prompts(model: str = MODEL, num_prompts: int = 8, prompt_len: int = 32) -> list:
    """The first prompt_len tokens of the first num_prompts held-out windows of `model`."""
    windows = heldout_windows(resolve_model_path(model))
    if not 1 <= num_prompts <= windows.shape[0]:
        raise ValueError(f"num_prompts must be in [1, {windows.shape[0]}], got {num_prompts}")
    if not 1 <= prompt_len <= windows.shape[1]:
        raise ValueError(f"prompt_len must be in [1, {windows.shape[1]}], got {prompt_len}")
    return windows[:num_prompts, :prompt_len].tolist()


def greedy_tokens(
    prompts: list[list[int]], max_tokens: int, model: str = MODEL, **engine_args
) -> list[list[int]]:
    """Each prompt's greedy continuation of exactly max_tokens tokens (EOS ignored), from an
    engine built with `engine_args`."""
    llm = LLM(model, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def compare_greedy(
    reference: list[list[int]], candidate: list[list[int]], max_tokens: int
) -> GreedyAgreement:
    """The agreement of two lists of greedy outputs of max_tokens tokens each."""
    if len(reference) != len(candidate) or not reference:
        raise ValueError("need the same, non-zero number of reference and candidate outputs")
    prefixes = [common_prefix_len(r, c) for r, c in zip(reference, candidate, strict=True)]
    pairs = zip(reference, candidate, strict=True)
    same = sum(x == y for r, c in pairs for x, y in zip(r, c, strict=False))
    return GreedyAgreement(
        agreement=sum(prefixes) / (len(prefixes) * max_tokens),
        token_agreement=same / (len(reference) * max_tokens),
        common_prefix=prefixes,
        max_tokens=max_tokens,
        reference=reference,
        candidate=candidate,
    )


def kv_fp8_greedy_agreement(
    model: str = MODEL,
    prompts: list[list[int]] | None = None,
    max_tokens: int = 32,
    kv_cache_dtype: str = "fp8_e4m3",
    calculate_kv_scales: bool = False,
    **engine_args,
) -> GreedyAgreement:
    """Greedy agreement of the engine with an FP8 KV cache against the same engine with its
    cache in the model's dtype (`engine_args`, e.g. dtype="bfloat16", apply to both).

    prompts None: heldout_prompts(model), eight prompts of 32 tokens.
    """
    prompts = heldout_prompts(model) if prompts is None else prompts
    reference = greedy_tokens(prompts, max_tokens, model, **engine_args)
    candidate = greedy_tokens(
        prompts,
        max_tokens,
        model,
        kv_cache_dtype=kv_cache_dtype,
        calculate_kv_scales=calculate_kv_scales,
        **engine_args,
    )
    return compare_greedy(reference, candidate, max_tokens)


def record(num_prompts: int, prompt_len: int, max_tokens: int, dtype: str) -> dict:
    prompts = heldout_prompts(MODEL, num_prompts, prompt_len)
    rows = {}
    for name, calibrate in (("scale 1.0", False), ("calculate_kv_scales", True)):
        start = time.perf_counter()
        result = kv_fp8_greedy_agreement(
            MODEL, prompts, max_tokens, calculate_kv_scales=calibrate, dtype=dtype
        )
        row = asdict(result)
        del row["reference"], row["candidate"]
        row["seconds"] = time.perf_counter() - start
        rows[name] = row
    return {
        **machine_record(),
        "model": MODEL,
        **weights_record(MODEL),
        "dtype": dtype,
        "kv_cache_dtype": "fp8_e4m3",
        "prompts": {"source": "held-out windows", "num": num_prompts, "tokens": prompt_len},
        "max_tokens": max_tokens,
        "measure": "mean over prompts of common greedy prefix / max_tokens",
        "results": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=str(RESULTS_DIR / "kv_fp8_cpu.json"))
    args = parser.parse_args(argv)
    rec = record(args.num_prompts, args.prompt_len, args.max_tokens, args.dtype)
    for name, row in rec["results"].items():
        print(
            f"{name:>20}: agreement {row['agreement']:.3f}, "
            f"token agreement {row['token_agreement']:.3f}, prefixes {row['common_prefix']}"
        )
    pathlib.Path(args.json).write_text(json.dumps(rec, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
