"""The drafter training loop: resumable, logged, checkpointed.

    for step in steps:
        sample S sequences, A anchors each -> Batch
        loss = drafter_loss(drafter, batch)          (training/losses.py)
        AdamW step (lr warm-up then cosine decay, gradient clip 1.0, no weight decay)
        every `checkpoint_every` steps: save weights + optimizer + RNG state atomically

Precision: `bf16` runs the forward and backward passes under autocast (matmuls in bf16 through
oneDNN on a CPU with AVX-512 BF16, or on a GPU; weights, optimizer state and the loss's
reductions stay fp32: the master weights are the fp32 parameters); `fp32` runs everything in
fp32. `auto` picks bf16 where the hardware has it. Throughput is reported in blocks/s (one
block = one anchor's gamma draft slots; the target features of a sequence are shared by all
its anchors).

A run starts from the target's last layers, or from a trained drafter's weights (fine-tuning:
`starting_drafter`, `train --init-from`); a resumed run keeps the architecture and draft
vocabulary it started with. The target is frozen and never runs here: its features come from
the cache (`data.py`).
A run folder holds `drafter/` (`config.json` + `model.safetensors`, loadable at any time),
`state/` (what resuming needs, exactly; this machine's), `state-compact/` (the same with
AdamW's moments shrunk: what the repository keeps, see `run_state.py`) and `train_log.jsonl`
(one line per logged step).
"""

from __future__ import annotations

import json
import math
import random
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from dspark_trt.errors import DsparkError
from dspark_trt.models.drafter import DrafterBase
from dspark_trt.models.drafter_config import DrafterConfig
from dspark_trt.models.drafter_io import build_drafter, load_stored_weights, read_drafter, save_drafter
from dspark_trt.models.loading import LoadedTarget
from dspark_trt.training.data import Sequence, make_batch
from dspark_trt.training.losses import SLOT_DECAY, drafter_loss
from dspark_trt.training.prompts import RESAMPLE_PREFIX, is_held_out  # noqa: F401  (trainer.is_held_out: the older home)
from dspark_trt.training.run_state import (load_run_state, optimizer_from_files, optimizer_to_files, run_progress,
                                           save_compact_run_state, save_run_state)


@dataclass
class TrainConfig:
    steps: int = 2000
    sequences_per_batch: int = 8
    anchors_per_sequence: int = 16
    learning_rate: float = 6e-4
    warmup_fraction: float = 0.04
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 200
    log_every: int = 20
    init_from_target: bool = True  # draft layers start as copies of the target's last layers
    init_from: str = ""  # a drafter checkpoint the weights start from instead (fine-tuning; `initial_weights`)
    domains: list[str] = field(default_factory=list)  # the data's rows of these domains only (empty: all)
    slot_decay: float = SLOT_DECAY  # L1 weight of slot k: exp(-(k-1)/slot_decay)
    greedy_weight: float = 0.0  # weight of the CE to the target's argmax (losses: what T=0 accepts)
    precision: str = "fp32"  # "bf16": autocast matmuls to bf16 (fp32 master weights); see resolve_precision
    compile_loss: bool = False  # the slot losses through torch.compile (losses.compiled_slot_terms)


PRECISIONS = ("auto", "bf16", "fp32")


def resolve_precision(name: str, device: torch.device) -> str:
    """`auto` -> `bf16` where the hardware runs bf16 matmuls natively (a CPU with AVX-512 BF16, or a
    GPU that supports bf16), else `fp32`."""
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "fp32"
    return "bf16" if " avx512_bf16" in flags else "fp32"


