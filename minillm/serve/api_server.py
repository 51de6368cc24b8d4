"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncEngine`.

    POST /v1/completions        text completion (prompt: text, token ids, or a batch of them)
    POST /v1/chat/completions   chat (the model's chat template turns messages into a prompt)
    GET  /v1/models             the served model
    GET  /health                200 while the engine loop runs, else 503
    GET  /metrics               Prometheus text format (see minillm.serve.metrics)

Both completion routes stream by server-sent events when `"stream": true`: one
`data: {json}` event per step that adds text, the finish reason in the last chunk of each
choice, with `stream_options.include_usage` a final chunk with `usage` and no choices, and
`data: [DONE]`. A client that disconnects, streaming or not, has its requests aborted, so
that their KV blocks and batch seats are freed at once.

Errors are OpenAI's JSON, `{"error": {"message", "type", "param", "code"}}`: 400 for a Host
header the server does not answer to (see HostCheckMiddleware), a body that is not JSON, a
field of the wrong type or unknown, a value out of range, or a prompt too long for
max_model_len; 404 for another model's name; 401 without the API key (when one is set); 503
with Retry-After when the waiting queue is full, or when the LoRA adapter asked for cannot be
loaded because every loaded one (max_cpu_loras) serves unfinished requests; 429 with
Retry-After when the key's token bucket is short (with a rate limit set: see
minillm.serve.rate_limit).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import time
import uuid
import weakref
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minillm.lora.request import LoRARequest
from minillm.model.lora import LoRASlotsBusy
from minillm.outputs import CompletionOutput, RequestOutput
from minillm.sampling_params import SamplingParams
from minillm.serve.async_engine import AsyncEngine, EngineDead, EngineOverloaded
from minillm.serve.chat_template import ChatTemplate, ChatTemplateError
from minillm.serve.metrics import ServerMetrics
from minillm.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    value_error,
)
from minillm.serve.rate_limit import RateLimited, RateLimiter, Reservation
from minillm.structured.grammar import token_bytes

# the largest request body read (vLLM sets none): far above any prompt that fits a context
# window, as text or as token ids, and small enough to parse in a fraction of a second
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 2**20

SAMPLING_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)


class AbortingStream(StreamingResponse):
    """A streaming response that calls `on_close` however it ends: done, or the client gone
    (Starlette cancels the stream when it hears the disconnect), or a failed send."""

    def __init__(self, content, on_close) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class ShuttingDown(Exception):
    """The server's drain time after SIGTERM is over: what still runs is ended."""


