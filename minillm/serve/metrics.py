"""The server's Prometheus metrics, with vLLM's names, buckets and meaning.

Names keep vLLM's `vllm:` prefix (as in vLLM v0.11's `vllm/v1/metrics/loggers.py`,
`PrometheusStatLogger`), so a dashboard, an alert or a PromQL query written for vLLM reads
`minillm serve` unchanged:

    vllm:time_to_first_token_seconds    histogram  arrival -> first output token
    vllm:inter_token_latency_seconds    histogram  every gap between consecutive tokens
    vllm:request_time_per_output_token_seconds  histogram  per finished request:
                                        (E2EL - TTFT) / (n - 1), the request-weighted TPOT
    vllm:e2e_request_latency_seconds    histogram  arrival -> finished
    vllm:request_queue_time_seconds     histogram  arrival -> first scheduled
    vllm:request_prompt_tokens          histogram  prompt tokens per finished request
    vllm:request_generation_tokens      histogram  output tokens per finished request
    vllm:request_prefill_time_seconds   histogram  first scheduled -> first token
    vllm:request_decode_time_seconds    histogram  first token -> last token
    vllm:request_inference_time_seconds histogram  first scheduled -> last token
    vllm:request_max_num_generation_tokens  histogram  the longest completion's tokens
    vllm:request_params_n               histogram  n of each finished request
    vllm:request_params_max_tokens      histogram  max_tokens of each finished request
    vllm:iteration_tokens_total         histogram  per engine step: prompt tokens of the requests
                                        whose prefill it finished + tokens it sampled
    vllm:cache_config_info              gauge = 1  the KV cache's configuration, in its labels
    vllm:prompt_tokens_total            counter    prompt tokens of requests that prefilled
    vllm:generation_tokens_total        counter    output tokens sampled
    vllm:request_success_total          counter    finished requests, by finished_reason
    vllm:num_requests_running           gauge      requests in the running batch
    vllm:num_requests_waiting           gauge      requests queued, not yet scheduled
    vllm:kv_cache_usage_perc            gauge      fraction of KV blocks held, 0 to 1
    vllm:prefix_cache_queries_total     counter    prompt tokens looked up in the prefix cache
    vllm:prefix_cache_hits_total        counter    of those, tokens found there
    vllm:num_preemptions_total          counter    preemptions

vllm:request_params_max_tokens, vllm:iteration_tokens_total, vllm:cache_config_info and the
`engine` label were checked in vLLM's source, `vllm/v1/metrics/loggers.py` at commit
005a810 (V1's `PrometheusStatLogger`, a 2025 commit; that it is v0.11's tagged file was not
checked): every series has vLLM's labels `model_name` and `engine` (the engine's index, "0": one
engine per server); `vllm:cache_config_info` has `engine` and, as labels, the fields of vLLM's
`CacheConfig` that minillm has (block_size, cache_dtype, calculate_kv_scales,
enable_prefix_caching, gpu_memory_utilization, kv_cache_memory_bytes, num_cpu_blocks,
num_gpu_blocks, num_gpu_blocks_override), each value `str()` of it as vLLM writes them
("None", "True"). `vllm:iteration_tokens_total` is counted as vLLM counts it
(`IterationStats`: a request's whole prompt in the step that gives its first token), not as
the tokens the forward ran (`LLMEngine.stats.num_batched_tokens` has those).

Each app has its own `CollectorRegistry`, so two servers in one process (a notebook, the
tests) never mix their counts. Latencies come from the engine's own timestamps
(`RequestOutput.metrics`, one clock), observed as outputs come out of each step; the gauges
and the prefix-cache counters are read from the engine when `/metrics` is scraped.
"""

from __future__ import annotations

from itertools import pairwise

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minillm.outputs import RequestOutput
from minillm.sampling_params import SamplingParams

# vLLM's buckets (seconds)
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's request_params_n
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ENGINE_INDEX = "0"  # vLLM's `engine` label: which engine core (data-parallel rank)


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, base = [], 1
    while True:
        for m in (1, 2, 5):
            if base * m > limit:
                return out
            out.append(base * m)
        base *= 10


