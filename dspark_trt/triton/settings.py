"""What a deployed model runs: the `parameters` of its config.pbtxt, written and read in one place.

The writer turns `DeploySettings` into string parameters; the Triton model reads them back with
`from_parameters` (strict: an unknown or malformed parameter is an error naming it) and builds
`LLM(**settings.llm_kwargs(...))` from them. Either an engine directory or a target (with an
optional drafter and policy) names the model. This module loads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from dspark_trt.cli_options import DTYPE_CHOICES as DTYPES  # the runtime's (no torch import here)
from dspark_trt.errors import DsparkError

# DTYPES: the runtime's choices (models/linear.py); float16 is not one (nothing resolves it, so a
# model asking for it would have failed only when Triton loaded it).
# Parameters Triton's Python backend reads itself (a conda-pack environment, where input tensors
# live): they belong in config.pbtxt beside ours, and are not ours to refuse or interpret.
BACKEND_PARAMETERS = ("EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS")


class DeployConfigError(DsparkError):
    """A Triton model's parameters (config.pbtxt) are missing, unknown or malformed."""


@dataclass
class DeploySettings:
    engine_dir: str = ""  # an engine directory from `dspark-trt build`; else target/drafter/policy
    target: str = ""  # 'default' or a model folder / .gguf file
    drafter: str = ""  # '' (none), 'default' or a drafter checkpoint folder
    policy: str = ""  # '' = the runtime's default (`auto`: dspark for a DSpark drafter, see verify_policy)
    dtype: str = "float32"
    max_running_requests: int = 32  # requests in one instance's in-flight batch (KV slots)
    max_batch_tokens: int = 2048  # tokens per target step (prefill chunks included)
    max_model_len: int = 2048  # longest prompt + output
    max_queue: int = 0  # requests waiting beyond the running ones before new ones are refused (0: no limit)
    default_max_tokens: int = 64  # when a request sends no max_tokens
    batch_invariant: bool = False  # outputs independent of the batch (slow; see LLM)

    def __post_init__(self):
        if bool(self.engine_dir) == bool(self.target):
            raise DeployConfigError("give either an engine directory or a target (not both, not neither)")
        if self.engine_dir and self.drafter:
            raise DeployConfigError("an engine directory already names its drafter; do not give a drafter too")
        if self.dtype not in DTYPES:
            raise DeployConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("max_running_requests", "max_batch_tokens", "max_model_len", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise DeployConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise DeployConfigError(f"max_queue must be >= 0, got {self.max_queue}")

    def parameters(self) -> dict[str, str]:
        """The config.pbtxt parameters (empty ones left out; booleans as true/false)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: str(value).lower() if isinstance(value, bool) else str(value)
                for name, value in values.items() if str(value) != ""}

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> DeploySettings:
        known = {f.name: f for f in fields(cls)}
        values: dict[str, object] = {}
        for key, text in parameters.items():
            if key in BACKEND_PARAMETERS:
                continue
            if key not in known:
                raise DeployConfigError(f"config.pbtxt has an unknown parameter {key!r} "
                                        f"(known: {', '.join(known)}; the Python backend's: "
                                        f"{', '.join(BACKEND_PARAMETERS)})")
            if known[key].type == "int":
                try:
                    values[key] = int(text)
                except ValueError:
                    raise DeployConfigError(f"config.pbtxt parameter {key} must be an integer, got {text!r}") from None
            elif known[key].type == "bool":
                if text.lower() not in ("true", "false"):
                    raise DeployConfigError(f"config.pbtxt parameter {key} must be true or false, got {text!r}")
                values[key] = text.lower() == "true"
            else:
                values[key] = text
        return cls(**values)

    def llm_kwargs(self, base: Path) -> dict:
        """Arguments of `LLM(...)`; relative paths are taken relative to `base` (the model's version folder)."""

        def path(spec: str) -> str:
            return spec if spec == "default" or Path(spec).is_absolute() else str(base / spec)

        kwargs = dict(dtype=self.dtype, max_batch_size=self.max_running_requests,
                      max_batch_tokens=self.max_batch_tokens, max_model_len=self.max_model_len,
                      policy=self.policy or None, batch_invariant=self.batch_invariant)
        if self.engine_dir:
            return dict(engine_dir=path(self.engine_dir), **kwargs)
        return dict(target=path(self.target), drafter=path(self.drafter) if self.drafter else None, **kwargs)
