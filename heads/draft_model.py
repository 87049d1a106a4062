"""specdec's own draft model: the target's architecture cut to a few layers, distilled from the target.

Layout: the target's frozen token embedding -> `layers` decoder blocks of the target's width (initialised
from chosen target layers) -> a final norm -> the target's frozen output head restricted to the
`kept_vocab` most frequent tokens of the distillation data. Only the blocks and the norm are trained
and saved. The reduced head matters on CPU: the full SmolLM2 head (49152 x 576) costs a sizeable share
of a target step, 8k rows much less. Proposals are mapped back to target ids (`token_ids`), and
at temperature > 0 the draft distribution is zero outside the kept rows, so speculative sampling stays
exact (a token the draft cannot propose simply has q = 0).

Saved as OUT/model.safetensors (decoder weights under Hugging Face names, plus `kept_ids`) and
OUT/config.json (base model, hidden and vocabulary size, layers, a fingerprint of the base model's
embedding, the draft's Hugging Face config, training metadata). The Hugging Face naming lets one file
serve both our compact model (strategy=draft) and a transformers model (strategy=hf_assisted).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.head_loss import head_loss
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.llama import Llama, LlamaArgs
from specdec.models.loader import LoadedModel

FORMAT = "specdec-draft/1"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
REPO = Path(__file__).resolve().parent.parent
FINGERPRINT_ROWS = 64


# --------------------------------------------------------------------------------------------------
# The target's tensors the draft reuses
# --------------------------------------------------------------------------------------------------


def _linear_weight(module: nn.Module) -> Tensor:
    """(out, in) weight of an nn.Linear or of the CPU NumpyLinear / NumbaLinear that may replace it."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        raise TypeError(f"cannot read the weight of {type(module).__name__}")
    return weight


def target_embedding(target: LoadedModel) -> Tensor:
    """(V, D) input embedding of the target, shared (no copy)."""
    if target.backend == "compact":
        return target.model.embed.weight
    return target.model.get_input_embeddings().weight


def target_head(target: LoadedModel) -> Tensor:
    """(V, D) output head of the target, shared (no copy)."""
    if target.backend == "compact":
        return _linear_weight(target.model.lm_head)
    return target.model.get_output_embeddings().weight


def fingerprint(target: LoadedModel) -> list[int]:
    """Which dimension dominates each of a few embedding rows: identifies the weights across dtypes."""
    emb = target_embedding(target)
    rows = torch.linspace(0, emb.shape[0] - 1, FINGERPRINT_ROWS, device=emb.device).long()
    return [int(i) for i in emb.detach()[rows].float().abs().argmax(-1).tolist()]


def check_drafter_meta(meta: dict[str, Any], target: LoadedModel, what: str, fix: str) -> None:
    """One-line SpecdecError unless `meta` (a saved drafter's config) names target's sizes and embedding."""
    base = meta.get("base_model", "?")
    if int(meta["hidden_size"]) != target.hidden_size or int(meta["vocab_size"]) != target.vocab_size:
        raise SpecdecError(f"{what} was trained for {base} (hidden {meta['hidden_size']}, vocab {meta['vocab_size']}), "
                           f"not {target.name} (hidden {target.hidden_size}, vocab {target.vocab_size}); {fix}")
    mine, theirs = fingerprint(target), meta.get("fingerprint") or []
    agree = sum(a == b for a, b in zip(mine, theirs)) / max(1, len(mine))
    if len(theirs) != len(mine) or agree < 0.9:
        raise SpecdecError(f"{what} was trained for {base}, whose embedding differs from {target.name}'s; {fix}")


def target_hf_config(target: LoadedModel) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(target.folder, trust_remote_code=target.trust_remote_code)


