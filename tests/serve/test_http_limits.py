"""What one request may cost the others: a body past the size limit is refused unread (413),
a prompt too long in bytes is refused before it is tokenized, tokenizing runs in a worker
thread while the other streams keep flowing, and errors nobody planned for still answer
OpenAI's JSON."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from minillm.serve import run_server
from minillm.serve.api_server import longest_token_bytes
from tests.serve.conftest import greedy, pool_is_empty

LIMIT = 4096


@pytest.fixture
def server(llm):
    """A server with a small body limit (function-scoped: a test may compute offline
    references on the same LLM before it starts)."""
    with run_server(llm, port=0, max_request_body_bytes=LIMIT) as server:
        yield server


@pytest.fixture
def big(reference_llm):
    """A server with the default body limit, on the second engine."""
    with run_server(reference_llm, port=0) as server:
        yield server


def error_of(response: httpx.Response) -> dict:
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def post(server, path: str, content: bytes, **headers) -> httpx.Response:
    return httpx.post(
        server.url + path,
        content=content,
        headers={"content-type": "application/json", **headers},
        timeout=60,
    )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_past_the_limit_is_a_413_and_one_at_the_limit_is_read(server, path):
    small = b'{"prompt": "x", "max_tokens": 1}'
    at_limit = small + b" " * (LIMIT - len(small))  # JSON allows trailing whitespace
    over = at_limit + b" "
    response = post(server, path, over)
    assert response.status_code == 413, response.text
    error = error_of(response)
    assert error["code"] == "request_too_large"
    assert str(LIMIT) in error["message"]
    # exactly at the limit the body is read: completions runs it, chat names what is missing
    response = post(server, path, at_limit)
    assert response.status_code == (200 if path == "/v1/completions" else 400), response.text


def test_a_chunked_body_without_a_length_is_cut_at_the_limit(server):
    sent = []

    def chunks():  # no Content-Length: the server counts what arrives
        for _ in range(LIMIT // 512 + 2):
            sent.append(512)
            yield b" " * 512

    response = httpx.post(
        server.url + "/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert "content-length" not in response.request.headers
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"


@pytest.fixture
def encode_calls(big, monkeypatch):
    """Every text the default-limit server tokenizes (the engine shares the tokenizer)."""
    tokenizer = big.parts.app.state.server.prompts.tokenizer
    calls: list[str] = []
    encode = tokenizer.encode

    def spy(text, *args, **kwargs):
        calls.append(text)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy)
    return calls


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_too_long_in_bytes_is_refused_before_it_is_tokenized(big, path, encode_calls):
    reader = big.parts.app.state.server.prompts
    assert reader.max_prompt_bytes == reader.max_model_len * longest_token_bytes(reader.tokenizer)
    text = "é" * (reader.max_prompt_bytes // 2 + 1)  # 2 bytes each: past the bound
    body = {"prompt": text}
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": text}]}
    response = post(big, path, json.dumps(body).encode())
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == ("prompt" if path == "/v1/completions" else "messages")
    assert encode_calls == []


def test_a_text_inside_the_byte_bound_is_tokenized_and_judged_by_tokens(big, encode_calls):
    reader = big.parts.app.state.server.prompts
    text = "a" * reader.max_prompt_bytes
    response = post(big, "/v1/completions", json.dumps({"prompt": text}).encode())
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "context_length_exceeded"
    assert "tokens, but the prompt has" in error["message"]  # counted in tokens
    assert encode_calls == [text]


def test_other_streams_keep_flowing_while_a_prompt_is_tokenized(llm, monkeypatch):
    """The tokenizer is held inside one request's encode; a second request streams to its
    end meanwhile. With tokenizing on the event loop the second one could not start until
    the first encode returned."""
    expected = greedy(llm, ["def add(a, b):"], 24, ignore_eos=True)[0]
    tokenizer = llm.engine.tokenizer
    encode = tokenizer.encode
    inside, release = threading.Event(), threading.Event()
    held_while_streaming: list[bool] = []

    def slow_encode(text, *args, **kwargs):
        if text.startswith("SLOW"):
            inside.set()
            release.wait(60)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)

    async def run(server) -> str:
        async with httpx.AsyncClient(timeout=120) as client:
            slow = asyncio.ensure_future(
                client.post(server.url + "/v1/completions", json={"prompt": "SLOW x"})
            )
            while not inside.is_set():
                await asyncio.sleep(0.01)
            body = {
                "prompt": "def add(a, b):",
                "max_tokens": 24,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
            text = ""
            async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            held_while_streaming.append(not release.is_set())
            release.set()
            assert (await slow).status_code == 200
            return text

    with run_server(llm, port=0) as server:
        try:
            text = asyncio.run(run(server))
        finally:
            release.set()
        assert held_while_streaming == [True]
        assert text == expected
        assert pool_is_empty(server.engine)


# ---------------------------------------------------------------------- errors as JSON


def test_a_chat_message_that_is_not_valid_unicode_is_a_400(server):
    body = json.dumps({"messages": [{"role": "user", "content": "bad\udcff"}]}).encode()
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "messages"
    assert "0xff" in error["message"]


def test_json_nested_too_deeply_is_a_400(big):
    depth = 50_000
    raw = b'{"prompt": "x", "n": ' + b"[" * depth + b"]" * depth + b"}"
    response = post(big, "/v1/completions", raw)
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "invalid_json"
    assert "deeply" in error["message"]


def test_an_unexpected_exception_is_a_500_in_openai_json(server, monkeypatch):
    def broken() -> dict:
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.parts.app.state.server, "models", broken)
    response = httpx.get(server.url + "/v1/models", timeout=60)
    assert response.status_code == 500
    error = error_of(response)
    assert error["type"] == "server_error"
    assert "a bug" in error["message"]
    # the server goes on serving
    monkeypatch.undo()
    assert httpx.get(server.url + "/v1/models", timeout=60).status_code == 200


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_declared_json_is_a_415(server, content_type):
    """A web page can make a browser send these across origins without a preflight."""
    headers = {} if content_type is None else {"content-type": content_type}
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    response = httpx.post(server.url + "/v1/completions", content=body, headers=headers)
    assert response.status_code == 415
    assert error_of(response)["code"] == "unsupported_media_type"
    ok = post(
        server, "/v1/completions", body, **{"content-type": "application/json; charset=utf-8"}
    )
    assert ok.status_code == 200


def test_cors_answers_only_the_origins_allowed(llm):
    preflight = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type,authorization",
    }
    with run_server(llm, port=0, allowed_origins=["http://ui.local"]) as server:
        url = server.url + "/v1/completions"
        ok = httpx.options(url, headers={"origin": "http://ui.local", **preflight})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "http://ui.local"
        other = httpx.options(url, headers={"origin": "http://evil.local", **preflight})
        assert "access-control-allow-origin" not in other.headers
    with run_server(llm, port=0) as server:  # by default no origin is allowed
        response = httpx.options(
            server.url + "/v1/completions", headers={"origin": "http://ui.local", **preflight}
        )
        assert "access-control-allow-origin" not in response.headers
