"""Our token masks against xgrammar's, a production library (a test dependency only).

For each grammar, both start from the same state; a few random walks pick an allowed token at
each step, feed it to both, and compare the full allowed-token sets (EOS included) at every
state on the way. xgrammar gets the bundled tokenizer's vocabulary as raw bytes, the same
bytes our masks walk.
"""

import json

import pytest

from minillm.structured.json_schema import schema_to_regex

xgr = pytest.importorskip("xgrammar")

from xgrammar_oracle import compare_walks, xgrammar_setup  # noqa: E402

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
    return xgrammar_setup()


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
