"""How often EAGLE's first drafted token of a round is the target's, by where the target's token lies:
`python experiments/first_draft.py DATA.jsonl [--category C] [--limit N]`.

The shipped drafter with `request_rows=true` drafts one token a round (FixedLength(1)) on the default model over
the questions' first turns; each round's first drafted token is compared with the target's next token, which lies
in the drafter's kept rows, among the request's own tokens (only `request_rows` can propose it) or elsewhere. For
the request's tokens it also gives the rank of the target's token among the drafter's logits (0: its first choice).
"""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from specdec.cli_checks import CONFIG_DIR, group_config
from specdec.data import load_jsonl
from specdec.models.loader import load_model
from specdec.strategies.base import DecodeState, GenerationParams
from specdec.strategies.eagle import EagleProposer
from specdec.strategies.schedules import FixedLength


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data")
    ap.add_argument("--category", default=None)
    ap.add_argument("--limit", type=int, default=8, help="questions")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per answer")
    ap.add_argument("--weights", default=None, help="the drafter's weights: fp32 | bf16 | int8 (default: the config's)")
    args = ap.parse_args()
    model = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "model" / "smollm2-135m.yaml"), resolve=True)
    assert isinstance(model, dict)
    model.pop("_target_")
    target = load_model(**(model | {"matmul": "numba"}))
    scfg = group_config("strategy", "eagle")
    scfg.drafter.path = f"heads/checkpoints/{target.name}-eagle"
    scfg.request_rows = True
    if args.weights:
        scfg.drafter.weights = args.weights
    strategy = instantiate(scfg)(target=target, max_len=2048, prefill_chunk=64)
    strategy.schedule = FixedLength(1)
    kept = set(strategy.net.token_ids.tolist())
    last: list[torch.Tensor] = []
    run = EagleProposer._run

    def spy(self: EagleProposer, *a: object) -> tuple[torch.Tensor, torch.Tensor]:
        logits, guess = run(self, *a)  # type: ignore[arg-type]
        last[:] = [logits]
        return logits, guess

    EagleProposer._run = spy  # type: ignore[method-assign]
    questions = [q for q in load_jsonl(args.data) if args.category in (None, q.category)][:args.limit]
    hits: Counter[tuple[str, bool]] = Counter()
    ranks: list[int] = []
    for q in questions:
        prompt = target.chat_ids([{"role": "user", "content": q.turns[0]}])
        asked = set(prompt)
        out = strategy.engine.prefill(prompt)
        state = DecodeState(list(prompt), len(prompt), GenerationParams(args.tokens), None)
        state.ids.append(int(out.logits[-1].argmax()))
        proposer = strategy.make_proposer()
        proposer.start(state, out)
        while state.output_len < args.tokens - 2:
            proposal = proposer.propose(state)
            if proposal is None:
                break
            verdict, out = strategy._step(state, proposal)
            drafted = int(proposal.tokens[0])
            truth = drafted if verdict.nodes else int(verdict.tokens[0])
            where = "kept" if truth in kept else "request" if truth in asked else "other"
            hits[(where, drafted == truth)] += 1
            if where == "request":
                row = (proposer.token_ids == truth).nonzero()[0, 0]
                ranks.append(int((last[0] > last[0][row]).sum()))
            state.ids.extend(verdict.tokens)
            if set(verdict.tokens) & set(target.eos_ids):
                break
            proposer.commit(state, verdict, out)
    for where in ("kept", "request", "other"):
        n = hits[(where, True)] + hits[(where, False)]
        print(f"target's token {where}: {n} rounds, first drafted token right in {hits[(where, True)]}")
    if ranks:
        r = np.array(ranks)
        print(f"rank of the target's token among the drafter's rows, request tokens: median {np.median(r):.0f}, "
              f"quartiles {np.percentile(r, 25):.0f}-{np.percentile(r, 75):.0f}, first 5: {(r < 5).mean():.2f}")


if __name__ == "__main__":
    main()
