"""Sharded (torch.distributed.checkpoint) folders, read as data.

A sharded folder's index, ``.metadata``, is a pickle, and torch's ``FileSystemReader`` loads it
with ``pickle.load``; its ``DefaultLoadPlanner`` loads every non-tensor item (an optimizer's
``param_groups``, a step count) with ``torch.load(weights_only=False)``. Either would run the code
a crafted folder names. So every sharded folder longctx reads (``model.init_from``, export,
verify, eval, a resume under ``trainer=fsdp``) goes through this module:

- :func:`read_dcp_metadata` unpickles ``.metadata`` admitting only the globals a
  distributed-checkpoint index holds (:data:`ALLOWED_GLOBALS`: its metadata classes,
  ``torch.Size``, dtypes, layouts and memory formats, a ``pathlib`` path), the way
  ``weights_only`` admits only tensors, lets a BUILD fill in only a fresh instance of those
  metadata dataclasses (never set attributes on a class or any other object), and checks what it
  got: a ``Metadata`` whose storage entries name files inside the folder (``..`` and symlinks
  resolved with ``os.path.realpath``);
- :class:`SafeFileSystemReader` reads metadata that way, and :class:`SafeLoadPlanner` loads
  non-tensor items with ``weights_only=True``; :func:`load_sharded` is ``dcp.load`` with both.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from longctx.errors import LongctxError

METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's index file in a sharded folder

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# (module, name) of every global a distributed-checkpoint index may reference: what torch 2.13's
# dcp.save pickles (checked against real FSDP2 saves in tests/unit/test_files_are_data.py).
# Each is a plain dataclass, an enum, a tuple subclass or a constant: calling one with any
# arguments builds a value and runs nothing else.
ALLOWED_GLOBALS = frozenset(
    {
        (_METADATA_MODULE, "Metadata"),
        (_METADATA_MODULE, "StorageMeta"),
        (_METADATA_MODULE, "TensorStorageMetadata"),
        (_METADATA_MODULE, "BytesStorageMetadata"),
        (_METADATA_MODULE, "ChunkStorageMetadata"),
        (_METADATA_MODULE, "TensorProperties"),
        (_METADATA_MODULE, "MetadataIndex"),
        (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # a layout by name, from a fixed table
        ("torch", "Size"),
        # StorageMeta.checkpoint_id when dcp.save was given a Path (the module moved in 3.13)
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "PurePosixPath"),
    }
)
# torch constants referenced by name: every dtype, layout and memory format
_TORCH_CONSTANT_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeShardedCheckpoint(LongctxError):
    """A sharded checkpoint folder whose index is not plain distributed-checkpoint metadata."""


class UnreadableShardedCheckpoint(LongctxError):
    """A sharded checkpoint folder whose index or data is missing, empty or truncated."""


# The classes whose instances a BUILD may fill in (what pickle does after NEWOBJ for a dataclass):
# torch's dataclasses, each given its fields as a dict; TensorProperties its own 5-tuple state.
_BUILT_CLASSES = (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    MetadataIndex,
    _StorageInfo,
)


class _MetadataUnpickler(pickle._Unpickler):  # the Python one: its opcodes can be overridden
    """pickle's Unpickler that resolves only :data:`ALLOWED_GLOBALS` and torch constants, and
    whose BUILD fills in only a fresh instance of a distributed-checkpoint dataclass with its own
    fields. pickle's BUILD would otherwise ``setattr`` anything on any object on the stack, a
    class included (a BUILD on ``PurePosixPath`` once rewrote ``parts`` for the whole process)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, folder: Path) -> None:
        super().__init__(file)
        self.folder = folder

    def refuse(self, what: str) -> UnsafeShardedCheckpoint:
        return UnsafeShardedCheckpoint(
            f"sharded checkpoint {self.folder} is refused: its {METADATA_FILE} {what}; pass a "
            "checkpoint folder written by longctx (torch.distributed.checkpoint)"
        )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANT_TYPES):
            return getattr(torch, name)
        raise self.refuse(
            f"names {module}.{name}, which is not distributed-checkpoint metadata (unpickling "
            "it could run code)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise self.refuse("holds a persistent id, which distributed-checkpoint metadata never does")

    def load_build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        kind = type(target)
        if kind not in _BUILT_CLASSES:
            raise self.refuse(f"sets attributes on {kind.__name__} {target!r:.80}, not on metadata")
        if kind is TensorProperties:
            if not (isinstance(state, tuple) and len(state) == 5):
                raise self.refuse("has TensorProperties whose state is not its 5 fields")
            target.__setstate__(state)  # torch's own: assigns its five fields
            return
        fields = {f.name for f in dataclasses.fields(kind)}
        if not isinstance(state, dict) or not set(state) <= fields:
            raise self.refuse(f"sets {kind.__name__} fields other than its own ({sorted(fields)})")
        target.__dict__.update(state)  # as pickle does (MetadataIndex is frozen)

    dispatch[pickle.BUILD[0]] = load_build


def read_dcp_metadata(folder: str | os.PathLike, name: str = METADATA_FILE) -> Metadata:
    """The index of the sharded folder, unpickled as data and checked (see the module
    docstring); an UnsafeShardedCheckpoint, one line naming the folder, otherwise."""
    folder = Path(folder)
    path = folder / name
    if not path.is_file():
        raise UnreadableShardedCheckpoint(
            f"sharded checkpoint {folder} has no {name} (a write that never finished?); "
            "expected a folder written by torch.distributed.checkpoint"
        )
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, folder).load()
    except UnsafeShardedCheckpoint:
        raise
    except Exception as err:  # empty, truncated, not a pickle, a class given wrong arguments
        raise UnreadableShardedCheckpoint(
            f"sharded checkpoint {folder}: {name} cannot be read as distributed-checkpoint "
            f"metadata ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
        ) from None
    _check_metadata(metadata, folder)
    return metadata


