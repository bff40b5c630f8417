"""A training run from a composed Hydra config.

``train.py`` hands the composed config to :func:`main`: it is checked (before anything is
allocated, prepared or written), typed objects are instantiated from it, and Lightning fits them.

Only the app reads a DictConfig; the library below it takes typed configs (DataConfig, the model
spec, ParallelConfig, OptimConfig, PlannerSettings). The app is this module (with the writing
rank and a clean exit) and the modules it delegates to (longctx.train.preflight, dry_run,
loggers, resolvers, and longctx.probe.cli through this module's builders), each reading what no
typed config holds.
"""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from longctx.cli import USER_ERRORS, exit_on_user_error
from longctx.data.arms import arm_description
from longctx.data.dp_balance import RowCost
from longctx.distributed.slurm import slurm_plugins
from longctx.errors import LongctxError
from longctx.planner.dp_balance import training_row_cost
from longctx.runs.checkpoints import AtomicCheckpointIO, ResumePoint, remove_stale_temp_files
from longctx.runs.folder import (
    HydraWrites,
    RunFolderLock,
    RunStart,
    checkpoint_dir,
    what_a_stop_kept,
)
from longctx.runs.record import RunRecord
from longctx.runs.resume import (
    TRAINING_KEY,
    ResumeRefused,
    check_fresh_start,
    resume_point,
    run_identity,
    training_settings,
)
from longctx.train import console
from longctx.train.callbacks import SweepStopped, finish_preemption
from longctx.train.cpu_memory import retain_freed_memory
from longctx.train.dry_run import dry_run_report
from longctx.train.loggers import make_loggers
from longctx.train.nonfinite import NonFiniteStep
from longctx.train.optim_config import OptimConfig
from longctx.train.preflight import (
    ConfigError,
    check_planner,
    init_from_note,
    instantiate_config,
    preflight,
)


def main(cfg: DictConfig) -> float | None:
    try:
        metrics = run(cfg)
    # a user's mistake, or a run that diverged (NonFiniteStep says what to change): one line
    # and exit 2; anything else is a bug and keeps its traceback
    except (*USER_ERRORS, NonFiniteStep) as err:
        exit_on_user_error(err)
    except SweepStopped as err:
        print(f"longctx: {err}", file=sys.stderr, flush=True)
        raise SystemExit(0) from err  # a stop exits 0, as a single run's does
    finally:
        teardown()
    return metrics.get("val/loss")


def run(cfg: DictConfig) -> dict:
    """Train (or dry-run) one configuration; returns the final logged metrics. The process
    that writes the run folder (global rank 0) holds its lock throughout; a refused start
    takes back what it added; a run stopped in training keeps its folder."""
    output_dir = Path(cfg.paths.output_dir)
    start = RunStart(output_dir, hydra_writes()) if writes_run_folder() else None
    lock = RunFolderLock(output_dir).acquire() if start is not None else None
    try:
        metrics = train(cfg, output_dir, start)
        if cfg.dry_run and start is not None:
            start.undo()  # a plan writes nothing: no run folder either
        return metrics
    except NonFiniteStep as err:
        err.kept = what_a_stop_kept(output_dir)  # it trained: what it logged is kept
        raise
    except Exception:  # a refusal, or a bug: a start that did not train leaves nothing it made
        if start is not None and start.undo():
            print(f"removed the run folder {output_dir}: nothing was written", file=sys.stderr)
        raise
    finally:
        if lock is not None:
            lock.release()


def writes_run_folder() -> bool:
    """Global rank 0 (from the launcher's environment; 0 when not launched as a rank)."""
    return getattr(rank_zero_only, "rank", 0) == 0


