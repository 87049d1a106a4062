"""`python -m specdec.run`: benchmark strategies side by side on a prompt suite (see CONTRACT.md).

A thin `@hydra.main` over `run(cfg)`, which tests and notebooks call directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from specdec.cache_len import AUTO_FLOOR, cache_len, fit_cache, is_auto
from specdec.cli_checks import (
    CONFIG_DIR,
    check_overrides,
    debug_requested,
    hydra_error_line,
    native_overrides,
    run_searchpath,
    strategy_config,
)
from specdec.data import Question, select
from specdec.engine.engine import measured_curves
from specdec.engine.sampling import SamplingParams
from specdec.errors import SpecdecError
from specdec.metrics import add_speedup_ci, lossless, summarize
from specdec.models.loader import LoadedModel
from specdec.provenance import environment, git_state, kernel_target, peak_rss_mb
from specdec.resolvers import repo_relative
from specdec.results import AnswerLog, answers_code, check_resume_key, code_states, earlier_strategy_configs
from specdec.specbench import add_specbench_speedup
from specdec.strategies.base import GenerationParams, Strategy


class Interrupted(SpecdecError):
    """Ctrl-C: what finished is on disk; the same command with the same output_dir resumes."""


def build(cfg: Any) -> Any:
    """hydra.utils.instantiate, re-raising the SpecdecError a target raised rather than Hydra's wrapper
    (callers of run() then see the same one line the CLI prints)."""
    try:
        return instantiate(cfg)
    except Exception as e:
        err = user_error(e)
        if err is None or err is e:
            raise
        raise err from None  # its own traceback still points at the target


def load_questions(data_cfg: DictConfig) -> list[Question]:
    cfg = OmegaConf.to_container(data_cfg, resolve=True)
    assert isinstance(cfg, dict)
    limit, categories = cfg.pop("limit", None), cfg.pop("categories", None)
    skip = cfg.pop("skip", None)
    cfg.pop("name", None)
    if "path" in cfg and OmegaConf.is_missing(data_cfg, "path"):  # `in` on the DictConfig skips missing keys
        raise SpecdecError(f"data={data_cfg.name} needs a file: add data.path=FILE")
    return select(build(cfg), limit=limit, categories=categories, skip=0 if skip is None else skip)


def _integer(value: Any, name: str, minimum: int) -> int:
    # OmegaConf keeps `generation.max_new_tokens=abc` as a string; say so instead of a ValueError.
    try:
        if isinstance(value, (bool, float)):
            raise ValueError
        number = int(str(value))
    except ValueError:
        raise SpecdecError(f"{name}={value!r} is not an integer; give a whole number >= {minimum}") from None
    if number < minimum:
        raise SpecdecError(f"{name}={number} must be at least {minimum}")
    return number


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool):
        value = "bool"
    try:
        return float(value)
    except (TypeError, ValueError):
        raise SpecdecError(f"{name}={value!r} is not a number; use for example {name}=0.7") from None


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise SpecdecError(f"{name}={value!r} is not a boolean; use {name}=true or {name}=false")
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(x, str) and x for x in items):
        raise SpecdecError(f"generation.stop={items!r} must be a list of non-empty strings, e.g. "
                           "'generation.stop=[\"###\"]'")
    # Hydra's override grammar keeps backslashes as typed: read \n and \t as on the command line.
    escapes = {"n": "\n", "t": "\t", "\\": "\\"}
    return tuple(re.sub(r"\\([nt\\])", lambda m: escapes[m.group(1)], x) for x in items)


def generation_params(cfg: DictConfig, eos_ids: tuple[int, ...] = ()) -> GenerationParams:
    """The checked `generation` group (and the run's counters): every mistake fails before loading."""
    g = cfg.generation
    max_new = _integer(g.max_new_tokens, "generation.max_new_tokens", 1)
    sampling = SamplingParams(_number(g.temperature, "generation.temperature"), _number(g.top_p, "generation.top_p"))
    try:
        max_len = None if is_auto(g.max_len) else _integer(g.max_len, "generation.max_len", 2)
    except SpecdecError as e:
        raise SpecdecError(f"{e} or auto") from None
    _integer(g.prefill_chunk, "generation.prefill_chunk", 1)
    _integer(g.get("batch_size", 1), "generation.batch_size", 1)
    _integer(cfg.seed, "seed", 0)
    _integer(cfg.warmup, "warmup", 0)
    _integer(cfg.repeats, "repeats", 1)
    _flag(g.get("prefix_cache", True), "generation.prefix_cache")
    if max_len is not None and max_new >= max_len:
        raise SpecdecError(f"generation.max_new_tokens={max_new} leaves no room for the prompt in "
                           f"generation.max_len={max_len}; raise max_len or lower max_new_tokens")
    return GenerationParams(max_new, sampling, eos_ids, _stop_strings(g.get("stop")))


def strategy_names(cfg: DictConfig) -> list[str]:
    names = [str(n) for n in cfg.strategies] if cfg.strategies else [cfg.strategy.name]
    if len(set(names)) != len(names):
        raise SpecdecError(f"strategies={names} lists a strategy twice; give each once")
    return names


def build_strategies(cfg: DictConfig, target: LoadedModel,
                     configs: dict[str, DictConfig] | None = None) -> dict[str, Strategy]:
    built: dict[str, Strategy] = {}
    for name in strategy_names(cfg):
        scfg = configs[name] if configs is not None else strategy_config(cfg, name)
        # a strategy's own prefix_cache (a variant compared in the same run) overrides generation's; it is
        # the runner's setting, not the strategy's argument, but stays in the config that is recorded
        own = scfg.get("prefix_cache")
        reuse = _flag(own if own is not None else cfg.generation.get("prefix_cache", True),
                      f"strategies.{name}.prefix_cache" if own is not None else "generation.prefix_cache")
        if "prefix_cache" in scfg:
            scfg = scfg.copy()
            del scfg["prefix_cache"]
        factory = build(scfg)
        built[name] = factory(target=target, max_len=cache_len(cfg.generation.max_len),
                              prefill_chunk=int(cfg.generation.prefill_chunk))
        built[name].reuse_prefix(reuse)
    return built


def _turn_seed(seed: int, question_id: str, turn: int, repeat: int) -> int:
    # Stable across processes (unlike hash()) so a resumed or repeated run draws the same samples.
    return zlib.crc32(f"{seed}/{question_id}/{turn}/{repeat}".encode())


def _answer(strategy: Strategy, target: LoadedModel, q: Question, params: GenerationParams, seed: int,
            log: AnswerLog, repeat: int, on_row: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Answer every turn of q not yet on disk, each with this strategy's own conversation so far;
    `on_row` sees each new answer once it is on disk (the logger, as the turns happen)."""
    messages: list[dict[str, str]] = []
    strategy.new_conversation()  # only this conversation's own turns reuse its cached prefix
    for turn, text in enumerate(q.turns):
        messages.append({"role": "user", "content": text})
        done = log.get(strategy.name, q.question_id, turn, repeat)
        if done is not None:
            messages.append({"role": "assistant", "content": done["output_text"]})
            continue
        prompt = target.chat_ids(messages)
        try:
            if len(prompt) >= target.context_len:
                raise SpecdecError(f"prompt of {len(prompt)} tokens does not fit the model's context of "
                                   f"{target.context_len}; shorten the question or use a longer-context model")
            res = strategy.generate(prompt, params, _turn_seed(seed, q.question_id, turn, repeat))
        except SpecdecError as e:
            raise SpecdecError(f"turn {turn}: {e}") from e
        except torch.OutOfMemoryError as e:
            raise SpecdecError(f"turn {turn}: out of GPU memory; lower generation.max_len or use a smaller "
                               "model") from e
        text_out = target.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        row = turn_row(strategy.name, q, turn, repeat, prompt, res, text_out)
        log.append(row)
        if on_row is not None:
            on_row(row)
        messages.append({"role": "assistant", "content": text_out})


def turn_row(name: str, q: Question, turn: int, repeat: int, prompt: list[int], res: Any,
             text_out: str) -> dict[str, Any]:
    """One answer as answers.jsonl keeps it (CONTRACT.md)."""
    return {
        "question_id": q.question_id, "category": q.category, "turn": turn, "strategy": name,
        "prompt_tokens": len(prompt), "new_tokens": len(res.output_ids), "output_ids": res.output_ids,
        "output_text": text_out, "wall_time_s": res.wall_time_s, "ttft_s": res.ttft_s,
        "decode_steps": res.decode_steps, "accept_lengths": res.accept_lengths,
        "proposed_tokens": res.proposed, "accepted_tokens": res.accepted,
        # every verified draft node (a tree's, not only its longest path): alpha per node
        "proposed_nodes": getattr(res, "proposed_nodes", None),
        "proposed_by_pos": res.proposed_by_pos, "accepted_by_pos": res.accepted_by_pos,
        "draft_time_s": res.draft_time_s, "repeat": repeat,
    } | ({"ttft_wall_s": res.ttft_wall_s} if getattr(res, "ttft_wall_s", None) is not None else {})


def _warm_up(strategies: dict[str, Strategy], target: LoadedModel, questions: list[Question],
             params: GenerationParams, turns: int) -> None:
    short = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, 32))
    for i in range(turns):
        prompt = target.chat_ids([{"role": "user", "content": questions[i % len(questions)].turns[0]}])
        for s in strategies.values():
            with contextlib.suppress(SpecdecError):  # a question that fails is recorded when it is answered
                s.generate(prompt, short, 0)


def _pending(log: AnswerLog, names: list[str], questions: list[Question], repeats: int) -> int:
    """Answers (strategy, question, turn, repeat) not yet on disk."""
    return sum(not log.has(n, q.question_id, t, r)
               for r in range(repeats) for q in questions for n in names for t in range(len(q.turns)))


def _flat(obj: Any, prefix: str) -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out |= _flat(v, f"{prefix}.{k}")
        return out
    return {prefix: obj}


def resume_key(cfg: DictConfig, strategy_cfgs: dict[str, DictConfig]) -> dict[str, Any]:
    """Settings that change answers: a resumed run must share them (cache sizes may change)."""
    gen = OmegaConf.to_container(cfg.generation, resolve=True)
    assert isinstance(gen, dict)
    for k in ("max_len", "prefill_chunk"):
        gen.pop(k, None)
    key = _flat(OmegaConf.to_container(cfg.model, resolve=True), "model") | _flat(gen, "generation")
    key["seed"] = cfg.seed
    for name, scfg in strategy_cfgs.items():
        key |= _flat(OmegaConf.to_container(scfg, resolve=True), f"strategy.{name}")
    return key


@contextlib.contextmanager
def _no_interrupts() -> Iterator[None]:
    """Hold Ctrl-C off while the summary is written, so a second press does not tear it."""
    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to hold off
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _wandb_grouping(names: list[str]) -> dict[str, Any]:
    """Where this run sits among others, for the logger: the jobs of one multirun share a `group` (their
    sweep folder, relative to where it was launched), `job_type` names the strategies compared, and
    `job_name` the job (its number and overrides). Outside a multirun only job_type is set."""
    from hydra.core.hydra_config import HydraConfig

    grouping: dict[str, Any] = {"group": None, "job_type": ",".join(names), "job_name": None}
    if not _in_multirun():
        return grouping
    hc = HydraConfig.get()
    out = Path(str(hc.runtime.output_dir))
    depth = len(Path(str(hc.sweep.subdir)).parts)
    sweep = out.parents[depth - 1] if 0 < depth <= len(out.parents) else out
    with contextlib.suppress(ValueError):
        sweep = sweep.relative_to(Path(str(hc.runtime.cwd)))
    grouping["group"] = sweep.as_posix()
    grouping["job_name"] = " ".join([f"job{hc.job.num}", *hc.overrides.task])
    return grouping


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured strategies over the suite; write answers.jsonl and summary.json.

    Everything that can be checked without the model (settings, data, strategy names, output_dir)
    is checked before it loads. A question that fails is recorded and the run goes on; finished
    answers are never generated twice, so the same call with the same output_dir resumes.
    """
    out_dir = Path(cfg.output_dir)
    params = generation_params(cfg)
    names = strategy_names(cfg)
    baseline = cfg.baseline or names[0]
    if baseline not in names:
        raise SpecdecError(f"baseline={baseline} is not among strategies={names}; add it or pick one of them")
    searchpath = run_searchpath(cfg)
    strategy_cfgs = {name: strategy_config(cfg, name, searchpath) for name in names}
    questions = load_questions(cfg.data)
    log = AnswerLog(out_dir / "answers.jsonl")
    check_resume_key(out_dir, resume_key(cfg, strategy_cfgs), has_answers=log.count() > 0)
    repeats = int(cfg.repeats)
    pending = _pending(log, names, questions, repeats)
    states = code_states(out_dir, *git_state(), adds=pending > 0, has_answers=log.count() > 0)

    target: LoadedModel = build(cfg.model)
    params = dataclasses.replace(params, eos_ids=target.eos_ids)
    if is_auto(cfg.generation.max_len):  # recorded as the number it became
        cfg.generation.max_len = fit_cache(target, questions, params.max_new_tokens)
        if cfg.generation.max_len > AUTO_FLOOR:
            print(f"generation.max_len=auto: {cfg.generation.max_len} KV cache slots per sequence for the longest "
                  "conversation", file=sys.stderr)
    strategies = build_strategies(cfg, target, strategy_cfgs)
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)
    config["environment"] = environment(target, config.get("model"))
    if "batch_size" in (config.get("generation") or {}):
        config["environment"]["batch_size"] = config["generation"]["batch_size"]
    # what ran, per strategy: also for entries of strategies=[...], which the composed `strategy` is not
    ran = {name: OmegaConf.to_container(scfg, resolve=True) for name, scfg in strategy_cfgs.items()}
    # the exact command, so every committed table names what reproduces it
    from hydra.core.hydra_config import HydraConfig

    args = sys.argv[1:]
    if HydraConfig.initialized():  # per job in a multirun, unlike argv
        args = config["overrides"] = list(HydraConfig.get().overrides.task)
    config["command"] = " ".join(["python -m specdec.run", *args])
    logger = build(cfg.logger)
    logger.start(config, out_dir, **_wandb_grouping(names))
    logged = 0  # answers of this run the logger has seen

    def log_turn(row: dict[str, Any]) -> None:
        nonlocal logged
        logger.log_turn(row)
        logged += 1

    failures: dict[str, str] = {}
    interrupted = False
    try:
        # a resumed run still measures warm strategies, unless nothing is left to measure
        if cfg.warmup and pending and int(cfg.generation.get("batch_size", 1) or 1) == 1:
            _warm_up(strategies, target, questions, params, int(cfg.warmup))
        from tqdm import tqdm

        total = len(questions) * len(names) * repeats
        batch = int(cfg.generation.get("batch_size", 1) or 1)
        with tqdm(total=total, desc="specdec", unit="answer", disable=None) as bar:
            if batch > 1:
                from specdec.run_batched import answer_batched

                answer_batched(strategies, target, questions, params, int(cfg.seed), log, repeats, batch,
                               log_turn, failures, lambda: bar.update(1), warmup=bool(cfg.warmup) and pending > 0)
            for repeat in range(repeats if batch == 1 else 0):
                for i, q in enumerate(questions):
                    # alternate the order so neither strategy always runs on a warmer machine
                    order = names if (i + repeat) % 2 == 0 else names[::-1]
                    for name in order:
                        try:
                            _answer(strategies[name], target, q, params, int(cfg.seed), log, repeat, log_turn)
                        except SpecdecError as e:
                            where = f"{name}/{q.question_id}" + (f"/repeat{repeat}" if repeat else "")
                            failures[where] = str(e)
                            bar.write(f"failed: {name} on question {q.question_id}: {e}")
                        bar.update(1)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        with _no_interrupts():
            log.refresh()
            for row in log.new_rows[logged:]:  # on disk but not yet logged (Ctrl-C between the two)
                logger.log_turn(row)
            summary = summarize(log.rows(), baseline, params.sampling.temperature, names, config)
            for name, s in summary["strategies"].items():
                if name in strategies:  # whether its turns reused the cached prefix (peers never do)
                    s["prefix_cache"] = strategies[name].prefix_cache
            add_speedup_ci(summary)
            add_specbench_speedup(summary, log.rows(), target.tokenizer)  # Spec-Bench's definition
            config["environment"] |= kernel_target(target)  # a drafter may have compiled kernels since
            config["environment"]["pass_cost_curves"] = measured_curves(target.model)  # what drafts were sized by
            summary["environment"] = config["environment"]
            summary["environment"] |= answers_code(states, config["environment"]["commit"],
                                                   config["environment"]["dirty"])
            add_provenance(summary, ran | earlier_strategy_configs(out_dir, set(summary["strategies"]) - set(ran)),
                           params.sampling.temperature)
            summary["failures"] = failures
            summary["interrupted"] = interrupted
            summary["peak_rss_mb"] = round(peak_rss_mb(), 1)
            summary = repo_relative(summary)  # the same record from every checkout of the repository
            _write_json(out_dir / "summary.json", summary)
            logger.log_summary(summary, [out_dir / "summary.json", out_dir / "answers.jsonl"])
            logger.finish()
    if interrupted:
        raise Interrupted(f"interrupted: {log.count()} answers are kept in {out_dir}; run the same command "
                          f"with output_dir={out_dir} to resume")
    if failures:
        listed = sorted(failures)
        more = f" and {len(listed) - 10} more" if len(listed) > 10 else ""
        raise SpecdecError(f"{len(failures)} questions failed ({', '.join(listed[:10])}{more}); the other answers "
                           f"are in {out_dir}, the reasons in summary.json 'failures'; fix them and run the same "
                           "command to answer only those")
    return summary


def add_provenance(summary: dict[str, Any], configs: dict[str, Any], temperature: float) -> None:
    """Per strategy: the config it ran with and whether its output is exactly the target's."""
    for name, s in summary["strategies"].items():
        scfg = configs.get(name)
        s["config"] = scfg if isinstance(scfg, dict) else {}
        s["lossless"] = lossless(scfg, temperature)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def print_summary(summary: dict[str, Any], out_dir: str) -> None:
    print(f"\nresults: {out_dir}  (baseline {summary['baseline']})")
    print(f"{'strategy':<20}{'tokens/s':>10}{'speedup':>9}{'95% CI':>16}{'tau':>7}{'alpha':>7}{'match':>7}")
    for name, s in summary["strategies"].items():
        def fmt(v: float | None, w: int, p: int = 2) -> str:
            return f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}"
        ci = s.get("speedup_ci")
        shown = f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "-"
        lossy = "  lossy" if s.get("lossless") is False else ""
        print(f"{name:<20}{fmt(s['tokens_per_s'], 10)}{fmt(s['speedup'], 9)}{shown:>16}"
              f"{fmt(s['mean_accepted_tokens'], 7)}{fmt(s['acceptance_rate'], 7)}{fmt(s['matches_baseline'], 7)}"
              f"{lossy}")
    if summary.get("peak_rss_mb"):
        print(f"peak resident memory: {summary['peak_rss_mb']:.0f} MB")


