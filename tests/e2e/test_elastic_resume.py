"""Elastic resume through train.py on CPU over gloo: a run continues on another number of
data-parallel ranks with the same rows per optimizer step, so it lands on the parameters of the
uninterrupted run; a global batch that cannot be kept, or a checkpoint from before, is refused.

Every run is 4 AdamW steps of the tiny model on rows of 128 tokens, micro-batches of 2 rows and
4 rows per step (1 rank x accumulation 2, or 2 ranks x 1), checkpointed at step 2.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import FAST, read_metrics, run_train

from longctx.distributed.elastic import GlobalBatch, resume_accumulation

RUN = [
    *FAST,
    "data.seq_len=128",
    "trainer.max_steps=4",
    "trainer.limit_val_batches=0",
    "trainer.deterministic=true",
    "callbacks.checkpoint.every_n_train_steps=2",
    "callbacks.checkpoint.save_top_k=-1",
]
DDP2 = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
FSDP = ["trainer=fsdp", "trainer.accelerator=cpu"]
ACCUMULATE_2 = "optim.accumulate_grad_batches=2"


def train(tmp_path: Path, name: str, *overrides: str, resume: Path | None = None, check=True):
    """train.py RUN + overrides as run ``name``; (its run folder, the process)."""
    ckpt = [f"ckpt_path={resume}"] if resume else []
    proc = run_train([*RUN, *overrides, f"run_name={name}", *ckpt], tmp_path, check=check)
    return tmp_path / "outputs" / "train" / name, proc


def step2_checkpoint(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run's step-2 checkpoint (file or sharded folder) under a plain name
    (Hydra would need the '=' of Lightning's name quoted)."""
    found = next((run_dir / "checkpoints").glob("*step=2.ckpt"))
    copy = tmp_path / f"{run_dir.name}_step2.ckpt"
    (shutil.copytree if found.is_dir() else shutil.copy)(found, copy)
    return copy


def final_checkpoint(run_dir: Path) -> dict:
    """last.ckpt as one dict, a sharded FSDP2 folder gathered into one."""
    last = run_dir / "checkpoints" / "last.ckpt"
    if last.is_file():
        return torch.load(last, weights_only=False)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    gathered = run_dir / "last_gathered.pt"
    dcp_to_torch_save(last, gathered)
    return {**torch.load(gathered, weights_only=False), **torch.load(last / "meta.pt")}


def assert_same_parameters(run_dir: Path, reference: Path, rel: float = 1e-5) -> None:
    """Equal to fp32 round-off relative to each tensor's magnitude."""
    got, want = (final_checkpoint(d)["state_dict"] for d in (run_dir, reference))
    assert got.keys() == want.keys()
    for name, value in want.items():
        scale = float(value.abs().max())
        torch.testing.assert_close(got[name], value, rtol=rel, atol=rel * scale, msg=name)


def train_steps(run_dir: Path) -> list[int]:
    return [int(r["step"]) for r in read_metrics(run_dir) if r.get("train/loss")]


def assert_position(run_dir: Path, rows: int, global_batch: dict) -> None:
    """The checkpoint records the global rows consumed and how a step's rows were split."""
    checkpoint = final_checkpoint(run_dir)
    assert checkpoint["global_step"] == 4
    assert checkpoint["LongCtxDataModule"]["rows_consumed"] == rows
    assert checkpoint["longctx"]["global_batch"] == global_batch


@pytest.mark.slow
def test_two_ranks_resume_on_one_and_one_on_two(tmp_path):
    one, _ = train(tmp_path, "one", ACCUMULATE_2)
    two, _ = train(tmp_path, "two", *DDP2)
    # the rows of every step do not depend on the number of ranks
    assert_same_parameters(one, two)
    down, proc = train(tmp_path, "down", resume=step2_checkpoint(two, tmp_path))
    assert "accumulate_grad_batches 2 (configured 1) keeps the checkpoint's global batch" in (
        proc.stdout + proc.stderr
    )
    assert_same_parameters(down, two)
    # one row per optimizer step, whatever the accumulation: 2 ranks x 1, 1 x 2, and the
    # resume on 1 rank (accumulation 2) continuing the 2-rank run from step 2
    assert train_steps(one) == train_steps(two) == [1, 2, 3, 4]
    assert train_steps(down) == [3, 4]
    assert_position(
        down, 16, dict(micro_batch_rows=2, accumulate_grad_batches=2, data_parallel_size=1)
    )
    up, _ = train(tmp_path, "up", *DDP2, ACCUMULATE_2, resume=step2_checkpoint(one, tmp_path))
    assert_same_parameters(up, one)
    assert_position(
        up, 16, dict(micro_batch_rows=2, accumulate_grad_batches=1, data_parallel_size=2)
    )


