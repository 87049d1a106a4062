"""Checks on command-line overrides that Hydra would otherwise report as multi-line tracebacks."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specdec.errors import SpecdecError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
GROUPS = ("model", "strategy", "data", "generation", "logger", "experiment", "hydra")
# Named in CONTRACT.md; configs/strategy/ holds those that are built.
CONTRACT_STRATEGIES = ("greedy", "draft", "medusa", "prompt_lookup", "lookahead", "eagle", "hf_generate",
                       "hf_assisted")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _unknown(group: str, value: str) -> SpecdecError:
    valid = ", ".join(options(group))
    if group == "strategy" and value in CONTRACT_STRATEGIES:
        return SpecdecError(f"strategy {value!r} is not built yet; built strategies: {valid}")
    return SpecdecError(f"unknown {group} {value!r}; choose one of: {valid}")


def check_overrides(argv: list[str]) -> None:
    """Group choices and strategy lists must name config files that exist."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        if not sep:
            continue
        if key in GROUPS and value and value != "null" and "," not in value:
            if not (CONFIG_DIR / key / f"{value}.yaml").is_file():
                raise _unknown(key, value)
        if key == "strategies" and value not in ("", "null"):
            parsed = OmegaConf.create({"v": value}).v if not value.startswith("[") else None
            names = [n.strip() for n in value.strip("[]").split(",") if n.strip()] if parsed is None else [parsed]
            for name in names:
                if not (CONFIG_DIR / "strategy" / f"{name}.yaml").is_file():
                    raise _unknown("strategy", name)


def debug_requested(argv: list[str]) -> bool:
    """Whether the command line asks for tracebacks (`debug=true`), read before Hydra composes."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") == "debug":
            return value.strip().lower() in ("true", "1", "yes", "on")
    return False


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _keys_under(parent: str, argv: list[str], skip: str) -> list[str] | None:
    """The keys of config node `parent` as composed without the failing override `skip`, or None."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = [a for a in argv if a != skip and not a.startswith("-") and not a.startswith(("hydra.", "hydra/"))]
    try:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = compose("run", overrides=overrides)
        node = OmegaConf.select(cfg, parent) if parent else cfg
    except Exception:  # the hint is a courtesy; the error itself is already known
        return None
    return sorted(str(k) for k in node) if isinstance(node, DictConfig) else None


def _unparsable(argv: list[str]) -> str | None:
    """The first command-line override Hydra's grammar rejects."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for arg in argv:
        if arg.startswith("-"):
            continue
        try:
            parser.parse_overrides([arg])
        except Exception:  # any parse failure marks the culprit
            return arg
    return None


def hydra_error_line(exc: BaseException, argv: list[str]) -> str:
    """One line for an error Hydra raised while composing the config from the command line."""
    from hydra.errors import MissingConfigException, OverrideParseException

    text = str(exc)
    cause = exc.__cause__
    unknown = re.search(r"Could not override '([^']+)'", text)
    if unknown and cause is not None and "not in struct" in str(cause):
        dotted = unknown.group(1)
        parent, _, leaf = dotted.rpartition(".")
        bad = next((a for a in argv if a.partition("=")[0].lstrip("~") == dotted), dotted)
        keys = _keys_under(parent, argv, bad)
        where = f"under {parent}" if parent else "at the top level"
        valid = f"; valid keys {where}: {', '.join(keys)}" if keys else ""
        return f"unknown config key {dotted!r}{valid} (to add a new key on purpose write +{bad.lstrip('+~')})"
    if isinstance(exc, OverrideParseException):
        first = _one_line(text.splitlines()[0]) if text.strip() else "syntax error"
        return (f"cannot parse override {_unparsable(argv) or ''!r}: {first}; write key=value and quote values "
                "with special characters (see https://hydra.cc/docs/advanced/override_grammar/basic)").replace(
                    "override '': ", "override: ")
    if isinstance(exc, MissingConfigException):
        text = text.split("Config search path")[0]
        return f"{_one_line(text)} (options are the files in {CONFIG_DIR})"
    lines = [_one_line(line) for line in text.splitlines() if line.strip() and not line.startswith((" ", "\t"))]
    if cause is not None and str(cause).strip():
        lines += [_one_line(line) for line in str(cause).splitlines()
                  if line.strip() and not line.startswith((" ", "\t"))]
    detail = "; ".join(dict.fromkeys(line.rstrip(".") for line in lines)) or type(exc).__name__
    return f"{detail} (rerun with debug=true for the traceback)"


def _strategy_file(name: str, seen: tuple[str, ...] = ()) -> DictConfig:
    """configs/strategy/NAME.yaml over the strategies its `defaults` list names, as Hydra composes a group
    file (`defaults: [medusa, _self_]` is medusa with this file's keys on top)."""
    path = CONFIG_DIR / "strategy" / f"{name}.yaml"
    if not path.is_file():
        raise _unknown("strategy", name)
    if name in seen:
        raise SpecdecError(f"configs/strategy/{name}.yaml names itself in its defaults (through "
                           f"{', '.join(seen)}); break the loop")
    own = OmegaConf.load(path)
    assert isinstance(own, DictConfig)
    merged = OmegaConf.create()
    for entry in own.pop("defaults", None) or []:
        if entry == "_self_":
            continue
        if not isinstance(entry, str):
            raise SpecdecError(f"configs/strategy/{name}.yaml: defaults may list only other strategies of the "
                               f"group and _self_, got {entry!r}")
        merged = OmegaConf.merge(merged, _strategy_file(entry, (*seen, name)))
    out = OmegaConf.merge(merged, own)
    assert isinstance(out, DictConfig)
    return out


def strategy_config(cfg: DictConfig, name: str) -> DictConfig:
    """The config of strategy `name`: the composed `strategy` group if it is that one (so overrides
    such as strategy.gamma=4 apply), otherwise configs/strategy/NAME.yaml as written."""
    if cfg.strategy is not None and cfg.strategy.get("name") == name:
        scfg = OmegaConf.create(OmegaConf.to_container(cfg.strategy, resolve=False))
    else:
        scfg = _strategy_file(name)
    assert isinstance(scfg, DictConfig)
    scfg = OmegaConf.merge(scfg, {})
    # interpolations such as ${model} resolve against the run's config
    root = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    root._this = scfg
    resolved = OmegaConf.to_container(root._this, resolve=True)
    out = OmegaConf.create(resolved)
    assert isinstance(out, DictConfig)
    return out
