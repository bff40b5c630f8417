"""One source per setting: every key of every conf/ file names a setting of the config it fills
(a typed config's field, its ``_target_``'s parameter) or a documented app or Hydra key; a file
that is not a named preset neither restates a typed config's default nor sets another value
(the defaults live in the configs, longctx.train.typed_defaults puts them in the composed
config); a named preset sets what it exists to set."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import ROOT, compose
from hydra._internal.utils import _locate
from omegaconf import OmegaConf

from longctx.model import LlamaConfig
from longctx.train import typed_defaults
from longctx.train.app import optim_config
from longctx.train.preflight import ConfigError

CONF = ROOT / "conf"

# the options that exist to set values of their own (a model's shapes, an experiment's recipe)
NAMED_PRESETS = {
    "data/shards.yaml",
    "debug/default.yaml",
    "model/llama3_1b.yaml",
    "model/llama3_8b.yaml",
    "model/recall.yaml",
    "model/recall_d64.yaml",
    "model/tiny_long.yaml",
    *(f"rope_arm/{p.name}" for p in (CONF / "rope_arm").glob("*.yaml")),
    *(f"experiment/{p.name}" for p in (CONF / "experiment").glob("*.yaml")),
}
# the groups train.yaml selects (group=option); any other group is added (+group=option)
SELECTED_GROUPS = {"model", "data", "optim", "trainer", "parallel", "logger", "callbacks",
                   "paths", "hydra", "experiment", "debug"}  # fmt: skip
# the app's own top-level keys (conf/train.yaml documents each; longctx.train.app reads them)
APP_KEYS = {"task_name", "run_name", "ckpt_path", "overwrite", "allow_resume_changes", "seed",
            "dry_run", "compile", "group", "tags", "peak_flops_per_device"}  # fmt: skip
# experiment keys that other settings interpolate: synthesized mixes (data.shards entries) and
# stage 1's row length (rope_arm/yarn.yaml)
MIX_KEYS = {"ruler_mix", "ruler_repeat"}
EXPERIMENT_KEYS = MIX_KEYS | {"stage1_seq_len"}
# typed nodes without a _target_: the app builds them (longctx.train.app, longctx.train.preflight)
UNTARGETED = {
    "optim": "longctx.train.optim_config.OptimConfig",
    "planner": "longctx.planner.PlannerSettings",
    **dict.fromkeys(MIX_KEYS, "longctx.data.config.Synthesized"),
}
# untyped nodes the app reads by key (longctx.train.loggers, conf/paths/default.yaml)
APP_NODES = {
    "logger": {"wandb", "csv"},
    "logger.wandb": {"project", "entity", "mode"},
    "logger.csv": set(),
    "paths": {"root_dir", "runs_dir", "output_dir", "cache_dir"},
}
FROM_NAME = "longctx.model.LlamaConfig.from_name"
HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}
NO_DEFAULT = object()


def conf_files() -> list[str]:
    return sorted(
        str(p.relative_to(CONF))
        for p in CONF.rglob("*.yaml")
        if p.parts[len(CONF.parts)] != "hydra"
    )


def package_of(name: str, text: str) -> str:
    """Where the file's keys land in the composed config ("" for the root)."""
    for line in text.splitlines():
        if line.startswith("# @package"):
            package = line.split()[-1]
            return "" if package == "_global_" else package
    parent = str(Path(name).parent)
    return "" if parent == "." else parent.replace("/", ".")


def composed_with(name: str) -> dict:
    """The config composed with this file's option, unresolved (as plain dicts)."""
    group, option = str(Path(name).parent), Path(name).stem
    overrides = (
        [] if group == "." else [f"{'' if group in SELECTED_GROUPS else '+'}{group}={option}"]
    )
    return OmegaConf.to_container(compose(overrides), resolve=False)


def parameters(target: str) -> set[str] | None:
    """The keys ``target`` takes; None where it takes any (a **kwargs)."""
    if target == FROM_NAME:
        return {"name"} | {f.name for f in dataclasses.fields(LlamaConfig)}
    obj = _locate(target)
    if dataclasses.is_dataclass(obj):
        return {f.name for f in dataclasses.fields(obj) if f.init}
    params = inspect.signature(obj).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def default_of(target: str, key: str) -> Any:
    """``key``'s default where ``target`` is longctx's (the one source), else NO_DEFAULT; a
    Llama preset's field defaults to null: the preset's value."""
    if not target.startswith("longctx."):
        return NO_DEFAULT
    if target == FROM_NAME:
        return typed_defaults.llama_run_defaults().get(key, None if key != "name" else NO_DEFAULT)
    return typed_defaults.parameter_defaults(_locate(target)).get(key, NO_DEFAULT)


