"""Checks a composed config before anything is allocated, prepared or written.

Each rule has one owner (the model spec, the attention backend, context parallelism, SLURM, the
planner); preflight asks the owners and names the setting in the error.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from longctx import planner
from longctx.context_shard import check_context_parallel
from longctx.distributed.layout import ParallelConfig, world_size
from longctx.distributed.slurm import check_allocation, check_master_address
from longctx.errors import LongctxError
from longctx.model.attention import get_backend, resolve_backend
from longctx.model.interface import ModelSpec
from longctx.train.options import check_numbers, check_planner, unreached_stages

# keys that moved: an old command line gets the new name instead of a Hydra struct error
MOVED_KEYS = {
    "trainer.context_parallel": "parallel.context_parallel",
    "trainer.context_parallel_rounds": "parallel.context_parallel_rounds",
    "trainer.device_memory_gb": "planner.device_memory_gb",
}


# Lightning's own clipping and accumulation: the module optimizes manually (its step clips and
# accumulates, longctx.train.module), which Lightning refuses to combine with these
LONGCTX_OWNED_KEYS = {
    "trainer.gradient_clip_val": "optim.grad_clip",
    "trainer.gradient_clip_algorithm": "optim.grad_clip (the gradient norm)",
    "trainer.accumulate_grad_batches": "optim.accumulate_grad_batches",
}


class ConfigError(LongctxError):
    """A config value that cannot work; raised before anything is allocated."""


def moved_key_error(key: str, value) -> ConfigError:
    new = MOVED_KEYS[key]
    return ConfigError(f"{key} moved to {new} ({key}={value}); write {new}={value}")


def check_moved_overrides(overrides: Sequence[str]) -> None:
    """Refuse command-line overrides of keys that moved (before Hydra composes: its own error,
    a key not in struct, would not say where the key went)."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key in MOVED_KEYS:
            raise moved_key_error(key, value)


def check_moved_keys(cfg: DictConfig) -> None:
    """The same for a composed config (an experiment file or a ``+key=`` that sets one), and
    Lightning settings that longctx's training step does itself."""
    for key in MOVED_KEYS:
        if (value := OmegaConf.select(cfg, key)) is not None:
            raise moved_key_error(key, value)
    for key, own in LONGCTX_OWNED_KEYS.items():
        if (value := OmegaConf.select(cfg, key)) is not None:
            raise ConfigError(
                f"{key}={value}: longctx's training step does this itself (Lightning's cannot "
                f"run with it); set {own} instead"
            )


def instantiate_config(group: str, node: DictConfig):
    """A typed config from its group; a value its validation refuses is a ConfigError."""
    try:
        return instantiate(node)
    except (InstantiationException, InterpolationResolutionError) as err:
        # the class's own refusal, without Hydra's wrapping ("Error in call to target ...")
        refusal = err.__cause__ if isinstance(err.__cause__, ValueError) else err
        raise ConfigError(f"{group}: {refusal}") from err


def check_callbacks(cfg: DictConfig) -> None:
    """Each callback's constructor accepts its settings: one refuses a bad one (RulerEval's
    factor=0, say) here, named callbacks.<name>, not in a Hydra traceback once data is ready.
    The constructors only store and check their settings, so building them twice is free."""
    for name, node in (cfg.get("callbacks") or {}).items():
        if node is None:
            continue  # callbacks.<name>=null drops a default one
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(
                f"callbacks.{name} has no _target_ ({node}); expected "
                f"callbacks.{name}._target_=<a Lightning callback class>, or "
                f"callbacks.{name}=null to drop it"
            )
        callback = instantiate_config(f"callbacks.{name}", node)
        if not isinstance(callback, Callback):
            raise ConfigError(
                f"callbacks.{name}._target_={node._target_} is not a Lightning callback "
                f"({type(callback).__name__}); expected a lightning.pytorch.Callback"
            )


def training_device(trainer_cfg: DictConfig) -> torch.device:
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def trainer_world_size(trainer_cfg: DictConfig) -> int | None:
    return world_size(trainer_cfg.get("devices", 1), trainer_cfg.get("num_nodes", 1))


