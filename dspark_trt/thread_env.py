"""Ask PyTorch's OpenMP workers to sleep between ops, before torch is first imported.

The CPU runtime runs its big matmuls on its own threads (our kernels, numpy's OpenBLAS).
PyTorch's OpenMP workers spin between ops by default and then fight those threads for the
cores (6x slower steps, measured), so `OMP_WAIT_POLICY=PASSIVE` is set here, which the package
root imports first. It only takes effect if torch has not been imported yet:
`TORCH_IMPORTED_FIRST` records that case, which `runtime.threads` handles.

This module imports nothing but the standard library (it must run before torch loads).
"""

import os
import sys

TORCH_IMPORTED_FIRST = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
