"""`python -m heads.train`: distillation data, a short draft training, resume, the shipped artifact, accelerate's
precision, epochs without a time budget, gradient accumulation and W&B curves."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import tiny_train_overrides
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from heads.batches import LengthBatches, collate, target_hidden, with_cached_hidden
from heads.distill_data import distill_prompts, to_example
from heads.draft_model import DraftTrainable, load_draft
from heads.train import _cap_tokens, make_accelerator, train
from specdec.cli_checks import CONFIG_DIR
from specdec.data import default_suite
from specdec.engine.engine import StaticEngine
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.loader import LoadedModel, load_model
from specdec.provenance import cpu_name
from specdec.strategies.base import GenerationParams
from specdec.strategies.draft import DraftStrategy
from specdec.strategies.greedy import Greedy
from specdec.strategies.schedules import FixedLength


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("distill")  # shared: the first run generates, the others reuse


def config(out: Path, data_dir: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return compose("train", overrides=[
            *tiny_train_overrides("draft", out, data_dir),
            "head.layers=1", "head.init_layers=[0]", "head.kept_vocab=128", "head.kl_weight=0", *overrides])


def test_distill_prompts_never_contain_benchmark_questions() -> None:
    prompts = distill_prompts(per_category=30, seeds=[1, 2], exclude_per_category=10, exclude_seed=0)
    bench = {t for q in default_suite(per_category=10, seed=0) for t in q.turns}
    assert len(prompts) > 100 and len(set(prompts)) == len(prompts)
    assert not bench & set(prompts)
    with pytest.raises(SpecdecError, match="benchmark seed"):
        distill_prompts(per_category=5, seeds=[0], exclude_per_category=10, exclude_seed=0)


def test_instructions_join_the_prompts_without_quoting_the_benchmark() -> None:
    prompts = distill_prompts(per_category=5, seeds=[1], exclude_per_category=10, exclude_seed=0, instructions=40)
    suite = distill_prompts(per_category=5, seeds=[1], exclude_per_category=10, exclude_seed=0)
    extra = [p for p in prompts if p not in suite]
    assert len(extra) == 40 and len(set(prompts)) == len(prompts)
    assert prompts[:7] != suite[:7]  # interleaved: a time budget cut keeps a mix of both
    bench = [t for q in default_suite(per_category=10, seed=0) for t in q.turns]
    quoted = [p for p in extra if "\n\n" in p]  # the kinds that quote a stdlib paragraph
    assert quoted and not any(p.split("\n\n", 1)[1] in t for p in quoted for t in bench)


def test_batched_generation_matches_greedy_and_the_target_pass(tiny_target: LoadedModel) -> None:
    from heads.batch_generate import generate_with_hidden

    prompts = [[3, 17, 42, 9, 100, 7], [5, 6], [11, 12, 13, 14], [99]]  # uneven: left padding in one batch
    gens = generate_with_hidden(tiny_target, prompts, max_new_tokens=9, batch_size=3)
    for p, g in zip(prompts, gens):
        ref = Greedy(tiny_target, "greedy", 64, 64).generate(p, GenerationParams(9), 0).output_ids
        assert g.continuation == ref
        seq = torch.tensor([p + g.continuation])
        h = target_hidden(tiny_target, seq, torch.ones_like(seq))[0]  # (T, D)
        assert g.hidden.shape == tuple(h.shape)
        torch.testing.assert_close(torch.from_numpy(g.hidden).float(), h, atol=2e-2, rtol=2e-2)


def test_labels_are_the_continuation_shifted() -> None:
    ex = to_example([5, 6, 7], [8, 9])
    assert ex["input_ids"] == [5, 6, 7, 8, 9]
    assert ex["labels"] == [-100, -100, 8, 9, -100]


def test_target_hidden_matches_engine(tiny_target: LoadedModel) -> None:
    ids = [[3, 17, 42, 9, 100, 7], [5, 6, 7, 8, 0, 0]]
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    h = target_hidden(tiny_target, torch.tensor(ids), mask)  # (2, 6, D)
    for b, n in enumerate((6, 4)):
        ref = StaticEngine(tiny_target.model, 64).prefill(ids[b][:n]).hidden
        torch.testing.assert_close(h[b, :n], ref, atol=1e-5, rtol=1e-4)


def test_short_training_lowers_loss_and_ships_a_usable_draft(tmp_path: Path, data_dir: Path,
                                                             tiny_target: LoadedModel) -> None:
    out = tmp_path / "draft"
    meta = train(config(out, data_dir, "train.max_steps=30", "train.lr=3e-3"))
    assert meta["steps"] == 30
    assert meta["last_loss"] < 0.7 * meta["first_loss"]
    saved = json.loads((out / "config.json").read_text())
    assert saved["base_model"] == "tiny-llama" and saved["num_layers"] == 1 and saved["kept_vocab"] == 128
    assert saved["hidden_size"] == tiny_target.hidden_size and saved["vocab_size"] == tiny_target.vocab_size
    card = (out / "README.md").read_text()
    assert "# draft for tiny-llama" in card and "30 steps" in card and "python -m heads.train" in card
    assert f"last {meta['last_loss']:.4g}" in card
    assert "generated in fp32" in card and "mixed precision no" in card
    assert "`kept_vocab=128`" in card and "`kl_weight=" in card  # the head's whole recipe, defaults included
    assert f"- Machine: {cpu_name()}, " in card  # the CPU's name: speedups differ between the machines
    draft = load_draft(str(out))
    net = draft.bind(tiny_target)
    assert net.token_ids is not None and len(net.token_ids) == 128
    prompt = tiny_target.chat_ids([{"role": "user", "content": "Rewrite this sentence politely."}])
    ref = Greedy(tiny_target, "greedy", 512, 64).generate(prompt, GenerationParams(24), 0).output_ids
    res = DraftStrategy(tiny_target, "draft", draft, FixedLength(3), 512, 64).generate(prompt, GenerationParams(24), 0)
    assert res.output_ids == ref
    # the transformers wrapper (hf_assisted) scores exactly the kept rows, like the compact draft
    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf_logits = net.hf_model()(ids).logits[0]  # (T, V)
        cache = net.new_cache(256)
        ours, _ = net(ids, torch.arange(len(prompt))[None], cache, cache.attention_mask(None, len(prompt)))
    torch.testing.assert_close(hf_logits[:, net.token_ids], ours[0], atol=1e-4, rtol=1e-4)
    assert torch.isinf(hf_logits).sum(-1).eq(tiny_target.vocab_size - 128).all()
    other = load_model("tiny-wide", "builtin:tiny-llama", matmul="torch", tiny={"hidden_size": 32})
    with pytest.raises(SpecdecError, match="trained for tiny-llama"):
        draft.bind(other)
    if cpu_kernels.available():  # bf16 or int8 weights in the CPU kernels: a different draft, the same output
        fast_target = load_model("tiny-llama", "builtin:tiny-llama", matmul="numba")
        fast_ref = Greedy(fast_target, "greedy", 512, 64).generate(prompt, GenerationParams(24), 0).output_ids
        for kind, dtype in (("bf16", np.uint16), ("int8", np.int8)):
            rounded = load_draft(str(out), weights=kind)
            rounded_net = rounded.bind(fast_target)
            assert rounded_net.lm_head.panels.dtype == dtype and rounded_net.layers[0].attn.wqkv.panels.dtype == dtype
            res = DraftStrategy(fast_target, "draft", rounded, FixedLength(3), 512, 64).generate(
                prompt, GenerationParams(24), 0)
            assert res.output_ids == fast_ref and res.accepted > 0, kind
    with pytest.raises(SpecdecError, match="not fp32, bf16, int8"):
        load_draft(str(out), weights="fp8")


def _final_params(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    last = sorted((out / "checkpoints").glob("step-*"))[-1]
    return load_file(str(last / "trainable.safetensors"))


@pytest.mark.parametrize("accum", [1, 2])
def test_resume_continues_from_the_checkpoint(tmp_path: Path, data_dir: Path, accum: int) -> None:
    # a constant learning rate, so that the schedule does not depend on where a run was told to stop
    flat = ("train.warmup_steps=0", "train.min_lr_ratio=1.0", f"train.grad_accum={accum}")
    whole = train(config(tmp_path / "a", data_dir, "train.max_steps=8", *flat))
    train(config(tmp_path / "b", data_dir, "train.max_steps=4", *flat))
    assert (tmp_path / "b" / "checkpoints" / "step-0000004" / "optimizer.safetensors").is_file()
    resumed = train(config(tmp_path / "b", data_dir, "train.max_steps=8", *flat))
    assert resumed["steps"] == whole["steps"] == 8
    a, b = _final_params(tmp_path / "a"), _final_params(tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    fresh = train(config(tmp_path / "b", data_dir, "train.max_steps=2", "train.resume=false", *flat))
    assert fresh["steps"] == 2


@pytest.mark.parametrize("positions", ["continuation", "all"])
def test_heads_reading_hidden_states_get_them_cached(tmp_path: Path, data_dir: Path, positions: str) -> None:
    meta = train(config(tmp_path / "kl", data_dir, "train.max_steps=30", "train.lr=3e-3", "head.kl_weight=0.5",
                        f"head.kl_positions={positions}"))
    assert meta["steps"] == 30 and meta["last_loss"] < 0.8 * meta["first_loss"]
    assert any(data_dir.rglob("hidden-*.npy"))  # kept from generation, not recomputed


def test_generated_hidden_rows_equal_a_fresh_target_pass(tmp_path: Path, tiny_target: LoadedModel) -> None:
    from heads.batches import with_generated_hidden
    from heads.distill_data import build_distill_dataset

    distill = build_distill_dataset(tiny_target, per_category=1, seeds=(1,), max_new_tokens=6, batch_size=3,
                                    chunk_batches=1, cache_dir=str(tmp_path), log=lambda s: None)
    assert distill.hidden is not None
    data, store = with_generated_hidden(distill.data, distill.hidden, seq_len=1000)
    batch = collate([data[i] for i in range(4)], 1000, 0, store)
    ref = target_hidden(tiny_target, batch["input_ids"], batch["attention_mask"])  # (4, T, D)
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(batch["hidden"][mask], ref[mask], atol=2e-2, rtol=2e-2)


def test_cached_hidden_rows_equal_a_fresh_target_pass(tmp_path: Path, tiny_target: LoadedModel) -> None:
    import datasets

    rows = [to_example(list(range(3, 3 + n)), [7, 8, 9]) for n in (2, 9, 5)]  # lengths 5, 12, 8
    data = datasets.Dataset.from_list(rows)
    seq_len = 10  # the 12-token row keeps only its last 10 states, as collate cuts it
    data, store = with_cached_hidden(data, tiny_target, seq_len, batch_size=2, folder=tmp_path)
    batch = collate([data[i] for i in range(3)], seq_len, 0, store)
    ref = target_hidden(tiny_target, batch["input_ids"], batch["attention_mask"])  # (3, 10, D)
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(batch["hidden"][mask], ref[mask], atol=2e-2, rtol=1e-2)  # stored in fp16
    assert not batch["hidden"][~mask].any()
    again, _ = with_cached_hidden(datasets.Dataset.from_list(rows), tiny_target, seq_len, 2, folder=tmp_path)
    assert again["hidden_row"] == data["hidden_row"] == [0, 5, 15]


def test_generation_budget_is_kept_across_reruns(tmp_path: Path, tiny_target: LoadedModel) -> None:
    from heads.distill_data import build_distill_dataset

    def build(minutes: float | None) -> list[list[int]]:
        data = build_distill_dataset(tiny_target, per_category=1, seeds=(1,), max_new_tokens=4, batch_size=2,
                                     chunk_batches=1, max_minutes=minutes, cache_dir=str(tmp_path), log=lambda s: None)
        return list(data.data["input_ids"])

    first = build(1e-6)  # the budget runs out after the first chunk
    assert len(first) == 2
    assert build(1e-6) == first  # a rerun sees the same data: the budget is cumulative
    everything = build(None)
    assert len(everything) > 2 and everything[:2] == first


def test_data_can_be_generated_at_another_precision(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    meta = train(config(tmp_path / "a", cache, "train.max_steps=2"))
    low = train(config(tmp_path / "b", cache, "train.max_steps=2", "data.dtype=bf16"))
    assert meta["steps"] == low["steps"] == 2
    # a second data set, keyed by the generator's precision, so neither run reads the other's tokens
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2
    assert low["data_dtype"] == "bf16" and "generated in bf16" in (tmp_path / "b" / "README.md").read_text()
    with pytest.raises(SpecdecError, match="unknown data.dtype 'half'"):
        train(config(tmp_path / "c", cache, "data.dtype=half"))


# --------------------------------------------------------------------------------------------------
# Precision, stopping, accumulation, logging
# --------------------------------------------------------------------------------------------------


def test_mixed_precision_is_accelerates_unless_set(tmp_path: Path, data_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # what `accelerate launch --mixed_precision bf16` (or a saved accelerate config) sets for the script
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    meta = train(config(tmp_path / "env", data_dir, "train.max_steps=2"))
    assert meta["steps"] == 2 and meta["mixed_precision"] == "bf16"
    assert "mixed precision bf16" in (tmp_path / "env" / "README.md").read_text()
    explicit = train(config(tmp_path / "no", data_dir, "train.max_steps=1", "train.mixed_precision=no"))
    assert explicit["mixed_precision"] == "no"  # an explicit value wins over accelerate's
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert make_accelerator(config(tmp_path, data_dir).train).mixed_precision == "no"
    assert make_accelerator(config(tmp_path, data_dir, "train.mixed_precision=bf16").train).mixed_precision == "bf16"
    with pytest.raises(SpecdecError, match="train.mixed_precision='half' is not one of no, bf16, fp16"):
        make_accelerator(config(tmp_path, data_dir, "train.mixed_precision=half").train)


@pytest.mark.parametrize("batch, accum", [(2, 1), (2, 2)])
def test_without_a_time_budget_epochs_end_the_run(tmp_path: Path, data_dir: Path, batch: int, accum: int) -> None:
    meta = train(config(tmp_path / "a", data_dir, "train.max_minutes=null", "train.epochs=2",
                        f"train.batch_size={batch}", f"train.grad_accum={accum}"))
    assert meta["epochs"] == 2 and meta["grad_accum"] == accum
    # one optimizer step per batch x accum sequences: accelerate steps after `accum` micro-batches
    assert meta["steps"] == 2 * math.ceil(meta["sequences"] / (batch * accum))
    with pytest.raises(SpecdecError, match="all null, so nothing ends the training"):
        train(config(tmp_path / "b", data_dir, "train.max_minutes=null", "train.epochs=null"))


def test_a_draft_can_start_from_a_saved_draft(tmp_path: Path, data_dir: Path, tiny_target: LoadedModel) -> None:
    """head.init_from: the saved draft's layers and rows are where training starts, and its minutes count."""
    first = tmp_path / "first"
    fresh = train(config(first, data_dir, "train.max_steps=30", "train.lr=3e-3"))
    trainable = DraftTrainable(layers=1, kept_vocab=64, save_dtype="fp32", init_from=str(first))
    module = trainable.build(tiny_target, None)  # its own rows: no data needed to pick them
    net = load_draft(str(first)).bind(tiny_target)
    assert trainable.kept_ids is not None and torch.equal(trainable.kept_ids, net.token_ids)
    ids = torch.tensor([[5, 9, 31, 7, 2]])
    with torch.no_grad():  # the started layers give the saved draft's logits (saved in fp16)
        cache = net.new_cache(64)
        want, _ = net(ids, torch.arange(5)[None], cache, cache.attention_mask(None, 5))
        h = module(ids, torch.ones_like(ids))
        assert trainable.head is not None
        torch.testing.assert_close(h[0] @ trainable.head.T, want[0], atol=2e-2, rtol=2e-2)
    second = train(config(tmp_path / "second", data_dir, "train.max_steps=2", f"head.init_from={first}"))
    assert second["first_loss"] < 0.8 * fresh["first_loss"]
    assert second["minutes_in_all"] == pytest.approx(fresh["minutes"] + second["minutes"])
    card = (tmp_path / "second" / "README.md").read_text()
    assert f"Started from: the drafter in `{first}`" in card and "Training in all: " in card
    with pytest.raises(SpecdecError, match="head.layers=2"):
        DraftTrainable(layers=2, init_from=str(first)).build(tiny_target, None)


