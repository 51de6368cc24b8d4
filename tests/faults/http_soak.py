"""The soak over HTTP: many concurrent streaming clients against a `minillm serve` process.

`python -m tests.faults.soak --http --clients 50 --minutes 20 --record results.json` starts
`minillm serve` (the bundled model, a small KV pool so that long requests preempt others,
prefix caching on, step faults injected by tests.faults.fault_serve) as a child process and
runs `--clients` clients at once, each sending one request after another, a mix of:

    normal          a streamed completion, sampled with a seed, to its end
    chat            a streamed chat completion
    aborted         a stream the client drops after a few chunks, or before any
    bad_input       a body the server must refuse (status and OpenAI error JSON checked)
    structured      a stream under a regex or a JSON schema; the text must match it
    prefix_sharing  a long shared prefix with a short own suffix, greedy
    preempting      a long prompt and a long output with n=2: the pool cannot hold many
    faulted         a prompt the server's engine fails in every step (tests.faults.fault_serve
                    injects it, and a transient fault of every 40th batch): the stream must
                    end with the engine's error event and [DONE], the others go on

Every `--check-every` requests the clients pause; once they are idle the server must report
no request running or waiting and no KV block held (`/metrics`), and a greedy probe request
must return the text a fresh engine of the same options gives. At the end a wave of streams
is sent and the server gets SIGTERM: every stream must end with its last chunk or the
server's error event, then `[DONE]`, and the process must exit by itself with status 0.

A "failure" is anything else: a wrong status or error body, a stream cut without `[DONE]`, a
structured output that does not match, a completion with the wrong number of tokens, a
client timeout, blocks held or a probe that differs at a check, or a drain that loses a
stream. The record counts requests and failures by kind, gives latency percentiles, the
checks' block accounting and the machine's load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import pathlib
import platform
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from minillm import LLM, SamplingParams
from tests.faults.fault_serve import POISON, TRANSIENT_EVERY

# the engine the server runs: a pool of 48 blocks of 16 tokens holds three full-length
# requests, so 16 running requests with long outputs must preempt (with 96, a 20-minute
# soak of 9,164 requests preempted only 16 times)
ENGINE_OPTIONS = {
    "max_model_len": 256,
    "max_num_seqs": 16,
    "block_size": 16,
    "num_gpu_blocks": 48,
    "enable_prefix_caching": True,
}
SHUTDOWN_TIMEOUT_S = 3.0
# how often each kind comes up, per 20 requests
MIX = {
    "normal": 5,
    "chat": 2,
    "aborted": 3,
    "bad_input": 3,
    "structured": 3,
    "prefix_sharing": 2,
    "preempting": 2,
    "faulted": 1,
}
PROBE = {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
PREFIXES = [
    "import os\nimport sys\nimport json\n\n\nclass Config:\n    def __init__(self, path):\n"
    "        self.path = path\n        self.values = {}\n\n    def load(self):\n",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(description='tool')\n"
    "    parser.add_argument('--verbose', action='store_true')\n    return parser.parse_args(",
]
PROMPTS = ["def main():", "class Stack:", "import re", "for i in range(10):", "with open("]
REGEX = r"[0-9]{3}-[0-9]{4}"
# bounded: an integer field lets the model write digits until max_tokens runs out
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "big"]}},
    "required": ["ok", "size"],
}
# (body, expected status, path); sent raw when the body is bytes
BAD_INPUTS = [
    ({"prompt": "x", "temperature": -1}, 400, "/v1/completions"),
    (b'{"prompt": "x", "max_tokens": ', 400, "/v1/completions"),
    ({"prompt": "x", "max_tokens": 10**6}, 400, "/v1/completions"),
    ({"prompt": "x", "no_such_field": 1}, 400, "/v1/completions"),
    ({"prompt": "x", "structured_outputs": {"regex": "("}}, 400, "/v1/completions"),
    ({"prompt": [10**9]}, 400, "/v1/completions"),
    ({"prompt": "x", "model": "no-such-model"}, 404, "/v1/completions"),
    ({"messages": []}, 400, "/v1/chat/completions"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "/v1/chat/completions"),
]


@dataclass
class Tally:
    requests: dict[str, int] = field(default_factory=dict)
    failures: dict[str, dict[str, int]] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)  # the first failures, in full
    latency_s: dict[str, list[float]] = field(default_factory=dict)  # finished streams
    ttft_s: list[float] = field(default_factory=list)
    checks: list[dict] = field(default_factory=list)
    load: list[float] = field(default_factory=list)  # 1-minute load average, sampled

    def count(self, kind: str) -> None:
        self.requests[kind] = self.requests.get(kind, 0) + 1

    def fail(self, kind: str, reason: str, detail: str = "") -> None:
        by_reason = self.failures.setdefault(kind, {})
        by_reason[reason] = by_reason.get(reason, 0) + 1
        if len(self.examples) < 20:
            self.examples.append(f"{kind}: {reason}: {detail[:300]}")
        print(f"FAIL {kind}: {reason}: {detail[:300]}", flush=True)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile by the nearest-rank rule."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class Stream:
    """One streamed response read to its end: its chunks, whether [DONE] came, an error."""

    def __init__(self) -> None:
        self.status = 0
        self.chunks: list[dict] = []
        self.done = False
        self.error: dict | None = None
        self.first_chunk_s: float | None = None

    async def read(self, client, path: str, body: dict, started: float, keep: int | None = None):
        """Read the stream; with `keep`, drop the connection after that many chunks."""
        async with client.stream("POST", path, json=body) as response:
            self.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                self.error = response.json().get("error")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    self.done = True
                    return
                event = json.loads(data)
                if "error" in event:
                    self.error = event["error"]
                    continue
                if self.first_chunk_s is None:
                    self.first_chunk_s = time.monotonic() - started
                self.chunks.append(event)
                if keep is not None and len(self.chunks) >= keep:
                    return  # leaving the block closes the connection mid-stream

    def texts(self, chat: bool = False) -> dict[int, str]:
        out: dict[int, str] = {}
        for chunk in self.chunks:
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content", "") if chat else choice["text"]
                out[choice["index"]] = out.get(choice["index"], "") + (piece or "")
        return out

    def finish_reasons(self) -> dict[int, str]:
        return {
            choice["index"]: choice["finish_reason"]
            for chunk in self.chunks
            for choice in chunk.get("choices", [])
            if choice.get("finish_reason")
        }

    def usage(self) -> dict | None:
        return next((c["usage"] for c in self.chunks if c.get("usage")), None)


class Soak:
    def __init__(self, url: str, clients: int, check_every: int, seed: int, expected: str):
        self.url = url
        self.num_clients = clients
        self.check_every = check_every
        self.rng = random.Random(seed)
        self.expected = expected
        self.tally = Tally()
        self.gate = asyncio.Event()
        self.gate.set()
        self.active = 0
        self.issued = 0
        self.stopping = False
        self.kinds = [kind for kind, weight in MIX.items() for _ in range(weight)]
        self.rng.shuffle(self.kinds)

    def next_kind(self) -> str:
        # round robin over a shuffled weighted list: every kind comes up within 20 requests
        return self.kinds[self.issued % len(self.kinds)]

    async def client(self, client_id: int) -> None:
        rng = random.Random(self.rng.random())
        async with httpx.AsyncClient(base_url=self.url, timeout=300) as client:
            while not self.stopping:
                await self.gate.wait()
                if self.stopping:
                    return
                if not self.gate.is_set():  # woken just as a check closed the gate
                    continue
                kind = self.next_kind()
                self.issued += 1
                self.active += 1
                started = time.monotonic()
                try:
                    await getattr(self, kind)(client, rng, started)
                except Exception as err:  # noqa: BLE001 - every surprise is a counted failure
                    self.tally.fail(kind, type(err).__name__, repr(err))
                finally:
                    self.active -= 1
                    self.tally.count(kind)

    def finished(self, kind: str, stream: Stream, started: float) -> bool:
        """A stream that must have run to its end: status 200, no error event, [DONE]."""
        if stream.status != 200:
            self.tally.fail(kind, f"status {stream.status}", json.dumps(stream.error))
            return False
        if stream.error is not None:
            self.tally.fail(kind, "error event", json.dumps(stream.error))
            return False
        if not stream.done:
            self.tally.fail(kind, "stream cut without [DONE]")
            return False
        self.tally.latency_s.setdefault(kind, []).append(time.monotonic() - started)
        if stream.first_chunk_s is not None:
            self.tally.ttft_s.append(stream.first_chunk_s)
        return True

    def check_tokens(self, kind: str, stream: Stream, n: int, max_tokens: int, exact: bool):
        usage = stream.usage()
        if usage is None:
            self.tally.fail(kind, "no usage chunk")
            return
        got = usage["completion_tokens"]
        if (exact and got != n * max_tokens) or got > n * max_tokens:
            self.tally.fail(kind, "wrong token count", f"{got} for n={n}, max={max_tokens}")

    # ------------------------------------------------------------------ the kinds

    async def normal(self, client, rng, started):
        max_tokens = rng.randint(4, 40)
        body = {
            "prompt": rng.choice(PROMPTS),
            "max_tokens": max_tokens,
            "temperature": rng.choice([0, 0.7, 1.0]),
            "seed": rng.randrange(1000),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        stream = Stream()
        await stream.read(client, "/v1/completions", body, started)
        if self.finished("normal", stream, started):
            self.check_tokens("normal", stream, 1, max_tokens, exact=False)

    async def chat(self, client, rng, started):
        max_tokens = rng.randint(4, 32)
        body = {
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        stream = Stream()
        await stream.read(client, "/v1/chat/completions", body, started)
        if self.finished("chat", stream, started):
            self.check_tokens("chat", stream, 1, max_tokens, exact=False)

    async def aborted(self, client, rng, started):
        body = {
            "prompt": rng.choice(PROMPTS),
            "max_tokens": 120,
            "ignore_eos": True,
            "n": rng.choice([1, 2]),
            "temperature": 1.0,
            "stream": True,
        }
        stream = Stream()
        if rng.random() < 0.3:  # gone before the first chunk, perhaps before it was scheduled
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    stream.read(client, "/v1/completions", body, started), rng.uniform(0.01, 0.5)
                )
        else:
            await stream.read(client, "/v1/completions", body, started, keep=rng.randint(1, 6))
        if stream.status not in (0, 200):
            self.tally.fail("aborted", f"status {stream.status}", json.dumps(stream.error))

    async def bad_input(self, client, rng, started):
        body, status, path = rng.choice(BAD_INPUTS)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = await client.post(
            path, content=content, headers={"content-type": "application/json"}
        )
        error = response.json().get("error", {})
        if response.status_code != status or not error.get("message"):
            detail = f"{path} {body!r}: {response.status_code} {response.text[:200]}"
            self.tally.fail("bad_input", f"status {response.status_code}", detail)

    async def structured(self, client, rng, started):
        if rng.random() < 0.5:
            body = {
                "prompt": "phone: ",
                "max_tokens": 16,
                "structured_outputs": {"regex": REGEX},
                "temperature": 1.0,
                "stream": True,
            }
            path, chat, valid = "/v1/completions", False, lambda t: re.fullmatch(REGEX, t)
        else:
            body = {
                "messages": [{"role": "user", "content": "a record"}],
                "max_tokens": 48,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "record", "schema": SCHEMA},
                },
                "temperature": 1.0,
                "stream": True,
            }
            path, chat, valid = "/v1/chat/completions", True, valid_record
        stream = Stream()
        await stream.read(client, path, body, started)
        if not self.finished("structured", stream, started):
            return
        text = stream.texts(chat)[0]
        if stream.finish_reasons().get(0) == "stop" and not valid(text):
            self.tally.fail("structured", "does not match", f"{path}: {text!r}")
        elif stream.finish_reasons().get(0) == "length":
            self.tally.fail("structured", "ran out of max_tokens", f"{path}: {text!r}")

    async def prefix_sharing(self, client, rng, started):
        body = {
            "prompt": rng.choice(PREFIXES) + rng.choice(PROMPTS),
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
        }
        stream = Stream()
        await stream.read(client, "/v1/completions", body, started)
        self.finished("prefix_sharing", stream, started)

    async def preempting(self, client, rng, started):
        max_tokens = rng.randint(80, 140)
        body = {
            "prompt": rng.choice(PREFIXES) * 2,
            "max_tokens": max_tokens,
            "n": 2,
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": rng.randrange(1000),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        stream = Stream()
        await stream.read(client, "/v1/completions", body, started)
        if self.finished("preempting", stream, started):
            self.check_tokens("preempting", stream, 2, max_tokens, exact=True)

    async def faulted(self, client, rng, started):
        body = {
            "prompt": POISON + [rng.randint(20, 200) for _ in range(rng.randint(1, 8))],
            "max_tokens": 8,
            "stream": True,
        }
        stream = Stream()
        await stream.read(client, "/v1/completions", body, started)
        error = stream.error or {}
        if stream.status != 200 or not stream.done:
            detail = f"status {stream.status}, done {stream.done}"
            self.tally.fail("faulted", "not ended by an error event and [DONE]", detail)
        elif error.get("code") != "engine_error" or "injected fault" not in error.get(
            "message", ""
        ):
            self.tally.fail("faulted", "no engine error event", json.dumps(stream.error))

    # ------------------------------------------------------------------ checks

    async def metrics(self, client) -> dict[str, float]:
        text = (await client.get("/metrics")).text
        return parse_metrics(text)

    async def check(self, client) -> None:
        """Pause the clients; once idle, no block held and the probe equals a fresh engine."""
        self.gate.clear()
        while self.active:
            await asyncio.sleep(0.05)
        record = {"after_requests": self.issued, "t_s": round(time.monotonic() - self.t0, 1)}
        idle, values = await self.wait_idle(client)
        record.update(idle_metrics(values))
        if not idle:
            self.tally.fail("check", "not idle after the clients stopped", json.dumps(record))
        response = await client.post("/v1/completions", json=PROBE)
        text = response.json()["choices"][0]["text"] if response.status_code == 200 else None
        record["probe_equals_fresh_engine"] = text == self.expected
        if text != self.expected:
            self.tally.fail("check", "probe differs", f"{text!r} != {self.expected!r}")
        idle, values = await self.wait_idle(client)
        if not idle:
            self.tally.fail("check", "not idle after the probe", json.dumps(values))
        record["load_1m"] = os.getloadavg()[0]
        self.tally.load.append(record["load_1m"])
        self.tally.checks.append(record)
        print(f"check {json.dumps(record)}", flush=True)
        self.gate.set()

    async def wait_idle(self, client, timeout_s: float = 60.0):
        """Aborts reach the engine thread between steps: give them a moment."""
        deadline = time.monotonic() + timeout_s
        while True:
            values = await self.metrics(client)
            if is_idle(values) or time.monotonic() > deadline:
                return is_idle(values), values
            await asyncio.sleep(0.1)

    async def run(self, duration_s: float) -> None:
        self.t0 = time.monotonic()
        tasks = [asyncio.create_task(self.client(i)) for i in range(self.num_clients)]
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            next_check = self.check_every
            while time.monotonic() - self.t0 < duration_s:
                await asyncio.sleep(0.2)
                if self.issued >= next_check:
                    await self.check(client)
                    next_check = self.issued + self.check_every
            self.stopping = True
            self.gate.set()
            await asyncio.gather(*tasks)
            await self.check(client)

    async def drain_wave(self, process: subprocess.Popen, num_streams: int) -> dict:
        """Streams in flight, then SIGTERM: each must end with its last chunk or the error
        event, then [DONE]; long ones outlive the drain time and get the error."""
        results: list[Stream] = [Stream() for _ in range(num_streams)]

        async def one(stream: Stream, i: int, client) -> None:
            body = {
                "prompt": PROMPTS[i % len(PROMPTS)],
                "max_tokens": 8 if i % 2 else 200,
                "ignore_eos": True,
                "stream": True,
            }
            try:
                await stream.read(client, "/v1/completions", body, time.monotonic())
            except httpx.ConnectError:
                stream.status = -1  # connected after the server stopped listening: refused
            except httpx.HTTPError as err:
                stream.error = {"client": repr(err)}

        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            tasks = [asyncio.create_task(one(s, i, client)) for i, s in enumerate(results)]
            deadline = time.monotonic() + 120
            while sum(s.first_chunk_s is not None for s in results) < num_streams // 2:
                if time.monotonic() > deadline or all(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.05)
            process.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            await asyncio.gather(*tasks)
        ended = {"finished": 0, "ended by the drain": 0, "refused": 0, "lost": 0}
        for stream in results:
            if stream.done and stream.error is None:
                ended["finished"] += 1
            elif stream.done and stream.error.get("code") == "server_shutting_down":
                ended["ended by the drain"] += 1
            elif stream.status in (503, -1):  # after SIGTERM: a 503, or no listener any more
                ended["refused"] += 1
            else:
                ended["lost"] += 1
                detail = f"status {stream.status}, {len(stream.chunks)} chunks, {stream.error}"
                self.tally.fail("drain", "stream lost", detail)
        try:
            rc = await asyncio.to_thread(process.wait, SHUTDOWN_TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            rc = None
            self.tally.fail("drain", "the server did not exit")
        if rc not in (0, None):
            self.tally.fail("drain", f"exit status {rc}")
        return {
            "streams": num_streams,
            **ended,
            "exit_status": rc,
            "exit_after_sigterm_s": round(time.monotonic() - sent, 2),
            "shutdown_timeout_s": SHUTDOWN_TIMEOUT_S,
        }


def valid_record(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"ok", "size"}
        and type(value["ok"]) is bool
        and value["size"] in ("small", "big")
    )


METRIC_LINE = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+|NaN)$")


def parse_metrics(text: str) -> dict[str, float]:
    """{name: value} of the unlabelled-but-for-model_name gauges; for cache_config_info,
    its num_gpu_blocks label."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = METRIC_LINE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        if name == "vllm:cache_config_info":
            blocks = re.search(r'num_gpu_blocks="(\d+)"', labels or "")
            values["num_gpu_blocks"] = float(blocks.group(1)) if blocks else math.nan
        else:
            values.setdefault(name, float(value))
    return values


