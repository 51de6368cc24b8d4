"""Start and stop a server: from the command line (`minillm serve`) or in-process.

In a notebook or a test, `run_server` starts uvicorn in a thread on a loopback port and
stops it at the end of the block:

    from minillm import LLM
    from minillm.serve import run_server

    llm = LLM(max_model_len=512)
    with run_server(llm, port=0) as server:        # port 0: any free port
        print(server.url)                          # http://127.0.0.1:PORT
        # openai.OpenAI(base_url=server.base_url, api_key="-"), minillm bench serve
        #   --base-url server.url, or httpx.get(server.url + "/metrics")

`start_server` does the same without the block; `server.stop()` ends it. While a server
runs, it owns its engine: `llm.generate`, `llm.stream` and `llm.beam_search` on the same `LLM`
raise RuntimeError until it is stopped (two consumers would each lose the other's outputs).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.lora.request import LoRARequest
from minillm.model.loader import DEFAULT_MODEL
from minillm.serve.api_server import DEFAULT_MAX_REQUEST_BODY_BYTES, build_app
from minillm.serve.async_engine import AsyncEngine
from minillm.serve.chat_template import ChatTemplate
from minillm.serve.metrics import ServerMetrics
from minillm.serve.rate_limit import RateLimiter

DEFAULT_HOST = "127.0.0.1"  # loopback: reachable from this machine only, unless asked
DEFAULT_PORT = 8000
DEFAULT_MAX_WAITING_REQUESTS = 256
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0  # how long running requests may go on after SIGTERM
DRAIN_MARGIN_S = 2.0  # for the ended requests' last bytes, before uvicorn cuts connections


@dataclass
class ServerApp:
    """Everything a server is made of, before it listens anywhere."""

    app: object  # the FastAPI app
    engine: LLMEngine
    async_engine: AsyncEngine
    metrics: ServerMetrics
    served_model_name: str
    owns_engine: bool  # made here from a model name: shut down with the server
    llm: object = None  # the LLM served, if one was given: handed back on close

    def close(self) -> None:
        self.async_engine.shutdown()
        if self.llm is not None:
            self.llm._hand_over(None)
        if self.owns_engine:
            self.engine.shutdown()


def make_server_app(
    model=None,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
    rate_limit_tokens_per_minute: float | None = None,
    rate_limit_burst_tokens: float | None = None,
    rate_limiter: RateLimiter | None = None,
    lora_modules: dict[str, str] | list[str] | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    allowed_origins: list[str] | None = None,
    allowed_hosts: list[str] | None = None,
    **engine_args,
) -> ServerApp:
    """The app for `model`: an `LLM`, an `LLMEngine`, or a model directory or bundled name
    (None: the bundled model) with EngineArgs options (block_size=..., max_num_seqs=...).

    rate_limit_tokens_per_minute: a token bucket per API key (see minillm.serve.rate_limit),
    holding rate_limit_burst_tokens at most (default: a minute's worth); rate_limiter: a
    RateLimiter made by the caller (one with a test clock) instead. lora_modules: adapters
    clients select by `model` ({name: path}, or vLLM's "name=path" strings), for an engine
    with enable_lora=True; each is loaded and checked now. max_request_body_bytes: a larger
    body is answered 413 unread. allowed_origins: web origins allowed to call from a
    browser (CORS; None: none). allowed_hosts: host names the server answers to besides
    localhost and IP addresses (a Host header naming another is refused with 400: DNS
    rebinding); "*" for any."""
    from minillm.llm import LLM

    if rate_limiter is None and rate_limit_tokens_per_minute is not None:
        rate_limiter = RateLimiter(rate_limit_tokens_per_minute, rate_limit_burst_tokens)
    elif rate_limit_burst_tokens is not None and rate_limit_tokens_per_minute is None:
        raise ValueError("rate_limit_burst_tokens needs rate_limit_tokens_per_minute as well")

    lock = None
    if isinstance(model, LLM | LLMEngine):
        if engine_args:
            raise ValueError(
                f"engine options {sorted(engine_args)} apply only when the server loads the "
                "model itself; this one is already loaded"
            )
        engine = model.engine if isinstance(model, LLM) else model
        lock = model._lock if isinstance(model, LLM) else None
        owns_engine = False
        name = served_model_name or engine.tokenizer.path.parent.name
    else:
        args = EngineArgs(**engine_args) if model is None else EngineArgs(model, **engine_args)
        engine = LLMEngine(args)
        owns_engine = True
        name = served_model_name or str(DEFAULT_MODEL if model is None else os.fspath(model))
    adapters = lora_module_requests(lora_modules, name)
    if adapters and engine.lora_manager is None:
        raise ValueError("lora_modules need an engine with enable_lora=True (--enable-lora)")
    for lora in adapters.values():
        engine.lora_manager.add_lora(lora)  # a bad adapter fails now, not at a request
    served_llm = model if isinstance(model, LLM) else None
    if served_llm is not None:  # its generate and stream raise until the server is closed
        served_llm._hand_over(f"the minillm server {name!r}")
    try:
        metrics = ServerMetrics(engine, name)
        async_engine = AsyncEngine(
            engine, max_waiting_requests, metrics.observe_step, lock, metrics.added
        )
        chat_template = ChatTemplate.from_model_dir(engine.tokenizer.path.parent)
        app = build_app(
            async_engine,
            name,
            metrics,
            chat_template,
            api_key,
            rate_limiter,
            adapters,
            max_request_body_bytes,
            allowed_origins,
            allowed_hosts,
        )
    except BaseException:
        if served_llm is not None:
            served_llm._hand_over(None)
        raise
    return ServerApp(app, engine, async_engine, metrics, name, owns_engine, served_llm)


def lora_module_requests(
    lora_modules: dict[str, str] | list[str] | None, base_name: str
) -> dict[str, LoRARequest]:
    """{name: LoRARequest} from {name: path} or "name=path" strings, ids 1, 2, ..."""
    if not lora_modules:
        return {}
    if not isinstance(lora_modules, dict):
        pairs = {}
        for item in lora_modules:
            name, sep, path = str(item).partition("=")
            if not sep or not name or not path:
                raise ValueError(f"a LoRA module is name=path, got {item!r}")
            if name in pairs:
                raise ValueError(f"LoRA module {name!r} is named twice")
            pairs[name] = path
        lora_modules = pairs
    if base_name in lora_modules:
        raise ValueError(f"LoRA module {base_name!r} has the base model's name")
    return {
        name: LoRARequest(name, i, os.fspath(path))
        for i, (name, path) in enumerate(lora_modules.items(), start=1)
    }


@dataclass
class RunningServer:
    """A server listening in a thread of this process."""

    url: str  # http://host:port
    parts: ServerApp
    _uvicorn: object
    _thread: threading.Thread

    @property
    def base_url(self) -> str:
        """The URL OpenAI clients take: url + "/v1"."""
        return self.url + "/v1"

    @property
    def engine(self) -> LLMEngine:
        return self.parts.engine

    @property
    def metrics(self) -> ServerMetrics:
        return self.parts.metrics

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop listening, abort what is in flight, stop the engine thread."""
        self._uvicorn.should_exit = True
        self._thread.join(timeout_s)
        self.parts.close()


def draining_server(parts: ServerApp, shutdown_timeout: float, **config):
    """A uvicorn server whose shutdown (SIGTERM, Ctrl-C, `stop`) first tells the app to
    drain: no new requests, `shutdown_timeout` seconds for those running, then each is ended
    with OpenAI's error (an SSE error event and [DONE], or a 503). uvicorn's own cut comes
    DRAIN_MARGIN_S later, so that the app's endings are sent first."""
    import uvicorn

    if isinstance(shutdown_timeout, bool) or not (
        isinstance(shutdown_timeout, int | float) and 0 <= shutdown_timeout < float("inf")
    ):
        raise ValueError(f"shutdown_timeout must be a number >= 0, got {shutdown_timeout!r}")
    api = parts.app.state.server

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            api.begin_drain(shutdown_timeout)
            await super().shutdown(sockets)

    config = uvicorn.Config(
        parts.app, timeout_graceful_shutdown=shutdown_timeout + DRAIN_MARGIN_S, **config
    )
    return DrainingServer(config)


def with_bound_host(options: dict, host: str) -> dict:
    """`options` with the host the server binds to among its allowed host names."""
    allowed = options.get("allowed_hosts")
    if allowed is not None and "*" in allowed:
        return options
    return {**options, "allowed_hosts": [*(allowed or []), host]}


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def start_server(
    model=None,
    *,
    host: str = DEFAULT_HOST,
    port: int = 0,
    log_level: str = "warning",
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    **options,
) -> RunningServer:
    """Serve `model` (see make_server_app; options go there) from a thread; returns once it
    accepts connections. port 0 picks a free port (server.url tells which).
    shutdown_timeout: seconds running requests may go on once `stop` is called."""
    sock = bind_socket(host, port)  # first: a port in use fails before the model loads
    try:
        parts = make_server_app(model, **with_bound_host(options, host))
        server = draining_server(parts, shutdown_timeout, log_level=log_level, access_log=False)
    except BaseException:
        sock.close()
        raise
    parts.async_engine.start()
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="minillm-http", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            parts.close()
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return RunningServer(f"http://{shown}:{bound_port}", parts, server, thread)


@contextlib.contextmanager
def run_server(model=None, **options) -> Iterator[RunningServer]:
    """`start_server` for a with-block: the server stops when the block ends."""
    server = start_server(model, **options)
    try:
        yield server
    finally:
        server.stop()


class Terminated(Exception):
    """SIGTERM, raised once uvicorn has drained and handed the signal back."""


def raise_terminated(signum, frame) -> None:
    raise Terminated


def serve_forever(
    model=None,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    log_level="info",
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    **options,
) -> None:
    """Serve in the foreground until SIGTERM or Ctrl-C (what `minillm serve` runs); the
    port is bound before the model loads, so that a port in use fails at once. Either
    signal drains (see draining_server), closes the engine and returns: the command exits
    with status 0 after a drain, as after Ctrl-C."""
    sock = bind_socket(host, port)
    try:
        parts = make_server_app(model, **with_bound_host(options, host))
    except BaseException:
        sock.close()
        raise
    try:
        server = draining_server(parts, shutdown_timeout, log_level=log_level)
        parts.async_engine.start()
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        url = f"http://{shown}:{bound_port}"
        print(f"minillm serve: {parts.served_model_name} on {url}", flush=True)
        # uvicorn catches the signals while it runs and raises them again once it has shut
        # down: SIGTERM's default action would then end the process before the engine closes
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, raise_terminated) if main else None
        try:
            server.run(sockets=[sock])
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
    except (KeyboardInterrupt, Terminated):  # raised again by uvicorn once it has shut down
        pass
    finally:
        sock.close()
        parts.close()