def teardown() -> None:
    """Stop data-loader workers, finish the W&B run and destroy the process group (without it
    rank 1 aborts at exit)."""
    # workers still alive (a run stopped mid-epoch leaves its iterator's) ignore SIGTERM
    # (longctx.data.datamodule._worker_init), and multiprocessing's exit handler would SIGTERM
    # them and then wait for them forever
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(timeout=30)
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def train(cfg: DictConfig, output_dir: Path, start: RunStart | None) -> dict:
    """``start``: this start's view of the run folder; None on a rank that does not write it."""
    console.quiet_lightning()
    model_config = instantiate_config("model", cfg.model)
    data_config = instantiate_config("data", cfg.data)
    parallel = instantiate_config("parallel", cfg.parallel)
    device = preflight(cfg, model_config, data_config, parallel)
    optim = optim_config(cfg.optim)
    if cfg.dry_run:
        return dry_run_report(model_config, data_config, optim, parallel, cfg, device)
    identity = run_identity(model_config, data_config)
    if device.type == "cpu":
        retain_freed_memory()
    L.seed_everything(cfg.seed, workers=True)
    row_cost = run_row_cost(cfg, model_config, data_config, parallel)
    datamodule = build_datamodule(data_config, model_config, parallel, optim, row_cost)
    module = build_module(cfg, model_config, optim, datamodule.eos_id, parallel, row_cost)
    # after every refusal the data and the model can raise: an overwrite deletes the previous
    # run only once this start is known to begin
    resume = start_point(cfg, output_dir, identity, start)
    if writes_run_folder():
        print(arm_description(data_config.reset_position_ids, data_config.document_mask))
    trainer = build_trainer(cfg, output_dir, RunRecord(identity, recorded_config(cfg)))
    if start is not None:
        trainer.callbacks.append(TrainingBegan(start))
    ckpt_path = resume.announce() if resume is not None else None
    if note := init_from_note(getattr(model_config, "init_from", None), ckpt_path):
        print(note, flush=True)
    del resume  # drop the mapped contents before Lightning loads the checkpoint again
    # weights_only: a checkpoint is data; a crafted pickle in one must not run code
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    finish_preemption(trainer, output_dir)
    metrics = final_metrics(trainer, datamodule)
    if trainer.is_global_zero:
        print(console.run_summary(trainer, output_dir), flush=True)
    return metrics


def start_point(
    cfg: DictConfig, output_dir: Path, identity: dict, start: RunStart | None
) -> ResumePoint | None:
    """The checkpoint to resume from, or None after checking that a fresh start may begin;
    then the folder is marked as this run's."""
    allowed = list(cfg.get("allow_resume_changes") or [])
    try:
        resume = resume_point(cfg.ckpt_path, output_dir, identity, allowed, training_config(cfg))
        if start is not None and resume is None:
            check_fresh_start(output_dir, bool(cfg.get("overwrite", False)), start)
    except ResumeRefused as err:
        raise ConfigError(str(err)) from err
    if start is not None:
        start.claim()
        for path in remove_stale_temp_files(checkpoint_dir(output_dir)):
            print(f"removed {path}: a checkpoint write that never finished", flush=True)
    return resume


class TrainingBegan(L.Callback):
    """Tells the start that a training step ran: what an error after it leaves is the run's."""

    def __init__(self, start: RunStart) -> None:
        self.start = start

    def on_train_batch_end(self, *args, **kwargs) -> None:
        self.start.trained = True


def hydra_writes() -> HydraWrites:
    """What Hydra wrote into the run folder for this start (nothing known outside a Hydra app,
    e.g. in tests)."""
    if not HydraConfig.initialized():
        return HydraWrites()
    hydra = HydraConfig.get()
    return HydraWrites(config_dir=hydra.output_subdir, job_log=f"{hydra.job.name}.log")


def training_config(cfg: DictConfig) -> dict:
    """The optimizer and schedule settings a resume compares (longctx.runs.resume)."""
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    return training_settings(optim, cfg.trainer.get("max_steps"))


def recorded_config(cfg: DictConfig) -> dict:
    """The resolved model and data config, the run's group, seed and tags, and its training
    settings (optimizer, schedule): what the checkpoint's run record keeps."""
    config = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "data")}
    run = {"group": cfg.get("group"), "seed": cfg.seed, "tags": list(cfg.get("tags") or [])}
    return config | {"run": run, TRAINING_KEY: training_config(cfg)}


