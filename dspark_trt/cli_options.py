"""Click options shared by several commands (`cli.py`, `serving/cli_serve.py`); no logic."""

from __future__ import annotations

import click

# Kept in step with models/linear.py (DTYPE_CHOICES, DEFAULT_DTYPE); a test checks it. Not imported
# from there: `dspark-trt --help` must not load torch.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "int4")
DEFAULT_DTYPE = "auto"


def dtype_option(command):
    """`--dtype`: the weights of the target and the drafter (`models/linear.py`)."""
    return click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=DEFAULT_DTYPE, show_default=True,
                        help="Weights of the target and drafter: bfloat16 (bf16 weight matrices, fp32 activations, "
                             "and each matmul's input rounded to bf16 where the CPU has AMX; faster, and batch "
                             "invariant where our CPU kernels run: AMX, AVX-512 or AVX2+FMA), float32 (the exact "
                             "reference), int4 (the target's layer matrices in 4-bit Q4_1 blocks, the GGUF's own, "
                             "each matmul's input quantized to int8: ~3x less to read a step; Intel Xeon with AMX "
                             "only, the drafter in bfloat16), or auto (bfloat16 where our CPU kernels run, else "
                             "float32).")(command)


def features_dtype_option(command):
    """`--features-dtype`: the weights of the target that computes missing training features."""
    return click.option("--features-dtype", type=click.Choice(DTYPE_CHOICES), default=DEFAULT_DTYPE,
                        show_default=True,
                        help="Weight dtype of the target that computes missing features: use the one you serve in "
                             "(auto: the serving default, bfloat16 where our CPU kernels run); a feature cache "
                             "holds one dtype and refuses another.")(command)
