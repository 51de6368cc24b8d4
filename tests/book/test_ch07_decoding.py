"""The checks of chapter 7's exercises reject plausible wrong answers.

As for the other chapters: the solution's non-graded cells run in this process, then each
graded cell runs with the solution (it must pass), with the stub (NotImplementedError), and
with each wrong answer in the solution's place (it must fail with an AssertionError). Every
check meets at least a plausible slip of the formula or the mechanism, and where it applies
a hard-coded answer, a right answer of the wrong type, and an answer that modifies its input.
"""

from __future__ import annotations

import codecs

import torch

from minillm import LLM, SamplingParams

from .conftest import ROOT
from .exercise_checks import ExerciseChecks, FromNamespace

TARGET, DRAFT = "minillm-stdlib-target", "minillm-stdlib-draft"

# -- exercises 1 and 2: top-p and min-p ---------------------------------------------------


def top_p(rule="strictly above", normalize=True, in_place=False, as_list=False):
    def top_p_filter(probs, top_p):
        if rule == "index order":
            order = probs.argsort(descending=True, stable=True)
            keep = torch.zeros_like(probs, dtype=torch.bool)
            mass = 0.0
            for i in order.tolist():
                if mass < top_p or top_p >= 1:
                    keep[i] = True
                mass += float(probs[i])
        elif rule == "excludes the crossing token":
            keep = torch.stack([probs[probs > x].sum() + x <= top_p for x in probs])
            keep |= probs == probs.max()
        else:
            keep = torch.stack([probs[probs > x].sum() < top_p for x in probs]) | (top_p >= 1)
        if in_place:
            probs[~keep] = 0
            kept = probs
        else:
            kept = torch.where(keep, probs, torch.zeros_like(probs))
        out = kept / kept.sum() if normalize else kept
        return out.tolist() if as_list else out

    return top_p_filter


def min_p(relative_to_max=True, strict=False, normalize=True, in_place=False, as_list=False):
    def min_p_filter(probs, min_p):
        cutoff = min_p * probs.max() if relative_to_max else min_p
        keep = probs > cutoff if strict else probs >= cutoff
        if in_place:
            probs[~keep] = 0
            kept = probs
        else:
            kept = torch.where(keep, probs, torch.zeros_like(probs))
        out = kept / kept.sum() if normalize else kept
        return out.tolist() if as_list else out

    return min_p_filter


def hard_coded_top_p(probs, top_p):
    return torch.tensor([0.5, 0.3125, 0.1875, 0, 0], dtype=torch.float64)


def hard_coded_min_p(probs, min_p):
    return torch.tensor([0.40, 0.25, 0.15, 0.12, 0], dtype=torch.float64) / 0.92


# -- exercise 3: the residual -------------------------------------------------------------


def residual_with(clamp=True, norm="residual", empty="p", in_place=False, as_list=False):
    def residual(p, q):
        if in_place:
            r = p.sub_(q).clamp_(min=0)
        else:
            r = (p - q).clamp_min(0) if clamp else p - q
        total = r.sum()
        if total <= 0:
            out = p.clone() if empty == "p" else torch.full_like(p, 1 / p.numel())
        elif norm == "residual":
            out = r / total
        else:
            out = r
        return out.tolist() if as_list else out

    return residual


def correct_residual(p, q):
    r = (p - q).clamp_min(0)
    return p.clone() if r.sum() <= 0 else r / r.sum()


# -- exercise 4: one round of speculative sampling ----------------------------------------


def spec_step(
    accept="ratio",
    on_reject="residual",
    bonus="p",
    rows="same",
    uniform="each",
    as_tensor=False,
    mutate=False,
):
    def speculative_step(p, q, drafts, generator):
        out, k = [], len(drafts)
        round_u = torch.rand(1, generator=generator).item() if uniform == "round" else None
        for j, d in enumerate(drafts):
            # the target row draft j is checked against
            pj = {"same": p[j], "next": p[min(j + 1, k)], "first": p[0]}[rows]
            u = round_u if uniform == "round" else torch.rand(1, generator=generator).item()
            ok = u * q[j, d] < pj[d] if accept == "ratio" else bool(pj[d] >= q[j, d])
            if ok:
                out.append(d)
                continue
            if mutate:
                r = p[j].sub_(q[j]).clamp_(min=0)
                r = r / r.sum() if r.sum() > 0 else q[j]
            elif on_reject == "residual":
                r = correct_residual(pj, q[j])
            elif on_reject == "q minus p":
                r = (q[j] - pj).clamp_min(0)
                r = pj if r.sum() <= 0 else r
            elif on_reject == "unnormalized inverse cdf":
                # inverse-CDF sampling on max(0, p - q) without dividing by its sum
                r = (pj - q[j]).clamp_min(0)
                u = torch.rand(1, generator=generator, dtype=r.dtype)
                out.append(int(torch.searchsorted(r.cumsum(0), u).clamp_max(len(r) - 1)))
                return torch.tensor(out) if as_tensor else out
            else:
                r = pj
            out.append(int(torch.multinomial(r, 1, generator=generator)))
            return torch.tensor(out) if as_tensor else out
        if bonus == "p":
            out.append(int(torch.multinomial(p[k], 1, generator=generator)))
        elif bonus == "q":
            out.append(int(torch.multinomial(q[k - 1], 1, generator=generator)))
        elif bonus == "argmax":
            out.append(int(p[k].argmax()))
        return torch.tensor(out) if as_tensor else out

    return speculative_step


