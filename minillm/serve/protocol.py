"""The OpenAI request bodies the server accepts, and their mapping onto `SamplingParams`.

Fields are OpenAI's (`/v1/completions`, `/v1/chat/completions`) plus vLLM's extras that the
engine supports (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
`stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`, and for chat
`add_generation_prompt`). Any other field is refused with a 400 that names it, rather than
ignored: a client that asks for `logit_bias` or `tools` must learn that it did not get them.
Types are checked strictly (`"max_tokens": "16"` is an error, not 16); the values' ranges
are checked by `SamplingParams` itself, whose messages name the field.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from minillm.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from minillm.structured.json_schema import NUMBER, STRING_CHAR

# fields minillm does not implement, and the values of each that ask for nothing (what SDKs
# and frameworks send as defaults): accepted and dropped; any other value is a 400
NEUTRAL_VALUES = {
    "logit_bias": (None, {}),
    "tools": (None,),
    "tool_choice": (None, "none", "auto"),
    "functions": (None,),
    "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "prediction": (None,),
    "audio": (None,),
    "web_search_options": (None,),
    "suffix": (None, ""),
    "best_of": (None,),  # and a best_of equal to n: see drop_neutral_values
}
# structured_outputs members minillm does not implement (vLLM's names), neutral when null or false
UNSUPPORTED_STRUCTURED = (
    "structural_tag",
    "whitespace_pattern",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
)


class ApiError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status_code, self.param = message, status_code, param
        self.code, self.type, self.headers = code, type, headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


def json_object_pattern(depth: int = 3) -> str:
    """A regex for a JSON object whose values nest containers `depth` deep at most, in
    json.dumps's layout: what response_format {"type": "json_object"} asks for, as far as a
    regular language can hold it (any depth would need a grammar)."""
    string = f'"{STRING_CHAR}*"'
    value = f"(?:{string}|{NUMBER}|true|false|null)"
    obj = ""
    for _ in range(depth):
        array = rf"\[(?:{value}(?:, {value})*)?\]"
        obj = rf"\{{(?:{string}: {value}(?:, {string}: {value})*)?\}}"
        value = f"(?:{string}|{NUMBER}|true|false|null|{array}|{obj})"
    return obj


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: "text" (no constraint), "json_object", "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(regex=json_object_pattern())
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError(
                'response_format of type "json_schema" needs json_schema.schema, a JSON schema'
            )
        return StructuredOutputsParams(json=self.json_schema.schema_)


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs (StructuredOutputsParams): one of json, regex, choice,
    grammar or json_object; the members minillm does not implement are refused unless null or
    false."""

    model_config = ConfigDict(extra="allow", strict=True)
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def params(self) -> StructuredOutputsParams:
        extra = self.model_extra or {}
        for name, value in extra.items():
            if value not in (None, False):
                known = name in UNSUPPORTED_STRUCTURED
                raise ValueError(
                    f"structured_outputs.{name} is not supported: "
                    + ("minillm does not implement it" if known else "no such member")
                    + "; minillm supports json, regex, choice, grammar and json_object"
                )
        if self.json_object:
            if any(v is not None for v in (self.json_, self.regex, self.choice, self.grammar)):
                raise ValueError(
                    "structured_outputs needs exactly one of json, regex, choice or grammar"
                )
            return StructuredOutputsParams(regex=json_object_pattern())
        return StructuredOutputsParams(
            json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar
        )


