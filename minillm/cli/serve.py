"""The `minillm serve` command: an OpenAI-compatible server for one model.

    minillm serve                                   # the bundled model on 127.0.0.1:8000
    minillm serve path/to/hf-dir --port 8080 --max-num-seqs 16 --api-key secret

Engine options keep vLLM's flag names. The server binds to the loopback address unless
--host says otherwise (0.0.0.0 exposes it to the network: set --api-key then).
"""

from __future__ import annotations

import argparse

# EngineArgs fields the command line passes through: (flag, type, help)
ENGINE_OPTIONS = (
    ("dtype", str, "float32, bfloat16 or float16 (default: the checkpoint's)"),
    ("device", str, "cpu or cuda (default: cuda if available)"),
    ("block-size", int, "tokens per KV-cache block"),
    ("max-num-seqs", int, "most requests in one batch"),
    ("max-num-batched-tokens", int, "token budget of one step"),
    ("max-model-len", int, "longest prompt + output, in tokens"),
    ("num-gpu-blocks", int, "KV-cache pool size in blocks"),
    ("kv-cache-memory-bytes", int, "KV-cache pool size in bytes"),
    ("gpu-memory-utilization", float, "share of GPU memory the engine may fill"),
    ("attention-backend", str, "torch or triton"),
    ("scheduling-policy", str, "fcfs, priority or sjf"),
    ("prefix-caching-algo", str, "hash or radix"),
    ("seed", int, "seed of the shared sampling generator"),
    ("max-loras", int, "most LoRA adapters in one batch"),
    ("max-lora-rank", int, "highest rank of a LoRA adapter"),
    ("max-cpu-loras", int, "LoRA adapters kept loaded (default: max-loras)"),
    ("tensor-parallel-size", int, "worker processes the model's heads and widths are split over"),
    ("pipeline-parallel-size", int, "worker processes the model's layers are split over"),
)
ENGINE_FLAGS = (
    ("enable-prefix-caching", "reuse the KV of shared prompt prefixes"),
    ("enable-chunked-prefill", "split long prompts over several steps"),
    ("enable-lora", "serve LoRA adapters beside the base model"),
    ("enable-expert-parallel", "with tensor parallelism: spread MoE experts whole over ranks"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument(
        "model", nargs="?", default=None, help="model directory or name (default: bundled)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1; repeat for several keys (with a rate "
        "limit, each key has its own bucket)",
    )
    p.add_argument("--served-model-name", default=None, help="the name clients use as model")
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="requests that may wait to be scheduled; past it, 503 with Retry-After",
    )
    p.add_argument(
        "--rate-limit-tokens-per-minute",
        type=float,
        default=None,
        help="a token bucket per API key: prompt + max_tokens reserved, unused part given "
        "back; past it, 429 with Retry-After (default: no limit)",
    )
    p.add_argument(
        "--rate-limit-burst-tokens",
        type=float,
        default=None,
        help="tokens a key may spend at once (default: a minute's worth)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="a larger request body is answered 413 unread (default: 8 MiB)",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="web origins (https://host:port, or *) whose pages may call the API from a "
        "browser (CORS; default: none)",
    )
    p.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=None,
        metavar="HOST",
        help="host names the server answers to besides localhost, IP addresses and --host "
        "(a request whose Host header names another gets 400: a defence against DNS "
        "rebinding; * for any)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        help="seconds running requests may go on after SIGTERM or Ctrl-C before they are "
        "ended with an error (streams: an error event and [DONE]; default: 5)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) clients select with model=NAME; needs --enable-lora",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    engine = p.add_argument_group("engine options (as in vLLM)")
    for flag, kind, help_text in ENGINE_OPTIONS:
        engine.add_argument(f"--{flag}", type=kind, default=None, help=help_text)
    for flag, help_text in ENGINE_FLAGS:
        engine.add_argument(
            f"--{flag}", action=argparse.BooleanOptionalAction, default=None, help=help_text
        )
    engine.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs (GPU), no traced decode (CPU)"
    )
    p.set_defaults(func=_run)


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineArgs fields given on the command line (the others keep their defaults)."""
    names = [flag for flag, _, _ in ENGINE_OPTIONS] + [flag for flag, _ in ENGINE_FLAGS]
    options = {
        name.replace("-", "_"): getattr(args, name.replace("-", "_"))
        for name in names
        if getattr(args, name.replace("-", "_")) is not None
    }
    if args.enforce_eager:
        options["enforce_eager"] = True
    return options


def server_options(args: argparse.Namespace) -> dict:
    """The server options given on the command line whose defaults live in the server."""
    names = ("max_request_body_bytes", "shutdown_timeout", "allowed_origins", "allowed_hosts")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _run(args: argparse.Namespace) -> int:
    from minillm.serve.server import serve_forever

    serve_forever(
        args.model,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
        rate_limit_tokens_per_minute=args.rate_limit_tokens_per_minute,
        rate_limit_burst_tokens=args.rate_limit_burst_tokens,
        lora_modules=args.lora_modules,
        **server_options(args),
        **engine_options(args),
    )
    return 0