def is_idle(values: dict[str, float]) -> bool:
    return (
        values.get("vllm:num_requests_running") == 0
        and values.get("vllm:num_requests_waiting") == 0
        and values.get("vllm:kv_cache_usage_perc") == 0
    )


def idle_metrics(values: dict[str, float]) -> dict:
    blocks = values.get("num_gpu_blocks", math.nan)
    usage = values.get("vllm:kv_cache_usage_perc", math.nan)
    return {
        "running": values.get("vllm:num_requests_running"),
        "waiting": values.get("vllm:num_requests_waiting"),
        "kv_blocks_held": round(usage * blocks),
        "kv_blocks": int(blocks),
        "preemptions_so_far": values.get("vllm:num_preemptions_total"),
    }


def serve_command(port: int = 0, transient_every: int = TRANSIENT_EVERY) -> list[str]:
    flags = []
    for name, value in ENGINE_OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return [
        sys.executable,
        "-m",
        "tests.faults.fault_serve",
        "--transient-every",
        str(transient_every),
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        *flags,
    ]


def start_server(
    log_path: pathlib.Path, transient_every: int = TRANSIENT_EVERY
) -> tuple[subprocess.Popen, str]:
    """`minillm serve` on a free loopback port; its URL, read from its first line."""
    log = open(log_path, "w")  # noqa: SIM115 (kept open for the child's lifetime)
    command = serve_command(transient_every=transient_every)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = re.search(r"minillm serve: \S+ on (http://\S+)", log_path.read_text())
        if found:
            return process, found.group(1)
        if process.poll() is not None:
            raise RuntimeError(f"minillm serve exited: {log_path.read_text()[-2000:]}")
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("minillm serve did not start in 300 s")


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else the machine's architecture."""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process, from /proc (Linux)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fresh_probe_text() -> str:
    llm = LLM(**ENGINE_OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=PROBE["max_tokens"], ignore_eos=True)
    return llm.generate([PROBE["prompt"]], params, use_tqdm=False)[0].outputs[0].text


