"""Every strategy's state lives on the target's device and in its dtype (issue 32: right on every device).

There is no GPU on the test machines, so the target is loaded onto torch's lazy-tensor device, whose
TorchScript backend computes on the CPU: a real second device with real values (fingerprint checks
and checkpoint loading run as they would on CUDA), whose tensors refuse to mix with CPU ones as CUDA's
do. It runs no complex arithmetic (the target's rope), so the target never runs there: each strategy
is built around it, its proposer made, and every tensor reachable from them is checked, then the
Medusa proposers, which need only a hidden state, propose from one on that device. The target is bf16
there, as on a GPU, so a drafter left in float32 shows as well.

Where the decode loop draws (temperature > 0) it uses one generator, made on the engine's device; the last
test runs every strategy on the CPU and checks that no other generator is made along the way.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import eagle3_checkpoint
from torch import Tensor

from heads.draft_model import DraftTrainable, load_draft
from heads.eagle import EagleTrainable, load_eagle
from heads.interop.eagle_layout import load_eagle_layout
from heads.medusa import medusa_heads
from specdec.engine.engine import ForwardOut
from specdec.engine.sampling import SamplingParams
from specdec.models.loader import LoadedModel, load_model
from specdec.strategies import hybrid as hybrid_mod
from specdec.strategies import medusa as medusa_mod
from specdec.strategies import prompt_lookup as prompt_lookup_mod
from specdec.strategies import schedules as schedules_mod
from specdec.strategies.base import DecodeState, GenerationParams, SpeculativeStrategy
from specdec.strategies.draft import DraftStrategy
from specdec.strategies.eagle import EagleStrategy
from specdec.strategies.eagle_tree import Eagle2
from specdec.strategies.greedy import Greedy
from specdec.strategies.hybrid import LookupHybrid
from specdec.strategies.lookahead import Lookahead
from specdec.strategies.medusa import Medusa
from specdec.strategies.prompt_lookup import PromptLookup
from specdec.strategies.schedules import CostAware, FixedLength
from specdec.verify import Verdict

MAX_LEN, CHUNK = 96, 32
KEPT = 128  # drafters and heads keep a reduced vocabulary, so their id maps are tensors to place too
# Floating tensors that stay float32 whatever the model's dtype: rope's frequencies (the target's own too).
FLOAT32_BY_DESIGN = (".inv_freq",)
SKIP_ATTRS = {"tokenizer"}


# --------------------------------------------------------------------------------------------------
# Finding every tensor
# --------------------------------------------------------------------------------------------------


def _ours(obj: object) -> bool:
    """Objects whose attributes are walked besides modules: the project's and dataclasses (not libraries')."""
    module = type(obj).__module__ or ""
    return dataclasses.is_dataclass(obj) or module.split(".")[0] in ("specdec", "heads", "test_placement", "helpers")


def reachable(**roots: object) -> Iterator[tuple[str, Tensor | torch.Generator]]:
    """(path, object) of every tensor and generator reachable from `roots` through attributes, containers,
    closures, bound methods and partials; each object once."""
    seen: set[int] = set()
    stack: list[tuple[object, str]] = [(root, name) for name, root in reversed(roots.items())]
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type, np.ndarray,
                                                               torch.dtype, torch.device)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (Tensor, torch.Generator)):
            yield path, obj
        elif isinstance(obj, dict):
            stack += [(v, f"{path}[{k!r}]") for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        elif isinstance(obj, types.FunctionType):  # e.g. a lambda that builds a drafter's transformers twin
            for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                try:
                    stack.append((cell.cell_contents, f"{path}<{var}>"))
                except ValueError:  # an empty cell
                    pass
        elif isinstance(obj, types.MethodType):
            stack.append((obj.__self__, f"{path}.__self__"))
        elif isinstance(obj, functools.partial):
            stack += [(obj.func, f"{path}.func"), (obj.args, f"{path}.args"), (obj.keywords, f"{path}.keywords")]
        elif isinstance(obj, torch.nn.Module):  # parameters, buffers and submodules by their own names
            fields = dict(vars(obj))
            for slot in ("_parameters", "_buffers", "_modules"):
                fields |= fields.pop(slot)
            stack += [(v, f"{path}.{k}") for k, v in fields.items() if k not in SKIP_ATTRS]
        elif _ours(obj) and hasattr(obj, "__dict__"):
            stack += [(v, f"{path}.{k}") for k, v in vars(obj).items() if k not in SKIP_ATTRS]


def on(device: torch.device, target: torch.device) -> bool:
    """`device` is the target's (torch.device("cuda") names whichever GPU is current: cuda:0 then)."""
    return device.type == target.type and (target.index is None or device.index == target.index)


