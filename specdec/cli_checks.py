"""The command line around Hydra: checks that Hydra would report as multi-line tracebacks, the
shorthand for overriding one listed strategy, and the config of each listed strategy as Hydra composes it.

Terms used below:

- *config folder*: the package's own `configs/` (CONFIG_DIR) followed by the folders named on
  `hydra.searchpath` (e.g. `hydra.searchpath=[file:///home/me/specdec-configs]`), searched in that
  order: a file the package ships wins over a user file of the same group and name.
- *listed strategy*: a name in `strategies=[...]`, run side by side with the others.
- *entry*: a listed strategy composed by Hydra at `strategy_configs.NAME`, selected with Hydra's own
  syntax for choosing one group several times, `+strategy@strategy_configs.NAME=FILE`. Its keys are
  then ordinary config keys: `strategy_configs.NAME.KEY=VALUE`. `strategies.NAME.KEY=VALUE` is
  shorthand for both (see `native_overrides`). An experiment preset selects entries the same way in its
  defaults list, for variants that exist only for its comparison (PRESET_STRATEGIES).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdec.errors import SpecdecError


def _config_dir() -> Path:
    """specdec/configs: a link to the repository's top-level configs/ in a checkout, the copy a wheel
    ships when installed. A checkout without the link (e.g. git on Windows without symlinks) falls back
    to the top-level folder."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "configs", here.parent / "configs"):
        if (candidate / "run.yaml").is_file():
            return candidate.resolve()
    return (here / "configs").resolve()


CONFIG_DIR = _config_dir()
GROUPS = ("model", "strategy", "data", "generation", "logger", "experiment", "hydra")
# Named in CONTRACT.md; configs/strategy/ holds those that are built.
CONTRACT_STRATEGIES = ("greedy", "draft", "medusa", "prompt_lookup", "lookahead", "eagle", "hf_generate",
                       "hf_assisted")
ENTRIES = "strategy_configs"  # the config node holding the entries (see the module docstring)
# Variants that exist only for one comparison are entries of that experiment preset, not strategy files;
# a run that names one elsewhere is told where it went. A test keeps this in step with the presets.
PRESET_STRATEGIES = {"draft_heuristic": "draft_schedules", "draft_confidence": "draft_schedules",
                     "draft_cost_aware": "draft_schedules", "draft_sitout": "draft_schedules",
                     "greedy_full": "prefix_cache", "draft_candidate": "heldapart", "medusa_candidate": "heldapart",
                     "hydra_candidate": "heldapart", "eagle_candidate": "heldapart",
                     "eagle3_candidate": "heldapart", "eagle3_tree_candidate": "heldapart",
                     "medusa_63": "paper_trees", "eagle2_60": "paper_trees",
                     **{f"eagle_{n}": "eagle_scaling"
                        for n in ("040k", "080k", "160k", "all", "x2", "x3", "x4", "x5", "x6")}}
SLURM_EXTRA = "pip install 'specdec[slurm]'"
_NAME = r"[A-Za-z_][\w\-]*"
_SHORTHAND = re.compile(rf"(?P<prefix>[+~]*)(?:strategies|{ENTRIES})\.(?P<name>{_NAME})(?P<rest>\..+)")
_APPEND = re.compile(rf"\+{{0,2}}strategy@{ENTRIES}\.(?P<name>{_NAME})")


# --- config folders ---------------------------------------------------------------------------------


def searchpath_dirs(searchpath: Sequence[str]) -> list[Path] | None:
    """The folders of `hydra.searchpath` entries (`file://PATH`, a plain path, or `pkg://MODULE`), or
    None when one of them names something that cannot be read here (Hydra then has the last word)."""
    dirs: list[Path] = []
    for entry in searchpath:
        scheme, sep, rest = str(entry).partition("://")
        if not sep:
            scheme, rest = "file", str(entry)
        if scheme == "file":
            dirs.append(Path(rest).expanduser())
        elif scheme == "pkg":
            try:
                spec = importlib.util.find_spec(rest.replace("/", "."))
            except (ImportError, ValueError):
                return None
            locations = list(spec.submodule_search_locations or []) if spec is not None else []
            if not locations:
                return None
            dirs.extend(Path(p) for p in locations)
        else:
            return None
    return dirs