def run_http_soak(
    minutes: float,
    clients: int,
    check_every: int,
    seed: int,
    workdir: pathlib.Path,
    drain_streams: int = 20,
    transient_every: int = TRANSIENT_EVERY,
) -> dict:
    """Run the soak; the record (see the module's docstring)."""
    expected = fresh_probe_text()
    log_path = workdir / "serve.log"
    load_before = os.getloadavg()
    process, url = start_server(log_path, transient_every)
    soak = Soak(url, clients, check_every, seed, expected)
    started = time.monotonic()
    try:
        asyncio.run(soak.run(60 * minutes))
        traffic_s = time.monotonic() - started
        server_cpu_s = cpu_seconds(process.pid)
        drain = asyncio.run(soak.drain_wave(process, drain_streams))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    tally = soak.tally
    all_latency = [x for values in tally.latency_s.values() for x in values]
    num_failures = sum(sum(reasons.values()) for reasons in tally.failures.values())
    return {
        "clients": clients,
        "minutes": minutes,
        "check_every": check_every,
        "seed": seed,
        "serve_command": " ".join(["minillm", *serve_command()[5:]]),
        "injected_faults": {
            "transient_every_nth_batch": transient_every,
            "transient": log_path.read_text().count("injected fault: transient"),
            "poisoned_steps": log_path.read_text().count("injected fault: poisoned"),
        },
        "traffic_s": round(traffic_s, 1),
        "requests": sum(tally.requests.values()),
        "requests_by_kind": dict(sorted(tally.requests.items())),
        "failures": num_failures,
        "failures_by_kind": tally.failures,
        "failure_examples": tally.examples,
        "latency_s": {
            "all_finished_streams": summary(all_latency),
            "first_chunk": summary(tally.ttft_s),
            **{kind: summary(values) for kind, values in sorted(tally.latency_s.items())},
        },
        "checks": len(tally.checks),
        "checks_failed": sum(
            not (c["probe_equals_fresh_engine"] and c["kv_blocks_held"] == 0) for c in tally.checks
        ),
        "final_check": tally.checks[-1] if tally.checks else None,
        "all_checks": tally.checks,
        "drain": drain,
        "machine": {
            "cores": os.cpu_count(),
            "cpu": cpu_name(),
            "load_1m_before": round(load_before[0], 2),
            "load_1m_at_checks": {
                "min": min(tally.load, default=None),
                "max": max(tally.load, default=None),
            },
            "server_cpu_s": server_cpu_s,
            "server_cpu_share_of_traffic_time": (
                None if server_cpu_s is None else round(server_cpu_s / traffic_s, 2)
            ),
        },
    }


def summary(values: list[float]) -> dict:
    return {
        "count": len(values),
        "p50": round_or_none(percentile(values, 50)),
        "p99": round_or_none(percentile(values, 99)),
        "max": round_or_none(max(values, default=None)),
    }


def round_or_none(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