def test_a_stop_mid_epoch_counts_its_share(tmp_path: Path, data_dir: Path) -> None:
    meta = train(config(tmp_path, data_dir, "train.max_steps=1", "train.batch_size=2"))
    batches_per_epoch = math.ceil(meta["sequences"] / 2)  # sequences of one length band here: full batches
    assert meta["epochs"] == round(1 / batches_per_epoch, 2) and 0 < meta["epochs"] < 1
    assert f"{meta['epochs']:.4g} epochs" in (tmp_path / "README.md").read_text()


def test_accumulation_batches_are_the_large_batches_cut() -> None:
    lengths = [(i * 37) % 50 + 1 for i in range(16)]
    large = LengthBatches(lengths, 8, seed=3, epoch=1).batches
    micro = LengthBatches(lengths, 4, seed=3, epoch=1, split=2).batches
    assert [a + b for a, b in zip(micro[::2], micro[1::2])] == large
    # short batches (one per pool of 24) are joined at the end: every step but the last gets 3 micro-batches
    odd = LengthBatches(list(range(1, 212)), 4, seed=0, epoch=0, pool=2, split=3).batches
    assert [len(b) for b in odd] == [4] * (17 * 3) + [4, 3]
    assert sorted(i for b in odd for i in b) == list(range(211))
    assert LengthBatches(list(range(1, 212)), 4, seed=0, epoch=0, pool=2, split=3, skip=6).batches == odd[6:]


