"""Batched generation on specdec's compact model, for self-distillation data and Magpie prompts.

Why not transformers' `generate`: its cache grows by concatenation every step, while these loops write
into one static cache. And they return the target's final-norm hidden states of every prompt and
continuation token as a by-product, which the drafters' losses read: no second pass over the data.

Two loops: on the CPU kernels, continuous batching over `BatchEngine` slots (each pass reads the weights
once for every slot, a finished slot takes the next prompt at once, no padding); elsewhere (torch
linears, CUDA), left-padded static batches of large GEMMs. With compiled steps (`model.compile`, the
default on CUDA) each decode step of a batch is one static-shape step (engine/static_step.py) that also
picks the tokens: one CUDA graph replay instead of about a thousand kernel launches a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specdec.engine.batch import BatchEngine, Feed
from specdec.engine.kv_cache import KVCache
from specdec.engine.static_step import CacheView, allow_many_graphs, compile_mode
from specdec.models.cpu_linear import use_matmul
from specdec.models.loader import LoadedModel


@dataclass
class Generated:
    continuation: list[int]  # greedy tokens, up to and including the first end-of-turn token
    hidden: np.ndarray  # (len(prompt) + len(continuation), D) float16: the state after each token


def left_padded(prompts: list[list[int]], max_new_tokens: int, device: torch.device
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A batch of prompts left-padded to the longest (W): tokens (B, W), positions (B, W), the cache slots
    each row may read (B, W + max_new_tokens: not its padding) and the prefill's mask (B, 1, W, W), on
    `device`. Padding queries see only themselves, so no softmax row is empty; their outputs are never read."""
    B, W = len(prompts), max(map(len, prompts))
    tokens = torch.zeros(B, W, dtype=torch.long)
    positions = torch.zeros(B, W, dtype=torch.long)
    valid = torch.ones(B, W + max_new_tokens, dtype=torch.bool)
    for b, p in enumerate(prompts):
        pad = W - len(p)
        tokens[b, pad:] = torch.tensor(p)
        positions[b, pad:] = torch.arange(len(p))
        valid[b, :pad] = False
    causal = torch.ones(W, W, dtype=torch.bool).tril()
    mask = ((causal[None] & valid[:, None, :W]) | torch.eye(W, dtype=torch.bool)[None])[:, None]  # (B, 1, W, W)
    return tokens.to(device), positions.to(device), valid.to(device), mask.to(device)


# Slots of continuous batching on the CPU kernels. On two cores more slots gain little, since the passes are
# already compute-bound (experiments/distill_slots.py), and each slot holds a KV cache as long as the longest
# prompt. The slot count never changes a token or a hidden state.
CPU_SLOTS = 16

STATIC_ROOM = 256  # a static batch's cache is a multiple of this many slots: batches of similar width share graphs


def greedy_step(model: torch.nn.Module, compile: bool) -> Callable[..., tuple[Tensor, Tensor]]:
    """One static-shape decode step for a left-padded batch -> (B,) greedy tokens and (B, D) final-norm
    states; compiled once per model (one graph per batch size and cache size), CUDA graphs on a GPU."""
    key = "_greedy_step_compiled" if compile else "_greedy_step_eager"
    fn = model.__dict__.get(key)
    if fn is None:
        def step(tokens: Tensor, positions: Tensor, slot: Tensor, k: Tensor, v: Tensor,
                 keep: Tensor) -> tuple[Tensor, Tensor]:
            tree = torch.ones(1, 1, dtype=torch.bool, device=tokens.device)
            logits, h = model.forward_static(tokens, positions, slot, tree, CacheView(k, v), keep=keep)  # type: ignore[operator]
            return logits[:, -1].argmax(-1), h[:, 0]

        device = next(model.parameters()).device
        allow_many_graphs()
        fn = torch.compile(step, mode=compile_mode(device), fullgraph=True, dynamic=False) if compile else step
        model.__dict__[key] = fn
    return fn


def _static_cache(model: torch.nn.Module, batch: int, size: int, compile: bool) -> KVCache:
    """The cache of the static loop, reused batch after batch while the batch and cache size stay (CUDA graphs
    mutate only buffers whose address never changes); a new shape replaces it, so one cache lives at a time.
    A reused cache's stale slots are never read: each row reads only its own prompt's and continuation's
    slots (`keep`), and it writes those before it reads them."""
    held = model.__dict__.get("_greedy_cache")
    if held is not None and held[0] == (batch, size):
        held[1].rollback(0)
        return held[1]
    model.__dict__.pop("_greedy_cache", None)  # freed before the next one is allocated
    cache = model.new_cache(size, batch=batch)  # type: ignore[operator]
    if compile and cache.k.device.type == "cuda":
        torch._dynamo.mark_static_address(cache.k)
        torch._dynamo.mark_static_address(cache.v)
    model.__dict__["_greedy_cache"] = ((batch, size), cache)
    return cache


