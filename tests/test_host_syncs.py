"""One host read per target step: what a GPU decode loop can afford.

On a GPU every tensor-to-Python conversion (`.item`, `.tolist`, `.cpu`, `.numpy`, `bool(t)`, `int(t)`)
waits for the device. The loop's sanctioned reads are the `@host_read` functions (engine/sampling.py);
this test counts them and every conversion made outside them, on the torch path on the CPU, where the
same Python runs as on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specdec.engine.engine import StaticEngine
from specdec.engine.sampling import HOST_READS
from specdec.models.loader import LoadedModel
from specdec.strategies.base import DecodeState, GenerationParams, SpeculativeStrategy
from specdec.strategies.draft import DraftStrategy
from specdec.strategies.eagle import EagleStrategy
from specdec.strategies.greedy import Greedy
from specdec.strategies.prompt_lookup import PromptLookup
from specdec.strategies.schedules import FixedLength
from specdec.verify import Proposal, Verdict
from tests.helpers import make_looping_target, prompts

CONVERSIONS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """reads(): sanctioned reads plus stray conversions since the fixture started."""
    stray = [0]
    for name in CONVERSIONS:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: object, _original: object = original, **kwargs: object) -> object:
            if HOST_READS.inside == 0:
                stray[0] += 1
            return _original(self, *args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, name, counted)
    start = HOST_READS.count
    return lambda: HOST_READS.count - start + stray[0]


class DeviceTree:
    """A proposer whose tokens are computed on the device (a fixed 5-node tree from the target's own
    hidden state, as heads would): nothing about them is known on the host until verification."""

    parents = [0, 0, 1, 1, 2]

    def __init__(self, target: LoadedModel) -> None:
        self.head = target.model.lm_head
        self.hidden: torch.Tensor | None = None

    def start(self, state: DecodeState, out: object) -> None:
        self.hidden = out.hidden[-1]  # type: ignore[attr-defined]

    def propose(self, state: DecodeState) -> Proposal:
        assert self.hidden is not None
        top = self.head(self.hidden).topk(2).indices  # (2,) on the device
        return Proposal(top[[0, 1, 0, 1, 0]], self.parents)

    def commit(self, state: DecodeState, verdict: Verdict, out: object) -> None:
        self.hidden = out.hidden[verdict.nodes[-1] if verdict.nodes else 0]  # type: ignore[attr-defined]


class TreeStrategy(SpeculativeStrategy):
    def make_proposer(self) -> DeviceTree:
        return DeviceTree(self.target)


def eagle(target: LoadedModel, request_rows: bool) -> EagleStrategy:
    """EAGLE's chain from an untrained drafter over 64 kept rows; with `request_rows` it also scores the
    request's other tokens, whose rows it gathers on the device as they appear."""
    from heads.eagle import EagleTrainable

    ids = prompts(target)["repeating"]
    trainable = EagleTrainable(kept_vocab=64)
    net = trainable.build(target, [{"input_ids": ids, "labels": ids[1:] + [0]}]).net.eval()
    assert trainable.kept_ids is not None
    net.token_ids = trainable.kept_ids[8:]  # the prompt's most frequent tokens left outside the kept rows
    net.lm_head.weight.data = net.lm_head.weight.data[8:]
    return EagleStrategy(target, "eagle", net, FixedLength(3), 256, request_rows=request_rows)


@pytest.mark.parametrize("kind", ["greedy", "chain", "tree", "draft", "eagle", "eagle_rows"])
@pytest.mark.parametrize("static", [False, True])
def test_at_most_one_host_read_per_step(kind: str, static: bool, host_reads: Callable[[], int]) -> None:
    target = make_looping_target()
    strategy: SpeculativeStrategy = {
        "greedy": lambda: Greedy(target, "greedy", max_len=256),
        "chain": lambda: PromptLookup(target, max_len=256),
        "tree": lambda: TreeStrategy(target, "tree", max_len=256),
        # the target drafts for itself: every drafted token accepted, none of them read one by one
        "draft": lambda: DraftStrategy(target, "draft", target, FixedLength(4), 256),
        "eagle": lambda: eagle(target, False),
        "eagle_rows": lambda: eagle(target, True),
    }[kind]()
    if static:  # the static-shape step without compiling: the same Python as the compiled one
        strategy.engine = StaticEngine(target.model, 256, static=True)
    prompt = prompts(target)["repeating"]
    strategy.generate(prompt, GenerationParams(24), 0)  # warm-up: lazy set-up may read once
    before = host_reads()
    res = strategy.generate(prompt, GenerationParams(24), 0)
    reads = host_reads() - before
    # the prefill's first token is one read; then one per decode step, whatever was proposed
    assert reads <= res.decode_steps + 1, f"{reads} host reads for {res.decode_steps} steps"
    if kind not in ("greedy", "eagle", "eagle_rows"):  # an untrained drafter's tokens may all be rejected
        assert res.accepted > 0  # the proposals were real, and verified
    if kind == "eagle_rows":
        assert len(strategy.rows.added) > 0  # type: ignore[attr-defined]  # rows were gathered while decoding


def test_the_counter_sees_a_stray_read(host_reads: Callable[[], int]) -> None:
    before = host_reads()
    t = torch.ones(3)
    _ = t.sum().item()
    _ = bool(t.all())
    assert host_reads() - before == 2