def drafter_config_for(kind: str, target: LoadedTarget, feature_layers: tuple[int, ...], head: str | None = None,
                       block_size: int = 7, num_layers: int = 2, draft_vocab: int = 8192,
                       context_norm: bool = True, prefix_layer: bool = False) -> DrafterConfig:
    """The drafter `dspark-trt train --kind KIND` builds: DSpark (Markov head and confidence head by
    default), DFlash (the same backbone, no heads), EAGLE-3-style and MTP-1 (one layer; MTP-1
    drafts one token). `context_norm` (DSpark and DFlash): each layer's own norm of the context
    (`DSparkDrafter.context_keys_values_at`); EAGLE-3-style and MTP-1 already norm theirs.
    `prefix_layer` (DSpark only, which `DrafterConfig` checks): a causal layer over the drafted
    prefix (`PrefixLayer`)."""
    return DrafterConfig.for_target(target.name, target.config, feature_layers, kind=kind,
                                    head=head or ("markov" if kind == "dspark" else "none"),
                                    confidence=kind == "dspark", block_size=1 if kind == "mtp1" else block_size,
                                    num_layers=1 if kind in ("eagle3", "mtp1") else num_layers,
                                    draft_vocab_size=draft_vocab,
                                    context_norm=context_norm and kind in ("dspark", "dflash"),
                                    prefix_layer=prefix_layer)


# The drafter fields a resumed run must keep: its weights mean nothing under another shape or wiring.
ARCHITECTURE_FIELDS = ("kind", "feature_layers", "block_size", "num_layers", "head", "markov_rank", "confidence",
                       "draft_vocab_size", "context_norm", "prefix_layer")
# Those of them that are on/off options added later: a run saved before one existed had it off.
DRAFTER_FLAGS = ("context_norm", "prefix_layer")


def saved_drafter_flag(run_dir: Path, name: str) -> bool | None:
    """The on/off drafter option `name` (one of `DRAFTER_FLAGS`) a run at `run_dir` was
    started with: None for no run there yet, False for runs checkpointed before the option existed
    (they were trained without it)."""
    meta = run_progress(run_dir)
    if not meta:
        return None
    return bool(meta.get("drafter_config", {}).get(name, False))


def check_same_drafter(saved: dict | None, drafter_config: DrafterConfig) -> None:
    """Refuse to resume a run's weights into a drafter of another architecture (naming the field)."""
    if not saved:
        return  # checkpointed before the drafter's config was saved with the run
    current = asdict(drafter_config)
    for name in ARCHITECTURE_FIELDS:
        ours = list(current[name]) if isinstance(current[name], tuple) else current[name]
        # an on/off option the run's saved config predates was off (`saved_drafter_flag`)
        theirs = saved.get(name, False) if name in DRAFTER_FLAGS else saved.get(name, ours)
        if theirs != ours:
            raise DsparkError(f"the run was started with drafter {name} = {theirs!r}, not {ours!r}: resume it "
                              f"with the options it started with, or train into another --output")


# `dspark-trt train` options -> the DrafterConfig field each sets (what `starting_drafter` checks).
ARCHITECTURE_OPTIONS = {"kind": "kind", "head": "head", "block_size": "block_size", "num_layers": "num_layers",
                        "draft_vocab": "draft_vocab_size", "feature_layers": "feature_layers",
                        "context_norm": "context_norm", "prefix_layer": "prefix_layer"}


def starting_drafter(spec: str, target: LoadedTarget, given: dict) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """What a fine-tuning run (`train --init-from SPEC`) starts from: the checkpoint's config, without
    its confidence calibration (fine-tuning moves the confidences it was fitted to; a copy bias
    stays, so the drafter learns beside it), and its weights. `given`:
    the architecture options set on the command line (names as in `ARCHITECTURE_OPTIONS`); each must
    agree with the checkpoint, since its weights mean nothing under another shape."""
    config, weights = read_drafter(spec, target)
    for option, value in given.items():
        field_name = ARCHITECTURE_OPTIONS[option]
        theirs = getattr(config, field_name)
        if isinstance(theirs, (list, tuple)):
            theirs, value = list(theirs), list(value)
        if option == "draft_vocab":  # 0, or any size not below the target's vocabulary, means all of it
            vocab_size = target.config.vocab_size
            theirs, value = (v if 0 < v < vocab_size else vocab_size for v in (theirs, value))
        if theirs != value:
            raise DsparkError(f"--{option.replace('_', '-')} {value}: the --init-from drafter {spec!r} has "
                              f"{field_name} = {theirs!r}; leave the option out (fine-tuning keeps the architecture)")
    config.confidence_temperatures, config.copy_confidence, config.confidence_top_prob = [], [], []
    return config, weights


