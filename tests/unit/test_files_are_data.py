"""A sharded (torch.distributed.checkpoint) folder is data: its ``.metadata`` is unpickled with
only the distributed-checkpoint classes admitted, and its non-tensor items weights-only, on every
path that reads one (init_from, export, verify, eval, a resume under trainer=fsdp). A crafted
folder is refused in one line, and its code never runs; a genuine folder still loads."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from export_helpers import make_run
from helpers import CACHE_DIR, FAST, SCRIPTS, compose

from longctx.distributed.fsdp import load_training_state
from longctx.distributed.sharded import (
    ALLOWED_GLOBALS,
    METADATA_FILE,
    UnsafeShardedCheckpoint,
    load_sharded,
    read_dcp_metadata,
)
from longctx.eval import cli as eval_cli
from longctx.hf.export import export
from longctx.hf.verify import verify
from longctx.hf.weight_source import InitFromError, resolve
from longctx.runs.checkpoints import AtomicCheckpointIO, resolve_ckpt_path
from longctx.train.app import run


class _WritesMarker:
    """A pickle that, loaded by plain pickle, creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def plant(folder, marker) -> None:
    """Make ``folder``'s index a pickle that would create ``marker`` if unpickled."""
    (folder / METADATA_FILE).write_bytes(pickle.dumps(_WritesMarker(marker)))


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A genuine sharded run, its export, and a crafted copy of the run (hostile index)."""
    root = tmp_path_factory.mktemp("sharded")
    good = make_run(root / "good", sharded=True)
    exported = export(good, root / "hf").folder
    bad = make_run(root / "bad", sharded=True)
    marker = root / "code_ran"
    plant(bad / "checkpoints" / "last.ckpt", marker)
    # the planted index is live: torch's own reader runs it
    from torch.distributed.checkpoint import FileSystemReader

    with pytest.raises(Exception):  # noqa: B017 - the exec returns None, not a Metadata
        FileSystemReader(str(bad / "checkpoints" / "last.ckpt")).read_metadata()
    assert marker.exists()
    marker.unlink()
    return good, exported, bad, marker


# --------------------------------------------------------------------------- the allow-list
def referenced_globals(folder) -> set[tuple[str, str]]:
    """(module, name) of every global a folder's index references, unpickled by plain pickle
    (only genuine torch saves are given to it)."""
    seen: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(folder / METADATA_FILE, "rb") as f:
        Recording(f).load()
    return seen


def test_real_saves_reference_only_the_allowed_globals(tmp_path):
    """What torch 2.13 pickles into an FSDP2 (DTensor) save of the model and AdamW's state, and
    into a plain save with non-tensor items and bf16, is all in ALLOWED_GLOBALS or a dtype."""
    out = tmp_path / "fsdp"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "dcp_save_script.py"), str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = tmp_path / "plain"
    state = {"w": torch.zeros(2, dtype=torch.bfloat16), "opt": {"lr": 0.1, "groups": [{"a": 1}]}}
    dcp.save(state, checkpoint_id=plain)
    for folder in (out, plain):
        seen = referenced_globals(folder)
        dtypes = {
            (m, n) for m, n in seen if m == "torch" and isinstance(getattr(torch, n), torch.dtype)
        }
        assert seen - dtypes <= ALLOWED_GLOBALS, sorted(seen - dtypes - ALLOWED_GLOBALS)
        assert ("torch.distributed.checkpoint.metadata", "Metadata") in seen
        read_dcp_metadata(folder)  # and the restricted reader reads it
    assert "optimizer_0.state" in str(read_dcp_metadata(out).state_dict_metadata.keys())


@pytest.mark.parametrize(
    "global_name", ["os.system", "builtins.eval", "subprocess.Popen", "torch.load"]
)
def test_any_other_global_is_refused_by_name(tmp_path, global_name):
    module, name = global_name.rsplit(".", 1)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    # GLOBAL 'module name', then STOP: refused on lookup, before anything is called
    (folder / METADATA_FILE).write_bytes(f"c{module}\n{name}\n.".encode())
    with pytest.raises(UnsafeShardedCheckpoint) as err:
        read_dcp_metadata(folder)
    assert f"names {global_name}," in one_line(err) and str(folder) in str(err.value)


def test_a_tensor_stored_outside_the_folder_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=folder)
    metadata = read_dcp_metadata(folder)
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(folder / METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UnsafeShardedCheckpoint, match=r"'\.\./\.\./etc/passwd', outside"):
        read_dcp_metadata(folder)


def test_a_build_on_an_allowed_class_is_refused(tmp_path):
    """A BUILD on the class PurePosixPath (allowed as a global) once set its ``parts`` for the
    whole process, so the inside-the-folder check passed a tensor at ../outside; only a fresh
    metadata instance may be filled in now, and the process's pathlib is untouched."""
    from pathlib import PurePosixPath

    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=folder)
    metadata = read_dcp_metadata(folder)
    for info in metadata.storage_data.values():
        info.relative_path = "../outside/w.distcp"
    body = pickle.dumps(metadata, protocol=2)
    # GLOBAL pathlib.PurePosixPath, (None, {"parts": ("ok",)}), BUILD, POP; then the metadata
    build = b"cpathlib\nPurePosixPath\nN(X\x05\x00\x00\x00parts(X\x02\x00\x00\x00oktd\x86b0"
    (folder / METADATA_FILE).write_bytes(body[:2] + build + body[2:])
    with pytest.raises(UnsafeShardedCheckpoint, match="sets attributes on type .*PurePosixPath"):
        read_dcp_metadata(folder)
    assert PurePosixPath("a/b").parts == ("a", "b")


