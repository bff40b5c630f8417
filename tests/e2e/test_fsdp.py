"""FSDP2 on CPU (gloo): 2 processes train exactly like 1; a 2-rank sharded checkpoint resumes
on 1 rank; the sharding helpers refuse what they cannot do, by name."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import fsdp_script  # noqa: E402
import pytest
import torch
from helpers import SCRIPTS, assert_close_scaled
from module_fixtures import cat_batches, fit, small_module
from torch import nn

from longctx.distributed.fsdp import FSDP2Strategy, parse_dtype, swap_into_place, transformer_blocks
from longctx.hf.weight_source import load_hf


def run_script(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "fsdp_script.py"), *args],
        cwd=SCRIPTS,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]


def reference_params(
    steps: int, momentum: bool, init_from: str | None = None
) -> dict[str, torch.Tensor]:
    """One ordinary process, no FSDP, both micro-batches of a step stacked."""
    module = small_module(init_from=init_from)
    if momentum:  # optimizer state to reshard; AdamW would amplify round-off (sign of ~0 grads)
        module.optim = replace(
            module.optim, optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9)
        )
    batches = fsdp_script.rank_batches(steps)
    fit(module, [cat_batches(batches[2 * s : 2 * s + 2]) for s in range(steps)], max_steps=steps)
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def assert_params_close(a: dict, b: dict, rel: float = 2e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert_close_scaled(a[name], b[name], rel=rel, msg=name)


@pytest.mark.slow
def test_fsdp_two_processes_equal_one_process(tmp_path):
    out = tmp_path / "fsdp2.pt"
    run_script("--devices", "2", "--steps", "3", "--out", str(out))  # SGD: scale-sensitive
    assert_params_close(torch.load(out), reference_params(3, momentum=False))


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path):
    ckpt, mid, end = tmp_path / "last.ckpt", tmp_path / "mid.pt", tmp_path / "end.pt"
    run_script(
        "--devices", "2", "--steps", "2", "--out", str(mid), "--save", str(ckpt), "--momentum"
    )
    shards = sorted(p.name for p in ckpt.iterdir())
    assert ckpt.is_dir() and "__0_0.distcp" in shards and "__1_0.distcp" in shards, shards
    assert not list(tmp_path.glob(".last.ckpt.*")), "temporary checkpoint folder left behind"
    assert_params_close(torch.load(mid), reference_params(2, momentum=True))
    # 1 rank loads the 2-rank shards (parameters and momentum buffers) and continues
    run_script(
        "--devices", "1", "--steps", "4", "--start", "2", "--resume", str(ckpt),
        "--out", str(end), "--momentum",
    )  # fmt: skip
    assert_params_close(torch.load(end), reference_params(4, momentum=True))


@pytest.mark.slow
@pytest.mark.parametrize("source", ["transformers", "longctx_ckpt"])
def test_init_from_under_fsdp_reads_each_ranks_shards_only(tmp_path, source):
    """model.init_from with 2 FSDP2 ranks: training from a sharded transformers folder (or a
    single-file longctx checkpoint) equals one ordinary process started from it, and from
    safetensors each rank reads about half of the elements (its own rows)."""
    from test_init_from import save_hf_small

    path = save_hf_small(tmp_path / "hf")
    if source == "longctx_ckpt":
        state = {f"model.{k}": v for k, v in load_hf(path).state_dict().items()}
        path = str(tmp_path / "stage.ckpt")
        torch.save({"state_dict": state}, path)
    out, report = tmp_path / "fsdp2.pt", tmp_path / "read"
    run_script(
        "--devices", "2", "--steps", "2", "--out", str(out),
        "--init-from", path, "--read-report", str(report),
    )  # fmt: skip
    assert_params_close(torch.load(out), reference_params(2, momentum=False, init_from=path))
    if source == "longctx_ckpt":
        return  # memory-mapped: each rank copies its slices, nothing to count
    total = sum(v.numel() for v in small_module().model.state_dict().values())
    for rank in (0, 1):
        read = json.loads(Path(f"{report}.{rank}").read_text())["elements"]
        assert read <= 0.55 * total, (rank, read, total)  # its half (+ rounding of odd rows)
        assert read >= 0.45 * total, (rank, read, total)


def test_blocks_found_or_refused_by_name():
    module = small_module()
    assert transformer_blocks(module.model) is module.model.layers
    with pytest.raises(ValueError, match="no nn.ModuleList named 'layers'"):
        transformer_blocks(nn.Sequential(nn.Linear(2, 2)))


def test_bad_strategy_settings_are_named():
    with pytest.raises(ValueError, match="param_dtype='bf16'"):
        FSDP2Strategy(param_dtype="bf16")
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        FSDP2Strategy(tensor_parallel_size=2)
    assert parse_dtype("auto", torch.device("cpu"), "x") is torch.float32
    assert parse_dtype("auto", torch.device("cuda"), "x") is torch.bfloat16


def test_swap_into_place_replaces_a_folder_whole(tmp_path):
    final, tmp = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.x.tmp"
    final.mkdir()
    (final / "old_shard").write_text("old")
    tmp.mkdir()
    (tmp / "new_shard").write_text("new")
    swap_into_place(tmp, final)
    assert sorted(p.name for p in final.iterdir()) == ["new_shard"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


@pytest.mark.slow
def test_train_py_fsdp_sharded_checkpoint_resumes(tmp_path):
    """The app end to end: trainer=fsdp writes a sharded last.ckpt folder (with the data
    position) and ckpt_path=last continues it (on another world size:
    tests/test_elastic_resume.py)."""
    from helpers import FAST, run_train

    common = [*FAST, "trainer=fsdp", "trainer.accelerator=cpu", "run_name=sharded",
              "trainer.val_check_interval=4", "callbacks.checkpoint.every_n_train_steps=2"]  # fmt: skip
    run_train([*common, "trainer.devices=2", "trainer.max_steps=4"], tmp_path, timeout=600)
    last = tmp_path / "outputs" / "train" / "sharded" / "checkpoints" / "last.ckpt"
    assert last.is_dir() and {"__0_0.distcp", "__1_0.distcp", "meta.pt"} <= {
        p.name for p in last.iterdir()
    }
    meta = torch.load(last / "meta.pt", weights_only=True)  # non-tensor state, rank 0
    assert meta["global_step"] == 4 and "LongCtxDataModule" in meta, sorted(meta)
    proc = run_train(
        [*common, "trainer.devices=2", "trainer.max_steps=6", "ckpt_path=last"], tmp_path
    )
    assert "longctx: rank 0/2 stopped at step 6" in proc.stdout, proc.stdout[-2000:]
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == 6
