"""transformers' own generate() and assisted generation on the same weights: the peer baselines."""

from __future__ import annotations

from typing import Any

import torch

from specdec.engine.timing import clock
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.strategies.base import GenerationParams, Strategy, TurnResult, stop_cut


class _FirstTokenTimer:
    """A transformers streamer that only notes when the first generated token arrives."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first put() is the prompt
            self.first = clock(self.device)

    def end(self) -> None:
        pass


class _StopStrings:
    """A transformers stopping criterion with the decode loop's stop-string rule (base.stop_cut)."""

    def __init__(self, tokenizer: Any, prompt_len: int, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.prompt_len, self.stop = tokenizer, prompt_len, stop
        self.checked = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        ids = input_ids[0].tolist()
        hit = stop_cut(self.tokenizer, ids, self.prompt_len, self.checked, self.stop) is not None
        self.checked = len(ids)
        return torch.full((input_ids.shape[0],), hit, dtype=torch.bool, device=input_ids.device)


CACHES = (None, "dynamic", "static")


class HFGenerate(Strategy):
    """`model.generate()`; with `prompt_lookup_num_tokens` set it is transformers' prompt lookup,
    with a draft it is assisted generation. decode_steps and accept_lengths stay null: transformers
    does not expose its per-pass counts.

    `cache_implementation="static"` with `compile` is transformers' own fast path (`strategy=hf_static`):
    a preallocated cache of `max_len` positions, so every decode step has one shape, and the decode
    step `torch.compile`d through `generate(compile_config=...)` (mode reduce-overhead: CUDA graphs).
    compile `auto` compiles where transformers does by default (CUDA), `true` on any device (inductor
    on a CPU: slow to compile, for tests), `false` never. Prefill runs eagerly, as transformers does it.

    No prefix reuse (generation.prefix_cache): generate() builds its own cache for every call, so each turn
    prefills its whole conversation; `reuse_prefix` stays Strategy's no-op.
    """

    def __init__(self, target: LoadedModel, name: str, prompt_lookup_num_tokens: int | None = None,
                 max_matching_ngram_size: int | None = None, draft: LoadedModel | None = None,
                 num_assistant_tokens: int | None = None, num_assistant_tokens_schedule: str | None = None,
                 torch_threads: int | None = None, max_len: int | None = None,
                 prefill_chunk: int | None = None, cache_implementation: str | None = None,
                 compile: bool | str = False, compile_mode: str = "reduce-overhead", fullgraph: bool = True) -> None:
        del prefill_chunk  # configures our engine; transformers prefills in one pass
        self.name = name
        self.target = target
        self.draft = draft
        self.threads = torch_threads
        if cache_implementation not in CACHES:
            raise SpecdecError(f"strategy.cache_implementation={cache_implementation!r}; use null, dynamic or static")
        if compile not in (True, False, "auto"):
            raise SpecdecError(f"strategy.compile={compile!r}; use auto, true or false")
        if compile and cache_implementation != "static":
            raise SpecdecError("strategy.compile needs a static cache (every step one shape): set "
                               "strategy.cache_implementation=static, or strategy.compile=false")
        static = cache_implementation == "static"
        if static and (prompt_lookup_num_tokens or draft is not None):
            raise SpecdecError("the static-cache peer runs plain generate(); drop strategy.cache_implementation "
                               "for prompt lookup or assisted generation")
        self.cache_implementation = cache_implementation
        # auto: where transformers compiles by default; asking it elsewhere only earns a warning
        self.compile = compile is True or (compile == "auto" and target.device.type == "cuda")
        self.extra: dict[str, Any] = {}
        if prompt_lookup_num_tokens:
            self.extra["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
            if max_matching_ngram_size:
                self.extra["max_matching_ngram_size"] = max_matching_ngram_size
        if draft is not None:
            if num_assistant_tokens:
                self.extra["num_assistant_tokens"] = num_assistant_tokens
            if num_assistant_tokens_schedule:
                self.extra["num_assistant_tokens_schedule"] = num_assistant_tokens_schedule
        if cache_implementation is not None:
            self.extra["cache_implementation"] = cache_implementation
        if static:
            # one cache size for every turn: a new size would reallocate the cache and recompile the step
            if max_len:
                self.extra["max_cache_len"] = max_len
            if self.compile:
                from transformers import CompileConfig

                cc = CompileConfig(fullgraph=fullgraph, mode=compile_mode)
                if target.device.type != "cuda":  # transformers compiles on accelerators only, unless told so
                    cc._compile_all_devices = True
                self.extra["compile_config"] = cc
            else:
                self.extra["disable_compile"] = True  # transformers compiles static caches on CUDA by default

    @property
    def peer(self) -> str:
        """How transformers runs: what summaries print beside the name (eager, static, static+compile)."""
        if self.cache_implementation != "static":
            return "eager"
        return "static+compile" if self.compile else "static"

    def generate(self, prompt_ids: list[int], params: GenerationParams, seed: int) -> TurnResult:
        from transformers import GenerationConfig

        from specdec.strategies.base import torch_threads

        model = self.target.hf_model()
        sp = params.sampling
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=not sp.greedy,
            temperature=sp.temperature if not sp.greedy else None, top_p=sp.top_p if not sp.greedy else None,
            top_k=0 if not sp.greedy else None, eos_token_id=list(params.eos_ids) or None,
            pad_token_id=self.target.tokenizer.pad_token_id or (params.eos_ids[0] if params.eos_ids else 0),
            **self.extra)
        kwargs: dict[str, Any] = {}
        if params.stop:
            # our matcher rather than stop_strings, so every strategy stops at the same token
            from transformers import StoppingCriteriaList

            kwargs["stopping_criteria"] = StoppingCriteriaList([_StopStrings(self.target.tokenizer, len(prompt_ids),
                                                                             params.stop)])
        assistant = self.assistant_model()
        if assistant is not None:
            kwargs["assistant_model"] = assistant
        ids = torch.tensor([prompt_ids], device=self.target.device)
        device = self.target.device
        timer = _FirstTokenTimer(device)
        with torch_threads(self.threads), torch.inference_mode():
            torch.manual_seed(seed)
            start = clock(device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                 streamer=timer, **kwargs)
            wall = clock(device) - start
        output = out[0, len(prompt_ids):].tolist()
        cut = stop_cut(self.target.tokenizer, output, 0, 0, params.stop)  # assisted steps overshoot
        output = output if cut is None else output[:cut]
        ttft = (timer.first or clock(device)) - start
        return TurnResult(output, min(ttft, wall), wall, None, None)

    def assistant_model(self) -> Any:
        """The transformers model that drafts for assisted generation, None for plain generate."""
        return self.draft.hf_model() if self.draft is not None else None


class HFAssisted(HFGenerate):
    """transformers assisted generation with the same draft as `strategy=draft`: the peer baseline.

    transformers reads the draft length from the assistant's own generation config (not from the
    config passed to generate), so it is set there once; with the "heuristic" schedule the length
    then carries over from turn to turn, as in transformers. A trained drafter from heads/ is used
    through its transformers wrapper (`bind(target).hf_model()`).
    """

    def __init__(self, target: LoadedModel, name: str, draft: Any, num_assistant_tokens: int = 4,
                 num_assistant_tokens_schedule: str = "constant", assistant_confidence_threshold: float = 0.0,
                 torch_threads: int | None = None, max_len: int | None = None,
                 prefill_chunk: int | None = None) -> None:
        from specdec.models.loader import check_same_tokenizer

        super().__init__(target, name, torch_threads=torch_threads)
        if num_assistant_tokens < 1:
            raise SpecdecError(f"strategy.num_assistant_tokens={num_assistant_tokens} must be at least 1")
        if num_assistant_tokens_schedule not in ("constant", "heuristic", "heuristic_transient"):
            raise SpecdecError(f"strategy.num_assistant_tokens_schedule={num_assistant_tokens_schedule!r}; use "
                               "constant, heuristic or heuristic_transient")
        if isinstance(draft, LoadedModel):
            check_same_tokenizer(target, draft)
            self._assistant = draft.hf_model()
        elif hasattr(draft, "bind"):
            self._assistant = draft.bind(target).hf_model()
        else:
            raise SpecdecError(f"strategy.draft builds a {type(draft).__name__}; hf_assisted needs a model config "
                               "(specdec.models.load_model) or a trained drafter with bind(target)")
        gc = self._assistant.generation_config
        gc.num_assistant_tokens = num_assistant_tokens
        gc.num_assistant_tokens_schedule = num_assistant_tokens_schedule
        gc.assistant_confidence_threshold = assistant_confidence_threshold

    def assistant_model(self) -> Any:
        return self._assistant
