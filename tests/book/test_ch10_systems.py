"""The checks of chapter 10's exercises reject plausible wrong answers.

As for the other chapters: the solution's non-graded cells run in this process, then each
graded cell runs with the solution (it must pass), with the stub (NotImplementedError), and
with each wrong answer in the solution's place (it must fail with an AssertionError). Every
check meets at least a plausible slip of the formula or the mechanism, and where it applies
a hard-coded answer, a right answer of the wrong type, and an answer that modifies its input.
"""

from __future__ import annotations

import fractions
import math

from minillm.serve.router import stable_hash

from .conftest import ROOT
from .exercise_checks import ExerciseChecks, FromNamespace

# -- exercise 1: least outstanding ---------------------------------------------------------


def least(key=min, use_turn=True, only_known=False, mutate=False, as_index=False):
    def pick_least_outstanding(candidates, outstanding, turn):
        pool = [c for c in candidates if c in outstanding] if only_known else candidates
        pool = pool or candidates
        best = key(outstanding.get(c, 0) for c in pool)
        n = len(pool)
        start = turn if use_turn else 0
        for step in range(n):
            i = (start + step) % n
            if outstanding.get(pool[i], 0) == best:
                if mutate:
                    outstanding[pool[i]] = outstanding.get(pool[i], 0) + 1
                return candidates.index(pool[i]) if as_index else pool[i]

    return pick_least_outstanding


# -- exercises 2 and 3: the ring --------------------------------------------------------------


def ring(rule="after", hasher=stable_hash, mutate=False):
    def ring_lookup(nodes, key, virtual_nodes):
        if not nodes:
            return None
        if rule == "modulo":
            return nodes[hasher(key) % len(nodes)]
        points = sorted((hasher(f"{n}#{i}"), n) for n in nodes for i in range(virtual_nodes))
        h = hasher(key)
        if mutate:
            nodes.reverse()
        if rule == "before":
            below = [n for p, n in points if p <= h]
            return below[-1] if below else points[-1][1]
        for point, node in points:
            if point >= h:
                return node
        return points[-1][1] if rule == "no wrap" else points[0][1]

    return ring_lookup


def python_hash(text):
    return hash(("salt", text)) % 2**64


def moved(kind):
    def moved_fraction(nodes, new_node, keys, virtual_nodes):
        if kind == "formula":
            return 1 / (len(nodes) + 1)
        after = [*nodes, new_node]
        lookup = ring()
        count = sum(
            lookup(nodes, k, virtual_nodes) != lookup(after, k, virtual_nodes) for k in keys
        )
        if kind == "appends":
            nodes.append(new_node)
        if kind == "count":
            return count
        if kind == "stayed":
            return 1 - count / len(keys)
        return count / len(keys)

    return moved_fraction


# -- exercise 4: the batch -------------------------------------------------------------------


def batch(tpot_prefill=True, ttft=True, pick="best", none_as=None, as_rate=False):
    def best_batch(decode_step_s, prefill_s, max_batch, output_len, tpot_slo_s, ttft_slo_s):
        best, best_x = none_as, -1.0
        for b in range(1, max_batch + 1):
            t_d = decode_step_s(b)
            x = b / (output_len * t_d + b * prefill_s)
            tpot = t_d + (b * prefill_s / output_len if tpot_prefill else 0.0)
            ok = tpot <= tpot_slo_s and (not ttft or prefill_s + t_d <= ttft_slo_s)
            if ok and pick == "first":
                return x if as_rate else b
            if ok and x > best_x:
                best, best_x = (x if as_rate else b), x
        return best

    return best_batch


# -- exercise 8: warm pool ---------------------------------------------------------------------