def check_devices(trainer_cfg: DictConfig, device: torch.device) -> None:
    devices = trainer_cfg.get("devices", 1)
    if world_size(devices, 1) is None:
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


def check_topology(trainer_cfg: DictConfig) -> None:
    """Nodes and tasks match the SLURM allocation; the ranks can meet at MASTER_ADDR."""
    try:
        check_allocation(int(trainer_cfg.get("num_nodes", 1)), trainer_cfg.get("devices", 1))
        check_master_address(trainer_world_size(trainer_cfg) or 1)
    except ValueError as err:  # a refusal, or int() of a node count that is no number
        raise ConfigError(str(err)) from err


def check_backend(
    model_config: ModelSpec,
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
    except LongctxError as err:
        raise ConfigError(f"{setting}={seq_len}: {err}") from err
    name = model_config.attn_backend
    try:
        backend = get_backend(resolve_backend(name, device))
        backend.check(device, seq_len, chunks=context_chunks, training=True)
        if context_balance is not None:
            backend.check_context_parallel(context_balance)
    except (LongctxError, RuntimeError) as err:
        raise ConfigError(f"model.attn_backend={name}, {setting}={seq_len}: {err}") from err


def check_parallel(
    trainer_cfg: DictConfig,
    model_config: ModelSpec,
    seq_len: int,
    parallel: ParallelConfig,
    setting: str = "data.seq_len",
) -> None:
    """parallel.context_parallel (ranks that split each row), its balancer and rounds can work
    with this world, sequence length (from ``setting``) and model."""
    size, rounds = parallel.context_parallel, parallel.context_parallel_rounds
    try:
        check_context_parallel(
            size,
            rounds,
            seq_len=seq_len if size > 1 else None,
            world=trainer_world_size(trainer_cfg),
            balance=parallel.context_parallel_balance,
        )
    except ValueError as err:  # a refusal, or int() of a node count that is no number
        raise ConfigError(
            f"{setting}={seq_len}, parallel.context_parallel={size}, "
            f"parallel.context_parallel_rounds={rounds}: {err}"
        ) from err
    if size > 1 and not model_config.supports_context_parallel:
        raise ConfigError(
            f"parallel.context_parallel={size}: only longctx's Llama (model=tiny/llama3_*) "
            "supports context parallelism; a Hugging Face model's attention cannot take a row "
            "split over ranks"
        )


def check_init_from(model_config: ModelSpec) -> None:
    """model.init_from names weights of this model's shapes (read later, by each rank)."""
    if not model_config.init_from:
        return
    from longctx.hf.weight_source import resolve

    try:
        source = resolve(model_config.init_from)
        source.check(model_config)
    except ValueError as err:  # a refusal, or a config.json that is no JSON
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


def check_memory(model_config: ModelSpec, trainer_cfg: DictConfig, device: torch.device) -> None:
    shards = (trainer_world_size(trainer_cfg) or 1) if sharded_strategy(trainer_cfg) else 1
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


def preflight(
    cfg: DictConfig, model_config: ModelSpec, data_config, parallel: ParallelConfig
) -> torch.device:
    """Every check that needs no data and no allocation; returns the training device."""
    check_moved_keys(cfg)
    try:
        check_numbers(cfg)
        check_planner(cfg)
    except LongctxError as err:
        raise ConfigError(str(err)) from err
    check_callbacks(cfg)
    for warning in unreached_stages(data_config.stages, cfg.trainer.get("max_steps")):
        print(warning, flush=True)
    device = training_device(cfg.trainer)
    if not cfg.dry_run:  # a dry run plans for the target machine, maybe not this one
        check_devices(cfg.trainer, device)
    check_topology(cfg.trainer)
    stages = [
        (f"data.stages[{i}].seq_len", s.seq_len) for i, s in enumerate(data_config.stages or [])
    ]
    for setting, seq_len in [*stages, ("data.seq_len", data_config.seq_len)]:
        check_parallel(cfg.trainer, model_config, seq_len, parallel, setting)
        balance = parallel.context_parallel_balance if parallel.context_parallel > 1 else None
        check_backend(model_config, seq_len, device, parallel.query_chunks, setting, balance)
    check_init_from(model_config)
    if not cfg.dry_run:
        check_memory(model_config, cfg.trainer, device)
    return device
