"""Composition of a training run from a Hydra config: the only place a DictConfig is read.

``train.py`` hands the composed config to :func:`run`, which checks it (before anything is
allocated or prepared), instantiates typed objects, and gives them to Lightning.
"""

from __future__ import annotations

import copy
import datetime
import os
import shutil
import socket
import sys
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError

from longctx import planner
from longctx.distributed.context_parallel import check_context_parallel
from longctx.distributed.cp_balance import DEFAULT_BALANCE, rank_unit
from longctx.distributed.slurm import (
    PREEMPTED_MARKER,
    check_allocation,
    check_master_address,
    checked_num_nodes,
    slurm_job_label,
    slurm_plugins,
)
from longctx.experiments.arms import arm_description
from longctx.model import Llama, LlamaConfig
from longctx.model.attention import get_backend, resolve_backend
from longctx.runs.checkpoints import (
    AtomicCheckpointIO,
    ResumePoint,
    UnreadableCheckpoint,
    auto_resume_path,
    remove_stale_temp_files,
    resolve_ckpt_path,
)
from longctx.runs.folder import (
    RunFolderBusy,
    RunFolderLock,
    config_subdir,
    existing_checkpoints,
    remove_if_only_bookkeeping,
)
from longctx.runs.identity import (
    CHECKPOINT_KEY,
    ResumeMismatch,
    RunRecord,
    check_resume,
    run_identity,
)
from longctx.train.cpu_memory import retain_freed_memory
from longctx.train.loggers import make_loggers


class ConfigError(ValueError):
    """A config value that cannot work; raised before anything is allocated."""


