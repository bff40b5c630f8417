"""Every experiment is one command from a fresh clone: each conf/experiment/*.yaml trains, at toy
size, against an empty cache (the embedded corpus and the synthesized mixes it names are made on
first use, one line saying what was synthesized and where), with no other step before it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import ROOT, compose, run_train
from omegaconf import DictConfig, OmegaConf

from longctx.train.app import run

EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
TOY = [
    "logger=csv",
    "data.seq_len=256",
    "data.micro_batch_size=2",
    "data.val_rows=2",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
    "callbacks.checkpoint.every_n_train_steps=2",
]
MIX_DOCUMENTS = 6  # per task: a mix of a few documents is still the mix the experiment names
SYNTHESIZED = re.compile(r"^synthesized \d+ documents \(.*\) into (\S+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory) -> Path:
    """The cache of a fresh clone: empty (shared by this module's runs, as by a user's)."""
    return tmp_path_factory.mktemp("fresh") / "data_cache"


def shrink(cfg: DictConfig) -> DictConfig:
    """The experiment at toy size: fewer documents in each mix it names, one suite sample."""
    for value in list(cfg.values()):
        if isinstance(value, DictConfig) and "tasks" in value and "documents" in value:
            value.documents = MIX_DOCUMENTS  # a mix node (ruler_mix, ruler_repeat, ...)
    callbacks = cfg.get("callbacks") or {}
    if "ruler" in callbacks:
        cfg.callbacks.ruler.samples = 1
        # the suite tasks that fit the toy rows (a multi-key needle needs more than 256)
        cfg.callbacks.ruler.tasks = ["lc_passkey", "lc_copy"]
    if "held_out_documents" in callbacks:
        cfg.callbacks.held_out_documents.num_documents = 2
    if "held_out_answers" in callbacks:
        cfg.callbacks.held_out_answers.documents = 2
    return cfg


def test_the_ablation_sweep_is_one_command_on_a_fresh_clone(tmp_path, fresh_cache):
    """python train.py -m experiment=position_ablation, one arm: the mix is synthesized on first
    use, into the cache, with one line saying so; the run trains on it."""
    proc = run_train(
        ["-m", "experiment=position_ablation", *TOY, f"paths.cache_dir={fresh_cache}",
         f"ruler_mix.documents={MIX_DOCUMENTS}", "seed=0", "data.reset_position_ids=true",
         "data.document_mask=true", "callbacks.ruler.samples=1",
         "callbacks.ruler.tasks=[lc_passkey,lc_copy]"],
        tmp_path,
    )  # fmt: skip
    (folder,) = SYNTHESIZED.findall(proc.stdout)
    assert Path(folder).parent == fresh_cache and (Path(folder) / "manifest.json").is_file()
    assert "does not exist" not in proc.stderr
    (run_dir,) = [p.parent.parent for p in (tmp_path / "multirun").rglob("checkpoints/last.ckpt")]
    assert "ruler_mix" not in run_dir.name  # the mix's settings do not name the arm's folder


# a second stage starts from its first stage's weights (model.init_from): the stage tests train
# both (below; tests/e2e/test_recall_run.py for recall and the recall_ablation pair)
SECOND_STAGES = {"context_extension", "recall", "recall_ablation"}


@pytest.mark.parametrize("experiment", [e for e in EXPERIMENTS if e not in SECOND_STAGES])
def test_every_experiment_trains_from_a_fresh_cache(experiment, tmp_path, fresh_cache, capsys):
    cfg = shrink(compose([f"experiment={experiment}", *TOY, f"paths.cache_dir={fresh_cache}"],
                         output_dir=tmp_path / "run"))  # fmt: skip
    before = mixes_in(fresh_cache)
    run(cfg)
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    announced = {Path(f) for f in SYNTHESIZED.findall(capsys.readouterr().out)}
    # each mix written into the cache once, and said: one an earlier run made (position_ablation's,
    # by the sweep above) is found again, not synthesized anew
    assert announced == mixes_in(fresh_cache) - before
    shards = OmegaConf.to_container(cfg.data, resolve=True)["shards"] or []
    # every named entry (a mix, an MQAR corpus: dicts) is a folder in the cache
    written = mixes_in(fresh_cache) | set(fresh_cache.glob("mqar_*"))
    assert len(written) >= sum(isinstance(s, dict) for s in shards)


def mixes_in(cache: Path) -> set[Path]:
    return {p for p in cache.glob("synthesized_*") if p.is_dir()} if cache.exists() else set()


def test_the_context_extension_stages_train_from_a_fresh_cache(tmp_path, fresh_cache, capsys):
    """Stage 1, then stage 2 from its weights: each names the mix at its own length, so stage 2
    synthesizes another folder (its rows are longer) instead of reading stage 1's."""
    stage1 = tmp_path / "stage1"
    run(shrink(compose(["experiment=context_extension_stage1", *TOY,
                        f"paths.cache_dir={fresh_cache}"], output_dir=stage1)))  # fmt: skip
    capsys.readouterr()
    before = mixes_in(fresh_cache)
    cfg = compose(["experiment=context_extension", *TOY, "data.seq_len=512", "stage1_seq_len=256",
                   f"model.init_from={stage1}", f"paths.cache_dir={fresh_cache}"],
                  output_dir=tmp_path / "stage2")  # fmt: skip
    run(shrink(cfg))
    assert (tmp_path / "stage2" / "checkpoints" / "last.ckpt").is_file()
    (second,) = SYNTHESIZED.findall(capsys.readouterr().out)
    assert {Path(second)} == mixes_in(fresh_cache) - before and "_L16-512_" in second
    assert any("_L16-256_" in p.name for p in before)  # stage 1's, at its own length
