"""The official `openai` client, unchanged, against a live `minillm serve`: what it gets
back equals the offline greedy run of the same prompt, streaming or not."""

from __future__ import annotations

import openai
import pytest

from minillm import SamplingParams
from minillm.serve import run_server
from minillm.serve.chat_template import ChatTemplate
from tests.serve.conftest import greedy

PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:", "for i in range("]
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sort a list of numbers."},
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(llm):
    """(server, client, references): the references are computed before the server starts."""
    template = ChatTemplate.from_model_dir(llm.get_tokenizer().path.parent)
    chat_ids = llm.get_tokenizer().encode(template.render(MESSAGES), add_special_tokens=False)
    references = {
        "completions": greedy(llm, PROMPTS, MAX_TOKENS),
        "chat": greedy(llm, [chat_ids], MAX_TOKENS)[0],
        "token_ids": greedy(llm, [[0, 528, 291, 10]], MAX_TOKENS)[0],
        "stop": greedy(llm, [PROMPTS[0]], MAX_TOKENS, stop=["\n"])[0],
        "seeded": [
            c.text
            for c in llm.generate(
                [PROMPTS[2]],
                SamplingParams(n=2, seed=7, temperature=1.0, top_k=20, max_tokens=MAX_TOKENS),
                use_tqdm=False,
            )[0].outputs
        ],
    }
    with run_server(llm, port=0) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        yield server, client, references


def test_completion_equals_the_offline_greedy_run(served):
    server, client, ref = served
    for prompt, expected in zip(PROMPTS, ref["completions"], strict=True):
        response = client.completions.create(
            model=server.parts.served_model_name,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert response.choices[0].text == expected
        assert response.usage.completion_tokens == MAX_TOKENS
        assert response.usage.prompt_tokens == len(server.engine.tokenizer.encode(prompt))


def test_a_batch_of_prompts_comes_back_in_order(served):
    server, client, ref = served
    response = client.completions.create(
        model=server.parts.served_model_name, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == ref["completions"]
    assert response.usage.completion_tokens == 3 * MAX_TOKENS


def test_token_id_prompts_and_echo(served):
    server, client, ref = served
    ids = [0, 528, 291, 10]
    response = client.completions.create(
        model=server.parts.served_model_name,
        prompt=ids,
        max_tokens=MAX_TOKENS,
        temperature=0,
        echo=True,
    )
    prompt_text = server.engine.tokenizer.decode(ids)
    assert response.choices[0].text == prompt_text + ref["token_ids"]


def test_streamed_completion_equals_the_offline_run_chunk_by_chunk(served):
    server, client, ref = served
    chunks = list(
        client.completions.create(
            model=server.parts.served_model_name,
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == ref["completions"][0]
    assert len(texts) > 1  # streamed, not sent whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_equals_the_offline_run_of_the_rendered_template(served):
    server, client, ref = served
    response = client.chat.completions.create(
        model=server.parts.served_model_name,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == ref["chat"]
    stream = client.chat.completions.create(
        model=server.parts.served_model_name,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["chat"]
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_logprobs_are_those_of_the_greedy_tokens(served):
    server, client, _ = served
    response = client.completions.create(
        model=server.parts.served_model_name,
        prompt=PROMPTS[0],
        max_tokens=4,
        temperature=0,
        logprobs=3,
    )
    logprobs = response.choices[0].logprobs
    assert "".join(logprobs.tokens) == response.choices[0].text
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 3
        assert logprob == max(top.values())  # greedy: the sampled token is the likeliest
        assert top[token] == logprob


def test_the_server_lists_its_model_and_refuses_others(served):
    server, client, _ = served
    assert [m.id for m in client.models.list().data] == [server.parts.served_model_name]
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=server.parts.served_model_name,
            prompt="x",
            max_tokens=1,
            extra_body={"best_of": 2},
        )
    assert info.value.body["param"] == "best_of"


def test_stop_strings_cut_the_text_as_offline(served):
    server, client, ref = served
    kwargs = {"model": server.parts.served_model_name, "prompt": PROMPTS[0]}
    kwargs.update(max_tokens=MAX_TOKENS, temperature=0, stop=["\n"])
    response = client.completions.create(**kwargs)
    assert response.choices[0].text == ref["stop"]
    assert "\n" not in ref["stop"] and response.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == ref["stop"]


def test_seeded_sampling_with_n_completions_matches_offline(served):
    """Completion i of a seeded request draws from seed + i: the same texts as offline."""
    server, client, ref = served
    response = client.completions.create(
        model=server.parts.served_model_name,
        prompt=PROMPTS[2],
        n=2,
        seed=7,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        extra_body={"top_k": 20},
    )
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == ref["seeded"]
    assert ref["seeded"][0] != ref["seeded"][1]  # two different draws


def test_chat_logprobs_list_each_token_with_its_alternatives(served):
    server, client, ref = served
    response = client.chat.completions.create(
        model=server.parts.served_model_name,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 5
    assert "".join(item.token for item in content) == response.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == item.top_logprobs[0].logprob  # greedy: the likeliest
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert bytes(item.bytes).decode() == item.token