def target_of(path: str, composed: Any) -> str | None:
    if isinstance(composed, dict) and "_target_" in composed:
        return str(composed["_target_"])
    return UNTARGETED.get(path)


def allowed_keys(path: str) -> set[str] | None:
    """The keys of an untyped node; None where any name is one (callbacks.<name>, hydra)."""
    if path == "":
        return APP_KEYS | SELECTED_GROUPS | EXPERIMENT_KEYS | set(UNTARGETED)
    return APP_NODES.get(path)


def problems_in(name: str, raw: Any, composed: Any, path: str) -> list[str]:
    """What is wrong with one node of a file (``raw``) at ``path`` of the composed config."""
    if not isinstance(raw, dict) or path == "hydra":
        return []  # Hydra checks its own node against its schema when it composes
    target = target_of(path, composed)
    found = []
    for key, value in raw.items():
        where = f"{path}.{key}".lstrip(".")
        child = composed.get(key) if isinstance(composed, dict) else None
        if target is None:
            known = allowed_keys(path)
            if known is not None and key not in known:
                found.append(f"{name}: {where} is no setting of the app (known: {sorted(known)})")
        elif key not in HYDRA_KEYS:
            found += setting_problems(name, target, where, key, value)
        if target is None or isinstance(value, dict):
            found += problems_in(name, value, child, where)
    return found


def setting_problems(name: str, target: str, where: str, key: str, value: Any) -> list[str]:
    known = parameters(target)
    if known is not None and key not in known:
        return [f"{name}: {where} names no field or parameter of {target}"]
    default = default_of(target, key)
    literal = not (isinstance(value, str) and ("${" in value or value == "???"))
    if default is NO_DEFAULT or not literal or name in NAMED_PRESETS or isinstance(value, dict):
        return []
    if value == default:
        return [f"{name}: {where}={value!r} restates {target}'s default"]
    return [
        f"{name}: {where}={value!r} disagrees with {target}'s default {default!r} (only a named "
        "preset sets its own values: change the default, or list the file in NAMED_PRESETS)"
    ]


@pytest.mark.parametrize("name", conf_files())
def test_every_key_is_a_setting_and_no_default_has_two_sources(name):
    text = (CONF / name).read_text()
    raw = yaml.safe_load(text) or {}
    raw.pop("defaults", None)
    node = composed_with(name)
    package = package_of(name, text)
    for key in package.split(".") if package else []:
        node = node[key]
    assert problems_in(name, raw, node, package) == []


def test_every_typed_node_has_a_config_spelling():
    """Every default a node holds is a config value (the nodes are built on registration)."""
    nodes = typed_defaults.nodes()
    assert set(nodes) == {typed_defaults.node_name(p) for p in typed_defaults.TYPED_CONFIGS} | {
        typed_defaults.LLAMA_NODE
    }


def test_a_planted_disagreement_is_named():
    problems = setting_problems("data/default.yaml", "longctx.data.DataConfig",
                                "data.micro_batch_size", "micro_batch_size", 7)  # fmt: skip
    assert problems and "disagrees with longctx.data.DataConfig's default 2" in problems[0]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1; expected a finite number >= 0"),
        ("optim.grad_clip=-1", "optim.grad_clip=-1; expected a finite number >= 0"),
        ("optim.accumulate_grad_batches=0", "optim.accumulate_grad_batches=0; expected a whole"),
        ("optim.skip_nonfinite=-1", "optim.skip_nonfinite=-1; expected a whole number >= 0"),
        ("optim.allow_global_batch_change=1", "optim.allow_global_batch_change=1; expected true"),
        ("optim.optimizer.lr=-1e-3", "optim.optimizer.lr=-0.001; expected a finite number >= 0"),
        ("+optim.warmup=5", "optim.warmup: unknown optim setting ['warmup']"),
    ],
)
def test_optim_is_typed_and_refuses_a_bad_setting_by_name(override, message):
    with pytest.raises(ConfigError) as refused:
        optim_config(compose([override]).optim)
    assert message in str(refused.value)


def test_optim_config_holds_the_groups_settings():
    optim = optim_config(compose(["optim.grad_clip=0.5", "optim.optimizer.lr=1e-3"]).optim)
    assert (optim.grad_clip, optim.weight_decay, optim.accumulate_grad_batches) == (0.5, 0.1, 1)
    assert optim.optimizer.keywords["lr"] == 1e-3 and optim.scheduler.keywords["warmup_steps"] == 20
