"""OpenAI bodies as clients write them: null for a nullable field, the neutral values of
fields minillm does not implement, and structured outputs (response_format, and vLLM's
structured_outputs) served by the engine's constrained decoding."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from minillm.serve import run_server

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "big"]}},
    "required": ["ok", "size"],
}
MESSAGES = [{"role": "user", "content": "Describe the box as JSON."}]


@pytest.fixture(scope="module")
def server(llm):
    with run_server(llm, port=0) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0)


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def body(path: str, **fields) -> dict:
    """A body for the endpoint at `path`: one user message (chat) or the prompt "x", two
    tokens at most, then `fields` (which may replace those)."""
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "x"}
    return {**base, "max_tokens": 2, **fields}


def post(server, path: str, **fields) -> httpx.Response:
    return httpx.post(server.url + path, json=body(path, **fields), timeout=120)


def chat(server, client, **options):
    """The openai client's chat call on MESSAGES, greedy unless `options` say otherwise."""
    return client.chat.completions.create(
        model=server.parts.served_model_name, messages=MESSAGES, **{"temperature": 0, **options}
    )


def complete(server, client, **options):
    return client.completions.create(model=server.parts.served_model_name, **options)


NULLABLE = ["n", "stream", "max_tokens", "temperature", "top_p", "stop", "seed", "user"]


@pytest.mark.parametrize("field", [*NULLABLE, "logprobs", "top_logprobs", "stream_options"])
def test_chat_takes_null_for_a_nullable_field(server, field):
    response = post(server, CHAT, **{field: None})
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"  # stream: null is not a stream


@pytest.mark.parametrize("field", [*NULLABLE, "echo", "logprobs", "suffix", "best_of"])
def test_completions_take_null_for_a_nullable_field(server, field):
    response = post(server, COMPLETIONS, **{field: None})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1  # n: null is one completion


NEUTRAL = [
    ("response_format", {"type": "text"}),
    ("tools", None),
    ("tool_choice", "none"),
    ("functions", None),
    ("parallel_tool_calls", False),
    ("logit_bias", {}),
    ("store", False),
    ("metadata", None),
    ("service_tier", "auto"),
    ("modalities", ["text"]),
    ("reasoning_effort", None),
    ("top_logprobs", 0),
]


@pytest.mark.parametrize(("field", "value"), NEUTRAL)
def test_chat_takes_the_neutral_value_of_a_field_it_does_not_implement(server, field, value):
    response = post(server, CHAT, max_tokens=3, temperature=0, **{field: value})
    assert response.status_code == 200, response.text
    plain = post(server, CHAT, max_tokens=3, temperature=0, **{field: None})
    content = response.json()["choices"][0]["message"]["content"]
    assert content == plain.json()["choices"][0]["message"]["content"]  # a no-op


@pytest.mark.parametrize("best_of", [1, 2])
def test_completions_take_best_of_equal_to_n(server, best_of):
    response = post(server, COMPLETIONS, n=best_of, best_of=best_of)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == best_of


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (CHAT, "tools", [{"type": "function", "function": {"name": "f"}}]),
        (CHAT, "tool_choice", "required"),
        (CHAT, "logit_bias", {"5": 10}),
        (CHAT, "store", True),
        (CHAT, "modalities", ["text", "audio"]),
        (CHAT, "top_logprobs", 2),  # without logprobs: true
        (COMPLETIONS, "best_of", 3),
        (COMPLETIONS, "suffix", "}"),
        (COMPLETIONS, "logit_bias", {"5": -100}),
        (COMPLETIONS, "n", 0),
    ],
)
def test_a_value_that_asks_for_something_missing_is_a_400_naming_the_field(
    server, path, field, value
):
    response = post(server, path, **{field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert field in error["message"]


def test_chat_top_logprobs_past_the_limit_names_top_logprobs(server):
    response = post(server, CHAT, logprobs=True, top_logprobs=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "top_logprobs"
    assert "top_logprobs" in error["message"] and "30" in error["message"]


# ---------------------------------------------------------------------- structured outputs


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "box", "schema": schema}}


def valid(value: object) -> bool:
    """SCHEMA checked by hand (no code shared with the schema compiler)."""
    return (
        isinstance(value, dict)
        and set(value) == {"ok", "size"}
        and isinstance(value["ok"], bool)
        and value["size"] in ("small", "big")
    )


def test_chat_response_format_json_schema_returns_valid_json(server, client):
    response = chat(server, client, max_tokens=40, response_format=json_schema_format(SCHEMA))
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert valid(json.loads(choice.message.content))


def test_completions_response_format_json_schema_returns_valid_json(server, client):
    response = complete(
        server,
        client,
        prompt="box = ",
        max_tokens=40,
        temperature=0.8,
        seed=3,
        n=3,
        extra_body={"response_format": json_schema_format(SCHEMA)},
    )
    assert len(response.choices) == 3
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert valid(json.loads(choice.text))


def test_a_streamed_chat_with_a_schema_joins_to_valid_json(server, client):
    stream = chat(
        server, client, max_tokens=40, stream=True, response_format=json_schema_format(SCHEMA)
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert valid(json.loads(text))


def test_json_object_returns_a_json_object(server, client):
    response = chat(server, client, max_tokens=60, response_format={"type": "json_object"})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        ({"choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
        ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
        ({"json": SCHEMA}, lambda text: valid(json.loads(text))),
        ({"json": json.dumps(SCHEMA), "grammar": None}, lambda text: valid(json.loads(text))),
        ({"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
        (
            {"grammar": 'start: "SELECT " name ("," name)? " FROM " name\nname: /[a-z]{1,5}/'},
            lambda text: re.fullmatch("SELECT [a-z]{1,5}(,[a-z]{1,5})? FROM [a-z]{1,5}", text),
        ),
    ],
)
def test_vllm_structured_outputs_constrain_the_completion(server, client, constraint, check):
    response = complete(
        server,
        client,
        prompt="x = ",
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": constraint},
    )
    assert response.choices[0].finish_reason == "stop"
    assert check(response.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"structured_outputs": {"grammar": "root ::= b"}}, "structured_outputs", "'b' is not"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one"),
        ({"structured_outputs": {"json": {"type": "object"}, "json_object": True}}, None, "one"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"response_format": json_schema_format({"pattern": "a+"})}, "response_format", "schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "type"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "not both",
        ),
    ],
)
def test_a_constraint_the_engine_cannot_serve_is_a_400(server, extra, param, words):
    response = post(server, COMPLETIONS, **extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == (param or "structured_outputs")
    assert words in error["message"]


@pytest.mark.parametrize("k", [0, 1])
def test_completions_top_logprobs_hold_the_sampled_token(server, k):
    """Sampling at a high temperature picks tokens outside the top k; each position's
    top_logprobs still holds the sampled token with its own logprob, beside the k best."""
    response = post(server, COMPLETIONS, max_tokens=12, temperature=5.0, seed=1, logprobs=k)
    logprobs = response.json()["choices"][0]["logprobs"]
    positions = zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    )
    outside = 0
    for token, logprob, top in positions:
        assert top[token] == logprob
        assert max(k, 1) <= len(top) <= k + 1
        outside += logprob < max(top.values())
    if k:
        assert outside > 0  # the case that matters was met: a sampled token past the top k
