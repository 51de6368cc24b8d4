"""`minillm router`: one address in front of several `minillm serve` replicas.

    minillm serve --port 8001 &   minillm serve --port 8002 &
    minillm router --replica http://127.0.0.1:8001 http://127.0.0.1:8002 \\
        --policy prefix_aware --port 8000

A small FastAPI proxy. `POST /v1/completions` and `POST /v1/chat/completions` go to one
replica, chosen by the policy, and its answer comes back byte for byte (server-sent events
pass through as they arrive, status codes and Retry-After too). `GET /v1/models` asks any
live replica; `GET /health` probes every replica; `GET /metrics` counts the requests sent to
each replica, the ones in flight, the connection failures, and the requests refused for a
token quota.

The policies (pure functions and classes below, so that tests check them alone):

- `round_robin`: the live replicas in turn. Even by count, blind to request sizes.
- `least_outstanding`: the live replica with the fewest requests in flight through this
  router (ties: in turn). Follows the load when requests differ in length.
- `prefix_aware`: consistent hashing of the prompt's first `prefix_chars` characters on a
  hash ring with virtual nodes, so that requests sharing a prefix (a tenant's system prompt,
  a document) land on the replica whose prefix cache already holds its KV blocks. The key is
  a *character* prefix, not a token prefix: the router needs no tokenizer to route (it
  forwards to any OpenAI-compatible server) and equal text gives equal tokens, so equal
  character prefixes of the prompt mean equal first KV blocks. 256 characters is about 64 tokens,
  four blocks of 16: short enough to lie inside a shared system prompt, long enough to tell
  tenants apart. With virtual nodes, adding a replica to N moves about 1/(N + 1) of the keys
  and removing one moves only its own; a dead replica's keys go to the next one clockwise.
  SGLang's router ("cache-aware") and vLLM's production stack route by prefix for the same
  reason. Like SGLang's, this policy gives up affinity when the load is out of balance: when
  the busiest live replica has more than `balance_abs_threshold` requests in flight beyond
  the least busy one *and* more than `balance_rel_threshold` times its count, the request
  goes to the least busy replica instead (SGLang's `CacheAwareConfig` defaults: 32 and 1.1).
  A hot prefix then spills over instead of queueing on one replica.

A replica that refuses the connection (or closes it before answering) is marked down for
`down_for_s` seconds and the request goes to the next choice; when none is left the router
answers 503 with OpenAI's error JSON naming the replicas it tried. Only such connection
failures are retried (a completion changes nothing on the server, so a retry at worst
repeats work); an answer from a replica, an error included, is passed on as it is.

Token quotas (`rate_limit_tokens_per_minute`, `--rate-limit-tokens-per-minute`) belong here,
in front of the replicas: a bucket per key in each of N replicas lets a key spend N times
its quota, one bucket per key in the router holds it for the whole deployment. The keys are
the router's own `api_key` list, checked here (401 for any other); without keys there is one
bucket for all clients, since a key nobody checks could be made up for each request. The router
keeps the buckets of minillm.serve.rate_limit and charges what a replica would: it loads the
model's tokenizer and chat template only (`tokenizer`: the bundled model by default; nothing
is downloaded) and counts the prompt as the server does (`PromptReader`), plus n *
max_tokens, where a missing max_tokens is what max_model_len leaves (give the replicas'
`max_model_len`). A key short of tokens gets the server's 429 (OpenAI's body, Retry-After,
`x-ratelimit-*` headers) from the router, and no replica sees the request. When the answer
ends, the unused part goes back: what the answer's `usage` says was not generated, or, for a
stream without `stream_options.include_usage`, what the streamed chunks did not carry
(`UsageMeter`, also for a stream cut short). An answer other than 200, or none (no replica
left), gives back everything; a JSON answer cut short keeps it all, as the server keeps the
tokens of a request whose client left. A body the router cannot count (not JSON, no
prompt) is forwarded uncharged, and the replica answers its 400.

The router answers only to its own names, as the server does (`allowed_hosts`,
`--allowed-hosts`; see minillm.serve.api_server.HostCheckMiddleware): a request whose Host
header names another host is refused with 400 before its body is read or forwarded, since a
router on localhost is reachable by DNS rebinding just as a replica is.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import json
import pathlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from minillm.serve.api_server import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ApiKeyMiddleware,
    HostCheckMiddleware,
    PromptReader,
    api_key_list,
    check_allowed_hosts,
    rate_limit_key,
    rate_limited_error,
    read_capped_body,
    request_cost,
)
from minillm.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_request
from minillm.serve.rate_limit import RateLimited, RateLimiter, Reservation

POLICIES = ("round_robin", "least_outstanding", "prefix_aware")
DEFAULT_PREFIX_CHARS = 256
DEFAULT_VIRTUAL_NODES = 100
DEFAULT_BALANCE_ABS_THRESHOLD = 32
DEFAULT_BALANCE_REL_THRESHOLD = 1.1
# headers of a replica's answer the client must see (the rest are the connection's own)
PASSED_HEADERS = ("content-type", "retry-after", "x-request-id")
PASSED_PREFIXES = ("x-ratelimit-",)


# ------------------------------------------------------------------------------ policies


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process (Python's hash() is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing: each node owns `virtual_nodes` points on a 64-bit ring; a key
    belongs to the first point at or after its hash, going round."""

    def __init__(self, nodes: Sequence[str] = (), virtual_nodes: int = DEFAULT_VIRTUAL_NODES):
        if not isinstance(virtual_nodes, int) or virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be an int >= 1, got {virtual_nodes!r}")
        self.virtual_nodes = virtual_nodes
        self._points: list[tuple[int, str]] = []
        for node in nodes:
            self.add(node)

    @property
    def nodes(self) -> list[str]:
        return sorted({node for _, node in self._points})

    def add(self, node: str) -> None:
        if node in self.nodes:
            return
        for i in range(self.virtual_nodes):
            bisect.insort(self._points, (stable_hash(f"{node}#{i}"), node))

    def remove(self, node: str) -> None:
        self._points = [p for p in self._points if p[1] != node]

    def lookup(self, key: str, allowed: Callable[[str], bool] | None = None) -> str | None:
        """The node owning `key`; with `allowed`, the first allowed node clockwise from it
        (None: no node, or none allowed)."""
        if not self._points:
            return None
        start = bisect.bisect_left(self._points, (stable_hash(key), ""))
        for step in range(len(self._points)):
            node = self._points[(start + step) % len(self._points)][1]
            if allowed is None or allowed(node):
                return node
        return None


