"""Soak the engine with random fault scenarios for a while: `python -m tests.faults.soak
--minutes N` (from the repository root).

Each scenario is `scenarios.run_scenario(seed, ...)` with the next seed, so any failure it
prints can be replayed alone with `--seed S --count 1`. Exits 1 when any scenario found a
problem. The model is the tests' tiny random Llama (three layers, so that a pipelined
configuration can split them unevenly), built into a temporary directory.

With `--http`, the soak runs over HTTP instead: `--clients` concurrent streaming clients
against a `minillm serve` process of the bundled model, checks every `--check-every`
requests, and a SIGTERM drain at the end (see tests.faults.http_soak); `--record PATH`
writes the results as JSON, with the command that produced them.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import random
import sys
import tempfile
import time

import torch

from tests.engine.tiny_llama import build_tiny_llama
from tests.faults.scenarios import ALL_CONFIGS, NUM_LAYERS, make_env, run_scenario


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to run")
    parser.add_argument("--seed", type=int, default=None, help="first seed (default: random)")
    parser.add_argument("--count", type=int, default=None, help="stop after this many")
    parser.add_argument("--http", action="store_true", help="soak `minillm serve` over HTTP")
    parser.add_argument("--clients", type=int, default=50, help="--http: concurrent clients")
    parser.add_argument(
        "--check-every", type=int, default=200, help="--http: requests between idle checks"
    )
    parser.add_argument("--record", default=None, help="--http: write the results here (JSON)")
    args = parser.parse_args(argv)
    first = random.randrange(10**9) if args.seed is None else args.seed
    if args.http:
        return http_main(args, first, argv)
    # one thread, as the tests run (tests/conftest.py): with torch's default on a 2-core
    # machine, the forked worker processes of a pipelined configuration were seen to stall
    # once other configurations (async scheduling among them) had run in this process
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        env = make_env(build_tiny_llama(root / "model", num_hidden_layers=NUM_LAYERS), root)
        deadline = time.monotonic() + 60 * args.minutes
        runs: collections.Counter[str] = collections.Counter()
        failures: list[str] = []
        seed = first
        while time.monotonic() < deadline and (args.count is None or seed - first < args.count):
            config = random.Random(seed).choice(sorted(ALL_CONFIGS))
            try:
                problems = run_scenario(seed, env, config)
            except Exception as error:  # noqa: BLE001 - a scenario that raised is a problem too
                head = str(error).splitlines()[0] if str(error) else ""
                problems = [f"seed {seed} ({config}): raised {type(error).__name__}: {head}"]
            runs[config] += 1
            for problem in problems:
                print("FAIL", problem, flush=True)
            failures += problems
            seed += 1
    print(f"seeds {first}..{seed - 1}: {sum(runs.values())} scenarios, {len(failures)} problems")
    print("  by configuration: " + ", ".join(f"{c} {n}" for c, n in sorted(runs.items())))
    return 1 if failures else 0


def http_main(args: argparse.Namespace, seed: int, argv: list[str] | None) -> int:
    from tests.faults.http_soak import run_http_soak

    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        record = run_http_soak(args.minutes, args.clients, args.check_every, seed, workdir)
    given = sys.argv[1:] if argv is None else argv
    record = {"command": " ".join(["python -m tests.faults.soak", *given]), **record}
    print(json.dumps({k: v for k, v in record.items() if k != "all_checks"}, indent=1))
    if args.record:
        pathlib.Path(args.record).write_text(json.dumps(record, indent=1) + "\n")
    return 1 if record["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
