"""`python -m specdec.run`: benchmark strategies side by side on a prompt suite (see CONTRACT.md).

A thin `@hydra.main` over `run(cfg)`, which tests and notebooks call directly.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from specdec.cli_checks import CONFIG_DIR, check_overrides, strategy_config
from specdec.data import Question, select
from specdec.engine.sampling import SamplingParams
from specdec.errors import SpecdecError
from specdec.metrics import add_speedup_ci, summarize
from specdec.models.loader import LoadedModel
from specdec.results import AnswerLog
from specdec.strategies.base import GenerationParams, Strategy


class Interrupted(SpecdecError):
    """Ctrl-C: what finished is on disk; the same command with the same output_dir resumes."""


def load_questions(data_cfg: DictConfig) -> list[Question]:
    cfg = OmegaConf.to_container(data_cfg, resolve=True)
    assert isinstance(cfg, dict)
    limit, categories = cfg.pop("limit", None), cfg.pop("categories", None)
    cfg.pop("name", None)
    if "path" in data_cfg and OmegaConf.is_missing(data_cfg, "path"):
        raise SpecdecError(f"data={data_cfg.name} needs a file: add data.path=FILE")
    return select(instantiate(cfg), limit=limit, categories=categories)


def generation_params(cfg: DictConfig, target: LoadedModel) -> GenerationParams:
    g = cfg.generation
    if int(g.max_new_tokens) < 1:
        raise SpecdecError(f"generation.max_new_tokens={g.max_new_tokens} must be at least 1")
    return GenerationParams(int(g.max_new_tokens), SamplingParams(float(g.temperature), float(g.top_p)),
                            target.eos_ids)


def build_strategies(cfg: DictConfig, target: LoadedModel) -> dict[str, Strategy]:
    names = list(cfg.strategies) if cfg.strategies else [cfg.strategy.name]
    if len(set(names)) != len(names):
        raise SpecdecError(f"strategies={names} lists a strategy twice; give each once")
    built: dict[str, Strategy] = {}
    for name in names:
        scfg = strategy_config(cfg, name)
        factory = instantiate(scfg)
        built[name] = factory(target=target, max_len=int(cfg.generation.max_len),
                              prefill_chunk=int(cfg.generation.prefill_chunk))
    return built


def _turn_seed(seed: int, question_id: str, turn: int, repeat: int) -> int:
    # Stable across processes (unlike hash()) so a resumed or repeated run draws the same samples.
    return zlib.crc32(f"{seed}/{question_id}/{turn}/{repeat}".encode())


def _answer(strategy: Strategy, target: LoadedModel, q: Question, params: GenerationParams, seed: int,
            log: AnswerLog, repeat: int) -> None:
    """Answer every turn of q not yet on disk, each with this strategy's own conversation so far."""
    messages: list[dict[str, str]] = []
    for turn, text in enumerate(q.turns):
        messages.append({"role": "user", "content": text})
        done = log.get(strategy.name, q.question_id, turn, repeat)
        if done is not None:
            messages.append({"role": "assistant", "content": done["output_text"]})
            continue
        prompt = target.chat_ids(messages)
        res = strategy.generate(prompt, params, _turn_seed(seed, q.question_id, turn, repeat))
        text_out = target.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        row = {
            "question_id": q.question_id, "category": q.category, "turn": turn, "strategy": strategy.name,
            "prompt_tokens": len(prompt), "new_tokens": len(res.output_ids), "output_ids": res.output_ids,
            "output_text": text_out, "wall_time_s": res.wall_time_s, "ttft_s": res.ttft_s,
            "decode_steps": res.decode_steps, "accept_lengths": res.accept_lengths,
            "proposed_tokens": res.proposed, "accepted_tokens": res.accepted,
            "proposed_by_pos": res.proposed_by_pos, "accepted_by_pos": res.accepted_by_pos,
            "draft_time_s": res.draft_time_s, "repeat": repeat,
        }
        log.append(row)
        messages.append({"role": "assistant", "content": text_out})


