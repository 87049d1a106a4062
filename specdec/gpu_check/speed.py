"""The GPU check's speed cases on random weights in Llama-3-8B's shape: decoding against the measured
bandwidth, the verification-cost curve, batched greedy and one drafting step per strategy."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from specdec.engine.timing import clock
from specdec.gpu_check.correctness import batched_outputs, describe
from specdec.gpu_check.models import SHAPES, Models
from specdec.strategies.base import GenerationParams, Strategy, make_engine


def speed_weights(models: Models) -> dict[str, Any]:
    from specdec.bench import weight_bytes

    start = clock(models.dev)
    target = models.big()
    return {"shape": models.opt.shape, "dtype": str(target.dtype).removeprefix("torch."),
            "weight_bytes": weight_bytes(target.model), "build_s": clock(models.dev) - start,
            "params": sum(p.numel() for p in target.hf_model().parameters())}


def speed_bandwidth(models: Models) -> dict[str, Any]:
    from specdec.bench import bandwidth_method, device_bandwidth_gbs

    return {"gb_per_s": device_bandwidth_gbs(models.dev), "method": bandwidth_method(models.dev)}


DECODERS = ("greedy_eager", "hf_eager", "greedy_compiled", "hf_static")


def decoder(models: Models, name: str) -> Strategy:
    from specdec.strategies.greedy import Greedy
    from specdec.strategies.hf import HFGenerate

    target, n = models.big(), models.speed_max_len()
    if name == "greedy_eager":
        return Greedy(target, name, n)
    if name == "greedy_compiled":
        return Greedy(dataclasses.replace(target, compile=True), name, n)
    if name == "hf_eager":
        return HFGenerate(target, name)
    # transformers' fast path: static cache, decode step compiled where transformers compiles (CUDA)
    return HFGenerate(target, name, max_len=n, cache_implementation="static", compile="auto")


def speed_decode(models: Models, name: str) -> dict[str, Any]:
    """ms per decoded token (the decode phase only) after a warm-up turn that compiles what compiles."""
    from specdec.bench import compare_greedy

    s = decoder(models, name)
    prompts = models.speed_prompts()
    compare_greedy({name: s}, models.big(), prompts[:1], GenerationParams(8, eos_ids=()), 1)  # warm-up
    r = compare_greedy({name: s}, models.big(), prompts, models.speed_params(), models.opt.rounds)[name]
    engine = getattr(s, "engine", None)
    r["how"] = describe(engine) if engine is not None else f"transformers {getattr(s, 'peer', '')}".strip()
    return r


def speed_batch(models: Models, batch: int) -> dict[str, Any]:
    """Greedy over `batch` slots of the big model (eager): decode tokens/s summed over the slots."""
    from specdec.strategies.greedy import Greedy

    target, params = models.big(), models.speed_params()
    vocab = SHAPES[models.opt.shape]["vocab_size"]
    prompts = [[(i * 7919 + j * 104729) % (vocab - 3) + 3 for i in range(models.opt.context)] for j in range(batch)]
    strategy = Greedy(target, "greedy", models.speed_max_len())
    batched_outputs(strategy, prompts, GenerationParams(8, eos_ids=()), batch)  # warm-up
    start = clock(models.dev)
    outs = batched_outputs(strategy, prompts, params, batch)
    seconds = clock(models.dev) - start
    tokens = sum(len(o) for o in outs)
    return {"slots": batch, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ms_per_step": 1e3 * seconds / params.max_new_tokens, "prefill_included": True}


def speed_verification(models: Models, ks: list[int], compiled: bool) -> dict[str, Any]:
    """One pass over k new tokens after `context` cached ones: ms, and relative to k = 1."""
    from specdec.engine.engine import pass_times

    opt = models.opt
    target = dataclasses.replace(models.big(), compile=True) if compiled else models.big()
    engine = make_engine(target, models.speed_max_len(), 512)
    with torch.inference_mode():
        ms = {k: t * 1e3 for k, t in pass_times(engine, [3 + i % 100 for i in range(opt.context)], [1, *ks],
                                                opt.reps).items()}
    ks = [1, *ks] if 1 not in ks else ks
    return {"ms": {k: ms[k] for k in ks}, "ratio": {k: ms[k] / ms[1] for k in ks}, "engine": describe(engine)}


DRAFTERS = ("prompt_lookup", "lookahead", "draft", "medusa", "eagle")


def speed_drafting(models: Models, name: str) -> dict[str, Any]:
    """One drafting step against one target step, from real turns (untrained drafters: cost, not acceptance)."""
    from heads.eagle import EagleTrainable
    from heads.medusa import medusa_heads
    from specdec.bench import drafting_cost
    from specdec.strategies.draft import DraftStrategy
    from specdec.strategies.eagle import EagleStrategy
    from specdec.strategies.lookahead import Lookahead
    from specdec.strategies.medusa import Medusa
    from specdec.strategies.prompt_lookup import PromptLookup
    from specdec.strategies.schedules import FixedLength

    target, n = models.big(), models.speed_max_len()
    build: dict[str, Callable[[], Strategy]] = {
        "prompt_lookup": lambda: PromptLookup(target, max_len=n, num_draft_tokens=7),
        "lookahead": lambda: Lookahead(target, max_len=n, window=4, level=3, guesses=2),
        "draft": lambda: DraftStrategy(target, "draft", models.big_draft(), FixedLength(4), n),
        "medusa": lambda: Medusa(target, max_len=n, heads=medusa_heads(target, num_heads=4, seed=0),
                                 tree="dynamic", nodes=6),
        "eagle": lambda: EagleStrategy(target, "eagle", EagleTrainable(kept_vocab=0).build(target, None).net.eval(),
                                       FixedLength(3), n),
    }
    s = build[name]()
    params = GenerationParams(min(models.opt.new_tokens, 32), eos_ids=())
    return drafting_cost(s, models.speed_prompts()[:1], params)
