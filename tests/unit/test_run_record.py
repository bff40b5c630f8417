"""A run's config record is data: every reader refuses a crafted ``_target_`` and runs no code."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import FAST, compose, write_run_record

from longctx.eval import cli as eval_cli
from longctx.hf.config_targets import CONFIG_TARGETS
from longctx.runs.folder import last_checkpoint
from longctx.runs.record import CHECKPOINT_KEY, RecordError, read_stored_run
from longctx.train.app import run
from longctx.train.preflight import ConfigError
from studies import analysis


class _WritesMarker:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def crafted_configs(tmp_path) -> dict[str, dict]:
    """Model configs a hostile record could carry: each would run code or touch files if it
    were instantiated."""
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps(_WritesMarker(tmp_path / "code_ran")))
    return {
        "torch.load": {"_target_": "torch.load", "_args_": [str(evil)], "weights_only": False},
        "numpy.load": {"_target_": "numpy.load", "file": str(evil), "allow_pickle": True},
        "open": {"_target_": "builtins.open", "file": str(tmp_path / "code_ran"), "mode": "w"},
        "copyfile": {"_target_": "shutil.copyfile", "src": str(evil), "dst": str(tmp_path / "x")},
        "nested": {
            "_target_": "longctx.model.LlamaConfig.from_name",
            "name": "tiny",
            "rope_scaling": {"_target_": "torch.load", "f": str(evil), "weights_only": False},
        },
        "args": {"_target_": "longctx.model.LlamaConfig.from_name", "_args_": ["tiny"]},
    }


def crafted_run(tmp_path, model: dict):
    run = write_run_record(tmp_path / "run", {"reset_position_ids": True, "document_mask": True})
    path = last_checkpoint(run)
    contents = torch.load(path, weights_only=True)
    contents[CHECKPOINT_KEY]["config"]["model"] = model
    torch.save(contents, path)
    return run


@pytest.mark.parametrize("case", ["torch.load", "numpy.load", "open", "copyfile", "nested", "args"])
def test_the_record_refuses_any_other_target_naming_file_and_key(tmp_path, case):
    run = crafted_run(tmp_path, crafted_configs(tmp_path)[case])
    stored = None
    with pytest.raises(RecordError, match=r"last\.ckpt: longctx_run\.config\.model") as err:
        stored = read_stored_run(run, CONFIG_TARGETS)
        stored.model_config()
    assert stored is None
    assert "_target_" in str(err.value) or "_args_" in str(err.value)
    assert not (tmp_path / "code_ran").exists() and not (tmp_path / "x").exists()


def test_eval_and_analysis_refuse_a_crafted_record_and_run_nothing(tmp_path):
    run = crafted_run(tmp_path, crafted_configs(tmp_path)["torch.load"])
    with pytest.raises(RecordError, match="torch.load"):
        eval_cli.main([str(last_checkpoint(run)), "--no-probe"])
    with pytest.raises(RecordError, match="torch.load"):
        analysis.load_local(tmp_path)
    assert not (tmp_path / "code_ran").exists()


def test_resume_and_init_from_a_crafted_checkpoint_run_nothing(tmp_path):
    folder = crafted_run(tmp_path, crafted_configs(tmp_path)["torch.load"])
    resume = compose([*FAST, f"ckpt_path={last_checkpoint(folder)}"], output_dir=tmp_path / "r")
    with pytest.raises(ConfigError, match="would change the run"):
        run(resume)
    init = compose([*FAST, f"model.init_from={folder}"], output_dir=tmp_path / "i")
    with pytest.raises(ConfigError, match="init_from"):
        run(init)
    assert not (tmp_path / "code_ran").exists()


def test_a_valid_record_builds_typed_configs(tmp_path):
    run = write_run_record(tmp_path / "run", {"seq_len": 128, "document_mask": False}, seed=3)
    stored = read_stored_run(run, CONFIG_TARGETS)
    assert stored.model_config().n_layers >= 1
    data = stored.data_config(seq_len=64)
    assert (data.seq_len, data.document_mask) == (64, False)
    assert stored.config["run"]["seed"] == 3


def test_an_older_identity_is_lenient_only_for_the_keys_added_since(capsys):
    from longctx.runs.record import CHECKPOINT_KEY
    from longctx.runs.resume import LATER_IDENTITY_KEYS, ResumeMismatch, check_resume

    current = {"model.dim": 64, "data.seq_len": 128} | {k: None for k in LATER_IDENTITY_KEYS}
    older = {CHECKPOINT_KEY: {"identity": {"model.dim": 64, "data.seq_len": 128}}}
    assert check_resume(older, current, [], "ckpt") == {}
    assert "does not record data.add_bos" in capsys.readouterr().out
    # an identity that omits anything else is not trusted for it (a crafted, empty one)
    crafted = {CHECKPOINT_KEY: {"identity": {"data.seq_len": 128}}}
    with pytest.raises(ResumeMismatch, match=r"model.dim: '<absent>' \(checkpoint\) -> 64"):
        check_resume(crafted, current, [], "ckpt")
