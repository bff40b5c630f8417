"""``dry_run=true``: the capacity plan of a composed config; nothing is allocated."""

from __future__ import annotations

from dataclasses import asdict

import torch
from omegaconf import DictConfig

from longctx import planner
from longctx.data import DataConfig
from longctx.data.tokenizer import TOKENIZER_IDS
from longctx.distributed.layout import ParallelConfig
from longctx.model.attention import resolve_backend
from longctx.model.interface import ModelSpec
from longctx.planner.dp_balance import expected_dp_balance, format_dp_balance
from longctx.train.optim_config import OptimConfig
from longctx.train.preflight import (
    ConfigError,
    available_memory_bytes,
    check_planner,
    sharded_strategy,
)

# trainer.precision -> the planner's precision (one of longctx.planner.settings.PRECISIONS)
TRAINER_PRECISIONS = {
    "32-true": "fp32",
    "32": "fp32",
    "bf16-mixed": "bf16-mixed",
    "bf16-true": "bf16",
}


def dry_run_report(
    model_config: ModelSpec,
    data_config: DataConfig,
    optim: OptimConfig,
    parallel: ParallelConfig,
    cfg: DictConfig,
    device: torch.device,
) -> dict:
    """``cfg``: the composed config, for what no typed config holds: the trainer (Lightning's
    keys), the planner group and peak_flops_per_device."""
    params = model_config.num_params()
    report = {
        "parameters": params,
        "training_memory_gib_per_device": planner.training_state_bytes(params) / 2**30,
        "model": asdict(model_config),
        "seq_len": data_config.seq_len,
    }
    print(
        f"dry run: {params:,} parameters, about {report['training_memory_gib_per_device']:,.1f} "
        f"GiB for weights, gradients and AdamW state; nothing allocated"
    )
    print(vocabulary_line(model_config.vocab_size, data_config.tokenizer))
    if not model_config.plans_capacity:
        print("capacity plan: covers longctx's Llama (model=tiny/llama3_*) only")
        return report
    settings = check_planner(cfg)
    if settings.device:  # planning for named GPUs, maybe from a machine without them
        device = torch.device("cuda")
    try:
        capacity = planner.plan(
            model_config,
            planner_layout(
                cfg.trainer, settings, model_config, data_config, optim, parallel, device
            ),
            planner_device(cfg, settings, device),
            mfu=settings.mfu,
        )
    except planner.PlanError as err:
        raise ConfigError(str(err)) from err
    print(planner.format_plan(capacity))
    plan = planner.plan_dict(capacity)
    balance = expected_dp_balance(model_config, capacity, data_config.dp_balance)
    if balance is not None:
        print(format_dp_balance(balance))
        plan["dp_balance"] = asdict(balance) | {"speedup": balance.speedup}
    return report | {"plan": plan}


def vocabulary_line(vocab_size: int, tokenizer: str | None) -> str:
    """The vocabulary the plan is made with (its embeddings, output projection and loss chunks);
    a named tokenizer (data.tokenizer) with more ids than the model holds is refused."""
    ids = TOKENIZER_IDS.get(tokenizer)
    if ids is not None and ids > vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab_size}: data.tokenizer={tokenizer} has {ids:,} ids; "
            "expected a model vocabulary >= the tokenizer's (e.g. model=tiny_llama3 or llama3_*)"
        )
    named = f" (data.tokenizer={tokenizer}: {ids:,} ids)" if ids is not None else ""
    return f"vocabulary: {vocab_size:,} ids{named}"


def planner_layout(
    trainer_cfg: DictConfig,
    settings: planner.PlannerSettings,
    model_config: ModelSpec,
    data_config: DataConfig,
    optim: OptimConfig,
    parallel: ParallelConfig,
    device: torch.device,
) -> planner.RunLayout:
    """The run's layout as the planner sees it (one document per row, the worst case, unless
    planner.doc_length_median states a distribution)."""
    fsdp = sharded_strategy(trainer_cfg)
    devices = trainer_cfg.get("devices", 1)
    median, sigma = settings.doc_length_median, settings.doc_length_sigma
    lognormal = None if median is None else (float(median), float(sigma))
    return planner.RunLayout(
        seq_len=data_config.seq_len,
        micro_batch_size=data_config.micro_batch_size,
        num_nodes=int(trainer_cfg.get("num_nodes", 1)),
        devices=devices if isinstance(devices, int) else 1,
        context_parallel=parallel.context_parallel,
        context_parallel_rounds=parallel.context_parallel_rounds,
        context_parallel_balance=parallel.context_parallel_balance,
        fsdp=fsdp,
        precision=planner_precision(trainer_cfg, fsdp, device),
        activation_checkpointing=model_config.activation_checkpointing,
        attn_backend=resolve_backend(model_config.attn_backend, device),
        accumulate_grad_batches=optim.accumulate_grad_batches,
        max_steps=trainer_cfg.max_steps,
        doc_length_lognormal=lognormal,
    )


def planner_precision(trainer_cfg: DictConfig, fsdp: bool, device: torch.device) -> str:
    if fsdp:  # FSDP2's mixed-precision policy casts; Lightning's precision stays 32-true
        name = trainer_cfg.strategy.get("param_dtype", "auto")
        bf16 = name == "bfloat16" or (name == "auto" and device.type == "cuda")
        return "bf16" if bf16 else "fp32"
    precision = str(trainer_cfg.get("precision", "32-true"))
    if precision not in TRAINER_PRECISIONS:
        raise ConfigError(
            f"trainer.precision={precision}: the capacity plan knows {sorted(TRAINER_PRECISIONS)}"
        )
    return TRAINER_PRECISIONS[precision]


def planner_device(
    cfg: DictConfig, settings: planner.PlannerSettings, device: torch.device
) -> planner.Device:
    """planner.device names a known accelerator (else the visible GPU's name); the keys
    planner.device_memory_gb and peak_flops_per_device override or supply its numbers."""
    memory_gb, peak = settings.device_memory_gb, cfg.get("peak_flops_per_device")
    bandwidths = {
        "intra_node_bytes_per_s": settings.intra_node_gb_per_s * 1e9,
        "inter_node_bytes_per_s": settings.inter_node_gb_per_s * 1e9,
    }
    if device.type == "cpu":
        memory = memory_gb * 1e9 if memory_gb else available_memory_bytes(device)
        rss = planner.process_rss_bytes()
        note = "this process's RSS (Python, torch, the app's imports), measured"
        # train.py keeps freed heap blocks on CPU (retain_freed_memory): plan with their excess
        retention = planner.CPU_HEAP_RETENTION
        return planner.Device(
            "cpu", int(memory), peak, rss, note, **bandwidths, heap_retention=retention
        )
    name = settings.device or (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    if name is not None and (memory_gb is None or peak is None):
        known = planner.known_device(name)
        memory_gb = memory_gb or known.memory_bytes / 1e9
        peak = peak or known.peak_flops
    for key, value in (("planner.device_memory_gb", memory_gb), ("peak_flops_per_device", peak)):
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