def user_error(exc: BaseException) -> SpecdecError | None:
    """The SpecdecError behind exc, if any: Hydra's instantiate wraps what our loaders raise."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, SpecdecError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


# Exit codes: bad input or failed questions, an internal error, Ctrl-C (the shell's 128 + SIGINT).
EXIT_USER, EXIT_BUG, EXIT_INTERRUPTED = 2, 1, 130


class JobFailed(Exception):
    """A multirun job failed and has said why on stderr: the sweep runs its other jobs, then exits."""

    def __init__(self, code: int) -> None:
        super().__init__(f"a job failed (exit code {code})")
        self.code = code


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:  # not under Hydra (run() called directly)
        return False


def _fail(line: str, code: int) -> None:
    print(f"error: {line}", file=sys.stderr)
    if code != EXIT_INTERRUPTED and _in_multirun():
        raise JobFailed(code)  # Hydra's sweeper finishes the other jobs first
    sys.exit(code)


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="run")
def hydra_main(cfg: DictConfig) -> None:
    try:
        summary = run(cfg)
    except KeyboardInterrupt:  # before the answer loop (loading): nothing new was written
        if cfg.get("debug"):
            raise
        _fail(f"interrupted before any answer was generated; run the same command to start again "
              f"(output_dir={cfg.output_dir})", EXIT_INTERRUPTED)
        return
    except Exception as e:
        if cfg.get("debug"):
            raise
        err = user_error(e)
        if err is None:
            detail = " ".join(str(e).split())[:300]
            _fail(f"unexpected {type(e).__name__}: {detail} (rerun with debug=true for the traceback)", EXIT_BUG)
        else:
            _fail(" ".join(str(err).split()), EXIT_INTERRUPTED if isinstance(err, Interrupted) else EXIT_USER)
        return
    print_summary(summary, cfg.output_dir)


def main() -> None:
    """The CLI: Hydra's own errors (bad overrides, unknown keys) also come out as one line."""
    argv = sys.argv[1:]
    debug = debug_requested(argv) or os.environ.get("HYDRA_FULL_ERROR") == "1"
    # With this set Hydra re-raises composition errors instead of printing them over several lines.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        # strategies.NAME.KEY=VALUE -> Hydra's own selection of NAME at strategy_configs.NAME, and its key
        argv = native_overrides(argv)
        sys.argv[1:] = argv
        check_overrides(argv)
        hydra_main()
    except JobFailed as e:
        sys.exit(e.code)
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted before the run started; nothing was written", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as e:
        if debug:
            raise
        # check_overrides' own errors are already one line that names the fix
        line = " ".join(str(e).split()) if isinstance(e, SpecdecError) else hydra_error_line(e, argv)
        print(f"error: {line}", file=sys.stderr)
        sys.exit(EXIT_USER)


if __name__ == "__main__":
    main()
