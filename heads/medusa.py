"""Medusa heads (Cai et al. 2024): K small heads on the target's last hidden state.

Head k (counting from 0) reads the final-norm hidden state of token t and guesses token t + k + 2;
the target's own output head already predicts t + 1. Each head is a stack of residual blocks
x + SiLU(W x + b) followed by an output projection: the target's frozen output head ("shared", the
cheap default: all K heads go through one matmul) or a trainable copy per head ("own").

With `root_input` the first block of each head also reads token t + 1 itself, the root of the next
tree, which is known when the heads run (the target just chose it):
x + SiLU(W x + U e(t + 1) + b), e being that token's row of the target's frozen output head. Plain
Medusa-1 heads must guess t + k + 2 without knowing which t + 1 the target picked, and hedge when
several were likely; conditioning on it is the first step of Hydra's sequentially dependent heads
(Ankner et al. 2024), at the price of one more dim x dim product per head. Off by default, as in
Medusa-1; `U` starts at zero, so such heads start as plain ones. `sequential` heads go the rest of the
way: each head also continues the previous one along the tree path (heads/medusa_sequential.py).

On a CPU a full-vocabulary projection costs as much as a good part of a target step, so a head may
keep only the N most frequent tokens of the distillation data (`kept_ids`); its top-k ids are
mapped back to the full vocabulary.

Files: `medusa.safetensors` (block weights, own projections, kept ids) and `medusa.json`
(`MedusaConfig` plus training metadata).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.loader import LoadedModel, check_trained_for

WEIGHTS_FILE = "medusa.safetensors"
CONFIG_FILE = "medusa.json"
PROJECTIONS = ("shared", "own")
Roots = int | Sequence[int] | Tensor | None  # the root token of one state, or one per state of a batch


@dataclass(frozen=True)
class MedusaConfig:
    base_model: str  # the target's name (model config alias)
    base_fingerprint: str  # sign pattern of the target's output head: tells same-shaped models apart
    hidden_size: int
    vocab_size: int  # the target's full vocabulary
    num_heads: int = 4  # K
    num_layers: int = 1  # residual blocks per head
    projection: str = "shared"  # "shared": the target's frozen output head; "own": one trainable copy per head
    head_vocab: int | None = None  # kept vocabulary size; None = the full vocabulary
    root_input: bool = False  # first blocks also read the tree's root token (see the module docstring)
    sequential: bool = False  # head k > 0 reads head k - 1's features and the path's token (heads/medusa_sequential.py)
    chain_head0: bool = False  # sequential: head 1 starts from the state (False) or continues head 0's features

    def __post_init__(self) -> None:
        if self.projection not in PROJECTIONS:
            raise SpecdecError(f"unknown Medusa projection {self.projection!r}; use shared or own")
        if self.num_heads < 1 or self.num_layers < 0:
            raise SpecdecError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got {self.num_heads} "
                               f"and {self.num_layers}")
        if self.root_input and self.num_layers < 1:
            raise SpecdecError("Medusa root_input feeds the root token into each head's first block; "
                               "it needs num_layers >= 1")
        if self.sequential and not self.root_input:
            raise SpecdecError("sequential Medusa heads chain from the root token; set root_input=true as well")


def head_weight(target: LoadedModel) -> Tensor:
    """(V, dim) weight of the target's output head as the target holds it (its device and dtype, no copy),
    whichever linear implementation holds it."""
    model = target.model
    head = model.lm_head if target.backend == "compact" else model.get_output_embeddings()
    weight = getattr(head, "weight", None)  # nn.Linear, or the CPU NumpyLinear / NumbaLinear replacing it
    if isinstance(weight, Tensor):
        return weight.detach()
    raise SpecdecError(f"cannot read the output head of {target.name} ({type(head).__name__}); "
                       "use a Llama-family model on model.backend=compact")


def output_weight(target: LoadedModel) -> Tensor:
    """(V, dim) float32 weight of the target's output head, on the target's device."""
    return head_weight(target).float()


def fingerprint(weight: Tensor) -> str:
    # Signs survive fp32 -> bf16/fp16 casts, so heads trained on one dtype load on another.
    block = weight[:16, :16].float() > 0
    return hashlib.sha256(bytes(block.flatten().tolist())).hexdigest()[:16]


def kept_vocab(token_ids: Iterable[int], n: int, vocab_size: int) -> Tensor:
    """The n most frequent ids (ties: smaller id first), padded with unseen ids in order, sorted."""
    counts = Counter(int(t) for t in token_ids)
    order = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    if len(order) < n:
        seen = set(order)
        order += [t for t in range(vocab_size) if t not in seen][:n - len(order)]
    return torch.tensor(sorted(order), dtype=torch.long)


class ResBlock(nn.Module):
    def __init__(self, dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim, device=device)
        # Zero init makes a fresh block the identity, so every head starts as the target's own head.
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor, extra: Tensor | None = None) -> Tensor:
        y = self.linear(x)
        return x + F.silu(y if extra is None else y + extra)


class MedusaHeads(nn.Module):
    """K heads; `forward` gives all heads' logits over the kept vocabulary in one projection.

    Built in float32 on `base_weight`'s device (the target's: training runs there), every tensor there;
    `_for_inference` gives them the target's dtype too.
    """

    def __init__(self, cfg: MedusaConfig, base_weight: Tensor, kept_ids: Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        V, dim = base_weight.shape
        if (V, dim) != (cfg.vocab_size, cfg.hidden_size):
            raise SpecdecError(f"output head of shape {(V, dim)} does not match the Medusa config "
                               f"(vocab {cfg.vocab_size}, hidden {cfg.hidden_size})")
        if kept_ids is not None and (kept_ids.ndim != 1 or len(kept_ids) != cfg.head_vocab):
            raise ValueError(f"kept_ids must be ({cfg.head_vocab},), got {tuple(kept_ids.shape)}")
        dev = base_weight.device
        # Distinct blocks per head and per layer: never one module repeated.
        self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(dim, dev) for _ in range(cfg.num_layers)))
                                    for _ in range(cfg.num_heads))
        kept = kept_ids.to(dev) if kept_ids is not None else torch.arange(V, device=dev)
        self.register_buffer("kept_ids", kept.long().clone())
        # full id -> row of the kept vocabulary, -100 (cross-entropy's ignore index) when dropped
        to_head = torch.full((V,), -100, dtype=torch.long, device=dev)
        to_head[self.kept_ids] = torch.arange(len(kept), device=dev)
        self.register_buffer("to_head", to_head, persistent=False)
        self.root_in: nn.Parameter | None = None
        if cfg.root_input:
            # (K, dim, dim): U of each head
            self.root_in = nn.Parameter(torch.zeros(cfg.num_heads, dim, dim, device=dev))
            # (V, dim) frozen rows that stand for the root token, over the full vocabulary
            self.register_buffer("root_rows", base_weight.detach().float(), persistent=False)  # no copy in fp32
        w = base_weight.detach().float()[self.kept_ids].contiguous()  # (V', dim)
        if cfg.projection == "own":
            self.proj = nn.Parameter(w[None].repeat(cfg.num_heads, 1, 1))  # (K, V', dim)
        else:
            self.register_buffer("proj", w, persistent=False)  # (V', dim), frozen, not saved
        self.proj_panels: np.ndarray | None = None  # set by `use_cpu_kernels`: the shared projection
        self.own_panels: list[np.ndarray] | None = None  # set by `use_cpu_kernels`: each head's own projection
        self.block_panels: list[tuple[np.ndarray, np.ndarray]] | None = None  # per layer: (panels, biases (K, dim))
        self.compiled: Callable[..., Any] | None = None  # set by `compile_steps`

    def compile_steps(self) -> None:
        """`model.compile`: the inference step as a static-shape graph, as the target's
        (specdec/engine/static_step.py). Every head runs whatever the depth asked (the rows are sliced
        after), the root enters as a device tensor (a host int would be a constant: one graph per token),
        and `width` is a constant, so a strategy replays one graph (CUDA graphs on a GPU)."""
        from specdec.engine.static_step import allow_many_graphs, compile_mode

        allow_many_graphs()

        self.compiled = torch.compile(self._top_all, mode=compile_mode(self.proj.device), fullgraph=True,
                                      dynamic=False)

    def _top_all(self, hidden: Tensor, root: Tensor | None, width: int) -> tuple[Tensor, Tensor]:
        """(dim,) state, (1,) root id -> (K, width) ids in the full vocabulary, (K, width) float32 log-probs.
        A batch of one: indexing with a 0-d tensor would be a data-dependent int to the compiler."""
        logits = self.forward(hidden[None], root)[0].float()  # (K, V')
        top = logits.topk(width, dim=-1)
        return self.kept_ids[top.indices], top.values - torch.logsumexp(logits, dim=-1, keepdim=True)

    def _compiled_top(self, hidden: Tensor, width: int, depth: int | None,
                      root: int | None) -> tuple[Tensor, Tensor]:
        assert self.compiled is not None
        d = self.num_heads if depth is None else depth
        # heads that ignore the root get None always: a tensor on one call and None on another would be two graphs
        root_t = torch.tensor([root], device=self.proj.device) if self.reads_root and root is not None else None
        ids, logp = self.compiled(hidden, root_t, width)
        return ids[:d].clone(), logp[:d].clone()  # a CUDA graph's outputs are overwritten by its next replay

    def use_cpu_kernels(self, weights: str = "fp32", block_weights: str = "fp32") -> None:
        """Run the heads at inference through specdec's few-row CPU kernels, as the target does: the
        residual blocks from a `block_weights` copy, and the projection (shared, or each head's own) from
        a `weights` copy (fp32, bf16 or int8; cpu_kernels.pack).

        Why: torch runs single-threaded beside those kernels (see `LoadedModel.torch_threads`). Right
        after a target pass has pushed the heads out of cache, a step with the kernels (every head's first
        block in one call) was cheaper than one with torch's per-head block products
        (experiments/medusa_step_times.py; experiments/README.md, "Medusa: retrained heads, a KL term, the
        heads on the CPU kernels"). The blocks stay float32, so the candidates are the ones torch
        gives; an int8 copy of the blocks would save a little more but changes some second choices. The
        projection's copy may be rounded: the heads only propose, the target verifies.
        """
        for key, kind in (("weights", weights), ("block_weights", block_weights)):
            if kind not in cpu_kernels.KINDS:
                raise SpecdecError(f"strategy.heads.{key}={kind!r} is not one of {', '.join(cpu_kernels.KINDS)}")
        if self.proj.device.type != "cpu" or not cpu_kernels.available():
            return
        if self.proj.ndim == 2:
            self.proj_panels = cpu_kernels.pack(self.proj.contiguous().numpy(), kind=weights)
        elif not self.cfg.sequential:  # (sequential heads read the shared projection only)
            self.own_panels = [cpu_kernels.pack(w.float().contiguous().numpy(), kind=weights) for w in self.proj]
        self._pack_blocks(block_weights)

    def _pack_blocks(self, block_weights: str) -> None:
        """Every head's blocks, layer by layer, so that all heads' first blocks are one product."""
        layers = []
        for layer in range(self.cfg.num_layers):
            linears = [blocks[layer].linear for blocks in self.blocks]
            mats = [lin.weight.detach().float() for lin in linears]  # (dim, dim) each
            if layer == 0 and self.root_in is not None:  # [W | U] reads [x, e(root)] in one product
                mats = [torch.cat([m, u.detach().float()], dim=1) for m, u in zip(mats, self.root_in)]
            # each head's panels in turn: head h owns panels h * P .. (h + 1) * P - 1
            panels = np.concatenate([cpu_kernels.pack(m.numpy(), kind=block_weights) for m in mats])
            layers.append((panels, torch.stack([lin.bias.detach().float() for lin in linears]).numpy()))
        self.block_panels = layers

    def _cpu_features(self, hidden: Tensor, depth: int, root: Roots = None) -> np.ndarray:
        """(dim,) or (S, dim) states -> (depth, dim) or (S, depth, dim): the first `depth` heads' residual
        stacks on the CPU kernels; `root`: one id, or one per row. Every head reads the same state, so their
        first blocks are one product over the S rows; the kernels compute each row on its own, so a row's
        features are bitwise those of a call with that row alone."""
        assert self.block_panels is not None
        dim = self.cfg.hidden_size
        h = hidden.detach().float().reshape(-1, dim).numpy()  # (S, dim)
        S = len(h)
        x = np.repeat(h[:, None], depth, axis=1)  # (S, depth, dim)
        for layer, (panels, bias) in enumerate(self.block_panels):
            per_head = len(panels) // self.num_heads
            width = per_head * panels.shape[2]
            if layer == 0:
                rows = h  # (S, dim), or (S, 2 dim) with each row's root beside it
                if self.root_in is not None:
                    e = self._root_row(root).numpy()
                    rows = np.concatenate([rows, np.broadcast_to(e, (S, e.shape[-1]))], axis=1)
                y = cpu_kernels.matmul(rows, panels[:depth * per_head], depth * width).reshape(S, depth, width)
            else:
                y = np.stack([cpu_kernels.matmul(x[:, k], panels[k * per_head:(k + 1) * per_head], width)
                              for k in range(depth)], axis=1)
            y = y[..., :dim] + bias[:depth]
            with np.errstate(over="ignore"):  # exp overflow for very negative inputs: SiLU is then -0
                x = x + y / (np.float32(1.0) + np.exp(-y))
        return x if hidden.ndim > 1 else x[0]

    @property
    def num_heads(self) -> int:
        return self.cfg.num_heads

    def _root_row(self, root: int | Tensor | None) -> Tensor:
        assert self.root_in is not None
        if root is None:
            raise ValueError("these Medusa heads read the root token (root_input); pass root")
        return self.root_rows[root]

    def features(self, hidden: Tensor, root: Tensor | int | None = None, depth: int | None = None,
                 path: Tensor | None = None) -> Tensor:
        """(..., dim) states, (...,) root ids (or one id) when the heads read them -> (..., d, dim): the first
        d heads' residual stacks (all K by default). `path` is ignored: these heads guess independently."""
        d = self.num_heads if depth is None else depth
        extra = None
        if self.root_in is not None:
            e = self._root_row(root).to(hidden.dtype)  # (..., dim)
            extra = torch.einsum("...i,koi->...ko", e, self.root_in[:d].to(hidden.dtype))  # (..., d, dim)
        outs = []
        for k, blocks in enumerate(self.blocks[:d]):
            x = hidden
            for i, block in enumerate(blocks):
                x = block(x, extra[..., k, :] if extra is not None and i == 0 else None)
            outs.append(x)
        return torch.stack(outs, dim=-2)

    @property
    def reads_root(self) -> bool:
        return self.root_in is not None

    def teacher_features(self, hidden: Tensor, input_ids: Tensor) -> Tensor:
        """Training: (B, T, dim) states of a known sequence (B, T) of ids (-1 for padding) -> (B, T, K, dim),
        each position's tree rooted at the sequence's own next token."""
        root = None
        if self.reads_root:  # the root of position t's tree is token t + 1
            root = torch.cat([input_ids[:, 1:], input_ids.new_zeros(input_ids.shape[0], 1)], 1).clamp_min(0)
        return self.features(hidden, root)

    def head_logits(self, x: Tensor, k: int) -> Tensor:
        """(..., dim) features of head k -> (..., V') logits: one head at a time keeps training memory low."""
        w = self.proj[k] if self.proj.ndim == 3 else self.proj
        return x @ w.t()

    def forward(self, hidden: Tensor, root: Tensor | None = None, path: Tensor | None = None) -> Tensor:
        """(..., dim) states (any float dtype: run in the heads') -> (..., K, V') logits. `path` (..., K - 1):
        the tokens after the root, which only sequential heads read (heads/medusa_sequential.py)."""
        x = self.features(hidden.to(self.proj.dtype), root, path=path)  # (..., K, dim)
        if self.proj.ndim == 3:
            return torch.einsum("...kd,kvd->...kv", x, self.proj)  # (..., K, V')
        return x @ self.proj.t()  # (..., K, V'): every head in one matmul

    def _step_logits(self, hidden: Tensor, depth: int | None, root: Roots = None) -> Tensor:
        """(S, dim) states, `root` one id or (S,) ids -> (S, d, V') logits of the first d heads (all K by
        default): every row's heads in one pass, so the projection is streamed once for all S rows."""
        d = self.num_heads if depth is None else depth
        S = hidden.shape[0]
        if self.block_panels is not None:
            x = torch.from_numpy(self._cpu_features(hidden, d, root))  # (S, d, dim)
        else:  # in the heads' dtype, one root as a plain index: nothing made on the host
            x = self.features(hidden.to(self.proj.dtype), root, d)  # (S, d, dim)
        if self.own_panels is not None:  # head k's rows through its own panels
            V = self.proj.shape[1]
            xs = x.float().numpy()
            return torch.from_numpy(np.stack([cpu_kernels.matmul(xs[:, k], self.own_panels[k], V)
                                              for k in range(d)], axis=1))  # (S, d, V')
        if self.proj.ndim == 3:
            return torch.bmm(self.proj[:d], x.permute(1, 2, 0)).permute(2, 0, 1)  # (S, d, V')
        rows = x.reshape(S * d, -1)  # (S d, dim)
        if self.proj_panels is not None:
            logits = torch.from_numpy(cpu_kernels.matmul(rows.numpy(), self.proj_panels, self.proj.shape[0]))
        else:  # W @ x^T streams W once as a GEMV-like product; x @ W^T ran slower on CPU
            logits = (self.proj @ rows.t()).t()
        return logits.reshape(S, d, -1)

    def _compiled_rows(self, hidden: Tensor, k: int, depth: int | None, root: Roots) -> tuple[Tensor, Tensor]:
        """The compiled step is a graph of one row: (S, dim) states run through it row by row."""
        roots = root if isinstance(root, Sequence | Tensor) else [root] * len(hidden)
        tops = [self._compiled_top(h, k, depth, None if r is None else int(r)) for h, r in zip(hidden, roots)]
        return torch.stack([t[0] for t in tops]), torch.stack([t[1] for t in tops])

    @torch.inference_mode()
    def topk(self, hidden: Tensor, k: int, depth: int | None = None, root: Roots = None) -> Tensor:
        """(dim,) hidden state of the newest accepted token -> (depth, k) candidate ids in the full vocabulary
        from the first `depth` heads (all K by default): a tree `depth` deep has no use for deeper heads.
        `root`: the token the target chose after it, for heads that read it (`reads_root`).
        Batched: (S, dim) states (one per sequence) and one root each -> (S, depth, k), in one heads pass."""
        rows = hidden.reshape(-1, hidden.shape[-1])  # (S, dim)
        if self.compiled is not None:
            ids = self._compiled_rows(rows, k, depth, root)[0]
        else:
            ids = self.kept_ids[self._step_logits(rows, depth, root).topk(k, dim=-1).indices]  # (S, d, k)
        return ids if hidden.ndim > 1 else ids[0]

    @torch.inference_mode()
    def topk_logprobs(self, hidden: Tensor, k: int, depth: int | None = None,
                      root: Roots = None) -> tuple[Tensor, Tensor]:
        """As `topk`, with each guess's log-probability under its head: (depth, k) ids, (depth, k) float32
        (batched: (S, depth, k) each)."""
        rows = hidden.reshape(-1, hidden.shape[-1])  # (S, dim)
        if self.compiled is not None:
            ids, logp = self._compiled_rows(rows, k, depth, root)
        else:
            logits = self._step_logits(rows, depth, root).float()  # (S, d, V')
            top = logits.topk(k, dim=-1)
            ids, logp = self.kept_ids[top.indices], top.values - torch.logsumexp(logits, dim=-1, keepdim=True)
        return (ids, logp) if hidden.ndim > 1 else (ids[0], logp[0])

    def save(self, out_dir: str | Path, meta: dict[str, Any] | None = None) -> Path:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_FILE))
        body = {"kind": "medusa", "config": asdict(self.cfg), "meta": meta or {}}
        (out / CONFIG_FILE).write_text(json.dumps(body, indent=2, default=str))
        return out


