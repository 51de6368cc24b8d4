"""The `minillm generate` command: complete prompts from the command line.

    minillm generate "def fib(n):" --max-tokens 48 --temperature 0
    minillm generate "import os" "class Tree:" --model path/to/hf-dir --metrics
    minillm generate "Once upon" --stream

The engine is imported inside the handler, so `minillm --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="complete prompts with a model")
    parser.add_argument("prompts", nargs="+", help="prompt texts, completed as one batch")
    parser.add_argument("--model", default=None, help="model directory or name (default: bundled)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    parser.add_argument(
        "--metrics", action="store_true", help="print TTFT, TPOT and E2EL of each prompt"
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from minillm.llm import LLM
    from minillm.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            n=args.n,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_tokens=args.max_tokens,
            stop=args.stop,
        )
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        if args.stream:
            return _stream(llm, args.prompts, params)
        outputs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1)
    except (ValueError, FileNotFoundError) as err:
        print(f"minillm generate: {err}", file=sys.stderr)
        return 2
    for output in outputs:
        for completion in output.outputs:
            print(f"{output.prompt}{completion.text}")
            print()
        if args.metrics:
            _print_metrics(output)
    return 0


def _stream(llm, prompts: list[str], params) -> int:
    for prompt in prompts:
        print(prompt, end="", flush=True)
        for output in llm.stream(prompt, params):
            print(output.outputs[0].delta_text, end="", flush=True)
        print()
    return 0


def _print_metrics(output) -> None:
    m = output.metrics
    tpot = "n/a" if m.tpot_s is None else f"{m.tpot_s * 1e3:.1f} ms"
    print(
        f"[{output.request_id}] TTFT {m.ttft_s * 1e3:.1f} ms, TPOT {tpot}, "
        f"E2EL {m.e2el_s * 1e3:.1f} ms, {m.num_output_tokens} tokens",
        file=sys.stderr,
    )