class _SamplingFields(_Strict):
    """What both endpoints share."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted (OpenAI clients send it) and not used
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extra

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output asked for (response_format or structured_outputs), compiled:
        ApiError naming the field for one outside the engine's subset."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise ApiError(
                "give response_format or structured_outputs, not both", param="structured_outputs"
            )
        where = "response_format" if self.response_format is not None else "structured_outputs"
        try:
            if self.response_format is not None:
                return self.response_format.params()
            if self.structured_outputs is not None:
                return self.structured_outputs.params()
        except ValueError as err:
            message = str(err) if str(err).startswith(where) else f"{where}: {err}"
            raise ApiError(message, param=where, code="invalid_structured_output") from None
        return None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams of this request; None fields take vLLM's defaults."""
        defaults = SamplingParams()
        pick = {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "presence_penalty",
                "frequency_penalty",
                "top_k",
                "min_p",
                "repetition_penalty",
            )
        }
        return SamplingParams(
            n=self.n,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            structured_outputs=self.constraint(),
            **{k: getattr(defaults, k) if v is None else v for k, v in pick.items()},
        )

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError('stream_options needs "stream": true', param="stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # top-n alternatives per token
    echo: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):  # text parts are joined, as vLLM does for text models
            content = "\n".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ApiError(
                "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens"
            )
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs not in (None, 0):  # 0 alternatives without logprobs: a no-op
                raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        k = self.top_logprobs or 0
        if not 0 <= k <= MAX_LOGPROBS:
            raise ApiError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {k}", param="top_logprobs"
            )
        return k


# what the fields that take several types accept, for their error messages
UNION_TYPES = {
    "prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
    "stop": "null, a string or a list of strings",
    "content": 'a string or a list of {"type": "text", "text": ...} parts',
}


def parse_request(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The request body -> a request object, or an ApiError that names the field."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ApiError(f"the request body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(
            "the request body nests JSON arrays or objects too deeply", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise ApiError(
            f"the request body must be a JSON object, got {type(data).__name__}",
            code="invalid_json",
        )
    data = drop_neutral_values(data, model)
    try:
        request = model.model_validate(data)
    except ValidationError as err:
        raise validation_error(err) from None
    if isinstance(request, _SamplingFields):
        request.check_stream_options()
    return request


def drop_neutral_values(data: dict, model: type[BaseModel]) -> dict:
    """The body without what asks for nothing: null for a field that is not nullable here
    (it takes its default, as OpenAI's spec reads null), and the neutral values of fields
    minillm does not implement (NEUTRAL_VALUES). Any other value of such a field is a 400
    that names it."""
    out = {}
    for name, value in data.items():
        field = model.model_fields.get(name)
        if value is None and field is not None and not allows_none(field.annotation):
            continue
        if name in NEUTRAL_VALUES and name not in model.model_fields:
            n = data.get("n")
            if name == "best_of" and value == (1 if n is None else n) and value != 0:
                continue
            if any(type(value) is type(ok) and value == ok for ok in NEUTRAL_VALUES[name]):
                continue
            accepted = ", ".join(json.dumps(v) for v in NEUTRAL_VALUES[name])
            if name == "best_of":
                accepted += ", or the value of n"
            raise ApiError(
                f"{name}={json.dumps(value, default=str)[:80]} is not supported: minillm does "
                f"not implement {name} (accepted, as no-ops: {accepted})",
                param=name,
            )
        out[name] = value
    return out


def allows_none(annotation) -> bool:
    return annotation is None or type(None) in getattr(annotation, "__args__", ())


def validation_error(err: ValidationError) -> ApiError:
    first = err.errors()[0]
    loc = [str(part) for part in first["loc"]]
    # a union's failure lists each branch it tried (`prompt.str`, `prompt.list[int]`):
    # name the field the client sent, not pydantic's branches
    field = []
    for part in loc:
        if "[" in part or part in ("str", "int", "float", "bool", "function-after"):
            break
        field.append(part)
    param = ".".join(field) or None
    if first["type"] == "extra_forbidden":
        return ApiError(f"unsupported field {param!r}: minillm does not implement it", param=param)
    if first["type"] == "missing":
        return ApiError(f"the field {param!r} is required", param=param)
    got = json.dumps(first.get("input"), default=str)[:80]
    if len(field) < len(loc) and field and field[-1] in UNION_TYPES:  # a union field
        return ApiError(f"{param} must be {UNION_TYPES[field[-1]]}, got {got}", param=param)
    return ApiError(f"{param}: {first['msg']} (got {got})", param=param)


def value_error(err: ValueError, fields: set[str]) -> ApiError:
    """A ValueError from SamplingParams or the engine, with the field it names as param."""
    message = str(err)
    first_word = message.split(" ", 1)[0].split("=", 1)[0]  # "n=9 completions cannot ..."
    return ApiError(message, param=first_word if first_word in fields else None)
