"""The context-free grammar engine (`minillm.structured.cfg`) against two independent oracles:
Lark's Earley parser (the grammar text is Lark syntax, fed to Lark as is, read with its
`dynamic_complete` lexer, the plain context-free language) and xgrammar's GrammarMatcher (the
same grammar printed in xgrammar's EBNF). Strings and token masks are compared on random
grammars (Hypothesis) and on the SQL-shaped grammar of vLLM's example.
"""

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from structured_testing import SQL

from minillm.structured import cfg
from minillm.structured.cfg import GrammarError, GrammarLimitError, compile_grammar
from minillm.structured.grammar import token_bytes
from minillm.structured.regex import Alternation, Chars, CompileLimitError, Concat, Repeat, parse

lark = pytest.importorskip("lark")
xgr = pytest.importorskip("xgrammar")

from xgrammar_oracle import compare_walks, xgrammar_setup  # noqa: E402

BRACKETS = 'start: "(" start ")" start | "[" start "]" start | "x"'
ARITHMETIC = """
start: expr
expr: expr "+" term | term
term: term "*" atom | atom
atom: "(" expr ")" | /[0-9]+/
"""


# ---------------------------------------------------------------------------------------
# xgrammar's EBNF from ours


def _gbnf_chars(ranges) -> str:
    def char(code: int) -> str:
        return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"

    return "[" + "".join(char(lo) + ("" if lo == hi else "-" + char(hi)) for lo, hi in ranges) + "]"


def _gbnf_regex(node) -> str:
    if isinstance(node, Chars):
        return _gbnf_chars(node.ranges)
    if isinstance(node, Concat):
        return "(" + " ".join(_gbnf_regex(p) for p in node.parts) + ")" if node.parts else '""'
    if isinstance(node, Alternation):
        return "(" + " | ".join(_gbnf_regex(o) for o in node.options) + ")"
    assert isinstance(node, Repeat)
    body = _gbnf_regex(node.body)
    high = "" if node.max is None else str(node.max)
    return f"({body}){{{node.min},{high}}}"


def _gbnf(node) -> str:
    if isinstance(node, cfg.Ref):
        return node.name
    if isinstance(node, cfg.Term):
        return _gbnf_regex(parse(node.pattern))
    if isinstance(node, cfg.Seq):
        return "(" + " ".join(_gbnf(i) for i in node.items) + ")" if node.items else '""'
    if isinstance(node, cfg.Alt):
        return "(" + " | ".join(_gbnf(o) for o in node.options) + ")"
    return f"({_gbnf(node.body)}){node.op}"


def to_xgrammar(text: str) -> str:
    rules = cfg._Parser(text).rules()
    names = [name for name, _, _ in rules]
    start = "start" if "start" in names else names[0]
    lines = [f"root ::= {start}"]
    lines += [f"{name} ::= {_gbnf(body)}" for name, body, _ in rules]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# fixtures and oracles


@pytest.fixture(scope="module")
def setup():
    return xgrammar_setup()


def lark_accepts(parser, text: str) -> bool:
    try:
        parser.parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


def lark_parser(text: str):
    return lark.Lark(text, parser="earley", lexer="dynamic_complete", start="start")


def xgrammar_verdict(compiled, eos: int, text: str) -> tuple[bool, bool]:
    """(is a prefix of a sentence, is a sentence) by xgrammar."""
    matcher = xgr.GrammarMatcher(compiled)
    if text and not matcher.accept_string(text):
        return False, False
    return True, matcher.accept_token(eos)


# ---------------------------------------------------------------------------------------
# hand-written grammars


def test_sql_grammar_accepts_exactly_lark_and_xgrammar_strings(setup):
    tokenizer, compiler, _ = setup
    grammar = compile_grammar(SQL)
    parser = lark_parser(SQL)
    compiled = compiler.compile_grammar(to_xgrammar(SQL))
    texts = [
        "SELECT a FROM b",
        "SELECT name,age FROM users",
        "SELECT _x1,y FROM t_2",
        "SELECT a FROM",
        "SELECT a, b FROM t",
        "SELECT  a FROM b",
        "SELECT 1a FROM b",
        "SELECT a FROM b;",
        "select a FROM b",
        "SELECT a,,b FROM c",
        "SELECT a FROM b c",
    ]
    accepted = []
    for text in texts:
        ours = grammar.accepts(text.encode())
        assert ours == lark_accepts(parser, text), text
        assert (grammar.accepts_prefix(text.encode()), ours) == xgrammar_verdict(
            compiled, tokenizer.eos_token_id, text
        ), text
        accepted.append(ours)
    assert accepted == [True, True, True] + [False] * 8