def always_the_argmax(p, q, drafts, generator):
    return [int(p[0].argmax())]


# -- exercise 5: expected accepted length -------------------------------------------------


def length_with(rule):
    def expected_accepted_length(alpha, k):
        if rule == "1 + k alpha":
            return 1 + k * alpha
        if rule == "no +1":
            return float(sum(alpha**i for i in range(1, k + 1)))
        if rule == "k, not k + 1":
            return float(sum(alpha**i for i in range(k)))
        if rule == "hard-coded":
            return 2.9411764705882355
        return torch.tensor(sum(alpha**i for i in range(k + 1)))

    return expected_accepted_length


# -- exercise 6: alpha from counters ------------------------------------------------------


def alpha_with(rule, mutate=False):
    def estimate_alpha(num_drafts, num_accepted_tokens_per_pos):
        counts = num_accepted_tokens_per_pos
        k = len(counts)
        if rule == "over proposed":
            value = sum(counts) / (num_drafts * k) if num_drafts else 0.0
        elif rule == "first position":
            value = counts[0] / num_drafts if num_drafts else 0.0
        elif rule == "hard-coded":
            value = 77 / 115
        else:
            tried = num_drafts + sum(counts[:-1])
            value = sum(counts) / tried if tried else 0.0
        if mutate:
            counts.pop()
        if rule == "a tensor":
            return torch.tensor(value)
        return value

    return estimate_alpha


# -- exercise 7: choose k -----------------------------------------------------------------


def tokens(alpha, k):
    return sum(alpha**i for i in range(k + 1))


def choose_with(rule):
    def choose_k(alpha, draft_cost, max_k):
        ks = range(1, max_k + 1)
        if rule == "most tokens per round":
            return max(ks, key=lambda k: (tokens(alpha, k), -k))
        if rule == "tie to the larger k":
            return max(ks, key=lambda k: (tokens(alpha, k) / (1 + k * draft_cost), k))
        if rule == "subtracts the cost":
            return max(ks, key=lambda k: (tokens(alpha, k) - k * draft_cost, -k))
        if rule == "hard-coded":
            return 6
        best = max(ks, key=lambda k: (tokens(alpha, k) / (1 + k * draft_cost), -k))
        return float(best)

    return choose_k


# -- exercise 8: measure the bundled pair -------------------------------------------------


def measure_with(rule):
    def measure_spec(prompt, k, max_tokens):
        if rule == "hard-coded":
            return 0.75, 2.875
        use_k = 4 if rule == "ignores k" else k
        engine = LLM(
            TARGET,
            speculative_config={
                "method": "draft_model",
                "model": DRAFT,
                "num_speculative_tokens": use_k,
            },
        )
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        engine.generate([prompt], params, use_tqdm=False)
        stats = engine.spec_decode_stats()
        if rule == "accepted over proposed":
            return stats.draft_acceptance_rate, stats.num_emitted_tokens / stats.num_drafts
        tried = stats.num_drafts + sum(stats.num_accepted_tokens_per_pos[:-1])
        alpha = sum(stats.num_accepted_tokens_per_pos) / tried
        if rule == "accepted per round":
            return alpha, stats.num_accepted_tokens / stats.num_drafts
        return [alpha, stats.num_emitted_tokens / stats.num_drafts]

    return measure_spec


# -- exercise 9: the n-gram proposer ------------------------------------------------------


def ngram_with(longest_first=True, earliest=True, overlap=True, as_tuple=False, mutate=False):
    def ngram_propose(token_ids, min_n, max_n, k):
        n_tokens = len(token_ids)
        sizes = range(min(max_n, n_tokens - 1), min_n - 1, -1)
        found = []
        for n in sizes if longest_first else reversed(sizes):
            suffix = token_ids[n_tokens - n :]
            last_start = n_tokens - n if overlap else n_tokens - 2 * n + 1
            starts = [i for i in range(max(last_start, 0)) if token_ids[i : i + n] == suffix]
            if starts:
                i = starts[0] if earliest else starts[-1]
                found = list(token_ids[i + n : i + n + k])
                break
        if mutate:
            token_ids.pop()
        return tuple(found) if as_tuple else found

    return ngram_propose


