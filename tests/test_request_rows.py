"""EAGLE's request rows: the request's tokens outside a drafter's kept rows, scored by the target's head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_draws_follow, speculative_rounds
from omegaconf import OmegaConf

from heads.eagle import EagleTrainable, load_eagle
from specdec.cli_checks import CONFIG_DIR
from specdec.engine.sampling import SamplingParams, warp
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.loader import LoadedModel, load_model
from specdec.strategies.base import DecodeState, GenerationParams
from specdec.strategies.eagle import EagleStrategy
from specdec.strategies.eagle_tree import Eagle2
from specdec.strategies.greedy import Greedy
from specdec.strategies.request_rows import RequestRows, output_rows
from specdec.strategies.schedules import FixedLength

# kept rows come from ids 100..300 (below); these prompts are mostly outside them
PROMPTS = [list(range(20, 44)) + [150, 151], [7, 9, 11, 13, 7, 9, 11, 13, 200, 60, 61, 62, 63, 64, 65]]


@pytest.fixture(scope="module")
def narrow(tiny_target: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A drafter trained on 64 kept rows, all among ids 100..300, sharpened so that it drafts confidently."""
    trainable = EagleTrainable(kept_vocab=64, save_dtype="fp32")
    module = trainable.build(tiny_target, [{"input_ids": list(range(100, 300)), "labels": list(range(101, 301))}])
    with torch.no_grad():
        module.net.fc.weight.mul_(8)
    folder = tmp_path_factory.mktemp("narrow")
    trainable.save(module, folder, {"steps": 0})
    return folder


def test_rows_add_the_requests_tokens_outside_the_kept_ones_in_order() -> None:
    head = torch.randn(12, 4)
    rows = RequestRows(torch.tensor([3, 5, 7]), head)
    rows.reset([5, 8, 8, 2, 3])
    assert rows.token_ids.tolist() == [3, 5, 7, 8, 2]
    logits, h = torch.randn(3), torch.randn(4)
    got = rows.extend(logits, h)
    assert torch.equal(got[:3], logits)
    torch.testing.assert_close(got[3:], head[[8, 2]] @ h)
    rows.add([2, 9, 7, 9])
    assert rows.token_ids.tolist() == [3, 5, 7, 8, 2, 9]
    assert rows.extend(torch.randn(2, 3), torch.randn(2, 4)).shape == (2, 6)  # a tree's rows
    rows.reset([1])  # a new request forgets the last one's tokens
    assert rows.token_ids.tolist() == [3, 5, 7, 1]
    rows.reset([])
    assert rows.extend(logits, h) is logits


@pytest.fixture(scope="module")
def kernels_target() -> LoadedModel:
    """tiny-llama (tiny_target's weights) on the CPU kernels, where drafter passes are one compiled call."""
    if not cpu_kernels.available():
        pytest.skip("numba is not installed")
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "model" / "tiny-llama.yaml"), resolve=True)
    assert isinstance(cfg, dict)
    cfg.pop("_target_")
    return load_model(**(cfg | {"matmul": "numba"}))


@pytest.mark.parametrize("matmul", ["torch", "numba"])
@pytest.mark.parametrize("tree", [False, True])
def test_request_rows_get_proposed_and_the_output_stays_greedys(request: pytest.FixtureRequest, narrow: Path,
                                                                 tree: bool, matmul: str) -> None:
    tiny_target = request.getfixturevalue("tiny_target" if matmul == "torch" else "kernels_target")

    def build(request_rows: bool) -> EagleStrategy:
        if tree:
            return Eagle2(tiny_target, "eagle2", load_eagle(str(narrow)), depth=3, topk=3, nodes=6, max_len=512,
                          prefill_chunk=64, request_rows=request_rows)
        return EagleStrategy(tiny_target, "eagle", load_eagle(str(narrow)), FixedLength(3), 512, 64,
                             request_rows=request_rows)

    with_rows, without = build(True), build(False)
    assert (with_rows.kernel is not None) == (matmul == "numba")  # the one-call drafter pass, as in real runs
    with pytest.raises(SpecdecError, match="request's own rows at generation.batch_size=1 only"):
        with_rows.batch_decoder(2, GenerationParams(8))
    kept = set(load_eagle(str(narrow)).bind(tiny_target).token_ids.tolist())
    greedy = Greedy(tiny_target, "greedy", 512, 64)
    for prompt in PROMPTS:
        expected = greedy.generate(prompt, GenerationParams(40), 0).output_ids
        assert with_rows.generate(prompt, GenerationParams(40), 0).output_ids == expected
        assert without.generate(prompt, GenerationParams(40), 0).output_ids == expected
    for strategy, rows in ((with_rows, True), (without, False)):
        outside = []
        known = set(PROMPTS[0])
        for state, proposal, _, _ in speculative_rounds(strategy, PROMPTS[0], 8, GenerationParams(100)):
            drafted = [int(t) for t in proposal.tokens if int(t) not in kept]
            assert set(drafted) <= known  # only the request's tokens, as far as the last round knew them
            outside += drafted
            known = set(state.ids)
        # the request's own tokens are proposed with the rows, never without them
        assert (len(outside) > 0) == rows


def test_request_rows_keep_the_target_distribution_when_sampling(tiny_target: LoadedModel, narrow: Path) -> None:
    sp = SamplingParams(temperature=0.7)
    prompt = PROMPTS[0]
    strategy = EagleStrategy(tiny_target, "eagle", load_eagle(str(narrow)), FixedLength(3), 256, 64,
                             request_rows=True)
    base, params = len(prompt) - 1, GenerationParams(8, sp)
    counts = torch.zeros(tiny_target.vocab_size)
    out = strategy.engine.prefill(prompt[:-1])
    proposer = strategy.make_proposer()
    drafted_outside = 0
    kept = set(strategy.net.token_ids.tolist())  # type: ignore[union-attr]
    for seed in range(300):
        state = DecodeState(list(prompt), base, params, torch.Generator().manual_seed(seed))
        proposer.start(state, out)
        proposal = proposer.propose(state)
        assert proposal is not None and proposal.probs is not None
        drafted_outside += int(proposal.tokens[0]) not in kept
        verdict, _ = strategy._step(state, proposal)
        counts[verdict.tokens[0]] += 1
        strategy.engine.rollback(base)
    assert drafted_outside > 0  # q really spans the added rows
    assert_draws_follow(counts, warp(strategy.engine.prefill(prompt).logits[-1], sp))


def test_output_rows_are_the_heads_and_eagle3_refuses_them(tiny_target: LoadedModel) -> None:
    head = output_rows(tiny_target)
    assert head.shape == (tiny_target.vocab_size, tiny_target.hidden_size)

    class Tapped:  # stands for an EAGLE-3 drafter: it reads the target's tapped layers
        token_ids = torch.arange(10)
        target_layers = (0,)

    with pytest.raises(SpecdecError, match="set request_rows=false"):
        EagleStrategy(tiny_target, "eagle3", Tapped(), FixedLength(3), 256, 64,  # type: ignore[arg-type]
                      request_rows=True)