def test_accumulated_micro_batches_train_like_one_large_batch(tmp_path: Path) -> None:
    rows = [{"conversations": [{"from": "human", "value": f"Name {i} things that are {c}."}]}
            for i in range(2, 6) for c in ("red", "round", "loud", "cold")]  # 16 prompts: two batches of 8
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = tmp_path / "cache"

    def run(out: str, *overrides: str) -> dict[str, Any]:
        # 4-token replies, all kept tokens: every sequence has the same number of learnt tokens, so the
        # mean of two micro-batches' mean losses is the large batch's mean loss
        with initialize_config_dir(str(CONFIG_DIR), version_base=None):
            cfg = compose("train", overrides=[
                *tiny_train_overrides("draft", tmp_path / out, cache, max_new_tokens=4), "head.layers=1",
                "head.init_layers=[0]", "head.kept_vocab=128", "head.kl_weight=0", f"data.source={source}",
                "train.max_minutes=null", "train.epochs=2", "train.warmup_steps=0", "train.min_lr_ratio=1.0",
                "train.lr=3e-3", "train.grad_clip=0", *overrides])
        return train(cfg)

    accumulated = run("a", "train.batch_size=4", "train.grad_accum=2")
    large = run("b", "train.batch_size=8")
    assert accumulated["target_tokens"] == 16 * 4 and accumulated["steps"] == large["steps"] == 4
    assert accumulated["first_loss"] == pytest.approx(large["first_loss"], rel=1e-5)
    assert accumulated["last_loss"] == pytest.approx(large["last_loss"], rel=1e-4)
    a, b = _final_params(tmp_path / "a"), _final_params(tmp_path / "b")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)


