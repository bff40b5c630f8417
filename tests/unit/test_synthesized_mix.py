"""A synthesized mix named in data.shards by its settings: synthesized into the cache on first
use (one line says what and where), found again with the same settings, another folder with
changed ones, never a stale one; and synthesize leaves nothing behind when it refuses."""

from __future__ import annotations

import json
import shutil

import pytest

from longctx.data import ByteTokenizer, DataConfig, LongCtxDataModule, ShardSet, Synthesized
from longctx.data.shards import MANIFEST_NAME
from longctx.data.synthesize import (
    cli,
    holds_only_training_haystacks,
    synthesize,
    synthesized_dir,
)
from longctx.eval.ruler import RulerInputError

# fast: no haystack to prepare, a handful of short documents
SMALL = {"tasks": ["repeat", "copy"], "seed": 3, "documents": 4, "min_length": 16,
         "max_length": 128, "haystack": "noise"}  # fmt: skip


def test_a_mapping_in_shards_is_a_typed_synthesized_entry():
    config = DataConfig(shards=["embedded", SMALL, "/some/folder"], weights=[1.0, 1.0, 1.0])
    entry = config.shards[1]
    assert isinstance(entry, Synthesized) and entry.tasks == ("repeat", "copy")
    assert config.shards[0] == "embedded" and config.shards[2] == "/some/folder"
    assert holds_only_training_haystacks(entry)  # noise: the held-out books stay unseen
    assert not holds_only_training_haystacks(Synthesized(("copy",), haystack="/a/folder"))


@pytest.mark.parametrize(
    "entry, message",
    [
        ({**SMALL, "sed": 1}, "DataConfig.shards[0]={"),
        ({**SMALL, "sed": 1}, "unknown key 'sed'"),
        ({"seed": 1}, "no tasks; expected a folder, 'embedded', or the settings"),
        ({**SMALL, "tasks": ["bogus"]}, "DataConfig.shards[0]: unknown task ('bogus')"),
        ({**SMALL, "documents": 0}, "DataConfig.shards[0]: documents=0; expected an int >= 1"),
        ({**SMALL, "max_length": 8}, "max_length=8; expected an int >= min_length=16"),
        (3, "DataConfig.shards[0]=3; expected a folder, 'embedded', or the settings"),
    ],
)
def test_bad_settings_are_refused_on_construction_naming_them(entry, message):
    with pytest.raises(ValueError) as err:
        DataConfig(shards=[entry])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_first_use_synthesizes_once_and_says_where(tmp_path, capsys):
    cache = tmp_path / "cache"
    spec = Synthesized(**SMALL)
    folder = synthesized_dir(spec, cache)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("synthesized 8 documents (repeat, copy; seed 3, 16..128 tokens")
    assert line.endswith(f"into {folder}") and folder.parent == cache
    assert ShardSet(folder, "train").num_documents == 8
    assert not [p for p in cache.iterdir() if "partial" in p.name]  # written aside, renamed
    stamp = (folder / MANIFEST_NAME).stat().st_mtime_ns

    assert synthesized_dir(Synthesized(**SMALL), cache) == folder  # the same settings: reused
    assert capsys.readouterr().out == "" and (folder / MANIFEST_NAME).stat().st_mtime_ns == stamp

    other = synthesized_dir(Synthesized(**{**SMALL, "documents": 5}), cache)
    assert other != folder and ShardSet(other, "train").num_documents == 10
    assert capsys.readouterr().out.startswith("synthesized 10 documents")


def test_a_write_killed_midway_is_cleared_and_redone(tmp_path, capsys):
    cache = tmp_path / "cache"
    folder = synthesized_dir(Synthesized(**SMALL), cache)
    shutil.rmtree(folder)  # as if the writer had been killed before its rename
    stale = cache / f".{folder.name}.x1y2.partial"
    stale.mkdir()
    (stale / "train-00000-00000.tokens.npy").write_bytes(b"half")
    capsys.readouterr()
    assert synthesized_dir(Synthesized(**SMALL), cache) == folder
    assert "synthesized 8 documents" in capsys.readouterr().out
    assert not stale.exists() and ShardSet(folder, "train").num_documents == 8


def test_a_folder_whose_manifest_disagrees_with_its_name_is_refused(tmp_path):
    cache = tmp_path / "cache"
    folder = synthesized_dir(Synthesized(**SMALL), cache)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["sources"][0]["seed"] = 4  # edited, or written by another version
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"holds documents synthesized with other settings"):
        synthesized_dir(Synthesized(**SMALL), cache)


def test_the_datamodule_reads_a_mix_named_by_its_settings(tmp_path, capsys):
    config = DataConfig(
        shards=[SMALL], seq_len=128, micro_batch_size=1, cache_dir=str(tmp_path / "cache")
    )
    dm = LongCtxDataModule(config)
    dm.prepare_data()
    assert "synthesized 8 documents" in capsys.readouterr().out
    assert dm.folders() == [synthesized_dir(Synthesized(**SMALL), tmp_path / "cache")]
    assert (
        dm.vocab_size == ByteTokenizer().vocab_size
        and next(iter(dm.train_dataloader())).tokens.shape[-1] == 128
    )


def test_refusals_leave_no_out_folder_behind(tmp_path, capsys):
    # refused midway, once documents are being written: a copy needle is longer than 8 tokens
    with pytest.raises(RulerInputError, match=r"copy does not fit --max-length 8"):
        synthesize("copy", tmp_path / "a" / "b" / "y", min_length=4, max_length=8, haystack="noise")
    assert list(tmp_path.iterdir()) == []  # neither --out nor the folders made for it
    (tmp_path / "empty").mkdir()  # a user's empty folder stays as it was
    with pytest.raises(SystemExit) as exit_:
        cli(["--tasks", "copy", "--min-length", "4", "--max-length", "8", "--haystack", "noise",
             "--out", str(tmp_path / "empty")])  # fmt: skip
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: copy does not fit") and err.count("\n") == 1
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]
    assert list((tmp_path / "empty").iterdir()) == []