def _warm_up(strategies: dict[str, Strategy], target: LoadedModel, questions: list[Question],
             params: GenerationParams, turns: int) -> None:
    short = GenerationParams(min(params.max_new_tokens, 32), params.sampling, params.eos_ids)
    for i in range(turns):
        prompt = target.chat_ids([{"role": "user", "content": questions[i % len(questions)].turns[0]}])
        for s in strategies.values():
            s.generate(prompt, short, 0)


def environment() -> dict[str, Any]:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured strategies over the suite; write answers.jsonl and summary.json."""
    out_dir = Path(cfg.output_dir)
    questions = load_questions(cfg.data)
    target: LoadedModel = instantiate(cfg.model)
    params = generation_params(cfg, target)
    strategies = build_strategies(cfg, target)
    names = list(strategies)
    baseline = cfg.baseline or names[0]
    if baseline not in strategies:
        raise SpecdecError(f"baseline={baseline} is not among strategies={names}; add it or pick one of them")
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)
    config["environment"] = environment() | {"dtype": str(target.dtype).removeprefix("torch."),
                                             "backend": target.backend}
    log = AnswerLog(out_dir / "answers.jsonl")
    logger = instantiate(cfg.logger)
    logger.start(config, out_dir)
    failures: dict[str, str] = {}
    interrupted = False
    try:
        if cfg.warmup and log.count() == 0:
            _warm_up(strategies, target, questions, params, int(cfg.warmup))
        from tqdm import tqdm

        total = len(questions) * len(names) * int(cfg.repeats)
        with tqdm(total=total, desc="specdec", unit="answer", disable=None) as bar:
            for repeat in range(int(cfg.repeats)):
                for i, q in enumerate(questions):
                    # alternate the order so neither strategy always runs on a warmer machine
                    order = names if (i + repeat) % 2 == 0 else names[::-1]
                    for name in order:
                        try:
                            _answer(strategies[name], target, q, params, int(cfg.seed), log, repeat)
                        except SpecdecError as e:
                            failures[f"{name}/{q.question_id}"] = str(e)
                            bar.write(f"failed: {name} on question {q.question_id}: {e}")
                        bar.update(1)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for row in log.new_rows:
            logger.log_turn(row)
        summary = summarize(log.rows(), baseline, params.sampling.temperature, names, config)
        add_speedup_ci(summary)
        summary["failures"] = failures
        summary["interrupted"] = interrupted
        _write_json(out_dir / "summary.json", summary)
        logger.log_summary(summary, [out_dir / "summary.json", out_dir / "answers.jsonl"])
        logger.finish()
    if interrupted:
        raise Interrupted(f"interrupted: {log.count()} answers kept in {out_dir}; rerun with "
                           f"output_dir={out_dir} to resume")
    if failures:
        raise SpecdecError(f"{len(failures)} answers failed ({', '.join(sorted(failures))}); the others are in "
                           f"{out_dir}; see summary.json 'failures'")
    return summary


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def print_summary(summary: dict[str, Any], out_dir: str) -> None:
    print(f"\nresults: {out_dir}  (baseline {summary['baseline']})")
    print(f"{'strategy':<20}{'tokens/s':>10}{'speedup':>9}{'tau':>7}{'alpha':>7}{'match':>7}")
    for name, s in summary["strategies"].items():
        def fmt(v: float | None, w: int, p: int = 2) -> str:
            return f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}"
        print(f"{name:<20}{fmt(s['tokens_per_s'], 10)}{fmt(s['speedup'], 9)}{fmt(s['mean_accepted_tokens'], 7)}"
              f"{fmt(s['acceptance_rate'], 7)}{fmt(s['matches_baseline'], 7)}")


def user_error(exc: BaseException) -> SpecdecError | None:
    """The SpecdecError behind exc, if any: Hydra's instantiate wraps what our loaders raise."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, SpecdecError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="run")
def hydra_main(cfg: DictConfig) -> None:
    try:
        summary = run(cfg)
    except Exception as e:
        err = user_error(e)
        if err is None or cfg.get("debug"):
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(130 if isinstance(err, Interrupted) else 2)
    print_summary(summary, cfg.output_dir)


def main() -> None:
    try:
        check_overrides(sys.argv[1:])
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    hydra_main()


if __name__ == "__main__":
    main()
