"""User-facing errors.

Everything a user can get wrong (a bad path, a bad request, a checkpoint that does not match)
raises a subclass of `DsparkError` with a message that says what to do. The CLI prints these
messages without a traceback; anything else escaping is a bug in dspark-trt.
"""


class DsparkError(Exception):
    """Base class of every error a user can cause and fix."""


class ModelLoadError(DsparkError):
    """A target or drafter checkpoint is missing, corrupt, or unsupported."""


class InvalidRequestError(DsparkError, ValueError):
    """A prompt or sampling parameter is invalid (empty prompt, negative max_tokens, ...)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
