"""The HTTP server under the attacks a client can make: a huge body, malformed or deeply
nested JSON, a prompt too long, bad parameters, streams dropped midway, whole answers
abandoned. After each one the engine holds no KV block and no request, and the next
request's output equals that of a fresh engine."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from minillm import LLM, SamplingParams
from minillm.serve import run_server

OPTIONS = {"max_model_len": 256, "max_num_seqs": 8}
BODY_LIMIT = 64 * 1024
PROBE = {"prompt": "def fib(n):", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
LONG = {"prompt": "import os", "max_tokens": 120, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def expected() -> str:
    """The probe's greedy text on a fresh engine that served nothing else."""
    fresh = LLM(**OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return fresh.generate([PROBE["prompt"]], params, use_tqdm=False)[0].outputs[0].text


@pytest.fixture(scope="module")
def server():
    with run_server(LLM(**OPTIONS), port=0, max_request_body_bytes=BODY_LIMIT) as server:
        yield server


def is_clean(server) -> bool:
    engine = server.engine
    return (
        engine.kv_cache_manager.usage == 0.0
        and not engine.scheduler.running
        and not engine.scheduler.waiting
        and not engine.output_processor.states
        and server.parts.async_engine.num_streams == 0
    )


def settle(server, timeout_s: float = 30.0) -> bool:
    """Whether the engine is clean; aborts travel to the engine thread, so give them time."""
    deadline = time.monotonic() + timeout_s
    while not is_clean(server):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def post(server, body, path="/v1/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=120)


def huge_body(server):
    return post(server, {"prompt": "x" * (4 * BODY_LIMIT)}).status_code == 413


def prompt_past_the_byte_bound(server):
    reader = server.parts.app.state.server.prompts
    text = "é" * (reader.max_prompt_bytes // 2 + 1)  # inside the body limit, past the bound
    assert len(text.encode()) < BODY_LIMIT
    response = post(server, {"prompt": text})
    return response.json()["error"]["code"] == "context_length_exceeded"


def malformed_json(server):
    return post(server, b'{"prompt": "x", "max_tokens": ').status_code == 400


def deeply_nested_json(server):
    depth = BODY_LIMIT // 2 - 16
    raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    return post(server, raw).status_code == 400


def bad_parameters(server):
    bodies = [
        {"prompt": "x", "temperature": -1},
        {"prompt": "x", "stop_token_ids": [10**9]},
        {"prompt": "x", "logit_bias": {"5": 3}},
        {"prompt": "x", "structured_outputs": {"regex": "("}},
        {"prompt": "x", "n": 9, "temperature": 1},
        {"prompt": [10**9]},
    ]
    return all(post(server, body).status_code == 400 for body in bodies)


def chat_text_not_unicode(server):
    raw = json.dumps({"messages": [{"role": "user", "content": "a\udcff"}]}).encode()
    return post(server, raw, "/v1/chat/completions").status_code == 400


def stream_dropped_midway(server):
    body = {**LONG, "n": 2, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        chunks = (line for line in r.iter_lines() if line.startswith("data: {"))
        for _ in range(3):
            next(chunks)
        held = server.engine.kv_cache_manager.usage > 0
    return held  # it held blocks when it was dropped


def whole_answer_abandoned(server):
    """A non-streaming request whose client closes the socket right after sending it."""
    host, port = server.url.removeprefix("http://").split(":")
    raw = json.dumps({**LONG, "max_tokens": 200}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        deadline = time.monotonic() + 30
        while not server.engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.01)
        return bool(server.engine.scheduler.running)


def body_cut_short(server):
    """A client that promises a body and leaves halfway through it."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "abc'
        )
    return True


def foreign_host(server):
    """A page whose own domain name resolves to this machine (DNS rebinding): its requests
    name that domain in Host, and are refused before their body is read."""
    headers = {"content-type": "application/json", "host": "attacker.example:8000"}
    answers = [
        httpx.post(server.url + "/v1/completions", json=LONG, headers=headers, timeout=60),
        httpx.get(server.url + "/v1/models", headers=headers, timeout=60),
        httpx.get(server.url + "/metrics", headers=headers, timeout=60),
    ]
    codes = [(r.status_code, r.json()["error"]["code"]) for r in answers]
    return codes == [(400, "invalid_host")] * 3


def chat_stream_dropped_after_the_role(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    return True


ATTACKS = [
    huge_body,
    prompt_past_the_byte_bound,
    malformed_json,
    deeply_nested_json,
    bad_parameters,
    chat_text_not_unicode,
    stream_dropped_midway,
    whole_answer_abandoned,
    body_cut_short,
    foreign_host,
    chat_stream_dropped_after_the_role,
]


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda attack: attack.__name__)
def test_after_an_attack_the_engine_is_clean_and_answers_as_a_fresh_one(server, expected, attack):
    assert attack(server), f"{attack.__name__} did not go as planned"
    assert settle(server), "a KV block or a request outlived the attack"
    probe = post(server, PROBE)
    assert probe.status_code == 200, probe.text
    assert probe.json()["choices"][0]["text"] == expected
    assert settle(server)
    assert httpx.get(server.url + "/health").status_code == 200
