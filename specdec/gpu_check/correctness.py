"""The GPU check's correctness cases on the tiny model: every strategy against greedy, a token-tree pass
against each node's path, sampling against the target's law, continuous batching, and the distillation's
batched generation."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from specdec.gpu_check.models import MAX_LEN, Models, Options
from specdec.models.loader import LoadedModel
from specdec.strategies.base import GenerationParams, Strategy, make_engine

# Largest logit deficit of an output token below the reference's argmax that still counts as a tie:
# fp32 passes differ in the last bits only; bf16 logits of a few units carry a step of 1/32, and a
# pass over k tokens (or a fused, compiled one) may round each activation differently from a one-token
# step, which moves logits by several such steps. Both stay below the tiny model's typical gap between
# its first and second choice, and far below where a wrong token (another context's argmax) lands.
TIE = {"fp32": 1e-3, "bf16": 0.25}
TREE_TOL = {"fp32": 1e-3, "bf16": 0.3}  # largest logit difference, tree pass vs each path on its own


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


def check_distill(models: Models, dtype: str) -> dict[str, Any]:
    """The distillation's loop as a GPU runs it (heads/batch_generate.py: one left-padded batch, compiled
    static-shape steps) gives greedy's output; its hidden states match the eager loop's on the device."""
    from dataclasses import replace

    from heads.batch_generate import _generate_batch

    n, prompts = models.opt.check_tokens, models.prompts()
    target = replace(models.tiny(dtype, True), eos_ids=())  # fixed length, as the references
    want, ref = models.reference_outputs(dtype), models.reference(dtype)
    got = _generate_batch(target, prompts, n, static=True)
    eager = _generate_batch(replace(models.tiny(dtype, False), eos_ids=()), prompts, n, static=False)
    worst = max([max(deficits(ref, p, g.continuation)) for p, g, w in zip(prompts, got, want)
                 if g.continuation != w], default=0.0)
    same = [(a.continuation == b.continuation) for a, b in zip(got, eager)]
    drift = max(float(abs(a.hidden.astype("float32") - b.hidden.astype("float32")).max())
                for a, b, s in zip(got, eager, same) if s) if any(same) else None
    return {"identical": sum(g.continuation == w for g, w in zip(got, want)) / len(want), "max_deficit": worst,
            "tie_tolerance": TIE[dtype], "prompts": len(want), "max_hidden_diff_vs_eager": drift,
            "passed": worst <= TIE[dtype] and all(len(g.continuation) == n for g in got)}
