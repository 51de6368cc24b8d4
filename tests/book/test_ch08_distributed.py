"""The checks of chapter 8's exercises reject plausible wrong answers.

As for the other chapters: the solution's non-graded cells run in this process, then each
graded cell runs with the solution (it must pass), with the stub (NotImplementedError), and
with each wrong answer in the solution's place (it must fail with an AssertionError). Every
check meets at least a plausible slip of the formula or the mechanism, and where it applies
a hard-coded answer, a right answer of the wrong type, and an answer that modifies its input.
"""

from __future__ import annotations

import math
import time

import torch

from minillm.lab.collective_bench import AllReduceTiming

from .conftest import ROOT
from .exercise_checks import ExerciseChecks

# -- exercise 1: the tensor-parallel MLP --------------------------------------------------


def mlp_partials(rows_of, clobber=False, as_tuple=False, equal_shares=False):
    def tp_mlp(x, gate_w, up_w, down_w, tp):
        if equal_shares:
            whole = (torch.nn.functional.silu(x @ gate_w.T) * (x @ up_w.T)) @ down_w.T
            return [whole / tp for _ in range(tp)]
        partials = []
        for rank in range(tp):
            rows = rows_of(rank, tp, gate_w.shape[0])
            h = torch.nn.functional.silu(x @ gate_w[rows].T) * (x @ up_w[rows].T)
            partials.append(h @ down_w[:, rows].T)
        if clobber:
            x.zero_()
        return tuple(partials) if as_tuple else partials

    return tp_mlp


