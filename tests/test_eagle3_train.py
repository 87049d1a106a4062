"""Training EAGLE-3 drafters (heads/eagle3_train.py): the target pass that taps three layers, the training-time
test's passes against drafting itself, and a short run that lowers the loss and ships a drafter the eagle3 and
eagle2 strategies run losslessly and that reads back in SafeAILab's layout.

The target is tiny-llama with 8 layers: EAGLE-3's default taps (inputs of layers 2, n/2, n-3) need n >= 7."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_train_overrides
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from heads.batches import NoCache, target_hidden
from heads.eagle3 import Eagle3Net
from heads.eagle3_train import Eagle3Trainable, Eagle3TrainModule
from heads.train import train
from specdec.cli_checks import CONFIG_DIR, group_config
from specdec.errors import SpecdecError
from specdec.models.llama import LlamaArgs, rope_inv_freq
from specdec.models.loader import LoadedModel, load_model
from specdec.strategies.base import GenerationParams
from specdec.strategies.greedy import Greedy

DEEP = {"num_hidden_layers": 8}


@pytest.fixture(scope="module")
def deep() -> LoadedModel:
    return load_model("tiny-llama", "builtin:tiny-llama", matmul="torch", compile=False, tiny=DEEP)


def test_tapped_target_pass_gives_the_layer_inputs_transformers_gives(deep: LoadedModel) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 17, 40, 99, 23, 5, 8, 13], [1, 30, 31, 32, 0, 0, 0, 0]])
    mask = (torch.arange(8) < torch.tensor([[8], [4]])).long()
    got = target_hidden(deep, ids, mask, (2, 4, 5))  # (B, T, 4 D): final state, then the three taps
    hf = AutoModelForCausalLM.from_pretrained(deep.folder, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    want = torch.cat([hs[-1], hs[2], hs[4], hs[5]], -1)
    for b, n in enumerate((8, 4)):  # right padding: compare the real tokens
        torch.testing.assert_close(got[b, :n], want[b, :n], atol=1e-4, rtol=1e-4)
    assert torch.equal(target_hidden(deep, ids, mask)[0], got[0, :, :deep.hidden_size])
    hf_target = load_model("tiny-llama", "builtin:tiny-llama", backend="hf", compile=False, tiny=DEEP)
    through_hf = target_hidden(hf_target, ids, mask, (2, 4, 5))  # model.backend=hf: the same rows
    for b, n in enumerate((8, 4)):
        torch.testing.assert_close(through_hf[b, :n], want[b, :n], atol=1e-5, rtol=1e-5)


def test_training_time_test_passes_are_what_drafting_computes() -> None:
    """Pass s at pair j must equal drafting's s-th token after the last verified pair j - (s - 1): the drafter run
    causally over real pairs 0..j-s+1 and then its own guesses, each fed to the next pair."""
    torch.manual_seed(0)
    args = LlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, hidden_dim=48, head_dim=8,
                     norm_eps=1e-5, rope_theta=10000.0, max_position=64, tie_embeddings=False, qkv_bias=False,
                     o_bias=False)
    net = Eagle3Net(args, 24, 64, (1, 2, 3)).eval()
    net.inv_freq = rope_inv_freq(net.args)
    module = Eagle3TrainModule(net, torch.zeros(64, 32))
    T, unroll = 9, 3
    tokens, taps = torch.randint(0, 64, (1, T)), torch.randn(1, T, 72)
    pos = torch.arange(T)[None]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        passes = module(tokens, taps, unroll)
        for s in range(1, unroll + 1):
            for j in range(s - 1, T):
                feats = net.fuse(taps[:, :j - s + 2])  # real pairs up to the last verified one
                while feats.shape[1] < j + 1:  # then each guess becomes the next pair's feature
                    n = feats.shape[1]
                    _, h = net(tokens[:, :n], feats, pos[:, :n], NoCache(), causal[..., :n, :n])
                    feats = torch.cat([feats, h[:, -1:]], 1)
                logits, _ = net(tokens[:, :j + 1], feats, pos[:, :j + 1], NoCache(), causal[..., :j + 1, :j + 1])
                torch.testing.assert_close(net.lm_head(passes[s - 1][0, j]), logits[0, j], atol=1e-5, rtol=1e-5)


def test_training_loss_is_the_plain_formula(monkeypatch: pytest.MonkeyPatch, deep: LoadedModel) -> None:
    """The loss reads each pass through the trained head in head_loss's chunks; its value and every gradient,
    the head's included, are those of KL(target || drafter) over whole (rows, K) logits, averaged over the
    passes, each on the real pairs it scores."""
    import torch.nn.functional as F

    from heads import head_loss as hl

    monkeypatch.setattr(hl, "CHUNK_ELEMENTS", 7 * 64)  # several ragged chunks
    torch.manual_seed(0)
    B, T, D, V = 3, 12, deep.hidden_size, deep.vocab_size
    ids = torch.randint(3, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 8:], mask[2, 5:] = 0, 0  # right padding
    labels = torch.where(mask.bool(), torch.roll(ids, -1, 1), -100)
    trainable = Eagle3Trainable(draft_vocab=64, unroll=3)  # some labels outside the draft vocabulary
    module = trainable.build(deep, [{"input_ids": ids[0].tolist(), "labels": labels[0].tolist()}])
    hidden = torch.randn(B, T, 4 * D)  # the final state, then the three taps
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    params = [p for p in module.parameters() if p.requires_grad]
    assert any(p is module.net.lm_head.weight for p in params)

    loss, logs = trainable.loss(module, batch, hidden)
    got = torch.autograd.grad(loss, params)

    valid = mask[:, 1:].bool()
    p_log = F.log_softmax(hidden[:, 1:, :D][valid] @ module.target_rows.T, -1)
    want_loss = torch.zeros(())
    for s, states in enumerate(module(ids[:, 1:], hidden[:, :-1, D:], 3), 1):
        keep = valid.clone()
        keep[:, :s - 1] = False
        q_log = F.log_softmax(module.net.lm_head(states[keep]), -1)
        want_loss = want_loss + F.kl_div(q_log, p_log[keep[valid]], log_target=True, reduction="batchmean") / 3
    want = torch.autograd.grad(want_loss, params)
    torch.testing.assert_close(loss, want_loss)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert set(logs) == {"kl", "acc", "kl2", "acc2", "kl3", "acc3"} and 0 <= logs["acc"] <= 1


def test_short_training_lowers_loss_and_ships_a_lossless_drafter(tmp_path: Path, deep: LoadedModel) -> None:
    out = tmp_path / "eagle3"
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=[*tiny_train_overrides("eagle3", out, tmp_path / "data"),
                                          "model.tiny.num_hidden_layers=8", "train.max_steps=30", "train.lr=3e-3",
                                          "head.draft_vocab=128", "head.unroll=3"])
    meta = train(cfg)
    assert meta["steps"] == 30 and meta["last_loss"] < 0.7 * meta["first_loss"]
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["draft_vocab_size"] == 128
    assert json.loads((out / "train.json").read_text())["steps"] == 30
    assert "# eagle3 for tiny-llama" in (out / "README.md").read_text()
    greedy = Greedy(deep, "greedy", 512, 64)
    prompt = deep.chat_ids([{"role": "user", "content": "Rewrite this sentence politely."}])
    want = greedy.generate(prompt, GenerationParams(24), 0).output_ids
    scfg = group_config("strategy", "eagle3")
    scfg.drafter.path = str(out)
    scfg.schedule.threshold = 0.0
    chain = instantiate(scfg)(target=deep, max_len=512, prefill_chunk=64)
    assert chain.net.token_ids is not None and len(chain.net.token_ids) == 128
    res = chain.generate(prompt, GenerationParams(24), 0)
    assert res.output_ids == want and res.proposed > 0
    tcfg = OmegaConf.load(CONFIG_DIR / "strategy" / "eagle2.yaml")  # EAGLE-2's dynamic tree, same drafter
    tcfg.drafter = {"_target_": "heads.interop.eagle_layout.load_eagle_layout", "path": str(out)}
    assert instantiate(tcfg)(target=deep, max_len=512, prefill_chunk=64).generate(
        prompt, GenerationParams(24), 0).output_ids == want


def test_bad_settings_fail_in_one_line(deep: LoadedModel) -> None:
    with pytest.raises(SpecdecError, match="three distinct layer inputs"):
        Eagle3Trainable(target_layers=[1, 1, 2]).target_taps(deep)
    with pytest.raises(SpecdecError, match="three distinct layer inputs"):
        Eagle3Trainable(target_layers=[2, 4, 8]).target_taps(deep)
    with pytest.raises(SpecdecError, match="head.unroll"):
        Eagle3Trainable(unroll=0)
    assert Eagle3Trainable().target_taps(deep) == (2, 4, 5)
