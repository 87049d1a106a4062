"""Medusa heads that also read the tree's root token (`root_input`): shapes, kernels, files, training, decoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fit_on_pairs, random_ids

from heads.medusa import load_heads, medusa_heads
from heads.medusa_train import MedusaTrainable
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.loader import LoadedModel
from specdec.strategies.base import GenerationParams
from specdec.strategies.greedy import Greedy
from specdec.strategies.medusa import Medusa

VOCAB = 512


def test_root_changes_the_guesses_and_zero_init_is_plain(tiny_target: LoadedModel) -> None:
    plain = medusa_heads(tiny_target, num_heads=3, num_layers=2, seed=3)
    rooted = medusa_heads(tiny_target, num_heads=3, num_layers=2, root_input=True)
    rooted.load_state_dict(plain.state_dict(), strict=False)  # same blocks, U still zero
    assert rooted.reads_root and not plain.reads_root
    h = torch.randn(5, 64)
    roots = torch.tensor([1, 2, 3, 4, 5])
    torch.testing.assert_close(rooted(h, roots), plain(h), rtol=0, atol=0)
    with torch.no_grad():
        rooted.root_in.normal_(0, 0.3)
    a, b = rooted(h, roots), rooted(h, roots.flip(0))
    assert not torch.allclose(a, b)
    # one row at a time, through the step path, equals the batched training path
    assert torch.equal(rooted.topk(h[0], 4, root=1), rooted.kept_ids[a[0].topk(4, dim=-1).indices])
    assert torch.equal(rooted.topk(h[0], 4, depth=2, root=1), rooted.kept_ids[a[0, :2].topk(4, dim=-1).indices])
    with pytest.raises(ValueError, match="pass root"):
        rooted.topk(h[0], 4)


def test_root_heads_on_the_cpu_kernels_match_torch(tiny_target: LoadedModel) -> None:
    if not cpu_kernels.available():
        pytest.skip("CPU kernels unavailable")
    heads = medusa_heads(tiny_target, num_heads=3, num_layers=2, seed=4, root_input=True)
    h = torch.randn(64)
    want = heads.features(h, torch.tensor(7)).numpy()  # (3, dim)
    heads.use_cpu_kernels()
    np.testing.assert_allclose(heads._cpu_features(h, 3, 7), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(heads._cpu_features(h, 2, 7), want[:2], rtol=1e-5, atol=1e-5)
    assert not np.allclose(heads._cpu_features(h, 3, 8), want, atol=1e-4)


def test_root_heads_save_and_load(tiny_target: LoadedModel, tmp_path: Path) -> None:
    heads = medusa_heads(tiny_target, num_heads=2, num_layers=1, head_vocab=64, seed=5, root_input=True)
    heads.save(tmp_path / "m")
    loaded = load_heads(tiny_target, tmp_path / "m")
    assert loaded.cfg.root_input and loaded.cfg == heads.cfg
    h, roots = torch.randn(3, 64), torch.tensor([9, 10, 11])
    torch.testing.assert_close(loaded(h, roots), heads(h, roots), rtol=0, atol=0)


def test_root_input_needs_a_block(tiny_target: LoadedModel) -> None:
    with pytest.raises(SpecdecError, match="num_layers >= 1"):
        medusa_heads(tiny_target, num_heads=2, num_layers=0, root_input=True)


@pytest.mark.parametrize("root_input", [False, True])
def test_training_learns_from_the_root(tiny_target: LoadedModel, root_input: bool) -> None:
    trainable = MedusaTrainable(num_heads=2, num_layers=1, head_vocab=None, root_input=root_input)
    module, metrics = fit_on_pairs(trainable, tiny_target)
    # head 0 guesses token t + 2: fixed by the root t + 1 half of the time (odd t + 2), random otherwise
    if root_input:
        assert metrics["top1_0"] > 0.4
        assert float(module.heads.root_in.abs().sum()) > 0
    else:
        assert metrics["top1_0"] < 0.3


def test_proposers_hand_the_heads_the_root(tiny_target: LoadedModel) -> None:
    heads = medusa_heads(tiny_target, num_heads=4, num_layers=1, seed=6, root_input=True)
    seen: list[int | None] = []
    real_topk, real_logprobs = heads.topk, heads.topk_logprobs

    def topk(hidden: torch.Tensor, k: int, depth: int | None = None, root: int | None = None) -> torch.Tensor:
        seen.append(root)
        return real_topk(hidden, k, depth, root)

    def topk_logprobs(hidden: torch.Tensor, k: int, depth: int | None = None,
                      root: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(root)
        return real_logprobs(hidden, k, depth, root)

    heads.topk, heads.topk_logprobs = topk, topk_logprobs  # type: ignore[method-assign]
    prompt = random_ids(12, VOCAB, seed=70)
    want = Greedy(tiny_target, "greedy", max_len=256).generate(prompt, GenerationParams(30), 0).output_ids
    for tree in ("dynamic", [(0,), (1,), (0, 0), (0, 0, 0)]):  # both proposers
        seen.clear()
        res = Medusa(tiny_target, max_len=256, heads=heads, tree=tree).generate(prompt, GenerationParams(30), 0)
        assert res.output_ids == want
        # every step's root is the newest committed token: the first is the prefill's choice, the rest in order
        assert seen and seen[0] == want[0]
        it = iter(want)
        assert all(r in it for r in seen)
