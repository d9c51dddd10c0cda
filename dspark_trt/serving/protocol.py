"""OpenAI request bodies (the fields we serve) and the error body, as pydantic models.

Unknown fields are errors (HTTP 400), except a few OpenAI clients send that change nothing
when left at their neutral value (`n=1`, `logprobs` off, zero penalties, `user`): silently
ignoring a field the user set would be silent wrong output.

This module only parses and shapes JSON; it never touches the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from dspark_trt.errors import InvalidRequestError

# Fields accepted only at the value that means "feature off".
NEUTRAL_VALUES: dict[str, tuple] = {
    "n": (1, None),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # accepted only at their neutral value (see NEUTRAL_VALUES)
    n: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
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
        allowed = NEUTRAL_VALUES[info.field_name]
        if value not in allowed:
            raise ValueError(f"unsupported field {info.field_name}={value!r}: this server supports only "
                             f"{info.field_name}={allowed[-1]!r}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @field_validator("max_tokens")
    @classmethod
    def _positive_max_tokens(cls, value):
        if value is not None and value < 1:
            raise ValueError(f"max_tokens must be >= 1, got {value}")
        return value

    @field_validator("temperature")
    @classmethod
    def _non_negative_temperature(cls, value):
        if not value >= 0:
            raise ValueError(f"temperature must be >= 0, got {value}")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p_range(cls, value):
        if not 0 < value <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {value}")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(...)
    max_tokens: int | None = 16  # OpenAI's default for completions


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:  # OpenAI's content parts: only text here
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    @model_validator(mode="after")
    def _messages_present(self):
        if not self.messages:
            raise ValueError("messages must not be empty")
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise ValueError(f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}")
            self.max_tokens = self.max_completion_tokens
        return self


def parse_request(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded JSON body; raise `InvalidRequestError` naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        location = ".".join(str(part) for part in first.get("loc", ())) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            message = f"unsupported field {location!r}"
        elif first.get("type") == "missing":
            message = f"missing required field {location!r}"
        elif location and location not in message:
            message = f"{location}: {message}"
        raise InvalidRequestError(message, location) from None


def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