def build_draft_vocab(rows: list[dict], size: int, vocab_size: int, always: set[int]) -> torch.Tensor:
    """The `size` most frequent target tokens of the training responses (plus `always`, e.g. EOS)."""
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = Counter(t for r in rows for t in r["response_ids"])
    chosen = list(always)
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if token not in always:
            chosen.append(token)
    filler = (t for t in range(vocab_size) if t not in set(chosen))
    while len(chosen) < size:  # tiny datasets: pad with low ids
        chosen.append(next(filler))
    return torch.tensor(sorted(chosen))


def learning_rate(step: int, config: TrainConfig) -> float:
    warmup = max(1, int(config.steps * config.warmup_fraction))
    if step < warmup:
        return config.learning_rate * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    return config.learning_rate * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# What may change when a run resumes: its length (to extend a schedule) and how often it logs.
RESUMABLE_CHANGES = {"steps", "checkpoint_every", "log_every", "compile_loss"}


def _warn_on_recipe_change(saved: dict, config: TrainConfig) -> None:
    """A resumed run continues with the options given now; say which differ from the saved run's."""
    defaults = asdict(TrainConfig())
    changed = [f"{name} {saved.get(name, defaults[name])} -> {value}" for name, value in asdict(config).items()
               if name not in RESUMABLE_CHANGES and saved.get(name, defaults[name]) != value]
    if changed:
        warnings.warn("resuming with a different training recipe: " + ", ".join(changed), stacklevel=3)


def device_description(device: torch.device) -> str:
    """What the model card says the drafter was trained on."""
    if device.type == "cuda":
        return f"one {torch.cuda.get_device_name(device)} GPU"
    return "this machine's CPU"


