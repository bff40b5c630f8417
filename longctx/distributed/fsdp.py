"""FSDP2: ``fully_shard`` per transformer block, then the root, through Lightning's
ModelParallelStrategy (which, unlike ``strategy='fsdp'``, also runs on CPU with gloo).

:class:`FSDP2Strategy` carries the sharding settings (mixed precision,
reshard-after-forward) so a Hydra trainer file can hold them; the
LightningModule's ``configure_model`` calls :func:`apply_fsdp` with them. Checkpoints are
distributed (a folder, one shard file per rank, loadable on another world size) and written
atomically: into a temporary sibling folder first, then renamed into place.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from longctx.distributed.sharded import load_sharded
from longctx.dtypes import dtype_named
from longctx.errors import LongctxError

# loss / token_loss: training and validation; labelled_logits: teacher-forced scoring; prefill /
# decode: generation from the KV cache
FORWARD_METHODS = ("loss", "token_loss", "labelled_logits", "prefill", "decode")
SHARDED_META_FILE = "meta.pt"  # Lightning's: a sharded checkpoint's non-tensor state


def parse_dtype(name: str | None, device: torch.device, what: str) -> torch.dtype | None:
    """ "auto": bf16 on CUDA, fp32 elsewhere; None keeps the parameter dtype."""
    if name is None:
        return None
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype_named(name, what)


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: the first ModuleList named ``layers`` (Llama: model.layers;
    a Hugging Face model: ...model.layers)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(module, nn.ModuleList):
            return module
    raise ValueError(
        f"{type(model).__name__} has no nn.ModuleList named 'layers': FSDP2 shards per "
        "transformer block and cannot find the blocks"
    )


def apply_fsdp(
    model: nn.Module,
    mesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard every transformer block, then the root, in place (parameter names unchanged).
    Activation checkpointing is the model's (``model.activation_checkpointing``): one switch."""
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if mesh.ndim > 1:
        # Lightning's ModelParallelStrategy mesh is (data_parallel, tensor_parallel); a 2-D
        # mesh would make fully_shard replicate over the first dim and shard over the second
        # (HSDP), i.e. over tensor_parallel = 1: every rank would hold every parameter
        mesh = mesh["data_parallel"]
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        # the last block's parameters are needed at once by backward: keep them gathered
        last = i == len(blocks) - 1
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward and not last,
        )
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # the module calls model.loss / model.token_loss, not forward: FSDP's root hooks (which
    # gather the embedding, final norm and output) must run around those methods too
    for method in FORWARD_METHODS:
        if callable(getattr(model, method, None)):
            register_fsdp_forward_method(model, method)
    return model


class FSDP2Strategy(ModelParallelStrategy):
    """ModelParallelStrategy for pure data-parallel FSDP2 (tensor_parallel_size 1).

    data_parallel_size "auto" is every process of every node (Lightning's own "auto" is the
    node count, which assumes tensor parallelism inside a node).
    """

    def __init__(
        self,
        *,
        param_dtype: str | None = "auto",
        reduce_dtype: str | None = "float32",
        reshard_after_forward: bool = True,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        if tensor_parallel_size != 1:
            raise LongctxError(
                f"FSDP2Strategy: tensor_parallel_size={tensor_parallel_size}; only 1 (pure "
                "data parallel FSDP) is implemented"
            )
        for what, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            parse_dtype(value, torch.device("cpu"), f"strategy.{what}")  # fail fast on a typo
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1, **kwargs)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def shard(self, model: nn.Module) -> nn.Module:
        device = self.root_device
        return apply_fsdp(
            model,
            self.device_mesh,
            param_dtype=parse_dtype(self.param_dtype, device, "strategy.param_dtype"),
            reduce_dtype=parse_dtype(self.reduce_dtype, device, "strategy.reduce_dtype"),
            reshard_after_forward=self.reshard_after_forward,
        )

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Every rank writes its shard into a temporary folder; rank 0 then swaps it in."""
        final = Path(self.broadcast(str(filepath)))
        tmp = final.with_name(f".{final.name}.{self.broadcast(uuid.uuid4().hex[:8])}.tmp")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("longctx_fsdp_checkpoint_written")
        if self.global_rank == 0:
            swap_into_place(tmp, final)
        self.barrier("longctx_fsdp_checkpoint_renamed")

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """A sharded folder read as data (:func:`load_training_state`); a single-file
        checkpoint as Lightning reads it (``trainer.fit(weights_only=True)``)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if not path.is_dir():
            return super().load_checkpoint(path, weights_only)
        strict = self.lightning_module.strict_loading
        return load_training_state(path, self.model, self.optimizers, strict)


def load_training_state(folder: Path, module: nn.Module, optimizers, strict: bool) -> dict:
    """What Lightning's ModelParallelStrategy.load_checkpoint does for a sharded folder, with the
    folder read as data: torch's reader would unpickle its index, and its planner load non-tensor
    items (optimizer param_groups), with plain pickle (longctx.distributed.sharded). The
    module's and optimizers' states are loaded in place; the rest (meta.pt, weights-only) is
    returned."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model_state = {"state_dict": get_model_state_dict(module)}  # the keys Lightning saves
    load_sharded(model_state, folder)
    module.load_state_dict(model_state["state_dict"], strict=strict)
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        load_sharded(optimizer_state, folder)
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(
            module, optimizer, optim_state_dict=optimizer_state[key], options=options
        )
    return torch.load(folder / SHARDED_META_FILE, weights_only=True)


def swap_into_place(tmp: Path, final: Path) -> None:
    """Rename a finished checkpoint (file or folder) to ``final``, replacing an older one.

    A folder cannot be renamed over a folder, so the old one moves aside to ``final.old`` first;
    between the two renames a resume finds ``final.old`` (see longctx.runs.checkpoints).
    """
    old = final.with_name(final.name + ".old")
    if old.exists():
        remove(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        remove(old)


def remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()
