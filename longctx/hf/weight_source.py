"""Weight sources: a transformers folder or a longctx checkpoint, resolved, checked against a
model config and read into a model (``model.init_from``, export, verify, eval).

A source is one of
- a transformers folder: config.json + model.safetensors, or shards with their index;
- a longctx checkpoint: a ``.ckpt`` file, a sharded FSDP checkpoint folder, or a run folder
  (its checkpoints/last.ckpt).

A model config must have the source's shapes: a mismatch names the field or tensor and both
values. RoPE settings are the run's own (changing them is how a context is extended); a
difference from a transformers source is reported, not refused.

Loading goes through torch.distributed.checkpoint where the source allows it, so under FSDP2
every rank reads only the slices of its own shards (safetensors and DCP shards are read by
offset); a single-file ``.ckpt`` is memory-mapped and each rank copies out its slices.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from longctx.distributed.sharded import (
    METADATA_FILE,
    SafeLoadPlanner,
    UnreadableShardedCheckpoint,
    UnsafeShardedCheckpoint,
    load_sharded,
    read_dcp_metadata,
)
from longctx.errors import LongctxError
from longctx.hf.checkpoint import config_from_hf, to_hf_name
from longctx.hf.folders import CONFIG_FILE, read_config_json
from longctx.model.config import LlamaConfig
from longctx.model.interface import check_weights
from longctx.model.llama import Llama
from longctx.runs.folder import is_run_folder
from longctx.runs.record import checkpoint_in

# fields that fix the tensors' shapes or the function the weights compute
ARCHITECTURE_FIELDS = (
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "tie_embeddings",
    "norm_eps",
)
LONGCTX_PREFIX = "model."  # LongCtxModule.model's parameters in a Lightning state_dict
LLAMA_MODULES = {"tok_embeddings", "layers", "norm", "output"}  # Llama's top-level children


class InitFromError(LongctxError):
    """model.init_from names something that cannot initialise this model."""


@dataclasses.dataclass
class WeightSource:
    """A resolved ``init_from`` path: its kind, its tensors' shapes (longctx names) and, for a
    transformers folder, the LlamaConfig its config.json states."""

    path: Path
    kind: str  # "transformers", "longctx" (a .ckpt file) or "longctx-sharded"
    shapes: dict[str, torch.Size]
    their_config: LlamaConfig | None = None

    def check(self, config: LlamaConfig) -> None:
        """Refuse a model config whose architecture or tensor shapes differ from the source's."""
        if self.their_config is not None:
            _check_fields(config, self.their_config, self.path)
        _check_shapes(_meta_state(config), self.shapes, self.path)

    def rope_change(self, config: LlamaConfig) -> str | None:
        """A line saying how this run's RoPE differs from a transformers source's, if it does."""
        theirs = self.their_config
        if theirs is None:
            return None
        if (theirs.rope_theta, theirs.rope_scaling) == (config.rope_theta, config.rope_scaling):
            return None
        return (
            f"model.init_from: {self.path} was trained with rope_theta={theirs.rope_theta}, "
            f"rope_scaling={theirs.rope_scaling}; this run uses rope_theta={config.rope_theta}, "
            f"rope_scaling={config.rope_scaling}"
        )

    def load_into(self, model: nn.Module) -> None:
        """Copy the source's weights into ``model`` (plain or FSDP2-sharded), this rank's part."""
        self.check(model.config)
        state = model.state_dict()  # FSDP2: sharded DTensors that share the parameters' storage
        if self.kind == "transformers":
            # each rank reads the slices its (sharded) tensors hold, in the model's dtype; without
            # a process group, a plain load. The planner is the one that never unpickles.
            hf_state = {to_hf_name(k): v for k, v in state.items()}
            dcp.load(hf_state, storage_reader=_hf_reader(self.path), planner=SafeLoadPlanner())
        elif self.kind == "longctx-sharded":
            nested = {"state_dict": {LONGCTX_PREFIX + k: v for k, v in state.items()}}
            load_sharded(nested, self.path)  # its index and items read as data
        else:
            _copy_slices(state, read_longctx_checkpoint(self.path))