@pytest.mark.slow
def test_fsdp2_sharded_checkpoint_resumes_on_one_rank(tmp_path):
    two, _ = train(tmp_path, "fsdp2", *FSDP, "trainer.devices=2")
    mid = step2_checkpoint(two, tmp_path)
    assert mid.is_dir() and {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in mid.iterdir()}
    one, _ = train(tmp_path, "fsdp1", *FSDP, "trainer.devices=1", resume=mid)
    assert_same_parameters(one, two)
    assert_position(
        one, 16, dict(micro_batch_rows=2, accumulate_grad_batches=2, data_parallel_size=1)
    )


@pytest.mark.slow
def test_context_parallel_2_resumes_as_data_parallel_2(tmp_path):
    """2 processes splitting each row (1 data-parallel rank, accumulation 2) resume as 2
    data-parallel ranks (accumulation 1)."""
    cp2, _ = train(tmp_path, "cp2", *DDP2, "parallel.context_parallel=2", ACCUMULATE_2)
    dp2, _ = train(tmp_path, "dp2", *DDP2, resume=step2_checkpoint(cp2, tmp_path))
    assert_same_parameters(dp2, cp2)
    assert_position(
        dp2, 16, dict(micro_batch_rows=2, accumulate_grad_batches=1, data_parallel_size=2)
    )


@pytest.mark.slow
def test_a_global_batch_that_cannot_be_kept_stops_the_resume(tmp_path):
    one, _ = train(tmp_path, "one", "trainer.max_steps=2")  # 2 rows a step
    last = one / "checkpoints" / "last.ckpt"
    _, proc = train(tmp_path, "two", *DDP2, resume=last, check=False)
    assert proc.returncode != 0
    assert (
        "cannot keep the checkpoint's global batch of 2 rows (micro-batch 2 x accumulation 1 x 1 "
        "data-parallel ranks) on 2 data-parallel ranks with micro-batch 2: 2 rows is not a "
        "multiple of 2 x 2 = 4"
    ) in proc.stderr, proc.stderr[-3000:]


def test_resume_accumulation_keeps_refuses_or_changes_the_global_batch():
    saved = GlobalBatch(micro_batch_rows=2, accumulate_grad_batches=3, data_parallel_size=4)
    assert resume_accumulation(saved, 2, 4, configured=3, allow_change=False) == (3, None)
    accumulation, note = resume_accumulation(saved, 2, 6, configured=3, allow_change=False)
    assert accumulation == 2 and "24 rows (micro-batch 2 x accumulation 2 x 6" in note
    with pytest.raises(ValueError, match=r"24 rows is not a multiple of 2 x 8 = 16.*divides 12"):
        resume_accumulation(saved, 2, 8, configured=3, allow_change=False)
    accumulation, note = resume_accumulation(saved, 2, 8, configured=3, allow_change=True)
    assert accumulation == 2 and "changes" in note and "-> 32 rows" in note
    assert resume_accumulation(saved, 2, 32, configured=3, allow_change=True)[0] == 1


def test_checkpoint_from_before_elastic_resume_is_refused():
    from module_fixtures import small_module

    module = small_module()
    with pytest.raises(ValueError, match=r"no longctx.global_batch .*earlier longctx"):
        module.on_load_checkpoint({"longctx": {"tokens_seen": 512}})
    module.on_load_checkpoint({"longctx": {"tokens_seen": 512, "global_batch": None}})
    assert module.tokens_seen == 512
