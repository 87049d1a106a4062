"""`python -m specdec.gpu_check [--device cuda|cpu] [--shape 8b|tiny] [--out DIR]`: the one-script GPU check.

Nothing is downloaded. Every check is a case of its own: a case that raises is recorded with its error
(type, message, where) and the rest still run; gpu_check.json and gpu_check.md in --out are rewritten
as each case ends, so a run cut short still leaves everything done so far. A time budget (--budget-s)
and a per-case limit (--case-timeout-s) keep the whole run within about 8 minutes on one H200: cases
left when the budget is spent are recorded as skipped.

Correctness, on the tiny random model (`builtin:tiny-llama`), eager and compiled (`load_model(compile=True)`):
- every strategy (greedy, draft models, Medusa trees with plain and sequential heads, EAGLE, prompt
  lookup, lookahead, the lookup hybrids) on the device: in fp32 against greedy on the CPU, in bf16
  against the device's own eager bf16 greedy (bf16 rounds differently from fp32). Identical outputs
  pass; an output that differs passes only if each of its tokens is the reference model's argmax, up
  to a tie tolerance, given the output's own prefix (a pass over k tokens may round differently from
  a one-token step, and flips a near-tie);
- one token-tree pass against sequential decoding of every node's path (fp32 and bf16);
- sampling on the device: chi-square tests that plain sampling, speculative sampling and
  deterministic-draft sampling (specdec.verify) draw from the target's distribution on a small
  vocabulary, and sampled turns of the strategies that are reproducible from their seed.
Speed, on random bf16 weights in Llama-3-8B's shape (built on the device, no host copy):
- ms per token of our greedy (eager, compiled), transformers `generate()` eager and with a static cache
  plus torch.compile, each as a fraction of the measured bandwidth (weight bytes per token / the bytes
  per second of a device-to-device copy);
- the verification-cost curve (one pass over k = 1 ... 64 new tokens) eager and compiled;
- one drafting step of each strategy against one target step.

Order: eager correctness, eager speed, then what compiles (slow to start, the least certain): bf16
correctness, compiled decoding and transformers' static peer, the compiled verification curve (a case
per pass size, each tracing one more token bucket), fp32 correctness. `--cases 'speed/*'` (fnmatch
patterns) reruns a part, `--skip` leaves cases out. `--device cpu --shape tiny` runs the same code on a
CPU (the tests do); compiled cases there use inductor, so only a few strategies run compiled unless
--compiled-strategies says otherwise. Details and how to read the output: docs/gpu_check.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import gc
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from specdec.engine.timing import clock
from specdec.models.loader import LoadedModel, load_model
from specdec.strategies.base import GenerationParams, Strategy, make_engine

# Llama-3-8B's shape (bf16: about 16 GB of weights); "tiny" keeps the speed cases runnable on a CPU
SHAPES: dict[str, dict[str, Any]] = {
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 8192,
           "rms_norm_eps": 1e-5},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512, "rope_theta": 10000.0, "max_position_embeddings": 4096},
}
# the random draft model of the drafting-cost cases: a small Llama on the target's vocabulary
DRAFT_SHAPES: dict[str, dict[str, Any]] = {
    "8b": {**SHAPES["8b"], "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 2,
           "num_attention_heads": 8, "num_key_value_heads": 8},
    "tiny": {**SHAPES["tiny"], "num_hidden_layers": 1},
}
# Largest logit deficit of an output token below the reference's argmax that still counts as a tie:
# fp32 passes differ in the last bits only; bf16 logits of a few units carry a step of 1/32, and a
# pass over k tokens (or a fused, compiled one) may round each activation differently from a one-token
# step, which moves logits by several such steps. Both stay below the tiny model's typical gap between
# its first and second choice, and far below where a wrong token (another context's argmax) lands.
TIE = {"fp32": 1e-3, "bf16": 0.25}
TREE_TOL = {"fp32": 1e-3, "bf16": 0.3}  # largest logit difference, tree pass vs each path on its own
MAX_LEN = 512  # the tiny model's cache: prompts of ~30 tokens plus the checked output
# compiled on a CPU by default: inductor there compiles each token bucket for tens of seconds
# (the tree/*/compiled cases still run a compiled tree pass)
CPU_COMPILED = ("greedy",)
STATUSES = ("passed", "failed", "error", "skipped")


class CaseTimeout(Exception):
    """A case ran past its time limit (--case-timeout-s, or what was left of --budget-s)."""


@dataclass
class Case:
    """One isolated check: `run` returns its figures; a "passed": False among them fails the case."""

    name: str
    run: Callable[[], dict[str, Any]]


@dataclass
class Options:
    device: str = "cuda"
    shape: str = "8b"
    out: Path = Path("experiments/gpu")
    check_tokens: int = 32  # tokens per correctness turn
    check_prompts: int = 4
    new_tokens: int = 64  # tokens per speed turn
    rounds: int = 1
    speed_prompts: int = 2
    context: int = 256  # cached tokens before each verification pass, and the speed prompts' length
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    reps: int = 5
    batches: list[int] = field(default_factory=lambda: [1, 4, 16])  # slots of the batched speed cases
    samples: int = 2000  # draws per chi-square test
    sampling_seed: int = 1234  # the chi-square tests' generator
    budget_s: float = 440.0
    case_timeout_s: float = 240.0  # speed/decode/greedy_compiled took 179 s on an H200 (compiling every bucket)
    compiled_strategies: tuple[str, ...] | None = None  # None: every strategy
    cases: tuple[str, ...] = ()  # fnmatch patterns of the cases to run; empty: every case
    skip: tuple[str, ...] = ()  # fnmatch patterns of cases to leave out


# --- models and references, built once and shared by the cases ------------------------------------


class Models:
    """What the cases share: tiny models per (dtype, compiled), reference outputs, the random big model."""

    def __init__(self, opt: Options) -> None:
        self.opt = opt
        self.dev = torch.device(opt.device)
        self._memo: dict[Any, Any] = {}

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def tiny(self, dtype: str, compiled: bool, device: str | None = None, seed: int = 0) -> LoadedModel:
        dev = device or self.opt.device
        return self.memo(("tiny", dtype, compiled, dev, seed), lambda: load_model(
            "tiny-llama" if seed == 0 else f"tiny-draft-{seed}", "builtin:tiny-llama", dtype=dtype, device=dev,
            matmul="torch", compile=compiled, tiny={"seed": seed} if seed else None))

    def draft(self, dtype: str, compiled: bool) -> LoadedModel:
        # another random model on the same tokenizer: it disagrees with the target often
        return self.tiny(dtype, compiled, seed=1)

    def prompts(self) -> list[list[int]]:
        texts = ["Explain what a static KV cache is.", "Write a Python function that reverses a list.",
                 "Summarise: the cat sat on the mat and the cat sat on the mat again.", "What is 12 times 7?"]
        tok = self.tiny("fp32", False, "cpu")
        return [tok.chat_ids([{"role": "user", "content": t}]) for t in texts[:self.opt.check_prompts]]

    def reference(self, dtype: str) -> LoadedModel:
        """fp32: the CPU's fp32 model (what the device must reproduce); bf16: the device's eager bf16 model."""
        return self.tiny("fp32", False, "cpu") if dtype == "fp32" else self.tiny("bf16", False)

    def reference_outputs(self, dtype: str) -> list[list[int]]:
        from specdec.strategies.greedy import Greedy

        def build() -> list[list[int]]:
            greedy = Greedy(self.reference(dtype), "greedy", MAX_LEN)
            return [greedy.generate(p, self.check_params(), 0).output_ids for p in self.prompts()]

        return self.memo(("ref", dtype), build)

    def check_params(self) -> GenerationParams:
        return GenerationParams(self.opt.check_tokens, eos_ids=())  # fixed length: no early EOS

    def big(self) -> LoadedModel:
        return self.memo("big", lambda: random_llama(SHAPES[self.opt.shape], self.opt.device, torch.bfloat16
                                                     if self.dev.type == "cuda" else torch.float32))

    def big_draft(self) -> LoadedModel:
        target = self.big()
        return self.memo("big_draft", lambda: random_llama(DRAFT_SHAPES[self.opt.shape], self.opt.device,
                                                           target.dtype, keep_hf=False, seed=1))

    def speed_prompts(self) -> list[list[int]]:
        vocab = SHAPES[self.opt.shape]["vocab_size"]
        return [[(i * 7919 + j) % (vocab - 3) + 3 for i in range(self.opt.context)]
                for j in range(self.opt.speed_prompts)]

    def speed_params(self) -> GenerationParams:
        return GenerationParams(self.opt.new_tokens, eos_ids=())

    def speed_max_len(self) -> int:
        """One cache size for every speed engine: compiled steps are traced per bucket and cache size,
        so the verification cases reuse the graphs the compiled greedy traced."""
        return self.opt.context + max(self.opt.new_tokens, max(self.opt.ks)) + 64


def random_llama(shape: dict[str, Any], device: str, dtype: torch.dtype, keep_hf: bool = True,
                 seed: int = 0) -> LoadedModel:
    """A Llama of the given shape with random weights created on `device` in `dtype` (no host copy),
    as our compact model and, sharing the tensors it does not fuse, as transformers' (the peers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.models.llama import Llama, LlamaArgs

    tok = load_model("tiny-llama", "builtin:tiny-llama", device="cpu", matmul="torch")  # ids only, never text
    cfg = AutoConfig.for_model("llama", bos_token_id=0, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                               **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval().requires_grad_(False)
    with torch.device("meta"):
        compact = Llama(LlamaArgs.from_hf(cfg))
    compact.load_hf_state_dict({k: v.detach() for k, v in hf.state_dict().items()})
    compact.eval().requires_grad_(False)
    name = f"llama-{shape['num_hidden_layers']}x{shape['hidden_size']}-random"
    return LoadedModel(name, tok.folder, tok.tokenizer, compact, "compact", dtype, torch.device(device),
                       eos_ids=(), _hf=hf if keep_hf else None)


# --- correctness ------------------------------------------------------------------------------------


def strategy_builders(models: Models, dtype: str, compiled: bool) -> dict[str, Callable[[LoadedModel], Strategy]]:
    """Every strategy, untrained drafters included, as a function of the target."""
    from heads.eagle import EagleTrainable
    from heads.medusa import medusa_heads
    from specdec.strategies.draft import DraftStrategy
    from specdec.strategies.eagle import EagleStrategy
    from specdec.strategies.eagle_tree import Eagle2
    from specdec.strategies.greedy import Greedy
    from specdec.strategies.hybrid import LookupHybrid
    from specdec.strategies.lookahead import Lookahead
    from specdec.strategies.medusa import Medusa
    from specdec.strategies.prompt_lookup import PromptLookup
    from specdec.strategies.schedules import CostAware, FixedLength

    def draft() -> LoadedModel:
        return models.draft(dtype, compiled)

    def eagle_net(t: LoadedModel) -> Any:  # untrained: the pair bookkeeping on the device, not acceptance
        return EagleTrainable(kept_vocab=0).build(t, None).net.eval()

    def heads(t: LoadedModel, sequential: bool = False) -> Any:
        if sequential:  # Hydra: each head continues the previous one along the path
            return medusa_heads(t, num_heads=3, num_layers=2, root_input=True, sequential=True, seed=3)
        return medusa_heads(t, num_heads=3, seed=0)

    n = MAX_LEN
    return {
        "greedy": lambda t: Greedy(t, "greedy", n),
        "draft_random": lambda t: DraftStrategy(t, "draft", draft(), FixedLength(4), n),
        "draft_self": lambda t: DraftStrategy(t, "draft", t, FixedLength(4), n),  # the target drafts: all accepted
        "draft_siblings": lambda t: DraftStrategy(t, "draft", draft(), CostAware(max_gamma=6, siblings=2), n),
        "medusa": lambda t: Medusa(t, max_len=n, heads=heads(t), tree="default"),
        "medusa_dynamic": lambda t: Medusa(t, max_len=n, heads=heads(t), tree="dynamic", nodes=6),
        "hydra": lambda t: Medusa(t, "hydra", max_len=n, heads=heads(t, sequential=True), tree="dynamic", nodes=6),
        "hydra_copy": lambda t: Medusa(t, "hydra_copy", max_len=n, heads=heads(t, sequential=True), tree="dynamic",
                                       nodes=6, copy_tokens=8),
        "eagle_random": lambda t: EagleStrategy(t, "eagle", eagle_net(t), FixedLength(3), n),
        "eagle_siblings": lambda t: EagleStrategy(t, "eagle", eagle_net(t), CostAware(max_gamma=6, siblings=2), n),
        "eagle2_random": lambda t: Eagle2(t, "eagle2", eagle_net(t), depth=3, topk=2, nodes=5, max_len=n),
        "prompt_lookup": lambda t: PromptLookup(t, max_len=n, num_draft_tokens=7),
        "prompt_lookup_tree": lambda t: PromptLookup(t, max_len=n, num_draft_tokens=4, num_candidates=3,
                                                     gate=False),
        "lookahead": lambda t: Lookahead(t, max_len=n, window=4, level=3, guesses=2),
        "draft_lookup": lambda t: LookupHybrid(t, "draft_lookup", partial(
            DraftStrategy, name="draft", draft=draft(), schedule=FixedLength(4)), n),
        "eagle_lookup": lambda t: LookupHybrid(t, "eagle_lookup", partial(
            EagleStrategy, name="eagle", drafter=eagle_net(t), schedule=FixedLength(3)), n),
        "hydra_lookup": lambda t: LookupHybrid(t, "hydra_lookup", partial(
            Medusa, name="hydra", heads=heads(t, sequential=True), tree="dynamic", nodes=4), n),
    }


def strategy_names() -> list[str]:
    """The strategies the correctness cases run (building the table loads nothing)."""
    return list(strategy_builders(Models(Options(device="cpu")), "fp32", False))


def describe(engine: Any) -> str:
    """How the engine runs its passes: eager, or through the compiled static-shape step."""
    step = getattr(engine, "static", None)
    how = "" if step is None else "+compiled" if getattr(step, "compiled", False) else "+static"
    return type(engine).__name__ + how


def deficits(ref: LoadedModel, prompt: list[int], output: list[int]) -> list[float]:
    """For each output token, how far its logit lies below the reference's argmax given the prompt and
    the output before it (0: it is the argmax), from one prefill and one pass over the output."""
    from specdec.engine.engine import StaticEngine

    engine = StaticEngine(ref.model, MAX_LEN)  # eager: the reference is the plain computation
    with torch.inference_mode():
        rows = [engine.prefill(prompt).logits[-1:]]
        if len(output) > 1:
            rows.append(engine.forward(torch.tensor(output[:-1])).logits)
        logits = torch.cat(rows).float().cpu()
    picked = logits.gather(1, torch.tensor(output)[:, None])[:, 0]
    return (logits.max(-1).values - picked).tolist()


def check_strategy(models: Models, name: str, dtype: str, compiled: bool) -> dict[str, Any]:
    target = models.tiny(dtype, compiled)
    strategy = strategy_builders(models, dtype, compiled)[name](target)
    want = models.reference_outputs(dtype)
    got = [strategy.generate(p, models.check_params(), 0).output_ids for p in models.prompts()]
    ref = models.reference(dtype)
    worst = 0.0
    for p, g, w in zip(models.prompts(), got, want):
        if g != w:
            worst = max(worst, max(deficits(ref, p, g)))
    out: dict[str, Any] = {
        "identical": sum(g == w for g, w in zip(got, want)) / len(want), "max_deficit": worst,
        "tie_tolerance": TIE[dtype], "against": "cpu fp32 greedy" if dtype == "fp32" else "device bf16 eager greedy",
        "engine": describe(strategy.engine),
        "passed": worst <= TIE[dtype] and all(len(g) == models.opt.check_tokens for g in got),
    }
    if dtype == "bf16" and name == "greedy":  # for the record: how far bf16 drifts from fp32 here
        cpu = models.reference_outputs("fp32")
        out["identical_to_cpu_fp32"] = sum(g == c for g, c in zip(got, cpu)) / len(cpu)
    return out


def check_tree(models: Models, dtype: str, compiled: bool) -> dict[str, Any]:
    """One token-tree pass against sequential decoding of every node's path, on the same engine."""
    from specdec.trees import paths_to_parents, tree_depth, tree_mask

    target = models.tiny(dtype, compiled)
    prompt = models.prompts()[0]
    paths = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]
    parents, _ = paths_to_parents(paths)  # node i >= 1 hangs below parents[i - 1]; 0 is the root
    tokens = torch.tensor([5 + 3 * i for i in range(len(parents) + 1)])  # root + nodes
    engine = make_engine(target, MAX_LEN, 512)
    with torch.inference_mode():
        engine.prefill(prompt)
        n = engine.length
        tree = engine.forward(tokens, tree_depth(parents), tree_mask(parents)).logits.float().cpu()  # (N + 1, V)
        diff, worst_tie = 0.0, 0.0
        for i in range(len(tokens)):
            chain, j = [int(tokens[i])], i
            while j > 0:
                j = parents[j - 1]
                chain.append(int(tokens[j]))
            engine.rollback(n)
            seq = engine.forward(torch.tensor(chain[::-1])).logits[-1].float().cpu()
            diff = max(diff, float((seq - tree[i]).abs().max()))
            worst_tie = max(worst_tie, float(seq.max() - seq[tree[i].argmax()]))  # the tree's pick, per the path
    return {"max_abs_logit_diff": diff, "logit_scale": float(tree.abs().max()), "argmax_deficit": worst_tie,
            "tolerance": TREE_TOL[dtype], "engine": describe(engine), "nodes": len(parents),
            "passed": diff <= TREE_TOL[dtype] and worst_tie <= TIE[dtype]}


