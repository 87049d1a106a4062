"""strategy=hf_static: transformers' static cache plus torch.compile, the strongest transformers peer.
On a CPU it must run, give greedy's tokens, and say which way transformers ran."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from specdec.cli_checks import CONFIG_DIR
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.strategies.base import GenerationParams
from specdec.strategies.greedy import Greedy
from specdec.strategies.hf import HFGenerate

PARAMS = GenerationParams(10, eos_ids=())


def _greedy(target: LoadedModel, prompt: list[int]) -> list[int]:
    return Greedy(target, "greedy", 256).generate(prompt, PARAMS, 0).output_ids


def test_hf_static_config_matches_greedy_and_names_its_peer(tiny_target: LoadedModel) -> None:
    cfg = OmegaConf.load(CONFIG_DIR / "strategy" / "hf_static.yaml")
    s = instantiate(cfg)(target=tiny_target, max_len=256, prefill_chunk=512)
    assert isinstance(s, HFGenerate) and s.name == "hf_static" and s.cache_implementation == "static"
    assert s.peer == "static"  # compile: auto compiles on CUDA only; a CPU runs the static cache eagerly
    assert s.extra["max_cache_len"] == 256 and s.extra["disable_compile"] is True
    prompts = [tiny_target.chat_ids([{"role": "user", "content": t}]) for t in ("Hello there.", "What is a cache?")]
    for p in prompts:  # two turns, two prompt lengths: one cache size serves both
        assert s.generate(p, PARAMS, 0).output_ids == _greedy(tiny_target, p)
    assert HFGenerate(tiny_target, "hf_generate").peer == "eager"


def test_hf_static_compiled_on_cpu_matches_greedy(tiny_target: LoadedModel) -> None:
    # compile=true forces transformers' compiled decode step on a CPU too (inductor; tens of seconds)
    s = HFGenerate(tiny_target, "hf_static", max_len=128, cache_implementation="static", compile=True)
    assert s.peer == "static+compile" and s.extra["compile_config"].fullgraph
    prompt = tiny_target.chat_ids([{"role": "user", "content": "Count to five."}])
    first = s.generate(prompt, PARAMS, 0)
    assert first.output_ids == _greedy(tiny_target, prompt)
    again = s.generate(prompt, PARAMS, 0)  # compiled now: same tokens, timings in order
    assert again.output_ids == first.output_ids and 0 < again.ttft_s <= again.wall_time_s


@pytest.mark.parametrize(("kwargs", "hint"), [
    ({"compile": True}, "cache_implementation=static"),
    ({"cache_implementation": "paged"}, "use null, dynamic or static"),
    ({"cache_implementation": "static", "compile": "yes"}, "use auto, true or false"),
    ({"cache_implementation": "static", "prompt_lookup_num_tokens": 3}, "drop strategy.cache_implementation"),
])
def test_bad_peer_settings_say_how_to_fix_them(tiny_target: LoadedModel, kwargs: dict[str, object],
                                               hint: str) -> None:
    with pytest.raises(SpecdecError, match=hint) as e:
        HFGenerate(tiny_target, "hf_static", **kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(e.value)
