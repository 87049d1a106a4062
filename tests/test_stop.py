"""generation.stop: every strategy ends a turn at the token that completes a stop string."""

from __future__ import annotations

from pathlib import Path

from specdec.engine.sampling import SamplingParams
from specdec.models.loader import LoadedModel
from specdec.run import generation_params
from specdec.strategies.base import GenerationParams, stop_cut
from specdec.strategies.greedy import Greedy
from specdec.strategies.hf import HFGenerate
from tests.run_helpers import make_cfg


class CharTokenizer:
    """Token id i is the i-th string of `pieces`: enough of a tokenizer for stop_cut."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_stop_cut_finds_the_completing_token() -> None:
    tok = CharTokenizer(["<p>", "ab", "c", "###", "d", "#"])
    prompt = [0, 3]  # the prompt holds "###" itself: never matched
    out = [1, 2, 5, 5, 4, 5, 3, 1]  # "abc##d####ab"
    ids = prompt + out
    assert stop_cut(tok, ids, 2, 2, ("###",)) == 2 + 7  # completed by the 7th token ("###" after "d#")
    assert stop_cut(tok, ids, 2, 2, ("bc",)) == 2 + 2  # spans two tokens
    assert stop_cut(tok, ids, 2, 2, ("zz",)) is None
    assert stop_cut(tok, ids, 2, 2, ()) is None
    # only tokens from first_new on can complete a match (earlier ones were checked when committed)
    assert stop_cut(tok, ids, 2, 2 + 7, ("###",)) is None
    assert stop_cut(tok, ids, 2, 2, ("d", "##")) == 2 + 4  # the earliest of several


def test_stop_setting_reaches_the_params(tmp_path: Path) -> None:
    assert generation_params(make_cfg(tmp_path)).stop == ()
    assert generation_params(make_cfg(tmp_path, 'generation.stop=["a b","\\n\\n"]')).stop == ("a b", "\n\n")
    assert generation_params(make_cfg(tmp_path, "generation.stop=END")).stop == ("END",)


def _ascii_piece(text: str, length: int = 3) -> str:
    for k in range(len(text) // 2, len(text) - length):
        piece = text[k:k + length]
        if piece.isascii() and piece.isprintable() and piece.strip():
            return piece
    raise AssertionError(f"no ASCII piece in {text!r}")


def test_our_loop_and_transformers_stop_at_the_same_token(tiny_target: LoadedModel) -> None:
    tok = tiny_target.tokenizer
    prompt = tiny_target.chat_ids([{"role": "user", "content": "Describe how a for statement works."}])
    greedy = Greedy(tiny_target, "greedy", max_len=256)
    hf = HFGenerate(tiny_target, "hf_generate")
    free = GenerationParams(40, SamplingParams(), ())  # no EOS, so the whole budget is generated
    full = greedy.generate(prompt, free, 0).output_ids
    assert len(full) == 40
    stop = _ascii_piece(tok.decode(full, skip_special_tokens=False))
    expected = next(n for n in range(1, 41) if stop in tok.decode(full[:n], skip_special_tokens=False))
    assert expected < 40

    params = GenerationParams(40, SamplingParams(), (), (stop,))
    ours = greedy.generate(prompt, params, 0)
    assert ours.output_ids == full[:expected]
    assert sum(ours.accept_lengths or []) == len(ours.output_ids) == expected
    assert hf.generate(prompt, params, 0).output_ids == full[:expected]


def test_a_stop_string_in_the_prompt_does_not_end_the_turn(tiny_target: LoadedModel) -> None:
    prompt = tiny_target.chat_ids([{"role": "user", "content": "Zebra crossing"}])
    greedy = Greedy(tiny_target, "greedy", max_len=256)
    full = greedy.generate(prompt, GenerationParams(12, SamplingParams(), ()), 0).output_ids
    assert "Zebra" not in tiny_target.tokenizer.decode(full)
    assert greedy.generate(prompt, GenerationParams(12, SamplingParams(), (), ("Zebra",)), 0).output_ids == full