# -- exercise 10: the token mask ----------------------------------------------------------


def mask_with(rule):
    def token_mask(transitions, state, vocab):
        if rule == "hard-coded":
            return list(range(0, 121))
        allowed = []
        for token_id, data in enumerate(vocab):
            if not data:
                continue
            if rule == "first byte only":
                if transitions[state][data[0]] >= 0:
                    allowed.append(token_id)
                continue
            if rule == "single bytes only" and len(data) > 1:
                continue
            s = state
            for byte in data:
                s = transitions[s][byte]
                if s < 0:
                    break
            else:
                allowed.append(token_id)
        if rule == "a set":
            return set(allowed)
        return allowed

    return token_mask


# -- exercise 11: what a stream may show --------------------------------------------------


def stream_with(rule):
    def stream_text(token_bytes):
        if rule == "replace":
            return [data.decode("utf-8", "replace") for data in token_bytes]
        if rule == "ignore":
            return [data.decode("utf-8", "ignore") for data in token_bytes]
        if rule == "all at the end":
            return [""] * (len(token_bytes) - 1) + [b"".join(token_bytes).decode()]
        decoder = codecs.getincrementaldecoder("utf-8")()
        return tuple(decoder.decode(data) for data in token_bytes)

    return stream_text


# -- exercise 12: a regex compiled to a DFA -----------------------------------------------


def dfa_with(rule):
    """A wrong compile_dfa built on the notebook's own (correct) one."""

    def factory(namespace):
        compile_dfa = namespace["compile_dfa"]

        def wrong(pattern):
            if rule == "star as plus":
                return compile_dfa(pattern.replace("*", "+"))
            if rule == "optional as star":
                return compile_dfa(pattern.replace("?", "*"))
            if rule == "hard-coded":
                return compile_dfa("ab|c")
            transitions, accepting = compile_dfa(pattern)
            if rule == "empty text never accepted":
                return transitions, accepting - {0}
            if rule == "only the last state accepts":
                return transitions, {len(transitions) - 1}
            if rule == "dead state kept":
                # the empty subset kept as a state that every missing transition leads to
                alphabet = sorted({ch for ch in pattern if ch.isalnum()})
                dead = len(transitions)
                transitions = [{ch: t.get(ch, dead) for ch in alphabet} for t in transitions]
                return [*transitions, dict.fromkeys(alphabet, dead)], accepting
            if rule == "a dict of states":
                return dict(enumerate(transitions)), accepting
            raise ValueError(rule)

        return wrong

    return FromNamespace(factory)


# -- exercise 13: the next terminals of a pushdown automaton -------------------------------


def pda_with(rule):
    """A wrong allowed_next built on the notebook's own (correct) one."""

    def factory(namespace):
        allowed_next = namespace["allowed_next"]

        def wrong(prefix, max_depth):
            if rule == "no depth limit":
                return allowed_next(prefix, 10**6)
            if rule == "hard-coded":
                return {")"} if prefix == "[(x" else {"x", "[", "(", "]"}
            got = allowed_next(prefix, max_depth)
            if rule == "forgets the empty list" and prefix.endswith("["):
                return got - {"]"}
            if rule == "a close with nothing open" and got == {"$"}:
                return got | {"]", ")"}
            if rule == "a counter, not a stack" and got & {"]", ")"}:
                return got | {"]", ")"}
            if rule == "commas inside parentheses" and ")" in got:
                return got | {","}
            if rule == "the end never allowed":
                return got - {"$"}
            if rule == "a sorted list":
                return sorted(got)
            return got

        return wrong

    return FromNamespace(factory)