def heads_for(cfg: MedusaConfig, base_weight: Tensor, kept_ids: Tensor | None = None) -> MedusaHeads:
    """The heads class a config describes: plain (independent) heads, or sequential ones."""
    if cfg.sequential:
        from heads.medusa_sequential import SequentialMedusaHeads  # it subclasses MedusaHeads

        return SequentialMedusaHeads(cfg, base_weight, kept_ids)
    return MedusaHeads(cfg, base_weight, kept_ids)


def new_config(target: LoadedModel, num_heads: int = 4, num_layers: int = 1, projection: str = "shared",
               head_vocab: int | None = None, root_input: bool = False, sequential: bool = False,
               chain_head0: bool = False) -> MedusaConfig:
    w = output_weight(target)
    V, dim = w.shape
    if head_vocab is not None and not 0 < head_vocab <= V:
        raise SpecdecError(f"Medusa head_vocab={head_vocab} must be in 1..{V} (the target's vocabulary) or null")
    return MedusaConfig(target.name, fingerprint(w), dim, V, num_heads, num_layers, projection,
                        None if head_vocab in (None, V) else head_vocab, root_input, sequential, chain_head0)


def check_match(cfg: MedusaConfig, target: LoadedModel, where: str) -> None:
    check_trained_for({"base_model": cfg.base_model, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size},
                      target, f"Medusa heads in {where}")
    if fingerprint(output_weight(target)) != cfg.base_fingerprint:
        raise SpecdecError(f"Medusa heads in {where} were trained for {cfg.base_model} with other weights than this "
                           f"{target.name} ({target.folder}); train heads for this checkpoint or load the one "
                           "they were trained for")