def misplaced(target: LoadedModel, **roots: object) -> list[str]:
    """What is not on the target's device or, floating, not in its dtype; generators included."""
    bad = []
    for path, obj in reachable(**roots):
        if not on(obj.device, target.device):
            bad.append(f"{path}: {type(obj).__name__} on {obj.device}")
        elif (isinstance(obj, Tensor) and obj.is_floating_point() and obj.dtype != target.dtype
              and not path.endswith(FLOAT32_BY_DESIGN)):
            bad.append(f"{path}: {obj.dtype}, not the target's {target.dtype}")
    return bad


def test_the_walker_finds_tensors_in_modules_closures_and_containers() -> None:
    class Holder:  # a plain project object (this module counts as one)
        def __init__(self) -> None:
            self.net = torch.nn.Linear(2, 2)
            self.ids = [torch.zeros(1, dtype=torch.long)]
            w = torch.ones(1)
            self.factory = lambda: w
            self.gen = torch.Generator()

    found = dict(reachable(h=Holder()))
    assert {"h.net.weight", "h.net.bias", "h.ids[0]", "h.factory<w>", "h.gen"} <= set(found)
    fake = LoadedModel("t", Path("."), None, None, "compact", torch.bfloat16, torch.device("meta"))
    assert len(misplaced(fake, h=Holder())) == 5  # on the CPU, and float32 where floating


# --------------------------------------------------------------------------------------------------
# Targets, drafters and heads
# --------------------------------------------------------------------------------------------------


@functools.cache
def _start_lazy() -> str | None:
    """Start torch's lazy-tensor backend once per process (a second start raises); None, or why it is missing."""
    try:
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
    except (ImportError, RuntimeError, AttributeError) as e:
        return str(e)
    return None


def lazy_device() -> None:
    """Skip unless the lazy-tensor device (a second device that computes on the CPU) is available."""
    why = _start_lazy()
    if why is not None:
        pytest.skip(f"torch's lazy-tensor device is unavailable ({why}); the placement test needs a second device")


@pytest.fixture(scope="module")
def lazy_target() -> LoadedModel:
    """tiny-llama in bf16 on the lazy-tensor device (a second device that computes on the CPU)."""
    lazy_device()
    return load_model("tiny-llama", "builtin:tiny-llama", dtype="bf16", device="lazy", matmul="torch")


@pytest.fixture(scope="module")
def cpu_target() -> LoadedModel:
    return load_model("tiny-llama", "builtin:tiny-llama", matmul="torch")


