"""Checks on command-line overrides that Hydra would otherwise report as multi-line tracebacks."""

from __future__ import annotations

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


def strategy_config(cfg: DictConfig, name: str) -> DictConfig:
    """The config of strategy `name`: the composed `strategy` group if it is that one (so overrides
    such as strategy.gamma=4 apply), otherwise configs/strategy/NAME.yaml as written."""
    if cfg.strategy is not None and cfg.strategy.get("name") == name:
        scfg = OmegaConf.create(OmegaConf.to_container(cfg.strategy, resolve=False))
    else:
        path = CONFIG_DIR / "strategy" / f"{name}.yaml"
        if not path.is_file():
            raise _unknown("strategy", name)
        scfg = OmegaConf.load(path)
    assert isinstance(scfg, DictConfig)
    scfg = OmegaConf.merge(scfg, {})
    scfg.pop("defaults", None)
    # interpolations such as ${model} resolve against the run's config
    root = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    root._this = scfg
    resolved = OmegaConf.to_container(root._this, resolve=True)
    out = OmegaConf.create(resolved)
    assert isinstance(out, DictConfig)
    return out
