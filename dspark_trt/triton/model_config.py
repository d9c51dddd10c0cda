"""config.pbtxt for the dspark Triton model: rendered as protobuf text, checked against `ModelConfig`.

The model is a decoupled (streaming) Python-backend model with `max_batch_size: 1`: one prompt per
Triton request, shapes `[1, ...]` as TensorRT-LLM clients send them. Concurrent requests are not
batched by Triton's scheduler but by our runtime: every request joins the instance's in-flight
batch at the next engine step. `check_model_config` parses the text with Triton's own
`ModelConfig` protobuf (shipped in `tritonclient`) when that is installed.
"""

from __future__ import annotations

from dspark_trt import __version__
from dspark_trt.errors import DsparkError
from dspark_trt.triton.protocol import INPUTS, OUTPUTS, TensorSpec

INSTANCE_KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU", "model": "KIND_MODEL"}


def _quote(text: str) -> str:
    """A protobuf text-format string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


def _tensors(specs: tuple[TensorSpec, ...], inputs: bool) -> str:
    blocks = []
    for spec in specs:
        lines = [f"    name: {_quote(spec.name)}", f"    data_type: {spec.data_type}",
                 f"    dims: [ {', '.join(map(str, spec.dims))} ]"]
        if inputs and spec.optional:
            lines.append("    optional: true")
        blocks.append(f"  {{  # {spec.doc}\n" + "\n".join(lines) + "\n  }")
    return ",\n".join(blocks)


def render_model_config(name: str, parameters: dict[str, str], instances: int = 1, kind: str = "cpu") -> str:
    if kind not in INSTANCE_KINDS:
        raise DsparkError(f"instance kind must be one of {', '.join(INSTANCE_KINDS)}, got {kind!r}")
    params = "\n".join(f"parameters {{ key: {_quote(k)} value: {{ string_value: {_quote(v)} }} }}"
                       for k, v in parameters.items())
    return f"""# Written by `dspark-trt triton` (dspark-trt {__version__}): DSpark speculative decoding served by
# dspark-trt's runtime in Triton's Python backend (model.py in the version folder).
name: {_quote(name)}
backend: "python"

# One prompt per request. Requests are batched by the model itself: every request joins the
# instance's in-flight batch at its next step (no Triton dynamic batcher needed).
max_batch_size: 1

# Streaming: a request gets one response per new piece of text when it sends stream=true.
model_transaction_policy {{
  decoupled: true
}}

input [
{_tensors(INPUTS, inputs=True)}
]

output [
{_tensors(OUTPUTS, inputs=False)}
]

# Each instance is a separate process with its own copy of the model and its own in-flight batch.
instance_group [
  {{
    count: {instances}
    kind: {INSTANCE_KINDS[kind]}
  }}
]

# What to run (read by model.py; see dspark_trt/triton/settings.py).
{params}
"""


def check_model_config(text: str) -> bool:
    """Parse `text` as Triton's `ModelConfig`; False when tritonclient (which ships the schema) is absent."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        return False
    try:
        text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:  # a bug in this module, not a user error
        raise AssertionError(f"config.pbtxt does not parse as Triton's ModelConfig: {exc}") from None
    return True
