"""`python -m heads.train head=NAME`: train a drafter on the frozen target's own greedy continuations.

Interface for a trainable drafter (`configs/head/NAME.yaml`, whose `_target_` builds one)::

    class Trainable(Protocol):
        name: str                # names the output folder: heads/checkpoints/MODEL-NAME/
        needs_hidden: bool       # True: loss() reads target_hidden; False: the trainer skips the target pass

        def build(self, target: LoadedModel, data: datasets.Dataset) -> nn.Module:
            # The trainable module. The target stays frozen; the module may share its tensors (embedding,
            # output head) as frozen parameters: the optimizer only sees parameters with requires_grad.
            # `data` is the training set (columns below), e.g. to pick a reduced vocabulary. Must be
            # deterministic given (target, data, config): resuming rebuilds it and loads the checkpoint.

        def loss(self, module: nn.Module, batch: dict[str, Tensor],
                 target_hidden: Tensor | None) -> tuple[Tensor, dict[str, float]]:
            # batch: input_ids (B, T), labels (B, T), attention_mask (B, T); right-padded.
            #   labels[b, t] is the token that follows input_ids[b, t] in the self-distilled sequence,
            #   -100 where nothing should be learnt (the prompt, padding, the last token).
            # target_hidden: (B, T, D) final-norm hidden states of the frozen target for input_ids
            #   (computed by the trainer, cached on disk with `train.cache_hidden`), None unless needs_hidden;
            #   a Trainable with `target_taps(target) -> layers` gets those layers' inputs after them in the
            #   same rows, (B, T, (1 + len(layers)) D) (EAGLE-3's fused features).
            # Returns the scalar loss and floats to log (e.g. {"acc": ...}). `module` is the module as
            # accelerate prepared it (DistributedDataParallel under `accelerate launch`): call it (its
            # forward) rather than its methods, or gradients are not synchronised across processes.

        def save(self, module: nn.Module, out_dir: Path, meta: dict[str, Any]) -> None:
            # The shipped artifact: safetensors weights + a JSON config naming the base model, its
            # hidden and vocabulary sizes (so a loader refuses another model with a clear error), plus
            # `meta`: training facts from the trainer (steps, minutes, loss, validation, full config).
            # `module` is unwrapped. A Trainable with a truthy `init_from` (a fine-tune) may set
            # `start_minutes` in build(): the saved start's training minutes, None if unknown; the
            # trainer then records `minutes_in_all` (start + this run) in `meta` and on the card.

The trainer (`train`) owns data (heads/distill_data.py: the built-in prompts, or any `datasets` source
with `data.source`, heads/prompt_sources.py), device placement, mixed precision and gradient
accumulation (accelerate), the optimizer (AdamW over parameters with requires_grad), logging (a
progress bar, logger=wandb|none), the stopping rule (`train.epochs` / `train.max_steps` /
`train.max_minutes`), a held-out validation and resumable checkpoints (trainable parameters +
optimizer state in safetensors, counters in JSON, under OUTPUT/checkpoints/, resumed from the last
one). OUTPUT defaults to heads/checkpoints/MODEL-NAME, NAME being the trainable's `name` attribute
(its config need not set it). docs/training.md is the user's guide.

Terms: a *micro-batch* is what one forward/backward sees (`train.batch_size` sequences); a *step* is
one optimizer update, over `train.grad_accum` micro-batches on each process (so an effective batch of
batch_size x grad_accum x processes sequences). Steps are what max_steps, warmup_steps, the logs and
checkpoints count.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import hydra
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler
from tqdm import tqdm

from heads.batches import (
    LengthBatches,
    collate,
    hidden_taps,
    target_hidden,
    with_cached_hidden,
    with_generated_hidden,
)
from heads.card import write_card
from specdec.cli_checks import CONFIG_DIR
from specdec.errors import SpecdecError
from specdec.models.loader import DTYPES, LoadedModel

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

CHECKPOINTS = "checkpoints"

PRECISIONS = ("no", "bf16", "fp16", "fp8")  # accelerate's mixed_precision values

# `data` keys of a `data.source` run (heads/prompt_sources.py); not distill_data's arguments
SOURCE_KEYS = ("source", "split", "subset", "field", "turns", "shuffle")


class Trainable(Protocol):
    name: str
    needs_hidden: bool

    def build(self, target: LoadedModel, data: Any) -> nn.Module: ...

    def loss(self, module: nn.Module, batch: dict[str, Tensor],
             target_hidden: Tensor | None) -> tuple[Tensor, dict[str, float]]: ...

    def save(self, module: nn.Module, out_dir: Path, meta: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    step: int = 0  # optimizer steps
    epoch: int = 0
    batch_in_epoch: int = 0  # global micro-batches of this epoch already trained on
    elapsed_s: float = 0.0
    loss_ema: float | None = None
    first_loss: float | None = None
    recent_losses: list[float] = field(default_factory=list)  # the last 10 steps'


# --------------------------------------------------------------------------------------------------
# Checkpoints: trainable parameters and optimizer state in safetensors, counters in JSON
# --------------------------------------------------------------------------------------------------


def trainable_state(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().contiguous().cpu() for n, p in module.named_parameters() if p.requires_grad}


def save_checkpoint(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState,
                    config_key: str, keep: int = 2) -> Path:
    from safetensors.torch import save_file

    root = folder / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    (root / ".gitignore").write_text("*\n")  # resumable state is large and local; only the artifact ships
    final = root / f"step-{state.step:07d}"
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(trainable_state(module), str(tmp / "trainable.safetensors"))
    opt = optimizer.state_dict()
    tensors = {f"{i}.{k}": (v if torch.is_tensor(v) else torch.tensor(v)).detach().contiguous().cpu()
               for i, s in opt["state"].items() for k, v in s.items()}
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    meta = {"state": asdict(state), "config_key": config_key, "param_groups": opt["param_groups"]}
    (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(folder: Path) -> Path | None:
    done = [p for p in sorted((folder / CHECKPOINTS).glob("step-*")) if (p / "trainer_state.json").is_file()]
    return done[-1] if done else None


def load_checkpoint(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer, config_key: str) -> TrainState:
    from safetensors.torch import load_file

    meta = json.loads((path / "trainer_state.json").read_text())
    if meta["config_key"] != config_key:
        raise SpecdecError(f"the checkpoint in {path} was made with another model, head or data config; pass "
                           "train.resume=false to start over, or another output_dir")
    params = dict(module.named_parameters())
    saved = load_file(str(path / "trainable.safetensors"))
    if set(saved) != {n for n, p in params.items() if p.requires_grad}:
        raise SpecdecError(f"the checkpoint in {path} does not match the module's trainable parameters; pass "
                           "train.resume=false to start over")
    with torch.no_grad():
        for n, t in saved.items():
            params[n].copy_(t)
    tensors = load_file(str(path / "optimizer.safetensors"))
    opt_state: dict[int, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        i, k = key.split(".", 1)
        opt_state.setdefault(int(i), {})[k] = t
    device = next(iter(params.values())).device
    opt_state = {i: {k: (v if k == "step" else v.to(device)) for k, v in s.items()} for i, s in opt_state.items()}
    optimizer.load_state_dict({"state": opt_state, "param_groups": meta["param_groups"]})
    return TrainState(**meta["state"])


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def lr_at(step: int, progress: float, lr: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up, then cosine decay over `progress` (the larger of the step and time fractions)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    p = min(1.0, max(0.0, progress))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def _cap_tokens(train_data: Any, cap: int | None, say: Any) -> tuple[Any, int]:
    """The first sequences of the (shuffled) training split holding at most `cap` target tokens (all of
    them for None), and their target-token count: the points of a data-scaling curve, each a prefix of
    the next, all scored on the same held-out split."""
    counts = np.array([sum(1 for x in r if x >= 0) for r in train_data["labels"]])
    if cap is None:
        return train_data, int(counts.sum())
    if int(cap) < 1:
        raise SpecdecError(f"train.max_train_tokens={cap}: use a positive token count or null (all of them)")
    keep = int(np.searchsorted(np.cumsum(counts), int(cap), side="right"))
    if keep == 0:
        raise SpecdecError(f"train.max_train_tokens={cap} is below the first sequence's {counts[0]} target "
                           "tokens; raise it")
    if keep < len(train_data):
        say(f"train: max_train_tokens={cap} keeps {keep} of {len(train_data)} training sequences")
    return train_data.select(range(keep)), int(counts[:keep].sum())


def _config_key(cfg: DictConfig) -> str:
    """What a checkpoint must have been made with to be resumed. Keys added since (data.source and
    its options, train.grad_accum, head.layout) count only away from their defaults, so that checkpoints
    made before them still resume."""
    t = cfg.train
    data = OmegaConf.to_container(cfg.data, resolve=True)
    assert isinstance(data, dict)
    if data.get("source") is None:
        data = {k: v for k, v in data.items() if k not in SOURCE_KEYS}
    train_keys = {k: t[k] for k in ("lr", "batch_size", "seq_len", "seed", "weight_decay", "val_fraction")}
    if t.get("max_train_tokens") is not None:
        train_keys["max_train_tokens"] = int(t.max_train_tokens)
    if int(t.get("grad_accum") or 1) != 1:
        train_keys["grad_accum"] = int(t.grad_accum)
    head = OmegaConf.to_container(cfg.head)
    assert isinstance(head, dict)
    if head.get("layout") == "specdec":  # head=eagle's layout (added since) at its default
        head.pop("layout")
    spec = {"model": OmegaConf.to_container(cfg.model, resolve=True), "head": head, "data": data,
            "train": train_keys}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def mixed_precision_setting(value: Any) -> str | None:
    """`train.mixed_precision` as accelerate's argument: None (accelerate decides: the environment's
    ACCELERATE_MIXED_PRECISION, which `accelerate launch --mixed_precision` and a saved `accelerate
    config` set, else "no") or one of PRECISIONS, which wins over the environment."""
    if value is None:
        return None
    if value is False:  # YAML 1.1 reads a bare `no` as false
        return "no"
    name = str(value).lower()
    if name not in PRECISIONS:
        raise SpecdecError(f"train.mixed_precision={value!r} is not one of {', '.join(PRECISIONS)}; or give null "
                           "for accelerate's setting")
    return name


def make_accelerator(t: DictConfig) -> Any:
    """The run's Accelerator: mixed precision per `mixed_precision_setting`, gradient accumulation over
    `train.grad_accum` micro-batches (accelerate's ACCELERATE_GRADIENT_ACCUMULATION_STEPS, set by
    `accelerate launch --gradient_accumulation_steps`, wins over it, as accelerate does)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    precision = mixed_precision_setting(t.get("mixed_precision"))
    accum = int(t.get("grad_accum") or 1)
    if accum < 1:
        raise SpecdecError(f"train.grad_accum={accum}: give 1 (no accumulation) or more micro-batches per step")
    # accelerate keeps one precision per process: a second train() in one process (tests, notebooks)
    # would otherwise inherit the first one's, or be refused another. Not under a distributed launch,
    # whose process group outlives the state.
    if AcceleratorState._shared_state and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        AcceleratorState._reset_state()
    try:
        return Accelerator(mixed_precision=precision, cpu=bool(t.cpu), gradient_accumulation_steps=accum)
    except ValueError as e:
        raise SpecdecError(f"accelerate refused the settings (train.mixed_precision={precision}, train.cpu={t.cpu}): "
                           f"{' '.join(str(e).split())[:200]}") from None


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def _log(logger: Any, metrics: dict[str, float], step: int) -> None:
    fn = getattr(logger, "log_metrics", None)
    if fn is not None:
        fn(metrics, step)
        return
    run = getattr(logger, "run", None)  # WandbLogger: the W&B run itself
    if run is not None:
        run.log(metrics, step=step)


