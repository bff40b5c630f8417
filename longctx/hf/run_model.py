"""A trained run's Llama as export and verify read it: its config from the checkpoint's record,
its weights from the checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from longctx.errors import LongctxError
from longctx.hf.weight_source import InitFromError, WeightSource, check_finite_weights, resolve
from longctx.model import Llama, LlamaConfig
from longctx.runs.record import StoredRun

EXPORT_RECORD = "longctx_export.json"  # written into every export: where it came from


@dataclasses.dataclass
class ExportRecord:
    """An export's longctx_export.json: the checkpoint it came from and its lengths."""

    checkpoint: Path
    trained_length: int
    max_position_embeddings: int


def read_export_record(folder: Path) -> ExportRecord:
    """The export's record, each field checked; one line naming the file and field otherwise."""
    path = folder / EXPORT_RECORD
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} has no {EXPORT_RECORD}; expected a folder written by longctx.hf.export"
        )
    try:
        record = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as err:
        raise LongctxError(
            f"{path} cannot be read as JSON ({err}); re-export the checkpoint"
        ) from None
    kinds = {"checkpoint": str, "trained_length": int, "max_position_embeddings": int}
    for key, kind in kinds.items():
        value = record.get(key) if isinstance(record, dict) else None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise LongctxError(
                f"{path} has no valid {key!r} ({value!r}); expected a {kind.__name__} as "
                "longctx.hf.export writes it (re-export the checkpoint)"
            )
    if record["max_position_embeddings"] < 2:
        raise LongctxError(f"{path}: max_position_embeddings={record['max_position_embeddings']}; "
                         "expected at least 2 (re-export the checkpoint)")  # fmt: skip
    return ExportRecord(Path(record["checkpoint"]), record["trained_length"],
                        record["max_position_embeddings"])  # fmt: skip


def llama_config(stored: StoredRun) -> LlamaConfig:
    """The run's model config from its checkpoint's record; only longctx's Llama exports."""
    config = stored.model_config()
    if not config.exports_to_hf:
        raise LongctxError(
            f"{stored.checkpoint} was trained with {type(config).__name__}, not longctx's Llama; "
            "a model=hf run's weights are already a transformers model"
        )
    return config


def weights_source(checkpoint: Path, config: LlamaConfig) -> WeightSource:
    """``checkpoint``'s weights, their names and shapes (from its index or header: nothing
    is loaded) checked against the record's model config, so a record that disagrees with its
    tensors is refused before a model is allocated."""
    try:
        source = resolve(checkpoint)
        source.check(config)
    except InitFromError as err:
        detail = str(err).split(": ", 1)[-1]
        raise LongctxError(
            f"{checkpoint}: its run record's model config does not fit its weights ({detail}); "
            "expected a checkpoint and record written together by train.py"
        ) from None
    return source


def read_model(checkpoint: Path, config: LlamaConfig) -> Llama:
    """longctx's Llama with ``checkpoint``'s weights, on the CPU in fp32; weights with a NaN or
    inf are refused."""
    config = dataclasses.replace(config, init_from=str(checkpoint))
    source = weights_source(checkpoint, config)  # before anything is allocated
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device="cpu")
    source.load_into(model)
    check_finite_weights(model, f"checkpoint {checkpoint}")  # never exported as a model
    return model.eval()