def read_saved(target: LoadedModel, path: str | Path) -> tuple[Path, MedusaConfig, dict[str, Any], dict[str, Tensor]]:
    """A `MedusaHeads.save` folder checked against `target`: (folder, config, training meta, state dict on the host)."""
    from safetensors.torch import load_file

    folder = Path(path).expanduser()
    repo_root = Path(__file__).resolve().parent.parent
    if not folder.is_absolute() and not folder.exists() and (repo_root / folder).exists():
        folder = repo_root / folder  # configs name checkpoints relative to the repository
    cfg_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not cfg_file.is_file() or not weights_file.is_file():
        raise SpecdecError(f"no Medusa heads in {folder} (needs {CONFIG_FILE} and {WEIGHTS_FILE}); train them with "
                           f"`python -m heads.train head=medusa model={target.name}` or set strategy.heads.path")
    try:
        body = json.loads(cfg_file.read_text())
        known = {f.name for f in fields(MedusaConfig)}
        cfg = MedusaConfig(**{k: v for k, v in body["config"].items() if k in known})
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise SpecdecError(f"{cfg_file} is not a Medusa heads config ({type(e).__name__}: {e}); "
                           "retrain the heads") from None
    check_match(cfg, target, str(folder))
    return folder, cfg, body.get("meta") or {}, load_file(str(weights_file))


