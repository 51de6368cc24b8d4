"""An LLM a server is serving belongs to the server: the LLM's own calls raise at once
instead of stepping the engine beside it (each would drop the other's outputs), and the LLM
works again once the server stops."""

from __future__ import annotations

import json

import httpx
import pytest

from minillm import SamplingParams
from minillm.sampling_params import BeamSearchParams
from minillm.serve import run_server
from tests.serve.conftest import greedy, pool_is_empty

PROMPT = "def fib(n):"


def test_the_llm_raises_while_served_and_the_stream_is_whole(llm):
    expected = greedy(llm, [PROMPT], 30, ignore_eos=True)[0]
    body = {"prompt": PROMPT, "max_tokens": 30, "ignore_eos": True, "temperature": 0}
    with run_server(llm, port=0) as server:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            with pytest.raises(RuntimeError, match="served by the minillm server"):
                llm.generate([PROMPT], SamplingParams(max_tokens=3), use_tqdm=False)
            with pytest.raises(RuntimeError, match="stop the server"):
                next(llm.stream(PROMPT, SamplingParams(max_tokens=3)))
            with pytest.raises(RuntimeError, match="served by"):
                llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=3))
            rest = [line for line in lines if line.startswith("data: {")]
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in [first, *rest])
        assert text == expected
        assert pool_is_empty(server.engine)
        with pytest.raises(RuntimeError, match="busy"):  # a second server on the same LLM
            run_server(llm, port=0).__enter__()
    assert greedy(llm, [PROMPT], 30, ignore_eos=True)[0] == expected  # handed back


def test_an_llm_with_requests_in_flight_is_not_served(llm):
    stream = llm.stream(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
    next(stream)  # a request of the LLM's own is in flight
    with pytest.raises(RuntimeError, match="1 requests of this LLM in flight"):
        run_server(llm, port=0).__enter__()
    stream.close()
    with run_server(llm, port=0) as server:
        assert httpx.get(server.url + "/health").status_code == 200
