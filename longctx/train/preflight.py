"""Checks a composed config before anything is allocated, prepared or written.

Each rule has one owner (the model spec, the attention backend, context parallelism, SLURM, the
planner); preflight asks the owners and names the setting in the error. What no owner sees is
checked here, on the config as resolved: a non-finite float anywhere (an optimizer's lr, a
callback's setting that is handed to a constructor untyped), a number of another kind than its
target's parameter takes, and settings that only make sense together (the stages and
``trainer.max_steps``; ``model.init_from`` and a resumed checkpoint).
"""

from __future__ import annotations

import math
import os
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from hydra._internal.utils import _locate
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from longctx import planner
from longctx.context_shard import check_context_parallel
from longctx.distributed.layout import ParallelConfig, world_size
from longctx.distributed.slurm import check_allocation, check_master_address
from longctx.errors import LongctxError
from longctx.model.attention import get_backend, resolve_backend
from longctx.model.interface import ModelSpec

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


def config_nodes(node: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, node) of every node of a plain config tree, each before what it holds."""
    yield key, node
    if isinstance(node, dict):
        for name, value in node.items():
            yield from config_nodes(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from config_nodes(value, f"{key}[{i}]")


def non_finite_options(tree: Any) -> Iterator[tuple[str, float]]:
    """(dotted key, value) of every NaN or infinite float in a plain config tree (a resolved
    one: what an interpolation such as ``${oc.decode:"inf"}`` gives is checked as typed)."""
    for key, node in config_nodes(tree):
        if isinstance(node, float) and not math.isfinite(node):
            yield key, node


def mistyped_options(tree: Any) -> Iterator[str]:
    """What is wrong with each ``_target_`` node of a plain config tree: a target that cannot be
    imported, or a number of the wrong kind for what the target takes (``1.5`` where its
    parameter is an int, ``'inf'`` where it is a float), by the target's own type hints."""
    for key, node in config_nodes(tree):
        if isinstance(node, dict) and "_target_" in node:
            yield from target_mismatches(node, f"{key}." if key else "")


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
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    arms = set(typing.get_args(hint)) if union else {hint}
    if value is None and type(None) in arms:
        return None
    arms -= {type(None), torch.Tensor}  # a config holds no tensor (torch's optimizers take one)
    # 1 == True: a count where a switch belongs passes ``in (True, False)``, and a switch
    # where a count belongs passes isinstance(value, int)
    switch = isinstance(value, bool)
    if arms == {bool}:
        return None if switch else "true or false"
    if arms == {int}:
        return None if isinstance(value, int) and not switch else "an int"
    if arms and arms <= {int, float}:
        return None if isinstance(value, int | float) and not switch else "a number"
    if len(arms) == 1 and isinstance(value, list):
        (arm,) = arms
        if typing.get_origin(arm) in (list, tuple, Sequence) and typing.get_args(arm):
            item = typing.get_args(arm)[0]
            wrong = next((e for v in value if (e := number_expected(v, item))), None)
            return wrong and f"a list whose every entry is {wrong}"
    return None


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