def test_a_tensor_file_linked_outside_the_folder_is_refused(tmp_path):
    """The inside-the-folder check resolves symlinks: a data file that is a link to a file
    outside is refused, as a ``..`` is."""
    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=folder)
    (data,) = [p for p in folder.iterdir() if p.name != METADATA_FILE]
    outside = tmp_path / "outside.distcp"
    data.rename(outside)
    data.symlink_to(outside)
    with pytest.raises(UnsafeShardedCheckpoint, match=f"'{data.name}', outside") as err:
        read_dcp_metadata(folder)
    one_line(err)


def test_a_non_tensor_item_is_loaded_weights_only(tmp_path):
    """torch's planner loads a non-tensor item (an optimizer's param_groups) with
    weights_only=False; ours refuses a pickled global there, in one line."""
    marker = tmp_path / "code_ran"
    folder = tmp_path / "ckpt"
    dcp.save({"opt": {"lr": _WritesMarker(marker)}}, checkpoint_id=folder)
    with pytest.raises(UnsafeShardedCheckpoint, match="not weights-only data") as err:
        load_sharded({"opt": {"lr": 0.0}}, folder)
    one_line(err)
    assert not marker.exists()
    dcp.load({"opt": {"lr": 0.0}}, checkpoint_id=folder)  # the hole this closes
    assert marker.exists()


# --------------------------------------------------------------------------- every path
def test_init_from_refuses_the_folder_and_its_run_folder(runs):
    _, _, bad, marker = runs
    for path in (bad / "checkpoints" / "last.ckpt", bad):
        with pytest.raises(InitFromError, match="is refused: its .metadata names builtins.exec"):
            resolve(path)
    assert not marker.exists()


def test_train_py_init_from_refuses_it_in_one_line(runs, tmp_path):
    _, _, bad, marker = runs
    cfg = compose([*FAST, f"model.init_from={bad}"], output_dir=tmp_path / "run")
    with pytest.raises(ValueError, match="builtins.exec") as err:
        run(cfg)
    one_line(err)
    assert not marker.exists()


def test_export_refuses_it_and_writes_nothing(runs, tmp_path):
    _, _, bad, marker = runs
    with pytest.raises(UnsafeShardedCheckpoint, match="builtins.exec") as err:
        export(bad, tmp_path / "out")
    one_line(err)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_verify_refuses_the_checkpoint_its_export_names(runs, tmp_path):
    good, exported, bad, marker = runs
    import json
    import shutil

    copy = shutil.copytree(exported, tmp_path / "hf")
    record = json.loads((copy / "longctx_export.json").read_text())
    record["checkpoint"] = str(bad / "checkpoints" / "last.ckpt")
    (copy / "longctx_export.json").write_text(json.dumps(record))
    with pytest.raises(UnsafeShardedCheckpoint, match="builtins.exec") as err:
        verify(copy, documents=1)
    one_line(err)
    assert not marker.exists()


def test_eval_refuses_it(runs):
    _, _, bad, marker = runs
    with pytest.raises(UnsafeShardedCheckpoint, match="builtins.exec") as err:
        eval_cli.main([str(bad), "--no-probe", "--cache-dir", str(CACHE_DIR)])
    one_line(err)
    assert not marker.exists()


def test_a_resume_refuses_it_before_lightning_and_the_fsdp_loader_too(runs):
    """ckpt_path= is read (checked) before the trainer starts; FSDP2Strategy.load_checkpoint
    (load_training_state) reads the folder as data as well."""
    _, _, bad, marker = runs
    folder = bad / "checkpoints" / "last.ckpt"
    for ckpt_path in (str(folder), "last"):
        with pytest.raises(UnsafeShardedCheckpoint, match="builtins.exec") as err:
            resolve_ckpt_path(ckpt_path, bad)
        one_line(err)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UnsafeShardedCheckpoint, match="builtins.exec"):
        load_training_state(folder, model, [torch.optim.SGD(model.parameters(), lr=0.1)], True)
    assert not marker.exists()


# --------------------------------------------------------------------------- genuine folders
def test_a_genuine_folder_loads_everywhere(runs, tmp_path):
    good, exported, _, _ = runs
    folder = good / "checkpoints" / "last.ckpt"
    source = resolve(good)
    assert source.kind == "longctx-sharded"
    assert resolve_ckpt_path(str(folder), good).path == str(folder)
    summary = eval_cli.main([str(good), "--no-probe", "--cache-dir", str(CACHE_DIR),
                             "--out", str(tmp_path / "eval"), "--long-factor", "1"])  # fmt: skip
    assert torch.isfinite(torch.tensor(summary["val_loss"]))
    verified = verify(exported, documents=1)
    assert verified.max_diff <= 1e-4 * verified.max_logit