def shutting_down_error() -> ApiError:
    return ApiError(
        "the server is shutting down: this request did not finish within its drain time; "
        "retry on another replica",
        503,
        code="server_shutting_down",
        type="server_error",
        headers={"Retry-After": "1"},
    )


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of text one token can stand for: the longest vocabulary entry or
    added token (a special token's text is matched whole)."""
    vocab = [len(b) for b in token_bytes(tokenizer, tokenizer.vocab_size) if b]
    added = [
        len(token.content.encode())
        for token in tokenizer.backend.get_added_tokens_decoder().values()
    ]
    return max(vocab + added + [1])


class PromptReader:
    """A request body's prompt token ids and SamplingParams, as the server admits them: what
    needs only the tokenizer, the chat template and max_model_len, so that a router counts a
    request's tokens exactly as the replica will (minillm.serve.router).

    Its methods tokenize, so they run in a worker thread, never on the event loop; a text
    longer than `max_prompt_bytes` is refused before it is tokenized: max_model_len tokens of
    at most `longest_token_bytes` each cannot hold it, whatever the tokenizer makes of it."""

    def __init__(self, tokenizer, chat_template: ChatTemplate | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_model_len = max_model_len
        self.max_prompt_bytes = max_model_len * longest_token_bytes(tokenizer)

    def check_text_bytes(self, text: str, param: str) -> None:
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_prompt_bytes:
            raise ApiError(
                f"this model's maximum context length is {self.max_model_len} tokens, and the "
                f"prompt's {size} bytes of text cannot fit in it (no token is longer than "
                f"{self.max_prompt_bytes // self.max_model_len} bytes)",
                param=param,
                code="context_length_exceeded",
            )

    def max_tokens_for(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> int:
        """vLLM's rule: the prompt and max_tokens must fit in max_model_len together;
        max_tokens None takes what is left."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise ApiError(
                f"this model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens (at most {limit - 1} leave room for one output "
                "token)",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return limit - num_prompt_tokens
        if isinstance(max_tokens, int) and max_tokens >= 1:
            if num_prompt_tokens + max_tokens > limit:
                raise ApiError(
                    f"this model's maximum context length is {limit} tokens, but "
                    f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in "
                    f"the prompt, {max_tokens} in the completion); reduce the prompt or "
                    "max_tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
        return max_tokens  # a bad value is refused by SamplingParams, which names the field

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            self.check_text_bytes(prompt, "prompt")
        try:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        except ValueError as err:
            raise ApiError(str(err), param="prompt") from None
        if not ids:
            raise ApiError("the prompt is empty: expected at least one token", param="prompt")
        return ids

    def completion_prompts(self, body: CompletionRequest) -> list:
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ApiError("the prompt is empty: expected at least one token", param="prompt")
        return list(prompt)

    def completion(self, body: CompletionRequest) -> tuple[list, list, list]:
        """(prompts, their token ids, their SamplingParams); ApiError for a bad request."""
        prompts = self.completion_prompts(body)
        ids_list = [self.prompt_ids(p) for p in prompts]
        try:
            params_list = [
                body.sampling_params(
                    self.max_tokens_for(len(ids), body.max_tokens, "prompt"), body.logprobs
                )
                for ids in ids_list
            ]
        except ValueError as err:
            raise value_error(err, SAMPLING_FIELDS) from None
        return prompts, ids_list, params_list

    def chat(self, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        """The rendered prompt's token ids and the SamplingParams; ApiError for a bad request."""
        if self.chat_template is None:
            raise ApiError(
                "this model has no chat template (tokenizer_config.json has no "
                '"chat_template"); use /v1/completions',
                param="messages",
                code="no_chat_template",
            )
        if not body.messages:
            raise ApiError("messages must hold at least one message", param="messages")
        messages = [m.as_template_input() for m in body.messages]
        try:
            text = self.chat_template.render(messages, body.add_generation_prompt)
        except ChatTemplateError as err:
            raise ApiError(str(err), param="messages") from None
        self.check_text_bytes(text, "messages")
        try:  # the template wrote the special tokens it wants (a BOS): add none of our own
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        except ValueError as err:  # text that is not valid Unicode
            raise ApiError(str(err), param="messages") from None
        if not ids:
            raise ApiError("the chat template rendered an empty prompt", param="messages")
        k = body.num_logprobs()
        max_tokens = self.max_tokens_for(len(ids), body.requested_max_tokens(), "messages")
        try:
            params = body.sampling_params(max_tokens, k)
        except ValueError as err:
            raise value_error(err, SAMPLING_FIELDS) from None
        return ids, params


class OpenAIServer:
    """The routes' logic, over one engine serving one model name."""

    def __init__(
        self,
        async_engine: AsyncEngine,
        served_model_name: str,
        metrics: ServerMetrics,
        chat_template: ChatTemplate | None,
        rate_limiter: RateLimiter | None = None,
        lora_modules: dict[str, LoRARequest] | None = None,
        max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    ) -> None:
        self.rate_limiter = rate_limiter
        self.keys_checked = False  # API keys checked by the app: a bucket per key
        self.max_request_body_bytes = max_request_body_bytes
        # adapters clients name as `model` (vLLM's --lora-modules), beside the base model
        self.lora_modules = dict(lora_modules or {})
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.tokenizer = self.engine.tokenizer
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.chat_template = chat_template
        self.prompts = PromptReader(self.tokenizer, chat_template, self.engine.max_model_len)
        self.created = int(time.time())
        self.draining = False  # set on SIGTERM: new requests get a 503
        # the queues of the requests running, to end them when the drain time is over
        self.queues: weakref.WeakSet[asyncio.Queue] = weakref.WeakSet()

    def begin_drain(self, timeout_s: float) -> None:
        """Called on the event loop when the server starts to shut down: refuse new requests,
        let running ones go on for `timeout_s` seconds, then end them (a stream with an error
        event and [DONE], a non-streaming request with a 503)."""
        self.draining = True

        def end_running() -> None:
            for shared in list(self.queues):
                shared.put_nowait(ShuttingDown())  # raised by whoever reads the queue

        asyncio.get_running_loop().call_later(timeout_s, end_running)

    # ------------------------------------------------------------------ checks

    async def read_body(self, request: Request) -> bytes:
        return await read_capped_body(request, self.max_request_body_bytes)

    async def parse(self, request: Request, model):
        """The body as a request object; parsed in a worker thread, like the tokenizing
        after it, so that a large body does not stall the other streams' event loop."""
        if self.draining:
            raise shutting_down_error()
        check_json_content_type(request.headers.get("content-type", ""))
        return await asyncio.to_thread(parse_request, await self.read_body(request), model)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names, None for the base model; 404 for another name."""
        if model is None or model == self.served_model_name:
            return None
        if model in self.lora_modules:
            return self.lora_modules[model]
        served = ", ".join(repr(name) for name in [self.served_model_name, *self.lora_modules])
        raise ApiError(
            f"the model {model!r} does not exist; this server serves {served}",
            status_code=404,
            param="model",
            code="model_not_found",
        )

    def admit(self, request: Request, ids_list: list, params_list: list) -> Reservation | None:
        """Take the requests' most tokens (prompt + n * max_tokens each) from the caller's
        bucket, or answer 429 with Retry-After (no rate limit: None, always admitted)."""
        if self.rate_limiter is None:
            return None
        key = rate_limit_key(request.headers.get("authorization", ""), self.keys_checked)
        try:
            return self.rate_limiter.acquire(key, request_cost(ids_list, params_list))
        except RateLimited as err:
            raise rate_limited_error(err, self.rate_limiter, key) from None

    # ------------------------------------------------------------------ running requests

    async def start(
        self,
        prefix: str,
        prompts: list,
        params_list: list,
        shared: asyncio.Queue,
        lora_request: LoRARequest | None = None,
    ) -> list[str]:
        """Add every prompt, or none: a refusal aborts the ones already added.

        The requests arrive now, checked and tokenized, as in vLLM (where arrival_time is
        set when the API server hands a request to the engine): their TTFT and queueing
        time include the wait for the engine thread to take them, between two steps."""
        arrival_time = self.engine.clock()
        self.queues.add(shared)
        request_ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = f"{prefix}-{i}"
                await self.async_engine.add_request(
                    request_id, prompt, params, shared, arrival_time, lora_request
                )
                request_ids.append(request_id)
        except BaseException as err:
            self.async_engine.abort(*request_ids)
            if isinstance(err, EngineOverloaded):
                raise ApiError(
                    str(err),
                    status_code=503,
                    code="server_overloaded",
                    type="server_error",
                    headers={"Retry-After": str(err.retry_after_s)},
                ) from None
            if isinstance(err, EngineDead):
                raise ApiError(str(err), 503, code="engine_dead", type="server_error") from None
            if isinstance(err, LoRASlotsBusy):  # not the request's fault: it may come back
                raise ApiError(
                    str(err),
                    503,
                    code="lora_slots_busy",
                    type="server_error",
                    headers={"Retry-After": "1"},
                ) from None
            if isinstance(err, ValueError):
                raise value_error(err, SAMPLING_FIELDS) from None
            raise
        return request_ids

    async def start_reserved(
        self, prefix, prompts, params_list, shared, reservation, lora_request=None
    ) -> list:
        """`start`, giving the reservation back whole when the requests are refused."""
        try:
            return await self.start(prefix, prompts, params_list, shared, lora_request)
        except BaseException:
            settle(reservation, [])
            raise

    async def collect_settled(self, request, request_ids, shared, reservation):
        """`collect`, then settle the reservation: what was used, nothing if it failed."""
        try:
            finals = await self.collect(request, request_ids, shared)
        except BaseException:
            settle(reservation, [])
            raise
        settle(reservation, finals)
        return finals

    def closer(self, request_ids: list[str], reservation, latest: dict):
        """What a stream does when it ends: abort what still runs, settle the tokens."""

        def close() -> None:
            self.async_engine.abort(*request_ids)
            settle(reservation, list(latest.values()))

        return close

    async def collect(self, request: Request, request_ids: list[str], shared: asyncio.Queue):
        """Wait for every request to finish; abort them all if the client disconnects."""
        finals: dict[str, RequestOutput] = {}

        async def drain() -> None:
            while len(finals) < len(request_ids):
                output = await shared.get()
                if isinstance(output, BaseException):
                    raise output
                if output.finished:
                    finals[output.request_id] = output

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(drain())
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                self.async_engine.abort(*request_ids)
        if not work.done() or work.cancelled():
            return None  # the client is gone; nobody reads an answer
        if isinstance(work.exception(), ShuttingDown):
            self.async_engine.abort(*request_ids)
            raise shutting_down_error()
        if work.exception() is not None:
            raise ApiError(str(work.exception()), 503, code="engine_dead", type="server_error")
        for output in finals.values():
            if output.error:
                raise ApiError(output.error, 500, code="engine_error", type="server_error")
        return [finals[r] for r in request_ids]

    async def stream_outputs(self, shared: asyncio.Queue, num_requests: int, latest=None):
        """The outputs of `num_requests` requests sharing a queue, until all have finished
        (`latest`, a dict: each request's last output, kept for the rate limiter)."""
        done = 0
        while done < num_requests:
            output = await shared.get()
            if isinstance(output, BaseException):
                raise output
            done += output.finished
            if latest is not None:
                latest[output.request_id] = output
            yield output

    # ------------------------------------------------------------------ logprobs

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, logprobs, token_ids, k: int, offset: int) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, alternatives in zip(token_ids, logprobs, strict=False):
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(alternatives.get(token_id))
            # the k best and the sampled token, as OpenAI's legacy completions and vLLM send
            # them (up to k + 1 entries)
            best = sorted(alternatives.items(), key=lambda item: -item[1])[:k]
            if token_id not in dict(best) and token_id in alternatives:
                best.append((token_id, alternatives[token_id]))
            top.append({self.token_text(t): lp for t, lp in best})
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def chat_logprobs(self, logprobs, token_ids, k: int) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for token_id, alternatives in zip(token_ids, logprobs, strict=False):
            best = sorted(alternatives.items(), key=lambda item: -item[1])[:k]
            item = entry(token_id, alternatives.get(token_id))
            item["top_logprobs"] = [entry(t, lp) for t, lp in best]
            content.append(item)
        return {"content": content}

    # ------------------------------------------------------------------ /v1/completions

    async def completions(self, request: Request) -> Response:
        body = await self.parse(request, CompletionRequest)
        lora_request = self.check_model(body.model)
        if body.echo and body.logprobs is not None:
            raise ApiError("echo together with logprobs is not supported", param="echo")
        prompts, ids_list, params_list = await asyncio.to_thread(self.prompts.completion, body)
        echoes = [
            (p if isinstance(p, str) else self.tokenizer.decode(p)) if body.echo else ""
            for p in prompts
        ]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        shared: asyncio.Queue = asyncio.Queue()
        reservation = self.admit(request, ids_list, params_list)
        request_ids = await self.start_reserved(  # token ids: the engine tokenizes nothing
            request_id, ids_list, params_list, shared, reservation, lora_request
        )
        index_of = {r: i for i, r in enumerate(request_ids)}
        n, k = body.n, body.logprobs
        head = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or self.served_model_name,
        }

        def choice(prompt_index: int, c: CompletionOutput, text: str, logprobs) -> dict:
            return {
                "index": prompt_index * n + c.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }

        if not body.stream:
            finals = await self.collect_settled(request, request_ids, shared, reservation)
            if finals is None:
                return Response(status_code=499)
            choices = []
            for i, output in enumerate(finals):
                for c in output.outputs:
                    logprobs = None
                    if k is not None:
                        logprobs = self.completion_logprobs(c.logprobs, c.token_ids, k, 0)
                    choices.append(choice(i, c, echoes[i] + c.text, logprobs))
            usage = usage_of(finals)
            return JSONResponse({**head, "choices": choices, "usage": usage})

        async def events():
            sent: dict[tuple[int, int], int] = {}  # (prompt, completion) -> tokens sent
            text_sent: dict[tuple[int, int], int] = {}
            finals: dict[str, RequestOutput] = {}
            outputs = self.stream_outputs(shared, len(request_ids), latest)
            async for output in ending_on_shutdown(outputs):
                if isinstance(output, str):  # the drain time is over
                    yield output
                    return
                if output.error:
                    yield sse(engine_error(output.error))
                    continue
                i = index_of[output.request_id]
                for c in output.outputs:
                    key = (i, c.index)
                    first = key not in sent
                    start = sent.get(key, 0)
                    text = (echoes[i] if first else "") + c.delta_text
                    if not text and not c.finished and not first:
                        continue
                    logprobs = None
                    if k is not None:
                        new = c.token_ids[start:]
                        logprobs = self.completion_logprobs(
                            c.logprobs[start:], new, k, text_sent.get(key, 0)
                        )
                    sent[key] = len(c.token_ids)
                    text_sent[key] = text_sent.get(key, 0) + len(text)
                    yield sse({**head, "choices": [choice(i, c, text, logprobs)]})
                if output.finished:
                    finals[output.request_id] = output
            if body.include_usage and len(finals) == len(request_ids):
                yield sse({**head, "choices": [], "usage": usage_of(list(finals.values()))})
            yield sse("[DONE]")

        latest: dict[str, RequestOutput] = {}
        return AbortingStream(events(), self.closer(request_ids, reservation, latest))

    # ------------------------------------------------------------------ /v1/chat/completions

    async def chat_completions(self, request: Request) -> Response:
        body = await self.parse(request, ChatCompletionRequest)
        lora_request = self.check_model(body.model)
        ids, params = await asyncio.to_thread(self.prompts.chat, body)
        k = body.num_logprobs()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        shared: asyncio.Queue = asyncio.Queue()
        reservation = self.admit(request, [ids], [params])
        request_ids = await self.start_reserved(
            request_id, [ids], [params], shared, reservation, lora_request
        )
        head = {
            "id": request_id,
            "created": int(time.time()),
            "model": body.model or self.served_model_name,
        }

        if not body.stream:
            finals = await self.collect_settled(request, request_ids, shared, reservation)
            if finals is None:
                return Response(status_code=499)
            choices = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": None
                    if k is None
                    else self.chat_logprobs(c.logprobs, c.token_ids, k),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in finals[0].outputs
            ]
            return JSONResponse(
                {
                    **head,
                    "object": "chat.completion",
                    "choices": choices,
                    "usage": usage_of(finals),
                }
            )

        head = {**head, "object": "chat.completion.chunk"}

        def chunk(index: int, delta: dict, logprobs=None, finish=None, stop=None) -> str:
            return sse(
                {
                    **head,
                    "choices": [
                        {
                            "index": index,
                            "delta": delta,
                            "logprobs": logprobs,
                            "finish_reason": finish,
                            "stop_reason": stop,
                        }
                    ],
                }
            )

        async def events():
            for index in range(body.n):  # the role first, as OpenAI sends it
                yield chunk(index, {"role": "assistant", "content": ""})
            sent: dict[int, int] = {}
            final = None
            async for output in ending_on_shutdown(self.stream_outputs(shared, 1, latest)):
                if isinstance(output, str):  # the drain time is over
                    yield output
                    return
                if output.error:
                    yield sse(engine_error(output.error))
                    continue
                for c in output.outputs:
                    if not c.delta_text and not c.finished:
                        continue
                    start = sent.get(c.index, 0)
                    logprobs = None
                    if k is not None:
                        logprobs = self.chat_logprobs(c.logprobs[start:], c.token_ids[start:], k)
                    sent[c.index] = len(c.token_ids)
                    delta = {"content": c.delta_text} if c.delta_text else {}
                    yield chunk(c.index, delta, logprobs, c.finish_reason, c.stop_reason)
                if output.finished:
                    final = output
            if body.include_usage and final is not None:
                yield sse({**head, "choices": [], "usage": usage_of([final])})
            yield sse("[DONE]")

        latest: dict[str, RequestOutput] = {}
        return AbortingStream(events(), self.closer(request_ids, reservation, latest))

    # ------------------------------------------------------------------ the rest

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.served_model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "minillm",
                    # the directory's name, never its path: a client learns nothing of the
                    # server's filesystem (vLLM sends the path it was given)
                    "root": self.tokenizer.path.parent.name,
                    "max_model_len": self.engine.max_model_len,
                }
            ]
            + [
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "minillm",
                    "root": name,
                    "parent": self.served_model_name,
                    "max_model_len": self.engine.max_model_len,
                }
                for name, lora in self.lora_modules.items()
            ],
        }


