"""`minillm bench serve`: a load generator for any OpenAI-compatible server.

It streams requests to `/v1/completions` (or `/v1/chat/completions`) with httpx, records
when each output chunk arrives, and reports the metrics of `minillm.lab.serving_metrics`.

How it times requests:

- **Open loop** (`request_rate`): sessions arrive on a schedule (Poisson, or gamma with a
  burstiness), whether or not earlier ones are done. Each request is sent at its scheduled
  time and its latency counts from that time, so a client that falls behind (an event loop
  busy, a `max_concurrency` cap full) adds its delay to the latency instead of hiding it:
  no coordinated omission. The send lag is recorded too.
- **Closed loop** (`concurrency`): C users each send a request, wait for its end, and send
  the next. A closed loop measures a server at a fixed number in flight; its latencies
  count from the send, which is also its schedule.
- Multi-turn sessions send turn k + 1 when turn k has finished (plus a think time); the
  history (user text and the answers received) is the next turn's prompt.

What it counts, as vLLM 0.11's `vllm bench serve` does (`vllm/benchmarks/serve.py`,
`calculate_metrics`): a request's output tokens n from the server's `usage`, else from
re-tokenizing the received text, never from the number of chunks (a chunk can hold several
tokens: a server that falls behind merges deltas, speculative decoding emits several per
step). TPOT divides by n - 1 tokens; ITL is per chunk; E2EL ends at the last chunk with
text. Chunks per request are reported, so multi-token chunks show. A stream that ends with an
error event is a failed request, whatever it streamed before. Warm-up requests run first and
are not counted. Every prompt of a run starts with a short run-unique salt, so a run never
hits prefix-cache blocks that the previous run left (cache carry-over); shared prefixes are
shared within a run only.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from minillm.lab import serving_metrics as sm

WORDS = (
    "the of and to in is for that with on as by this from data value list return time "
    "request token model cache batch server queue stream client layer block memory step "
    "prompt output input rate load latency number first last next each every other small"
).split()


@dataclass(frozen=True, slots=True)
class Turn:
    """One user message of a session and how many output tokens it asks for."""

    text: str
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Session:
    """A conversation: its turns are sent one after another, each when the last has ended.
    A single request is a session of one turn."""

    turns: tuple[Turn, ...]


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request; times in seconds since the run's start."""

    session: int
    turn: int
    scheduled_s: float
    sent_s: float = math.nan
    token_times_s: list[float] = field(default_factory=list)
    end_s: float = math.nan  # the stream's end (after usage and [DONE]): in flight until then
    text: str = ""
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens
    output_tokens: int | None = None  # the server's usage.completion_tokens
    retokenized_output_tokens: int | None = None  # len(tokenizer.encode(text))
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times_s)

    @property
    def num_tokens(self) -> int | None:
        """Output tokens: the server's usage count, else the re-tokenized text's, else None
        (then the metrics count one token a chunk)."""
        for count in (self.output_tokens, self.retokenized_output_tokens):
            if isinstance(count, int) and not isinstance(count, bool) and count >= 1:
                return count
        return None

    def timing(self) -> sm.RequestTiming:
        """The latencies' inputs: E2EL ends at the last chunk with text, as in vLLM."""
        times = tuple(self.token_times_s)
        end = times[-1] if times else self.end_s
        return sm.RequestTiming(self.scheduled_s, self.sent_s, times, end, self.ok, self.num_tokens)


@dataclass(slots=True)
class Run:
    """The records of one run (in order of sessions, then turns) and how it was driven."""

    mode: str  # "open" or "closed"
    load: float  # request rate (sessions/s; inf: all at once) or concurrency
    records: list[RequestRecord]
    duration_s: float  # from the run's start to the end of its last response
    salt: str


# ------------------------------------------------------------------------------ workloads


