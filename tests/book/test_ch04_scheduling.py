"""The checks of the scheduling exercises reject plausible wrong answers.

As for chapter 0: the solution's cells define the functions, then each graded cell runs once
with the solution (it must pass), once with the stub (NotImplementedError), and once per
wrong answer (it must fail with an AssertionError).
"""

from __future__ import annotations

import math

from .conftest import ROOT
from .exercise_checks import ExerciseChecks

RIGHT_PLAN = [
    {"A": 6, "B": 2},
    {"A": 1, "B": 1, "C": 6},
    {"A": 1, "B": 1, "C": 4},
    {"B": 1, "C": 1},
    {"C": 1},
]


def waiting_first(running, waiting, budget, max_num_seqs):
    plan, n = [], len(running)
    for rid, left in waiting:
        if budget == 0 or n >= max_num_seqs:
            break
        plan.append((rid, min(left, budget)))
        budget -= plan[-1][1]
        n += 1
    for rid, left in running:
        if budget == 0:
            break
        plan.append((rid, min(left, budget)))
        budget -= plan[-1][1]
    return plan


def budget_rule(seats=True, chunk=True, share=True, reverse=False):
    """The right rule with one thing left out."""

    def step(running, waiting, budget, max_num_seqs):
        plan, n = [], len(running)
        for rid, left in reversed(running) if reverse else running:
            if budget == 0:
                break
            plan.append((rid, min(left, budget)))
            if share:
                budget -= plan[-1][1]
        for rid, prompt in waiting:
            if budget == 0 or (seats and n >= max_num_seqs):
                break
            if not chunk and prompt > budget:
                break
            plan.append((rid, min(prompt, budget)))
            if share:
                budget -= plan[-1][1]
            n += 1
        return plan

    return step


def idle(batch_width, longest):
    def count(output_lens, batch_size):
        total = 0
        for start in range(0, len(output_lens), batch_size):
            batch = output_lens[start : start + batch_size]
            width = batch_width(batch, batch_size)
            total += width * longest(batch, output_lens) - sum(batch)
        return total

    return count


def extended_in_place(samples, end_s):
    """Right value, but the caller's list gains a closing sample."""
    samples.append((end_s, 0))
    return sum(v * (b[0] - a) for (a, v), b in zip(samples, samples[1:], strict=False)) / end_s


def hold_next(samples, end_s):
    """Each interval takes the value of the sample that ends it."""
    total, previous_t = 0.0, 0.0
    for t, v in samples:
        total += v * (t - previous_t)
        previous_t = t
    return total / end_s


def admit(vllm_need, trt_need, sglang_strict=True, stop=True):
    def count(engine, prompts, max_new, capacity):
        left, admitted = capacity, 0
        for p, m in zip(prompts, max_new, strict=True):
            if engine == "vllm":
                need, fits = vllm_need(p, m), vllm_need(p, m) <= left
            elif engine == "trtllm":
                need, fits = trt_need(p, m), trt_need(p, m) <= left
            else:
                need = p + m
                fits = need < left if sglang_strict else need <= left
            if not fits:
                if stop:
                    break
                continue
            left -= need
            admitted += 1
        return admitted

    return count


def right_victim(engine, running):
    if engine == "vllm":
        return running[-1][0]
    return min(reversed(running), key=lambda r: (r[2], -r[1]))[0]


def plan_running_with(
    victim="newest",
    tie="newest",
    give_back_tokens=True,
    give_back_new=True,
    stop_on_self=True,
    skip=False,
    blocks="ceil",
    mutate=False,
):
    """The solution's plan_running with one mistake."""

    def plan_running(running, num_free_blocks, block_size, token_budget, policy):
        queue = [
            dict(zip(("id", "computed", "tokens", "blocks", "priority", "arrival"), r, strict=True))
            for r in running
        ]
        original = {r["id"]: r["blocks"] for r in queue}
        plan, preempted, free = [], [], num_free_blocks
        i = 0
        while (i if skip else len(plan)) < len(queue) and token_budget > 0:
            request = queue[i if skip else len(plan)]
            num_new = min(request["tokens"] - request["computed"], token_budget)
            if blocks == "ceil":
                needed = max(
                    0, math.ceil((request["computed"] + num_new) / block_size) - request["blocks"]
                )
            else:
                needed = math.ceil(num_new / block_size)
            if skip and needed > free:
                i += 1
                continue
            stop = False
            while needed > free:
                if policy == "priority":
                    pick = max if victim != "min" else min
                    if tie == "newest":
                        victim_r = pick(
                            reversed(queue), key=lambda r: (r["priority"], r["arrival"])
                        )
                    else:  # the first of the lowest priorities: the oldest among equals
                        victim_r = pick(queue, key=lambda r: r["priority"])
                elif victim == "oldest":
                    victim_r = queue[0]
                else:
                    victim_r = queue[-1]
                index = queue.index(victim_r)
                queue.remove(victim_r)
                free += victim_r["blocks"] if give_back_new else original[victim_r["id"]]
                preempted.append(victim_r["id"])
                if index < len(plan):
                    tokens = plan.pop(index)[1]
                    if give_back_tokens:
                        token_budget += tokens
                if victim_r is request:
                    stop = True
                    break
            if stop:
                if stop_on_self:
                    break
                continue
            free -= needed
            request["blocks"] += needed
            plan.append((request["id"], num_new))
            token_budget -= num_new
            i += 1
        if mutate:  # the preempted requests removed from the caller's list
            running[:] = [r for r in running if r[0] not in preempted]
        return plan, preempted

    return plan_running


