"""A small OpenAI-compatible test double: streaming SSE with delays the test controls.

It serves /v1/models and streaming /v1/completions and /v1/chat/completions on a loopback
port (uvicorn in a thread), so the load generator talks real HTTP to it. Each request sleeps
`first_token_delay_s` before its first chunk and `gap_s` before every later one, and emits
`tokens_per_chunk` words per chunk (" w0", " w1", ...), then a usage chunk and [DONE]; with
`error_after_chunks`, an SSE error event ends the stream instead. With `serial`, one
request is served at a time (a server with a single slot), so later ones queue.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


@dataclass
class DoubleConfig:
    first_token_delay_s: float = 0.0
    gap_s: float = 0.0
    serial: bool = False
    reject_substring: str | None = None  # prompts containing it get HTTP 400
    usage_offset: int = 0  # usage reports this many tokens more than were streamed
    tokens_per_chunk: int = 1  # several tokens a chunk, as a server that merges deltas
    error_after_chunks: int | None = None  # then an SSE error event ends the stream
    usage_delay_s: float = 0.0  # a pause between the last token and the usage chunk


@dataclass
class DoubleState:
    payloads: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


class OpenAIDouble:
    def __init__(self) -> None:
        self.config = DoubleConfig()
        self.state = DoubleState()
        self._lock: asyncio.Lock | None = None
        app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.completions, methods=["POST"]),
            ]
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self, **config) -> None:
        self.config = DoubleConfig(**config)
        self.state = DoubleState()

    def __enter__(self) -> OpenAIDouble:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the test double did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "double", "object": "model"}]})

    async def completions(self, request: Request):
        payload = await request.json()
        self.state.payloads.append(payload)
        chat = request.url.path.endswith("/chat/completions")
        prompt = json.dumps(payload["messages"]) if chat else payload["prompt"]
        config = self.config
        if config.reject_substring and config.reject_substring in prompt:
            return JSONResponse({"error": {"message": "rejected"}}, status_code=400)
        if self._lock is None:
            self._lock = asyncio.Lock()

        async def stream():
            if config.serial:
                await self._lock.acquire()
            # the state of the test that sent this request: a stream of an earlier test that is
            # still closing must not count against the state a later reset() made
            state = self.state
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                n = payload["max_tokens"]
                per = config.tokens_per_chunk
                for c, first in enumerate(range(0, n, per)):
                    if c == config.error_after_chunks:
                        error = {"message": "the engine aborted the request", "type": "server"}
                        yield f"data: {json.dumps({'error': error})}\n\n"
                        return
                    await asyncio.sleep(config.first_token_delay_s if c == 0 else config.gap_s)
                    text = "".join(f" w{i}" for i in range(first, min(n, first + per)))
                    choice = (
                        {"index": 0, "delta": {"content": text}}
                        if chat
                        else {"index": 0, "text": text}
                    )
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                await asyncio.sleep(config.usage_delay_s)
                usage = {
                    "prompt_tokens": len(prompt.split()),
                    "completion_tokens": n + config.usage_offset,
                }
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1
                if config.serial:
                    self._lock.release()

        return StreamingResponse(stream(), media_type="text/event-stream")


class WordTokenizer:
    """Counts words: the double's output " w0 w1 ..." has one per streamed token."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("x" * i for i in ids)
