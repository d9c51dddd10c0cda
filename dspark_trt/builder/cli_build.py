"""The `dspark-trt build` command: flags in, `builder.build.build` called. No logic here."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("build")
@click.argument("config", metavar="CONFIG")
@click.option("--output", "-o", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Engine directory to write (written to a staging folder and renamed at the end).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config field by dotted path, e.g. --set profile.quick=true (repeatable).")
@click.option("--format", "fmt", type=click.Choice(["dspark", "trtllm"]), default="dspark", show_default=True,
              help="trtllm: also write the drafter and cost table in TensorRT-LLM's DSpark layout (DIR/trtllm).")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
def build_command(config, output, overrides, fmt, force):
    """Build an engine directory from CONFIG (a YAML file, or a name in configs/: default, tiny).

    Steps: load target and drafter, export ONNX, validate against torch, build TensorRT engines
    (when TensorRT and a GPU are present), measure the latency profile, write manifest.json.
    """
    from dspark_trt.builder.build import build
    from dspark_trt.config import load_build_config

    build(load_build_config(config, overrides), output, fmt=fmt, force=force, progress=click.echo)