async def ending_on_shutdown(outputs):
    """`outputs`, then, if the drain time ends them, the SSE error event and [DONE] as one
    str: a client reads why its stream stopped instead of a cut connection."""
    try:
        async for output in outputs:
            yield output
    except ShuttingDown:
        yield sse(shutting_down_error().body()) + sse("[DONE]")


def usage_of(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def request_cost(ids_list: list[list[int]], params_list: list[SamplingParams]) -> int:
    """The most tokens requests may use: each prompt plus n * max_tokens."""
    return sum(len(ids) + p.n * p.max_tokens for ids, p in zip(ids_list, params_list, strict=True))


def rate_limit_key(authorization: str, per_key: bool) -> str:
    """The bucket's key: the bearer token when the server checks API keys (per_key: a
    client cannot make one up), else "": one bucket for every client, because a token
    nobody checks would give each made-up key a full bucket."""
    return authorization.removeprefix("Bearer ").strip() if per_key else ""


def api_key_list(api_key: str | Sequence[str] | None) -> list[str] | None:
    """One API key or several -> a list (None: no key is checked)."""
    if api_key is None:
        return None
    keys = [api_key] if isinstance(api_key, str) else list(api_key)
    if not keys or not all(isinstance(k, str) and k.strip() == k and k for k in keys):
        raise ValueError(
            f"api_key must be a non-empty str or a list of them, without spaces at the ends; "
            f"got {api_key!r}"
        )
    return keys


def rate_limited_error(err: RateLimited, limiter: RateLimiter, key: str) -> ApiError:
    """The 429 of a refused request: OpenAI's body, Retry-After and x-ratelimit-* headers."""
    headers = {
        "x-ratelimit-limit-tokens": f"{limiter.tokens_per_minute:g}",
        "x-ratelimit-remaining-tokens": str(int(limiter.remaining(key))),
    }
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(err.retry_after_s)
        headers["x-ratelimit-reset-tokens"] = f"{err.wait_s:.3f}s"
    return ApiError(str(err), 429, code="rate_limit_exceeded", type="tokens", headers=headers)


def settle(reservation: Reservation | None, outputs: list[RequestOutput] | None) -> None:
    """Give back the reserved tokens the requests did not use (None: the client left before
    the outputs were read; the reservation is kept whole)."""
    if reservation is not None:
        reservation.settle(None if outputs is None else usage_of(outputs)["total_tokens"])


async def read_capped_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 past `limit` bytes: the declared length is checked first,
    and the read stops as soon as the limit is passed."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def check_json_content_type(content_type: str) -> None:
    """415 unless the body is declared JSON: a web page may make a browser send a
    cross-origin text/plain POST without asking first, but never an application/json one."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(
            f"the request body must be JSON sent with 'Content-Type: application/json', got "
            f"{content_type or 'no Content-Type'!r}",
            415,
            code="unsupported_media_type",
        )


def body_too_large(limit: int) -> ApiError:
    return ApiError(
        f"the request body is larger than this server's limit of {limit} bytes",
        status_code=413,
        code="request_too_large",
    )


def engine_error(message: str) -> dict:
    return ApiError(message, 500, code="engine_error", type="server_error").body()


class ApiKeyMiddleware:
    """401 for /v1 routes without `Authorization: Bearer <key>` for one of `api_keys`
    (/health and /metrics stay open, as in vLLM). Plain ASGI, so that streaming and
    disconnects pass untouched."""

    def __init__(self, app, api_keys: list[str]) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    def accepts(self, given: bytes) -> bool:
        # every key compared in constant time, none skipped: the time tells nothing
        return sum(hmac.compare_digest(given, key) for key in self.expected) > 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not self.accepts(given):
                err = ApiError(
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    status_code=401,
                    code="invalid_api_key",
                )
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


LOCAL_HOST_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(host_header: str) -> str:
    """The name in a Host header, lowercased, without port, brackets or a trailing dot."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


def is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HostCheckMiddleware:
    """400 for a request whose Host header names a host not in `allowed_hosts`: the defence
    against DNS rebinding, where a web page makes its own domain name resolve to 127.0.0.1 and
    then reads a server on the reader's machine as if it were same-origin. Its requests carry
    the page's name in Host, which is not one of the server's names.

    Always allowed: localhost names, any IP address (a rebinding attack needs a name of its
    own, so an address in Host is never one), and a request without Host (not a browser).
    `allowed_hosts` adds names (a DNS name the server is reached by); "*" turns the check off.
    Plain ASGI, so that streaming passes untouched."""

    def __init__(self, app, allowed_hosts: Sequence[str]) -> None:
        self.app = app
        self.allowed = {host_name(h) for h in (*LOCAL_HOST_NAMES, *allowed_hosts)}

    def accepts(self, host: str) -> bool:
        name = host_name(host)
        return name in self.allowed or is_ip_address(name)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"host")
            host = None if given is None else given.decode("latin-1")
            if host is not None and not self.accepts(host):
                err = ApiError(
                    f"this server does not answer to the host {host!r} (it protects itself from "
                    "DNS rebinding); start it with --allowed-hosts "
                    f"{host_name(host) or '<name>'} to allow that name",
                    status_code=400,
                    param="Host",
                    code="invalid_host",
                )
                await JSONResponse(err.body(), status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_allowed_hosts(allowed_hosts: Sequence[str] | None) -> list[str]:
    """The extra host names as a list; ValueError for anything but non-empty names."""
    hosts = list(allowed_hosts or [])
    for host in hosts:
        if not isinstance(host, str) or not host.strip() or any(c in host for c in "/ @"):
            raise ValueError(
                f"allowed_hosts holds host names (example.com, or * for any), got {host!r}"
            )
    return hosts


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    metrics: ServerMetrics,
    chat_template: ChatTemplate | None = None,
    api_key: str | Sequence[str] | None = None,
    rate_limiter: RateLimiter | None = None,
    lora_modules: dict[str, LoRARequest] | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    allowed_origins: Sequence[str] | None = None,
    allowed_hosts: Sequence[str] | None = None,
) -> FastAPI:
    """The FastAPI app. `async_engine` must be started (and is not stopped by the app).
    allowed_origins: web origins whose pages may call the API from a browser (CORS, vLLM's
    --allowed-origins; "*" for any); None: no page of another origin may. allowed_hosts: host
    names the server answers to besides localhost and IP addresses (see HostCheckMiddleware;
    "*": any)."""
    allowed_hosts = check_allowed_hosts(allowed_hosts)
    if isinstance(max_request_body_bytes, bool) or not (
        isinstance(max_request_body_bytes, int) and max_request_body_bytes >= 1
    ):
        raise ValueError(
            f"max_request_body_bytes must be an int >= 1, got {max_request_body_bytes!r}"
        )
    server = OpenAIServer(
        async_engine,
        served_model_name,
        metrics,
        chat_template,
        rate_limiter,
        lora_modules,
        max_request_body_bytes,
    )
    app = FastAPI(title="minillm", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, err: Exception) -> JSONResponse:
        # a bug, not the client's fault: still OpenAI's JSON, so that clients parse it (the
        # traceback goes to the server's log)
        message = f"internal server error: {type(err).__name__}: {err}"
        error = ApiError(message, 500, code="internal_error", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    if allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
        )
    api_keys = api_key_list(api_key)
    if api_keys is not None:
        app.add_middleware(ApiKeyMiddleware, api_keys=api_keys)
        server.keys_checked = True
    if "*" not in allowed_hosts:  # added last: checked first, before anything is read
        app.add_middleware(HostCheckMiddleware, allowed_hosts=allowed_hosts)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if async_engine.is_running else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return server.models()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request)

    return app
