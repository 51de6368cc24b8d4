"""Our token masks against xgrammar's, a production library (a test dependency only).

For each grammar, both start from the same state; a few random walks pick an allowed token at
each step, feed it to both, and compare the full allowed-token sets (EOS included) at every
state on the way. xgrammar gets the bundled tokenizer's vocabulary as raw bytes, the same
bytes our masks walk.
"""

import json
import random

import pytest
import torch

from minillm.model.loader import DEFAULT_MODEL, resolve_model_path
from minillm.model.tokenizer import Tokenizer
from minillm.structured.grammar import StructuredOutputManager, token_bytes
from minillm.structured.json_schema import schema_to_regex

xgr = pytest.importorskip("xgrammar")

# no "." here: xgrammar's "." also matches a newline, Python's (and ours) does not
REGEXES = [
    r"[a-z]+@[a-z]+\.com",
    r"\d{3}-\d{4}",
    r'"(?:[^"\\]|\\["\\n])*"',
    r"(?:yes|no|maybe)",
    r"[A-Z][a-z]*(?: [A-Z][a-z]*){0,3}",
    r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+\-]?\d+)?",
]
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age"],
    },
    {"type": "array", "items": {"type": "number"}, "minItems": 1},
    {"enum": ["red", "green", 3, None]},
]


@pytest.fixture(scope="module")
def setup():
    tokenizer = Tokenizer(resolve_model_path(DEFAULT_MODEL))
    vocab_size = tokenizer.vocab_size
    encoded = [data or b"" for data in token_bytes(tokenizer, vocab_size)]
    info = xgr.TokenizerInfo(
        encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[tokenizer.eos_token_id]
    )
    return tokenizer, xgr.GrammarCompiler(info), StructuredOutputManager(tokenizer, vocab_size)


def xgrammar_mask(matcher, vocab_size: int) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    ids = torch.arange(vocab_size)
    return ((bitmask[0][ids // 32] >> (ids % 32)) & 1).bool()


def compare_walks(
    setup, pattern: str, compiled, num_walks: int = 3, max_steps: int = 12, avoid: bytes = b""
):
    """Walk random allowed tokens (none whose bytes hold `avoid`, when given) and compare the
    masks at every state; returns how many states were compared."""
    tokenizer, _, manager = setup
    vocab = token_bytes(tokenizer, tokenizer.vocab_size)
    vocab_size = tokenizer.vocab_size
    eos = tokenizer.eos_token_id
    rng = random.Random(pattern)
    num_states_compared = 0
    for walk in range(num_walks):
        matcher = xgr.GrammarMatcher(compiled)
        request_id = f"{pattern}/{walk}"
        output: list[int] = []
        for _ in range(max_steps):
            ours = manager.allowed_mask(request_id, pattern, output, [eos])
            theirs = xgrammar_mask(matcher, vocab_size)
            different = (ours != theirs).nonzero().flatten().tolist()
            assert different == [], (tokenizer.decode(output), different[:10])
            num_states_compared += 1
            choices = [
                t
                for t in ours.nonzero().flatten().tolist()
                if t != eos and not (avoid and avoid in vocab[t])
            ]
            if not choices:
                break
            token = rng.choice(choices)
            assert matcher.accept_token(token)
            output.append(token)
        manager.free(request_id)
    return num_states_compared


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_masks_equal_xgrammars_along_random_walks(setup, pattern):
    _, compiler, _ = setup
    assert compare_walks(setup, pattern, compiler.compile_regex(pattern)) >= 3


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_masks_equal_xgrammars_along_random_walks(setup, index):
    """The schema's regex (our compiler's layout) against xgrammar on the same regex."""
    _, compiler, _ = setup
    pattern = schema_to_regex(SCHEMAS[index])
    assert compare_walks(setup, pattern, compiler.compile_regex(pattern)) >= 3


# xgrammar's own JSON-schema compiler, in the same layout (no free whitespace, json.dumps's
# separators, no extra keys). Strings here have no length bounds: xgrammar spells a bounded
# string without escape sequences, our compiler allows them there too. The walks take no
# token with a minus sign: xgrammar refuses the integer -0, which JSON's grammar (RFC 8259)
# and Python's json allow, and our compiler accepts.
XGRAMMAR_LAYOUT_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "ok": {"type": "boolean"},
            "nothing": {"type": "null"},
        },
        "required": ["name", "age"],
    },
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "required": ["point"],
    },
]


@pytest.mark.parametrize("index", range(len(XGRAMMAR_LAYOUT_SCHEMAS)))
def test_json_schema_masks_equal_xgrammars_own_json_compiler(setup, index):
    _, compiler, _ = setup
    schema = XGRAMMAR_LAYOUT_SCHEMAS[index]
    compiled = compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(", ", ": "), strict_mode=True
    )
    pattern = schema_to_regex(schema)
    assert compare_walks(setup, pattern, compiled, num_walks=4, max_steps=20, avoid=b"-") >= 4
