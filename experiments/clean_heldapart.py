"""Write a small question file that shares no passage with the drafters' training prompts or the benchmark.

The offline suite draws its passages from a finite pool, so other seeds of `default_suite` mostly repeat
passages the drafters were trained on (some turns are training prompts verbatim; experiments/README.md,
"Figures moved out of code and configs"). This
keeps only questions none of whose turns shares a 160-character span with any training prompt (the
`heads.train` defaults plus `data.instructions=1200`) or benchmark turn, nor a 13-word n-gram with any
evaluation question shipped in the repository (heads/contamination.py), at most three per category.
Its output is committed as experiments/heldapart/offline_clean.jsonl.
Used to choose between two training recipes without looking at the benchmark (experiments/README.md):

    python experiments/clean_heldapart.py /tmp/clean_heldapart.jsonl
    python -m specdec.run "strategies=[greedy,eagle]" data=jsonl data.path=/tmp/clean_heldapart.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import Counter

from heads.contamination import EVAL_DIR, EvalIndex, default_suite_turns, file_turns
from heads.distill_data import distill_prompts
from specdec.data import default_suite

SPAN = 160


def clean_questions(seeds: tuple[int, ...] = (17, 23, 29), per_category: int = 8, keep: int = 3) -> list[dict]:
    train = distill_prompts(per_category=70, seeds=[1, 2, 3], exclude_per_category=20, exclude_seed=0,
                            instructions=1200)
    bench = [t for q in default_suite(per_category=10, seed=0) for t in q.turns]
    seen_text = "\n".join(train + bench)
    evaluation = EvalIndex(default_suite_turns(None, None) + [t for f in sorted(EVAL_DIR.glob("*.jsonl"))
                                                           for t in file_turns(f)])

    def unseen(turn: str) -> bool:
        return not any(turn[i:i + SPAN] in seen_text for i in range(0, max(1, len(turn) - SPAN), 40))

    out: list[dict] = []
    per: Counter[str] = Counter()
    seen: set[tuple[str, ...]] = set()
    for seed in seeds:
        for q in default_suite(per_category=per_category, seed=seed):
            if (tuple(q.turns) in seen or per[q.category] >= keep or not all(map(unseen, q.turns))
                    or evaluation.hits(list(q.turns))):
                continue
            seen.add(tuple(q.turns))
            per[q.category] += 1
            out.append({"question_id": f"{seed}-{q.question_id}", "category": q.category, "turns": list(q.turns)})
    return out


if __name__ == "__main__":
    questions = clean_questions()
    with open(sys.argv[1], "w") as f:
        f.writelines(json.dumps(q) + "\n" for q in questions)
    print(f"{len(questions)} questions, {sum(len(q['turns']) for q in questions)} turns: "
          f"{dict(Counter(q['category'] for q in questions))}")
