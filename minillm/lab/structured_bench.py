"""Mask time per decoding step: minillm's constrained decoding against xgrammar's.

For each grammar both libraries walk the same random path of tokens (chosen among the allowed
ones) over the bundled tokenizer's vocabulary, interleaved step by step: at each step each one
computes the mask of the next token and then accepts the chosen token. minillm's masks are
computed the first time a state is reached and cached, so its first walk over a grammar pays
for the states it meets ("cold") and later walks reuse them ("warm"); xgrammar precomputes
most of its masks when it compiles the grammar, so compile times are reported too.

    python -m minillm.lab.structured_bench --json benchmarks/results/structured_cpu.json

xgrammar is a test dependency; this benchmark needs it installed. Speed is measured here,
never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from minillm.lab.bench import machine_record
from minillm.model.loader import DEFAULT_MODEL, resolve_model_path
from minillm.model.tokenizer import Tokenizer
from minillm.structured.grammar import StructuredOutputManager, token_bytes
from minillm.structured.json_schema import schema_to_regex
from minillm.structured.regex import compile_regex

GRAMMARS = {
    "email regex": r"[a-z]{2,12}@[a-z]{2,8}\.(?:com|org|net)",
    "quoted string": r'"(?:[^"\\]|\\["\\n])*"',
    "json object": schema_to_regex(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                "ok": {"type": "boolean"},
            },
            "required": ["name", "age"],
        }
    ),
}


def run(num_walks: int = 3, num_steps: int = 24, seed: int = 0) -> dict:
    from importlib.metadata import version

    import xgrammar as xgr

    tokenizer = Tokenizer(resolve_model_path(DEFAULT_MODEL))
    vocab_size = tokenizer.vocab_size
    eos = tokenizer.eos_token_id
    t0 = time.perf_counter()
    manager = StructuredOutputManager(tokenizer, vocab_size)
    manager.vocab  # noqa: B018 - reads the vocabulary's bytes and builds the trie
    vocab_s = time.perf_counter() - t0
    encoded = [data or b"" for data in token_bytes(tokenizer, vocab_size)]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(
        encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[eos]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    xgr_vocab_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    rows = []
    for name, pattern in GRAMMARS.items():
        compile_regex.cache_clear()
        t0 = time.perf_counter()
        grammar = manager.grammar(pattern)
        ours_compile = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = compiler.compile_regex(pattern)
        theirs_compile = time.perf_counter() - t0
        rng = random.Random(seed)
        times = {"ours_cold": [], "ours_warm": [], "xgrammar": []}
        for walk in range(num_walks):
            matcher = xgr.GrammarMatcher(compiled)
            request_id = f"{name}/{walk}"
            output: list[int] = []
            for _ in range(num_steps):
                t0 = time.perf_counter()
                mask = manager.allowed_mask(request_id, pattern, output, [eos])
                ours = time.perf_counter() - t0
                t0 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                theirs = time.perf_counter() - t0
                times["ours_cold" if walk == 0 else "ours_warm"].append(ours)
                times["xgrammar"].append(theirs)
                choices = [t for t in mask.nonzero().flatten().tolist() if t != eos]
                if not choices:
                    break
                token = rng.choice(choices)
                t0 = time.perf_counter()
                matcher.accept_token(token)
                times["xgrammar"][-1] += time.perf_counter() - t0
                output.append(token)
            manager.free(request_id)
        row = {
            "grammar": name,
            "dfa_states": grammar.dfa.num_states,
            "ours_compile_ms": 1e3 * ours_compile,
            "xgrammar_compile_ms": 1e3 * theirs_compile,
            **{f"{k}_median_us": 1e6 * statistics.median(v) for k, v in times.items() if v},
            # the first walk computes a mask at every state it meets for the first time
            "ours_cold_mean_us": 1e6 * statistics.fmean(times["ours_cold"]),
            "masks_cached": len(grammar.masks),
        }
        row["warm_over_xgrammar"] = row["ours_warm_median_us"] / row["xgrammar_median_us"]
        rows.append(row)
        print(
            f"{name:14s} states {row['dfa_states']:4d}  compile ours {ours_compile * 1e3:7.1f} ms"
            f" xgrammar {theirs_compile * 1e3:7.1f} ms | per step: ours cold "
            f"{row['ours_cold_median_us']:8.1f} us, warm {row['ours_warm_median_us']:6.1f} us, "
            f"xgrammar {row['xgrammar_median_us']:6.1f} us (warm/xgrammar "
            f"{row['warm_over_xgrammar']:.2f}x)"
        )
    return {
        **machine_record(),
        "xgrammar": version("xgrammar"),
        "vocab_size": vocab_size,
        "vocab_setup_ms": {"ours": 1e3 * vocab_s, "xgrammar": 1e3 * xgr_vocab_s},
        "num_walks": num_walks,
        "num_steps": num_steps,
        "results": rows,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = run(args.walks, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