def draft_hf_config(target: LoadedModel, layers: int, source_layers: list[int]) -> Any:
    """The target's config cut to `layers` decoder layers, with an untied (reduced) head."""
    cfg = target_hf_config(target)
    cfg.num_hidden_layers = layers
    cfg.tie_word_embeddings = False
    per_layer = getattr(cfg, "layer_types", None)
    if per_layer:  # sliding/full attention per layer: keep the kinds of the layers we start from
        cfg.layer_types = [per_layer[i] for i in source_layers] if source_layers else list(per_layer[:layers])
    if getattr(cfg, "max_window_layers", None) is not None:
        cfg.max_window_layers = min(cfg.max_window_layers, layers)
    return cfg


# --------------------------------------------------------------------------------------------------
# Inference: the compact draft (strategy=draft) and its transformers wrapper (strategy=hf_assisted)
# --------------------------------------------------------------------------------------------------


class DraftModel(Llama):
    """Our compact Llama with a reduced output head: logits (B, T, K) over `token_ids` (K,)."""

    def __init__(self, args: LlamaArgs, kept: int) -> None:
        super().__init__(args)
        self.lm_head = nn.Linear(args.dim, kept, bias=False)
        self.token_ids: Tensor | None = None
        self._hf_factory: Any = None
        self._hf: Any = None

    def hf_model(self) -> Any:
        """The same draft as a transformers model (built on first use)."""
        if self._hf is None:
            self._hf = self._hf_factory()
        return self._hf


