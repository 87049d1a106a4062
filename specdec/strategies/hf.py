"""transformers' own generate() and assisted generation on the same weights: the peer baselines."""

from __future__ import annotations

import time
from typing import Any

import torch

from specdec.models.loader import LoadedModel
from specdec.strategies.base import GenerationParams, Strategy, TurnResult


class _FirstTokenTimer:
    """A transformers streamer that only notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first put() is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class HFGenerate(Strategy):
    """`model.generate()`; with `prompt_lookup_num_tokens` set it is transformers' prompt lookup,
    with a draft it is assisted generation. decode_steps and accept_lengths stay null: transformers
    does not expose its per-pass counts."""

    def __init__(self, target: LoadedModel, name: str, prompt_lookup_num_tokens: int | None = None,
                 max_matching_ngram_size: int | None = None, draft: LoadedModel | None = None,
                 num_assistant_tokens: int | None = None, num_assistant_tokens_schedule: str | None = None,
                 torch_threads: int | None = None, max_len: int | None = None,
                 prefill_chunk: int | None = None) -> None:
        # max_len/prefill_chunk configure our engine; transformers sizes its own cache
        del max_len, prefill_chunk
        self.name = name
        self.target = target
        self.draft = draft
        self.threads = torch_threads
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
        if self.draft is not None:
            kwargs["assistant_model"] = self.draft.hf_model()
        ids = torch.tensor([prompt_ids], device=self.target.device)
        timer = _FirstTokenTimer()
        with torch_threads(self.threads), torch.inference_mode():
            torch.manual_seed(seed)
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                 streamer=timer, **kwargs)
            wall = time.perf_counter() - start
        output = out[0, len(prompt_ids):].tolist()
        ttft = (timer.first or time.perf_counter()) - start
        return TurnResult(output, min(ttft, wall), wall, None, None)
