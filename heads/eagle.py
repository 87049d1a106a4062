"""An EAGLE-style drafter (Li et al. 2024): one decoder layer that extrapolates the target's features.

Where specdec's plain draft (heads/draft_model.py) sees only tokens, this drafter also reads the
target's final-norm hidden state h_t: its input at step t is the pair (h_t, token x_{t+1}), fused by
one linear layer, passed through `layers` decoder blocks of the target's width, and normalised into a
guess of h_{t+1}. The target's own (frozen) output head, cut to the `kept_vocab` most frequent rows,
turns that guess into the distribution of x_{t+2}. Drafting further feeds the guessed feature back
in place of the target's, so training adds noise to the target's features to make the drafter robust
to its own errors (EAGLE's remedy). The loss regresses the feature (smooth L1) and matches the
target's distribution (KL, by default at a tenth of the regression's weight, as the EAGLE paper weights
them), at every position, prompts included; the head is read in chunks
(heads/head_loss.py), the target's distribution once a step for every unrolled pass.

Two layouts (`head.layout`, saved as eagle.json's `layout`; checkpoints without it are `specdec`):
`specdec` normalises layer 0's input and the output (RMSNorm) and may score a reduced vocabulary;
`eagle1` is EAGLE-1's published network (neither norm, `fc` without a bias, the target's whole head), which
`python -m heads.export eagle` writes in EAGLE-1's layout for vLLM, SGLang and EAGLE's code
(heads/interop/eagle_layout.py).

Saved as OUT/eagle.safetensors (fc, blocks, norm, `kept_ids`) and OUT/eagle.json (base model, its hidden
and vocabulary size, a fingerprint of its embedding, the block shape, the layout, training metadata);
loading it for another target is a one-line error. Used by `strategy=eagle` (specdec/strategies/eagle.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.draft_model import (
    SavedDrafter,
    drafter_rows,
    fingerprint,
    start_minutes,
    target_embedding,
    target_head,
)
from heads.head_loss import head_loss, target_distribution
from heads.training_time_test import PassStack, ttt_mask
from specdec.errors import SpecdecError
from specdec.models.llama import SUPPORTED_TYPES, Llama, LlamaArgs, PassThroughNorm, rope_inv_freq
from specdec.models.loader import LoadedModel

FORMAT = "specdec-eagle/1"
WEIGHTS = "eagle.safetensors"
CONFIG = "eagle.json"
LAYOUTS = ("specdec", "eagle1")  # the first: what checkpoints without a `layout` field have
CONTEXTS = ("guessed", "drafting")  # what an unrolled pass s > 1 attends to (EagleTrainModule.forward)


class EagleNet(Llama):
    """(token x_{t+1}, feature h_t) pairs -> guessed h_{t+1} (B, T, D) and logits over kept rows (B, T, K).

    A Llama of `n_layers` blocks whose input is fc([embed(x); h]) instead of embed(x); it keeps the
    compact model's static cache, rope and CPU kernels. `token_ids` (K,) maps logit rows to target ids.
    layout "eagle1": no norm on layer 0's input nor on the output (PassThroughNorm), as EAGLE-1 publishes it.
    """

    def __init__(self, args: LlamaArgs, kept: int, layout: str = "specdec") -> None:
        super().__init__(args)
        self.fc = nn.Linear(2 * args.dim, args.dim, bias=True)
        self.lm_head = nn.Linear(args.dim, kept, bias=False)
        self.token_ids: Tensor | None = None
        self.layout = layout
        if layout == "eagle1":  # the last block's output itself is the guessed feature
            self.layers[0].attn_norm = PassThroughNorm(args.dim, args.norm_eps)  # type: ignore[index]
            self.norm = PassThroughNorm(args.dim, args.norm_eps)  # type: ignore[assignment]

    reads_features = True  # BatchEngine feeds it each row's feature beside the token (engine/batch.py)

    def pair_input(self, tokens: Tensor, features: Tensor) -> Tensor:
        """The layers' input (..., D) of tokens (...) and their pairs' features (..., D): fc([embed(x); h])."""
        return self.fc(torch.cat([self.embed(tokens), features.to(self.dtype)], -1))

    def forward(self, tokens: Tensor, features: Tensor, positions: Tensor, cache: Any,  # type: ignore[override]
                mask: Tensor | None = None, logits_from: int = 0) -> tuple[Tensor, Tensor]:
        cache.reserve(tokens.shape[1])
        h = self.run_layers(self.pair_input(tokens, features), positions, cache, mask)  # (B, T, D)
        cache.advance(tokens.shape[1])
        return self.lm_head(h[:, logits_from:]), h

    def forward_static(self, tokens: Tensor, positions: Tensor, slots: Tensor, tree: Tensor,  # type: ignore[override]
                       cache: Any, features: Tensor) -> tuple[Tensor, Tensor]:
        """Llama.forward_static with the pairs' features (1, T, D) beside the tokens (engine/static_step.py)."""
        h = self.layers_static(self.pair_input(tokens, features), positions, slots, tree, cache)  # (1, T, D)
        return self.lm_head(h), h


