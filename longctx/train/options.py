"""Rules of the composed config as a whole, checked before the run folder is written.

Each typed config checks its own fields (the model's, the data's, the planner's); what no owner
sees is checked here: a non-finite float anywhere (an optimizer's lr, a callback's setting that
is handed to a constructor untyped), and settings that only make sense together (the stages
and ``trainer.max_steps``; ``model.init_from`` and a resumed checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

from longctx import planner


def non_finite_options(node: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(dotted key, value) of every NaN or infinite float in a plain config tree. Interpolations
    are left as written (strings): the literal they point at is checked where it is."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from non_finite_options(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from non_finite_options(value, f"{prefix[:-1]}[{i}].")
    elif isinstance(node, float) and not math.isfinite(node):
        yield prefix[:-1], node


def check_finite(cfg: DictConfig) -> None:
    """Every float in the config is finite: NaN passes every ``value <= 0`` check and trains to
    a NaN checkpoint; an infinite lr or clip is no setting either."""
    found = list(non_finite_options(OmegaConf.to_container(cfg, resolve=False)))
    if found:
        listed = ", ".join(f"{key}={value}" for key, value in found)
        raise ValueError(f"{listed}: not a finite number; expected a finite value")


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