@pytest.fixture(scope="module")
def saved(cpu_target: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random drafters and heads for tiny-llama, saved the way trained ones are (reduced vocabularies)."""
    rows = [{"input_ids": list(range(3, 200)), "labels": [-100] * 20 + list(range(100, 300))}]
    out: dict[str, Path] = {}
    for name, trainable in (("draft", DraftTrainable(layers=1, kept_vocab=KEPT, save_dtype="fp32")),
                            ("eagle", EagleTrainable(kept_vocab=KEPT, save_dtype="fp32"))):
        out[name] = tmp_path_factory.mktemp(name)
        trainable.save(trainable.build(cpu_target, rows), out[name], {"steps": 0})  # type: ignore[attr-defined]
    out["medusa"] = tmp_path_factory.mktemp("medusa")
    medusa_heads(cpu_target, num_heads=3, root_input=True, head_vocab=KEPT, seed=3).save(out["medusa"])
    return out


@pytest.fixture(autouse=True)
def flat_pass_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Strategies time the target at start-up; a flat curve instead (the lazy device cannot run the target)."""
    def flat(engine: Any, sizes: list[int], *args: Any, **kwargs: Any) -> dict[int, float]:
        return {n: 1.0 + 0.05 * (n - 1) for n in sizes}

    for module in (schedules_mod, hybrid_mod, medusa_mod, prompt_lookup_mod):
        monkeypatch.setattr(module, "pass_cost_curve", flat)


def strategies(saved: dict[str, Path]) -> dict[str, Callable[[LoadedModel], SpeculativeStrategy]]:
    """Every strategy with learned state or buffers, in the variants whose proposers differ."""
    def draft(schedule: Callable[[], Any] = lambda: CostAware(siblings=1)) -> Callable[..., DraftStrategy]:
        return functools.partial(DraftStrategy, name="draft", draft=load_draft(str(saved["draft"])),
                                 schedule=schedule())

    def eagle(**kw: Any) -> Callable[..., EagleStrategy]:  # as configs/strategy/eagle.yaml: chains, second choices
        return functools.partial(EagleStrategy, name="eagle", drafter=load_eagle(str(saved["eagle"])),
                                 schedule=CostAware(siblings=1), **kw)

    def medusa(rows: int | None = None, **kw: Any) -> Callable[..., Medusa]:
        heads = functools.partial(medusa_heads, path=str(saved["medusa"]), rows=rows)  # as Hydra builds it
        return functools.partial(Medusa, name="medusa", **({"heads": heads} | kw))

    def sequential(**kw: Any) -> Callable[..., Medusa]:
        heads = functools.partial(medusa_heads, num_heads=3, num_layers=2, root_input=True, sequential=True,
                                  head_vocab=KEPT, seed=5)
        return functools.partial(Medusa, name="hydra", heads=heads, **kw)

    def hybrid(name: str, inner: Callable[..., SpeculativeStrategy]) -> Callable[[LoadedModel], LookupHybrid]:
        return lambda t: LookupHybrid(t, name, inner, MAX_LEN, CHUNK, num_draft_tokens=4)

    plain: dict[str, Callable[..., SpeculativeStrategy]] = {
        "greedy": functools.partial(Greedy, name="greedy"),
        "prompt_lookup": functools.partial(PromptLookup, num_candidates=2),
        "lookahead": functools.partial(Lookahead, window=3, level=3, guesses=2),
        "draft": draft(),
        "draft_lm": lambda target, **kw: DraftStrategy(target, "draft_lm", target, FixedLength(3), **kw),
        "eagle": eagle(),
        "eagle_rows": eagle(request_rows=True),  # the request's own rows, gathered from the target's head
        # rows past the trained ones: the widened head is built where the target is too
        "eagle2": functools.partial(Eagle2, name="eagle2", drafter=load_eagle(str(saved["eagle"]), rows=2 * KEPT),
                                    depth=2, topk=2, nodes=3),
        "medusa": medusa(rows=2 * KEPT, tree="default", copy_tokens=3),
        "medusa_dynamic": medusa(tree="dynamic", size="cost", acceptance="exact"),
        "hydra_copy": sequential(tree="dynamic", size="cost", copy_tokens=2),
        "hydra_fixed": sequential(tree="default"),
    }
    built: dict[str, Callable[[LoadedModel], SpeculativeStrategy]] = {
        name: functools.partial(make, max_len=MAX_LEN, prefill_chunk=CHUNK) for name, make in plain.items()}
    built |= {"draft_lookup": hybrid("draft_lookup", draft(lambda: FixedLength(3))),
              "eagle_lookup": hybrid("eagle_lookup", eagle()),
              "medusa_lookup": hybrid("medusa_lookup", medusa(tree="default"))}
    return built


NAMES = ["greedy", "prompt_lookup", "lookahead", "draft", "draft_lm", "eagle", "eagle_rows", "eagle2", "medusa",
         "medusa_dynamic", "hydra_copy", "hydra_fixed", "draft_lookup", "eagle_lookup", "medusa_lookup"]


def test_a_published_eagle3_drafter_is_built_on_the_targets_device(tmp_path: Path) -> None:
    """EAGLE-3 drafters are read from their published files on the CPU and built per target (bind): the
    built drafter, its draft-to-target id map and the proposer's state land on the target's device."""
    lazy_device()
    deep = load_model("tiny-llama", "builtin:tiny-llama", dtype="bf16", device="lazy", matmul="torch",
                      tiny={"num_hidden_layers": 4})
    eagle3_checkpoint(tmp_path, deep, D=48, extra={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]})
    strategy = EagleStrategy(deep, "eagle3", load_eagle_layout(str(tmp_path)), FixedLength(3), MAX_LEN, CHUNK)
    proposer = strategy.make_proposer()
    bad = misplaced(deep, strategy=strategy, proposer=proposer)
    assert not bad, f"eagle3: {len(bad)} misplaced, e.g.\n" + "\n".join(bad[:40])


