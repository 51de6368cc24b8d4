"""Constrained decoding end to end on the bundled model: every output parses and validates.

The validator of the JSON-schema subset is written here, apart from the compiler; regex
outputs are checked with Python's re.fullmatch.
"""

import json
import re

import pytest
from structured_testing import run_counting_steps

from minillm import LLM, SamplingParams
from minillm.sampling_params import StructuredOutputsParams

PROMPTS = ["def parse(text):", "import os\n", "class Point:"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["file", "dir", None]},
        "size": {"type": "integer"},
        "ratio": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "extra": {"type": ["string", "null"], "maxLength": 4},
    },
    "required": ["name", "kind", "size"],
}
REGEX = r"[a-z]{2,8}@[a-z]{2,6}\.(?:com|org)"
CHOICES = ["alpha", "beta", "gamma delta"]


def validate(value, schema) -> None:
    """Raise AssertionError unless value is valid for the schema (the supported subset)."""
    if "enum" in schema:
        assert value in schema["enum"] and type(value) in {type(v) for v in schema["enum"]}
        return
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
    }
    kind = next((k for k in kinds if checks[k](value)), None)
    assert kind is not None, (value, kinds)
    if kind == "object":
        assert set(schema.get("required", [])) <= set(value) <= set(schema["properties"])
        for key, item in value.items():
            validate(item, schema["properties"][key])
    elif kind == "array":
        assert len(value) <= schema.get("maxItems", len(value))
        assert len(value) >= schema.get("minItems", 0)
        for item in value:
            validate(item, schema["items"])
    elif kind == "string":
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))


def test_the_validator_rejects_what_the_schema_does_not_allow():
    good = {"name": "a", "kind": "dir", "size": 3}
    validate(good, SCHEMA)
    for bad in (
        {"name": "a", "kind": "dir"},  # a required key missing
        {**good, "size": 1.5},
        {**good, "name": "much too long"},
        {**good, "kind": "link"},
        {**good, "tags": [True, 1]},
        {**good, "other": 1},
    ):
        with pytest.raises(AssertionError):
            validate(bad, SCHEMA)


@pytest.fixture(scope="module")
def llm():
    return LLM(enforce_eager=True, max_num_seqs=8)


def generate(llm, constraint, temperature):
    params = [
        SamplingParams(
            temperature=temperature, seed=i, max_tokens=80, structured_outputs=constraint
        )
        for i in range(len(PROMPTS))
    ]
    return [output.outputs[0] for output in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_outputs_parse_and_validate(llm, temperature):
    for completion in generate(llm, StructuredOutputsParams(json=SCHEMA), temperature):
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        validate(value, SCHEMA)
        # the layout is json.dumps's, and keys come in the schema's order
        assert completion.text == json.dumps(value)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_choice_outputs_match(llm, temperature):
    for completion in generate(llm, StructuredOutputsParams(regex=REGEX), temperature):
        assert completion.finish_reason == "stop"
        assert re.fullmatch(REGEX, completion.text), completion.text
    for completion in generate(llm, StructuredOutputsParams(choice=CHOICES), temperature):
        assert completion.finish_reason == "stop"
        assert completion.text in CHOICES


def test_unconstrained_rows_in_the_batch_are_unaffected(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[0-9]+")
    )
    alone = llm.generate([PROMPTS[0]], plain, use_tqdm=False)[0].outputs[0]
    mixed = llm.generate(PROMPTS[:2], [plain, constrained], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.token_ids
    assert re.fullmatch("[0-9]+", mixed[1].outputs[0].text)


def test_jump_forward_skips_forwards_over_forced_text(llm):
    schema = {
        "type": "object",
        "properties": {"identifier": {"enum": ["x"]}, "description": {"type": "boolean"}},
        "required": ["identifier", "description"],
    }
    params = SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)
    )
    engine = llm.engine
    assert not engine.enable_jump_forward  # off by default: tokens as decoded one by one
    try:
        text_without, steps_without = run_counting_steps(llm, PROMPTS[0], params)
        engine.enable_jump_forward = True
        text_with, steps_with = run_counting_steps(llm, PROMPTS[0], params)
    finally:
        engine.enable_jump_forward = False
    for text in (text_without, text_with):
        validate(json.loads(text), schema)
    # '{"identifier": "x", "description": ' is forced after the first "{": one forward
    # computes all its tokens instead of one forward each
    assert steps_with < steps_without - 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(), "exactly one of json, regex, choice or grammar"),
        (dict(regex="a", choice=["a"]), "exactly one of json, regex, choice or grammar"),
        (dict(regex="(ab"), "missing ), unterminated subpattern"),
        (dict(regex="^x$"), "anchors"),
        (dict(regex=3), "structured_outputs.regex must be a str"),
        (dict(choice=[]), "structured_outputs.choice must be a non-empty list"),
        (dict(json={"type": "string", "pattern": "a+"}), "unsupported keyword(s) ['pattern']"),
        (dict(json={"type": "date"}), "type must be one of"),
        (dict(json="{not json"), "json schema is not valid JSON"),
        (dict(json={"type": "object", "required": ["a"]}), "required names unknown"),
        (dict(json={"type": "array"}), "an array needs an items schema"),
        (dict(json={}), "unconstrained value"),
    ],
)
def test_bad_constraints_are_rejected_where_they_enter(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_takes_only_structured_outputs_params():
    with pytest.raises(ValueError, match="structured_outputs must be None or a Structured"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_every_completion_of_n_follows_its_own_grammar_state(llm):
    params = SamplingParams(
        n=3,
        temperature=1.0,
        seed=11,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(regex=REGEX),
    )
    [output] = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    assert len(output.outputs) == 3
    for completion in output.outputs:
        assert completion.finish_reason == "stop"
        assert re.fullmatch(REGEX, completion.text), completion.text


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"const": float("nan")}, "JSON cannot"),
        ({"enum": [1, float("inf")]}, "JSON cannot"),
        ({"enum": {1, 2}}, "JSON cannot"),
    ],
)
def test_values_json_cannot_hold_are_a_value_error(schema, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(json=schema)


def test_a_schema_text_with_nan_is_refused():
    with pytest.raises(ValueError, match="is not a JSON value"):
        StructuredOutputsParams(json='{"const": NaN}')


def test_jump_forward_puts_no_token_past_a_stop_string(llm):
    """A stop string inside a forced run: the run's tokens after the one that completes it
    are not output (token ids end there, as decoding a token a step would end them)."""
    constraint = StructuredOutputsParams(regex="name: [a-z]{1,8}, age: [0-9]{1,3}")
    params = SamplingParams(
        temperature=0.0, max_tokens=40, stop=[":"], structured_outputs=constraint
    )
    engine = llm.engine
    try:
        engine.enable_jump_forward = True
        [output] = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    finally:
        engine.enable_jump_forward = False
    token_ids = output.outputs[0].token_ids
    decode = llm.get_tokenizer().decode
    assert output.outputs[0].text == "name" and output.outputs[0].stop_reason == ":"
    assert ":" in decode(token_ids) and ":" not in decode(token_ids[:-1])


def test_a_grammar_that_ends_wins_over_min_tokens(llm):
    """min_tokens cannot outlast the grammar: the stop token the grammar forces ends the
    request once, instead of being drawn again until min_tokens tokens are out."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        min_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    [output] = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    completion = output.outputs[0]
    eos = llm.get_tokenizer().eos_token_id
    assert completion.text in ("yes", "no") and completion.finish_reason == "stop"
    assert completion.token_ids[-1] == eos and completion.token_ids.count(eos) == 1