@pytest.mark.parametrize(
    ("text", "sentence", "prefix"),
    [
        ("", False, True),
        ("x", True, True),
        ("(x)x", True, True),
        ("([x]x)x", True, True),
        ("([x)x]x", False, False),  # crossed brackets: no regex can tell this from the next
        ("((((", False, True),
        ("(x))", False, False),
    ],
)
def test_bracket_grammar_needs_the_stack(text, sentence, prefix):
    grammar = compile_grammar(BRACKETS)
    assert grammar.accepts(text.encode()) == sentence
    assert grammar.accepts_prefix(text.encode()) == prefix


def test_left_recursion_and_nullable_rules():
    grammar = compile_grammar(ARITHMETIC)
    for text, ok in [("1+2*3", True), ("(1+2)*30", True), ("1+", False), ("()", False)]:
        assert grammar.accepts(text.encode()) == ok
    nullable = compile_grammar('start: a b "c"\na: "a"?\nb: a a')
    assert [nullable.accepts(t) for t in (b"c", b"ac", b"aac", b"aaac", b"aaaac")] == [
        True,
        True,
        True,
        True,
        False,
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("start: missing", "rule 'missing' is not defined"),
        ('start: "a"\nstart: "b"', "defined twice"),
        ('start: "abc', "unterminated string"),
        ("start: /[a-/", "bad regex"),
        ('start: "a" start', "derives no finite string"),
        ('start: ok\nok: "x" | loop\nloop: "y" loop', "loop"),
        ('start: ("a"', "to close the group"),
        ("start: /a/i", "flags"),
        ('start: "\\q"', "unsupported escape"),
        ("", "no rules"),
        ("start: ;", "line 1, column 8"),
    ],
)
def test_bad_grammars_are_grammar_errors_naming_the_problem(text, message):
    with pytest.raises(GrammarError, match=None) as info:
        compile_grammar(text)
    assert message in str(info.value)


def test_compile_limits(monkeypatch):
    with pytest.raises(CompileLimitError, match="MAX_GRAMMAR_LENGTH"):
        compile_grammar('start: "' + "a" * cfg.MAX_GRAMMAR_LENGTH + '"')
    many = "start: " + " | ".join(f'"{i}"*' for i in range(cfg.MAX_GRAMMAR_RULES))
    with pytest.raises(CompileLimitError, match="MAX_GRAMMAR_RULES"):
        compile_grammar(many)
    monkeypatch.setattr(cfg, "MAX_TERMINAL_STATES", 10)
    with pytest.raises(CompileLimitError, match="MAX_TERMINAL_STATES"):
        compile_grammar.__wrapped__('start: "abcdefghijklmnop"')


def test_an_ambiguous_grammar_past_the_item_limit_is_a_limit_error(monkeypatch):
    monkeypatch.setattr(cfg, "MAX_EARLEY_ITEMS", 200)
    grammar = compile_grammar.__wrapped__('start: start start | "a" | ""')
    assert grammar.accepts(b"a" * 3)
    with pytest.raises(GrammarLimitError, match="MAX_EARLEY_ITEMS=200"):
        grammar.accepts(b"a" * 200)


# ---------------------------------------------------------------------------------------
# random grammars against Lark and xgrammar

ALPHABET = "ab()"
TERMINALS = ['"a"', '"b"', '"("', '")"', '"ab"', "/[ab]+/", "/a|b/", '"ba"']


@st.composite
def grammars(draw):
    """A grammar over rules r0..rn; r_i's first alternative uses only r_j with j > i, so every
    rule derives a finite string; the other alternatives may recurse anywhere (left, right or
    middle), and items may carry `?`, `*`, `+` or be groups."""
    num_rules = draw(st.integers(1, 4))

    def item(allowed_rules):
        kind = draw(st.sampled_from(["term", "term", "ref", "group"]))
        if kind == "ref" and allowed_rules:
            text = f"r{draw(st.sampled_from(allowed_rules))}"
        elif kind == "group":
            text = "(" + " | ".join(draw(st.sampled_from(TERMINALS)) for _ in range(2)) + ")"
        else:
            text = draw(st.sampled_from(TERMINALS))
        return text + draw(st.sampled_from(["", "", "", "?", "*", "+"]))

    lines = []
    for i in range(num_rules):
        later = list(range(i + 1, num_rules))
        first = " ".join(item(later) for _ in range(draw(st.integers(1, 3))))
        options = [first]
        for _ in range(draw(st.integers(0, 2))):
            options.append(
                " ".join(item(list(range(num_rules))) for _ in range(draw(st.integers(1, 3))))
            )
        lines.append(f"r{i}: " + " | ".join(options))
    return "start: r0\n" + "\n".join(lines)


