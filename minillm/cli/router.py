"""The `minillm router` command: one address in front of several `minillm serve` replicas.

    minillm router --replica http://127.0.0.1:8001 http://127.0.0.1:8002 --policy prefix_aware

See minillm.serve.router for the policies and what is passed through.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from minillm.serve.router import (
        DEFAULT_BALANCE_ABS_THRESHOLD,
        DEFAULT_BALANCE_REL_THRESHOLD,
        DEFAULT_PREFIX_CHARS,
        DEFAULT_VIRTUAL_NODES,
        POLICIES,
    )

    p = subparsers.add_parser("router", help="route requests over several minillm serve replicas")
    p.add_argument(
        "--replica",
        action="extend",
        nargs="+",
        required=True,
        metavar="URL",
        help="a replica's URL (http://host:port); repeat or list several",
    )
    p.add_argument("--policy", choices=POLICIES, default="round_robin")
    p.add_argument(
        "--prefix-chars",
        type=int,
        default=DEFAULT_PREFIX_CHARS,
        help="prefix_aware: characters of the prompt hashed to choose the replica",
    )
    p.add_argument(
        "--virtual-nodes",
        type=int,
        default=DEFAULT_VIRTUAL_NODES,
        help="prefix_aware: points of each replica on the hash ring",
    )
    p.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=DEFAULT_BALANCE_ABS_THRESHOLD,
        help="prefix_aware: requests in flight by which the busiest replica must lead the "
        "least busy one (and --balance-rel-threshold times) before affinity yields to load",
    )
    p.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=DEFAULT_BALANCE_REL_THRESHOLD,
        help="prefix_aware: the busiest replica's load over the least busy one's (see above)",
    )
    p.add_argument(
        "--rate-limit-tokens-per-minute",
        type=float,
        default=None,
        help="a token bucket per API key for the whole deployment, kept here: prompt + n * "
        "max_tokens reserved, unused part given back; past it, 429 with Retry-After",
    )
    p.add_argument(
        "--rate-limit-burst-tokens",
        type=float,
        default=None,
        help="tokens a key may spend at once (default: a minute's worth)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1, checked here; repeat for several "
        "keys. With a rate limit, each key has its own bucket; without keys, one for all",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for a replica's answer (between two reads of a stream); past it, 504",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="MODEL_OR_PATH",
        help="the replicas' model (a bundled name or a local directory), whose tokenizer and "
        "chat template count a request's tokens (default: the bundled model)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the replicas' --max-model-len, for max_tokens left unset (default: theirs)",
    )
    p.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=None,
        metavar="HOST",
        help="host names the router answers to besides localhost, IP addresses and --host "
        "(a request whose Host header names another gets 400: a defence against DNS "
        "rebinding; * for any)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from minillm.serve.router import route_forever

    route_forever(
        args.replica,
        args.policy,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        prefix_chars=args.prefix_chars,
        virtual_nodes=args.virtual_nodes,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        rate_limit_tokens_per_minute=args.rate_limit_tokens_per_minute,
        rate_limit_burst_tokens=args.rate_limit_burst_tokens,
        tokenizer=args.tokenizer,
        max_model_len=args.max_model_len,
        api_key=args.api_key,
        timeout_s=args.request_timeout,
        allowed_hosts=args.allowed_hosts,
    )
    return 0
