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
from .variant_checks import PrivateVariantChecks

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
            if ok and pick == "largest":
                best = b
                continue
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


# -- exercise 10: the seat queue -------------------------------------------------------------


def seats(pick="first free", from_zero=False, as_tuple=False, mutate=False, in_turn=False):
    def seat_waits(arrivals_s, holds_s, seats):
        free_at = [0.0] * seats
        waits = []
        for n, (t, hold) in enumerate(zip(arrivals_s, holds_s, strict=True)):
            if in_turn:
                i = n % seats
            elif pick == "last free":
                i = max(range(seats), key=free_at.__getitem__)
            else:
                i = min(range(seats), key=free_at.__getitem__)
            start = max(t, free_at[i])
            waits.append(start if from_zero else start - t)
            free_at[i] = start + hold
        if mutate:
            holds_s.reverse()
        return tuple(waits) if as_tuple else waits

    return seat_waits


# -- exercise 11: multi-LoRA rows --------------------------------------------------------------


def lora(scale=True, negative_index=False, in_place=False, first_adapter=False, scale_base=False):
    def lora_rows(x, base_out, adapter_of_row, A, B, scaling):
        import torch

        out = base_out if in_place else base_out.clone()
        if scale_base:
            out = out * scaling
        present = set(adapter_of_row) if negative_index else set(adapter_of_row) - {-1}
        for a in sorted(present):
            chosen = adapter_of_row[0] if first_adapter and adapter_of_row[0] >= 0 else a
            rows = torch.tensor([i for i, r in enumerate(adapter_of_row) if r == a])
            delta = (x.index_select(0, rows) @ A[chosen].T) @ B[chosen].T
            delta = scaling * delta if scale else delta
            if in_place:
                out.index_add_(0, rows, delta)
            else:
                out = out.index_add(0, rows, delta)
        return out

    return lora_rows


# -- exercise 12: routing with a load guard ----------------------------------------------------


def router(rule="both", spill=True, allowed=True, mutate=False, strict=True):
    def route(key, candidates, outstanding, ring, turn, abs_threshold=32, rel_threshold=1.1):
        from minillm.serve.router import least_outstanding

        loads = [outstanding.get(c, 0) for c in candidates]
        busiest, idlest = max(loads), min(loads)
        ahead = busiest - idlest > abs_threshold if strict else busiest - idlest >= abs_threshold
        ratio = busiest > idlest * rel_threshold
        imbalanced = {"both": ahead and ratio, "either": ahead or ratio, "abs": ahead}[rule]
        if mutate:
            outstanding[candidates[0]] = outstanding.get(candidates[0], 0) + 1
        if spill and imbalanced:
            return least_outstanding(candidates, outstanding, turn)
        return ring.lookup(key, set(candidates).__contains__) if allowed else ring.lookup(key)

    return route


def _fleet_waste_at_plan_target(plan, target_rps):
    return plan.cost_per_million_tokens_at_target / plan.cost_per_million_tokens_full_load


def _ring_after(nodes, key, virtual_nodes):
    """The first point strictly after the key's hash (bisect_right)."""
    points = sorted((stable_hash(f"{n}#{i}"), n) for n in nodes for i in range(virtual_nodes))
    if not points:
        return None
    h = stable_hash(key)
    return next((n for p, n in points if p > h), points[0][1])


def _pool_busy_at_arrival(arrivals, service_s, warm, cold_start_s):
    """Counts a replica that frees exactly at an arrival as busy: launches one more."""
    free_at = [(0.0, i) for i in range(warm)]
    waits = []
    for t in arrivals:
        if not free_at or min(free_at)[0] >= t:
            free_at.append((t + cold_start_s, len(free_at)))
        ready, replica = min(free_at)
        free_at.remove((ready, replica))
        start = max(t, ready)
        waits.append(start - t)
        free_at.append((start + service_s, replica))
    return waits


def scaler(
    stabilize=True,
    rounding=math.ceil,
    cap=True,
    at_least_one=True,
    up_window=False,
    mutate=False,
    times_target=False,
):
    def fleet_after_sync(current, demand, seats, target_usage, recent_desired, max_replicas):
        need = demand * target_usage / seats if times_target else demand / (seats * target_usage)
        desired = rounding(need)
        desired = max(1, desired) if at_least_one else desired
        desired = min(max_replicas, desired) if cap else desired
        if mutate:
            recent_desired.append(desired)
        if up_window:
            return max([desired, *recent_desired])
        if not stabilize or desired >= current:
            return desired
        return min(current, max([desired, *recent_desired]))

    return fleet_after_sync


# -- exercise 14: overlap scheduling's two threads ---------------------------------------------