def _check_metadata(metadata: Any, folder: Path) -> None:
    """What the unpickler built is a Metadata whose entries are what dcp.load expects, and
    whose storage entries name files inside ``folder``."""

    def refuse(what: str) -> UnsafeShardedCheckpoint:
        return UnsafeShardedCheckpoint(
            f"sharded checkpoint {folder} is refused: its {METADATA_FILE} {what}; pass a "
            "checkpoint folder written by longctx (torch.distributed.checkpoint)"
        )

    if not isinstance(metadata, Metadata):
        raise refuse(f"holds a {type(metadata).__name__}, not a Metadata")
    entries = metadata.state_dict_metadata
    kinds = (TensorStorageMetadata, BytesStorageMetadata)
    if not isinstance(entries, dict) or not all(
        isinstance(k, str) and isinstance(v, kinds) for k, v in entries.items()
    ):
        raise refuse("has state_dict_metadata that is not names -> tensor or bytes entries")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise refuse(f"has storage_data of type {type(storage).__name__}")
    for index, info in storage.items():
        relative = getattr(info, "relative_path", None)
        if type(index) is not MetadataIndex or type(relative) is not str:
            raise refuse("has a storage entry that is not (MetadataIndex, _StorageInfo)")
        if not _inside(relative, folder):
            raise refuse(f"points a tensor at {relative!r}, outside the folder")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise refuse(f"has storage_meta of type {type(metadata.storage_meta).__name__}")


def _inside(relative: str, folder: Path) -> bool:
    """Whether ``folder/relative`` is a file name inside ``folder`` once every ``..`` and symlink
    is resolved: plain strings compared, nothing a pickle could have touched."""
    if not relative or "\\" in relative or os.path.isabs(relative):
        return False
    root = os.path.realpath(folder)
    return os.path.realpath(os.path.join(root, relative)).startswith(root + os.sep)


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader with the index read by :func:`read_dcp_metadata`.

    Only the folder's one index is read: no ``**kwargs`` here, because dcp.load falls back to a
    per-rank ``__<rank>.metadata`` when the reader takes a ``rank`` keyword and the index fails,
    which would turn a refusal into a load of another file (longctx never writes those)."""

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        metadata = read_dcp_metadata(self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor items are loaded weights-only (torch's own uses
    ``torch.load(weights_only=False)``)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # as torch's own

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_sharded(state: dict, folder: str | os.PathLike) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` from ``folder``, in place, read as
    data: each rank reads the slices its (sharded) tensors hold; without a process group, a
    plain load. A failure is one line naming the folder (torch's CheckpointException is a
    BaseException holding each rank's traceback)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    read_dcp_metadata(folder)  # our one-line refusal, not torch's wrapped one
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner())
    except CheckpointException as err:
        raise _first_failure(err, Path(folder)) from None


def _first_failure(err, folder: Path) -> Exception:
    """The first rank's exception: ours as it is, any other as a one-line UnreadableShardedCheckpoint."""
    cause = next(iter(err.failures.values()))[0]
    if isinstance(cause, UnsafeShardedCheckpoint | UnreadableShardedCheckpoint):
        return cause
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    # a refused non-tensor item: torch's weights-only message says which global in one line
    refusal = [line for line in lines if "GLOBAL" in line]
    if isinstance(cause, pickle.UnpicklingError) and refusal:
        return UnsafeShardedCheckpoint(
            f"sharded checkpoint {folder} is refused: a non-tensor item is not weights-only data "
            f"({refusal[0][:200]}); pass a checkpoint folder written by longctx"
        )
    return UnreadableShardedCheckpoint(
        f"sharded checkpoint {folder} cannot be loaded ({type(cause).__name__}: "
        f"{(lines[0] if lines else '')[:300]})"
    )


def read_sharded_tensors(folder: str | os.PathLike, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder whose name starts with ``prefix`` (the prefix removed), whole,
    on the CPU: allocated at the shapes and dtypes its index states, then loaded as data."""
    folder = Path(folder)
    entries = read_dcp_metadata(folder).state_dict_metadata
    wanted = {
        name: entry
        for name, entry in entries.items()
        if name.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    stated = sum(e.size.numel() * e.properties.dtype.itemsize for e in wanted.values())
    held = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    if stated > held:  # an index that claims more than the folder holds: allocate nothing
        raise UnreadableShardedCheckpoint(
            f"sharded checkpoint {folder}: its index states {stated} bytes of tensors but the "
            f"folder holds {held}; expected a complete checkpoint folder"
        )
    tensors = {n: torch.empty(tuple(e.size), dtype=e.properties.dtype) for n, e in wanted.items()}
    load_sharded(tensors, folder)
    return {name.removeprefix(prefix): tensor for name, tensor in tensors.items()}
