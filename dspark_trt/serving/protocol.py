"""OpenAI request bodies (the fields we serve) and the error body: JSON bytes in, a validated model out.

- `decode_body`: bytes -> a JSON value, refusing what would later crash or mislead us: invalid
  JSON (NaN and Infinity included), nesting deeper than `MAX_JSON_DEPTH` (Python's decoder would
  hit its recursion limit, and so would any `repr` of it), integer literals past Python's digit
  limit (4300), numbers that overflow to inf, and strings with lone UTF-16 surrogates (not text:
  the tokenizer cannot take them). Long integers below that limit reach the range checks.
- `parse_request`: a JSON value -> `CompletionRequest` / `ChatCompletionRequest`. The models are
  strict (`"max_tokens": "4"`, `true`, `"stream": "yes"`, `"prompt": [false]` are errors, not
  coerced) and unknown fields are errors, except a few OpenAI clients send that change nothing
  at their neutral value (zero penalties, `best_of=1`, no tools, `user`): silently ignoring a
  field the user set would be silent wrong output. Served: `n`, `logprobs` (completions: a
  count; chat: `logprobs` + `top_logprobs`), `echo` (completions, with `max_tokens` 0 allowed:
  lm-eval's loglikelihood request), and a completions `prompt` that is a string, token ids, or a
  list of either (one choice per prompt and per `n`).

Every error is an `InvalidRequestError` whose `param` is the path of the offending value in the
client's JSON (`messages.0.content.1.type`). This module only parses and shapes JSON; it never
touches the engine.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from dspark_trt.errors import InvalidRequestError
from dspark_trt.runtime.sampling import MAX_LOGPROBS, SEED_MAX, SEED_MIN

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # a 128k-token context fits, as text or as ids; 8 MB does not
DEFAULT_MAX_CHOICES = 64  # choices one request may ask for (its prompts x n): each runs as a request of its own
MAX_JSON_DEPTH = 64  # OpenAI bodies nest ~5 deep; far below the decoder's recursion limit (~1000)
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_STOPS = 16  # OpenAI allows 4; every stop string is checked against the text at every step
MAX_STOP_CHARS = 256
_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")

# Fields accepted only at the value that means "feature off" (compared with the type too: `best_of:
# true` equals 1 in Python, but it is not what a strict API takes).
NEUTRAL_VALUES: dict[str, tuple] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "parallel_tool_calls": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


def decode_body(raw: bytes) -> Any:
    """The JSON value of a request body; `InvalidRequestError` for anything we could not serve safely."""
    try:
        # UTF-8, strictly (RFC 8259): json.loads(bytes) would also guess UTF-16/32 and decode with
        # 'surrogatepass', letting encoded lone surrogates through.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"the request body is not UTF-8 text: {e}") from None
    try:
        # No parse_int hook: a Python call per integer made a 2 MB list of token ids 7x slower.
        value = json.loads(text, parse_float=_parse_float, parse_constant=_refuse_constant)
    except InvalidRequestError:
        raise
    except RecursionError:
        raise InvalidRequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, or an integer past Python's digit limit
        if "integer string conversion" in str(e):
            raise InvalidRequestError(f"an integer literal has more than {sys.get_int_max_str_digits()} digits") from None
        raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None
    # Strict UTF-8 holds no surrogates, so a lone one can only come from a \uXXXX escape.
    check_json_value(value, surrogates=_ESCAPED_SURROGATE.search(text) is not None)
    return value


def _parse_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e999: Python reads inf, which no field takes
        raise InvalidRequestError(f"the number {short_repr(literal)} is out of range")
    return value


def _refuse_constant(literal: str):
    raise InvalidRequestError(f"{literal} is not valid JSON (Python's decoder accepts it; JSON does not)")


def check_json_value(value: Any, surrogates: bool = True) -> None:
    """Refuse nesting deeper than `MAX_JSON_DEPTH` and, with `surrogates`, strings (keys too)
    holding lone surrogates. Iterative, so a deep value cannot exhaust the stack here either."""
    walk = (str, dict, list) if surrogates else (dict, list)
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise InvalidRequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                                      json_path(path[:1]))
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise InvalidRequestError("a string holds a lone UTF-16 surrogate, which is not text",
                                          json_path(path))
        elif isinstance(node, dict):
            for key, item in node.items():
                if surrogates and _SURROGATE.search(key):
                    raise InvalidRequestError("a key holds a lone UTF-16 surrogate, which is not text",
                                              json_path(path))
                if isinstance(item, walk):
                    stack.append((item, (*path, key)))
        elif isinstance(node, list) and not set(map(type, node)).isdisjoint(walk):  # a C-speed look first:
            # a 2 MB list of token ids has nothing to walk into
            stack.extend((item, (*path, i)) for i, item in enumerate(node) if isinstance(item, walk))


def json_path(path) -> str | None:
    """`("messages", 0, "content")` -> `"messages.0.content"` (None for the body itself)."""
    return ".".join(str(part) for part in path) if path else None


def short_repr(value: Any, limit: int = 60) -> str:
    """A repr that fits in an error message whatever the client sent."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """What completions and chat completions share."""

    model: str
    # Bounds are checked by the validators below (in our words) and shown in the OpenAPI schema.
    max_tokens: int | None = Field(None, description="tokens to generate; prompt + max_tokens must fit the context",
                                   json_schema_extra={"minimum": 1})
    temperature: float = Field(1.0, description="0 (or below 1e-5) is greedy",
                               json_schema_extra={"minimum": 0, "maximum": MAX_TEMPERATURE})
    top_p: float = Field(1.0, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    seed: int | None = Field(None, json_schema_extra={"minimum": SEED_MIN, "maximum": SEED_MAX})
    stop: str | list[str] | None = Field(None, description=f"at most {MAX_STOPS} strings of at most "
                                                           f"{MAX_STOP_CHARS} characters")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = Field(None, description="choices to generate (per prompt), each an independent sample; "
                                            "with a seed, choice i uses a seed derived from it and i",
                          json_schema_extra={"minimum": 1})
    # accepted only at their neutral value (see NEUTRAL_VALUES)
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    best_of: Any = None
    suffix: Any = None
    parallel_tool_calls: Any = None
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None

    @field_validator(*NEUTRAL_VALUES)
    @classmethod
    def _neutral_only(cls, value, info: ValidationInfo):
        return _neutral(value, info.field_name, NEUTRAL_VALUES[info.field_name])

    @field_validator("n")
    @classmethod
    def _positive_n(cls, value):
        return _in_range(value, "n", lambda v: v is None or v >= 1, ">= 1")

    @property
    def num_choices_per_prompt(self) -> int:
        return 1 if self.n is None else self.n

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return value

    # Range errors in our words (the README and the tests name the ranges this way).
    @field_validator("max_tokens")
    @classmethod
    def _positive_max_tokens(cls, value):
        return _in_range(value, "max_tokens", lambda v: v is None or v >= 1, ">= 1")

    @field_validator("temperature")
    @classmethod
    def _temperature_range(cls, value):
        return _in_range(value, "temperature", lambda v: 0 <= v <= MAX_TEMPERATURE, f">= 0 and <= {MAX_TEMPERATURE:g}")

    @field_validator("top_p")
    @classmethod
    def _top_p_range(cls, value):
        return _in_range(value, "top_p", lambda v: 0 < v <= 1, "in (0, 1]")

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, value):
        return _in_range(value, "seed", lambda v: v is None or SEED_MIN <= v <= SEED_MAX,
                         f"a 64-bit integer, in [{SEED_MIN}, {SEED_MAX}]")

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop has {len(stops)} strings; at most {MAX_STOPS} are allowed")
        for i, stop in enumerate(stops):
            if not stop or len(stop) > MAX_STOP_CHARS:
                raise InvalidRequestError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters, "
                                          f"got {len(stop)}", "stop" if isinstance(value, str) else f"stop.{i}")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def output_limit(self) -> int | None:
        """The requested number of output tokens (None: up to the context's end)."""
        return self.max_tokens

    @property
    def output_limit_field(self) -> str:
        """The field `output_limit` came from (what a too-long request's error names)."""
        return "max_tokens"


def _neutral(value, name: str, allowed: tuple):
    if not any(type(value) is type(a) and value == a for a in allowed):
        neutral = next((a for a in allowed if a is not None), None)
        raise ValueError(f"unsupported field {name}={short_repr(value)}: this server supports only {name}={neutral!r}")
    return value


def _in_range(value, name: str, ok, wanted: str):
    # `not ok(...)`, not a negated comparison: NaN fails every comparison, so it fails here.
    if not ok(value):
        raise ValueError(f"{name} must be {wanted}, got {short_repr(value)}")
    return value


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="text, token ids, or a list of either: one choice per prompt (and per n), the choices of "
                         "prompt p numbered p * n to p * n + n - 1")
    max_tokens: int | None = Field(16, description="OpenAI's default for completions; 0 only with echo (score the "
                                                   "prompt, generate nothing)", json_schema_extra={"minimum": 0})
    logprobs: int | None = Field(None, description="logprobs of each generated token (and, with echo, each prompt "
                                                   "token after the first) with this many most likely alternatives",
                                 json_schema_extra={"minimum": 0, "maximum": MAX_LOGPROBS})
    echo: bool | None = Field(None, description="the prompt's text (and, with logprobs, its tokens' logprobs) "
                                                "before each choice's completion")
    top_logprobs: Any = Field(None, description="chat only: completions take logprobs: N")

    @field_validator("max_tokens")
    @classmethod
    def _positive_max_tokens(cls, value):  # replaces SamplingFields' (0 with echo: the model validator below)
        return _in_range(value, "max_tokens", lambda v: v is None or v >= 0, ">= 0")

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, value):
        return _in_range(value, "logprobs", lambda v: v is None or 0 <= v <= MAX_LOGPROBS,
                         f"an integer in [0, {MAX_LOGPROBS}]")

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value):
        if value is not None:
            raise ValueError("top_logprobs is a chat completions field; completions take logprobs: N")
        return value

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens must be >= 1 (0 only with echo: true, to score the prompt)",
                                      "max_tokens")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: text or token ids."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def prompt_is_list(self) -> bool:
        """Whether `prompt` is a list of prompts (errors then name `prompt.i`)."""
        return isinstance(self.prompt, list) and bool(self.prompt) and not isinstance(self.prompt[0], int)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = Field(None, description="passed to the chat template; a 400 where the template ignores it")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, description="the newer name of max_tokens")
    logprobs: bool | None = Field(None, description="logprobs of each generated token")
    top_logprobs: int | None = Field(None, description="with logprobs: this many most likely alternatives per token",
                                     json_schema_extra={"minimum": 0, "maximum": MAX_LOGPROBS})
    echo: Any = Field(None, description="completions only (accepted only as false)")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        return _neutral(value, "echo", (None, False))

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_range(cls, value, info: ValidationInfo):
        value = _in_range(value, "top_logprobs", lambda v: v is None or 0 <= v <= MAX_LOGPROBS,
                          f"an integer in [0, {MAX_LOGPROBS}]")
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @field_validator("messages")
    @classmethod
    def _messages_present(cls, value):
        if not value:
            raise ValueError("messages must not be empty")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_output_limit(cls, value, info: ValidationInfo):
        value = _in_range(value, "max_completion_tokens", lambda v: v is None or v >= 1, ">= 1")
        other = info.data.get("max_tokens")
        if value is not None and other is not None and value != other:
            raise ValueError(f"max_tokens={other} and max_completion_tokens={value} disagree; give one of them")
        return value

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def output_limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def parse_request(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded JSON body; raise `InvalidRequestError` naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _first_error(e.errors(), body) from None


def _first_error(errors: list[dict], body: dict) -> InvalidRequestError:
    # A union (`str | list[int] | list[str]`) reports one error per member; the member that got
    # deepest into the client's value, and furthest along its lists, is the one the client meant
    # (`["a", 1]` is a list of strings with a bad item 1, not a list of ids with a bad item 0).
    paths = [_client_path(body, error["loc"], error.get("type") in ("missing", "extra_forbidden")) for error in errors]
    field = paths[0][:1]
    index = max((i for i, path in enumerate(paths) if path[:1] == field),
                key=lambda i: (len(paths[i]), [part for part in paths[i] if isinstance(part, int)]))
    error, location = errors[index], json_path(paths[index])
    raised = (error.get("ctx") or {}).get("error")
    if isinstance(raised, InvalidRequestError):  # a validator that knew the exact field
        return InvalidRequestError(str(raised), raised.param or location)
    message = error.get("msg", "invalid request").removeprefix("Value error, ")
    if error.get("type") == "extra_forbidden":
        message = f"unsupported field {location!r}"
    elif error.get("type") == "missing":
        message = f"missing required field {location!r}"
    elif error.get("type", "").endswith("_type") or error.get("type") == "literal_error":
        message = f"{location}: {message} (got {_json_type(error.get('input'))} {short_repr(error.get('input'))})"
    elif location and location not in message:
        message = f"{location}: {message}"
    return InvalidRequestError(message, location)


def _client_path(body: Any, loc: tuple, names_a_key: bool) -> tuple:
    """pydantic's error location without its union-member labels ('str', 'list[int]'): the path
    of the value in the client's JSON, plus the missing or unknown key at the end (`names_a_key`)."""
    path, node = [], body
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, dict) and isinstance(part, str) and (part in node or (last and names_a_key)):
            path.append(part)
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(part)
            node = node[part]
        # else: a union member's label, not a key of the client's JSON
    return tuple(path)


def _json_type(value: Any) -> str:
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                       (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null"


def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