# ----------------------------------------------------------------------- run folder
def run_dir(runs_dir: str, run_name: str, ckpt_path: str | None) -> str:
    """The run folder: named, the newest resumable one (ckpt_path=last), inside a SLURM job
    slurm-<job id> (every rank and a requeued job find the same folder), or a new timestamped one."""
    root = Path(runs_dir)
    if run_name != "auto":
        return str(root / run_name)
    if ckpt_path == "last":
        found = sorted(root.glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise ConfigError(
                f"ckpt_path=last: no run under {root} has checkpoints/last.ckpt; "
                "pass run_name=<folder> to pick one"
            )
        return str(found[-1].parent.parent)
    if slurm_job_label() is not None:
        return str(root / f"slurm-{slurm_job_label()}")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    candidate, n = root / stamp, 1
    while candidate.exists():
        candidate, n = root / f"{stamp}-{n}", n + 1
    return str(candidate)


def required_value(key: str, hint: str = "") -> None:
    """``${longctx_required:key,hint}``: a value the command line must set. (A ``???`` in a
    config group option is lost when that option is merged over a default that sets it.)"""
    raise ConfigError(f"{key} is not set. {hint}".strip())


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("longctx_required"):
        OmegaConf.register_new_resolver("longctx_required", required_value)
    if not OmegaConf.has_resolver("longctx_run_dir"):
        # cached: Hydra may resolve the run folder more than once; it must not change
        OmegaConf.register_new_resolver("longctx_run_dir", run_dir, use_cache=True)
    if not OmegaConf.has_resolver("longctx_config_subdir"):
        # cached: decided once per start, before Hydra writes the config it names
        OmegaConf.register_new_resolver("longctx_config_subdir", config_subdir, use_cache=True)
    if not OmegaConf.has_resolver("longctx_slurm_nodes"):
        # conf/hydra/launcher/slurm.yaml: refuse a node count / partition the cluster lacks
        OmegaConf.register_new_resolver("longctx_slurm_nodes", checked_num_nodes)


# ------------------------------------------------------------------------ preflight
def training_device(trainer_cfg: DictConfig) -> torch.device:
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def check_devices(trainer_cfg: DictConfig, device: torch.device) -> None:
    devices = trainer_cfg.get("devices", 1)
    if not isinstance(devices, int) or isinstance(devices, bool):
        return  # "auto" / lists are Lightning's to interpret
    available = torch.cuda.device_count() if device.type == "cuda" else os.cpu_count() or 1
    if device.type == "cuda" and available == 0:
        raise ConfigError(
            f"trainer.accelerator={trainer_cfg.accelerator} but no CUDA device is visible"
        )
    if devices > available:
        raise ConfigError(
            f"trainer.devices={devices} but this machine has {available} {device.type} device(s)"
        )


def world_size(trainer_cfg: DictConfig) -> int | None:
    """trainer.devices x trainer.num_nodes; None where devices is Lightning's to count."""
    devices = trainer_cfg.get("devices", 1)
    if not isinstance(devices, int) or isinstance(devices, bool):
        return None
    return devices * int(trainer_cfg.get("num_nodes", 1))


def check_topology(trainer_cfg: DictConfig) -> None:
    """Nodes and tasks match the SLURM allocation; the ranks can meet at MASTER_ADDR."""
    try:
        check_allocation(int(trainer_cfg.get("num_nodes", 1)), trainer_cfg.get("devices", 1))
        check_master_address(world_size(trainer_cfg) or 1)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def check_backend(
    model_config,
    seq_len: int,
    device: torch.device,
    context_chunks: int = 1,
    setting: str = "data.seq_len",
    context_balance: str | None = None,
) -> None:
    """Ask the owners: the model spec (its length limit, an HF model's window) and the attention
    backend (device, lengths, training), for rows of ``seq_len`` cut into ``context_chunks``
    by the context-parallel balancer ``context_balance`` (None: no context parallelism).
    ``setting``: where ``seq_len`` comes from (data.seq_len or a stage's), for the errors."""
    try:
        model_config.check_seq_len(seq_len)
    except ValueError as err:
        raise ConfigError(f"{setting}={seq_len}: {err}") from err
    name = model_config.attn_backend
    try:
        backend = get_backend(resolve_backend(name, device))
        backend.check(device, seq_len, chunks=context_chunks, training=True)
        if context_balance is not None:
            backend.check_context_parallel(context_balance)
    except (ValueError, RuntimeError) as err:
        raise ConfigError(f"model.attn_backend={name}, {setting}={seq_len}: {err}") from err


def preflight_context_parallel(
    trainer_cfg: DictConfig,
    model_config,
    seq_len: int,
    size: int,
    rounds: int,
    setting: str = "data.seq_len",
    balance: str = DEFAULT_BALANCE,
) -> None:
    """trainer.context_parallel (ranks that split each row), trainer.context_parallel_balance
    (how) and trainer.context_parallel_rounds (head-tail rounds per row, balance=rounds) can
    work with this world, sequence length (from ``setting``) and model."""
    try:
        check_context_parallel(
            size,
            rounds,
            seq_len=seq_len if size > 1 else None,
            world=world_size(trainer_cfg),
            balance=balance,
        )
    except ValueError as err:
        raise ConfigError(
            f"{setting}={seq_len}, trainer.context_parallel={size}, "
            f"trainer.context_parallel_rounds={rounds}: {err}"
        ) from err
    if size > 1 and not isinstance(model_config, LlamaConfig):
        raise ConfigError(
            f"trainer.context_parallel={size}: only longctx's Llama (model=tiny/llama3_*) "
            "supports context parallelism; a Hugging Face model's attention cannot take a row "
            "split over ranks"
        )


def pop_context_parallel(cfg: DictConfig) -> tuple[int, int, str]:
    """Take longctx's own keys out of cfg.trainer (lightning.Trainer refuses them):
    (context_parallel, context_parallel_rounds, context_parallel_balance)."""
    with open_dict(cfg.trainer):
        cfg.trainer.pop("device_memory_gb", None)  # the capacity planner's key
        return (
            cfg.trainer.pop("context_parallel", 1),
            cfg.trainer.pop("context_parallel_rounds", 1),
            cfg.trainer.pop("context_parallel_balance", DEFAULT_BALANCE),
        )


def check_init_from(model_config) -> None:
    """model.init_from names weights of this model's shapes (read later, by each rank)."""
    if not model_config.init_from:
        return
    from longctx.train.init_from import resolve

    try:
        source = resolve(model_config.init_from)
        source.check(model_config)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if (change := source.rope_change(model_config)) is not None:
        print(change, flush=True)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def sharded_strategy(trainer_cfg: DictConfig) -> bool:
    """FSDP2 (or any ModelParallel / FSDP strategy): parameters sharded over the ranks."""
    target = str(OmegaConf.select(trainer_cfg, "strategy._target_", default=""))
    return "ModelParallel" in target or "FSDP" in target


def check_memory(model_config: LlamaConfig, trainer_cfg: DictConfig, device: torch.device) -> None:
    sharded = sharded_strategy(trainer_cfg)
    devices = trainer_cfg.get("devices", 1) if isinstance(trainer_cfg.get("devices"), int) else 1
    shards = devices * int(trainer_cfg.get("num_nodes", 1)) if sharded else 1
    params = model_config.num_params()
    need = planner.training_state_bytes(params, shards)
    have = available_memory_bytes(device)
    if need > have:
        raise ConfigError(
            f"the model has {params:,} parameters; training it needs about "
            f"{need / 2**30:,.1f} GiB per device for weights, gradients and AdamW state "
            f"({planner.training_state_bytes(1)} bytes/parameter{f' sharded over {shards}' if shards > 1 else ''}"
            f", activations not included), but a {device.type} device here has "
            f"{have / 2**30:,.1f} GiB. Use trainer=fsdp with more devices, or dry_run=true to "
            "inspect the model without allocating it."
        )


def instantiate_config(group: str, node: DictConfig):
    """A typed config from its group; a value its validation refuses is a ConfigError."""
    try:
        return instantiate(node)
    except (InstantiationException, InterpolationResolutionError) as err:
        raise ConfigError(f"{group}: {err}") from err


def preflight(
    cfg: DictConfig,
    model_config,
    data_config,
    context_parallel: int,
    rounds: int,
    balance: str = DEFAULT_BALANCE,
) -> torch.device:
    device = training_device(cfg.trainer)
    if not cfg.dry_run:  # a dry run plans for the target machine, maybe not this one
        check_devices(cfg.trainer, device)
    check_topology(cfg.trainer)
    stages = [
        (f"data.stages[{i}].seq_len", s.seq_len) for i, s in enumerate(data_config.stages or [])
    ]
    split = context_parallel > 1
    chunks = rank_unit(context_parallel, balance, rounds) if split else 1
    for setting, seq_len in [*stages, ("data.seq_len", data_config.seq_len)]:
        preflight_context_parallel(
            cfg.trainer, model_config, seq_len, context_parallel, rounds, setting, balance
        )
        check_backend(model_config, seq_len, device, chunks, setting, balance if split else None)
    check_init_from(model_config)
    if not cfg.dry_run:
        check_memory(model_config, cfg.trainer, device)
    return device


# ---------------------------------------------------------------------- composition
def dry_run_report(model_config: LlamaConfig, cfg: DictConfig, device: torch.device) -> dict:
    if isinstance(model_config, LlamaConfig):
        with torch.device("meta"):
            params = sum(p.numel() for p in Llama(model_config).parameters())
    else:  # a model factory (model=hf) counts its parameters from its config
        params = model_config.num_params()
    report = {
        "parameters": params,
        "training_memory_gib_per_device": planner.training_state_bytes(params) / 2**30,
        "model": asdict(model_config),
        "seq_len": cfg.data.seq_len,
    }
    print(
        f"dry run: {params:,} parameters, about {report['training_memory_gib_per_device']:,.1f} "
        f"GiB for weights, gradients and AdamW state; nothing allocated"
    )
    if not isinstance(model_config, LlamaConfig):
        print("capacity plan: covers longctx's Llama (model=tiny/llama3_*) only")
        return report
    if cfg.planner.device:  # planning for named GPUs, maybe from a machine without them
        device = torch.device("cuda")
    try:
        capacity = planner.plan(
            model_config,
            planner_layout(cfg, model_config, device),
            planner_device(cfg, device),
            mfu=cfg.planner.mfu,
        )
    except planner.PlanError as err:
        raise ConfigError(str(err)) from err
    print(planner.format_plan(capacity))
    return report | {"plan": planner.plan_dict(capacity)}


def planner_layout(cfg: DictConfig, model_config: LlamaConfig, device: torch.device):
    """The run's layout as the planner sees it (one document per row, the worst case, unless
    planner.doc_length_median states a distribution)."""
    fsdp = sharded_strategy(cfg.trainer)
    devices = cfg.trainer.get("devices", 1)
    return planner.Layout(
        seq_len=cfg.data.seq_len,
        micro_batch_size=cfg.data.micro_batch_size,
        num_nodes=int(cfg.trainer.get("num_nodes", 1)),
        devices=devices if isinstance(devices, int) else 1,
        context_parallel=cfg.trainer.get("context_parallel", 1),
        context_parallel_rounds=cfg.trainer.get("context_parallel_rounds", 1),
        context_parallel_balance=cfg.trainer.get("context_parallel_balance", DEFAULT_BALANCE),
        fsdp=fsdp,
        precision=planner_precision(cfg.trainer, fsdp, device),
        activation_checkpointing=model_config.activation_checkpointing,
        attn_backend=resolve_backend(model_config.attn_backend, device),
        accumulate_grad_batches=cfg.optim.accumulate_grad_batches,
        max_steps=cfg.trainer.max_steps,
        doc_length_lognormal=doc_length_distribution(cfg.planner),
    )


def doc_length_distribution(planner_cfg: DictConfig) -> tuple[float, float] | None:
    """planner.doc_length_median / doc_length_sigma as the planner's lognormal, if stated."""
    median = planner_cfg.get("doc_length_median")
    if median is None:
        return None
    return float(median), float(planner_cfg.get("doc_length_sigma", 1.0))


def planner_precision(trainer_cfg: DictConfig, fsdp: bool, device: torch.device) -> str:
    if fsdp:  # FSDP2's mixed-precision policy casts; Lightning's precision stays 32-true
        name = trainer_cfg.strategy.get("param_dtype", "auto")
        bf16 = name == "bfloat16" or (name == "auto" and device.type == "cuda")
        return "bf16" if bf16 else "fp32"
    precision = str(trainer_cfg.get("precision", "32-true"))
    known = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16"}
    if precision not in known:
        raise ConfigError(f"trainer.precision={precision}: the capacity plan knows {sorted(known)}")
    return known[precision]


def planner_device(cfg: DictConfig, device: torch.device) -> planner.Device:
    """planner.device names a known accelerator (else the visible GPU's name); the keys
    trainer.device_memory_gb and peak_flops_per_device override or supply its numbers."""
    memory_gb, peak = cfg.trainer.get("device_memory_gb"), cfg.get("peak_flops_per_device")
    bandwidths = {
        "intra_node_bytes_per_s": cfg.planner.intra_node_gb_per_s * 1e9,
        "inter_node_bytes_per_s": cfg.planner.inter_node_gb_per_s * 1e9,
    }
    if device.type == "cpu":
        memory = memory_gb * 1e9 if memory_gb else available_memory_bytes(device)
        rss = planner.process_rss_bytes()
        note = "this process's RSS (Python, torch, the app's imports), measured"
        return planner.Device("cpu", int(memory), peak, rss, note, **bandwidths)
    name = cfg.planner.device or (
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    )
    if name is not None and (memory_gb is None or peak is None):
        known = planner.known_device(name)
        memory_gb = memory_gb or known.memory_bytes / 1e9
        peak = peak or known.peak_flops
    for key, value in (("trainer.device_memory_gb", memory_gb), ("peak_flops_per_device", peak)):
        if value is None:
            raise ConfigError(
                f"the capacity plan needs {key} for this accelerator (no GPU is visible and "
                f"planner.device is not set to one of {sorted(planner.KNOWN_DEVICES)})"
            )
    baseline = planner.CUDA_RUNTIME_BYTES
    return planner.Device(
        name or "gpu", int(memory_gb * 1e9), peak, baseline, "CUDA context + NCCL (stated)",
        **bandwidths,
    )  # fmt: skip


def build_callbacks(cfg: DictConfig) -> list:
    return [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]


def run(cfg: DictConfig) -> dict:
    """Train (or dry-run) one configuration; returns the final logged metrics. The process
    that writes the run folder (global rank 0) holds its lock throughout."""
    output_dir = Path(cfg.paths.output_dir)
    lock = RunFolderLock(output_dir).acquire() if writes_run_folder() else None
    try:
        return train(cfg, output_dir, holds_folder=lock is not None)
    except ConfigError:
        if lock is not None and remove_if_only_bookkeeping(output_dir):
            print(f"removed the run folder {output_dir}: nothing was written", file=sys.stderr)
        raise
    finally:
        if lock is not None:
            lock.release()


def writes_run_folder() -> bool:
    """Global rank 0 (from the launcher's environment; 0 when not launched as a rank)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def train(cfg: DictConfig, output_dir: Path, holds_folder: bool) -> dict:
    from longctx.data import LongCtxDataModule
    from longctx.eval.baselines import unigram_baseline
    from longctx.train.module import LongCtxModule

    model_config: LlamaConfig = instantiate_config("model", cfg.model)
    data_config = instantiate_config("data", cfg.data)
    composed = copy.deepcopy(cfg)  # the planner reads longctx's own trainer keys, popped here
    context_parallel, context_parallel_rounds, balance = pop_context_parallel(cfg)
    device = preflight(
        cfg, model_config, data_config, context_parallel, context_parallel_rounds, balance
    )
    if cfg.dry_run:
        return dry_run_report(model_config, composed, device)
    identity = run_identity(model_config, data_config)
    resume = resume_point(cfg, output_dir, identity, holds_folder)
    if holds_folder:
        for path in remove_stale_temp_files(output_dir / "checkpoints"):
            print(f"removed {path}: a checkpoint write that never finished", flush=True)
    if device.type == "cpu":
        retain_freed_memory()
    if writes_run_folder():
        print(arm_description(data_config.reset_position_ids, data_config.document_mask))

    L.seed_everything(cfg.seed, workers=True)
    datamodule = LongCtxDataModule(
        data_config,
        context_parallel=context_parallel,
        accumulate_grad_batches=cfg.optim.accumulate_grad_batches,
    )
    datamodule.prepare_data()
    try:
        datamodule.check_vocab(model_config.vocab_size)
    except ValueError as err:
        raise ConfigError(f"model.vocab_size={model_config.vocab_size}: {err}") from err
    module = LongCtxModule(
        model_config,
        optimizer=instantiate(cfg.optim.optimizer),
        scheduler=instantiate(cfg.optim.scheduler),
        weight_decay=cfg.optim.weight_decay,
        grad_clip=cfg.optim.grad_clip,
        accumulate_grad_batches=cfg.optim.accumulate_grad_batches,
        compile=cfg.compile,
        peak_flops_per_device=cfg.get("peak_flops_per_device"),
        eos_id=datamodule.eos_id,
        context_parallel=context_parallel,
        context_parallel_rounds=context_parallel_rounds,
        context_parallel_balance=balance,
        allow_global_batch_change=cfg.optim.allow_global_batch_change,
    )
    resolved = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "data")}
    record = RunRecord(identity, resolved)
    trainer: L.Trainer = instantiate(
        cfg.trainer,
        logger=make_loggers(cfg, output_dir) or False,
        callbacks=[*build_callbacks(cfg), record],
        # under SLURM: Lightning's environment without its auto-requeue (SaveOnSignal requeues)
        plugins=[AtomicCheckpointIO(), *slurm_plugins()],
    )
    ckpt_path = None
    if resume is not None:
        print(f"{resume.note} at step {resume.step}", flush=True)
        ckpt_path, resume = resume.path, None  # drop the mapped contents before loading
    # weights_only: a checkpoint is data; a crafted pickle in one must not run code
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    if finish_preemption(trainer, output_dir) and in_local_sweep():
        raise SweepStopped(
            f"a signal stopped this arm at step {trainer.global_step} ({output_dir}); the sweep "
            "ends here and its later arms do not start. Resume this arm with its overrides and "
            f"hydra.run.dir={output_dir} ckpt_path=last"
        )
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if "val/loss" in metrics and trainer.is_global_zero:
        metrics["unigram_baseline"] = unigram_baseline(datamodule.folders()[0])
        print(
            f"val/loss {metrics['val/loss']:.4f} nats/token, unigram baseline "
            f"{metrics['unigram_baseline']:.4f}"
        )
    return metrics


def resume_point(
    cfg: DictConfig, output_dir: Path, identity: dict, holds_folder: bool
) -> ResumePoint | None:
    """The checkpoint this start resumes from (checked readable, and checked to be the same
    run), or None for a fresh start, which must not land among another start's checkpoints."""
    try:
        resume = resolve_ckpt_path(cfg.ckpt_path, output_dir)
        if resume is None and (resume := auto_resume_path(output_dir)):
            print("resuming a preempted / requeued run", flush=True)
    except (FileNotFoundError, UnreadableCheckpoint) as err:
        raise ConfigError(f"ckpt_path={cfg.ckpt_path}: {err}") from err
    if resume is None:
        if holds_folder:
            check_fresh_start(output_dir, overwrite=bool(cfg.get("overwrite", False)))
        return None
    try:
        allowed = check_resume(
            resume.contents, identity, cfg.get("allow_resume_changes") or [], resume.path
        )
    except ResumeMismatch as err:
        raise ConfigError(str(err)) from err
    if CHECKPOINT_KEY not in resume.contents:
        print(f"{resume.path} stores no run identity (an older checkpoint): not checked")
    for key, (old, new) in allowed.items():
        print(f"resuming with a change allowed by allow_resume_changes: {key}: {old!r} -> {new!r}")
    return resume


def check_fresh_start(output_dir: Path, overwrite: bool) -> None:
    """A fresh start into a folder that holds checkpoints would leave two runs' checkpoints
    side by side (and a later ckpt_path=last could pick the older): refused unless asked."""
    checkpoint_dir = output_dir / "checkpoints"
    found = existing_checkpoints(checkpoint_dir)
    if not found:
        return
    if not overwrite:
        raise ConfigError(
            f"run folder {output_dir} already has checkpoints ({', '.join(found)}): resume it "
            "with ckpt_path=last, pick another run_name, or start it over with overwrite=true "
            "(its checkpoints are deleted)"
        )
    for name in found:
        path = checkpoint_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    print(f"overwrite=true: deleted {', '.join(found)} from {checkpoint_dir}", flush=True)


class SweepStopped(Exception):
    """A signal stopped one arm of a local multirun: the arms after it must not start (the
    signal was meant for the whole process, not for one arm)."""


def in_local_sweep() -> bool:
    """A multirun whose arms run one after another in this process (Hydra's basic launcher);
    the SLURM launcher runs each arm as its own job, which a signal stops alone."""
    if not HydraConfig.initialized():
        return False
    hydra = HydraConfig.get()
    return hydra.mode == RunMode.MULTIRUN and hydra.launcher._target_.endswith(".BasicLauncher")


def finish_preemption(trainer: L.Trainer, output_dir: Path) -> bool:
    """Report this rank; a run that finished without being signalled drops its PREEMPTED marker.
    True when a signal stopped it."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(
        f"longctx: rank {trainer.global_rank}/{trainer.world_size} stopped at step "
        f"{trainer.global_step} on node {node}",
        flush=True,
    )
    signalled = any(getattr(c, "saved_path", None) for c in trainer.callbacks)
    if trainer.is_global_zero and not signalled:
        (output_dir / "checkpoints" / PREEMPTED_MARKER).unlink(missing_ok=True)
    return signalled


def main(cfg: DictConfig) -> float | None:
    try:
        metrics = run(cfg)
    except (ConfigError, RunFolderBusy) as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    except SweepStopped as err:
        print(f"longctx: {err}", file=sys.stderr, flush=True)
        raise SystemExit(0) from err  # a stop exits 0, as a single run's does
    finally:
        teardown()
    return metrics.get("val/loss")


def teardown() -> None:
    """Stop data-loader workers, finish the W&B run and destroy the process group (without it
    rank 1 aborts at exit)."""
    stop_data_workers()
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def stop_data_workers() -> None:
    """Kill data-loader workers still alive (a run stopped mid-epoch leaves its iterator's).
    They ignore SIGTERM (longctx.data.datamodule._worker_init), and multiprocessing's exit
    handler would SIGTERM them and then wait for them forever."""
    import multiprocessing

    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(timeout=30)