@given(grammars(), st.lists(st.text(ALPHABET, max_size=7), min_size=6, max_size=6))
def test_random_grammars_accept_what_lark_and_xgrammar_accept(setup, text, strings):
    tokenizer, compiler, _ = setup
    grammar = compile_grammar(text)
    parser = lark_parser(text)
    compiled = compiler.compile_grammar(to_xgrammar(text))
    # also strings the grammar generates: walk it with random allowed bytes
    rng = random.Random(text)
    for _ in range(4):
        chart, out = [grammar.initial_set()], bytearray()
        for _ in range(rng.randint(0, 8)):
            allowed = chart[-1].allowed_bytes()
            if not allowed:
                break
            byte = rng.choice(allowed)
            chart.append(grammar.scan(chart, byte))
            out.append(byte)
        strings.append(out.decode())
    for string in strings:
        ours = grammar.accepts(string.encode())
        assert ours == lark_accepts(parser, string), (text, string)
        verdict = xgrammar_verdict(compiled, tokenizer.eos_token_id, string)
        assert (grammar.accepts_prefix(string.encode()), ours) == verdict, (text, string)


@given(grammars())
def test_random_grammar_token_masks_equal_xgrammars(setup, text):
    tokenizer, compiler, manager = setup
    compare_walks(setup, compile_grammar(text), compiler.compile_grammar(to_xgrammar(text)), 2, 6)


@pytest.mark.parametrize("grammar_text", [SQL, BRACKETS, ARITHMETIC])
def test_token_masks_equal_xgrammars_on_the_held_grammars(setup, grammar_text):
    _, compiler, _ = setup
    compiled = compiler.compile_grammar(to_xgrammar(grammar_text))
    assert compare_walks(setup, compile_grammar(grammar_text), compiled, 4, 14) >= 8


def test_positions_with_the_same_stack_share_a_key_and_others_do_not():
    grammar = compile_grammar(SQL)

    def key(text: bytes):
        chart = [grammar.initial_set()]
        for byte in text:
            chart.append(grammar.scan(chart, byte))
        return chart[-1].state_key(chart)

    # a name after the first comma and after the fourth: the same continuations
    assert key(b"SELECT a,b") == key(b"SELECT a,b,c,d,e")
    assert key(b"SELECT a,") == key(b"SELECT abc,de,")
    # a column name and a table name differ (" FROM " may follow one, only the end the other)
    assert key(b"SELECT a") != key(b"SELECT a FROM b")
    brackets = compile_grammar(BRACKETS)

    def depth_key(text: bytes):
        chart = [brackets.initial_set()]
        for byte in text:
            chart.append(brackets.scan(chart, byte))
        return chart[-1].state_key(chart)

    # nesting changes the stack: every depth is a new key
    assert len({depth_key(b"(" * n) for n in range(1, 6)}) == 5


@given(grammars())
def test_cached_masks_equal_masks_computed_afresh(setup, text):
    """The mask cache keyed by parser state never hands a position another state's mask."""
    tokenizer, _, manager = setup
    grammar = compile_grammar(text)
    rng = random.Random(text)
    eos = tokenizer.eos_token_id
    for walk in range(2):
        output: list[int] = []
        for _ in range(6):
            cached = manager.allowed_mask(f"fresh/{walk}", grammar, output, [eos])
            matcher = manager.matchers[f"fresh/{walk}"]
            fresh = torch.zeros_like(cached)
            fresh[matcher.allowed_token_ids()] = True
            if matcher.is_accepting():
                fresh[eos] = True
            assert torch.equal(cached, fresh)
            choices = [t for t in cached.nonzero().flatten().tolist() if t != eos]
            if not choices:
                break
            output.append(rng.choice(choices))
        manager.free(f"fresh/{walk}")


def test_cached_masks_at_every_depth_of_nesting(setup):
    """Prefixes that differ only below the top of the stack ("(x" and "((x") must not share a
    mask: after "((x" the token "))" is allowed, after "(x" it is not."""
    tokenizer, _, manager = setup
    vocab = token_bytes(tokenizer, tokenizer.vocab_size)
    ids = {data: i for i, data in enumerate(vocab) if data}
    assert b"))" in ids  # the check needs a token that closes two brackets
    grammar = compile_grammar('start: "(" start ")" | "[" start "]" | "x"')
    eos = tokenizer.eos_token_id
    masks = {}
    for n, text in enumerate(["(x)", "((x))", "(((x)))", "([x])", "[(x)]"]):
        output = [ids[bytes([c])] for c in text.encode()]
        for end in range(len(output) + 1):
            cached = manager.allowed_mask(f"depth/{n}", grammar, output[:end], [eos])
            matcher = manager.matchers[f"depth/{n}"]
            fresh = torch.zeros_like(cached)
            fresh[matcher.allowed_token_ids()] = True
            fresh[eos] = matcher.is_accepting()
            assert torch.equal(cached, fresh), (text, end)
            masks[text[:end]] = cached
        manager.free(f"depth/{n}")
    assert masks["((x"][ids[b"))"]] and not masks["(x"][ids[b"))"]]