def train_drafter(target: LoadedTarget, sequences: list[Sequence], drafter_config: DrafterConfig,
                  draft_vocab: torch.Tensor, config: TrainConfig, run_dir: Path,
                  progress: bool = True, stop_at: int | None = None,
                  device: torch.device | str = "cpu",
                  initial_weights: dict[str, torch.Tensor] | None = None) -> DrafterBase:
    """Train (or resume) until `config.steps`, or until step `stop_at` when given (the schedule
    still spans `config.steps`, so a later call continues exactly where this one stopped).

    `initial_weights` (a drafter checkpoint's, `drafter_io.read_drafter`, of `drafter_config`'s
    architecture and `draft_vocab`): a new run starts from them instead of from the target's
    layers: fine-tuning a trained drafter, e.g. on one domain's traffic. A resumed run ignores them.

    `device`: where the drafter trains; the target's weights are moved there too (the drafter
    borrows its embedding and LM head). Batches are gathered on the CPU one step ahead, in a
    worker thread, so the GPU does not wait for them."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    legacy_state = run_dir / "training_state.pt"  # runs from before `state/`
    device = torch.device(device)
    if config.precision not in ("bf16", "fp32"):
        raise ValueError(f"TrainConfig.precision must be bf16 or fp32 (resolve_precision), got {config.precision!r}")
    torch.manual_seed(config.seed)
    target.model.to(device)
    saved = load_run_state(run_dir)
    if saved is not None:
        check_same_drafter(saved[0].get("drafter_config"), drafter_config)
        # A resumed run keeps the vocabulary it started with (its LM-head rows and id maps are built
        # from it here), whatever the data given now would choose.
        draft_vocab = saved[1].get("drafter.draft_vocab", draft_vocab)
    drafter = build_drafter(drafter_config, draft_vocab).attach_target(target.model)
    if saved is None and initial_weights is not None:
        if not torch.equal(initial_weights["draft_vocab"], draft_vocab):
            raise DsparkError("initial_weights: their draft vocabulary is not the one given to train with")
        load_stored_weights(drafter, initial_weights, config.init_from)
    elif config.init_from_target:
        drafter.init_layers_from_target(target.model)
    drafter.to(device)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=config.learning_rate,
                                  weight_decay=0.0)
    start_step, elapsed, num_blocks = 0, 0.0, 0
    generator = torch.Generator().manual_seed(config.seed)
    rng = random.Random(config.seed)
    if saved is not None:  # resume
        meta, tensors = saved
        started_from = meta.get("train_config", {}).get("init_from", "")
        if started_from and not config.init_from:  # resumed without --init-from: it still started there
            config = replace(config, init_from=started_from)
        drafter.load_state_dict({k[len("drafter."):]: v for k, v in tensors.items() if k.startswith("drafter.")})
        optimizer.load_state_dict(optimizer_from_files(meta["optimizer"], tensors))
        start_step, elapsed, num_blocks = meta["step"], meta["elapsed"], meta.get("num_blocks", 0)
        _warn_on_recipe_change(meta.get("train_config", {}), config)
        if meta.get("moments") == "factored":
            tqdm.write(f"resuming at step {start_step} from {meta['resumed_from']}/ (the repository's copy): "
                       "AdamW's first moments restart at zero, its second moments from their row and column "
                       "sums (run_state.py)")
        generator.set_state(tensors["sampler.generator"])
        version, internal, gauss = meta["rng"]
        rng.setstate((version, tuple(internal), gauss))
    elif legacy_state.is_file():
        state = torch.load(legacy_state, map_location="cpu", weights_only=False)
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        start_step, elapsed = state["step"], state["elapsed"]
        _warn_on_recipe_change(state.get("train_config", {}), config)
        generator.set_state(state["generator"])
        rng.setstate(state["rng"])
    final_norm, eps = target.model.final_norm.detach(), target.config.rms_norm_eps

    def next_batch():
        """The next step's batch, and the sampler states after it (what a resumed run starts from)."""
        chosen = rng.sample(sequences, min(config.sequences_per_batch, len(sequences)))
        batch = make_batch(chosen, config.anchors_per_sequence, drafter_config.block_size,
                           len(drafter_config.feature_layers), drafter_config.hidden_size, generator)
        return batch.to(device), rng.getstate(), generator.get_state()

    def checkpoint(step: int, sampler_state: tuple):
        rng_state, generator_state = sampler_state
        groups, moments = optimizer_to_files(optimizer.state_dict())
        meta = {"step": step, "elapsed": elapsed, "num_blocks": num_blocks, "rng": rng_state, "optimizer": groups,
                "train_config": asdict(config), "drafter_config": asdict(drafter_config),
                "device": device_description(device)}
        tensors = {**{f"drafter.{k}": v for k, v in drafter.state_dict().items()}, **moments,
                   "sampler.generator": generator_state}
        save_run_state(run_dir, meta, tensors)
        save_compact_run_state(run_dir, meta, tensors)
        legacy_state.unlink(missing_ok=True)  # superseded by state/
        save_drafter(drafter, run_dir / "drafter")

    drafter.train()
    bar = tqdm(total=config.steps, initial=start_step, desc=f"train {drafter_config.kind}", unit="step",
               disable=not progress)
    end_step = min(config.steps, stop_at or config.steps)
    with open(run_dir / "train_log.jsonl", "a") as log, ThreadPoolExecutor(max_workers=1) as prefetcher:
        # One batch in flight: the worker gathers step k+1's while step k trains. Calls run one
        # after another, so the samplers advance exactly as without the worker.
        pending = prefetcher.submit(next_batch) if start_step < end_step else None
        for step in range(start_step, end_step):
            began = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, config)
            batch, *sampler_state = pending.result()
            pending = prefetcher.submit(next_batch) if step + 1 < end_step else None
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16"):
                terms = drafter_loss(drafter, batch, final_norm, eps, config.slot_decay, config.compile_loss,
                                     config.greedy_weight)
            optimizer.zero_grad(set_to_none=True)
            terms.total.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), config.grad_clip)
            optimizer.step()
            seconds = time.perf_counter() - began
            elapsed += seconds
            step_blocks = int(batch.valid[..., 0].sum())  # anchors with a supervised first slot
            num_blocks += step_blocks
            bar.update(1)
            bar.set_postfix(loss=f"{float(terms.total.detach()):.3f}", acc1=f"{terms.acceptance_per_position[0]:.2f}",
                            blocks_s=f"{step_blocks / seconds:.0f}")
            if (step + 1) % config.log_every == 0 or step == start_step:
                log.write(json.dumps({"step": step + 1, "loss": float(terms.total.detach()), "ce": terms.ce, "l1": terms.l1,
                                      "bce": terms.bce, "greedy_ce": terms.greedy_ce, "grad_norm": float(grad_norm),
                                      "lr": learning_rate(step, config),
                                      "acceptance_per_position": terms.acceptance_per_position,
                                      "elapsed_s": elapsed, "num_blocks": num_blocks,
                                      "blocks_per_s": num_blocks / elapsed if elapsed else 0.0,
                                      "precision": config.precision}) + "\n")
                log.flush()
            if (step + 1) % config.checkpoint_every == 0 or step + 1 in (config.steps, stop_at):
                checkpoint(step + 1, sampler_state)
    bar.close()
    return drafter.eval()