def test_wandb_gets_the_loss_of_every_step(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    from test_wandb import read_records

    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    out = tmp_path / "logged"
    meta = train(config(out, data_dir, "train.max_steps=5", "logger=wandb", "logger.mode=offline"))
    runs = list((out / "checkpoints" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = read_records(next(runs[0].glob("run-*.wandb")))
    losses: dict[int, float] = {}
    for rec in records:
        if rec.WhichOneof("record_type") != "history":
            continue
        items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
        if "train/loss" in items:
            losses[int(items.get("_step", rec.history.step.num))] = items["train/loss"]
    assert sorted(losses) == [1, 2, 3, 4, 5]
    assert losses[1] == pytest.approx(meta["first_loss"])
    from specdec.loggers import WandbLogger

    if hasattr(WandbLogger, "log_checkpoint"):  # the shipped folder as a `model` artifact
        assert any(r.WhichOneof("record_type") == "artifact" and r.artifact.type == "model" for r in records)


def test_max_train_tokens_keeps_a_prefix_of_the_training_split() -> None:
    import datasets

    labels = [[-100, 1, 2], [-100, -100, 3, 4, 5], [6], [-100, 7, 8]]  # 2, 3, 1, 2 target tokens
    data = datasets.Dataset.from_dict({"labels": labels, "input_ids": labels})
    said: list[str] = []
    assert _cap_tokens(data, None, said.append) == (data, 8)
    kept, tokens = _cap_tokens(data, 6, said.append)
    assert kept["labels"] == labels[:3] and tokens == 6  # 2 + 3 + 1 = 6 fits, the 4th does not
    kept, tokens = _cap_tokens(data, 5, said.append)
    assert kept["labels"] == labels[:2] and tokens == 5
    assert said == ["train: max_train_tokens=6 keeps 3 of 4 training sequences",
                    "train: max_train_tokens=5 keeps 2 of 4 training sequences"]
    kept, tokens = _cap_tokens(data, 100, said.append)
    assert len(kept) == 4 and tokens == 8 and len(said) == 2
    for bad in (0, 1):
        with pytest.raises(SpecdecError, match="max_train_tokens"):
            _cap_tokens(data, bad, said.append)