def eagle_args(target: LoadedModel, layers: int) -> LlamaArgs:
    """The target's block shape, `layers` deep."""
    model = target.model
    if target.backend == "compact":
        base: LlamaArgs = model.args
    else:
        from heads.draft_model import target_hf_config

        cfg = target_hf_config(target)
        try:
            base = LlamaArgs.from_hf(cfg)
        except SpecdecError:  # from_hf's hint (use model.backend=hf) does not apply to the drafter
            raise SpecdecError(f"the EAGLE drafter copies the target's decoder block, which it has for "
                               f"{', '.join(SUPPORTED_TYPES)} models, not {cfg.model_type} ({target.name}); use "
                               "strategy=draft_lm or medusa with this target") from None
    return LlamaArgs(**(asdict(base) | {"n_layers": layers}))


# --------------------------------------------------------------------------------------------------
# Loading (strategy=eagle)
# --------------------------------------------------------------------------------------------------


class EagleCheckpoint(SavedDrafter):
    """A saved EAGLE-style drafter (what configs/strategy/eagle.yaml builds)."""

    HEAD = "eagle"
    WHAT = "EAGLE drafter"

    def build(self, target: LoadedModel) -> EagleNet:
        kept_ids, own = self.saved_tensors(target, WEIGHTS)
        args = LlamaArgs(**self.meta["args"])
        layout = self.meta.get("layout", LAYOUTS[0])
        if layout not in LAYOUTS:
            raise SpecdecError(f"{self.folder / CONFIG} has layout {layout!r}, not one of {', '.join(LAYOUTS)}; "
                               "retrain it with this version of python -m heads.train head=eagle")
        with torch.device("meta"):
            net = EagleNet(args, len(kept_ids), layout)
        own["embed.weight"] = target_embedding(target).detach()
        own["lm_head.weight"] = target_head(target).detach()[kept_ids].to(target.dtype).contiguous()
        net.load_state_dict(own, strict=True, assign=True)
        net.inv_freq = rope_inv_freq(args).to(target.device)  # the meta-device buffer holds no values
        self.ready(net, kept_ids, target)
        if layout == "eagle1":  # trained on the whole vocabulary: rows are target ids (what export_eagle needs)
            net.token_ids = None
        return net


def load_eagle(path: str, weights: str = "fp32", rows: int | None = None) -> EagleCheckpoint:
    """Entry point of configs/strategy/eagle.yaml: the drafter in `path` (heads/checkpoints/MODEL-eagle),
    its matrices run in fp32, bf16 or int8 by the CPU kernels (`weights`), scoring `rows` target rows
    (SavedDrafter.rows; None: the kept rows it was trained on)."""
    return EagleCheckpoint.load(path, CONFIG, WEIGHTS, FORMAT, weights=weights, rows=rows)


# --------------------------------------------------------------------------------------------------
# Training (heads.train's Trainable)
# --------------------------------------------------------------------------------------------------


