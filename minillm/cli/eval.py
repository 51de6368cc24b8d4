"""The `minillm eval` command: measure a model, float or quantized.

    minillm eval ppl
    minillm eval ppl --quantization int4 --quantization-method gptq
    minillm eval ppl --model path/to/gptq-checkpoint

`ppl` prints the perplexity on the model's held-out windows (`heldout_tokens.json` beside
it) and the bytes of its weights. With --quantization the float model is quantized after
loading (GPTQ and AWQ calibrate on standard library files that are not held out); a
directory whose config.json has a `quantization_config` is a pre-quantized checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="measure a model: perplexity, weight bytes")
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    ppl = kinds.add_parser("ppl", help="perplexity on the model's held-out windows")
    ppl.add_argument("--model", default=None, help="model directory or name (default: bundled)")
    ppl.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ppl.add_argument("--quantization", default=None, choices=["int8", "int4", "fp8", "w8a8"])
    ppl.add_argument(
        "--quantization-method", default="rtn", choices=["rtn", "gptq", "awq", "smoothquant"]
    )
    ppl.add_argument("--group-size", type=int, default=128, help="int4: inputs per scale")
    ppl.add_argument("--no-act-order", action="store_true", help="GPTQ: columns in their own order")
    ppl.add_argument("--calibration-tokens", type=int, default=8192)
    ppl.add_argument("--num-windows", type=int, default=None, help="default: all")
    ppl.set_defaults(func=_run_ppl)


def _run_ppl(args: argparse.Namespace) -> int:
    from minillm.model.loader import DEFAULT_MODEL, load_model
    from minillm.model.perplexity import heldout_windows, perplexity
    from minillm.model.quantization import (
        check_quantization_args,
        default_calibration,
        quantize_model,
        weight_bytes,
    )

    if args.quantization is not None:
        check_quantization_args(args.quantization, args.group_size, args.quantization_method)
    if args.num_windows is not None and args.num_windows < 1:
        raise ValueError(f"--num-windows must be >= 1, got {args.num_windows}")
    loaded = load_model(args.model or DEFAULT_MODEL, dtype=args.dtype)
    windows = heldout_windows(loaded.path)[: args.num_windows]
    label = args.dtype
    if args.quantization is not None:
        start = time.perf_counter()
        calibration = None
        if args.quantization_method != "rtn":
            calibration = default_calibration(loaded.path, args.calibration_tokens)
        quantize_model(
            loaded.model,
            args.quantization,
            args.group_size,
            args.quantization_method,
            calibration,
            not args.no_act_order,
        )
        label = f"{args.quantization} {args.quantization_method}"
        print(f"quantized in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    value = perplexity(loaded.model, windows)
    print(
        f"{loaded.path.name} ({label}): perplexity {value:.3f} over {windows.shape[0]} windows "
        f"of {windows.shape[1]} tokens; weights {weight_bytes(loaded.model) / 2**20:.2f} MiB"
    )
    return 0
