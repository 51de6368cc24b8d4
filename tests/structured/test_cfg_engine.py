"""Grammar-constrained generation end to end: every completion the engine finishes is a
sentence of the grammar by Lark (an independent Earley parser), greedy and sampled, batched
with unconstrained requests; a bad grammar is refused where it enters."""

import pytest
from structured_testing import SQL, run_counting_steps

from minillm import LLM, SamplingParams
from minillm.sampling_params import StructuredOutputsParams
from minillm.structured.cfg import GrammarError
from minillm.structured.regex import CompileLimitError

lark = pytest.importorskip("lark")

# the same shape with every part bounded, so that each completion ends within max_tokens
SQL_BOUNDED = """
start: "SELECT " columns " FROM " name
columns: name | name "," name | name "," name "," name
name: /[a-z_]{1,6}/
"""
# nesting a regex cannot bound: a list of lists
NESTED = """
start: value
value: "[" [value ("," value)*] "]" | /[0-9]/
"""
PROMPTS = ["def parse(text):", "import os\n", "class Point:"]


@pytest.fixture(scope="module")
def llm():
    return LLM(enforce_eager=True, max_num_seqs=8)


def sentences(llm, grammar: str, **kwargs) -> list[tuple[str, str]]:
    params = SamplingParams(
        max_tokens=40, structured_outputs=StructuredOutputsParams(grammar=grammar), **kwargs
    )
    outputs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]


@pytest.mark.parametrize("grammar", [SQL_BOUNDED, NESTED])
@pytest.mark.parametrize("seed", [None, 0, 1])
def test_every_completion_is_a_sentence_by_lark(llm, grammar, seed):
    parser = lark.Lark(grammar, parser="earley", lexer="dynamic_complete")
    kwargs = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    for text, reason in sentences(llm, grammar, **kwargs):
        assert reason == "stop", text
        parser.parse(text)  # raises for a non-sentence


def test_the_seeds_sql_grammar_keeps_every_prefix_viable(llm):
    """The seed's grammar has no bound on columns or names, and the model (trained on code)
    rarely stops, so completions end at max_tokens: each is then a prefix that a short suffix
    completes (checked by Lark)."""
    parser = lark.Lark(SQL, parser="earley", lexer="dynamic_complete")
    for text, _ in sentences(llm, SQL, temperature=1.0, seed=3):
        assert text.startswith("SELECT ")
        candidates = [text, text + "x", text + " FROM t", text + "FROM t", text + "x FROM t"]
        assert any(lark_parses(parser, candidate) for candidate in candidates), text


def lark_parses(parser, text: str) -> bool:
    try:
        parser.parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


def test_grammar_requests_batch_with_unconstrained_ones(llm):
    constrained = SamplingParams(
        max_tokens=30, temperature=0, structured_outputs=StructuredOutputsParams(grammar=SQL)
    )
    free = SamplingParams(max_tokens=12, temperature=0)
    outputs = llm.generate(PROMPTS + PROMPTS, [constrained] * 3 + [free] * 3)
    alone = llm.generate(PROMPTS, free)
    assert [o.outputs[0].text for o in outputs[3:]] == [o.outputs[0].text for o in alone]
    parser = lark.Lark(SQL, parser="earley", lexer="dynamic_complete")
    for output in outputs[:3]:
        if output.outputs[0].finish_reason == "stop":
            parser.parse(output.outputs[0].text)


def test_forced_text_of_a_grammar(llm):
    """After three columns of the bounded grammar and the end of a name... nothing is forced
    (the name may go on); after "SELECT " nothing is either; inside " FROM " the rest is."""
    manager = llm.engine.structured_output_manager
    grammar = StructuredOutputsParams(grammar=SQL_BOUNDED).pattern
    tokenizer = llm.engine.tokenizer
    eos = [tokenizer.eos_token_id]

    def forced(text: str) -> bytes:
        ids = tokenizer.encode(text, add_special_tokens=False)
        matcher = manager.matcher(f"forced/{text}", grammar, ids, frozenset(eos))
        manager.free(f"forced/{text}")
        return matcher.forced_bytes()

    assert forced("") == b"SELECT "
    assert forced("SELECT ") == b""
    assert forced("SELECT a,b,cdefgh") == b" FROM "  # the third name is at its 6 characters
    assert forced("SELECT a F") == b"ROM "
    assert forced("SELECT a FROM b") == b""  # a sentence: the model may stop or go on


def test_jump_forward_over_a_grammars_forced_text(llm):
    params = SamplingParams(
        max_tokens=40,
        temperature=0,
        structured_outputs=StructuredOutputsParams(grammar=SQL_BOUNDED),
    )
    engine = llm.engine
    try:
        text_without, steps_without = run_counting_steps(llm, PROMPTS[0], params)
        engine.enable_jump_forward = True
        text_with, steps_with = run_counting_steps(llm, PROMPTS[0], params)
    finally:
        engine.enable_jump_forward = False
    parser = lark.Lark(SQL_BOUNDED, parser="earley", lexer="dynamic_complete")
    for text in (text_without, text_with):
        parser.parse(text)
    assert steps_with < steps_without  # "SELECT " at least is appended without a forward


@pytest.mark.parametrize(
    ("grammar", "error", "words"),
    [
        (
            "start: nothing",
            GrammarError,
            "structured_outputs.grammar: line 1, column 8: rule 'nothing'",
        ),
        ('start: "a" start', GrammarError, "derives no finite string"),
        (3, ValueError, "structured_outputs.grammar must be a str"),
        ("start: " + '"a"' * 30_000, CompileLimitError, "MAX_GRAMMAR_LENGTH"),
    ],
)
def test_a_bad_grammar_is_refused_where_it_enters(grammar, error, words):
    with pytest.raises(error) as info:
        StructuredOutputsParams(grammar=grammar)
    assert words in str(info.value)


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice or grammar"):
        StructuredOutputsParams(grammar=SQL, regex="a")


def test_a_grammar_past_the_item_limit_aborts_its_request_only(llm, monkeypatch):
    from minillm.structured import cfg

    monkeypatch.setattr(cfg, "MAX_EARLEY_ITEMS", 40)
    ambiguous = StructuredOutputsParams(grammar='start: start start | /[a-z]/ | " "')
    bad = SamplingParams(max_tokens=30, temperature=0, structured_outputs=ambiguous)
    good = SamplingParams(max_tokens=8, temperature=0)
    outputs = llm.generate(PROMPTS[:2], [bad, good])
    assert outputs[0].outputs[0].finish_reason == "abort"
    assert "MAX_EARLEY_ITEMS=40" in outputs[0].error
    assert outputs[1].outputs[0].finish_reason == "length"
    assert outputs[1].outputs[0].text == llm.generate(PROMPTS[1:2], good)[0].outputs[0].text