class EagleTrainModule(nn.Module):
    """EagleNet over whole right-padded sequences, causal attention among their own pairs."""

    def __init__(self, net: EagleNet) -> None:
        super().__init__()
        self.net = net

    def forward(self, tokens: Tensor, features: Tensor, unroll: int = 1, context: str = "guessed") -> list[Tensor]:
        """tokens (B, T) x_{t+1} and features (B, T, D) h_t of pairs t -> each pass's guessed features (B, T, D),
        no logits: the loss reads them through the head in chunks (head_loss).

        Pass s > 1 gives pair t the guess pass s - 1 made at pair t - 1, as drafting feeds its guesses back
        (pair 0 keeps its feature). Its attention reads, with context "guessed", every earlier pair of the same
        pass (guesses all); with "drafting", pass 1's pairs up to t - (s - 1) and its own guesses after them,
        what drafting the s-th token shows it (the training-time test, heads/training_time_test.py)."""
        from heads.batches import NoCache

        B, T = tokens.shape
        pos = torch.arange(T, device=tokens.device).expand(B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()[None, None]  # (1, 1, T, T)
        stack = PassStack() if context == "drafting" else None  # one forward for every pass (one graph for DDP)
        out: list[Tensor] = []
        for s in range(1, unroll + 1):
            if stack is None:
                guess = self.net(tokens, features, pos, NoCache(), causal, logits_from=T)[1]
            else:
                guess = self.net(tokens, features, pos, stack, ttt_mask(T, s, tokens.device), logits_from=T)[1]
            out.append(guess)
            features = torch.cat([features[:, :1], guess[:, :-1]], 1)
        return out


class EagleTrainable:
    """heads.train's Trainable for the EAGLE-style drafter (configs/head/eagle.yaml)."""

    needs_hidden = True

    def __init__(self, name: str = "eagle", layers: int = 1, kept_vocab: int = 8192, reg_weight: float = 1.0,
                 kl_weight: float = 0.1, noise: float = 0.1, unroll: int = 2, context: str = "guessed",
                 save_dtype: str = "fp16", layout: str = "specdec", init_from: str | None = None) -> None:
        if layout not in LAYOUTS:
            raise SpecdecError(f"head.layout={layout!r}; use specdec (specdec's own) or eagle1 (EAGLE-1's published "
                               "network, exportable with python -m heads.export eagle)")
        if layers < 1:
            raise SpecdecError(f"head.layers={layers} must be at least 1")
        if noise < 0 or reg_weight < 0 or kl_weight < 0 or reg_weight + kl_weight == 0:
            raise SpecdecError("head.noise, head.reg_weight and head.kl_weight must be >= 0, the weights not both 0")
        if unroll < 1:
            raise SpecdecError(f"head.unroll={unroll} must be at least 1 (1: train on the target's features only)")
        if context not in CONTEXTS:
            raise SpecdecError(f"head.context={context!r}; use guessed (later passes attend to guesses only) or "
                               "drafting (to real pairs, then their own guesses: the training-time test)")
        self.name = name
        self.layers = layers
        self.layout = layout
        self.kept_vocab = 0 if layout == "eagle1" else kept_vocab  # EAGLE-1 scores with the target's whole head
        self.reg_weight = reg_weight
        self.kl_weight = kl_weight
        self.noise = noise
        self.unroll = unroll
        self.context = context
        self.save_dtype = parse_save_dtype(save_dtype)
        self.init_from = init_from
        self.target: LoadedModel | None = None
        self.args: LlamaArgs | None = None
        self.kept_ids: Tensor | None = None
        self.to_kept: Tensor | None = None  # (V,) target id -> kept row, -1 if not kept
        self.start_minutes: float | None = None  # training minutes behind init_from's drafter (None: unknown)
        self._target_buffer: Tensor | None = None  # the target's (N, K) probabilities, reused step to step

    def build(self, target: LoadedModel, data: Any) -> nn.Module:
        self.target = target
        self.args = eagle_args(target, self.layers)
        embed = target_embedding(target).detach().float()
        start = self._saved_start(target) if self.init_from else None
        self.kept_ids, self.to_kept = drafter_rows(start, data, target, self.kept_vocab, embed.device)
        torch.manual_seed(0)
        with torch.device("meta"):
            net = EagleNet(self.args, len(self.kept_ids), self.layout)
        net.to_empty(device=embed.device)
        init_fresh(net)  # fresh blocks and fc; the target's norm scale as the output's starting scale (below)
        net.embed.weight = nn.Parameter(embed, requires_grad=False)
        head = target_head(target).detach().float()[self.kept_ids].clone()  # (K, D)
        net.lm_head.weight = nn.Parameter(head, requires_grad=False)
        if self.layout == "eagle1":  # an exact zero bias: vLLM's EAGLE-1 drafter has none (docs/interop.md)
            nn.init.zeros_(net.fc.bias)
            net.fc.bias.requires_grad_(False)
        else:
            net.norm.weight.data.copy_(_final_norm_weight(target))
        net.inv_freq = rope_inv_freq(self.args).to(embed.device)
        if start is not None:
            got = net.load_state_dict({k: v.to(embed.device) for k, v in start.items()}, strict=False)
            lost = [k for k in got.missing_keys if not k.startswith(("embed.", "lm_head."))] + got.unexpected_keys
            if lost:
                raise SpecdecError(f"head.init_from={self.init_from} does not fit this drafter ({', '.join(lost)}); "
                                   "retrain it with this version of python -m heads.train head=eagle")
        return EagleTrainModule(net)

    def _saved_start(self, target: LoadedModel) -> dict[str, Tensor]:
        """head.init_from's saved weights (fp32, on the host) and `kept_ids`, checked against this head's shape."""
        from safetensors.torch import load_file

        saved = load_eagle(str(self.init_from))
        saved.check(target)
        layers, layout = saved.meta.get("num_layers"), saved.meta.get("layout", LAYOUTS[0])
        if (layers, layout) != (self.layers, self.layout):
            raise SpecdecError(f"head.init_from={self.init_from} holds a {layers}-layer {layout} drafter, not "
                               f"head.layers={self.layers} head.layout={self.layout}; set those to match it")
        self.start_minutes = start_minutes(saved.meta)
        tensors = load_file(str(saved.folder / WEIGHTS))
        return {k: v if k == "kept_ids" else v.float() for k, v in tensors.items()}

    def loss(self, module: nn.Module, batch: dict[str, Tensor],
             target_hidden: Tensor | None) -> tuple[Tensor, dict[str, float]]:
        assert self.to_kept is not None and target_hidden is not None
        ids, labels = batch["input_ids"], batch["labels"]
        h = target_hidden.float()  # (B, T, D)
        feats = h[:, :-1]
        if module.training and self.noise > 0:  # the drafter must cope with its own imperfect features
            rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
            feats = feats + (torch.rand_like(feats) * 2 - 1) * self.noise * rms
        valid = batch["attention_mask"][:, 1:].bool()
        if not valid.any():
            return feats.sum() * 0.0, {"reg": 0.0, "kl": 0.0, "acc": 0.0}
        nxt = h[:, 1:][valid]  # (N, D) the target's h_{t+1} for each real pair t
        head = module.net.lm_head.weight if hasattr(module, "net") else module.module.net.lm_head.weight
        small = self.to_kept.to(labels.device)[labels[:, 1:].clamp_min(0)][valid]  # (N,) kept row of x_{t+2}, -1: none
        scored = (labels[:, 1:][valid] >= 0) & (small >= 0)  # the continuation's tokens the drafter can propose
        target = target_distribution(nxt, head, self._target_buffer)  # once for every unrolled pass
        self._target_buffer = target.buffer
        loss = feats.new_zeros(())
        logs: dict[str, float] = {}
        pair = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)  # (B, T-1)
        for s, guess in enumerate(module(ids[:, 1:], feats, self.unroll, self.context), 1):
            # pass s's pair t guesses h_{t+1}, whose head scores x_{t+2}; under "drafting" pass s scores only
            # pairs with s - 1 real pairs before their guesses, as drafting has
            rows = (pair >= s - 1)[valid] if self.context == "drafting" else torch.ones_like(scored)  # (N,)
            if not rows.any():
                break
            real = guess[valid]  # (N, D)
            reg = F.smooth_l1_loss(real[rows].float(), nxt[rows])
            # KL(target || drafter) over the kept rows at every scored pair; the cross-entropy is unused (only
            # its hit count, the agreement with the target's continuation, is logged)
            _, kl, hits = head_loss(real, head, small, target, scored & rows, rows, top=1)
            loss = loss + (self.reg_weight * reg + self.kl_weight * kl) / self.unroll
            suffix = "" if s == 1 else str(s)
            logs |= {f"reg{suffix}": float(reg.detach()), f"kl{suffix}": float(kl.detach()),
                     f"acc{suffix}": float(hits[0]) / max(1, int((scored & rows).sum()))}
        return loss, logs

    def save(self, module: nn.Module, out_dir: Path, meta: dict[str, Any]) -> None:
        from safetensors.torch import save_file

        assert self.target is not None and self.kept_ids is not None and self.args is not None
        net = module.net  # type: ignore[union-attr]
        tensors = {k: v.detach().to(self.save_dtype).contiguous().cpu() for k, v in net.state_dict().items()
                   if not k.startswith(("embed.", "lm_head."))}
        tensors["kept_ids"] = self.kept_ids.to(torch.int32).cpu()
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": FORMAT})
        config = {
            "format": FORMAT,
            "base_model": self.target.name,
            "base_folder": self.target.folder.name,
            "hidden_size": self.target.hidden_size,
            "vocab_size": self.target.vocab_size,
            "num_layers": self.layers,
            "layout": self.layout,
            "kept_vocab": len(self.kept_ids),
            "fingerprint": fingerprint(self.target),
            "saved_dtype": str(self.save_dtype).removeprefix("torch."),
            "args": asdict(self.args),
            "train": meta,
        }
        (out_dir / CONFIG).write_text(json.dumps(config, indent=2, default=str))


SAVE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def parse_save_dtype(value: str) -> torch.dtype:
    """`head.save_dtype`: the dtype a drafter's weights are written in."""
    if value not in SAVE_DTYPES:
        raise SpecdecError(f"head.save_dtype={value!r}; use fp16, bf16 or fp32")
    return SAVE_DTYPES[value]


def init_fresh(net: nn.Module) -> None:
    """A drafter materialised from the meta device: its linears at their default init, every norm scale at 1."""
    for m in net.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
        elif hasattr(m, "weight") and m.weight.dim() == 1:
            nn.init.ones_(m.weight)


def _final_norm_weight(target: LoadedModel) -> Tensor:
    model = target.model
    norm = model.norm if target.backend == "compact" else model.model.norm
    return norm.weight.detach().float()
