"""python -m longctx.probe [options] [overrides as train.py takes]

Builds the run train.py would build from the same overrides (model, attention backend,
precision, strategy, context parallelism, data), probes it with the first micro-batch of every
stage, prints the table and writes the JSON (``--out``, else ``<run folder>/probe.json`` under
outputs/probe/). Exit 0 when every check passes, 1 naming the first failing check, row and
document, 2 for bad input.

Examples:
    python -m longctx.probe                                          # tiny, CPU, sdpa
    python -m longctx.probe model.attn_backend=eager trainer.precision=bf16-mixed
    python -m longctx.probe trainer=ddp trainer.accelerator=cpu trainer.devices=2 \\
        parallel.context_parallel=2                                  # CP=2 over gloo
    python -m longctx.probe model=hf model.path=/ckpt/llama --checks isolation
    torchrun --nproc-per-node 8 -m longctx.probe trainer=fsdp trainer.devices=8 ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from longctx.cli import USER_ERRORS, command
from longctx.errors import LongctxError
from longctx.probe.checks import CHECKS, TOLERANCE_NAMES, check_checks, check_tolerances


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m longctx.probe",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as train.py takes them")
    parser.add_argument("--out", help="the JSON file (default: <run folder>/probe.json)")
    parser.add_argument(
        "--checks", help=f"comma-separated checks to run (default: all of {', '.join(CHECKS)})"
    )
    parser.add_argument(
        "--tolerance",
        action="append",
        default=[],
        metavar="CHECK=VALUE",
        help=f"a relative tolerance for one of {', '.join(TOLERANCE_NAMES)} (replaces the "
        "measured one)",
    )
    parser.add_argument("--batches", type=int, default=1, help="micro-batches per stage")
    parser.add_argument("--seed", type=int, default=0, help="seed of the perturbations")
    args = parser.parse_intermixed_args(argv)
    args.checks = check_checks(args.checks.split(",") if args.checks is not None else None)
    args.tolerances = check_tolerances(dict(_pair(t) for t in args.tolerance))
    if args.batches < 1:
        raise LongctxError(
            f"--batches ({args.batches}) must be at least 1; pass --batches 1 or more"
        )
    check_out(args.out)
    return args


def check_out(out: str | None) -> None:
    """--out names a new file in a folder (or where one can be made): refused before the probe
    runs, not after; an existing file is never overwritten."""
    if out is None:
        return
    path = Path(out)
    if path.is_dir():
        raise IsADirectoryError(
            f"--out is a folder ({path}); pass a file, e.g. {path / 'probe.json'}"
        )
    if path.exists() or path.is_symlink():
        raise FileExistsError(
            f"--out exists ({path}); pass a new file, the probe never overwrites one"
        )
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir():
        raise NotADirectoryError(f"--out is inside a file ({parent}); pass a path in a folder")


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep:
        raise LongctxError(f"--tolerance ({text}) is not CHECK=VALUE; pass e.g. isolation=1e-6")
    return name, value


def compose(overrides: list[str]) -> DictConfig:
    """The config train.py would run, in task ``probe`` (its run folder under outputs/probe)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from longctx.train.cli import CONF_DIR
    from longctx.train.preflight import check_moved_overrides
    from longctx.train.resolvers import register_with_hydra, run_dir

    check_moved_overrides(overrides)
    register_with_hydra()
    keys = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    extra = [] if "task_name" in keys else ["task_name=probe"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("train", overrides=[*extra, *overrides])
    if "paths.output_dir" not in keys:
        folder = run_dir(cfg.paths.runs_dir, cfg.run_name, None)
        OmegaConf.update(cfg, "paths.output_dir", folder)
    return cfg


def main(argv: list[str] | None = None) -> int:
    from longctx.train.app import teardown

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return probe_run(compose(args.overrides), args)
    finally:
        teardown()


def probe_run(cfg: DictConfig, args: argparse.Namespace) -> int:
    """Build the run as train.py does, probe it at its start, stop before its first step."""
    import lightning as L

    from longctx.probe.callback import JSON_NAME, LeakProbe
    from longctx.probe.checks import check_probeable
    from longctx.probe.data import run_rows
    from longctx.train import console
    from longctx.train.app import build_datamodule, build_module, optim_config
    from longctx.train.preflight import instantiate_config, preflight

    console.quiet_lightning()  # what train.py silences (the srun hint, ...) the probe does too
    model_config = instantiate_config("model", cfg.model)
    data_config = instantiate_config("data", cfg.data)
    parallel = instantiate_config("parallel", cfg.parallel)
    preflight(cfg, model_config, data_config, parallel)
    optim = optim_config(cfg.optim)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = build_datamodule(data_config, model_config, parallel, optim)
    module = build_module(cfg, model_config, optim, datamodule.eos_id, parallel)
    check_probeable(run_rows(datamodule, args.batches))  # before any other process starts
    out = args.out or str(Path(cfg.paths.output_dir) / JSON_NAME)
    callback = LeakProbe(args.checks, args.tolerances, args.batches, out, True, args.seed)
    trainer = probe_trainer(cfg, callback)
    trainer.fit(module, datamodule=datamodule)
    if callback.report is None:
        raise RuntimeError("the probe did not run: training never started")
    return 0 if callback.report.passed else 1


def probe_trainer(cfg: DictConfig, callback):
    """The run's Lightning Trainer (strategy, precision, devices) with the probe as its only
    callback, and no logger or checkpoints: nothing trains."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from longctx.distributed.slurm import slurm_plugins
    from longctx.train.preflight import ConfigError

    try:
        return instantiate(
            cfg.trainer,
            logger=False,
            callbacks=[callback],
            enable_checkpointing=False,
            enable_model_summary=False,
            plugins=slurm_plugins(),
        )
    except InstantiationException as err:
        raise ConfigError(f"trainer: {err}") from err


def run() -> None:
    errors = (*USER_ERRORS, HydraException, OmegaConfBaseException)
    raise SystemExit(command(main, errors)())
