"""What conf/ needs registered before Hydra composes (train.py, the probe's CLI, the tests'
compose call :func:`register_with_hydra`): the OmegaConf resolvers it uses and the typed
configs' default nodes (longctx.train.typed_defaults)."""

from __future__ import annotations

import datetime
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from longctx.cli import exit_on_user_error
from longctx.distributed.slurm import checked_num_nodes, slurm_job_label
from longctx.errors import LongctxError
from longctx.runs.folder import (
    check_location,
    config_subdir,
    named_run,
    newest_resumable_run,
    note_before_hydra,
    sweep_subdir,
)
from longctx.train import typed_defaults
from longctx.train.preflight import ConfigError


def run_dir(runs_dir: str, run_name: str | int, ckpt_path: str | None) -> str:
    """The run folder: named, the newest resumable one (ckpt_path=last), inside a SLURM job
    slurm-<job id> (every rank and a requeued job find the same folder), or a new timestamped one."""
    root = Path(runs_dir)
    if isinstance(run_name, int) and not isinstance(run_name, bool):
        run_name = str(run_name)  # run_name=123: the folder the user typed
    if not isinstance(run_name, str) or not run_name:
        raise ConfigError(
            f"run_name={run_name!r}; expected a folder name or auto (the command line reads "
            f"1e3, nan, true as numbers or booleans: quote one to name a folder so, "
            f"run_name=\"'{run_name}'\")"
        )
    if run_name != "auto":
        return str(named_run(root, run_name))
    if ckpt_path == "last":
        found = newest_resumable_run(root)
        if found is None:
            raise ConfigError(
                f"ckpt_path=last: no run under {root} has a last checkpoint; "
                "pass run_name=<folder> to pick one"
            )
        return str(found)
    if (label := slurm_job_label()) is not None:
        check_location(root / f"slurm-{label}", root)
        return str(root / f"slurm-{label}")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    candidate, n = root / stamp, 1
    while candidate.exists():
        candidate, n = root / f"{stamp}-{n}", n + 1
    return str(candidate)


def run_dir_or_exit(runs_dir: str, run_name, ckpt_path: str | None) -> str:
    """``hydra.run.dir``: Hydra resolves it before the job starts (and before it makes the
    folder), where a refusal would come out as its traceback; said here as every other refusal,
    in one line (exit 2)."""
    try:
        run = run_dir(runs_dir, run_name, ckpt_path)
    except LongctxError as err:  # a ConfigError, a refused folder
        exit_on_user_error(err)
    note_before_hydra(Path(run))  # before Hydra makes or writes it: what a refusal leaves
    return run


class NoteRunFolder(Callback):
    """``hydra.callbacks``: notes what the run folder holds before Hydra makes it or writes into
    it, whatever ``hydra.run.dir`` names (the run-folder resolver notes only the folders it
    picks; ``hydra.run.dir=PATH`` bypasses it). What a refused start removes is what appeared
    since."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        note_before_hydra(Path(config.hydra.run.dir))


def config_subdir_or_exit(run_dir: str) -> str:
    """``hydra.output_subdir``; a refusal said in one line (exit 2), not as Hydra's traceback."""
    try:
        return config_subdir(run_dir)
    except LongctxError as err:  # a refused folder
        exit_on_user_error(err)


def required_value(key: str, hint: str = "") -> None:
    """``${longctx_required:key,hint}``: a value the command line must set. (A ``???`` in a
    config group option is lost when that option is merged over a default that sets it.)"""
    raise ConfigError(f"{key} is not set. {hint}".strip())


def register_with_hydra() -> None:
    typed_defaults.register()
    if not OmegaConf.has_resolver("longctx_required"):
        OmegaConf.register_new_resolver("longctx_required", required_value)
    if not OmegaConf.has_resolver("longctx_run_dir"):
        # cached: Hydra may resolve the run folder more than once; it must not change
        OmegaConf.register_new_resolver("longctx_run_dir", run_dir_or_exit, use_cache=True)
    if not OmegaConf.has_resolver("longctx_config_subdir"):
        # cached: decided once per start, before Hydra writes the config it names
        OmegaConf.register_new_resolver(
            "longctx_config_subdir", config_subdir_or_exit, use_cache=True
        )
    if not OmegaConf.has_resolver("longctx_sweep_subdir"):
        OmegaConf.register_new_resolver("longctx_sweep_subdir", sweep_subdir)
    if not OmegaConf.has_resolver("longctx_slurm_nodes"):
        # conf/hydra/launcher/slurm.yaml: refuse a node count / partition the cluster lacks
        OmegaConf.register_new_resolver("longctx_slurm_nodes", checked_num_nodes)