def test_the_fsdp_loader_restores_model_and_optimizer_state(tmp_path):
    """load_training_state (what FSDP2Strategy.load_checkpoint runs for a folder) restores the
    weights, the optimizer's moments and param_groups, and returns meta.pt."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state = {"state_dict": get_model_state_dict(model),
             "optimizer_0": get_optimizer_state_dict(model, optimizer)}  # fmt: skip
    folder = tmp_path / "last.ckpt"
    dcp.save(state, checkpoint_id=folder)
    torch.save({"global_step": 7}, folder / "meta.pt")
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    meta = load_training_state(folder, fresh, [fresh_optimizer], True)
    assert meta == {"global_step": 7}
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.01
    moments = [s["exp_avg"] for s in fresh_optimizer.state.values()]
    expected = [s["exp_avg"] for s in optimizer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(moments, expected, strict=True))


# --------------------------------------------------------------------------- wrong trainer
def test_a_sharded_ckpt_path_on_a_single_device_trainer_is_one_line(tmp_path):
    folder = tmp_path / "last.ckpt"
    dcp.save({"state_dict": {"model.w": torch.zeros(1)}}, checkpoint_id=folder)
    torch.save({"global_step": 1}, folder / "meta.pt")  # no run identity: not checked
    with pytest.raises(ValueError, match="is a sharded checkpoint folder") as err:
        AtomicCheckpointIO().load_checkpoint(folder)
    assert "trainer=fsdp" in one_line(err)
    cfg = compose([*FAST, f"ckpt_path={folder}"], output_dir=tmp_path / "run")
    with pytest.raises(ValueError, match="is a sharded checkpoint folder") as err:
        run(cfg)
    one_line(err)


def test_missing_index_and_truncated_index_are_one_line(tmp_path):
    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=folder)
    data = (folder / METADATA_FILE).read_bytes()
    (folder / METADATA_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot be read as distributed-checkpoint") as err:
        read_dcp_metadata(folder)
    one_line(err)
    os.remove(folder / METADATA_FILE)
    with pytest.raises(ValueError, match="has no .metadata") as err:
        read_dcp_metadata(folder)
    one_line(err)


# --------------------------------------------------------------------------- records vs weights
def test_a_record_that_does_not_fit_its_weights_is_refused_before_allocating(tmp_path, monkeypatch):
    """A record naming llama3_8b over a small model's tensors: export refuses it from the
    checkpoint's shapes, before a model is allocated (it used to allocate 16 GiB first)."""
    from longctx.model.llama import Llama
    from longctx.runs.record import CHECKPOINT_KEY

    run_folder = make_run(tmp_path)
    ckpt = run_folder / "checkpoints" / "last.ckpt"
    contents = torch.load(ckpt, weights_only=True)
    model = contents[CHECKPOINT_KEY]["config"]["model"]
    for field in ("dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):  # 2 layers kept
        model.pop(field, None)
    model["name"] = "llama3_8b"
    torch.save(contents, ckpt)

    def allocates(self, *args, **kwargs):
        raise AssertionError("a model was allocated before the shapes were checked")

    monkeypatch.setattr(Llama, "to_empty", allocates)
    with pytest.raises(ValueError, match="does not fit its weights") as err:
        export(run_folder, tmp_path / "out")
    assert "tok_embeddings.weight: model (128256, 4096) vs checkpoint (300, 64)" in one_line(err)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="tensor shapes differ from the model config's"):
        eval_cli.main([str(run_folder), "--no-probe", "--cache-dir", str(CACHE_DIR)])


@pytest.mark.parametrize("record", [{}, {"checkpoint": 3}, [], {"checkpoint": "x"}])
def test_an_export_record_without_its_fields_is_one_line(tmp_path, record):
    (tmp_path / "longctx_export.json").write_text(__import__("json").dumps(record))
    with pytest.raises(ValueError, match=r"longctx_export\.json has no valid") as err:
        verify(tmp_path)
    assert "re-export" in one_line(err)


def test_an_index_that_claims_more_than_the_folder_holds_allocates_nothing(tmp_path):
    """eval reads a sharded checkpoint's tensors at the shapes its index states: a 4 TB claim in
    a 2 kB folder is refused before anything is allocated."""
    from longctx.distributed.sharded import read_sharded_tensors

    folder = tmp_path / "ckpt"
    dcp.save({"state_dict": {"model.w": torch.randn(4, 3)}}, checkpoint_id=folder)
    assert read_sharded_tensors(folder, "state_dict.")["model.w"].shape == (4, 3)
    metadata = read_dcp_metadata(folder)
    metadata.state_dict_metadata["state_dict.model.w"].size = torch.Size([10**6, 10**6])
    with open(folder / METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(ValueError, match="states 4000000000000 bytes of tensors") as err:
        read_sharded_tensors(folder, "state_dict.")
    one_line(err)
