"""Where dspark-trt keeps what it builds once: converted targets, compiled kernels, tiny test models,
TensorRT timing caches. `$DSPARK_TRT_CACHE`, else `~/.cache/dspark-trt`. It imports nothing of the
package, so any module may use it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("DSPARK_TRT_CACHE", Path.home() / ".cache" / "dspark-trt"))