@torch.no_grad()
def evaluate(trainable: Trainable, module: nn.Module, target: LoadedModel, loader: Any, accelerator: Any
             ) -> dict[str, float]:
    module.eval()
    sums: dict[str, float] = {}
    n = 0
    for batch in loader:
        hidden = batch.pop("hidden", None)
        if trainable.needs_hidden and hidden is None:
            hidden = target_hidden(target, batch["input_ids"], batch["attention_mask"], hidden_taps(trainable, target))
        with accelerator.autocast():
            loss, logs = trainable.loss(module, batch, hidden)
        for k, v in ({"loss": float(loss)} | logs).items():
            sums[k] = sums.get(k, 0.0) + v
        n += 1
    module.train()
    return {f"val/{k}": v / n for k, v in sums.items()} if n else {}


def train(cfg: DictConfig) -> dict[str, Any]:
    """Build the data, train `cfg.head` on it within the budget, save the artifact; returns its metadata."""
    from heads.data_mix import BUILTIN, build_mix, source_list

    t = cfg.train
    # Stopping: max_steps, when set, replaces the epoch count; max_minutes (null: no time limit) stops
    # whichever comes first. The learning rate decays over the planned steps or the time, whichever is
    # further along.
    budget_s = math.inf if t.max_minutes is None else float(t.max_minutes) * 60
    max_steps = int(t.max_steps) if t.max_steps else None
    epochs = math.inf if max_steps or t.epochs is None else int(t.epochs)
    if epochs == math.inf and max_steps is None and budget_s == math.inf:
        raise SpecdecError("train.epochs, train.max_steps and train.max_minutes are all null, so nothing ends the "
                           "training; set one of them")
    accelerator = make_accelerator(t)
    say = accelerator.print
    accum = int(accelerator.gradient_accumulation_steps)
    chosen = "train.mixed_precision" if t.get("mixed_precision") is not None else "accelerate's setting"
    say(f"train: mixed precision {accelerator.mixed_precision} ({chosen}), {accum} micro-batch(es) per step, "
        f"{accelerator.num_processes} process(es) on {accelerator.device}")
    config = OmegaConf.to_container(cfg, resolve=True)  # as run: precision and accumulation resolved
    assert isinstance(config, dict)
    config["train"]["mixed_precision"] = accelerator.mixed_precision
    config["train"]["grad_accum"] = accum
    if t.torch_threads:
        torch.set_num_threads(int(t.torch_threads))
    torch.manual_seed(int(t.seed))
    target: LoadedModel = instantiate(cfg.model, device=str(accelerator.device))
    trainable: Trainable = instantiate(cfg.head)
    out_dir = Path(cfg.output_dir or f"heads/checkpoints/{target.name}-{trainable.name}")
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    assert isinstance(data_cfg, dict)
    data_cfg["seeds"] = tuple(data_cfg["seeds"])
    source_cfg = {k: data_cfg.pop(k) for k in SOURCE_KEYS if k in data_cfg}
    gen_dtype = data_cfg.pop("dtype", None) or str(cfg.model.dtype)
    if gen_dtype not in (*DTYPES, "auto"):
        raise SpecdecError(f"unknown data.dtype {gen_dtype!r}; use null (the target's), auto or one of "
                           f"{', '.join(DTYPES)}")
    with accelerator.main_process_first():
        # The data may be generated at a lower precision than the target trains against: on CPUs with
        # AMX, bf16 GEMMs run far faster than fp32, and an occasional near-tie flipped in a continuation
        # costs less than the data it buys. The hidden states then come from that copy too.
        generator = target if gen_dtype == str(cfg.model.dtype) else instantiate(
            cfg.model, device=str(accelerator.device), dtype=gen_dtype, matmul="torch")
        gen_dtype = DTYPE_NAMES[generator.dtype]  # `auto` resolved, for the card
        distill, sources = build_mix(generator, source_list(source_cfg.get("source")), source_cfg, data_cfg, say)
        del generator
        data, store = distill.data, None
        taps = hidden_taps(trainable, target)  # generation keeps only the final state: a tapped head recomputes
        if trainable.needs_hidden and distill.hidden is not None and not taps:
            data, store = with_generated_hidden(data, distill.hidden, int(t.seq_len))
        elif trainable.needs_hidden and t.cache_hidden:
            data, store = with_cached_hidden(data, target, int(t.seq_len), int(t.batch_size), taps=taps)
    n_val = int(len(data) * float(t.val_fraction)) if len(data) > 1 else 0
    split = data.train_test_split(test_size=n_val, seed=int(t.seed), shuffle=True) if n_val else None
    train_data, val_data = (split["train"], split["test"]) if split else (data, None)
    train_data, tokens = _cap_tokens(train_data, t.get("max_train_tokens"), say)
    say(f"train: {len(train_data)} sequences ({tokens} target tokens), {n_val} held out")

    module = trainable.build(target, train_data)
    params = [p for p in module.parameters() if p.requires_grad]
    say(f"train: {sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters")
    optimizer = torch.optim.AdamW(params, lr=float(t.lr), betas=(0.9, 0.95), weight_decay=float(t.weight_decay))
    module, optimizer = accelerator.prepare(module, optimizer)
    config_key = _config_key(cfg)
    state = TrainState()
    last = latest_checkpoint(out_dir) if t.resume else None
    if last is not None:
        state = load_checkpoint(last, accelerator.unwrap_model(module), optimizer, config_key)
        say(f"train: resumed from {last} (step {state.step}, {state.elapsed_s / 60:.1f} min)")

    logger = instantiate(cfg.logger) if accelerator.is_main_process else None
    if logger is not None:
        logger.start(config, out_dir / CHECKPOINTS)
    pad = target.tokenizer.pad_token_id or 0
    lengths = [len(x) for x in train_data["input_ids"]]

    def batches(dataset: Any, sampler: Sampler[list[int]]) -> Any:
        return accelerator.prepare(DataLoader(dataset, batch_sampler=sampler,
                                              collate_fn=lambda rows: collate(rows, int(t.seq_len), pad, store)))

    micro_per_epoch = math.ceil(len(LengthBatches(lengths, int(t.batch_size), 0, 0, split=accum))
                                / accelerator.num_processes)
    steps_per_epoch = math.ceil(micro_per_epoch / accum)
    planned_steps = max_steps or (max(1, int(epochs) * steps_per_epoch) if epochs != math.inf else None)
    clock = time.perf_counter() - state.elapsed_s
    last_save = time.perf_counter()
    module.train()
    done = state.epoch >= epochs
    # The bar counts optimizer steps; under a time budget its total is the steps the budget allows
    # at the pace so far, so its ETA is the run's. Not a terminal (a log file, a test): no bar, and a
    # line every log_every steps instead.
    bar = tqdm(total=planned_steps, initial=state.step, unit="step", dynamic_ncols=True,
               desc=f"train {trainable.name}", disable=None if accelerator.is_main_process else True)
    micro: list[float] = []  # losses of the micro-batches of the current step
    micro_logs: dict[str, float] = {}
    while not done:
        sampler = LengthBatches(lengths, int(t.batch_size), int(t.seed), state.epoch, skip=state.batch_in_epoch,
                                split=accum)
        for batch in batches(train_data, sampler):
            elapsed = time.perf_counter() - clock
            progress = max(elapsed / budget_s, state.step / planned_steps if planned_steps else 0.0)
            lr = lr_at(state.step, progress, float(t.lr), int(t.warmup_steps), float(t.min_lr_ratio))
            for group in optimizer.param_groups:
                group["lr"] = lr
            with accelerator.accumulate(module):  # the prepared optimizer steps only when it syncs
                hidden = batch.pop("hidden", None)
                if trainable.needs_hidden and hidden is None:
                    hidden = target_hidden(target, batch["input_ids"], batch["attention_mask"], taps)
                with accelerator.autocast():
                    loss, logs = trainable.loss(module, batch, hidden)
                accelerator.backward(loss)  # divided by grad_accum: the step's gradient is the mean
                if accelerator.sync_gradients and t.grad_clip:
                    accelerator.clip_grad_norm_(params, float(t.grad_clip))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            state.batch_in_epoch += accelerator.num_processes
            micro.append(float(loss.detach()))
            for k, v in logs.items():
                micro_logs[k] = micro_logs.get(k, 0.0) + v
            if not accelerator.sync_gradients:
                continue
            state.step += 1
            value = sum(micro) / len(micro)
            logs = {k: v / len(micro) for k, v in micro_logs.items()}
            micro, micro_logs = [], {}
            state.loss_ema = value if state.loss_ema is None else 0.95 * state.loss_ema + 0.05 * value
            state.first_loss = value if state.first_loss is None else state.first_loss
            state.recent_losses = [*state.recent_losses[-9:], value]
            state.elapsed_s = time.perf_counter() - clock
            metrics = {"train/loss": value, "train/loss_ema": state.loss_ema, "train/lr": lr,
                       "train/epoch": float(state.epoch)} | {f"train/{k}": v for k, v in logs.items()}
            if logger is not None:
                _log(logger, metrics, state.step)
            if bar.disable:
                if state.step % int(t.log_every) == 0:
                    say(f"step {state.step} epoch {state.epoch} {state.elapsed_s / 60:.1f}min "
                        + " ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in metrics.items() if k != "train/epoch"))
            else:
                if budget_s != math.inf:
                    affordable = int(state.step * budget_s / max(state.elapsed_s, 1e-9))
                    bar.total = max(state.step, min(planned_steps or affordable, affordable))
                bar.set_postfix(loss=f"{value:.4g}", lr=f"{lr:.2e}", epoch=state.epoch, refresh=False)
                bar.update(1)
            stop = state.elapsed_s >= budget_s or (max_steps is not None and state.step >= max_steps)
            if accelerator.num_processes > 1:  # every process must stop at the same step
                stop = bool(accelerator.reduce(torch.tensor(float(stop), device=accelerator.device), "max"))
            if stop or time.perf_counter() - last_save >= float(t.save_every_minutes) * 60:
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    save_checkpoint(out_dir, accelerator.unwrap_model(module), optimizer, state, config_key)
                last_save = time.perf_counter()
            if stop:
                done = True
                break
        else:
            state.epoch += 1
            state.batch_in_epoch = 0
            done = state.epoch >= epochs
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                save_checkpoint(out_dir, accelerator.unwrap_model(module), optimizer, state, config_key)
    bar.close()
    last_loss = sum(state.recent_losses) / len(state.recent_losses) if state.recent_losses else None
    # epochs trained, a stop mid-epoch counting its share of that epoch's micro-batches (all processes')
    epochs_done = round(state.epoch + state.batch_in_epoch / (micro_per_epoch * accelerator.num_processes), 2)
    say(f"train: {state.step} steps ({_num(epochs_done)} epochs, {accum} micro-batch(es) of {int(t.batch_size)} "
        f"per step and process) in {state.elapsed_s / 60:.1f} min; loss {_num(state.first_loss)} first, "
        f"{_num(last_loss)} over the last {len(state.recent_losses)} steps")
    val: dict[str, float] = {}
    if val_data is not None:
        vlen = [len(x) for x in val_data["input_ids"]]
        val = evaluate(trainable, module, target, batches(val_data, LengthBatches(vlen, int(t.batch_size), 0, 0)),
                       accelerator)
        say("validation: " + " ".join(f"{k}={v:.4g}" for k, v in val.items()))
        if logger is not None:
            _log(logger, val, state.step)
    meta = {"steps": state.step, "epochs": epochs_done, "minutes": state.elapsed_s / 60,
            "loss_ema": state.loss_ema, "first_loss": state.first_loss, "last_loss": last_loss,
            "sequences": len(train_data), "target_tokens": tokens, "data_minutes": distill.minutes,
            "data_dtype": gen_dtype, "mixed_precision": accelerator.mixed_precision, "grad_accum": accum,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "config": config} | val
    if [a["source"] for a in sources] != [BUILTIN]:
        meta["prompt_sources"] = sources
    if getattr(trainable, "init_from", None):  # a fine-tune: its start's training counts towards the drafter's
        start_minutes = getattr(trainable, "start_minutes", None)
        meta["minutes_in_all"] = None if start_minutes is None else start_minutes + meta["minutes"]
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        trainable.save(accelerator.unwrap_model(module), out_dir, meta)
        write_card(out_dir, trainable.name, target.name, meta)
        log_checkpoint = getattr(logger, "log_checkpoint", None)  # W&B: the artifact folder as a `model` artifact
        if log_checkpoint is not None:
            log_checkpoint(out_dir, metadata={k: v for k, v in meta.items() if k != "config"})
        say(f"saved {trainable.name} for {target.name} to {out_dir} ({state.step} steps, "
            f"{state.elapsed_s / 60:.1f} min)")
    if logger is not None:
        logger.finish()
    return meta


def _check_head(argv: list[str]) -> None:
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "head" and not (CONFIG_DIR / "head" / f"{value}.yaml").is_file():
            names = ", ".join(sorted(p.stem for p in (CONFIG_DIR / "head").glob("*.yaml")))
            raise SpecdecError(f"unknown head {value!r}; choose one of: {names}")


def data_alias(argv: list[str]) -> list[str]:
    """`data=VALUE`, the short form: a preset of configs/train_data/ (`train_data=VALUE`), else a prompt
    source (`data.source=VALUE`: a file, glob, folder or hub id). Without this, Hydra would read
    `data=` as the benchmark's prompt-suite group (configs/data/), which training does not use."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if key == "data" and eq:
            preset = (CONFIG_DIR / "train_data" / f"{value}.yaml").is_file()
            arg = f"train_data={value}" if preset else f"data.source={value}"
        out.append(arg)
    return out


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="train")
def hydra_main(cfg: DictConfig) -> None:
    from specdec.run import user_error

    try:
        train(cfg)
    except Exception as e:
        err = user_error(e)
        if err is None or cfg.get("debug"):
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    sys.argv[1:] = data_alias(sys.argv[1:])
    try:
        _check_head(sys.argv[1:])
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    hydra_main()


if __name__ == "__main__":
    main()
