"""Rules of the composed config as a whole, checked before the run folder is written.

Each typed config checks its own fields (the model's, the data's, the planner's); what no owner
sees is checked here, on the config as resolved: a non-finite float anywhere (an optimizer's lr,
a callback's setting that is handed to a constructor untyped), a number of another kind than
its target's parameter takes, and settings that only make sense together (the stages and
``trainer.max_steps``; ``model.init_from`` and a resumed checkpoint).
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from hydra._internal.utils import _locate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from longctx import planner
from longctx.errors import LongctxError


def non_finite_options(node: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(dotted key, value) of every NaN or infinite float in a plain config tree (a resolved
    one: what an interpolation such as ``${oc.decode:"inf"}`` gives is checked as typed)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from non_finite_options(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from non_finite_options(value, f"{prefix[:-1]}[{i}].")
    elif isinstance(node, float) and not math.isfinite(node):
        yield prefix[:-1], node


def mistyped_options(node: Any, prefix: str = "") -> Iterator[str]:
    """What is wrong with each ``_target_`` node of a plain config tree: a target that cannot be
    imported, or a number of the wrong kind for what the target takes (``1.5`` where its
    parameter is an int, ``'inf'`` where it is a float), by the target's own type hints."""
    if isinstance(node, dict):
        if "_target_" in node:
            yield from target_mismatches(node, prefix)
        for key, value in node.items():
            yield from mistyped_options(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from mistyped_options(value, f"{prefix[:-1]}[{i}].")


def target_mismatches(node: dict, prefix: str) -> Iterator[str]:
    name = node["_target_"]
    try:
        if not isinstance(name, str):
            raise ValueError(f"{type(name).__name__}, not a string")
        target = _locate(name)  # what instantiate uses (hydra.utils.get_object also logs)
    except (ImportError, ValueError) as err:
        reason = str(err).splitlines()[-1] if str(err) else type(err).__name__
        yield (
            f"{prefix}_target_={name!r} cannot be imported ({reason}); expected the dotted "
            "path of a class or function"
        )
        return
    hints = parameter_hints(target)
    for key, value in node.items():
        if isinstance(value, float) and not math.isfinite(value):
            continue  # said as not finite
        if key in hints and (expected := number_expected(value, hints[key])):
            yield f"{prefix}{key}={value!r}; expected {expected} ({name}'s {key})"


def parameter_hints(target: Any) -> dict[str, Any]:
    """The type hints of what ``target`` is called with (a class: its constructor's); none where
    they cannot be read (a hint naming what only a type checker imports): unchecked, not
    refused."""
    try:
        return typing.get_type_hints(target.__init__ if isinstance(target, type) else target)
    except Exception:  # get_type_hints evaluates a library's annotations: any error may come
        return {}


def number_expected(value: Any, hint: Any) -> str | None:
    """What ``value`` should have been where a parameter hinted ``hint`` takes numbers only (an
    int, a float or a bool, optionally None; a list of them): None when it is that, or when the
    hint takes more (a str, a class: the target's own checks apply)."""
    arms = set(typing.get_args(hint)) if _is_union(hint) else {hint}
    if value is None and type(None) in arms:
        return None
    arms -= {type(None), torch.Tensor}  # a config holds no tensor (torch's optimizers take one)
    if arms == {bool}:  # 1 == True: a count where a switch belongs passes ``in (True, False)``
        return None if isinstance(value, bool) else "true or false"
    if arms == {int}:
        return None if _is_int(value) else "an int"
    if arms and arms <= {int, float}:
        return None if _is_number(value) else "a number"
    if len(arms) == 1 and isinstance(value, list):
        (arm,) = arms
        if typing.get_origin(arm) in (list, tuple, Sequence) and typing.get_args(arm):
            item = typing.get_args(arm)[0]
            wrong = next((e for v in value if (e := number_expected(v, item))), None)
            return wrong and f"a list whose every entry is {wrong}"
    return None


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def resolved(cfg: DictConfig) -> dict:
    """The config with every interpolation resolved, as the run will use it; one that cannot
    be resolved is refused naming its key."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        root = err  # what the resolver raised: the first exception below OmegaConf's
        while isinstance(root, OmegaConfBaseException) and (root.__cause__ or root.__context__):
            root = root.__cause__ or root.__context__
        if isinstance(root, ValueError) and not isinstance(root, OmegaConfBaseException):
            raise LongctxError(str(root)) from err  # a resolver's refusal says it all
        if isinstance(root, KeyError):  # oc.env's unset variable
            raise LongctxError(f"{err.full_key}: {root.args[0]}; expected it set") from err
        if not isinstance(root, OmegaConfBaseException):
            raise  # a resolver's bug keeps its traceback
        reason = str(err).splitlines()[0]  # OmegaConf adds the key and node type below
        raise LongctxError(f"{err.full_key}: {reason}; expected a value that resolves") from err


def check_numbers(cfg: DictConfig) -> None:
    """Every number of the resolved config, however it arrived (typed, through an
    interpolation, from an experiment file): every float finite (NaN passes every
    ``value <= 0`` check and trains to a NaN checkpoint; an infinite warm-up trains at lr 0),
    and every number the kind its target takes (an int option given 1.5 or nan is no count)."""
    tree = resolved(cfg)
    found = [
        f"{key}={value}: not a finite number; expected a finite value"
        for key, value in non_finite_options(tree)
    ]
    found += mistyped_options(tree)
    if found:
        raise LongctxError("; ".join(found))


def check_planner(cfg: DictConfig) -> planner.PlannerSettings:
    """The ``planner`` group as typed settings: an unknown key (``+planner.<typo>``) or a value
    the planner cannot use is refused in every run, not only in a dry run."""
    return planner.PlannerSettings.from_dict(OmegaConf.to_container(cfg.planner, resolve=True))


def unreached_stages(stages, max_steps: int | None) -> list[str]:
    """Warnings for ``data.stages`` entries that end at or after ``trainer.max_steps``: the run
    stops inside that stage, so the stages after it (and the final ``data.seq_len``, which
    validation uses) never train."""
    if not stages or max_steps is None or max_steps < 0:
        return []
    return [
        f"warning: data.stages[{i}].until_step={stage.until_step} is not below "
        f"trainer.max_steps={max_steps}: the run ends in stage {i} "
        f"(seq_len {stage.seq_len}) and never trains the later stages or data.seq_len"
        for i, stage in enumerate(stages)
        if stage.until_step >= max_steps
    ][:1]  # the first such stage says it; the later ones follow from it


def init_from_note(init_from: str | None, resumed: str | None) -> str | None:
    """A resume continues the run's own weights; ``model.init_from`` starts a stage and is not
    read then (the resumed checkpoint already holds what it started from)."""
    if not init_from or resumed is None:
        return None
    return (
        f"model.init_from={init_from} does not apply: this start resumes {resumed}, whose "
        "weights replace it (init_from starts a stage from other weights; a resume continues "
        "the stage)"
    )
