"""dspark-trt: DSpark speculative decoding for LLM serving.

    from dspark_trt import LLM, SamplingParams
    llm = LLM(target="default")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))[0]
    print(out.text, out.metrics)
"""

__version__ = "0.1.0"

import os as _os
import sys as _sys

# The CPU runtime runs its matmuls on numpy's OpenBLAS threads (see models/linear.py). PyTorch's
# OpenMP workers spin between ops by default and then fight those threads for the cores (6x
# slower steps, measured), so ask them to sleep instead. This only takes effect if torch has not
# been imported yet; `runtime.threads` handles the other case.
TORCH_IMPORTED_FIRST = "torch" in _sys.modules and "OMP_WAIT_POLICY" not in _os.environ
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dspark_trt.errors import DsparkError, InvalidRequestError, ModelLoadError
from dspark_trt.runtime.sampling import SamplingParams
from dspark_trt.runtime.llm import LLM, RequestOutput

__all__ = [
    "LLM",
    "RequestOutput",
    "SamplingParams",
    "DsparkError",
    "InvalidRequestError",
    "ModelLoadError",
    "__version__",
]
