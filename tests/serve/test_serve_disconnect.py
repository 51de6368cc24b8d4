"""A client that goes away has its request aborted: its KV blocks and seat are freed at
once, whether it was streaming or waiting for a whole answer."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from minillm.serve import run_server
from minillm.serve.metrics import ENGINE_INDEX
from tests.serve.conftest import pool_is_empty

LONG = {"prompt": "def main():", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


def wait_until(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture(scope="module")
def server(llm):
    with run_server(llm, port=0) as server:
        yield server


def aborted_count(server) -> float:
    name = server.parts.served_model_name
    sample = server.metrics.request_success.labels(name, ENGINE_INDEX, "abort")
    return sample._value.get()


def test_a_stream_closed_midway_is_aborted_and_frees_its_blocks(server):
    before = aborted_count(server)

    async def read_three_chunks_and_leave() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            request = client.build_request(
                "POST", server.url + "/v1/completions", json={**LONG, "stream": True}
            )
            response = await client.send(request, stream=True)
            lines = response.aiter_lines()
            for _ in range(3):
                while not (await anext(lines)).startswith("data:"):
                    pass
            assert server.engine.kv_cache_manager.usage > 0  # it holds blocks now
            await response.aclose()

    asyncio.run(read_three_chunks_and_leave())
    assert wait_until(lambda: pool_is_empty(server.engine))
    assert wait_until(lambda: aborted_count(server) == before + 1)
    assert server.parts.async_engine.num_streams == 0
    # it stopped long before its 200 tokens
    assert server.metrics.generation_tokens._value.get() < 200


def test_a_non_streaming_client_that_leaves_is_aborted_too(server):
    before = aborted_count(server)

    async def leave_early() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.ensure_future(client.post(server.url + "/v1/completions", json=LONG))
            deadline = time.monotonic() + 20
            while server.engine.kv_cache_manager.usage == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            task.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(leave_early())
    assert wait_until(lambda: aborted_count(server) == before + 1)
    assert wait_until(lambda: pool_is_empty(server.engine))


def test_the_server_serves_on_after_disconnects(server):
    response = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 4})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4
