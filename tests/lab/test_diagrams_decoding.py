"""Chapter 7's diagrams show the engine's order and state: the sampler's stages as its code
runs them, the rounds of a real speculative run, prompt lookup and a grammar's mask."""

import ast
import inspect
import textwrap

import matplotlib
import pytest
import torch

from minillm.lab.diagrams import decoding as dd
from minillm.spec.ngram_proposer import ngram_propose
from minillm.worker import sampler as sampler_module

matplotlib.use("Agg")

TARGET, DRAFT = "minillm-stdlib-target", "minillm-stdlib-draft"


def test_pipeline_order_is_the_order_the_sampler_runs():
    traced = dd.traced_sampler_stages()
    assert traced == [
        "logits",
        "grammar mask",
        "min_tokens",
        "penalties",
        "temperature",
        "top-k",
        "top-p",
        "min-p",
        "sample",
    ]
    assert dd.source_sampler_stages() == traced
    assert dd.draw_sampler_pipeline(traced).labels() == traced


def test_source_order_is_read_from_the_sampler_itself():
    # an independent reading: the line on which each processor is first called
    lines = {}
    sampler = sampler_module.Sampler
    for function in (sampler.__call__, sampler.processed_logits, sampler._filter, sampler.draw):
        source = textwrap.dedent(inspect.getsource(function))
        start = inspect.getsourcelines(function)[1]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                lines.setdefault(name, start + node.lineno)
    top_k_before_top_p = lines["apply_top_k"] < lines["apply_top_p"] < lines["apply_min_p"]
    assert top_k_before_top_p
    assert lines["apply_penalties"] < lines["_filter"]
    assert lines["processed_logits"] < lines["draw"]


def test_a_changed_stage_list_changes_the_picture():
    stages = ["logits", "temperature", "sample"]
    assert dd.draw_sampler_pipeline(stages).labels() == stages


def decode_ids(token_id: int) -> str:
    return f"t{token_id}"


def test_spec_round_draws_accepted_corrected_and_discarded():
    r = dd.SpecRound(drafts=[5, 6, 7, 8], num_accepted=2, emitted=[5, 6, 9])
    labels = dd.draw_spec_round(r, decode_ids).labels()
    assert labels[:4] == ["t5", "t6", "t7", "t8"]  # the drafts
    assert labels[5:] == ["t5", "t6", "t9"]  # two accepted, then the corrected token
    bonus = dd.SpecRound(drafts=[5, 6], num_accepted=2, emitted=[5, 6, 4])
    assert bonus.bonus and dd.draw_spec_round(bonus, decode_ids).labels()[3:] == ["t5", "t6", "t4"]


@pytest.mark.slow
def test_recorded_rounds_rebuild_the_output():
    from minillm import LLM, SamplingParams

    spec = LLM(
        TARGET,
        speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4},
    )
    rounds, output = dd.record_spec_rounds(
        spec, "def parse_args(argv):", SamplingParams(temperature=1.0, max_tokens=24, seed=0)
    )
    # the prefill emits the first token; every round its accepted drafts and one more, until
    # the last steps, where too few tokens are left to draft and the target decodes alone
    emitted = [t for r in rounds for t in r.emitted]
    n = min(len(output) - 1, len(emitted))
    assert n >= len(output) - 3
    assert output[1 : 1 + n] == emitted[:n]
    for r in rounds:
        assert r.emitted[: r.num_accepted] == r.drafts[: r.num_accepted]
        assert len(r.emitted) == r.num_accepted + 1
    stats = spec.spec_decode_stats()
    assert stats.num_drafts == len(rounds)
    assert stats.num_accepted_tokens == sum(r.num_accepted for r in rounds)


def test_ngram_lookup_draws_what_ngram_propose_proposes():
    tokens = [1, 2, 3, 4, 9, 9, 1, 2, 3]
    proposal = ngram_propose(tokens, 2, 4, 3)
    assert proposal == [4, 9, 9]
    assert dd.ngram_match(tokens, 2, 4) == (0, 3)
    labels = dd.draw_ngram_lookup(tokens, 2, 4, 3, decode_ids).labels()
    assert labels == ["t1", "t2", "t3", "t4", "t9", "t9", "t1", "t2", "t3", "t4", "t9", "t9"]
    assert dd.draw_ngram_lookup([1, 2, 5, 1, 2], 2, 4, 2, decode_ids).labels()[-2:] == ["t5", "t1"]


def test_token_mask_is_the_grammars_mask():
    from minillm.structured.grammar import TokenGrammar, TokenTrie
    from minillm.structured.regex import compile_regex

    vocab = [b"1", b"00", b".", b"-", b"x", b"12.5"]
    grammar = TokenGrammar(compile_regex(r"-?[0-9]+(\.[0-9]+)?"), vocab, TokenTrie(vocab))
    after_digit = grammar.dfa.walk(0, b"7")
    labels = dd.draw_token_mask(
        grammar, after_digit, range(6), lambda t: vocab[t].decode()
    ).labels()
    assert labels == ["1 → keep", "00 → keep", ". → keep", "- → -inf", "x → -inf", "12.5 → keep"]
    start = dd.draw_token_mask(grammar, 0, range(6), lambda t: vocab[t].decode()).labels()
    assert start[2:4] == [". → -inf", "- → keep"]
    assert torch.equal(grammar.token_mask(0), torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.bool))


def test_parse_stack_is_read_from_the_earley_chart():
    from minillm.structured.cfg import compile_grammar

    brackets = compile_grammar('start: "(" start ")" start | "[" start "]" start | "x"')
    # after "([(" the output is inside three open brackets, innermost on top
    assert dd.parse_stack(brackets, b"([(", deepest=True) == [
        'start → • "(" start ")" start',
        'start → "(" • start ")" start',
        'start → "[" • start "]" start',
        'start → "(" • start ")" start',
        "start' → • start",
    ]
    sql = compile_grammar(
        'start: "SELECT " cols " FROM " name\ncols: name ("," name)*\nname: /[a-z]+/'
    )
    assert dd.parse_stack(sql, b"SELECT ab,c") == [
        "name → • /[a-z]+/",
        '("," name)* → ("," name)* "," • name',
        'cols → name • ("," name)*',
        'start → "SELECT " • cols " FROM " name',
        "start' → • start",
    ]
    with pytest.raises(ValueError, match="not a prefix"):
        dd.parse_stack(brackets, b"(]")
    frames = dd.parse_stack(sql, b"SELECT ab FROM x")
    canvas = dd.draw_parse_stacks([("a", frames), ("b", ["one", "two"])])
    assert canvas.labels() == [*frames, "one", "two"]
