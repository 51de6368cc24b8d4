"""`AsyncEngine`: the engine stepped by one background thread, fed by async handlers.

The HTTP handlers run on an asyncio event loop; `LLMEngine.step` is a blocking forward
pass. So one thread owns the engine: it applies the handlers' commands (add a request,
abort one) between steps, steps while any request is unfinished, and sleeps on its command
queue when there is none. Each step's outputs go to the asyncio queue of the request they
belong to, through `loop.call_soon_threadsafe`, so a handler only ever awaits its queue.

    stream = await async_engine.add_request("r1", "def f(x):", SamplingParams())
    async for output in stream:          # one RequestOutput per step that adds to it
        ...
    async_engine.abort("r1")             # client gone: the request's blocks are freed

Admission is bounded: when `max_waiting_requests` requests already wait to be scheduled, a
new one is refused with `EngineOverloaded` (the server answers 503 with Retry-After)
instead of queueing without limit.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from minillm.engine.llm_engine import LLMEngine, Prompt, match_torch_threads
from minillm.lora.request import LoRARequest
from minillm.outputs import RequestOutput
from minillm.sampling_params import SamplingParams


class EngineOverloaded(Exception):
    """Too many requests are waiting; retry after `retry_after_s` seconds."""

    def __init__(self, num_waiting: int, retry_after_s: int = 1) -> None:
        super().__init__(
            f"the server is overloaded: {num_waiting} requests are already waiting to be "
            "scheduled; retry later"
        )
        self.retry_after_s = retry_after_s


class EngineDead(RuntimeError):
    """The engine loop stopped on an error (or was shut down): no request can run."""


@dataclass(eq=False)
class RequestStream:
    """The outputs of one request (or of several, when they share `queue`), as they come."""

    request_id: str
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    finished: bool = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            output = await self.queue.get()
            if isinstance(output, BaseException):
                raise output
            self.finished = output.finished
            yield output


@dataclass(eq=False)
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    arrival_time: float | None
    stream: RequestStream
    future: asyncio.Future
    lora_request: LoRARequest | None = None


@dataclass(eq=False)
class _Abort:
    request_ids: list[str] = field(default_factory=list)


class AsyncEngine:
    """An LLMEngine driven by a background thread (see the module's docstring).

    on_step: called in the engine thread with each step's outputs, before they are handed to
    their streams; on_add: called in the engine thread with each request the engine took,
    before its first step (both: the server's metrics). lock: held while the engine is touched; pass
    the `LLM`'s own lock when serving an `LLM`, so that nothing else steps it meanwhile.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int | None = None,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        lock: threading.RLock | None = None,
        on_add: Callable[[str, SamplingParams], None] | None = None,
    ) -> None:
        if max_waiting_requests is not None and (
            isinstance(max_waiting_requests, bool)
            or not isinstance(max_waiting_requests, int)
            or max_waiting_requests < 1
        ):
            raise ValueError(
                f"max_waiting_requests must be None or an int >= 1, got {max_waiting_requests!r}"
            )
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.on_step = on_step
        self.on_add = on_add
        self.lock = lock or threading.RLock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        self.error: BaseException | None = None  # why the loop stopped, if it did
        self._stopped = False

    # ------------------------------------------------------------------ the handlers' side

    def start(self) -> None:
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_streams(self) -> int:
        """Requests whose outputs are still being delivered (0 when idle)."""
        return len(self._streams)

    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        shared_queue: asyncio.Queue | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request; raises ValueError (a bad prompt or options), EngineOverloaded,
        or EngineDead. shared_queue: deliver to this queue (several requests, one consumer).
        arrival_time: when the request reached the server (`engine.clock()`), so that its
        TTFT and queueing time include the wait for the engine thread; default: when the
        engine thread adds it. lora_request: the adapter it runs with (None: the base model)."""
        if not self.is_running:
            raise EngineDead(f"the engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, shared_queue or asyncio.Queue(), loop)
        future = loop.create_future()
        self._commands.put(
            _Add(request_id, prompt, params, arrival_time, stream, future, lora_request)
        )
        try:
            await future
        except asyncio.CancelledError:  # the client left while the request was being added
            self.abort(request_id)
            raise
        return stream

    def abort(self, *request_ids: str) -> None:
        """Abort requests (unknown or finished ids are ignored); returns at once."""
        self._commands.put(_Abort(list(request_ids)))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort every request, stop the thread."""
        self._stopped = True
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        match_torch_threads()
        try:
            while not self._stopped:
                idle = not self.engine.has_unfinished_requests()
                if not self._apply(self._commands.get() if idle else None):
                    break
                while True:  # everything that came in meanwhile, before the next step
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if not self._apply(command):
                        return
                if self.engine.has_unfinished_requests():
                    with self.lock:
                        outputs = self.engine.step()
                    self._deliver(outputs)
        except BaseException as err:  # noqa: BLE001 - handed to every waiting handler
            self.error = err
            for stream in list(self._streams.values()):
                self._send(stream, EngineDead(f"the engine stopped: {err!r}"))
        finally:  # whatever stopped the loop, the requests it held free their blocks
            self._fail_pending_commands()
            with self.lock:
                for request_id in list(self._streams):
                    self.engine.abort_request(request_id)
            self._streams.clear()

    def _apply(self, command) -> bool:
        """Apply one command; False to stop the loop."""
        if command is None:
            return not self._stopped
        if isinstance(command, _Abort):
            with self.lock:
                for request_id in command.request_ids:
                    self._streams.pop(request_id, None)
                    self.engine.abort_request(request_id)
            return True
        waiting = len(self.engine.scheduler.waiting)
        if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
            self._resolve(command, EngineOverloaded(waiting))
            return True
        try:
            with self.lock:
                self.engine.add_request(
                    command.request_id,
                    command.prompt,
                    command.params,
                    command.arrival_time,
                    lora_request=command.lora_request,
                )
        except ValueError as err:
            self._resolve(command, err)
            return True
        if self.on_add is not None:
            self.on_add(command.request_id, command.params)
        self._streams[command.request_id] = command.stream
        self._resolve(command, None)
        return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if self.on_step is not None:
            self.on_step(outputs)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted: nobody waits for it any more
                continue
            if output.finished:
                del self._streams[output.request_id]
            self._send(stream, output)

    @staticmethod
    def _send(stream: RequestStream, item) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: its handlers are gone
            pass

    @staticmethod
    def _resolve(command: _Add, error: BaseException | None) -> None:
        def resolve() -> None:
            if command.future.done():
                return
            if error is None:
                command.future.set_result(None)
            else:
                command.future.set_exception(error)

        try:
            command.stream.loop.call_soon_threadsafe(resolve)
        except RuntimeError:
            pass

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._resolve(command, EngineDead("the engine is shutting down"))