def pool(from_zero=False, newest=False, as_tuple=False, pops=False):
    def warm_pool_waits(arrivals, service_s, warm, cold_start_s):
        free_at = [(0.0, i) for i in range(warm)]
        waits = []
        queue = arrivals if pops else list(arrivals)
        while queue:
            t = queue.pop(0)
            launched = None
            if not free_at or min(free_at)[0] > t:
                launched = (t + cold_start_s, len(free_at))
                free_at.append(launched)
            ready, replica = launched if newest and launched else min(free_at)
            free_at.remove((ready, replica))
            start = max(t, ready)
            waits.append(start if from_zero else start - t)
            free_at.append((start + service_s, replica))
        return tuple(waits) if as_tuple else waits

    return warm_pool_waits


# -- exercise 9: the bucket --------------------------------------------------------------------


def bucket(**methods):
    return FromNamespace(lambda ns: type("WrongBucket", (ns["Bucket"],), methods))


def _uncapped_level(self):
    now = self.clock()
    self._level += (now - self._stamp) * self.rate
    self._stamp = now
    return self._level


def _take_partial(self, tokens):
    if tokens > self.burst + 1e-9:
        return math.inf
    missing = tokens - self.level
    self._level = max(0.0, self._level - tokens)
    return 0.0 if missing <= 1e-9 else missing / self.rate


def _wait_whole(self, tokens):
    if tokens > self.burst + 1e-9:
        return math.inf
    if tokens - self.level <= 1e-9:
        self._level -= tokens
        return 0.0
    return tokens / self.rate


def _no_inf(self, tokens):
    missing = tokens - self.level
    if missing <= 1e-9:
        self._level = max(0.0, self._level - tokens)
        return 0.0
    return missing / self.rate


def _give_uncapped(self, tokens):
    self._level = self.level + tokens


def _starts_empty(self, rate, burst, clock):
    self.rate, self.burst, self.clock = float(rate), float(burst), clock
    self._level, self._stamp = 0.0, clock()


# -- exercise 10: the allocator ----------------------------------------------------------------


def allocator(**methods):
    return FromNamespace(lambda ns: type("WrongAllocator", (ns["Allocator"],), methods))


def _free_to_head(self, ids):
    for i in ids:
        if self.refs[i] < 1:
            raise ValueError(f"block {i} is already free")
        self.refs[i] -= 1
        if self.refs[i] == 0:
            self.free_list.insert(0, i)


def _free_ignoring_refs(self, ids):
    for i in ids:
        if self.refs[i] < 1:
            raise ValueError(f"block {i} is already free")
        self.refs[i] = 0
        if i not in self.free_list:
            self.free_list.append(i)


def _allocate_what_is_there(self, n):
    ids, self.free_list = self.free_list[:n], self.free_list[n:]
    for i in ids:
        self.refs[i] = 1
    return ids


def _free_twice_silently(self, ids):
    for i in ids:
        self.refs[i] -= 1
        if self.refs[i] == 0:
            self.free_list.append(i)


def _fork_nothing(self, ids):
    return None


def _free_and_clear(self, ids):
    type(self).__mro__[1].free(self, ids)
    ids.clear()


# -- exercise 11: copy-on-write ----------------------------------------------------------------


def cow(always=False, keep_ref=False, mutate=False, drop_all=False, as_tuple=False):
    def write_block(alloc, table, index):
        block = table[index]
        if alloc.ref_cnt(block) == 1 and not always:
            return tuple(table) if as_tuple else list(table)
        (new,) = alloc.allocate(1)
        if drop_all:
            while alloc.ref_cnt(block) > 0:
                alloc.free([block])
        elif not keep_ref:
            alloc.free([block])
        out = table if mutate else list(table)
        out[index] = new
        return tuple(out) if as_tuple else out

    return write_block