def config_dirs(searchpath: Sequence[str] = ()) -> list[Path] | None:
    """The config folders in Hydra's search order, or None (see searchpath_dirs)."""
    user = searchpath_dirs(searchpath)
    return None if user is None else [CONFIG_DIR, *user]


def options(group: str, searchpath: Sequence[str] = ()) -> list[str]:
    """The names that `group=NAME` accepts: the group's yaml files in every config folder."""
    dirs = config_dirs(searchpath) or [CONFIG_DIR]
    return sorted({p.stem for d in dirs for p in (d / group).glob("*.yaml")})


def _is_option(group: str, name: str, dirs: list[Path]) -> bool:
    return any((d / group / f"{name}.yaml").is_file() for d in dirs)


def _unknown(group: str, value: str, searchpath: Sequence[str] = ()) -> SpecdecError:
    valid = ", ".join(options(group, searchpath))
    if group == "strategy" and value in CONTRACT_STRATEGIES:
        return SpecdecError(f"strategy {value!r} is not built yet; built strategies: {valid}")
    if group == "strategy" and value in PRESET_STRATEGIES:
        preset = PRESET_STRATEGIES[value]
        return SpecdecError(f"strategy {value!r} is defined by experiment preset {preset} "
                            f"(configs/experiment/{preset}.yaml), not in configs/strategy/; list it with that "
                            f"preset: experiment={preset} \"strategies=[greedy,{value}]\"")
    return SpecdecError(f"unknown {group} {value!r}; choose one of: {valid} (or add {group}/{value}.yaml to a "
                        "folder on hydra.searchpath)")


# --- the command line -------------------------------------------------------------------------------


