"""Bad requests over plain HTTP: each gets OpenAI's error JSON with the right status and the
field it is about, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from minillm.serve import run_server


@pytest.fixture(scope="module")
def server(reference_llm):
    """On the second engine: the tests below start servers of their own on `llm`, and an
    LLM is served by one server at a time."""
    with run_server(reference_llm, port=0) as server:
        yield server


def post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        server.url + path, content=content, headers={"content-type": "application/json"}
    )


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "n": 1.5}, "n"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": "x", "stop": 3}, "stop"),
        ({"prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": [], "max_tokens": 3}, "prompt"),
        ({"prompt": [10**9], "max_tokens": 3}, "prompt"),
        ({"prompt": "x", "n": 9, "temperature": 1}, "n"),  # more than max_num_seqs seats
    ],
)
def test_a_bad_completion_request_is_a_400_naming_its_field(server, body, param):
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if param is not None:
        assert param.split(".")[-1] in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_a_bad_chat_request_is_a_400_naming_its_field(server, body, param):
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param


def test_a_prompt_longer_than_max_model_len_is_refused_before_it_runs(server):
    limit = server.engine.max_model_len
    too_long = [5] * limit
    response = post(server, "/v1/completions", {"prompt": too_long, "max_tokens": 1})
    assert response.status_code == 400
    assert error_of(response)["code"] == "context_length_exceeded"
    assert str(limit) in error_of(response)["message"]
    # a prompt that fits, with more output asked for than the context has room for
    response = post(server, "/v1/completions", {"prompt": [5] * (limit - 4), "max_tokens": 5})
    assert response.status_code == 400
    assert error_of(response)["param"] == "max_tokens"
    # one token less fits exactly
    response = post(server, "/v1/completions", {"prompt": [5] * (limit - 4), "max_tokens": 4})
    assert response.status_code == 200
    assert response.json()["usage"]["total_tokens"] <= limit


def test_an_unknown_model_is_a_404(server):
    response = post(server, "/v1/completions", {"model": "llama-70b", "prompt": "x"})
    assert response.status_code == 404
    assert error_of(response)["code"] == "model_not_found"
    response = post(
        server,
        "/v1/chat/completions",
        {"model": "x", "messages": [{"role": "user", "content": "y"}]},
    )
    assert response.status_code == 404


def test_health_and_the_server_still_serves_after_errors(server):
    assert httpx.get(server.url + "/health").status_code == 200
    response = post(server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 3})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


def test_without_the_api_key_the_v1_routes_answer_401(llm):
    with run_server(llm, port=0, api_key="s3cret") as server:
        body = {"prompt": "x", "max_tokens": 1}
        assert httpx.post(server.url + "/v1/completions", json=body).status_code == 401
        wrong = {"Authorization": "Bearer guess"}
        response = httpx.post(server.url + "/v1/completions", json=body, headers=wrong)
        assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/v1/models").status_code == 401
        right = {"Authorization": "Bearer s3cret"}
        assert httpx.post(server.url + "/v1/completions", json=body, headers=right).is_success
        assert httpx.get(server.url + "/v1/models", headers=right).is_success
        assert httpx.get(server.url + "/health").status_code == 200  # open, as in vLLM


def test_past_the_waiting_limit_requests_get_503_with_retry_after(llm):
    """Long streams fill the batch's max_num_seqs seats, two more wait, the next is refused."""

    async def scenario(server):
        url = server.url + "/v1/completions"
        long = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=60) as client:
            running, lines = [], []
            # fill the batch: max_num_seqs long streams, each seen running
            for _ in range(server.engine.scheduler.max_num_seqs):
                stream = await client.send(
                    client.build_request("POST", url, json=long), stream=True
                )
                running.append(stream)
                # its first chunk: it is running (the line iterator is kept: dropping it
                # would close the response, and the server would abort the request)
                lines.append(stream.aiter_lines())
                await anext(lines[-1])
            waiting = [
                await client.send(client.build_request("POST", url, json=long), stream=True)
                for _ in range(2)
            ]
            statuses = [r.status_code for r in running + waiting]
            num_waiting = len(server.engine.scheduler.waiting)
            refused = await client.post(url, json={"prompt": "x", "max_tokens": 1})
            for r in running + waiting:
                await r.aclose()
        return refused, statuses, num_waiting

    with run_server(llm, port=0, max_waiting_requests=2) as server:
        refused, statuses, num_waiting = asyncio.run(scenario(server))
        assert statuses == [200] * len(statuses)
        assert num_waiting == 2
        assert refused.status_code == 503
        assert int(refused.headers["Retry-After"]) >= 1
        assert error_of(refused)["code"] == "server_overloaded"


def test_when_the_engine_loop_dies_clients_get_503_and_health_says_so(llm, monkeypatch):
    def broken_step():
        raise RuntimeError("device lost")

    with run_server(llm, port=0) as server:
        monkeypatch.setattr(server.engine, "step", broken_step)
        response = post(server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 3})
        assert response.status_code == 503
        assert "device lost" in error_of(response)["message"]
        assert httpx.get(server.url + "/health").status_code == 503
        again = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert again.status_code == 503 and error_of(again)["code"] == "engine_dead"
    monkeypatch.undo()
    # the requests it held were aborted: the engine is clean for whoever uses it next
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running
    llm.engine.step()  # reports the aborted request to nobody
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.usage == 0
