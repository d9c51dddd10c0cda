"""Where the PyTorch target runs: `cpu`, `cuda`, `cuda:N` or `auto`.

One parser for the `device` argument of `LLM`, `dspark-trt datagen`, `eval` and `train`, so
that each says the same thing about a device that is not there. A GPU that PyTorch does not see
is an error, never a silent fall-back to the CPU (a datagen or training run planned for a GPU
would otherwise crawl for hours).

This module only names devices; moving models and tensors is done where they are made.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from dspark_trt.errors import InvalidRequestError


def resolve_device(name: str | torch.device) -> torch.device:
    """`name` -> a torch device that is usable here (`auto`: the first GPU when one is visible)."""
    if isinstance(name, torch.device):
        name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise InvalidRequestError(f"{name!r} is not a device (cpu, cuda, cuda:N or auto)", "device") from None
    if device.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"{name!r}: only cpu and cuda are supported", "device")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidRequestError("no CUDA GPU is visible to PyTorch here (use device cpu)", "device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InvalidRequestError(f"{name!r}: only {torch.cuda.device_count()} GPU(s) visible", "device")
    return device


def device_name(device: torch.device) -> str:
    """How profiles name a device: the CPU model and core count, or the GPU model and compute capability."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)} sm_{major}{minor}"
    return cpu_device_name()


def cpu_device_name() -> str:
    """A short name for this CPU (the profile is only valid on the machine it was measured on)."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{name} x{os.cpu_count()}"