WRONG_ANSWERS = {
    "pick_least_outstanding": {
        "most outstanding": least(key=max),
        "ties to the first candidate": least(use_turn=False),
        "only replicas in the dict": least(only_known=True),
        "counts the choice in `outstanding`": least(mutate=True),
        "an index": least(as_index=True),
        "hard-coded": lambda candidates, outstanding, turn: "b",
    },
    "ring_lookup": {
        "modulo hash": ring(rule="modulo"),
        "the point before": ring(rule="before"),
        "no wrap-around": ring(rule="no wrap"),
        "Python's salted hash": ring(hasher=python_hash),
        "reverses `nodes`": ring(mutate=True),
        "hard-coded": lambda nodes, key, virtual_nodes: nodes[0] if nodes else None,
    },
    "moved_fraction": {
        "the 1/(N+1) formula": moved("formula"),
        "a count": moved("count"),
        "the keys that stayed": moved("stayed"),
        "appends to `nodes`": moved("appends"),
        "hard-coded": lambda nodes, new, keys, v: 0.2,
    },
    "best_batch": {
        "TPOT without the prefills": batch(tpot_prefill=False),
        "ignores the TTFT": batch(ttft=False),
        "the first batch that meets": batch(pick="first"),
        "0 when none meets": batch(none_as=0),
        "the requests/s": batch(as_rate=True),
        "hard-coded": lambda *args: 100,
    },
    "replicas_for": {
        "rounded": lambda t, r, u: round(t / (r * u)),
        "floor plus one": lambda t, r, u: int(t / (r * u)) + 1,
        "ignores utilization": lambda t, r, u: math.ceil(t / r),
        "multiplies by utilization": lambda t, r, u: math.ceil(t * u / r),
        "a float": lambda t, r, u: float(math.ceil(t / (r * u))),
        "hard-coded": lambda t, r, u: 2,
    },
    "cost_per_million": {
        "per hour": lambda price, rate: 1e6 * price / rate,
        "per thousand": lambda price, rate: 1e3 * price / 3600 / rate,
        "divides by 60": lambda price, rate: 1e6 * price / 60 / rate,
        "a Fraction": lambda price, rate: fractions.Fraction(1e6 * price / 3600 / rate),
        "hard-coded": lambda price, rate: 1.0,
    },
    "fleet_cost_per_million": {
        "one replica paid": lambda n, price, rate: price / 3600 / rate * 1e6,
        "per hour": lambda n, price, rate: n * price / rate * 1e6,
        "rounded to a whole": lambda n, price, rate: round(n * price / 3600 / rate * 1e6),
        "hard-coded": lambda n, price, rate: 1.0,
    },
    "warm_pool_waits": {
        "waits from time 0": pool(from_zero=True),
        "served by the replica it launched": pool(newest=True),
        "a tuple": pool(as_tuple=True),
        "pops from `arrivals`": pool(pops=True),
        "hard-coded": lambda arrivals, service, warm, cold: [0.0, 0.5],
    },
    "Bucket": {
        "refills past the burst": bucket(level=property(_uncapped_level)),
        "a refused request takes what is there": bucket(try_take=_take_partial),
        "waits for the whole request": bucket(try_take=_wait_whole),
        "no inf past the burst": bucket(try_take=_no_inf),
        "gives back past the burst": bucket(give_back=_give_uncapped),
        "starts empty": bucket(__init__=_starts_empty),
    },
    "Allocator": {
        "freed blocks to the head": allocator(free=_free_to_head),
        "free ignores reference counts": allocator(free=_free_ignoring_refs),
        "allocates what is there": allocator(allocate=_allocate_what_is_there),
        "double free accepted": allocator(free=_free_twice_silently),
        "fork takes no reference": allocator(fork=_fork_nothing),
        "clears the caller's ids": allocator(free=_free_and_clear),
    },
    "write_block": {
        "always copies": cow(always=True),
        "keeps the shared reference": cow(keep_ref=True),
        "drops every reference": cow(drop_all=True),
        "changes the table in place": cow(mutate=True),
        "a tuple": cow(as_tuple=True),
        "hard-coded": lambda alloc, table, index: [0, 1, 3],
    },
}


class TestChecks(ExerciseChecks):
    SOLUTION = ROOT / "solutions" / "ch10_systems.ipynb"
    EXERCISE = ROOT / "exercises" / "ch10_systems.ipynb"
    POINTS = [2, 3, 2, 3, 2, 2, 2, 3, 3, 3, 3]
    WRONG_ANSWERS = WRONG_ANSWERS
