"""The `minillm generate` command: complete prompts from the command line.

    minillm generate "def fib(n):" --max-tokens 48 --temperature 0
    minillm generate "import os" "class Tree:" --model path/to/hf-dir

One prompt is streamed to the terminal as its tokens arrive; several prompts run as one
continuous batch and print when done. Every completion ends with a timing line on stderr:
time to first token, output tokens per second, and time per output token.

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
    parser.add_argument(
        "--no-stream", action="store_true", help="print a single prompt's text only when done"
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
        if len(args.prompts) == 1 and args.n == 1 and not args.no_stream:
            outputs = [_stream(llm, args.prompts[0], params)]
        else:
            outputs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1)
            for output in outputs:
                for completion in output.outputs:
                    print(f"{output.prompt}{completion.text}\n")
    except (ValueError, FileNotFoundError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"minillm generate: error: {message}", file=sys.stderr)
        return 2
    for output in outputs:
        _print_metrics(output)
    return 0


def _stream(llm, prompt: str, params):
    """Print the prompt, then each new piece of text as the engine produces it."""
    stream = llm.stream(prompt, params)
    output = next(stream)  # a bad prompt raises here, before anything is printed
    print(prompt + output.outputs[0].delta_text, end="", flush=True)
    for output in stream:
        print(output.outputs[0].delta_text, end="", flush=True)
    print(flush=True)
    return output


def _print_metrics(output) -> None:
    """The timing line: TTFT, output tokens/s over the whole request, and TPOT."""
    m = output.metrics
    tokens_per_s = m.num_output_tokens / m.e2el_s if m.e2el_s > 0 else float("inf")
    tpot = "" if m.tpot_s is None else f", TPOT {m.tpot_s * 1e3:.1f} ms"
    print(
        f"[{m.num_output_tokens} tokens in {m.e2el_s:.2f} s: TTFT {m.ttft_s * 1e3:.1f} ms, "
        f"{tokens_per_s:.1f} tokens/s{tpot}]",
        file=sys.stderr,
    )