def load_heads(target: LoadedModel, path: str | Path, weights: str = "fp32",
               block_weights: str = "fp32", rows: int | None = None) -> MedusaHeads:
    """Heads saved by `MedusaHeads.save`, checked against the target they will run on; `weights` and
    `block_weights`: see `MedusaHeads.use_cpu_kernels`; `rows`: score that many rows of the target's head
    (heads.draft_model.widen_rows: the kept rows, then the lowest other ids; shared projection only)."""
    folder, cfg, _, state = read_saved(target, path)
    weights_file = folder / WEIGHTS_FILE
    if rows is not None and cfg.head_vocab is not None:
        if cfg.projection != "shared":
            raise SpecdecError(f"strategy.heads.rows={rows} needs heads on the target's shared head; these in {folder} "
                               "have their own projections (projection: own): leave rows null")
        from heads.draft_model import widen_rows

        state["kept_ids"] = widen_rows(state["kept_ids"].long(), rows, cfg.vocab_size)
        cfg = replace(cfg, head_vocab=None if len(state["kept_ids"]) == cfg.vocab_size else len(state["kept_ids"]))
    heads = heads_for(cfg, output_weight(target), state.get("kept_ids") if cfg.head_vocab is not None else None)
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SpecdecError(f"{weights_file} does not fit its config (missing {missing[:3]}, unexpected "
                           f"{unexpected[:3]}); retrain the heads")
    return _for_inference(heads, target, weights, block_weights)


