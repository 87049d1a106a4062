"""`python -m heads.magpie`: training prompts the target writes itself (Magpie, Xu et al. 2024).

An instruction-tuned model given only its chat template up to the start of a user turn completes a
plausible user request. A system line names one of many domains, so the requests spread over them; with
`--turns 2` the target answers (greedily) and is then given the user prefix again, which yields a
follow-up. Sampling is seeded per request and batched (continuous batching on the CPU kernels), so one
command regenerates the same file. Requests are cleaned (length, repeats, duplicates) and every one sharing
a 13-word n-gram with an evaluation or held-apart question shipped in the repository is dropped
(heads/contamination.py). Nothing is read from any benchmark: the prompts come from the model alone.
`--domains heldapart` draws from domains training never uses, for held-apart questions (`--questions`
writes them as a question file).

Output: jsonl (gzip with a .gz suffix), one conversation a line in OpenAI-messages form,
{"messages": [{"role": "user", ...}, {"role": "assistant", ...}, {"role": "user", ...}], "domain": ...};
heads.train reads it as a data source.

    python -m heads.magpie --n 3000 --turns 1 --seed 0 --batch-size 128 \\
        --out heads/data/magpie-smollm2-135m-1turn.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from heads.batch_generate import CPU_SLOTS, continuous, left_padded
from specdec.engine.sampling import SamplingParams, warp
from specdec.errors import SpecdecError
from specdec.models.cpu_linear import use_matmul
from specdec.models.loader import LoadedModel

DOMAINS = (
    "Python programming", "JavaScript and web development", "SQL and databases", "shell scripting and Linux",
    "algorithms and data structures", "arithmetic word problems", "algebra", "geometry", "probability",
    "physics", "chemistry", "biology", "medicine and health", "history", "geography", "economics",
    "personal finance", "law", "philosophy", "psychology", "literature", "creative writing", "poetry",
    "editing and rewriting text", "summarizing documents", "translation between languages", "cooking",
    "travel planning", "sports", "music", "films and television", "career advice", "email writing",
    "education and studying", "environment and climate", "astronomy", "everyday technology help",
    "business strategy", "marketing", "relationships and etiquette",
)
# Domains no training prompt is drawn from: the held-apart questions (`--domains heldapart`) that pick
# defaults come from these, so a choice made on them does not reward fitting the training topics.
HELDAPART_DOMAINS = (
    "gardening", "home repair and DIY", "pets and animal care", "architecture", "fashion", "video games",
    "linguistics", "parenting", "Rust programming", "statistics", "mythology", "nutrition and fitness",
)
TOP = 256  # candidates a prompt token is sampled from on the CPU kernels' path (see `complete`)
MARK = "\u2063MAGPIE\u2063"  # a string no template contains: where the user's text would go


def _system(domain: str) -> str:
    return f"You are a helpful assistant. The user asks you about {domain}."


def turn_prefix(target: LoadedModel, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the chat template over `messages` plus the opening of a new user turn, up to where its
    text would start."""
    text = target.tokenizer.apply_chat_template([*messages, {"role": "user", "content": MARK}], tokenize=False)
    if MARK not in text:
        raise SpecdecError(f"{target.name}'s chat template drops the user's text; Magpie needs a template that "
                           "renders it (use an instruction-tuned model)")
    return target.tokenizer.encode(text.split(MARK)[0], add_special_tokens=False)


