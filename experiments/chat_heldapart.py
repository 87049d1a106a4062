"""Write a file of general chat questions that no shipped drafter was trained on, to judge a drafting policy on prose.

The clean held-apart file (`clean_heldapart.py`) is mostly code and math, where the drafters do well;
a policy for text they guess badly needs prose. These are the project's own instruction templates
(`heads/instruction_prompts.py`) drawn with another seed, minus every prompt the instruction-mix
training (`data.instructions=1200`, seed 1) used; the shipped draft and Medusa heads saw no
instruction prompt at all. One turn each, category `chat`:

    python experiments/chat_heldapart.py /tmp/chat_heldapart.jsonl
    python -m specdec.run experiment=specbench_style data.path=/tmp/chat_heldapart.jsonl \\
        "strategies=[greedy,draft,draft_sitout]"
"""

from __future__ import annotations

import json
import sys

from heads.instruction_prompts import instruction_prompts


def chat_questions(count: int = 14, seed: int = 99) -> list[dict]:
    trained = set(instruction_prompts(1200, seed=1))
    fresh = [p for p in instruction_prompts(200, seed=seed) if p not in trained]
    return [{"question_id": i, "category": "chat", "turns": [p]} for i, p in enumerate(fresh[:count])]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python experiments/chat_heldapart.py OUT.jsonl")
    with open(sys.argv[1], "w") as f:
        for q in chat_questions():
            f.write(json.dumps(q) + "\n")