class KeptVocabHead(nn.Module):
    """A transformers lm_head that scores only the kept rows: -inf elsewhere, so the draft never
    proposes what it was not trained to predict (and its q is zero there)."""

    def __init__(self, weight: Tensor, kept_ids: Tensor, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (K, D)
        self.register_buffer("kept_ids", kept_ids, persistent=False)
        self.vocab_size = vocab_size

    def forward(self, h: Tensor) -> Tensor:
        small = F.linear(h, self.weight)  # (..., K)
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy(-1, self.kept_ids, small)


def _hf_draft(hf_config: Any, layers: dict[str, Tensor], embed: Tensor, head: Tensor, kept_ids: Tensor,
              dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.lm_head = KeptVocabHead(head, kept_ids, embed.shape[0])
    model.get_input_embeddings().weight = nn.Parameter(embed, requires_grad=False)  # shared with the target
    missing, unexpected = model.load_state_dict(layers, strict=False)
    missing = [k for k in missing if not k.startswith(("lm_head.", "model.embed_tokens."))]
    if missing or unexpected:
        raise SpecdecError(f"draft weights do not fit a {hf_config.model_type} of {hf_config.num_hidden_layers} layers "
                           f"(missing {missing[:2]}, unexpected {unexpected[:2]}); retrain the draft")
    return model.eval().requires_grad_(False)


@dataclass
class SavedDrafter:
    """A drafter `python -m heads.train head=HEAD` saved (weights and a JSON config); `bind(target)` checks
    that it was trained for `target` (a one-line SpecdecError otherwise) and builds it once per target."""

    folder: Path
    meta: dict[str, Any]
    # fp32, bf16 or int8: with the CPU kernels (model.matmul=numba), the drafter's matrices rounded to
    # bfloat16 (half the bytes to stream) or int8 with a scale per output (a quarter). Lossless either
    # way: the target checks every guess.
    weights: str = "fp32"
    # rows the drafter scores (None: the kept rows it was trained on). Its head is the target's own frozen
    # rows, so more rows need no retraining: the kept ones, then the lowest other target ids (a BPE
    # vocabulary's ids follow its merge order, roughly frequency). Proposals only; lossless either way.
    rows: int | None = None
    _bound: dict[int, Any] = field(default_factory=dict, repr=False)
    HEAD: ClassVar[str] = ""  # the configs/head/ entry that trains it
    WHAT: ClassVar[str] = ""  # how errors name it

    def check(self, target: LoadedModel) -> None:
        check_drafter_meta(self.meta, target, f"the {self.WHAT} in {self.folder}",
                           f"train one with `python -m heads.train head={self.HEAD} model={target.name}` (see README)")

    def bind(self, target: LoadedModel) -> Any:
        key = id(target)
        if key not in self._bound:
            self.check(target)
            self._bound[key] = self.build(target)
        return self._bound[key]

    def build(self, target: LoadedModel) -> Any:
        raise NotImplementedError

    def saved_tensors(self, target: LoadedModel, weights: str) -> tuple[Tensor, dict[str, Tensor]]:
        """The kept rows' target ids (K,) and the other saved tensors, on the target's device and dtype."""
        from safetensors.torch import load_file

        tensors = load_file(str(self.folder / weights))
        kept_ids = widen_rows(tensors.pop("kept_ids").long(), self.rows, target.vocab_size).to(target.device)
        return kept_ids, {k: v.to(device=target.device, dtype=target.dtype) for k, v in tensors.items()}

    def ready(self, net: nn.Module, kept_ids: Tensor, target: LoadedModel) -> None:
        """Frozen, its rows mapped to target ids, and running its matmuls the way the target does."""
        net.eval().requires_grad_(False)
        net.token_ids = kept_ids
        if target.matmul != "torch":
            from specdec.models.cpu_linear import use_matmul

            use_matmul(net, target.matmul, self.weights)  # the target's CPU kernels (see cpu_linear.py)

    @classmethod
    def load(cls, path: str | Path, config_file: str, weights_file: str, fmt: str, alternative: str = "",
             weights: str = "fp32", rows: int | None = None) -> Any:
        """The drafter saved in `path` (relative: the working directory, then the repository) as
        `config_file` and `weights_file`; `weights`: the CPU kernels' copy, fp32, bf16 or int8 (the field above)."""
        if weights not in cpu_kernels.KINDS:
            raise SpecdecError(f"the {cls.WHAT}'s weights={weights!r} is not {', '.join(cpu_kernels.KINDS)}; "
                               "e.g. strategy.draft.weights=int8")
        folder = resolve_path(path)
        if not (folder / config_file).is_file() or not (folder / weights_file).is_file():
            model = folder.name.removesuffix(f"-{cls.HEAD}") or "MODEL"
            raise SpecdecError(f"no trained {cls.WHAT} in {folder}; run `python -m heads.train head={cls.HEAD} "
                               f"model={model}` first{alternative}")
        meta = json.loads((folder / config_file).read_text())
        if meta.get("format") != fmt:
            raise SpecdecError(f"{folder / config_file} is not a specdec {cls.WHAT} ({fmt}); retrain it with "
                               f"python -m heads.train head={cls.HEAD}")
        return cls(folder, meta, weights, rows)


def widen_rows(kept_ids: Tensor, rows: int | None, vocab: int) -> Tensor:
    """(rows,) target ids: the trained `kept_ids` (K,) first, then the lowest ids not among them; rows=None
    or K: kept_ids as saved; rows past the vocabulary: all of it."""
    if rows is None or rows == len(kept_ids):
        return kept_ids
    if rows < len(kept_ids):
        raise SpecdecError(f"rows={rows} is below the {len(kept_ids)} rows this drafter was trained on; give null "
                           f"(its own rows) or at least {len(kept_ids)}")
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[kept_ids] = False
    return torch.cat([kept_ids, rest.nonzero()[:, 0][:rows - len(kept_ids)]])


class DraftCheckpoint(SavedDrafter):
    """A saved draft (what configs/strategy/draft.yaml builds)."""

    HEAD = "draft"
    WHAT = "draft"

    def build(self, target: LoadedModel) -> DraftModel:
        kept_ids, layers = self.saved_tensors(target, WEIGHTS)
        hf_config = _config_from_dict(self.meta["hf_config"])
        embed, head = target_embedding(target), target_head(target)
        small_head = head.detach()[kept_ids].to(target.dtype).contiguous()  # (K, D)
        args = LlamaArgs.from_hf(hf_config)
        with torch.device("meta"):
            net = DraftModel(args, len(kept_ids))
        net.load_hf_state_dict(layers | {"model.embed_tokens.weight": embed.detach(), "lm_head.weight": small_head})
        self.ready(net, kept_ids, target)
        net._hf_factory = lambda: _hf_draft(hf_config, layers, embed.detach(), small_head, kept_ids,
                                            target.dtype, target.device)
        return net


def _config_from_dict(d: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    d = dict(d)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def resolve_path(path: str | Path) -> Path:
    """A relative path is looked up from the working directory, then from the repository root."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    return REPO / p


def load_draft(path: str, weights: str = "fp32", rows: int | None = None) -> DraftCheckpoint:
    """Entry point of the strategy configs: the trained draft in `path` (heads/checkpoints/MODEL-draft),
    its matrices run in fp32, bf16 or int8 by the CPU kernels (`weights`), scoring `rows` target rows
    (SavedDrafter.rows; None: the kept rows it was trained on)."""
    return DraftCheckpoint.load(path, CONFIG, WEIGHTS, FORMAT, ", or use strategy=draft_lm with a draft model",
                                weights=weights, rows=rows)


# --------------------------------------------------------------------------------------------------
# Training (heads.train's Trainable)
# --------------------------------------------------------------------------------------------------


class DraftTrainModule(nn.Module):
    """The trainable draft: transformers decoder layers on the frozen embedding; the frozen reduced head
    is the trainable's (`DraftTrainable.head`), applied by the loss."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body  # a transformers base model (LlamaModel, Qwen2Model...) with `layers` layers

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, T, D) final-norm states; the loss applies the head (heads/head_loss.py)."""
        return self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def pick_vocab(data: Any, vocab_size: int, kept: int, always: list[int]) -> Tensor:
    """The `kept` ids the draft may propose, sorted: `always` (end-of-turn ids), then continuation
    tokens by frequency, then prompt tokens by frequency, then the lowest ids (BPE merges come
    roughly in frequency order)."""
    if kept <= 0 or kept >= vocab_size:
        return torch.arange(vocab_size)
    label_counts = torch.zeros(vocab_size, dtype=torch.long)
    input_counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in data:
        labels = torch.tensor(row["labels"])
        label_counts += torch.bincount(labels[labels >= 0], minlength=vocab_size)[:vocab_size]
        input_counts += torch.bincount(torch.tensor(row["input_ids"]), minlength=vocab_size)[:vocab_size]
    order = torch.arange(vocab_size)
    for key in (input_counts, label_counts):  # stable sorts, least significant key first
        order = order[torch.sort(-key[order], stable=True).indices]
    forced = [i for i in dict.fromkeys(always) if 0 <= i < vocab_size]
    taken = set(forced)
    ids = forced + [i for i in order.tolist() if i not in taken][:kept - len(forced)]
    return torch.tensor(sorted(ids))


def vocab_maps(data: Any, target: LoadedModel, kept: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """pick_vocab's (K,) target ids of the drafter's rows and the (V,) map back (target id -> row, -1 if not
    kept), both on `device`, where the loss meets them (saved from a host copy)."""
    kept_ids = pick_vocab(data, target.vocab_size, kept, list(target.eos_ids)).to(device)
    return kept_ids, row_map(kept_ids, target.vocab_size)


def row_map(kept_ids: Tensor, vocab: int) -> Tensor:
    """(vocab,) target id -> its row among kept_ids (K,), -1 where not kept; on kept_ids' device."""
    to_kept = torch.full((vocab,), -1, dtype=torch.long, device=kept_ids.device)
    to_kept[kept_ids] = torch.arange(len(kept_ids), device=kept_ids.device)
    return to_kept


def drafter_rows(start: dict[str, Tensor] | None, data: Any, target: LoadedModel, kept: int,
                 device: torch.device) -> tuple[Tensor, Tensor]:
    """vocab_maps' rows for fresh weights; a saved start's own `kept_ids` (popped from `start`) otherwise,
    since its layers learnt to score exactly those."""
    if start is None:
        return vocab_maps(data, target, kept, device)
    kept_ids = start.pop("kept_ids").long().to(device)
    return kept_ids, row_map(kept_ids, target.vocab_size)


def start_minutes(saved_meta: dict[str, Any]) -> float | None:
    """Training minutes behind a saved drafter that a fine-tune starts from (None: unknown): a start trained
    from fresh weights counts its own minutes; a fine-tuned one carries its total forward."""
    trained = saved_meta.get("train") or {}
    fresh = not (trained.get("config") or {}).get("head", {}).get("init_from")
    return trained.get("minutes_in_all", trained.get("minutes") if fresh else None)


class DraftTrainable:
    """heads.train's Trainable for the distilled draft (configs/head/draft.yaml)."""

    def __init__(self, name: str = "draft", layers: int = 2, init_layers: list[int] | None = None,
                 kept_vocab: int = 8192, kl_weight: float = 0.0, kl_positions: str = "continuation",
                 save_dtype: str = "fp16", init_from: str | None = None) -> None:
        if layers < 1:
            raise SpecdecError(f"head.layers={layers} must be at least 1")
        if init_layers is not None and len(init_layers) not in (0, layers):
            raise SpecdecError(f"head.init_layers={list(init_layers)} must name {layers} target layers (or be null)")
        if kl_positions not in ("continuation", "all"):
            raise SpecdecError(f"head.kl_positions={kl_positions!r}; use continuation or all")
        if save_dtype not in ("fp16", "bf16", "fp32"):
            raise SpecdecError(f"head.save_dtype={save_dtype!r}; use fp16, bf16 or fp32")
        self.name = name
        self.layers = layers
        self.init_layers = list(init_layers or [])
        self.kept_vocab = kept_vocab
        self.kl_weight = kl_weight
        self.kl_positions = kl_positions
        self.needs_hidden = kl_weight > 0
        self.save_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[save_dtype]
        self.kept_ids: Tensor | None = None
        self.to_kept: Tensor | None = None  # (V,) target id -> kept row, -1 if not kept
        self.target: LoadedModel | None = None
        self.source_layers: list[int] = []
        self.hf_config: Any = None
        self.head: Tensor | None = None  # (K, D) the target's head rows of the kept ids
        self.init_from = init_from
        self.start_minutes: float | None = None  # training minutes behind init_from's draft (None: unknown)

    def build(self, target: LoadedModel, data: Any) -> nn.Module:
        from transformers import AutoModel

        n_target = target_hf_config(target).num_hidden_layers
        source = [i % n_target for i in self.init_layers]
        self.target, self.source_layers = target, source
        self.hf_config = draft_hf_config(target, self.layers, source)
        embed = target_embedding(target).detach().float()
        start = self._saved_start(target) if self.init_from else None
        self.kept_ids, self.to_kept = drafter_rows(start, data, target, self.kept_vocab, embed.device)
        torch.manual_seed(0)
        body = AutoModel.from_config(self.hf_config, dtype=torch.float32)
        body.embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
        if start is not None:  # init_from wins over init_layers: its layers are where training starts
            missing, unexpected = body.load_state_dict(start, strict=False)
            if unexpected or any(k != "embed_tokens.weight" for k in missing):
                raise SpecdecError(f"head.init_from={self.init_from} does not fit this draft (missing {missing[:2]}, "
                                   f"unexpected {unexpected[:2]}); retrain it with this version of heads.train")
        elif source:
            missing, unexpected = body.load_state_dict(_target_layers(target, source), strict=False)
            if unexpected or any(k != "embed_tokens.weight" for k in missing):
                raise SpecdecError(f"target layers {source} do not fit the draft (missing {missing[:2]}, unexpected "
                                   f"{unexpected[:2]}); set head.init_layers=null to start from random weights")
        self.head = target_head(target).detach().float()[self.kept_ids].clone()  # (K, D)
        return DraftTrainModule(body)

    def _saved_start(self, target: LoadedModel) -> dict[str, Tensor]:
        """head.init_from's layers (fp32, transformers names without `model.`) and `kept_ids`, checked."""
        from safetensors.torch import load_file

        saved = load_draft(str(self.init_from))
        saved.check(target)
        if saved.meta.get("num_layers") != self.layers:
            raise SpecdecError(f"head.init_from={self.init_from} holds a {saved.meta.get('num_layers')}-layer draft, "
                               f"not head.layers={self.layers}; set head.layers to match it")
        self.start_minutes = start_minutes(saved.meta)
        tensors = load_file(str(saved.folder / WEIGHTS))
        return {k.removeprefix("model."): v if k == "kept_ids" else v.float() for k, v in tensors.items()}

    def loss(self, module: nn.Module, batch: dict[str, Tensor],
             target_hidden: Tensor | None) -> tuple[Tensor, dict[str, float]]:
        assert self.to_kept is not None and self.kept_ids is not None
        h = module(batch["input_ids"], batch["attention_mask"])  # (B, T, D)
        labels = batch["labels"]
        valid = labels >= 0
        small = self.to_kept.to(labels.device)[labels.clamp_min(0)]
        scored = valid & (small >= 0)  # tokens outside the kept rows are unlearnable
        if not scored.any():  # nothing learnable in this batch (prompts only): a zero that keeps the graph
            return h.sum() * 0.0, {"ce": 0.0, "acc": 0.0, "coverage": 0.0}
        use_kl = self.kl_weight > 0 and target_hidden is not None
        # "all": the target's distribution is known at every prompt position too, which multiplies the
        # distillation signal several times over for the same generated data
        at = scored if self.kl_positions == "continuation" else batch["attention_mask"].bool()
        assert self.head is not None
        if self.head.device != h.device:  # once: follow the states onto the device accelerate chose
            self.head = self.head.to(h.device)
        ce, kl, correct = head_loss(h.flatten(0, 1), self.head, small.flatten(),
                                    target_hidden.flatten(0, 1).to(h.device) if use_kl else None,
                                    scored.flatten(), at.flatten())
        loss = ce + self.kl_weight * kl if use_kl else ce
        logs = {"ce": float(ce.detach())} | ({"kl": float(kl.detach())} if use_kl else {})
        logs["acc"] = float(correct[0] / scored.sum())
        logs["coverage"] = float(scored.sum() / valid.sum().clamp_min(1))
        return loss, logs

    def save(self, module: nn.Module, out_dir: Path, meta: dict[str, Any]) -> None:
        from safetensors.torch import save_file

        assert self.target is not None and self.kept_ids is not None
        body = module.body  # type: ignore[union-attr]
        tensors = {f"model.{k}": v.detach().to(self.save_dtype).contiguous().cpu()
                   for k, v in body.state_dict().items() if not k.startswith("embed_tokens.")}
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
            "init_layers": self.source_layers,
            "kept_vocab": len(self.kept_ids),
            "fingerprint": fingerprint(self.target),
            "saved_dtype": str(self.save_dtype).removeprefix("torch."),
            "hf_config": self.hf_config.to_dict(),
            "train": meta,
        }
        (out_dir / CONFIG).write_text(json.dumps(config, indent=2, default=str))


def _target_layers(target: LoadedModel, source: list[int]) -> dict[str, Tensor]:
    """The target's decoder layers `source` renumbered 0.., plus its final norm, in transformers names."""
    from safetensors import safe_open

    wanted = {f"model.layers.{s}.": f"layers.{d}." for d, s in enumerate(source)}
    out: dict[str, Tensor] = {}
    for shard in sorted(target.folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no iterator)
                if key == "model.norm.weight":
                    out["norm.weight"] = f.get_tensor(key).float()
                for src, dst in wanted.items():
                    if key.startswith(src):
                        out[dst + key[len(src):]] = f.get_tensor(key).float()
    if not any(k.startswith("layers.") for k in out):
        raise SpecdecError(f"found no decoder layers named model.layers.N.* in {target.folder}; set "
                           "head.init_layers=null to start the draft from random weights")
    return out
