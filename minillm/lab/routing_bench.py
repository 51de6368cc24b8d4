"""Routing policies compared on a multi-tenant shared-prefix workload.

Several `minillm serve` replicas (in this process, each its own engine) stand behind one
`minillm router`; the chapter 9 load generator sends an open-loop workload in which each
tenant's requests share a long prefix (its system prompt) and add a short question. For
each policy in turn (round robin, least outstanding, prefix-aware) the same workload runs
with a fresh salt, so no run finds blocks the previous one cached, and we read:

- the prefix-cache hit rate: the increase of `vllm:prefix_cache_hits_total` over that of
  `vllm:prefix_cache_queries_total`, summed over the replicas' /metrics (prompt tokens found
  in a cache over prompt tokens looked up);
- TTFT and E2EL percentiles as the client measured them, and requests per replica.

Round robin and least outstanding spread each tenant over every replica, so each replica
pays the first, uncached prefill of every tenant; prefix-aware sends a tenant to one
replica, which pays it once. Speed is measured, not asserted: nothing here has a threshold.

    python -m minillm.lab.routing_bench --json benchmarks/results/routing_cpu.json
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

import httpx
import numpy as np

from minillm.lab import loadgen
from minillm.serve import start_server
from minillm.serve.router import POLICIES, run_router

ENGINE_OPTIONS = {"max_model_len": 256, "max_num_seqs": 8, "enable_prefix_caching": True}


@dataclasses.dataclass
class PolicyRun:
    """One policy's run: the cache counters' increase and the client's latencies."""

    policy: str
    round: int
    prefix_cache_queries: float
    prefix_cache_hits: float
    requests_per_replica: dict[str, float]
    completed: int
    failed: int
    ttft_s: dict
    e2el_s: dict

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "prefix_cache_hit_rate": self.prefix_cache_hit_rate}


def counter_total(metrics_text: str, name: str) -> float:
    """The sum of a counter's samples (all label sets) in Prometheus text."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def cache_counters(urls: Sequence[str]) -> tuple[float, float]:
    """(prefix-cache queries, hits) summed over the replicas at `urls`."""
    queries = hits = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=30).text
        queries += counter_total(text, "vllm:prefix_cache_queries_total")
        hits += counter_total(text, "vllm:prefix_cache_hits_total")
    return queries, hits


def tenant_sessions(
    num_tenants: int, requests_per_tenant: int, prefix_len: int, suffix_len: int,
    output_len: int, seed: int, tokenizer=None,
) -> list[loadgen.Session]:  # fmt: skip
    """Each tenant's requests share a prefix of prefix_len tokens, in a shuffled order (in
    tenant order, round robin over as many replicas as divide the tenants would send every
    tenant to one replica by accident)."""
    sessions = loadgen.shared_prefix_sessions(
        num_tenants * requests_per_tenant, num_tenants, prefix_len, suffix_len, output_len,
        seed, tokenizer,
    )  # fmt: skip
    order = np.random.default_rng(seed).permutation(len(sessions))
    return [sessions[i] for i in order]


def compare_routing_policies(
    *,
    num_replicas: int = 2,
    policies: Sequence[str] = POLICIES,
    rounds: int = 1,
    num_tenants: int = 8,
    requests_per_tenant: int = 4,
    prefix_len: int = 96,
    suffix_len: int = 16,
    output_len: int = 8,
    request_rate: float = 4.0,
    seed: int = 0,
    engine_options: dict | None = None,
) -> list[PolicyRun]:
    """Start `num_replicas` replicas of the bundled model and a router; run the workload
    under each policy, `rounds` times, the order reversed every other round."""
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"policies must be among {POLICIES}, got {p!r}")
    options = {**ENGINE_OPTIONS, **(engine_options or {})}
    replicas = [start_server(None, port=0, **options) for _ in range(num_replicas)]
    try:
        urls = [r.url for r in replicas]
        tokenizer = replicas[0].engine.tokenizer
        sessions = tenant_sessions(
            num_tenants, requests_per_tenant, prefix_len, suffix_len, output_len, seed, tokenizer
        )
        runs = []
        with run_router(urls, policies[0]) as router:
            target = loadgen.Target(router.url, loadgen.server_model(router.url))
            loadgen.warm_up(target, 2 * num_replicas)
            for k in range(rounds):
                order = list(policies) if k % 2 == 0 else list(reversed(policies))
                for policy in order:
                    router.router.policy = policy
                    before_q, before_h = cache_counters(urls)
                    before_r = dict(router.router.requests_total)
                    result = loadgen.run(target, sessions, request_rate=request_rate, seed=seed)
                    after_q, after_h = cache_counters(urls)
                    summary = loadgen.summarize(result)
                    runs.append(
                        PolicyRun(
                            policy,
                            k,
                            after_q - before_q,
                            after_h - before_h,
                            {
                                u: router.router.requests_total[u] - before_r[u]
                                for u in router.router.replicas
                            },
                            summary["completed"],
                            summary["failed"],
                            summary["ttft_s"],
                            summary["e2el_s"],
                        )
                    )
        return runs
    finally:
        for r in replicas:
            r.stop()


def main(argv: list[str] | None = None) -> None:
    import argparse
    import importlib.metadata
    import json
    import statistics

    from minillm.lab.bench import machine_record

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--requests-per-tenant", type=int, default=4)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--json", type=pathlib.Path, help="write the results here")
    args = parser.parse_args(argv)
    settings = {
        "num_replicas": args.replicas,
        "rounds": args.rounds,
        "num_tenants": args.tenants,
        "requests_per_tenant": args.requests_per_tenant,
        "request_rate": args.request_rate,
        "prefix_len": 96,
        "suffix_len": 16,
        "output_len": 8,
    }
    runs = compare_routing_policies(**settings)
    print("policy              round  hit rate  TTFT p50 ms  TTFT p90 ms  requests per replica")
    for r in runs:
        print(
            f"{r.policy:18s}  {r.round:5d}  {r.prefix_cache_hit_rate:8.3f}  "
            f"{r.ttft_s['p50'] * 1e3:11.1f}  {r.ttft_s['p90'] * 1e3:11.1f}  "
            f"{sorted(r.requests_per_replica.values())}"
        )
    means = {
        p: {
            "prefix_cache_hit_rate": statistics.fmean(
                r.prefix_cache_hit_rate for r in runs if r.policy == p
            ),
            "ttft_p50_s": statistics.fmean(r.ttft_s["p50"] for r in runs if r.policy == p),
        }
        for p in dict.fromkeys(r.policy for r in runs)
    }
    base = means.get("round_robin")
    for p, m in means.items():
        ratio = (
            f"  TTFT p50 / round robin's: {m['ttft_p50_s'] / base['ttft_p50_s']:.2f}"
            if base
            else ""
        )
        print(f"{p:18s} mean hit rate {m['prefix_cache_hit_rate']:.3f}{ratio}")
    if args.json:
        record = {
            **machine_record(),
            "minillm": importlib.metadata.version("minillm"),
            "settings": {**settings, "engine_options": ENGINE_OPTIONS},
            "means": means,
            "runs": [r.as_dict() for r in runs],
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