def resolve(path: str | Path) -> WeightSource:
    """The weight source at ``path``, or an InitFromError saying what was expected there."""
    p = Path(path).expanduser()
    expected = (
        "expected a transformers folder (config.json + safetensors) or a longctx checkpoint "
        "(a .ckpt file, a sharded checkpoint folder or a run folder)"
    )
    if not p.exists():
        raise InitFromError(f"model.init_from={str(path)!r} does not exist; {expected}")
    if p.is_dir() and (p / CONFIG_FILE).is_file():
        return _transformers_source(p)
    if is_run_folder(p):
        try:
            found = checkpoint_in(p)
        except FileNotFoundError as err:  # a run folder without its last checkpoint
            raise InitFromError(f"model.init_from: {err}") from err
        return resolve(found)
    if p.is_dir() and (p / METADATA_FILE).is_file():
        return WeightSource(p, "longctx-sharded", _sharded_shapes(p))
    if p.is_file():
        return WeightSource(
            p, "longctx", {k: v.shape for k, v in read_longctx_checkpoint(p).items()}
        )
    raise InitFromError(f"model.init_from={str(path)!r} is not a checkpoint; {expected}")


def load_hf(path: str | Path, **overrides: Any) -> Llama:
    """longctx's Llama from a local HF Llama folder (config.json + safetensors, maybe sharded),
    read as ``model.init_from`` reads one; weights are copied in the model's fp32.
    ``overrides`` replace config fields."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise LongctxError(f"{path} has no {CONFIG_FILE}; expected a Hugging Face model folder")
    config = config_from_hf(read_config_json(path), **overrides)
    with torch.device("meta"):  # no random init of weights that are about to be overwritten
        model = Llama(config)
    model.to_empty(device="cpu")
    resolve(path).load_into(model)
    return model


def read_longctx_checkpoint(path: Path) -> dict[str, Tensor]:
    """The Llama weights (longctx names) of a single-file longctx checkpoint, memory-mapped:
    the one place a longctx .ckpt is read for init_from."""
    if path.stat().st_size == 0:
        raise InitFromError(
            f"model.init_from={str(path)!r} is empty (0 bytes): a checkpoint whose write never "
            f"finished; pass another checkpoint of that run ({_other_checkpoints(path)})"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # a text file, a truncated file, another format, a crafted pickle
        raise InitFromError(
            f"model.init_from={str(path)!r} is not a checkpoint torch can read ({err}); expected "
            "a longctx .ckpt file"
        ) from err
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise InitFromError(
            f"model.init_from={str(path)!r} has no 'state_dict'; expected a longctx (Lightning) "
            "checkpoint"
        )
    return _strip_prefix(state, path)


def _transformers_source(path: Path) -> WeightSource:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InitFromError(
            f"model.init_from={str(path)!r} has a config.json but no *.safetensors weights"
        )
    try:
        theirs = config_from_hf(read_config_json(path))  # refuses what longctx cannot hold
    except LongctxError as err:
        raise InitFromError(f"model.init_from={str(path)!r}: {err}") from err
    from_hf = {to_hf_name(k): k for k in _meta_state(theirs)}
    shapes = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    shapes[from_hf.get(key, key)] = torch.Size(f.get_slice(key).get_shape())
        except Exception as err:  # a truncated or corrupt file: safetensors does not name it
            raise InitFromError(
                f"model.init_from={str(path)!r}: {file.name} cannot be read as safetensors "
                f"({type(err).__name__}: {err}); expected a complete .safetensors file (a copy "
                "that stopped part-way is truncated)"
            ) from err
    if theirs.tie_embeddings:
        shapes.pop("lm_head.weight", None)  # a tied copy some writers keep
    return WeightSource(path, "transformers", shapes, theirs)


def _other_checkpoints(path: Path) -> str:
    others = sorted(p.name for p in path.parent.glob("*.ckpt") if p != path and p.stat().st_size)
    return f"e.g. {', '.join(others)} in {path.parent}" if others else f"none in {path.parent}"


def _sharded_shapes(path: Path) -> dict[str, torch.Size]:
    try:
        metadata = read_dcp_metadata(path).state_dict_metadata  # data: a restricted unpickler
    except (UnsafeShardedCheckpoint, UnreadableShardedCheckpoint) as err:
        raise InitFromError(f"model.init_from={str(path)!r}: {err}") from err
    prefix = "state_dict."
    tensors = {
        k.removeprefix(prefix): m.size
        for k, m in metadata.items()
        if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }
    return {k: torch.Size(v) for k, v in _strip_prefix(tensors, path).items()}


def _strip_prefix(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """Llama names from a LongCtxModule state dict; anything else (a model=hf run's
    ``model.hf_model.*``, another program's checkpoint) is not longctx's Llama."""
    tops = {k.removeprefix(LONGCTX_PREFIX).split(".", 1)[0] for k in state}
    llama = all(k.startswith(LONGCTX_PREFIX) for k in state) and tops <= LLAMA_MODULES
    if not state or not llama:
        sample = sorted(state)[:3]
        raise InitFromError(
            f"model.init_from={str(path)!r} holds weights {sample}...; expected longctx's Llama "
            f"(names starting {LONGCTX_PREFIX!r})"
        )
    return {k.removeprefix(LONGCTX_PREFIX): v for k, v in state.items()}


def _meta_state(config: LlamaConfig) -> dict[str, Tensor]:
    with torch.device("meta"):
        return Llama(config).state_dict()


def _check_fields(config: LlamaConfig, theirs: LlamaConfig, path: Path) -> None:
    differ = [
        f"{f}: model {getattr(config, f)} vs checkpoint {getattr(theirs, f)}"
        for f in ARCHITECTURE_FIELDS
        if getattr(config, f) != getattr(theirs, f)
    ]
    if differ:
        raise InitFromError(
            f"model.init_from={str(path)!r} does not match the model config: "
            + "; ".join(differ)
            + ". Pick the preset of that checkpoint or override those fields (model.<field>=...)"
        )


def _check_shapes(expected: dict[str, Tensor], found: dict[str, torch.Size], path) -> None:
    """The names and shapes, compared as the model interface compares any checkpoint's."""
    with torch.device("meta"):
        found_meta = {k: torch.empty(shape) for k, shape in found.items()}
    try:
        check_weights(expected, found_meta)
    except LongctxError as err:
        raise InitFromError(f"model.init_from={str(path)!r}: {err}") from None


def _hf_reader(path: Path) -> HuggingFaceStorageReader:
    return HuggingFaceStorageReader(str(path))


def _copy_slices(state: dict[str, Tensor], source: dict[str, Tensor]) -> None:
    """Copy memory-mapped full tensors into the model's, this rank's slice of a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, target in state.items():
            full = source[name]
            if isinstance(target, DTensor):
                # src_data_rank=None: no broadcast, every rank slices its own chunk
                mesh, placements = target.device_mesh, target.placements
                full = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
                target = target.to_local()
            target.copy_(full)


def check_finite_weights(model: nn.Module, source: str) -> None:
    """Refuse weights with NaN or inf, naming ``source`` and the tensors: they would train to a
    NaN model, or score and export one as if it were a model. The one check of every path that
    loads weights (init_from, eval of a checkpoint or an --hf folder, export). Under FSDP2 each
    rank checks its own shards and every rank learns of any rank's finding, so all stop
    together."""
    bad = [name for name, t in model.state_dict().items() if not _all_finite(t)]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        found: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(found, bad)
        bad = sorted({name for names in found for name in names})
    if bad:
        listed = ", ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
        raise InitFromError(
            f"{source} holds NaN or infinite values in {listed}; expected "
            "finite weights (a run that diverged, or a damaged file)"
        )


def _all_finite(tensor: Tensor) -> bool:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # an FSDP2 shard
    return bool(torch.isfinite(local).all()) if local.is_floating_point() else True