WRONG_ANSWERS = {
    "top_p_filter": {
        "drops the token that crosses top_p": top_p(rule="excludes the crossing token"),
        "ties split by index": top_p(rule="index order"),
        "not renormalized": top_p(normalize=False),
        "hard-coded": hard_coded_top_p,
        "a list": top_p(as_list=True),
        "modifies probs": top_p(in_place=True),
    },
    "min_p_filter": {
        "min_p as an absolute cutoff": min_p(relative_to_max=False),
        "strictly above the cutoff": min_p(strict=True),
        "not renormalized": min_p(normalize=False),
        "hard-coded": hard_coded_min_p,
        "a list": min_p(as_list=True),
        "modifies probs": min_p(in_place=True),
    },
    "residual": {
        "not clamped": residual_with(clamp=False),
        "not normalized": residual_with(norm="none"),
        "uniform when p == q": residual_with(empty="uniform"),
        "a list": residual_with(as_list=True),
        "modifies p": residual_with(in_place=True),
    },
    "speculative_step": {
        "accepts when p >= q only": spec_step(accept="threshold"),
        "forgets the residual": spec_step(on_reject="target"),
        "skips the bonus token": spec_step(bonus=None),
        "bonus token from the last draft row": spec_step(bonus="q"),
        "bonus token is the argmax of p[k]": spec_step(bonus="argmax"),
        "off by one: draft j against p[j + 1]": spec_step(rows="next"),
        "every draft against p[0]": spec_step(rows="first"),
        "one uniform for the whole round": spec_step(uniform="round"),
        "residual max(0, q - p)": spec_step(on_reject="q minus p"),
        "residual not normalized (inverse CDF)": spec_step(on_reject="unnormalized inverse cdf"),
        "always the argmax": always_the_argmax,
        "a tensor": spec_step(as_tensor=True),
        "modifies p": spec_step(mutate=True),
    },
    "expected_accepted_length": {
        "1 + k alpha": length_with("1 + k alpha"),
        "no +1 for the extra token": length_with("no +1"),
        "k terms, not k + 1": length_with("k, not k + 1"),
        "hard-coded": length_with("hard-coded"),
        "a tensor": length_with("a tensor"),
    },
    "estimate_alpha": {
        "accepted over proposed": alpha_with("over proposed"),
        "first position only": alpha_with("first position"),
        "hard-coded": alpha_with("hard-coded"),
        "a tensor": alpha_with("a tensor"),
        "modifies the counters": alpha_with("pooled", mutate=True),
    },
    "choose_k": {
        "most tokens per round": choose_with("most tokens per round"),
        "tie to the larger k": choose_with("tie to the larger k"),
        "cost subtracted, not divided": choose_with("subtracts the cost"),
        "hard-coded": choose_with("hard-coded"),
        "a float": choose_with("a float"),
    },
    "measure_spec": {
        "accepted over proposed": measure_with("accepted over proposed"),
        "accepted drafts per round": measure_with("accepted per round"),
        "ignores k": measure_with("ignores k"),
        "hard-coded": measure_with("hard-coded"),
        "a list": measure_with("a list"),
    },
    "ngram_propose": {
        "shortest n first": ngram_with(longest_first=False),
        "latest occurrence": ngram_with(earliest=False),
        "no overlapping occurrence": ngram_with(overlap=False),
        "hard-coded": lambda token_ids, min_n, max_n, k: [9, 1],
        "a tuple": ngram_with(as_tuple=True),
        "modifies token_ids": ngram_with(mutate=True),
    },
    "token_mask": {
        "first byte only": mask_with("first byte only"),
        "single-byte tokens only": mask_with("single bytes only"),
        "hard-coded": mask_with("hard-coded"),
        "a set": mask_with("a set"),
    },
    "stream_text": {
        "each token decoded with replacement characters": stream_with("replace"),
        "each token decoded, partial bytes dropped": stream_with("ignore"),
        "everything at the end": stream_with("all at the end"),
        "a tuple": stream_with("a tuple"),
    },
    "compile_dfa": {
        "* as one or more": dfa_with("star as plus"),
        "? as zero or more": dfa_with("optional as star"),
        "the empty text never accepted": dfa_with("empty text never accepted"),
        "only the last state accepts": dfa_with("only the last state accepts"),
        "dead state kept": dfa_with("dead state kept"),
        "hard-coded": dfa_with("hard-coded"),
        "a dict of states": dfa_with("a dict of states"),
    },
    "allowed_next": {
        "no stack depth limit": pda_with("no depth limit"),
        "accepts a close with nothing open": pda_with("a close with nothing open"),
        "a counter, not a stack (any close closes)": pda_with("a counter, not a stack"),
        "forgets epsilon (no empty list)": pda_with("forgets the empty list"),
        "commas inside parentheses": pda_with("commas inside parentheses"),
        "the end never allowed": pda_with("the end never allowed"),
        "hard-coded": pda_with("hard-coded"),
        "a sorted list": pda_with("a sorted list"),
    },
}


class TestChecks(ExerciseChecks):
    SOLUTION = ROOT / "solutions" / "ch07_decoding.ipynb"
    EXERCISE = ROOT / "exercises" / "ch07_decoding.ipynb"
    POINTS = [3, 2, 2, 4, 2, 3, 3, 3, 3, 3, 2, 6, 5]
    WRONG_ANSWERS = WRONG_ANSWERS