def overlap(kind="right", mutate=False, as_tuple=False):
    def overlapped_done(plan_s, forward_s, process_s):
        n = len(forward_s)
        if kind == "serial":  # no overlap: each step plans, runs and processes in turn
            t, done = 0.0, []
            for k in range(n):
                t += plan_s[k] + forward_s[k] + process_s[k]
                done.append(t)
            return done
        if kind == "max per step":  # the page's max(t_cpu, t_gpu) summed, no pipeline
            t, done = 0.0, []
            for k in range(n):
                t += max(plan_s[k] + process_s[k], forward_s[k])
                done.append(t)
            return done
        cpu = plan_s[0] if n else 0.0
        fwd_end = [0.0] * n
        if n:
            fwd_end[0] = cpu + forward_s[0]
        done = []
        for k in range(n):
            if k + 1 < n:
                cpu += plan_s[k + 1]
                if kind == "forwards in parallel":  # forward k + 1 does not wait for forward k
                    fwd_end[k + 1] = cpu + forward_s[k + 1]
                elif kind == "forward ignores its plan":  # starts before plan k + 1 is handed
                    fwd_end[k + 1] = fwd_end[k] + forward_s[k + 1]
                else:
                    fwd_end[k + 1] = max(fwd_end[k], cpu) + forward_s[k + 1]
            if kind == "processing does not wait":  # processes before forward k is done
                cpu += process_s[k]
            else:
                cpu = max(cpu, fwd_end[k]) + process_s[k]
            done.append(fwd_end[k] if kind == "forward ends" else cpu)
        if mutate:
            plan_s.reverse()
        return tuple(done) if as_tuple else done

    return overlapped_done


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
        "strictly after the hash": _ring_after,
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
        "the largest batch that meets": batch(pick="largest"),
        "0 when none meets": batch(none_as=0),
        "the requests/s": batch(as_rate=True),
        "hard-coded": lambda *args: 100,
    },
    "replicas_for": {
        "rounded": lambda t, r, u: round(t / (r * u)),
        "floor plus one": lambda t, r, u: int(t / (r * u)) + 1,
        "round(x + 0.5)": lambda t, r, u: round(t / (r * u) + 0.5),
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
    "fleet_waste": {
        "the plan's own target": _fleet_waste_at_plan_target,
        "fleet over output-only cost": lambda plan, target: (
            (plan.replicas * plan.price_per_gpu_hour / 3600 / (target * 1200) * 1e6)
            / plan.cost_per_million_output_tokens_full_load
        ),
        "hard-coded": lambda plan, target: 1.0,
    },
    "warm_pool_waits": {
        "a replica free at the arrival is busy": _pool_busy_at_arrival,
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
    "seat_waits": {
        "the seat freed last": seats(pick="last free"),
        "seats in turn": seats(in_turn=True),
        "waits from time 0": seats(from_zero=True),
        "a tuple": seats(as_tuple=True),
        "reverses `holds_s`": seats(mutate=True),
        "hard-coded": lambda arrivals, holds, n: [0, 0, 1, 0.5],
    },
    "lora_rows": {
        "no scaling": lora(scale=False),
        "base rows take the last adapter": lora(negative_index=True),
        "changes base_out in place": lora(in_place=True),
        "the first row's adapter for all": lora(first_adapter=True),
        "scales the base output too": lora(scale_base=True),
        "hard-coded": lambda x, base, rows, A, B, s: base,
    },
    "route": {
        "either rule spills": router(rule="either"),
        "only the absolute rule": router(rule="abs"),
        "never spills": router(spill=False),
        "ignores down replicas": router(allowed=False),
        "32 ahead already spills": router(strict=False),
        "counts the choice in `outstanding`": router(mutate=True),
    },
    "fleet_after_sync": {
        "no stabilization window": scaler(stabilize=False),
        "rounds down": scaler(rounding=math.floor),
        "floor plus one": scaler(rounding=lambda x: int(x) + 1),
        "ignores max_replicas": scaler(cap=False),
        "may scale to zero": scaler(at_least_one=False),
        "the window scales up too": scaler(up_window=True),
        "appends to `recent_desired`": scaler(mutate=True),
        "demand times the target": scaler(times_target=True),
    },
    "overlapped_done": {
        "no overlap": overlap(kind="serial"),
        "max(cpu, gpu) per step": overlap(kind="max per step"),
        "forwards in parallel": overlap(kind="forwards in parallel"),
        "a forward ignores its plan": overlap(kind="forward ignores its plan"),
        "processing does not wait for the forward": overlap(kind="processing does not wait"),
        "the forwards' ends": overlap(kind="forward ends"),
        "a tuple": overlap(as_tuple=True),
        "reverses `plan_s`": overlap(mutate=True),
        "hard-coded": lambda plan, forward, process: [13.0, 23.0, 33.0][: len(forward)],
    },
}


class TestChecks(PrivateVariantChecks, ExerciseChecks):
    SOLUTION = ROOT / "solutions" / "ch10_systems.ipynb"
    EXERCISE = ROOT / "exercises" / "ch10_systems.ipynb"
    POINTS = [2, 3, 2, 3, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3]
    WRONG_ANSWERS = WRONG_ANSWERS
    # every function of data (Bucket is a class, fleet_waste reads the plan object)
    COPIED = [n for n in WRONG_ANSWERS if n not in ("Bucket", "fleet_waste")]
