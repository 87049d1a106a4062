"""Write a file of general chat questions that no shipped drafter was trained on, to judge a drafting policy on prose.

The clean held-apart file (`clean_heldapart.py`) is mostly code and math, where the drafters do well;
a policy for text they guess badly needs prose. These are the project's own instruction templates
(`heads/instruction_prompts.py`) drawn with another seed, minus every prompt any shipped drafter trained
on: every draw in `SHIPPED_DRAWS` (`data.instructions` = 1200, 2400, 4800) and the `heads.train` default
(`data.instructions` in configs/train.yaml), all drawn with the data's first seed (1). The templates are the training
prompts' own, so these questions read more like the training data than real questions do: the
Spec-Bench-style file is the fairer test of prose. One turn each, category `chat`:

    python experiments/chat_heldapart.py /tmp/chat_heldapart.jsonl
    python -m specdec.run experiment=draft_schedules data=jsonl data.path=/tmp/chat_heldapart.jsonl \\
        "~data.per_category" "~data.seed" "strategies=[greedy,draft,draft_sitout]"
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from heads.instruction_prompts import SHIPPED_DRAWS, instruction_prompts


def chat_questions(count: int = 14, seed: int = 99) -> list[dict]:
    # Every draw a shipped drafter trained on is left out: earlier versions of this file missed some, so
    # their questions included training prompts (experiments/README.md has the history and the results
    # it affects).
    cfg = OmegaConf.load(Path(__file__).resolve().parent.parent / "configs" / "train.yaml").data
    trained: set[str] = set()
    for draw in (*SHIPPED_DRAWS, int(cfg.instructions)):
        trained |= set(instruction_prompts(draw, seed=int(cfg.seeds[0])))
    fresh = [p for p in instruction_prompts(400, seed=seed) if p not in trained]
    return [{"question_id": i, "category": "chat", "turns": [p]} for i, p in enumerate(fresh[:count])]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python experiments/chat_heldapart.py OUT.jsonl")
    with open(sys.argv[1], "w") as f:
        for q in chat_questions():
            f.write(json.dumps(q) + "\n")