def build_trainer(cfg: DictConfig, output_dir: Path, record: RunRecord) -> L.Trainer:
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    try:
        return instantiate(
            cfg.trainer,
            logger=make_loggers(cfg, output_dir) or False,
            callbacks=[*callbacks, record, *console.callbacks(cfg.trainer)],
            # under SLURM: Lightning's environment without its auto-requeue (SaveOnSignal
            # requeues)
            plugins=[AtomicCheckpointIO(), *slurm_plugins()],
        )
    except InstantiationException as err:  # an unknown trainer key, a bad strategy
        raise ConfigError(f"trainer: {err}") from err


def optim_config(node: DictConfig) -> OptimConfig:
    """The ``optim`` group typed: its optimizer and schedule instantiated (Hydra partials),
    every other key an OptimConfig field; a value it refuses is a ConfigError."""
    factories = {
        name: instantiate_config(f"optim.{name}", node[name])
        for name in ("optimizer", "scheduler")
        if node.get(name) is not None
    }
    settings = OmegaConf.to_container(node, resolve=True)
    try:
        return OptimConfig.from_settings(
            {k: v for k, v in settings.items() if k not in factories}, **factories
        )
    except LongctxError as err:
        raise ConfigError(str(err)) from err


def run_row_cost(cfg: DictConfig, model_config, data_config, parallel) -> RowCost | None:
    """The planner's row cost (longctx.planner.dp_balance) that data.dp_balance balances and
    train/dp_work_imbalance weighs with: seconds at peak_flops_per_device x planner.mfu, FLOPs
    where no peak is set; None for a model the planner does not cover (refused with
    data.dp_balance=true)."""
    settings = check_planner(cfg)
    cost = training_row_cost(
        model_config, cfg.get("peak_flops_per_device"), settings.mfu, parallel.context_parallel
    )
    if cost is None and data_config.dp_balance:
        raise ConfigError(
            f"data.dp_balance=true: the row cost is the planner's FLOP model, which covers "
            f"longctx's Llama only, not {type(model_config).__name__}; expected model=tiny or "
            "llama3_*, or data.dp_balance=false"
        )
    return cost


def build_datamodule(data_config, model_config, parallel, optim: OptimConfig, row_cost=None):
    from longctx.data import LongCtxDataModule

    datamodule = LongCtxDataModule(
        data_config,
        context_parallel=parallel.context_parallel,
        accumulate_grad_batches=optim.accumulate_grad_batches,
        row_cost=row_cost,
    )
    datamodule.prepare_data()
    try:
        datamodule.check_vocab(model_config.vocab_size)
    except LongctxError as err:
        raise ConfigError(f"model.vocab_size={model_config.vocab_size}: {err}") from err
    return datamodule


def build_module(
    cfg: DictConfig, model_config, optim: OptimConfig, eos_id: int, parallel, row_cost=None
):
    from longctx.train.module import LongCtxModule

    return LongCtxModule(
        model_config,
        optim,
        compile=cfg.compile,
        peak_flops_per_device=cfg.get("peak_flops_per_device"),
        eos_id=eos_id,
        context_parallel=parallel.context_parallel,
        context_parallel_rounds=parallel.context_parallel_rounds,
        context_parallel_balance=parallel.context_parallel_balance,
        row_cost=row_cost,
    )


def final_metrics(trainer: L.Trainer, datamodule) -> dict:
    from longctx.eval.baselines import unigram_baseline

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    # the unigram baseline is over every token: no yardstick for an answers-only loss
    if "val/loss" in metrics and trainer.is_global_zero and datamodule.config.loss_tokens == "all":
        metrics["unigram_baseline"] = unigram_baseline(datamodule.folders()[0])
        print(
            f"val/loss {metrics['val/loss']:.4f} nats/token, unigram baseline "
            f"{metrics['unigram_baseline']:.4f}"
        )
    return metrics
