"""The run's config record: the one place a run's model and data config is read back from.

Every checkpoint carries, under ``longctx_run``, the run's identity and its resolved model and data
config as they were when that checkpoint was written (so a resume with an allowed change, or an
``overwrite=true`` start, records the config that trained those weights). Eval, export, init_from
and the analysis all read this record; nothing reads Hydra's ``.hydra/config.yaml`` back.

A record is data, never code. A stored config names its constructor with ``_target_``, and Hydra
would call whatever that names (``torch.load`` of a pickle, ``open``, ``shutil.copyfile``...). So
the record is validated against longctx's own config classes before anything is built: the
``_target_`` must be one of the allow-list's (:class:`RecordTargets`, which every reader passes in:
longctx's is :data:`longctx.hf.config_targets.CONFIG_TARGETS`, so this module imports no config
class), no other Hydra key (``_args_``, ``_partial_``, ``_recursive_``) may appear, nothing nested
may carry a ``_target_``, and the constructor is called directly, without Hydra.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L

from longctx.errors import LongctxError
from longctx.runs.checkpoints import existing_checkpoint, read_checkpoint
from longctx.runs.folder import is_run_folder, last_checkpoint

CHECKPOINT_KEY = "longctx_run"
HYDRA_CONVERT_MODES = {"all", "none", "partial", "object"}


class RecordError(LongctxError):
    """A checkpoint's run record that is missing or that longctx will not build."""


@dataclasses.dataclass(frozen=True)
class RecordTargets:
    """The allow-list: the only constructors a stored config may name, by ``_target_``, for its
    model and its data (the conf/ groups' own _target_s)."""

    model: Mapping[str, Callable[..., Any]]
    data: Mapping[str, Callable[..., Any]]


def plain(value):
    """JSON types only (lists for tuples and ListConfigs, dicts for dataclasses such as a
    synthesized data.shards entry): loadable with weights_only=True, and equal after a
    save/load round trip."""
    return json.loads(json.dumps(value, default=_plain_default))


def _plain_default(value):
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else list(value)


class RunRecord(L.Callback):
    """Writes the run's identity and resolved model/data config into every checkpoint."""

    def __init__(self, identity: dict, config: dict) -> None:
        self.record = {"identity": identity, "config": plain(config)}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = self.record


@dataclasses.dataclass
class StoredRun:
    """What a checkpoint says about the run that wrote it."""

    checkpoint: Path  # the file or sharded folder that was read
    contents: dict  # its weights-only, memory-mapped contents
    config: dict  # {"model": {...}, "data": {...}} as recorded (validated)
    identity: dict
    targets: RecordTargets  # what the config was validated against, and is built with

    def model_config(self, **overrides):
        """The typed model config (a LlamaConfig or an HF spec); ``overrides`` replace fields."""
        return build(
            self.config["model"], self.targets.model, f"{self.checkpoint}: model", overrides
        )

    def data_config(self, **overrides):
        return build(self.config["data"], self.targets.data, f"{self.checkpoint}: data", overrides)


def checkpoint_in(path: Path) -> Path:
    """The checkpoint ``path`` names: itself (a .ckpt file or sharded folder), or a run
    folder's last checkpoint."""
    path = Path(path)
    if is_run_folder(path):
        found = existing_checkpoint(last_checkpoint(path))
        if found is None:
            raise FileNotFoundError(
                f"{path} is a run folder without {last_checkpoint(path).relative_to(path)}; "
                "pass a checkpoint inside it"
            )
        return found
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist; expected a longctx checkpoint (a .ckpt file, a sharded "
            "checkpoint folder) or a run folder"
        )
    return path


def read_stored_run(path: str | Path, targets: RecordTargets) -> StoredRun:
    """The record of the checkpoint at ``path`` (see :func:`checkpoint_in`), validated
    against ``targets``."""
    checkpoint = checkpoint_in(Path(path))
    contents = read_checkpoint(checkpoint)
    record = contents.get(CHECKPOINT_KEY) if isinstance(contents, dict) else None
    config = validated_config(
        record, checkpoint, CHECKPOINT_KEY, "a checkpoint written by train.py", targets
    )
    return StoredRun(checkpoint, contents, config, record.get("identity") or {}, targets)


def validated_config(
    record: Any, source: Path, key: str | None, expected: str, targets: RecordTargets
) -> dict:
    """``record``'s config {"model", "data"[, "run"]}, refused unless ``targets`` allows it
    (``source``: the file read, ``key``: where in it the record was, for the errors)."""
    where = f"{source}: {key}" if key else str(source)
    config = record.get("config") if isinstance(record, dict) else None
    if not isinstance(config, dict) or not {"model", "data"} <= config.keys():
        held = f"key {key!r} with model and data" if key else "model and data"
        raise RecordError(f"{source} holds no run config ({held}); expected {expected}")
    validate(config["model"], targets.model, f"{where}.config.model")
    validate(config["data"], targets.data, f"{where}.config.data")
    _refuse_nested_targets(config.get("run", {}), f"{where}.config.run")
    return config


def validate(node: Any, targets: Mapping[str, Callable], where: str) -> None:
    """Refuse a stored config that is not one of longctx's own config classes (see the module
    docstring); ``where`` names the file and key in the error."""
    if not isinstance(node, dict):
        raise RecordError(f"{where} is a {type(node).__name__}; expected a config mapping")
    target = node.get("_target_")
    if target not in targets:
        raise RecordError(
            f"{where}._target_={target!r} is not one of longctx's config classes "
            f"({', '.join(sorted(targets))}); a stored config is data and names no other code"
        )
    convert = node.get("_convert_", "all")
    if convert not in HYDRA_CONVERT_MODES:
        raise RecordError(f"{where}._convert_={convert!r}; expected one of {HYDRA_CONVERT_MODES}")
    for key, value in node.items():
        if key.startswith("_") and key not in ("_target_", "_convert_"):
            raise RecordError(f"{where}.{key}: a stored config may not carry Hydra's {key}")
        _refuse_nested_targets(value, f"{where}.{key}")


def _refuse_nested_targets(value: Any, where: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and key.startswith("_") and key.endswith("_"):
                raise RecordError(f"{where}.{key}: a stored config may not carry Hydra's {key}")
            _refuse_nested_targets(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_nested_targets(item, f"{where}[{i}]")


def build(node: dict, targets: Mapping[str, Callable], where: str, overrides: Mapping) -> Any:
    """Call the validated constructor with the stored fields (``overrides`` replace some)."""
    validate(node, targets, where)
    fields = {k: v for k, v in node.items() if not k.startswith("_")} | dict(overrides)
    try:
        return targets[node["_target_"]](**fields)
    except TypeError as err:  # a field the class does not have
        raise RecordError(f"{where}: {err}") from err
