"""Shutting down (SIGTERM, Ctrl-C, `stop`): requests still running when the drain time is
over end with OpenAI's error, a stream with an error event and [DONE], a whole answer with a
503; none is cut without a word, and the engine is left with no request."""

from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx

from minillm.serve import start_server
from tests.serve.conftest import greedy, pool_is_empty

BODY = {"prompt": "def main():", "max_tokens": 100, "ignore_eos": True, "temperature": 0}


def test_streams_and_answers_still_running_are_ended_with_an_error(llm):
    server = start_server(llm, port=0, shutdown_timeout=0)
    engine = server.engine
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        whole = pool.submit(httpx.post, server.url + "/v1/completions", json=BODY, timeout=60)
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**BODY, "stream": True}, timeout=60
        ) as response:
            events = (line[6:] for line in response.iter_lines() if line.startswith("data: "))
            assert "choices" in json.loads(next(events))
            with llm._lock:  # the engine thread cannot step: both requests stay unfinished
                stopping = pool.submit(server.stop)
                rest = list(events)
        answer = whole.result()
    finally:
        stopping.result()
        pool.shutdown()
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
    assert all("choices" in json.loads(event) for event in rest[:-2])
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "server_shutting_down"
    assert pool_is_empty(engine)


def test_a_stream_that_ends_within_the_drain_time_is_whole(llm):
    expected = greedy(llm, [BODY["prompt"]], 20, ignore_eos=True)[0]
    server = start_server(llm, port=0, shutdown_timeout=120)
    stopped = threading.Event()
    try:
        with httpx.stream(
            "POST",
            server.url + "/v1/completions",
            json={**BODY, "max_tokens": 20, "stream": True},
            timeout=60,
        ) as response:
            events = (line[6:] for line in response.iter_lines() if line.startswith("data: "))
            first = next(events)
            stopper = threading.Thread(target=lambda: (server.stop(), stopped.set()))
            stopper.start()
            rest = list(events)
        # a new request is refused meanwhile, or finds the port closed
    finally:
        stopper.join(120)
    assert stopped.is_set()
    assert rest[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in [first, *rest[:-1]])
    assert text == expected