def random_text(rng: np.random.Generator, num_tokens: int, tokenizer=None) -> str:
    """Text of `num_tokens` tokens by `tokenizer` (cut at a token boundary), or of that many
    words without one. Re-encoding decoded text can merge across the cut, so the server's
    count may differ by a token or two; `usage.prompt_tokens` reports what it saw."""
    words = " ".join(rng.choice(WORDS, size=max(1, num_tokens)).tolist())
    if tokenizer is None:
        return words
    ids = tokenizer.encode(words, add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids)


def fixed_sessions(n: int, input_len: int, output_len: int, seed: int, tokenizer=None):
    """n single requests, each of input_len prompt tokens asking for output_len tokens."""
    rng = np.random.default_rng(seed)
    return [Session((Turn(random_text(rng, input_len, tokenizer), output_len),)) for _ in range(n)]


def shared_prefix_sessions(
    n: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int,
    tokenizer=None,
) -> list[Session]:
    """n requests in num_prefixes groups: each group shares a prefix of prefix_len tokens
    (a system prompt, a document) and each request adds its own suffix of suffix_len."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be at least 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    prefixes = [random_text(rng, prefix_len, tokenizer) for _ in range(num_prefixes)]
    return [
        Session(
            (
                Turn(
                    prefixes[i % num_prefixes] + " " + random_text(rng, suffix_len, tokenizer),
                    output_len,
                ),
            )
        )
        for i in range(n)
    ]


def multi_turn_sessions(
    n: int, num_turns: int, input_len: int, output_len: int, seed: int, tokenizer=None
) -> list[Session]:
    """n conversations of num_turns turns, each user message input_len tokens."""
    rng = np.random.default_rng(seed)
    return [
        Session(
            tuple(
                Turn(random_text(rng, input_len, tokenizer), output_len) for _ in range(num_turns)
            )
        )
        for _ in range(n)
    ]


def dataset_sessions(path: str, default_max_tokens: int) -> list[Session]:
    """Sessions from a JSONL file: one object a line, either {"prompt": str} or
    {"turns": [str, ...]}, with an optional "max_tokens" (int)."""
    sessions = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON: {err.msg}") from None
            texts = [item["prompt"]] if isinstance(item, dict) and "prompt" in item else None
            if texts is None and isinstance(item, dict):
                texts = item.get("turns")
            max_tokens = item.get("max_tokens", default_max_tokens) if isinstance(item, dict) else 0
            if (
                not isinstance(texts, list)
                or not texts
                or not all(isinstance(t, str) for t in texts)
                or not isinstance(max_tokens, int)
                or isinstance(max_tokens, bool)
                or max_tokens < 1
            ):
                raise ValueError(
                    f'{path}:{number}: expected {{"prompt": str}} or {{"turns": [str, ...]}} '
                    'with an optional positive int "max_tokens"'
                )
            sessions.append(Session(tuple(Turn(t, max_tokens) for t in texts)))
    if not sessions:
        raise ValueError(f"{path} holds no requests")
    return sessions


def arrival_times(n: int, rate_per_s: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Start times (s) of n sessions: gamma-distributed gaps with mean 1 / rate and shape
    `burstiness` (1: a Poisson process; below 1 burstier, above 1 more regular); all at 0
    for an infinite rate."""
    if rate_per_s <= 0:
        raise ValueError(f"the request rate must be positive, got {rate_per_s}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate_per_s):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (rate_per_s * burstiness), n)
    return (np.cumsum(gaps) - gaps[0]).tolist()  # the first session starts the run


# --------------------------------------------------------------------------------- client


@dataclass(slots=True)
class Target:
    """Where and how to send: an OpenAI-compatible server."""

    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    ignore_eos: bool = True
    api_key: str | None = None
    timeout_s: float = 300.0
    transport: object = None  # an httpx transport, for tests (default: the network)

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")


def _payload(target: Target, history: list[tuple[str, str]], turn: Turn) -> dict:
    payload: dict = {
        "model": target.model,
        "max_tokens": turn.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        payload["ignore_eos"] = True
    if target.endpoint == "chat":
        messages = []
        for user, answer in history:
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": answer},
            ]
        payload["messages"] = [*messages, {"role": "user", "content": turn.text}]
    else:
        payload["prompt"] = "".join(u + a for u, a in history) + turn.text
    return payload


def _chunk_text(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send(client, target: Target, payload: dict, record: RequestRecord, t0: float) -> None:
    """Stream one request; fill `record` with the time of every chunk that carries text."""
    path = "/v1/chat/completions" if target.endpoint == "chat" else "/v1/completions"
    record.sent_s = time.perf_counter() - t0
    try:
        async with client.stream("POST", path, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                chunk = json.loads(data)
                if chunk.get("error"):  # the server aborted the request mid-stream
                    error = chunk["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    record.error = (
                        f"error event after {len(record.token_times_s)} chunks: {message}"
                    )
                    break
                text = _chunk_text(chunk, target.endpoint)
                if text:
                    record.token_times_s.append(now)
                    record.text += text
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    record.output_tokens = chunk["usage"].get("completion_tokens")
    except Exception as err:  # noqa: BLE001 - the network's errors are many; record them all
        record.error = f"{type(err).__name__}: {err}"
    finally:
        record.end_s = time.perf_counter() - t0
    if not record.token_times_s and record.error is None:
        record.error = "the response carried no output"


async def _session(
    client, target, session, index, scheduled_s, t0, records, think_time_s, gate, on_done=None
):
    history: list[tuple[str, str]] = []
    for k, turn in enumerate(session.turns):
        record = RequestRecord(index, k, scheduled_s)
        records.append(record)
        if gate is not None:
            async with gate:  # a concurrency cap: the wait counts, from the schedule
                await send(client, target, _payload(target, history, turn), record, t0)
        else:
            await send(client, target, _payload(target, history, turn), record, t0)
        if on_done is not None:
            on_done(record)
        if not record.ok:
            return
        history.append((turn.text, record.text))
        await asyncio.sleep(think_time_s)
        scheduled_s = time.perf_counter() - t0  # the next turn is due now


def _client(target: Target):
    import httpx

    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    return httpx.AsyncClient(
        base_url=target.base_url.rstrip("/"),
        headers=headers,
        timeout=target.timeout_s,
        transport=target.transport,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def run_open_loop(
    target: Target,
    sessions: Sequence[Session],
    starts_s: Sequence[float],
    max_concurrency: int | None = None,
    think_time_s: float = 0.0,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Start session i at starts_s[i] (s after the run's start); latency from the schedule.
    `on_done` is called with each request's record as it ends (progress)."""
    if len(starts_s) != len(sessions):
        raise ValueError("one start time per session")
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    per_session: list[list[RequestRecord]] = [[] for _ in sessions]
    async with _client(target) as client:
        t0 = time.perf_counter()

        async def start(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + starts_s[i] - time.perf_counter()))
            await _session(
                client,
                target,
                sessions[i],
                i,
                starts_s[i],
                t0,
                per_session[i],
                think_time_s,
                gate,
                on_done,
            )

        await asyncio.gather(*(start(i) for i in range(len(sessions))))
    return [r for records in per_session for r in records]


async def run_closed_loop(
    target: Target,
    sessions: Sequence[Session],
    concurrency: int,
    think_time_s: float = 0.0,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """`concurrency` users take sessions in order, each starting its next when one ends."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    per_session: list[list[RequestRecord]] = [[] for _ in sessions]
    pending = iter(range(len(sessions)))
    async with _client(target) as client:
        t0 = time.perf_counter()

        async def user() -> None:
            for i in pending:  # shared iterator: each session goes to one user
                await _session(
                    client,
                    target,
                    sessions[i],
                    i,
                    time.perf_counter() - t0,
                    t0,
                    per_session[i],
                    think_time_s,
                    None,
                    on_done,
                )

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return [r for records in per_session for r in records]


def salted(sessions: Sequence[Session], salt: str) -> list[Session]:
    """The sessions with `salt` before each first turn (no prefix-cache hits across runs)."""
    return [
        Session((Turn(salt + s.turns[0].text, s.turns[0].max_tokens), *s.turns[1:]))
        for s in sessions
    ]


def run(
    target: Target,
    sessions: Sequence[Session],
    *,
    request_rate: float | None = None,
    concurrency: int | None = None,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    think_time_s: float = 0.0,
    seed: int = 0,
    salt: str | None = None,
    tokenizer=None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> Run:
    """One run, open loop (request_rate) or closed loop (concurrency); salt None: a fresh one.
    `on_done(record)` is called as each request ends, for a progress display."""
    if (request_rate is None) == (concurrency is None):
        raise ValueError("give exactly one of request_rate (open loop) and concurrency")
    salt = f"run {uuid.uuid4().hex[:6]}: " if salt is None else salt
    sessions = salted(sessions, salt)
    if request_rate is not None:
        starts = arrival_times(len(sessions), request_rate, seed, burstiness)
        coro = run_open_loop(target, sessions, starts, max_concurrency, think_time_s, on_done)
        mode, load = "open", request_rate
    else:
        coro = run_closed_loop(target, sessions, concurrency, think_time_s, on_done)
        mode, load = "closed", float(concurrency)
    records = run_sync(coro)
    if tokenizer is not None:
        for r in records:
            r.retokenized_output_tokens = len(tokenizer.encode(r.text, add_special_tokens=False))
    duration = max((r.end_s for r in records), default=0.0)
    return Run(mode, load, records, duration, salt)


def warm_up(target: Target, num_requests: int, seed: int = 1) -> None:
    """Send a few short requests one at a time and discard them (first-call costs: memory
    allocation, lazy initialisation, connection set-up). Raises when every one of them failed:
    a run against a server that refuses everything measures nothing."""
    if num_requests > 0:
        sessions = fixed_sessions(num_requests, 8, 4, seed)
        records = run_sync(run_closed_loop(target, salted(sessions, "warm-up: "), 1))
        if not any(r.ok for r in records):
            reasons = sorted({r.error for r in records if r.error})
            raise RuntimeError(
                f"all {len(records)} warm-up requests to {target.base_url} failed: "
                + "; ".join(reasons[:3])
            )


def run_sync(coro):
    """Run a coroutine to its end, also from inside a running event loop (a notebook's
    kernel has one): then in a thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# -------------------------------------------------------------------------------- summary

PERCENTILES = (50, 90, 99)


def _stats(values: list[float]) -> dict:
    if not values:
        return {}
    out = {"mean": statistics.fmean(values)}
    out.update({f"p{p}": sm.percentile(values, p) for p in PERCENTILES})
    return out


def summarize(result: Run, slo: sm.Slo | None = None) -> dict:
    """The run's metrics (seconds, tokens, per second), JSON-ready."""
    done = [r for r in result.records if r.ok]
    failed = [r for r in result.records if not r.ok]
    duration = result.duration_s
    per_request = {
        "ttft_s": [],
        "tpot_s": [],
        "tpot_incl_first_s": [],
        "e2el_s": [],
        "worst_gap_s": [],
        "ttft_from_send_s": [],
        "send_lag_s": [],
    }
    gaps: list[float] = []
    chunks_per_request: list[float] = []
    for r in done:
        timing = r.timing()
        t, end, n = timing.token_times_s, timing.end_s, timing.num_tokens
        per_request["ttft_s"].append(sm.ttft_s(r.scheduled_s, t))
        per_request["e2el_s"].append(sm.e2el_s(r.scheduled_s, end))
        per_request["tpot_incl_first_s"].append(sm.tpot_incl_first_s(r.scheduled_s, t, end, n))
        per_request["ttft_from_send_s"].append(sm.ttft_s(r.sent_s, t))
        per_request["send_lag_s"].append(r.sent_s - r.scheduled_s)
        tpot = sm.tpot_s(r.scheduled_s, t, end, n)
        if tpot is not None:
            per_request["tpot_s"].append(tpot)
        if len(t) >= 2:
            per_request["worst_gap_s"].append(sm.worst_gap_s(t))
        gaps += sm.itl_s(t)
        chunks_per_request.append(float(len(t)))
    usage_out = [r.output_tokens for r in done if r.output_tokens is not None]
    retok = [r.retokenized_output_tokens for r in done if r.retokenized_output_tokens is not None]
    chunks = sum(len(r.token_times_s) for r in done)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in done)
    out_tokens = sum(r.num_tokens or len(r.token_times_s) for r in done)
    summary = {
        "mode": result.mode,
        "load": result.load,
        "salt": result.salt,
        "completed": len(done),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:5],
        "duration_s": duration,
        "request_throughput_rps": len(done) / duration if duration else 0.0,
        "input_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "output_tokens_usage": sum(usage_out) if usage_out else None,
        "output_tokens_retokenized": sum(retok) if retok else None,
        "output_chunks": chunks,
        "chunks_per_request": _stats(chunks_per_request),
        "input_throughput_tps": prompt_tokens / duration if duration else 0.0,
        "output_throughput_tps": out_tokens / duration if duration else 0.0,
        "itl_s": _stats(gaps),
        "mean_in_flight": sm.mean_in_flight([(r.scheduled_s, r.end_s) for r in done], 0.0, duration)
        if done and duration
        else 0.0,
    }
    if usage_out and retok:
        summary["retokenized_minus_usage"] = sum(retok) - sum(usage_out)
    for name, values in per_request.items():
        summary[name] = _stats(values)
    if slo is not None and duration:
        summary["slo"] = asdict(slo)
        summary["goodput_rps"] = sm.goodput_rps([r.timing() for r in result.records], slo, duration)
    return summary


def abba_order(rounds: int) -> list[str]:
    """A, B, B, A repeated: a drift over time (a warming or throttling machine, a neighbour
    starting a job) falls on both configurations alike."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    return ["A", "B", "B", "A"] * rounds


def compare(
    run_a: Callable[[], dict],
    run_b: Callable[[], dict],
    rounds: int,
    metric: str = "output_throughput_tps",
) -> dict:
    """Run two configurations in ABBA order; report each one's runs of `metric`, the ratio
    of medians B / A, and the A/A spread (max / min over A's runs): a difference smaller
    than the spread is noise."""
    values: dict[str, list[float]] = {"A": [], "B": []}
    for label in abba_order(rounds):
        values[label].append(_metric(run_a() if label == "A" else run_b(), metric))
    a, b = values["A"], values["B"]
    return {
        "metric": metric,
        "order": "".join(abba_order(rounds)),
        "A": a,
        "B": b,
        "ratio_b_over_a": statistics.median(b) / statistics.median(a),
        "aa_spread": max(a) / min(a),
        "verdict": sm.ab_verdict(a, b),
    }


def _metric(summary: dict, metric: str) -> float:
    name, _, stat = metric.partition(".")
    value = summary[name]
    return value[stat] if stat else value


# ------------------------------------------------------------------------ sweeps and plots


def sweep(
    target: Target,
    make_sessions: Callable[[int], list[Session]],
    *,
    rates: Sequence[float] = (),
    concurrencies: Sequence[int] = (),
    slo: sm.Slo | None = None,
    tokenizer=None,
    on_done: Callable[[RequestRecord], None] | None = None,
    on_point: Callable[[dict], None] | None = None,
    **options,
) -> list[dict]:
    """One run per request rate (open loop), then one per concurrency (closed loop), each on
    fresh sessions (make_sessions(seed)) and a fresh salt; returns their summaries.
    `on_done(record)` is called as each request ends, `on_point(summary)` as each run ends."""
    points = []
    closed_options = {k: v for k, v in options.items() if k == "think_time_s"}
    runs = [(make_sessions(i), {"request_rate": rate, **options}) for i, rate in enumerate(rates)]
    runs += [
        (make_sessions(len(rates) + i), {"concurrency": c, **closed_options})
        for i, c in enumerate(concurrencies)
    ]
    for sessions, how in runs:
        result = run(target, sessions, tokenizer=tokenizer, on_done=on_done, **how)
        points.append(summarize(result, slo))
        if on_point is not None:
            on_point(points[-1])
    return points


def plot_sweep(points: Sequence[dict], path: str | None = None, factor: float = 2.0):
    """Latency (p50 and p99 TTFT and TPOT) against achieved output tokens/s, one line per
    mode, the knee of each p50 TTFT curve marked; saved to `path` when given."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode, style in (("open", "o-"), ("closed", "s--")):
        pts = sorted(
            (p for p in points if p["mode"] == mode and p["completed"]),
            key=lambda p: p["output_throughput_tps"],
        )
        if not pts:
            continue
        x = [p["output_throughput_tps"] for p in pts]
        for ax, metric in zip(axes, ("ttft_s", "tpot_s"), strict=True):
            for stat in ("p50", "p99"):
                y = [p[metric].get(stat, math.nan) * 1e3 for p in pts]
                ax.plot(
                    x, y, style, label=f"{mode} loop, {stat}", alpha=0.9 if stat == "p50" else 0.5
                )
        knee = sm.knee_index([p["ttft_s"]["p50"] for p in pts], factor)
        axes[0].axvline(x[knee], color="0.6", linestyle=":", label=f"knee ({mode})")
    for ax, name in zip(axes, ("TTFT", "TPOT"), strict=True):
        ax.set_xlabel("achieved output tokens/s")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


# ------------------------------------------------------------------------------ the command


def add_parser(kinds) -> None:
    """`minillm bench serve`, added to `minillm bench`'s subcommands."""
    p = kinds.add_parser(
        "serve", help="load-test an OpenAI-compatible server (open or closed loop)"
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF directory or bundled name, to size prompts and re-tokenize output "
        "(default: the served model's, when it names a local directory or a bundled model)",
    )
    p.add_argument(
        "--workload", default="fixed", choices=["fixed", "shared-prefix", "multi-turn", "dataset"]
    )
    p.add_argument("--dataset", default=None, help="JSONL file for --workload dataset")
    p.add_argument("--num-requests", type=int, default=32, help="sessions per run")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens")
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--num-turns", type=int, default=3, help="multi-turn: turns per session")
    p.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")
    p.add_argument(
        "--request-rate",
        type=float,
        nargs="*",
        default=[],
        help="open loop: sessions/s, several for a sweep (inf: all at once)",
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        default=[],
        help="closed loop: users, several for a sweep",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="open loop: cap on requests in flight (waits count as latency)",
    )
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (outputs then vary in length)",
    )
    p.add_argument("--warmup", type=int, default=2, help="requests sent first and not counted")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2el-ms", type=float, default=None)
    p.add_argument(
        "--compare",
        default=None,
        help="a second base URL: runs A and B in ABBA order (the same URL: an A/A test)",
    )
    p.add_argument("--rounds", type=int, default=1, help="ABBA rounds for --compare")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--plot", default=None, help="save latency versus load to this image")
    p.set_defaults(func=run_command)


def server_model(base_url: str, api_key: str | None = None, transport=None) -> str:
    """The id of the first model a server lists at /v1/models."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(
        base_url=base_url.rstrip("/"), headers=headers, transport=transport, timeout=30
    ) as client:
        response = client.get("/v1/models")
    if response.status_code != 200:
        raise ValueError(f"{base_url}/v1/models answered HTTP {response.status_code}")
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url} lists no model")
    return models[0]["id"]


def default_tokenizer(model: str) -> str:
    """The tokenizer for a served model's id: the id itself when it is a local model
    directory or a bundled model's name (a minillm server serves those), as vLLM's benchmark
    defaults to the served model's. Any other id needs --tokenizer: sizing prompts and counting
    output with another model's tokenizer would quietly mislabel every token count."""
    import pathlib

    from minillm.model.loader import BUNDLED_MODELS_DIR, DEFAULT_MODEL

    for candidate in (pathlib.Path(model).expanduser(), BUNDLED_MODELS_DIR / model):
        if (candidate / "tokenizer.json").is_file():
            return str(candidate)
    if model == DEFAULT_MODEL:
        return model
    raise ValueError(
        f"the server serves {model!r}, which is neither a local model directory nor a bundled "
        "model: pass --tokenizer with that model's tokenizer (a directory holding "
        f"tokenizer.json), or --tokenizer {DEFAULT_MODEL} to size prompts with minillm's own"
    )


def make_sessions_fn(args, tokenizer) -> Callable[[int], list[Session]]:
    n, seed = args.num_requests, args.seed
    if args.workload == "dataset":
        if not args.dataset:
            raise ValueError("--workload dataset needs --dataset FILE")
        sessions = dataset_sessions(args.dataset, args.output_len)
        return lambda i: sessions
    if args.workload == "shared-prefix":
        return lambda i: shared_prefix_sessions(
            n,
            args.num_prefixes,
            args.prefix_len,
            args.input_len,
            args.output_len,
            seed + i,
            tokenizer,
        )
    if args.workload == "multi-turn":
        return lambda i: multi_turn_sessions(
            n, args.num_turns, args.input_len, args.output_len, seed + i, tokenizer
        )
    return lambda i: fixed_sessions(n, args.input_len, args.output_len, seed + i, tokenizer)


class Progress:
    """A one-line count of finished requests, rewritten in place on stderr while a run goes
    on (a sweep of long runs is otherwise silent for its whole length)."""

    def __init__(self, stream=None) -> None:
        import sys

        self.stream = stream if stream is not None else sys.stderr
        self.done = self.failed = 0

    def __call__(self, record: RequestRecord) -> None:
        if record.ok:
            self.done += 1
        else:
            self.failed += 1
        self.stream.write(f"\r  {self.done} done, {self.failed} failed")
        self.stream.flush()

    def clear(self) -> None:
        """End the progress line before a result line is printed; count the next run anew."""
        if self.done or self.failed:
            self.stream.write("\r" + " " * 40 + "\r")
            self.stream.flush()
        self.done = self.failed = 0


def _print_point(p: dict) -> None:
    def ms(metric: str, stat: str) -> str:
        value = p[metric].get(stat)
        return f"{value * 1e3:8.1f}" if value is not None else f"{'-':>8}"

    load = f"{p['load']:g}/s" if p["mode"] == "open" else f"c={p['load']:g}"
    print(
        f"{p['mode']:>6} {load:>8} {p['completed']:>5} {p['failed']:>4} "
        f"{p['request_throughput_rps']:7.2f} {p['output_throughput_tps']:8.1f} "
        f"{ms('ttft_s', 'p50')} {ms('ttft_s', 'p99')} {ms('tpot_s', 'p50')} "
        f"{ms('tpot_s', 'p99')} {ms('itl_s', 'p99')} {ms('worst_gap_s', 'p99')} "
        f"{ms('e2el_s', 'p99')}" + (f" {p['goodput_rps']:8.2f}" if "goodput_rps" in p else "")
    )
    if p["failed"]:
        for reason in p["errors"][:3]:
            print(f"{'':>8}failed: {reason}")
    if p["completed"] and p["completed"] < 100:
        print(f"{'':>8}(under 100 requests: the p99 of {p['completed']} is their maximum)")


def run_command(args) -> int:
    from minillm.model.loader import resolve_model_path
    from minillm.model.tokenizer import Tokenizer

    if not args.request_rate and not args.concurrency:
        raise ValueError("give --request-rate (open loop) or --concurrency (closed loop)")
    model = args.model or server_model(args.base_url, args.api_key)
    tokenizer = Tokenizer(resolve_model_path(args.tokenizer or default_tokenizer(model)))
    slo = None
    if any(v is not None for v in (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)):
        slo = sm.Slo(
            *(
                v / 1e3 if v is not None else None
                for v in (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)
            )
        )
    make = make_sessions_fn(args, tokenizer)
    options = {
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "think_time_s": args.think_time,
    }

    def target_for(url: str) -> Target:
        return Target(url, model, args.endpoint, not args.no_ignore_eos, args.api_key)

    progress = Progress()

    def show(point: dict) -> None:
        progress.clear()
        _print_point(point)

    def measure(url: str) -> list[dict]:
        target = target_for(url)
        warm_up(target, args.warmup)
        return sweep(
            target,
            make,
            rates=args.request_rate,
            concurrencies=args.concurrency,
            slo=slo,
            tokenizer=tokenizer,
            seed=args.seed,
            on_done=progress,
            on_point=show,
            **options,
        )

    print(
        "latency counted from each request's scheduled time; nearest-rank percentiles; "
        "TPOT = (E2EL - TTFT) / (n - 1), n output tokens; ms"
    )
    print(
        f"{'mode':>6} {'load':>8} {'done':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>8} "
        f"{'TTFT p50':>8} {'TTFT p99':>8} {'TPOT p50':>8} {'TPOT p99':>8} {'ITL p99':>8} "
        f"{'worstgap':>8} {'E2EL p99':>8}" + (f" {'goodput':>8}" if slo else "")
    )
    record: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "base_url": args.base_url,
        "model": model,
        "endpoint": args.endpoint,
        "workload": {
            k: getattr(args, k)
            for k in (
                "workload",
                "num_requests",
                "input_len",
                "output_len",
                "prefix_len",
                "num_prefixes",
                "num_turns",
                "think_time",
                "burstiness",
                "seed",
                "dataset",
            )
        },
        "ignore_eos": not args.no_ignore_eos,
        "warmup_requests": args.warmup,
        "conventions": {
            "start": "each request's scheduled time (open loop) or its send (closed loop)",
            "tpot": "(E2EL - TTFT) / (n - 1), n output tokens from usage (else re-tokenized); "
            "tpot_incl_first = E2EL / n",
            "e2el": "to the last chunk with text, as vLLM's benchmark",
            "itl": "every gap between consecutive streamed chunks, all requests pooled",
            "percentiles": "nearest rank",
            "cache": "every prompt starts with a run-unique salt: no carry-over between runs",
        },
    }
    points = measure(args.base_url)
    record["points"] = points
    knees = {}
    for mode in ("open", "closed"):
        pts = sorted(
            (p for p in points if p["mode"] == mode and p["completed"]), key=lambda p: p["load"]
        )
        if len(pts) >= 2:
            knees[mode] = pts[sm.knee_index([p["ttft_s"]["p50"] for p in pts])]["load"]
    record["knee_load"] = knees
    if knees:
        print(
            "knee (last load before p50 TTFT doubles): "
            + ", ".join(f"{m} loop {v:g}" for m, v in knees.items())
        )
    if args.compare:
        rate = (args.request_rate or [None])[0]
        conc = None if rate is not None else args.concurrency[0]

        def one(url: str, _n=None) -> Callable[[], dict]:
            if _n is None:
                _n = [0]

            def go() -> dict:
                _n[0] += 1
                return summarize(
                    run(
                        target_for(url),
                        make(100 + _n[0]),
                        request_rate=rate,
                        concurrency=conc,
                        tokenizer=tokenizer,
                        seed=args.seed,
                        **(options if rate is not None else {"think_time_s": args.think_time}),
                    ),
                    slo,
                )

            return go

        warm_up(target_for(args.compare), args.warmup)
        result = compare(one(args.base_url), one(args.compare), args.rounds)
        record["compare"] = {"A": args.base_url, "B": args.compare, **result}
        print(
            f"ABBA x{args.rounds}: output tok/s A {result['A']} B {result['B']}; "
            f"B/A {result['ratio_b_over_a']:.3f}, A/A spread {result['aa_spread']:.3f}"
        )
    if args.plot:
        plot_sweep(points, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    return 0