class EngineStateCollector:
    """Gauges and counters the engine keeps itself, read at scrape time."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        engine, labels = self.engine, [self.model_name, ENGINE_INDEX]
        scheduler, kv = engine.scheduler, engine.kv_cache_manager
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.",
             len(scheduler.running)),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
             len(scheduler.waiting)),
            ("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", kv.usage),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, doc, labels=LABEL_NAMES)
            gauge.add_metric(labels, value)
            yield gauge
        stats = kv.prefix_cache_stats
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.num_queried_tokens),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.num_hit_tokens),
            ("vllm:num_preemptions", "Preemptions since the engine started.",
             scheduler.num_preemptions),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=LABEL_NAMES)
            counter.add_metric(labels, value)
            yield counter
        info = cache_config_info(engine)
        gauge = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        gauge.add_metric(list(info.values()), 1)
        yield gauge


def cache_config_info(engine) -> dict[str, str]:
    """vllm:cache_config_info's labels: vLLM's CacheConfig field names, str() of the values."""
    args = engine.engine_args
    return {
        "block_size": str(args.block_size),
        "cache_dtype": str(args.kv_cache_dtype),
        "calculate_kv_scales": str(args.calculate_kv_scales),
        "enable_prefix_caching": str(args.enable_prefix_caching),
        "gpu_memory_utilization": str(args.gpu_memory_utilization),
        "kv_cache_memory_bytes": str(args.kv_cache_memory_bytes),
        "num_cpu_blocks": str(None),  # no KV blocks are kept in CPU memory
        "num_gpu_blocks": str(engine.kv_cache_manager.block_pool.num_blocks),
        "num_gpu_blocks_override": str(args.num_gpu_blocks),
        "engine": ENGINE_INDEX,
    }


LABEL_NAMES = ["model_name", "engine"]


class ServerMetrics:
    """One server's registry and the request-level metrics observed from engine outputs."""

    def __init__(self, engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"labelnames": LABEL_NAMES, "registry": self.registry}

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, buckets=buckets, **labels).labels(model_name, ENGINE_INDEX)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token (s).", TTFT_BUCKETS_S
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency (s).", ITL_BUCKETS_S
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Time per output token after the first, per finished request (s).",
            ITL_BUCKETS_S,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency (s).",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Time a request waited before it was first scheduled (s).",
            REQUEST_LATENCY_BUCKETS_S,
        )
        # the phases of a finished request, as vLLM's dashboard charts them: prefill from
        # first scheduled to first token, decode from first token to last, inference both
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Time from first scheduled to the first token, per finished request (s).",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Time from the first token to the last, per finished request (s).",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Time from first scheduled to the last token, per finished request (s).",
            REQUEST_LATENCY_BUCKETS_S,
        )
        token_buckets = buckets_1_2_5(engine.max_model_len)
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "The most output tokens of one completion, per finished request.",
            token_buckets,
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Completions asked for (n), per finished request.", N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Output tokens per finished request.", token_buckets
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of requests that prefilled.", **labels
        ).labels(model_name, ENGINE_INDEX)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Output tokens sampled.", **labels
        ).labels(model_name, ENGINE_INDEX)
        self.request_success = Counter(
            "vllm:request_success",
            "Finished requests by finished_reason.",
            labelnames=[*LABEL_NAMES, "finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name
        self.registry.register(EngineStateCollector(engine, model_name))
        # per request in flight: (token times seen, output tokens seen)
        self._seen: dict[str, tuple[int, int]] = {}
        self._max_tokens: dict[str, int] = {}  # per request added and not finished

    def added(self, request_id: str, params: SamplingParams) -> None:
        """A request the engine took (called in the engine thread, before its first step)."""
        self._max_tokens[request_id] = params.max_tokens

    def observe_step(self, outputs: list[RequestOutput]) -> None:
        """Record one engine step's outputs (vLLM's IterationStats: the step's tokens are the
        prompts of the requests it gave a first token, plus the tokens it sampled)."""
        tokens = 0
        for output in outputs:
            times_seen, tokens_seen = self._seen.get(output.request_id, (0, 0))
            if times_seen == 0 and output.metrics.token_times:
                tokens += len(output.prompt_token_ids)
            tokens += sum(len(c.token_ids) for c in output.outputs) - tokens_seen
            self.observe(output)
        if outputs:
            self.iteration_tokens.observe(tokens)

    def observe(self, output: RequestOutput) -> None:
        """Record what this output adds to its request (called once per output, in order)."""
        m = output.metrics
        times_seen, tokens_seen = self._seen.get(output.request_id, (0, 0))
        times = m.token_times
        if times_seen == 0 and times:
            self.ttft.observe(m.ttft_s)
            self.prompt_tokens.inc(len(output.prompt_token_ids))
        for earlier, later in pairwise(times[max(times_seen - 1, 0) :]):
            self.itl.observe(later - earlier)
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        self.generation_tokens.inc(num_tokens - tokens_seen)
        if not output.finished:
            self._seen[output.request_id] = (len(times), num_tokens)
            return
        self._seen.pop(output.request_id, None)
        max_tokens = self._max_tokens.pop(output.request_id, None)
        if max_tokens:
            self.params_max_tokens.observe(max_tokens)
        if m.e2el_s is not None:
            self.e2e.observe(m.e2el_s)
        if m.tpot_s is not None:
            self.tpot.observe(m.tpot_s)
        if m.queueing_time_s is not None:
            self.queue_time.observe(m.queueing_time_s)
        times = m.token_times
        if m.first_scheduled_time is not None and times:
            self.prefill_time.observe(times[0] - m.first_scheduled_time)
            self.decode_time.observe(times[-1] - times[0])
            self.inference_time.observe(times[-1] - m.first_scheduled_time)
        longest = max((len(c.token_ids) for c in output.outputs), default=0)
        self.max_generation_tokens.observe(longest)
        self.params_n.observe(len(output.outputs))
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(num_tokens)
        reasons = {c.finish_reason for c in output.outputs}
        reason = "abort" if "abort" in reasons or output.error else sorted(reasons)[0]
        self.request_success.labels(self.model_name, ENGINE_INDEX, reason).inc()

    @property
    def num_tracked(self) -> int:
        """Requests whose progress is remembered (in flight); 0 when the server is idle."""
        return len(self._seen.keys() | self._max_tokens.keys())

    def render(self) -> bytes:
        return generate_latest(self.registry)
