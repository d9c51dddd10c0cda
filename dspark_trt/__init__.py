"""dspark-trt: DSpark speculative decoding for LLM serving.

    from dspark_trt import LLM, SamplingParams
    llm = LLM(target="default")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))[0]
    print(out.text, out.metrics)
"""

__version__ = "0.1.0"

from dspark_trt.thread_env import TORCH_IMPORTED_FIRST  # noqa: F401 (first: before anything imports torch)
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
