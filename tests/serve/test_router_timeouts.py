"""The router's edges: a body past its limit is a 413 that no replica sees; a replica that
takes a request and never answers gets a 504 in OpenAI's JSON after the router's timeout
(not a plain 500, and no retry that could run the request twice); a failed health probe
marks a replica down without counting as a failed request."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from minillm.serve.router import run_router


@pytest.fixture
def silent_replica():
    """An address that accepts connections and reads requests, and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", held
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_a_replica_that_never_answers_is_a_504_in_openai_json(silent_replica):
    url, held = silent_replica
    with run_router([url], timeout_s=0.5) as router:
        response = httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=60)
        assert response.status_code == 504
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "replica_timeout")
        assert len(held) == 1  # sent once, not retried
        assert router.router.outstanding[url] == 0
        assert router.router.failures_total[url] == 0


def test_a_failed_health_probe_is_not_a_connection_failure():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with run_router([dead]) as router:
        assert httpx.get(router.url + "/health").status_code == 503
        assert router.router.failures_total[dead] == 0
        assert not router.router.is_up(dead)
        metrics = httpx.get(router.url + "/metrics").text
        line = next(
            line
            for line in metrics.splitlines()
            if line.startswith("minillm_router_connect_failures_total{")
        )
        assert line.endswith(" 0.0") or line.endswith(" 0")


def test_a_body_past_the_router_s_limit_is_a_413_and_never_forwarded(silent_replica):
    url, held = silent_replica
    with run_router([url], max_request_body_bytes=1000) as router:
        body = {"prompt": "x" * 2000}
        response = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        assert held == []  # no replica saw it


def test_an_unexpected_router_error_is_a_500_in_openai_json(silent_replica, monkeypatch):
    url, _ = silent_replica
    with run_router([url]) as router:

        async def broken(request, path):
            raise RuntimeError("a bug")

        monkeypatch.setattr(router.router, "forward", broken)
        response = httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=60)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "server_error" and "a bug" in error["message"]