def model_card(drafter: DrafterBase, data_paths: list[Path], sequences: list[Sequence], config: TrainConfig,
               run_dir: Path) -> str:
    """A short markdown card: what the drafter is, what it was trained on, for how long."""
    state = run_progress(run_dir)
    log = [json.loads(line) for line in (Path(run_dir) / "train_log.jsonl").read_text().splitlines()]
    last = log[-1] if log else {}
    c = drafter.config
    num_params = sum(p.numel() for p in drafter.parameters())
    response_tokens = sum(s.token_ids.numel() - s.prompt_length for s in sequences)
    acceptance = ", ".join(f"{a:.2f}" for a in last.get("acceptance_per_position", []))
    schedule = f" (of a {config.steps}-step schedule, stopped early)" if state["step"] < config.steps else ""
    blocks = state.get("num_blocks", 0)
    precision = state.get("train_config", {}).get("precision", "fp32")
    throughput = (f", {blocks:,} blocks ({blocks / state['elapsed']:.0f} blocks/s, {precision})"
                  if blocks and state["elapsed"] else "")
    files = ", ".join(f"`{path}`" for path in data_paths)
    if config.domains:
        files += f" (only their {' and '.join(config.domains)} rows)"
    init_from = state.get("train_config", {}).get("init_from", "")  # how the run started, not how it resumed
    start = f", fine-tuning the drafter `{init_from}` (its architecture and draft vocabulary)" if init_from else ""
    loss = ("loss: CE alone (DFlash's recipe)" if c.kind == "dflash"
            else f"slot loss weights exp(-(k-1)/{config.slot_decay:g})")
    if config.greedy_weight:
        loss += f", plus {config.greedy_weight:g} x CE to the target's argmax (`--greedy-weight`)"
    context = " (each norms the target context with its own input norm: `context_norm`)" if c.context_norm else ""
    if c.prefix_layer:
        context += ", then a causal layer over the drafted prefix before the LM head (`prefix_layer`)"
    return f"""# {c.kind} drafter for {c.target_name}

- kind: `{c.kind}`, sequential head: `{c.head}`, confidence head: {c.confidence}, block size {c.block_size},
  {c.num_layers} backbone layer(s){context}, draft vocabulary {drafter.draft_vocab.numel()} tokens,
  target feature layers {list(c.feature_layers)}; {num_params / 1e6:.1f}M trained parameters (fp16 here).
- data: {files}: {len(sequences)} training sequences ({response_tokens} response tokens)
  regenerated by the target itself; 5% of rows (by id) held out for calibration.
- training: {state["step"]} steps{schedule} of {config.sequences_per_batch} sequences x \
{config.anchors_per_sequence} anchors{start},
  AdamW lr {config.learning_rate} (warm-up {config.warmup_fraction:.0%}, cosine), clip {config.grad_clip},
  {loss},
  {state["elapsed"] / 60:.1f} min on {state.get("device", "this machine's CPU")}{throughput}.
- last logged loss {last.get("loss", float("nan")):.3f}; teacher-forced acceptance per position: {acceptance}.
- calibration (STS temperatures): {c.confidence_temperatures or "not calibrated"}.
"""