def test_every_strategy_is_covered(saved: dict[str, Path]) -> None:
    assert sorted(strategies(saved)) == sorted(NAMES)


# --------------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_state_lives_on_the_targets_device_in_its_dtype(lazy_target: LoadedModel, saved: dict[str, Path],
                                                        name: str) -> None:
    strategy = strategies(saved)[name](lazy_target)
    proposer = strategy.make_proposer()
    bad = misplaced(lazy_target, strategy=strategy, proposer=proposer)
    assert not bad, f"{name}: {len(bad)} misplaced, e.g.\n" + "\n".join(bad[:40])


def _fake_out(target: LoadedModel, n: int, seed: int) -> ForwardOut:
    """What a target pass over n tokens would hand the proposer, made up on the target's device."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, target.hidden_size, generator=g)
    logits = torch.randn(n, target.vocab_size, generator=g)
    return ForwardOut(logits.to(target.device), hidden.to(device=target.device, dtype=target.dtype))


@pytest.mark.parametrize("name", ["medusa", "medusa_dynamic", "hydra_copy", "hydra_fixed"])
def test_medusa_proposers_propose_on_the_targets_device(lazy_target: LoadedModel, saved: dict[str, Path],
                                                        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads and proposers run from a hidden state on the device: any CPU tensor they made along the way
    would meet device tensors and fail, as on a GPU."""
    # The lazy backend refuses inference tensors: the heads' @torch.inference_mode() becomes a no-op here
    # (nothing in them requires grad, so nothing is recorded either way).
    monkeypatch.setattr(torch.autograd.grad_mode.inference_mode, "__enter__", lambda self: None)
    monkeypatch.setattr(torch.autograd.grad_mode.inference_mode, "__exit__", lambda self, *exc: None)
    strategy = strategies(saved)[name](lazy_target)
    proposer = strategy.make_proposer()
    prompt = [17, 40, 99, 23] * 4
    state = DecodeState(prompt + [17], len(prompt), GenerationParams(16), None)
    proposer.start(state, _fake_out(lazy_target, len(prompt), 0))
    for step in range(2):
        proposal = proposer.propose(state)
        assert proposal is not None and len(proposal.tokens) == len(proposal.parents) > 0
        assert all(0 <= t < lazy_target.vocab_size for t in proposal.tokens.tolist())
        verdict = Verdict([1], [int(proposal.tokens[0]), 40])
        state.ids += verdict.tokens
        proposer.commit(state, verdict, _fake_out(lazy_target, 1 + len(proposal.tokens), step + 1))
    assert not misplaced(lazy_target, proposer=proposer)