# the chi-square tests' target: three rows over a six-token vocabulary (as tests/test_verify_props.py)
CHI_LOGITS = [[2.0, 1.2, 0.6, 0.1, -0.4, -2.5], [-0.3, 1.5, 0.2, 0.9, -1.0, 0.4], [0.5] * 6]
MIN_P = 1e-3  # chi-square p-value below which the draws do not follow the target


def chi_square_p(samples: list[int], probs: torch.Tensor) -> float:
    """p-value of the draws against `probs` (V,) on its support; 0 if any draw lies outside it."""
    from scipy.stats import chisquare

    probs = probs.double().cpu()
    counts = torch.bincount(torch.tensor(samples, dtype=torch.long), minlength=len(probs)).double()
    support = probs > 0
    if counts[~support].sum() > 0 or not samples:
        return 0.0
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def check_sampling_rules(models: Models) -> dict[str, Any]:
    """Plain, speculative and deterministic-draft sampling on the device keep the target's law."""
    from specdec.engine.sampling import SamplingParams, new_generator, sample, warp
    from specdec.trees import chain_parents
    from specdec.verify import Proposal, verify_deterministic, verify_sampled_chain

    dev, n = models.dev, models.opt.samples
    params = SamplingParams(temperature=0.8, top_p=0.95)
    logits = torch.tensor(CHI_LOGITS, device=dev)
    p = warp(logits, params)  # (3, V) on the device
    q = warp(-logits[:2], params)  # a draft with its mass where the target has little
    gen = new_generator(dev, models.opt.sampling_seed)
    plain = [sample(p[0], gen) for _ in range(n)]
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).T  # (n, 2) on the device
    first, second = [], []
    for tokens in drafts:
        verdict = verify_sampled_chain(Proposal(tokens, chain_parents(2), probs=q), logits, params, gen)
        first.append(verdict.tokens[0])
        if verdict.nodes:
            second.append(verdict.tokens[1])
    rate = float(torch.minimum(p[0], q[0]).sum())  # acceptance of the first draft: 1 - TV(p, q)
    sibling = Proposal(torch.tensor([1, 0], device=dev), [0, 0])  # two candidates tried in order
    det = [verify_deterministic(sibling, logits, params, gen).tokens[0] for _ in range(n)]
    pv = {"plain": chi_square_p(plain, p[0]), "speculative_first": chi_square_p(first, p[0]),
          "speculative_after_accept": chi_square_p(second, p[1]), "deterministic_siblings": chi_square_p(det, p[0])}
    rate_ok = abs(len(second) / n - rate) < 4 * math.sqrt(rate * (1 - rate) / n)
    return {"p_values": pv, "acceptance": len(second) / n, "expected_acceptance": rate, "samples": n,
            "passed": all(v > MIN_P for v in pv.values()) and rate_ok}