WRONG_ANSWERS = {
    "my_plan": {
        "B not cut by the budget": lambda: [{"A": 6, "B": 3}, *RIGHT_PLAN[1:]],
        "waiting before running": lambda: [{"A": 6, "B": 2}, {"C": 8}, *RIGHT_PLAN[2:]],
        "decodes not charged to the budget": lambda: [
            {"A": 6, "B": 2},
            {"A": 1, "B": 1, "C": 8},
            {"A": 1, "B": 1, "C": 2},
            {"B": 1, "C": 1},
            {"C": 1},
        ],
        "first token one step late": lambda: [
            *RIGHT_PLAN[:3],
            {"A": 1, "B": 1, "C": 1},
            {"B": 1, "C": 1},
            {"C": 1},
        ],
        "one step short": lambda: RIGHT_PLAN[:-1],
    },
    "schedule_step": {
        "waiting first": waiting_first,
        "no seat limit": budget_rule(seats=False),
        "whole prompts only": budget_rule(chunk=False),
        "budget not shared": budget_rule(share=False),
        "newest running first": budget_rule(reverse=True),
    },
    "static_idle_slot_steps": {
        "last batch counted by its requests": idle(lambda b, s: len(b), lambda b, a: max(b)),
        "longest request of all": idle(lambda b, s: s, lambda b, a: max(a)),
        "busy slot-steps": lambda lens, size: sum(lens),
    },
    "littles_law": {
        "W = L * λ": lambda lam, w, n: lam * w if n is None else (n * lam if w is None else n / w),
        "L = λ / W": lambda lam, w, n: lam / w if n is None else (n / lam if w is None else n / w),
        "λ = L * W": lambda lam, w, n: lam * w if n is None else (n / lam if w is None else n * w),
    },
    "should_shed": {
        "at or above the target": lambda q, rate, slo: q / rate >= slo,
        "queue times rate": lambda q, rate, slo: q * rate > slo,
        "counts itself": lambda q, rate, slo: (q + 1) / rate > slo,
    },
    "gauge_time_average": {
        "plain mean of the samples": lambda s, end: sum(v for _, v in s) / len(s),
        "from the first sample": lambda s, end: (
            sum(v * ((s[k + 1][0] if k + 1 < len(s) else end) - t) for k, (t, v) in enumerate(s))
            / (end - s[0][0])
        ),
        "value of the next sample": hold_next,
        "samples extended in place": extended_in_place,
    },
    "pick_chunk_size": {
        "smallest that meets the target": lambda m, slo: min(
            (s for s, (p, _) in m.items() if p <= slo), default=None
        ),
        "strictly below the target": lambda m, slo: max(
            (s for s, (p, _) in m.items() if p < slo), default=None
        ),
        "largest overall": lambda m, slo: max(m),
        "fastest TTFT that meets the target": lambda m, slo: min(
            (s for s, (p, _) in m.items() if p <= slo), key=lambda s: m[s][1], default=None
        ),
    },
    "admitted_on_empty_pool": {
        "SGLang not strict": admit(lambda p, m: p, lambda p, m: p + m, sglang_strict=False),
        "TensorRT-LLM reserves the prompt only": admit(lambda p, m: p, lambda p, m: p),
        "vLLM reserves max_tokens": admit(lambda p, m: p + m, lambda p, m: p + m),
        "skips a request that does not fit": admit(lambda p, m: p, lambda p, m: p + m, stop=False),
    },
    "victim": {
        "vLLM takes the oldest": lambda e, r: r[0][0] if e == "vllm" else right_victim(e, r),
        "SGLang takes the most outputs": lambda e, r: (
            right_victim(e, r) if e == "vllm" else max(r, key=lambda x: x[2])[0]
        ),
        "SGLang ties by shortest prompt": lambda e, r: (
            right_victim(e, r) if e == "vllm" else min(r, key=lambda x: (x[2], x[1]))[0]
        ),
        "SGLang takes the oldest of a full tie": lambda e, r: (
            right_victim(e, r) if e == "vllm" else min(r, key=lambda x: (x[2], -x[1]))[0]
        ),
    },
    "plan_running": {
        "preempts the oldest": plan_running_with(victim="oldest"),
        "priority: the highest priority goes": plan_running_with(victim="min"),
        "priority: the oldest among equals goes": plan_running_with(tie="oldest"),
        "a planned victim keeps its tokens": plan_running_with(give_back_tokens=False),
        "a victim keeps this step's new blocks": plan_running_with(give_back_new=False),
        "goes on after preempting itself": plan_running_with(stop_on_self=False),
        "skips a request that does not fit": plan_running_with(skip=True),
        "blocks for the new tokens only": plan_running_with(blocks="new"),
        "removes victims from the caller's list": plan_running_with(mutate=True),
    },
}


class TestChecks(ExerciseChecks):
    SOLUTION = ROOT / "solutions" / "ch04_scheduling.ipynb"
    EXERCISE = ROOT / "exercises" / "ch04_scheduling.ipynb"
    POINTS = [2, 4, 3, 2, 3, 3, 3, 2, 5]
    WRONG_ANSWERS = WRONG_ANSWERS