def _for_inference(heads: MedusaHeads, target: LoadedModel, weights: str = "fp32",
                   block_weights: str = "fp32") -> MedusaHeads:
    """Frozen, on the target's device and in its dtype (every step meets the target's hidden state there),
    then, on the CPU kernels, with `weights` / `block_weights` copies for them."""
    if heads.root_in is not None:  # the root's rows are the target's own head: shared, not a copy
        heads.root_rows = head_weight(target)
    heads.to(device=target.device, dtype=target.dtype)
    heads.eval().requires_grad_(False)
    if target.matmul == "numba":
        heads.use_cpu_kernels(weights, block_weights)
    elif target.compile:  # the torch path compiled, as the target's step
        heads.compile_steps()
    return heads


def medusa_heads(target: LoadedModel, path: str | None = None, num_heads: int = 4, num_layers: int = 1,
                 projection: str = "shared", head_vocab: int | None = None, seed: int | None = None,
                 weights: str = "fp32", root_input: bool = False, sequential: bool = False,
                 block_weights: str = "fp32", chain_head0: bool = False, rows: int | None = None) -> MedusaHeads:
    """Strategy config entry (`strategy.heads`): trained heads from `path`, or untrained ones when path is null.

    Untrained heads start as copies of the target's own head (zero-initialised blocks); `seed` gives
    them random blocks instead, which tests use to get wrong guesses on purpose (drawn on the CPU, so
    the same seed gives the same heads on every device). `weights` and
    `block_weights`: the CPU kernels' copies of the shared projection and of the blocks
    (`MedusaHeads.use_cpu_kernels`). `root_input`, `sequential`, `chain_head0`: `MedusaConfig`. `rows`:
    trained heads only, see `load_heads`.
    """
    if path:
        return load_heads(target, path, weights, block_weights, rows)
    cfg = new_config(target, num_heads, num_layers, projection, head_vocab, root_input, sequential, chain_head0)
    weight = output_weight(target)
    kept = torch.arange(cfg.head_vocab, device=weight.device) if cfg.head_vocab is not None else None
    heads = heads_for(cfg, weight, kept)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in heads.named_parameters():
                if name.startswith(("blocks.", "root_in", "path_in")):
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return _for_inference(heads, target, weights, block_weights)