def test_request_rows_gather_and_score_on_the_targets_device(lazy_target: LoadedModel, saved: dict[str, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """EAGLE's request rows (strategies/request_rows.py) are gathered from the target's head and scored against
    a guessed feature on its device, in its dtype (the lazy device cannot run the drafter's rope, so the rows are
    fed and scored directly)."""
    monkeypatch.setattr(torch.autograd.grad_mode.inference_mode, "__enter__", lambda self: None)
    monkeypatch.setattr(torch.autograd.grad_mode.inference_mode, "__exit__", lambda self, *exc: None)
    proposer = strategies(saved)["eagle_rows"](lazy_target).make_proposer()
    rows = proposer.rows  # type: ignore[attr-defined]
    k = int(rows.kept_host[0])  # kept rows come from ids 100..299 (`saved`)
    proposer._offer([k, 400, 401, k])  # type: ignore[attr-defined]  # a turn's start
    proposer._offer([k, 400, 401, k, 402])  # type: ignore[attr-defined]  # then a token the target emitted
    assert rows.added == [400, 401, 402] and len(rows.token_ids) == KEPT + 3
    assert proposer.round.token_ids is rows.token_ids  # type: ignore[attr-defined]
    device, dtype = lazy_target.device, lazy_target.dtype
    scored = rows.extend(torch.zeros(KEPT, device=device, dtype=dtype), torch.ones(lazy_target.hidden_size,
                                                                                  device=device, dtype=dtype))
    assert scored.shape == (KEPT + 3,) and not misplaced(lazy_target, proposer=proposer, scored=scored)


@pytest.mark.parametrize("name", NAMES)
def test_decoding_draws_only_with_the_engines_generator(cpu_target: LoadedModel, saved: dict[str, Path],
                                                        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled turn makes one generator, the loop's, on the engine's device (`new_generator`), and
    nothing along the way keeps or makes another (a CPU generator cannot draw a GPU's tokens)."""
    strategy = strategies(saved)[name](cpu_target)
    real = torch.Generator
    asked: list[torch.device | None] = []

    def spy(device: torch.device | str | None = None) -> torch.Generator:
        asked.append(None if device is None else torch.device(device))
        return real() if device is None else real(device=device)

    monkeypatch.setattr(torch, "Generator", spy)
    params = GenerationParams(8, SamplingParams(temperature=0.8, top_p=0.95))
    res = strategy.generate([17, 40, 99, 23] * 4, params, seed=0)
    monkeypatch.undo()
    assert res.output_ids and asked == [strategy.engine.device]
    last = getattr(strategy, "last_proposer", None)
    assert not [p for p, g in reachable(strategy=strategy, proposer=last) if isinstance(g, torch.Generator)]


def test_an_eagle3_trainable_is_built_on_the_targets_device() -> None:
    """head=eagle3's module, its vocabulary maps and the target rows it scores against are built on the target's
    device (trained in fp32 whatever the target's dtype). Its forward is not run here: the lazy device has no
    complex tensors, which rope uses outside compiled steps."""
    from heads.eagle3_train import Eagle3Trainable

    lazy_device()
    deep = load_model("tiny-llama", "builtin:tiny-llama", dtype="bf16", device="lazy", matmul="torch",
                      tiny={"num_hidden_layers": 8})
    rows = [{"input_ids": list(range(3, 40)), "labels": [-100] * 5 + list(range(100, 132))}]
    trainable = Eagle3Trainable(draft_vocab=KEPT)
    module = trainable.build(deep, rows)
    bad = [line for line in misplaced(deep, module=module, kept=trainable.kept_ids, to_kept=trainable.to_kept)
           if " on " in line]  # device only: the drafter trains in fp32
    assert not bad, "eagle3 training: " + "\n".join(bad[:20])