SAMPLED = ("greedy", "draft_random", "eagle_random", "prompt_lookup", "lookahead", "medusa", "draft_lookup")


def check_sampled_turns(models: Models) -> dict[str, Any]:
    """Turns at temperature 0.8 on the device: each strategy's output is reproducible from its seed.
    Each turn gets a fresh strategy: some adapt between turns (the hybrids' measured rates)."""
    from specdec.engine.sampling import SamplingParams

    params = GenerationParams(models.opt.check_tokens, SamplingParams(0.8, 0.95), eos_ids=())
    target, prompt = models.tiny("fp32", False), models.prompts()[0]
    builders = strategy_builders(models, "fp32", False)
    out: dict[str, Any] = {}
    for name in SAMPLED:
        a, b = (builders[name](target).generate(prompt, params, 7).output_ids for _ in range(2))
        out[name] = a == b and len(a) == params.max_new_tokens and max(a) < target.vocab_size
    out["passed"] = all(out.values())
    return out


BATCHED = ("greedy", "draft_random", "prompt_lookup", "eagle_random", "medusa")  # the batchable ones
BATCH = 3  # slots: fewer than the prompts, so a finished slot takes the next conversation mid-run


def batched_outputs(strategy: Strategy, prompts: list[list[int]], params: GenerationParams,
                    batch: int) -> list[list[int]]:
    """Each prompt's output when `batch` slots decode them together (continuous batching)."""
    from specdec.strategies.batched import Job

    outs: dict[int, list[int]] = {}
    jobs = [Job(1, lambda t, p=p: p, lambda t: 0, lambda t, ids, res, i=i: outs.__setitem__(i, res.output_ids))
            for i, p in enumerate(prompts)]
    strategy.batch_decoder(batch, params).run(jobs)  # type: ignore[attr-defined]
    return [outs[i] for i in range(len(prompts))]