class RoundRobin:
    """The candidates in turn."""

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, candidates: Sequence[str]) -> str:
        choice = candidates[self.turn % len(candidates)]
        self.turn += 1
        return choice


def least_outstanding(candidates: Sequence[str], outstanding: dict[str, int], turn: int = 0) -> str:
    """A candidate with the fewest requests in flight; among equals, the first at or after
    position `turn` (so that an idle pool is still used in turn)."""
    fewest = min(outstanding.get(c, 0) for c in candidates)
    n = len(candidates)
    for step in range(n):
        c = candidates[(turn + step) % n]
        if outstanding.get(c, 0) == fewest:
            return c
    raise AssertionError("unreachable")


def is_imbalanced(
    loads: Sequence[int],
    abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
    rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
) -> bool:
    """Whether the busiest replica is ahead of the least busy one by more than abs_threshold
    requests and more than rel_threshold times its load (both must hold)."""
    if not loads:
        return False
    busiest, idlest = max(loads), min(loads)
    return busiest - idlest > abs_threshold and busiest > idlest * rel_threshold


def prefix_key(body: object, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str:
    """The routing key of a request body: the first `prefix_chars` characters of its prompt
    (completions: the prompt, or the first of a batch; token ids: as text; chat: the
    messages' roles and contents in order). A chat that opens with system (or developer)
    messages keys on those alone, the part a tenant's requests share, so that a system
    prompt shorter than `prefix_chars` does not pull the user's text into the key. A body
    without a prompt gives ""."""
    if not isinstance(body, dict):
        return ""
    if "messages" in body and isinstance(body["messages"], list):
        messages = [m for m in body["messages"] if isinstance(m, dict)]
        leading = 0
        while leading < len(messages) and messages[leading].get("role") in ("system", "developer"):
            leading += 1
        parts = []
        for m in messages[: leading or len(messages)]:
            content = m.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            parts.append(f"{m.get('role')}:{text}\n")
        return "".join(parts)[:prefix_chars]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, list):  # token ids: about 4 characters a token
        return ",".join(str(t) for t in prompt[: max(1, prefix_chars // 4)])
    return prompt[:prefix_chars] if isinstance(prompt, str) else ""


# ------------------------------------------------------------------------------ quotas


def load_prompt_reader(model: str | None = None, max_model_len: int | None = None) -> PromptReader:
    """A PromptReader for `model` (a local model directory or a bundled model's name; None:
    the bundled default), reading only its tokenizer, chat template and config. max_model_len
    is the replicas' (None: their default, the model's limit up to 4096)."""
    from minillm.engine.args import EngineArgs
    from minillm.model.loader import BUNDLED_MODELS_DIR, DEFAULT_MODEL, load_model
    from minillm.serve.chat_template import ChatTemplate

    model = DEFAULT_MODEL if model is None else str(model)
    if not (pathlib.Path(model).expanduser().is_dir() or (BUNDLED_MODELS_DIR / model).is_dir()):
        raise ValueError(
            f"tokenizer must be a local model directory or a bundled model's name, got "
            f"{model!r} (the router downloads nothing)"
        )
    loaded = load_model(model, weights=False)
    limit = EngineArgs(model, max_model_len=max_model_len).resolve_max_model_len(loaded.config)
    return PromptReader(loaded.tokenizer, ChatTemplate.from_model_dir(loaded.path), limit)


def load_json(raw: bytes) -> object:
    """The body's JSON, None when it is not JSON (the replica answers the 400)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def prompt_and_cost(reader: PromptReader, raw: bytes, path: str) -> tuple[int, int] | None:
    """(prompt tokens, tokens to reserve) of a request body, counted as the replica counts
    them; None when the replica will refuse the body (not JSON, a field missing or wrong)."""
    try:
        if path == "/v1/chat/completions":
            ids, params = reader.chat(parse_request(raw, ChatCompletionRequest))
            ids_list, params_list = [ids], [params]
        else:
            _, ids_list, params_list = reader.completion(parse_request(raw, CompletionRequest))
    except ApiError:
        return None
    return sum(len(ids) for ids in ids_list), request_cost(ids_list, params_list)


class UsageMeter:
    """The completion tokens of a replica's answer, read as it passes through the router:
    the `usage` of a JSON answer or of a stream's last chunk (`stream_options.include_usage`),
    else counted from the streamed chunks. Each chunk the server sends for a choice follows
    at least one new token (the chat role chunk aside), and its text re-tokenizes to about
    the tokens that made it; a choice counts the larger of the two. That is an estimate: text
    held back by a stop string is not seen, an echoed prompt is counted."""

    def __init__(self, tokenizer, streaming: bool) -> None:
        self.tokenizer = tokenizer
        self.streaming = streaming
        self.buffer = bytearray()
        self.texts: dict[int, str] = {}  # choice index -> its text so far
        self.chunks: dict[int, int] = {}  # choice index -> chunks that carried new tokens
        self.usage: dict | None = None

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        while self.streaming and b"\n\n" in self.buffer:
            event, _, rest = bytes(self.buffer).partition(b"\n\n")
            self.buffer = bytearray(rest)
            for line in event.split(b"\n"):
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    self.read_chunk(line[6:])

    def read_chunk(self, data: bytes) -> None:
        try:
            chunk = json.loads(data)
        except ValueError:
            return
        if not isinstance(chunk, dict):
            return
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            index, delta = choice.get("index", 0), choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            self.texts[index] = self.texts.get(index, "") + (text or "")
            if not (isinstance(delta, dict) and "role" in delta):
                self.chunks[index] = self.chunks.get(index, 0) + 1

    def completion_tokens(self) -> int | None:
        """The tokens generated (None: a JSON answer without usage, unknown)."""
        if not self.streaming:
            try:
                self.usage = json.loads(self.buffer).get("usage")
            except (ValueError, AttributeError):
                return None
        if isinstance(self.usage, dict) and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"]
        if not self.streaming:
            return None
        encode = self.tokenizer.encode
        return sum(
            max(self.chunks.get(i, 0), len(encode(text, add_special_tokens=False)))
            for i, text in self.texts.items()
        )


# ------------------------------------------------------------------------------ the proxy


def check_replicas(replicas: Sequence[str]) -> list[str]:
    if isinstance(replicas, str) or not replicas:
        raise ValueError(f"replicas must be a non-empty list of URLs, got {replicas!r}")
    out = []
    for url in replicas:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"replica must be an http:// or https:// URL, got {url!r}")
        url = url.rstrip("/").removesuffix("/v1")
        if url in out:
            raise ValueError(f"replica {url!r} is listed twice")
        out.append(url)
    return out


class Router:
    """The routing state: replicas, the policy, requests in flight, replicas marked down."""

    def __init__(
        self,
        replicas: Sequence[str],
        policy: str = "round_robin",
        *,
        prefix_chars: int = DEFAULT_PREFIX_CHARS,
        virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
        down_for_s: float = 5.0,
        timeout_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
        rate_limit_tokens_per_minute: float | None = None,
        rate_limit_burst_tokens: float | None = None,
        rate_limiter: RateLimiter | None = None,
        tokenizer: str | None = None,
        max_model_len: int | None = None,
        api_key: str | Sequence[str] | None = None,
        max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
        allowed_hosts: Sequence[str] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if not isinstance(balance_abs_threshold, int) or balance_abs_threshold < 0:
            raise ValueError(
                f"balance_abs_threshold must be an int >= 0, got {balance_abs_threshold!r}"
            )
        if not isinstance(balance_rel_threshold, int | float) or balance_rel_threshold < 1:
            raise ValueError(
                f"balance_rel_threshold must be a number >= 1, got {balance_rel_threshold!r}"
            )
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.spilled_total = 0  # prefix_aware requests sent elsewhere for balance
        if not isinstance(prefix_chars, int) or prefix_chars < 1:
            raise ValueError(f"prefix_chars must be an int >= 1, got {prefix_chars!r}")
        self.replicas = check_replicas(replicas)
        self.policy = policy
        self.prefix_chars = prefix_chars
        self.down_for_s = down_for_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.ring = HashRing(self.replicas, virtual_nodes)
        self.round_robin = RoundRobin()
        self.outstanding = dict.fromkeys(self.replicas, 0)
        self.requests_total = dict.fromkeys(self.replicas, 0)
        self.failures_total = dict.fromkeys(self.replicas, 0)
        self.down_until = dict.fromkeys(self.replicas, 0.0)
        self._client = None
        # checked here when given: then each key has its own bucket (else one for all)
        self.api_keys = api_key_list(api_key)
        self.max_request_body_bytes = max_request_body_bytes  # larger: 413, not forwarded
        # host names answered besides localhost and IP addresses (the server's DNS-rebinding
        # check, see HostCheckMiddleware); "*": any
        self.allowed_hosts = check_allowed_hosts(allowed_hosts)
        # token quotas for the whole deployment (see the module docstring)
        if rate_limiter is None and rate_limit_tokens_per_minute is not None:
            rate_limiter = RateLimiter(rate_limit_tokens_per_minute, rate_limit_burst_tokens)
        elif rate_limit_burst_tokens is not None and rate_limit_tokens_per_minute is None:
            raise ValueError("rate_limit_burst_tokens needs rate_limit_tokens_per_minute as well")
        if rate_limiter is None and (tokenizer is not None or max_model_len is not None):
            raise ValueError("tokenizer and max_model_len count tokens for a rate limit: set one")
        self.rate_limiter = rate_limiter
        self.prompts = (
            None if rate_limiter is None else load_prompt_reader(tokenizer, max_model_len)
        )
        self.rate_limited_total = 0

    def is_up(self, replica: str) -> bool:
        return self.clock() >= self.down_until[replica]

    def mark_down(self, replica: str, request_failed: bool = True) -> None:
        """Skip `replica` for down_for_s; request_failed: a request's connection failed
        (counted in minillm_router_connect_failures_total), not a health probe."""
        if request_failed:
            self.failures_total[replica] += 1
        self.down_until[replica] = self.clock() + self.down_for_s

    def choose(self, body: object, exclude: set[str] = frozenset()) -> str | None:
        """The replica for a request body, among those up and not in `exclude`."""
        candidates = [r for r in self.replicas if r not in exclude and self.is_up(r)]
        if not candidates:
            return None
        if self.policy == "round_robin":
            return self.round_robin.choose(candidates)
        if self.policy == "least_outstanding":
            self.round_robin.turn += 1
            return least_outstanding(candidates, self.outstanding, self.round_robin.turn)
        loads = [self.outstanding[r] for r in candidates]
        if is_imbalanced(loads, self.balance_abs_threshold, self.balance_rel_threshold):
            self.spilled_total += 1
            self.round_robin.turn += 1
            return least_outstanding(candidates, self.outstanding, self.round_robin.turn)
        allowed = set(candidates)
        return self.ring.lookup(prefix_key(body, self.prefix_chars), allowed.__contains__)

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # made in the server's event loop, on first use
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s, connect=5.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
        return self._client

    async def forward(self, request: Request, path: str) -> Response:
        try:
            raw = await read_capped_body(request, self.max_request_body_bytes)
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status_code)
        body = await asyncio.to_thread(load_json, raw)
        headers = {
            k: v for k, v in request.headers.items() if k in ("content-type", "authorization")
        }
        reservation, prompt_tokens = None, 0
        if self.rate_limiter is not None:
            # tokenizing in a worker thread: a long prompt does not stall the other streams
            counted = await asyncio.to_thread(prompt_and_cost, self.prompts, raw, path)
            if counted is not None:  # else the replica answers the 400, and nothing is taken
                prompt_tokens, cost = counted
                authorization = request.headers.get("authorization", "")
                key = rate_limit_key(authorization, self.api_keys is not None)
                try:
                    reservation = self.rate_limiter.acquire(key, cost)
                except RateLimited as err:
                    self.rate_limited_total += 1
                    refused = rate_limited_error(err, self.rate_limiter, key)
                    return JSONResponse(refused.body(), 429, headers=refused.headers)
        try:
            return await self._send(raw, body, headers, path, reservation, prompt_tokens)
        except BaseException:
            if reservation is not None:
                reservation.settle(0)
            raise

    async def _send(self, raw, body, headers, path, reservation, prompt_tokens) -> Response:
        """Send to the first replica that takes the connection, as the policy orders them."""
        tried: list[str] = []
        while True:
            replica = self.choose(body, set(tried))
            if replica is None:
                message = (
                    f"no replica available: tried {tried}; "
                    f"replicas marked down: {[r for r in self.replicas if not self.is_up(r)]}"
                )
                err = {
                    "error": {
                        "message": message,
                        "type": "server_error",
                        "param": None,
                        "code": "no_replica_available",
                    }
                }
                if reservation is not None:
                    reservation.settle(0)
                return JSONResponse(err, status_code=503, headers={"Retry-After": "1"})
            tried.append(replica)
            self.outstanding[replica] += 1
            try:
                upstream = await self.client.send(
                    self.client.build_request("POST", replica + path, content=raw, headers=headers),
                    stream=True,
                )
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError):
                self.outstanding[replica] -= 1
                self.mark_down(replica)
                continue
            except httpx.TimeoutException:  # it took the request: a retry could run it twice
                self.outstanding[replica] -= 1
                if reservation is not None:
                    reservation.settle(None)  # the replica may have spent it all
                err = ApiError(
                    f"the replica {replica} did not answer within {self.timeout_s:g} s "
                    "(the router's timeout_s, --request-timeout)",
                    504,
                    code="replica_timeout",
                    type="server_error",
                )
                return JSONResponse(err.body(), status_code=504)
            except BaseException:
                self.outstanding[replica] -= 1
                raise
            self.requests_total[replica] += 1
            meter = None
            if reservation is not None:
                streaming = upstream.headers.get("content-type", "").startswith("text/event-stream")
                meter = UsageMeter(self.prompts.tokenizer, streaming)
            done = self._done(replica, upstream, reservation, meter, prompt_tokens)
            return PassThrough(upstream, done, None if meter is None else meter.feed)

    def _done(
        self, replica: str, upstream, reservation=None, meter=None, prompt_tokens: int = 0
    ) -> Callable:
        """What runs once the answer has ended (finished, the client gone, the replica
        gone): free the replica's seat, settle the quota's reservation."""
        finished = False

        async def done() -> None:
            nonlocal finished
            if not finished:
                finished = True
                if reservation is not None:  # first: a client's next request sees the refund
                    settle_reservation(reservation, upstream.status_code, meter, prompt_tokens)
                self.outstanding[replica] -= 1
                await upstream.aclose()

        return done

    async def health(self) -> dict[str, bool]:
        """Probe every replica's /health (a replica that answers is up again)."""

        async def probe(replica: str) -> bool:
            try:
                r = await self.client.get(replica + "/health", timeout=2.0)
            except httpx.HTTPError:
                self.mark_down(replica, request_failed=False)
                return False
            if r.status_code == 200:
                self.down_until[replica] = 0.0
                return True
            return False

        states = await asyncio.gather(*(probe(r) for r in self.replicas))
        return dict(zip(self.replicas, states, strict=True))

    def render_metrics(self) -> str:
        """Prometheus text format."""
        lines = []
        for name, kind, help_text, values in (
            (
                "minillm_router_requests_total",
                "counter",
                "Requests forwarded to each replica.",
                self.requests_total,
            ),
            (
                "minillm_router_outstanding_requests",
                "gauge",
                "Requests in flight through the router, per replica.",
                self.outstanding,
            ),
            (
                "minillm_router_connect_failures_total",
                "counter",
                "Connections to a replica that failed (the request went elsewhere).",
                self.failures_total,
            ),
            (
                "minillm_router_replica_up",
                "gauge",
                "1 while the replica is not marked down.",
                {r: int(self.is_up(r)) for r in self.replicas},
            ),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f'{name}{{replica="{r}"}} {v}' for r, v in values.items()]
        for name, help_text, value in (
            (
                "minillm_router_balance_spills_total",
                "prefix_aware requests sent to the least busy replica for balance.",
                self.spilled_total,
            ),
            (
                "minillm_router_rate_limited_total",
                "Requests the router answered 429 for a key's token quota (never forwarded).",
                self.rate_limited_total,
            ),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        return "\n".join(lines) + "\n"

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def settle_reservation(
    reservation: Reservation, status_code: int, meter: UsageMeter, prompt_tokens: int
) -> None:
    """Give back what a proxied request did not use: all of it when the replica refused it
    or failed (no tokens generated), else all but the prompt and the completion tokens."""
    if status_code != 200:
        reservation.settle(0)
        return
    completion = meter.completion_tokens()
    reservation.settle(None if completion is None else prompt_tokens + completion)


class PassThrough(StreamingResponse):
    """A replica's answer streamed to the client as it arrives; `done` runs however the
    stream ends (finished, the client gone, a failed send)."""

    def __init__(self, upstream: httpx.Response, done, on_chunk=None) -> None:
        headers = {
            k: v
            for k, v in upstream.headers.items()
            if k in PASSED_HEADERS or k.startswith(PASSED_PREFIXES)
        }
        super().__init__(relay(upstream, on_chunk), upstream.status_code, headers)
        self.done = done

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.done()


async def relay(upstream: httpx.Response, on_chunk=None):
    """The answer's bytes as they arrive, each shown to `on_chunk` first (the usage meter)."""
    async for chunk in upstream.aiter_raw():
        if on_chunk is not None:
            on_chunk(chunk)
        yield chunk


def build_router_app(router: Router):
    """The FastAPI app of `router`."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await router.aclose()

    app = FastAPI(
        title="minillm router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.router = router

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, err: Exception) -> JSONResponse:
        # a bug, not the client's fault: still OpenAI's JSON (the traceback goes to the log)
        message = f"internal router error: {type(err).__name__}: {err}"
        error = ApiError(message, 500, code="internal_error", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    if router.api_keys is not None:
        app.add_middleware(ApiKeyMiddleware, api_keys=router.api_keys)
    if "*" not in router.allowed_hosts:  # added last: checked first, before anything is read
        app.add_middleware(HostCheckMiddleware, allowed_hosts=router.allowed_hosts)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        for replica in router.replicas:
            if router.is_up(replica):
                try:
                    auth = {k: v for k, v in request.headers.items() if k == "authorization"}
                    r = await router.client.get(replica + "/v1/models", headers=auth)
                except Exception:  # noqa: BLE001 (any failure: try the next replica)
                    router.mark_down(replica)
                    continue
                return Response(r.content, r.status_code, media_type="application/json")
        return JSONResponse({"error": {"message": "no replica available"}}, status_code=503)

    @app.get("/health")
    async def health():
        states = await router.health()
        return JSONResponse(states, status_code=200 if any(states.values()) else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(router.render_metrics(), media_type="text/plain; version=0.0.4")

    return app


@dataclass
class RunningRouter:
    """A router listening in a thread of this process."""

    url: str
    router: Router
    _uvicorn: object
    _thread: threading.Thread

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self, timeout_s: float = 30.0) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout_s)


def start_router(
    replicas: Sequence[str],
    policy: str = "round_robin",
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    **options,
) -> RunningRouter:
    """Route over `replicas` from a thread (options: Router's); returns once it listens."""
    import uvicorn

    from minillm.serve.server import bind_socket, with_bound_host

    router = Router(replicas, policy, **with_bound_host(options, host))
    sock = bind_socket(host, port)
    config = uvicorn.Config(
        build_router_app(router),
        log_level=log_level,
        timeout_graceful_shutdown=5,
        access_log=False,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="minillm-router", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the router did not start")
        time.sleep(0.01)
    bound_host, bound_port = sock.getsockname()[:2]
    return RunningRouter(f"http://{bound_host}:{bound_port}", router, server, thread)


@contextlib.contextmanager
def run_router(replicas: Sequence[str], policy: str = "round_robin", **options) -> Iterator:
    """`start_router` for a with-block."""
    running = start_router(replicas, policy, **options)
    try:
        yield running
    finally:
        running.stop()


def route_forever(
    replicas: Sequence[str],
    policy: str = "round_robin",
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    **options,
) -> None:
    """Route in the foreground until interrupted (what `minillm router` runs)."""
    import uvicorn

    from minillm.serve.server import with_bound_host

    router = Router(replicas, policy, **with_bound_host(options, host))
    print(f"minillm router: {policy} over {router.replicas} on http://{host}:{port}", flush=True)
    uvicorn.run(build_router_app(router), host=host, port=port, log_level=log_level)
