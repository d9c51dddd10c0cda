"""`dspark-trt triton`: write a Triton Inference Server model repository (flags only; see writer.py)."""

from __future__ import annotations

from pathlib import Path

import click

from dspark_trt.cli_options import DTYPE_CHOICES
from dspark_trt.triton.model_config import INSTANCE_KINDS


@click.command("triton")
@click.argument("engine_dir", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--output", "-o", "repo", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Model repository folder (created if missing); the model goes in REPO/NAME.")
@click.option("--model-name", default="dspark", show_default=True, help="Triton model name (a folder name).")
@click.option("--instances", type=int, default=1, show_default=True,
              help="Model instances (processes) per server; each has its own copy of the model and its own "
                   "in-flight batch.")
@click.option("--instance-kind", type=click.Choice(["auto", *INSTANCE_KINDS]), default="auto", show_default=True,
              help="Triton instance_group kind: cpu (KIND_CPU), gpu (KIND_GPU: COUNT instances on every GPU), "
                   "model (KIND_MODEL: the model picks its device); auto: gpu for an ENGINE_DIR built for "
                   "TensorRT, else cpu.")
@click.option("--target", default=None, help="Without ENGINE_DIR: 'default', a Hugging Face folder or a .gguf file.")
@click.option("--drafter", default=None, help="Without ENGINE_DIR: a drafter checkpoint folder, or 'default'.")
@click.option("--policy", default=None,
              help="Draft tokens verified per step: none, fixed:K, threshold:H, dspark, dspark-lagged "
                   "(default: the whole block with a drafter).")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="float32", show_default=True,
              help="Weights of the target and drafter (as `serve --dtype`; auto: bfloat16 where our CPU kernels run).")
@click.option("--max-running-requests", type=int, default=32, show_default=True,
              help="Requests in one instance's in-flight batch (KV slots); more wait in a queue.")
@click.option("--max-batch-tokens", type=int, default=2048, show_default=True, help="Tokens per target step.")
@click.option("--max-model-len", type=int, default=2048, show_default=True, help="Longest prompt + output.")
@click.option("--max-queue", type=int, default=0, show_default=True,
              help="Waiting requests per instance before new ones get UNAVAILABLE (0: no limit).")
@click.option("--default-max-tokens", type=int, default=64, show_default=True,
              help="max_tokens of a request that sends none.")
@click.option("--batch-invariant", is_flag=True,
              help="Each request's output is what it would be alone, whatever Triton batches with it "
                   "(bit-identical logits). Several times slower: for reproducibility and tests.")
@click.option("--execution-env", type=click.Path(path_type=Path), default=None,
              help="The Python environment the model runs in (Triton's EXECUTION_ENV_PATH): a conda-pack "
                   "archive or an unpacked environment folder holding dspark-trt.")
@click.option("--overwrite", is_flag=True, help="Replace an existing REPO/NAME.")
def triton_command(engine_dir, repo, model_name, instances, instance_kind, target, drafter, policy, dtype,
                   max_running_requests, max_batch_tokens, max_model_len, max_queue, default_max_tokens,
                   batch_invariant, execution_env, overwrite):
    """Write a Triton model repository that serves ENGINE_DIR (from `dspark-trt build`) with dspark-trt's runtime.

    The model is a decoupled (streaming) Python-backend model named like TensorRT-LLM's Triton
    models: text_input, max_tokens, stream, temperature, top_p, top_k, random_seed (or seed),
    stop_words in; text_output out, with token counts and acceptance statistics. Concurrent
    requests share one in-flight batch per instance; cancelling a request in Triton frees it.

    Without ENGINE_DIR, --target/--drafter/--policy name the model directly. Paths are written
    absolute: they must exist at the same paths where Triton runs. Serve it with the official
    Triton container (docs/triton.md), or on a CPU host with the nvidia-pytriton wheel:
    python -m dspark_trt.triton.local_server --model-repository REPO
    """
    from dspark_trt.triton.writer import instance_kind_for, resolve_settings, write_repository

    settings = resolve_settings(engine_dir, target, drafter, policy, dtype=dtype,
                                max_running_requests=max_running_requests, max_batch_tokens=max_batch_tokens,
                                max_model_len=max_model_len, max_queue=max_queue,
                                default_max_tokens=default_max_tokens, batch_invariant=batch_invariant)
    folder = write_repository(repo, settings, model_name, instances, instance_kind_for(engine_dir, instance_kind),
                              overwrite, execution_env)
    click.echo(f"wrote {folder} (config.pbtxt, 1/model.py)")
    click.echo(f"serve:  tritonserver --model-repository {folder.parent}")
    click.echo(f"query:  curl -X POST localhost:8000/v2/models/{model_name}/generate "
               "-d '{\"text_input\": \"Hello\", \"max_tokens\": 32}'")