def check_batched(models: Models, name: str, dtype: str) -> dict[str, Any]:
    """The strategy's batched decoder (eager, ragged acceptance per slot) on the device gives greedy's output."""
    target = models.tiny(dtype, False)
    strategy = strategy_builders(models, dtype, False)[name](target)
    want, ref = models.reference_outputs(dtype), models.reference(dtype)
    got = batched_outputs(strategy, models.prompts(), models.check_params(), BATCH)
    worst = max([max(deficits(ref, p, g)) for p, g, w in zip(models.prompts(), got, want) if g != w], default=0.0)
    return {"identical": sum(g == w for g, w in zip(got, want)) / len(want), "max_deficit": worst,
            "tie_tolerance": TIE[dtype], "slots": BATCH, "prompts": len(want),
            "passed": worst <= TIE[dtype] and all(len(g) == models.opt.check_tokens for g in got)}


# --- speed ------------------------------------------------------------------------------------------


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


# --- the runner -------------------------------------------------------------------------------------


def all_cases(models: Models) -> list[Case]:
    """Eager correctness first, then eager speed, then what compiles (slowest to start, least certain)."""
    opt = models.opt
    names = strategy_names()
    on = opt.compiled_strategies if opt.compiled_strategies is not None else names
    cases: list[Case] = []

    def add(name: str, fn: Callable[..., dict[str, Any]], *args: Any) -> None:
        cases.append(Case(name, partial(fn, models, *args)))

    for dtype in ("fp32", "bf16"):
        for s in names:
            add(f"correct/{dtype}/eager/{s}", check_strategy, s, dtype, False)
        add(f"tree/{dtype}/eager", check_tree, dtype, False)
    add("sampling/chi_square", check_sampling_rules)
    add("sampling/turns", check_sampled_turns)
    add("speed/weights", speed_weights)
    add("speed/bandwidth", speed_bandwidth)
    for d in ("greedy_eager", "hf_eager"):
        add(f"speed/decode/{d}", speed_decode, d)
    add("speed/verification/eager", speed_verification, opt.ks, False)
    for s in BATCHED:
        add(f"batch/fp32/{s}", check_batched, s, "fp32")
    for b in opt.batches:
        add(f"speed/batch/b{b}", speed_batch, b)
    for s in DRAFTERS:
        add(f"speed/drafting/{s}", speed_drafting, s)

    def compiled_correctness(dtype: str) -> None:
        for s in names:
            if s in on:
                add(f"correct/{dtype}/compiled/{s}", check_strategy, s, dtype, True)
        add(f"tree/{dtype}/compiled", check_tree, dtype, True)

    compiled_correctness("bf16")  # what a GPU runs by default
    for d in ("greedy_compiled", "hf_static"):
        add(f"speed/decode/{d}", speed_decode, d)
    # a case per pass size: each compiles one more bucket, so a slow compile costs one point, not the curve
    for k in opt.ks:
        if k > 1:
            add(f"speed/verification/compiled/k{k}", speed_verification, [k], True)
    compiled_correctness("fp32")
    if opt.cases:
        cases = [c for c in cases if any(fnmatch.fnmatch(c.name, pat) for pat in opt.cases)]
    return [c for c in cases if not any(fnmatch.fnmatch(c.name, pat) for pat in opt.skip)]


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise CaseTimeout in the main thread after `seconds` (no limit elsewhere: signals need it)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"ran past its {seconds:.0f} s limit; raise --case-timeout-s or --budget-s")

    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def error_record(e: BaseException) -> dict[str, Any]:
    """The error as one line, and the innermost frames (file:line function) to find it by."""
    frames = traceback.extract_tb(e.__traceback__)[-4:]
    return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}",
            "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames]}