def argv_searchpath(argv: Sequence[str]) -> list[str]:
    """The folders a `hydra.searchpath=[...]` override on the command line adds, as written."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") == "hydra.searchpath":
            parsed = _parse_value(arg)
            if isinstance(parsed, list):
                return [str(v) for v in parsed]
            return [value] if value and not value.startswith("[") else []
    return []


def _parse_value(arg: str) -> Any:
    """The value of one override as Hydra's grammar reads it (a list, a sweep's choices, a string), or
    None where the grammar rejects it (Hydra reports that itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    try:
        value = OverridesParser.create().parse_override(arg).value()
    except Exception:  # a parse error is Hydra's to report, in hydra_error_line
        return None
    return list(value.list) if isinstance(value, ChoiceSweep) else value


def _listed_names(arg: str) -> list[str]:
    """The strategy names in `strategies=...`: one list, a single name, or a sweep over lists."""
    value = _parse_value(arg)
    if value is None:
        text = arg.partition("=")[2]
        return [n.strip() for n in text.strip("[]").split(",") if n.strip() not in ("", "null")]
    names: list[str] = []
    for item in value if isinstance(value, list) else [value]:
        names += [str(n) for n in item] if isinstance(item, list) else [str(item)]
    return [n for n in names if n not in ("", "null", "None")]


def appended_entries(argv: Sequence[str]) -> set[str]:
    """The entry names that `+strategy@strategy_configs.NAME=FILE` overrides add."""
    return {m.group("name") for a in argv if (m := _APPEND.fullmatch(a.partition("=")[0]))}


def preset_entries(argv: Sequence[str]) -> set[str]:
    """The entry names that the experiment preset selected on the command line defines (its
    `strategy_configs`), as Hydra composes it; none without one, for a sweep over presets, or where it
    does not compose (Hydra reports that itself)."""
    chosen = [a.partition("=")[2] for a in argv if a.partition("=")[0].lstrip("+") == "experiment"]
    if not chosen or not chosen[-1] or chosen[-1] == "null" or "," in chosen[-1]:
        return set()
    try:
        node = _compose_aside([f"experiment={chosen[-1]}"], argv_searchpath(argv), "run").get(ENTRIES)
    except Exception:  # a bad preset is Hydra's to report, with its own message
        return set()
    return {str(k) for k in node} if isinstance(node, DictConfig) else set()


def native_overrides(argv: Sequence[str]) -> list[str]:
    """argv in Hydra's own spelling: an override of a listed strategy's key becomes an override of
    its entry, and the entry is selected first where the command line does not select it already.

        strategies.draft_fixed.schedule.gamma=2
        -> +strategy@strategy_configs.draft_fixed=draft_fixed strategy_configs.draft_fixed.schedule.gamma=2

    `strategy_configs.NAME.KEY=VALUE` gets the same selection. Everything else is passed as it is. An
    entry that the selected experiment preset defines is there already and is not selected again.
    """
    selected = appended_entries(argv)
    in_preset: set[str] | None = None  # composed only when a shorthand needs it
    out: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        m = _SHORTHAND.fullmatch(key)
        if arg.startswith("-") or m is None:
            out.append(arg)
            continue
        name = m.group("name")
        if name not in selected and in_preset is None:
            in_preset = preset_entries(argv)
            selected |= in_preset
        if name not in selected:
            out.append(f"+strategy@{ENTRIES}.{name}={name}")
            selected.add(name)
        out.append(f"{m.group('prefix')}{ENTRIES}.{name}{m.group('rest')}{sep}{value}")
    return out


def submitit_installed() -> bool:
    """Whether Hydra's submitit launcher plugin (hydra-submitit-launcher, the `slurm` extra) is installed."""
    try:  # find_spec raises, rather than returning None, when the hydra_plugins namespace is absent
        return importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except (ModuleNotFoundError, ValueError):
        return False


def _needs_submitit(choice: str, dirs: list[Path] | None) -> bool:
    if choice.startswith("submitit"):
        return True
    for d in dirs or [CONFIG_DIR]:
        path = d / "hydra" / "launcher" / f"{choice}.yaml"
        if path.is_file():
            return "submitit" in path.read_text(encoding="utf-8", errors="replace")
    return False


def check_overrides(argv: list[str]) -> None:
    """Group choices and strategy lists must name config files that exist (in CONFIG_DIR or a folder on
    hydra.searchpath), and a SLURM launcher needs its plugin."""
    searchpath = argv_searchpath(argv)
    dirs = config_dirs(searchpath)
    entries = appended_entries(argv)
    in_preset: set[str] | None = None  # composed only when a listed name is not a file
    for arg in argv:
        if arg.startswith("-"):
            continue
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        if not sep:
            continue
        if key == "hydra/launcher" and value and _needs_submitit(value, dirs) and not submitit_installed():
            raise SpecdecError(f"hydra/launcher={value} needs Hydra's submitit launcher plugin, which is not "
                               f"installed; {SLURM_EXTRA} (or pip install hydra-submitit-launcher)")
        group = key.partition("@")[0]
        if dirs is None:
            continue
        if group in GROUPS and value and value != "null" and "," not in value and not value.startswith("["):
            if not _is_option(group, value, dirs):
                raise _unknown(group, value, searchpath)
        if key == "strategies" and value not in ("", "null"):
            for name in _listed_names(arg):
                if name in entries or _is_option("strategy", name, dirs):
                    continue
                if in_preset is None:
                    in_preset = preset_entries(argv)
                if name not in in_preset:
                    raise _unknown("strategy", name, searchpath)


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

    overrides = [a for a in argv if a != skip and not a.startswith("-")
                 and (not a.startswith(("hydra.", "hydra/")) or a.startswith("hydra.searchpath="))]
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
        if "submitit" in text:
            return f"the SLURM launcher needs Hydra's submitit launcher plugin, which is not installed; {SLURM_EXTRA}"
        text = text.split("Config search path")[0]
        return f"{_one_line(text)} (options are the files in {CONFIG_DIR} and the folders on hydra.searchpath)"
    lines = [_one_line(line) for line in text.splitlines() if line.strip() and not line.startswith((" ", "\t"))]
    if cause is not None and str(cause).strip():
        lines += [_one_line(line) for line in str(cause).splitlines()
                  if line.strip() and not line.startswith((" ", "\t"))]
    detail = "; ".join(dict.fromkeys(line.rstrip(".") for line in lines)) or type(exc).__name__
    return f"{detail} (rerun with debug=true for the traceback)"


# --- the config of each listed strategy --------------------------------------------------------------


def run_searchpath(cfg: DictConfig) -> list[str]:
    """The run's `hydra.searchpath`: from cfg when it carries the hydra node, else from the running Hydra
    job, else none."""
    node = OmegaConf.select(cfg, "hydra.searchpath", default=None) if "hydra" in cfg else None
    if node is not None:
        return [str(p) for p in node]
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return [str(p) for p in HydraConfig.get().searchpath]
    return []


def _quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _compose_aside(overrides: list[str], searchpath: Sequence[str], config_name: str | None = None) -> DictConfig:
    """Compose from CONFIG_DIR (+ `searchpath`) beside whatever Hydra app is running: the global Hydra
    state is cleared for the compose and put back afterwards, whether or not it raised."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    if searchpath:
        overrides = [*overrides, "hydra.searchpath=[" + ",".join(_quoted(str(p)) for p in searchpath) + "]"]
    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return compose(config_name, overrides=overrides)
    finally:
        restore_gh_from_backup(backup)


def group_config(group: str, name: str, searchpath: Sequence[str] = ()) -> DictConfig:
    """GROUP/NAME.yaml as Hydra composes it on its own (its defaults list included, e.g.
    `defaults: [medusa, _self_]`), from CONFIG_DIR and the folders on `searchpath`. Interpolations are
    left for the caller to resolve against the run's config. Safe inside a running Hydra app: the global
    Hydra state is put back afterwards."""
    from hydra.errors import MissingConfigException

    try:
        composed = _compose_aside([f"+{group}={name}"], searchpath)
    except MissingConfigException:
        raise _unknown(group, name, searchpath) from None
    except Exception as e:
        detail = _one_line(e)[:300]
        raise SpecdecError(f"{group}/{name}.yaml does not compose ({detail}); fix that file") from None
    node = composed.get(group)
    if not isinstance(node, DictConfig):
        raise SpecdecError(f"{group}/{name}.yaml holds no config under '{group}'; give it keys such as _target_")
    return node


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else node


def strategy_config(cfg: DictConfig, name: str, searchpath: Sequence[str] | None = None) -> DictConfig:
    """The resolved config of listed strategy `name`, composed by Hydra:

    1. its entry `strategy_configs.NAME` when the command line selected one (with the overrides given
       there); if the entry is unchanged from its file and the `strategy` group holds the same strategy
       with settings of its own (an experiment preset's, a sweep's `strategy.KEY=...`), those win;
    2. else the `strategy` group's config if it is that strategy (so `strategy.KEY=...` applies);
    3. else strategy/NAME.yaml composed on its own, from CONFIG_DIR and the run's hydra.searchpath.

    An entry's `name` is its key, so one file can run twice under two names
    (`+strategy@strategy_configs.g2=draft_fixed +strategy@strategy_configs.g4=draft_fixed`).
    Interpolations such as ${model.name} resolve against the run's config.
    """
    if searchpath is None:
        searchpath = run_searchpath(cfg)
    entries = cfg.get(ENTRIES)
    chosen = cfg.get("strategy")
    own = chosen if isinstance(chosen, DictConfig) and chosen.get("name") == name else None
    if isinstance(entries, DictConfig) and name in entries:
        scfg = entries[name]
        if own is not None and _plain(own) != _plain(scfg):
            try:
                base = _plain(group_config("strategy", name, searchpath))
            except SpecdecError:  # an entry under a name of its own: nothing to compare with
                base = None
            if base is not None and _plain(scfg) == base:
                scfg = own
            elif base is not None and _plain(own) != base:
                raise SpecdecError(f"both strategy.* and {ENTRIES}.{name}.* (or strategies.{name}.*) change "
                                   f"strategy {name!r}; set all of its keys in one of the two")
        plain = _plain(scfg)
        if isinstance(plain, dict) and plain.get("name") != name and scfg is not own:
            plain["name"] = name
        scfg = OmegaConf.create(plain)
    elif own is not None:
        scfg = OmegaConf.create(_plain(own))
    else:
        scfg = OmegaConf.create(_plain(group_config("strategy", name, searchpath)))
    assert isinstance(scfg, DictConfig)
    # interpolations such as ${model} resolve against the run's config
    root = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    root._this = scfg
    resolved = OmegaConf.to_container(root._this, resolve=True)
    out = OmegaConf.create(resolved)
    assert isinstance(out, DictConfig)
    return out