def contiguous(rank, tp, n):
    return slice(rank * n // tp, (rank + 1) * n // tp)


def interleaved(rank, tp, n):
    return slice(rank, n, tp)


# -- exercises 2 and 3: all-reduce bytes and time -----------------------------------------


def ar_bytes(factor, per_layer=2, bits=1, constant=None, as_tuple=False):
    def all_reduce_bytes_per_step(num_layers, hidden_size, num_tokens, tp, dtype_bytes):
        if constant is not None:
            return constant
        tensor = num_tokens * hidden_size * dtype_bytes
        got = bits * per_layer * num_layers * factor(tp) * tensor
        return (got, per_layer * num_layers) if as_tuple else got

    return all_reduce_bytes_per_step


RING = lambda p: 2 * (p - 1) / p  # noqa: E731


def ar_time(
    bytes_factor=RING,
    steps=lambda p: 2 * (p - 1),
    latency=True,
    scale=1.0,
    tree_levels=lambda p: math.ceil(math.log2(p)),
    constant=None,
):
    def all_reduce_time_s(num_bytes, num_ranks, bandwidth_bytes_per_s, latency_s, algorithm):
        if constant is not None:
            return constant
        if num_ranks == 1:
            return 0.0
        alpha = latency_s if latency else 0.0
        if algorithm == "ring":
            t = (
                steps(num_ranks) * alpha
                + bytes_factor(num_ranks) * num_bytes / bandwidth_bytes_per_s
            )
        else:
            t = 2 * tree_levels(num_ranks) * (alpha + num_bytes / bandwidth_bytes_per_s)
        return scale * t

    return all_reduce_time_s


# -- exercise 4: the pipeline schedule ----------------------------------------------------


def schedule_with(lag=1, extra_slots=0, as_tuple=False):
    def pipeline_schedule(num_stages, num_microbatches):
        slots = num_microbatches + lag * (num_stages - 1) + extra_slots
        grid = [
            [t - lag * s if 0 <= t - lag * s < num_microbatches else None for t in range(slots)]
            for s in range(num_stages)
        ]
        return tuple(tuple(stage) for stage in grid) if as_tuple else grid

    return pipeline_schedule


def bubble_over_m(schedule):
    p = len(schedule)
    m = len({j for stage in schedule for j in stage if j is not None})
    return (p - 1) / m


def busy_share(schedule):
    cells = [c for stage in schedule for c in stage]
    return sum(c is not None for c in cells) / len(cells)


# -- exercise 5: dispatch bytes -----------------------------------------------------------


def dispatch(owner_of, count="routes", bits=1, as_tensor=False, mutate=False):
    def dispatch_bytes(expert_ids, num_experts, ep, rank, hidden_size, dtype_bytes):
        per = num_experts // ep
        if mutate:
            expert_ids //= per
            owner = expert_ids
        else:
            owner = owner_of(expert_ids, per, ep)
        remote = owner != rank
        if count == "all":
            n = remote.numel()
        elif count == "tokens":
            n = remote.any(dim=1).sum()
        else:
            n = remote.sum()
        total = n * hidden_size * dtype_bytes * bits
        return total if as_tensor else int(total)

    return dispatch_bytes


# -- exercise 6: replicas -----------------------------------------------------------------


def replicas(key, sort_after=False, as_tuple=False, top_once=False):
    def replicas_for(loads, num_redundant):
        r = [1] * len(loads)
        if top_once:
            for e in sorted(range(len(loads)), key=lambda e: (-loads[e], e))[:num_redundant]:
                r[e] += 1
        else:
            for _ in range(num_redundant):
                r[max(range(len(loads)), key=lambda e: key(loads, r, e))] += 1
        if sort_after:
            loads.sort(reverse=True)
        return tuple(r) if as_tuple else r

    return replicas_for


PER_REPLICA = lambda loads, r, e: (loads[e] / r[e], -e)  # noqa: E731

# -- exercise 7: KV transfer --------------------------------------------------------------


def kv(factor=2, heads="kv", bits=1, latency=True, constant=None, as_dict=False):
    def kv_transfer(
        num_layers,
        num_attention_heads,
        num_kv_heads,
        head_dim,
        prompt_len,
        dtype_bytes,
        bandwidth_bytes_per_s,
        latency_s,
    ):
        if constant is not None:
            return constant
        h = num_kv_heads if heads == "kv" else num_attention_heads
        size = bits * factor * num_layers * h * head_dim * dtype_bytes * prompt_len
        seconds = (latency_s if latency else 0.0) + size / bandwidth_bytes_per_s
        return {"bytes": size, "seconds": seconds} if as_dict else (size, seconds)

    return kv_transfer


# -- exercise 8: pick a layout ------------------------------------------------------------


def picker(rule, sort_in_place=False, as_triple=False, strict=False):
    def pick_layout(estimates, itl_target_s):
        pool = estimates if rule == "ignores fits" else [e for e in estimates if e.fits]
        good = [
            e for e in pool if (e.step_s < itl_target_s if strict else e.step_s <= itl_target_s)
        ]
        if not good:
            return None
        if rule == "lowest latency":
            best = min(good, key=lambda e: e.step_s)
        elif rule == "first":
            best = good[0]
        elif rule == "larger tp":
            best = min(good, key=lambda e: (-e.tokens_per_s, -e.tp, e.pp))
        elif rule == "pp first":
            best = min(good, key=lambda e: (-e.tokens_per_s, e.pp, e.tp))
        else:
            best = min(good, key=lambda e: (-e.tokens_per_s, e.tp, e.pp))
        if sort_in_place:
            estimates.sort(key=lambda e: -e.tokens_per_s)
        return (best.tp, best.pp, best.dp) if as_triple else best

    return pick_layout


# -- exercise 9: vocabulary-parallel embedding --------------------------------------------


def lookup(mask=True, offset=True, shift_ids=False):
    def shard_lookup(token_ids, shard, start):
        ids = token_ids
        if shift_ids:
            token_ids -= start
            ids, start = token_ids, 0
        mine = (ids >= start) & (ids < start + shard.shape[0])
        if shard.shape[0] == 0:
            return torch.zeros(*ids.shape, shard.shape[1], dtype=shard.dtype)
        local = (ids - start) if offset else ids
        rows = shard[local.clamp(0, shard.shape[0] - 1)]
        return rows * mine.unsqueeze(-1).to(shard.dtype) if mask else rows

    return shard_lookup


def embedding(size_of=None, as_tuple=False, round_robin=False):
    def vocab_parallel_embedding(token_ids, weight, tp):
        vocab = weight.shape[0]
        size = size_of(vocab, tp) if size_of else -(-vocab // tp)
        partials = []
        for rank in range(tp):
            if round_robin:
                rows = weight[token_ids] * (token_ids % tp == rank).unsqueeze(-1).to(weight.dtype)
            else:
                lo = min(rank * size, vocab)
                hi = vocab if (size_of and rank == tp - 1) else min(lo + size, vocab)
                rows = lookup()(token_ids, weight[lo:hi], lo)
            partials.append(rows)
        return sum(partials), tuple(partials) if as_tuple else partials

    return vocab_parallel_embedding


def ring(skip_gather=False, count_elements=False, chunk_order=1, mutate=False):
    def ring_all_reduce(x, rank, world_size, send, recv):
        p = world_size
        chunks = list(x.chunk(p)) if mutate else [c.clone() for c in x.chunk(p)]
        sent = 0
        for k in range(p - 1):
            out, into = (rank - k) % p, (rank - chunk_order * (k + 1)) % p
            send(chunks[out], (rank + 1) % p)
            sent += chunks[out].numel() * (1 if count_elements else chunks[out].element_size())
            buffer = torch.empty_like(chunks[into])
            recv(buffer, (rank - 1) % p)
            if mutate:
                chunks[into] += buffer
            else:
                chunks[into] = chunks[into] + buffer
        if not skip_gather:
            for k in range(p - 1):
                out, into = (rank + 1 - k) % p, (rank - k) % p
                send(chunks[out], (rank + 1) % p)
                sent += chunks[out].numel() * (1 if count_elements else chunks[out].element_size())
                buffer = torch.empty_like(chunks[into])
                recv(buffer, (rank - 1) % p)
                chunks[into] = buffer
        return torch.cat(chunks), sent

    return ring_all_reduce


def all_reduce_by_gathering(x, rank, world_size, send, recv):
    """Everyone sends its whole tensor to everyone: right sum, (p - 1) n bytes."""
    for other in range(world_size):
        if other != rank:
            send(x, other)
    total = x.clone()
    for other in range(world_size):
        if other != rank:
            buffer = torch.empty_like(x)
            recv(buffer, other)
            total += buffer
    return total, (world_size - 1) * x.numel() * x.element_size()


def all_reduce_by_gathering_as_a_ring(x, rank, world_size, send, recv):
    """Everyone sends everything, and reports the bytes a ring would send."""
    total, _ = all_reduce_by_gathering(x, rank, world_size, send, recv)
    return total, 2 * (world_size - 1) * x.numel() // world_size * x.element_size()


def reversed_ring(x, rank, world_size, send, recv):
    """A ring run the other way round, each rank sending to the previous one: the right
    sums and bytes, but not the ring the exercise describes (the same at p = 2)."""
    mirrored = ring()
    order = [(-r) % world_size for r in range(world_size)]  # rank r plays rank -r

    def send_back(t, dst):
        send(t, order[dst])

    def recv_back(t, src):
        recv(t, order[src])

    return mirrored(x, order[rank], world_size, send_back, recv_back)


def ring_of_zeros():
    """A ring's pattern of messages carrying zeros; each rank sums the other ranks' inputs
    behind the wire's back (the ranks share the process, so it can)."""
    inputs: dict = {}

    def ring_all_reduce(x, rank, world_size, send, recv):
        mine = inputs.setdefault(world_size, {})
        mine[rank] = x.clone()
        chunk = x.numel() // world_size
        for _ in range(2 * (world_size - 1)):  # a barrier, too: all ranks have started
            send(torch.zeros(chunk, dtype=x.dtype), (rank + 1) % world_size)
            recv(torch.empty(chunk, dtype=x.dtype), (rank - 1) % world_size)
        total = sum(mine[r] for r in range(world_size))
        return total, 2 * (world_size - 1) * chunk * x.element_size()

    return ring_all_reduce


def ring_from_shared_inputs():
    """A ring's messages and sums worked out from every rank's input (the ranks share a
    process) rather than from what arrives: right while the wire delivers each message
    unchanged, wrong once it adds to them."""
    inputs: dict = {}
    calls: dict = {}

    def ring_all_reduce(x, rank, world_size, send, recv):
        p = world_size
        run = calls[p, rank] = calls.get((p, rank), 0) + 1
        mine = inputs.setdefault((p, run), {})
        mine[rank] = x.clone()
        for _ in range(10_000):  # every rank's input, or give up after 10 s
            if len(mine) == p:
                break
            time.sleep(0.001)
        chunks = [mine[r].chunk(p) for r in range(p)]
        for k in range(2 * (p - 1)):
            if k < p - 1:
                c = (rank - k) % p
                message = sum(chunks[(rank - j) % p][c] for j in range(k + 1))
            else:
                c = (rank + 1 - (k - p + 1)) % p
                message = sum(chunks[q][c] for q in range(p))
            send(message, (rank + 1) % p)
            recv(torch.empty_like(message), (rank - 1) % p)
        return sum(mine[r] for r in range(p)), 2 * (p - 1) * (x.numel() // p) * x.element_size()

    return ring_all_reduce


# -- exercise 10: fit and measurement -----------------------------------------------------


def end_points(xs, ys):
    i, j = xs.index(min(xs)), xs.index(max(xs))
    b = (ys[j] - ys[i]) / (xs[j] - xs[i])
    return ys[i] - b * xs[i], b


def through_origin(xs, ys):
    return 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)


def swapped(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return b, my - b * mx


SIZES = [4096, 65536, 2**20, 4 * 2**20]


def fake_timing(times, sizes=SIZES):
    return AllReduceTiming(
        2, "gloo", "2 CPU processes over gloo", list(sizes), list(times), list(times), list(times)
    )


def constant_timing(world_size):
    return 1e-3, 1e9, fake_timing([1e-3] * 4)


def two_sizes(world_size):
    sizes = [4096, 4 * 2**20]
    times = [4e-4 + 1e-9 * n for n in sizes]
    return 4e-4, 1e9, fake_timing(times, sizes)


def slope_as_bandwidth(world_size):
    times = [4e-4 + 1e-9 * n for n in SIZES]
    return 4e-4, 1e-9, fake_timing(times)


def alpha_from_smallest(world_size):
    times = [4e-4 + 1e-9 * n for n in SIZES]
    return times[0], 1e9, fake_timing(times)


WRONG_ANSWERS = {
    "tp_mlp": {
        "equal shares of the whole output": mlp_partials(contiguous, equal_shares=True),
        "interleaved rows": mlp_partials(interleaved),
        "modifies x": mlp_partials(contiguous, clobber=True),
        "a tuple": mlp_partials(contiguous, as_tuple=True),
    },
    "all_reduce_bytes_per_step": {
        "2x, not 2(p-1)/p": ar_bytes(lambda p: 2.0),
        "one all-reduce per layer": ar_bytes(RING, per_layer=1),
        "bits": ar_bytes(RING, bits=8),
        "whole tensor": ar_bytes(lambda p: 1.0),
        "hard-coded": ar_bytes(RING, constant=160 * 2 * 7 / 8 * 64 * 8192 * 2),
        "a tuple": ar_bytes(RING, as_tuple=True),
    },
    "all_reduce_time_s": {
        "2n / B": ar_time(bytes_factor=lambda p: 2.0),
        "p - 1 latency steps": ar_time(steps=lambda p: p - 1),
        "no latency": ar_time(latency=False),
        "milliseconds": ar_time(scale=1e3),
        "tree without ceil": ar_time(tree_levels=math.log2),
        "hard-coded": ar_time(constant=14 * 3e-6 + 1.75 * 2**20 / 450e9),
    },
    "pipeline_schedule": {
        "no dependencies": schedule_with(lag=0),
        "an idle slot too many": schedule_with(extra_slots=1),
        "two slots per stage": schedule_with(lag=2),
        "tuples": schedule_with(as_tuple=True),
    },
    "bubble_fraction": {
        "(p - 1) / m": bubble_over_m,
        "the busy share": busy_share,
    },
    "experts_per_rank": {
        "a float": lambda num_experts, ep: num_experts / ep,
        "no error": lambda num_experts, ep: num_experts // ep,
    },
    "dispatch_bytes": {
        "local routes too": dispatch(lambda ids, per, ep: ids // per, count="all"),
        "one copy per token": dispatch(lambda ids, per, ep: ids // per, count="tokens"),
        "round-robin placement": dispatch(lambda ids, per, ep: ids % ep),
        "bits": dispatch(lambda ids, per, ep: ids // per, bits=8),
        "a tensor": dispatch(lambda ids, per, ep: ids // per, as_tensor=True),
        "modifies expert_ids": dispatch(None, mutate=True),
    },
    "replicas_for": {
        "raw load": replicas(lambda loads, r, e: (loads[e], -e)),
        "one each to the busiest": replicas(None, top_once=True),
        "tie to the highest index": replicas(lambda loads, r, e: (loads[e] / r[e], e)),
        "sorts loads": replicas(PER_REPLICA, sort_after=True),
        "a tuple": replicas(PER_REPLICA, as_tuple=True),
        "hard-coded": lambda loads, n: [3, 1, 1, 1, 2, 1, 1, 2],
    },
    "kv_transfer": {
        "no factor 2": kv(factor=1),
        "query heads": kv(heads="query"),
        "bits": kv(bits=8),
        "no latency": kv(latency=False),
        "hard-coded": kv(constant=(2**30, 2**30 / 50e9)),
        "a dict": kv(as_dict=True),
    },
    "pick_layout": {
        "ignores fits": picker("ignores fits"),
        "lowest latency": picker("lowest latency"),
        "first that qualifies": picker("first"),
        "tie to the larger tp": picker("larger tp"),
        "ties by pp before tp": picker("pp first"),
        "strict < against the target": picker("best", strict=True),
        "sorts the list": picker("best", sort_in_place=True),
        "a (tp, pp, dp) tuple": picker("best", as_triple=True),
    },
    "shard_lookup": {
        "no mask": lookup(mask=False),
        "no offset": lookup(offset=False),
        "shifts the caller's ids": lookup(shift_ids=True),
    },
    "vocab_parallel_embedding": {
        "round-robin rows": embedding(round_robin=True),
        "floor size, the last rank takes the rest": embedding(
            size_of=lambda v, tp: max(v // tp, 1)
        ),
        "a tuple of partials": embedding(as_tuple=True),
    },
    "ring_all_reduce": {
        "no all-gather": ring(skip_gather=True),
        "elements, not bytes": ring(count_elements=True),
        "receives into the wrong chunk": ring(chunk_order=0),
        "adds into x's own storage": ring(mutate=True),
        "everyone sends everything": all_reduce_by_gathering,
        "everyone sends everything, a ring's bytes reported": all_reduce_by_gathering_as_a_ring,
        "a ring the other way round": reversed_ring,
        "zeros on the wire, sums behind its back": ring_of_zeros(),
        "messages from every rank's input, not from what arrives": ring_from_shared_inputs(),
    },
    "fit_line": {
        "through the end points": end_points,
        "through the origin": through_origin,
        "intercept and slope swapped": swapped,
    },
    "measure_link": {
        "constant timing": constant_timing,
        "two sizes": two_sizes,
        "slope as the bandwidth": slope_as_bandwidth,
        "alpha from the smallest size": alpha_from_smallest,
    },
}


class TestChecks(ExerciseChecks):
    SOLUTION = ROOT / "solutions" / "ch08_distributed.ipynb"
    EXERCISE = ROOT / "exercises" / "ch08_distributed.ipynb"
    POINTS = [3, 2, 2, 3, 3, 3, 2, 3, 4, 3, 5]
    WRONG_ANSWERS = WRONG_ANSWERS