def _now(device: torch.device) -> float:
    try:
        return clock(device)
    except Exception:  # a failed case may leave the device unusable; the runner still times the rest
        return clock(None)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception:  # a broken context is recorded by the next case that touches it
            pass


def run_cases(cases: list[Case], out: Path, meta: dict[str, Any], device: torch.device, budget_s: float,
              case_timeout_s: float, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every case in isolation, rewriting the json and md files after each one."""
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {**meta, "cases": {}, "finished": False}
    start = _now(device)
    for i, case in enumerate(cases):
        left = budget_s - (_now(device) - start)
        entry: dict[str, Any] = {"status": "skipped", "seconds": 0.0}
        if left <= 0:
            entry["error"] = f"time budget of {budget_s:.0f} s spent; rerun with --cases '{case.name}'"
        else:
            t0 = _now(device)
            try:
                with time_limit(min(case_timeout_s, left)):
                    figures = case.run()
                entry["status"] = "passed" if figures.get("passed", True) else "failed"
                entry["result"] = figures
            except Exception as e:  # isolate: record it, run the rest
                entry["status"] = "error"
                entry.update(error_record(e))
            finally:
                _release(device)
            entry["seconds"] = _now(device) - t0
        result["cases"][case.name] = entry
        result["summary"] = {s: sum(c["status"] == s for c in result["cases"].values()) for s in STATUSES}
        result["seconds"] = _now(device) - start
        result["finished"] = i == len(cases) - 1
        write(result, out)
        log(f"[{i + 1}/{len(cases)}] {case.name}: {entry['status']} ({entry['seconds']:.1f} s)"
            + (f" {entry['error']}" if "error" in entry else ""))
    if not cases:
        write(result, out)
    return result


def write(result: dict[str, Any], out: Path) -> None:
    """Replace both files whole, so a reader (or a run killed mid-write) never sees half of one."""
    for name, text in (("gpu_check.json", json.dumps(result, indent=2, default=str)),
                       ("gpu_check.md", to_markdown(result))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


# --- the report -------------------------------------------------------------------------------------


def _cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return ""
    r = entry.get("result") or {}
    if entry["status"] in ("error", "skipped"):
        return entry["status"]
    mark = "ok" if entry["status"] == "passed" else "FAIL"
    if "identical" in r:
        return f"{mark} {r['identical']:.2f} ({r['max_deficit']:.2g})"
    return mark


def to_markdown(r: dict[str, Any]) -> str:
    cases: dict[str, dict[str, Any]] = r.get("cases", {})
    s = r.get("summary", {})
    lines = [f"# specdec.gpu_check on {r.get('device_name', '?')}", "",
             f"`{r.get('command', '')}` ({r.get('date', '')}; torch {r.get('torch', '?')}, transformers "
             f"{r.get('transformers', '?')}; fp32 matmul precision {r.get('float32_matmul_precision', '?')})", "",
             f"**{s.get('passed', 0)} passed, {s.get('failed', 0)} failed, {s.get('error', 0)} errors, "
             f"{s.get('skipped', 0)} skipped** in {r.get('seconds', 0.0):.0f} s"
             + ("" if r.get("finished") else " (run not finished)"), ""]
    strategies = list(dict.fromkeys(k.split("/")[3] for k in cases if k.startswith("correct/")))
    if strategies:
        cols = [("fp32", "eager"), ("fp32", "compiled"), ("bf16", "eager"), ("bf16", "compiled")]
        lines += ["## Correctness on the tiny model", "",
                  "Each cell: share of outputs identical to the reference (fp32: CPU greedy; bf16: the device's "
                  "eager bf16 greedy) and, in brackets, the largest logit deficit of an output token below the "
                  f"reference's argmax (ties up to {TIE['fp32']:g} in fp32, {TIE['bf16']:g} in bf16 pass).", "",
                  f"The batched column: {BATCH} slots decoding the prompts together (eager), against CPU fp32 greedy.",
                  "", "| strategy | " + " | ".join(f"{d} {m}" for d, m in cols) + " | fp32 batched |",
                  "|---" * (len(cols) + 2) + "|"]
        for name in strategies:
            cells = [_cell(cases.get(f"correct/{d}/{m}/{name}")) for d, m in cols]
            cells.append(_cell(cases.get(f"batch/fp32/{name}")))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    other = {k: v for k, v in cases.items() if not k.startswith(("correct/", "speed/", "batch/"))}
    if other:
        lines += ["## Tree pass and sampling", "", "| case | status | figures |", "|---|---|---|"]
        for k, v in other.items():
            figures = {a: b for a, b in (v.get("result") or {}).items() if a != "passed"}
            lines.append(f"| {k} | {v['status']} | {_short(figures) if figures else v.get('error', '')} |")
        lines.append("")
    lines += _speed_markdown(cases)
    problems = {k: v for k, v in cases.items() if v["status"] in ("error", "skipped")}
    if problems:
        lines += ["## Errors and skipped cases", ""]
        lines += [f"- `{k}`: {v.get('error', '')}" + (f" (at {'; '.join(v['where'])})" if v.get("where") else "")
                  for k, v in problems.items()]
        lines.append("")
    return "\n".join(lines)


def _short(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    if isinstance(x, dict):
        return ", ".join(f"{k}: {_short(v)}" for k, v in x.items())
    return str(x)


def _speed_markdown(cases: dict[str, dict[str, Any]]) -> list[str]:
    def res(name: str) -> dict[str, Any]:
        return cases.get(name, {}).get("result") or {}

    weights, bw = res("speed/weights"), res("speed/bandwidth")
    if not any(k.startswith("speed/") for k in cases):
        return []
    lines = [f"## Speed: random weights, {weights.get('shape', '?')} shape, {weights.get('dtype', '?')}", ""]
    bound = None
    if weights and bw:
        bound = weights["weight_bytes"] / bw["gb_per_s"] / 1e6
        lines += [f"- weights read per token {weights['weight_bytes'] / 1e6:.1f} MB; bandwidth {bw['gb_per_s']:.0f} "
                  f"GB/s ({bw['method']}); bound {bound:.3f} ms/token", ""]
    lines += ["| decoder | how | ms/token | tokens/s | of bandwidth |", "|---|---|---|---|---|"]
    for d in DECODERS:
        c = cases.get(f"speed/decode/{d}")
        if c is None:
            continue
        r = c.get("result") or {}
        if not r:
            lines.append(f"| {d} | {c['status']} | | | |")
            continue
        frac = f"{bound / r['ms_per_token']:.0%}" if bound else ""
        lines.append(f"| {d} | {r.get('how', '')} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} | {frac} |")
    ver = {"eager": res("speed/verification/eager"), "compiled": {"ms": {}, "ratio": {}}}
    for k, c in cases.items():
        if k.startswith("speed/verification/compiled/") and c.get("result"):
            for part in ("ms", "ratio"):
                ver["compiled"][part].update(c["result"][part])
    ks = list(dict.fromkeys(k for v in ver.values() for k in v.get("ms", {})))
    if ks:
        lines += ["", "| k new tokens | eager ms | eager / k=1 | compiled ms | compiled / k=1 |",
                  "|---|---|---|---|---|"]
        for k in ks:
            cells = []
            for m in ("eager", "compiled"):
                v = ver[m]
                cells += [f"{v['ms'][k]:.2f}", f"{v['ratio'][k]:.2f}"] if k in v.get("ms", {}) else ["", ""]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    batches = {k: c for k, c in cases.items() if k.startswith("speed/batch/")}
    if batches:
        lines += ["", "| greedy, batched (eager) | tokens/s, all slots | ms per step | tokens/s per slot |",
                  "|---|---|---|---|"]
        for k, c in batches.items():
            r = c.get("result") or {}
            lines.append(f"| {r['slots']} slots | {r['tokens_per_s']:.1f} | {r['ms_per_step']:.2f} | "
                         f"{r['tokens_per_s'] / r['slots']:.1f} |" if r else f"| {k} | {c['status']} | | |")
    drafts = {k.rsplit("/", 1)[1]: v for k, v in cases.items() if k.startswith("speed/drafting/")}
    if drafts:
        lines += ["", "| strategy | drafting ms/step | target step ms | draft / target |", "|---|---|---|---|"]
        for name, c in drafts.items():
            r = c.get("result") or {}
            if r:
                lines.append(f"| {name} | {r['draft_ms']:.2f} | {r['step_ms']:.2f} | {r['draft_to_step']:.3f} |")
            else:
                lines.append(f"| {name} | {c['status']} | | |")
    return [*lines, ""]


def parse(argv: list[str] | None) -> Options:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), help="speed cases' model: 8b (default on cuda) or tiny")
    p.add_argument("--out", default="experiments/gpu")
    p.add_argument("--check-tokens", type=int, help="tokens per correctness turn (cuda 32, cpu 12)")
    p.add_argument("--prompts", type=int, help="correctness prompts, at most 4 (cuda 4, cpu 2)")
    p.add_argument("--new-tokens", type=int, help="tokens per speed turn (8b 64, tiny 16)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--context", type=int, help="speed prompts' length and the verification context (8b 256, tiny 32)")
    p.add_argument("--ks", help="verification pass sizes (8b 1,2,4,8,16,32,64; tiny 1,2,4)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batches", help="slots of the batched speed cases (8b 1,4,16; tiny 1,4)")
    p.add_argument("--samples", type=int, default=2000, help="draws per chi-square test")
    p.add_argument("--sampling-seed", type=int, default=1234, help="the chi-square tests' generator seed")
    p.add_argument("--budget-s", type=float, help="stop starting cases after this many seconds (cuda 440)")
    p.add_argument("--case-timeout-s", type=float, default=240.0)
    p.add_argument("--compiled-strategies", help="'all' or a comma list (cuda all; cpu "
                   f"{','.join(CPU_COMPILED)})")
    p.add_argument("--cases", default="", help="comma list of fnmatch patterns, e.g. 'speed/*,tree/*'")
    p.add_argument("--skip", default="", help="comma list of fnmatch patterns of cases to leave out")
    a = p.parse_args(argv)
    cpu = not a.device.startswith("cuda")
    shape = a.shape or ("tiny" if cpu else "8b")
    big = shape != "tiny"
    compiled = a.compiled_strategies or ("all" if not cpu else ",".join(CPU_COMPILED))
    return Options(
        device=a.device, shape=shape, out=Path(a.out),
        check_tokens=a.check_tokens or (12 if cpu else 32), check_prompts=min(a.prompts or (2 if cpu else 4), 4),
        new_tokens=a.new_tokens or (64 if big else 16), rounds=a.rounds, speed_prompts=2,
        context=a.context or (256 if big else 32),
        ks=[int(k) for k in (a.ks or ("1,2,4,8,16,32,64" if big else "1,2,4")).split(",")], reps=a.reps,
        batches=[int(b) for b in (a.batches or ("1,4,16" if big else "1,4")).split(",")],
        samples=a.samples, sampling_seed=a.sampling_seed,
        budget_s=a.budget_s if a.budget_s is not None else (440.0 if not cpu else 900.0),
        case_timeout_s=a.case_timeout_s,
        compiled_strategies=None if compiled == "all" else tuple(compiled.split(",")),
        cases=tuple(c for c in a.cases.split(",") if c), skip=tuple(c for c in a.skip.split(",") if c))


def main(argv: list[str] | None = None) -> int:
    import transformers

    opt = parse(argv)
    if opt.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device visible; run on a GPU machine or pass --device cpu --shape tiny", file=sys.stderr)
        return 2
    dev = torch.device(opt.device)
    meta = {"command": " ".join(["python -m specdec.gpu_check", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": opt.device, "shape": opt.shape,
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "options": {k: v for k, v in dataclasses.asdict(opt).items() if k != "out"}}
    threads = torch.get_num_threads()
    if dev.type == "cpu" and opt.shape == "tiny":
        torch.set_num_threads(1)  # tiny matrices: threads only add OpenMP spinning on a shared CPU
    try:
        models = Models(opt)
        result = run_cases(all_cases(models), opt.out, meta, dev, opt.budget_s, opt.case_timeout_s)
    finally:
        torch.set_num_threads(threads)
    summary = result["summary"] if result["cases"] else "no cases"
    print(f"wrote {opt.out / 'gpu_check.md'} and gpu_check.json: {summary}")
    return 0 if result["cases"] and all(c["status"] == "passed" for c in result["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