@torch.inference_mode()
def _generate_batch(target: LoadedModel, prompts: list[list[int]], max_new_tokens: int,
                    check_every: int | None = None, static: bool | None = None) -> list[Generated]:
    """Greedy continuations of a left-padded batch. Tokens and hidden states stay on the target's device
    until the end, and whether every row has ended is read only each `check_every` steps (default: 1 on
    the CPU, 8 elsewhere): on a GPU each read waits for the device, and a host that never waits can queue
    the next step's kernels while the device runs this one. Steps past every row's end are cut off.
    `static` (default: the target's `compile`): decode steps at static shapes (`greedy_step`), compiled
    when the target is; the prefill stays eager (one pass a batch)."""
    model = target.model
    B, W, n = len(prompts), max(map(len, prompts)), max_new_tokens
    dev = target.device
    every = check_every or (1 if dev.type == "cpu" else 8)
    static = target.compile if static is None else static
    size = -(-(W + n) // STATIC_ROOM) * STATIC_ROOM if static else W + n
    cache = _static_cache(model, B, size, target.compile) if static else model.new_cache(size, batch=B)
    tokens, positions, valid, mask = left_padded(prompts, n, dev)
    logits, h = model(tokens, positions, cache, mask, logits_from=W - 1)  # h: (B, W, D)
    states = torch.empty(B, W + n, h.shape[-1], dtype=torch.float16, device=dev)  # the state after each token
    states[:, :W] = h
    gen = torch.empty(B, n, dtype=torch.long, device=dev)
    pos = positions[:, -1]
    eos = torch.tensor(target.eos_ids or [-1], device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    nxt = logits[:, -1].argmax(-1)  # (B,)
    if static:
        step = greedy_step(model, target.compile)
        keep = torch.nn.functional.pad(valid, (0, size - W - n))  # (B, size): no row reads another's padding
        slots = torch.arange(size, device=dev)
    steps = n
    for i in range(n):
        gen[:, i] = nxt  # copied out before the next step: a CUDA graph's outputs are overwritten by its replay
        done |= torch.isin(nxt, eos)
        pos = pos + 1
        # The last step runs even when every row has ended: it gives the final token's hidden state.
        if static:
            # the step's own tensors, not views into gen and slots, which the compiled step read more slowly
            nxt, h_new = step(gen[:, i:i + 1].clone(), pos[:, None], slots[W + i:W + i + 1].clone(), cache.k, cache.v,
                              keep)
        else:
            logits, h = model(gen[:, i:i + 1], pos[:, None], cache, valid[:, None, None, :W + i + 1])
            nxt, h_new = logits[:, -1].argmax(-1), h[:, 0]
        states[:, W + i] = h_new
        if (i + 1) % every == 0 and bool(done.all()):
            steps = i + 1
            break
    out = gen[:, :steps].cpu().tolist()  # (B, steps)
    hidden = states[:, :W + steps].cpu().numpy()  # (B, W + steps, D)
    eos_set = set(target.eos_ids)
    results = []
    for b, p in enumerate(prompts):
        cont = out[b]
        cut = next((j + 1 for j, t in enumerate(cont) if t in eos_set), len(cont))
        results.append(Generated(cont[:cut], hidden[b, W - len(p):W + cut].copy()))
    return results


def generate_with_hidden(target: LoadedModel, prompts: list[list[int]], max_new_tokens: int,
                         batch_size: int) -> list[Generated]:
    """Greedy continuations and hidden states of `prompts`, in their order.

    On the CPU kernels: `continuous` with batch_size slots (at most CPU_SLOTS).
    Else batch by batch; batches group prompts of similar length, so left padding wastes little of the
    prefill, and the compact model's linears switch to torch for the run (large GEMMs), then back.
    """
    if getattr(target.model, "fused", None) is not None:
        return continuous(target, prompts, max_new_tokens, min(batch_size, CPU_SLOTS), stop=set(target.eos_ids))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[Generated | None] = [None] * len(prompts)
    use_matmul(target.model, "torch")
    try:
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            for i, g in zip(idx, _generate_batch(target, [prompts[i] for i in idx], max_new_tokens)):
                results[i] = g
    finally:
        use_matmul(target.model, target.matmul)
        target.model.__dict__.pop("_greedy_cache", None)  # the memory goes back to training
    return [r for r in results if r is not None]


Pick = Callable[[int, Tensor], int]  # (prompt index, logits (V,) float32) -> the next token


def greedy_pick(i: int, logits: Tensor) -> int:
    return int(logits.argmax())


@dataclass
class _Run:
    i: int  # the prompt's index
    pending: int  # the token to feed next
    out: list[int]
    hidden: list[Tensor]


@torch.inference_mode()
def continuous(target: LoadedModel, prompts: list[list[int]], max_new_tokens: int, slots: int,
               stop: set[int], pick: Pick = greedy_pick) -> list[Generated]:
    """Continuations of `prompts` (in their order) on `slots` BatchEngine slots, one pass a step for all.

    Each continuation ends with its first `stop` token (kept) or after max_new_tokens. Its last token is
    fed too, so `hidden` has a row after every token, as `_generate_batch` gives. `pick(i, logits)` picks
    prompt i's next token: a sampler seeded per prompt makes the result independent of slot scheduling.
    """
    if max_new_tokens < 1 or not prompts:
        return []
    engine = BatchEngine(target.model, slots, max(map(len, prompts)) + max_new_tokens + 1)
    queue: Iterator[int] = iter(sorted(range(len(prompts)), key=lambda i: -len(prompts[i])))  # long ones first
    runs: dict[int, _Run] = {}
    done: list[Generated | None] = [None] * len(prompts)

    def admit(b: int) -> None:
        i = next(queue, None)
        if i is not None:
            first = engine.prefill(b, prompts[i])  # logits (1, V), hidden (P, D)
            runs[b] = _Run(i, pick(i, first.logits[-1].float()), [], [first.hidden])

    for b in range(slots):
        admit(b)
    while runs:
        outs = engine.step({b: Feed(torch.tensor([r.pending], device=engine.device)) for b, r in runs.items()})
        for b, o in outs.items():
            r = runs[b]
            r.out.append(r.pending)
            r.hidden.append(o.hidden)
            if r.pending in stop or len(r.out) == max_new_tokens:
                done[r.i] = Generated(r.out, torch.cat(r.hidden).half().cpu().numpy())
                del runs[b]
                admit(b)
            else:
                r.pending = pick(r.i, o.logits[-1].float())
    return [g for g in done if g is not None]