@torch.inference_mode()
def complete(target: LoadedModel, prefixes: list[list[int]], max_new_tokens: int, params: SamplingParams,
             generator: torch.Generator | None, stop: set[int]) -> list[list[int]]:
    """Continuations of `prefixes` sampled under `params` (greedy at temperature 0), each up to and
    excluding its first `stop` token: on the CPU kernels in continuous batches (each prefix samples from
    its own generator, seeded from `generator`, so slot scheduling cannot change the result), else
    left-padded in one batch on a static cache."""
    if getattr(target.model, "fused", None) is not None:
        seeds = ([0] * len(prefixes) if generator is None else
                 torch.randint(2**62, (len(prefixes),), generator=generator).tolist())
        gens = [torch.Generator().manual_seed(s) for s in seeds]

        def pick(i: int, logits: Tensor) -> int:
            if params.greedy:
                return int(logits.argmax())
            # the nucleus within the TOP most likely tokens: a full-vocabulary sort per token cost more
            # than the pass; prompts only need to be plausible, not exact samples
            top, ids = torch.topk(logits.cpu(), TOP)
            return int(ids[torch.multinomial(warp(top[None], params), 1, generator=gens[i])[0, 0]])

        rows = [g.continuation for g in continuous(target, prefixes, max_new_tokens, CPU_SLOTS, stop, pick)]
        return [row[:-1] if row and row[-1] in stop else row for row in rows]
    model, dev = target.model, target.device
    B, W = len(prefixes), max(map(len, prefixes))
    cache = model.new_cache(W + max_new_tokens, batch=B)
    tokens, positions, valid, mask = left_padded(prefixes, max_new_tokens, dev)
    logits, _ = model(tokens, positions, cache, mask, logits_from=W - 1)
    pos = positions[:, -1]
    stops = torch.tensor(sorted(stop) or [-1], device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    out = []
    for i in range(max_new_tokens):
        last = logits[:, -1].float()  # (B, V)
        if params.greedy:
            nxt = last.argmax(-1)
        else:
            nxt = torch.multinomial(warp(last, params), 1, generator=generator)[:, 0]
        out.append(nxt)
        done |= torch.isin(nxt, stops)
        if bool(done.all()) or i == max_new_tokens - 1:
            break
        pos = pos + 1
        logits, _ = model(nxt[:, None], pos[:, None], cache, valid[:, None, None, :W + i + 1])
    rows = torch.stack(out, 1).cpu().tolist()
    return [row[:next((j for j, t in enumerate(row) if t in stop), len(row))] for row in rows]


def clean(text: str, min_words: int = 4, max_words: int = 200) -> str | None:
    """The request if it looks like one: long enough, not cut off mid-stream, not one phrase repeated."""
    text = text.strip()
    words = text.split()
    if not min_words <= len(words) <= max_words:
        return None
    if len(set(words)) < len(words) / 3:  # a loop, not a request
        return None
    return text


def generate(target: LoadedModel, n: int, seed: int = 0, turns: int = 1, batch_size: int = 32,
             max_prompt_tokens: int = 96, max_answer_tokens: int = 160, temperature: float = 1.0,
             top_p: float = 0.95, max_minutes: float | None = None,
             domains: Sequence[str] = DOMAINS) -> list[dict[str, Any]]:
    """Up to `n` cleaned, deduplicated, decontaminated conversations of `turns` user turns on `domains`."""
    from heads.contamination import EvalIndex, evaluation_turns

    if n < 1 or turns < 1 or batch_size < 1:
        raise SpecdecError(f"magpie needs n, turns and batch_size >= 1; got {n}, {turns}, {batch_size}")
    index = EvalIndex(evaluation_turns())
    params, greedy = SamplingParams(temperature=temperature, top_p=top_p), SamplingParams(temperature=0.0)
    stop = set(target.eos_ids) | {t for t in [target.tokenizer.convert_tokens_to_ids("<|im_end|>")] if t is not None}
    gen = torch.Generator(device=target.device).manual_seed(seed)
    seen: set[str] = set()
    kept: list[dict[str, Any]] = []
    start, batch_no = time.monotonic(), 0
    if getattr(target.model, "fused", None) is None:
        use_matmul(target.model, "torch")  # left-padded batches of rows: torch's GEMMs beat the few-row kernels
    try:
        while len(kept) < n:
            if max_minutes is not None and time.monotonic() - start > 60 * max_minutes:
                break
            picked = [domains[(batch_no * batch_size + b + seed) % len(domains)] for b in range(batch_size)]
            convs: list[list[dict[str, str]]] = [[{"role": "system", "content": _system(d)}] for d in picked]
            alive = list(range(batch_size))
            for turn in range(turns):
                asks = complete(target, [turn_prefix(target, convs[b]) for b in alive], max_prompt_tokens, params,
                                gen, stop)
                nxt = []
                for b, ids in zip(alive, asks):
                    text = clean(target.tokenizer.decode(ids, skip_special_tokens=True))
                    if text is not None and index.clean(text) and " ".join(text.lower().split()) not in seen:
                        convs[b].append({"role": "user", "content": text})
                        nxt.append(b)
                alive = nxt
                if turn + 1 < turns and alive:  # the target's own answer, then a follow-up request
                    answers = complete(target, [target.chat_ids(convs[b]) for b in alive], max_answer_tokens,
                                       greedy, None, stop)
                    for b, ids in zip(alive, answers):
                        convs[b].append({"role": "assistant",
                                         "content": target.tokenizer.decode(ids, skip_special_tokens=True)})
            for b in alive:
                first = " ".join(convs[b][1]["content"].lower().split())
                if first in seen:
                    continue
                seen.add(first)
                kept.append({"messages": convs[b][1:], "domain": picked[b]})
            batch_no += 1
            print(f"magpie: {len(kept)}/{n} conversations after {batch_no} batches, "
                  f"{(time.monotonic() - start) / 60:.1f} min", file=sys.stderr, flush=True)
    finally:
        use_matmul(target.model, target.matmul)
    return kept[:n]


def as_questions(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conversations as a question file (`data=jsonl`): the user turns only, the domain as category."""
    return [{"question_id": i, "category": r["domain"], "turns": [m["content"] for m in r["messages"]
                                                                  if m["role"] == "user"]}
            for i, r in enumerate(rows)]


def write(rows: Sequence[dict[str, Any]], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)
    if out.suffix == ".gz":
        out.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))  # mtime 0: the same bytes every run
    else:
        out.write_text(text, encoding="utf-8")


def cli(prog: str, description: str, n: int, domains_help: str) -> argparse.ArgumentParser:
    """The options the two generators share (heads.magpie, heads.magpie_tasks)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--model", default="smollm2-135m", help="a model config name (configs/model/)")
    p.add_argument("--n", type=int, default=n)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--domains", choices=["train", "heldapart"], default="train", help=domains_help)
    p.add_argument("--questions", action="store_true",
                   help="write a question file (question_id, category, turns) for data=jsonl instead")
    p.add_argument("--out", type=Path, required=True)
    return p


def load_target(model: str, *overrides: str) -> LoadedModel:
    """The target as `python -m specdec.run model=MODEL` would build it."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from specdec.cli_checks import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return instantiate(compose("run", overrides=[f"model={model}", *overrides]).model)


def main(argv: Sequence[str] | None = None) -> int:
    p = cli("python -m heads.magpie", __doc__.split("\n")[0], 4000,
            "train: the training domains; heldapart: domains training never draws from")
    p.add_argument("--turns", type=int, default=1)
    a = p.parse_args(argv)
    try:
        rows = generate(load_target(a.model), a.n, a.seed, a.turns, a.batch_size, max_minutes=a.max_minutes,
                        domains=HELDAPART_DOMAINS if a.domains == "heldapart" else DOMAINS)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write(as_questions(rows) if a.questions else rows, a.out)
    print(f"wrote {len(rows)} conversations to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
