"""Our CPU kernels (C, compiled on first use with the system's gcc): see `cpu_kernels.py`."""
