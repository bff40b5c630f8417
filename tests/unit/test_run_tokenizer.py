"""The tokenizer of a run is the tokenizer of its data: the manifests' (which must agree), never
``data.tokenizer`` alone. A data.tokenizer or an export's --tokenizer that disagrees is refused
in one line naming both; an export carries the data's tokenizer without being told."""

from __future__ import annotations

import json
import shutil

import pytest
from export_helpers import make_user_run, make_user_tokenizer, model_overrides
from helpers import CACHE_DIR

from longctx.data.config import DataConfig
from longctx.data.corpus import default_corpus_dir
from longctx.data.run_tokenizer import run_tokenizer
from longctx.data.tokenizer import HFTokenizer, tokenizer_source
from longctx.hf.export import cli, export

BYTE_SPEC = {"kind": "byte", "vocab_size": 259}


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("user-run")
    source = make_user_tokenizer(root / "tok")
    return source, make_user_run(root, source, model_overrides(vocab_size=300))


def test_the_run_tokenizer_is_the_one_its_data_was_prepared_with(user_run):
    source, run = user_run
    byte = default_corpus_dir(CACHE_DIR)
    assert run_tokenizer(DataConfig(shards=[str(byte)], cache_dir=str(CACHE_DIR))) == BYTE_SPEC
    data = run.parent / "user-data"
    spec = run_tokenizer(DataConfig(shards=[str(data)]))  # data.tokenizer unset
    assert spec["kind"] == "hf" and spec["path"] == str(source.resolve())


def test_a_data_tokenizer_that_disagrees_with_the_data_is_refused_naming_both():
    byte = default_corpus_dir(CACHE_DIR)
    config = DataConfig(tokenizer="llama3", shards=[str(byte)], cache_dir=str(CACHE_DIR))
    with pytest.raises(ValueError) as err:
        run_tokenizer(config)
    message = str(err.value)
    assert "prepared with tokenizer 'byte', not data.tokenizer='llama3'" in message
    assert str(byte) in message and len(message.splitlines()) == 1


def test_folders_prepared_with_two_tokenizers_are_refused(user_run):
    byte = default_corpus_dir(CACHE_DIR)
    config = DataConfig(shards=[str(byte), str(user_run[1].parent / "user-data")])
    with pytest.raises(ValueError, match="expected one tokenizer for all folders"):
        run_tokenizer(config)


def test_the_export_carries_the_datas_tokenizer_without_being_told(user_run, tmp_path):
    """The run's data.tokenizer is unset: the export once carried the 259-id byte tokenizer."""
    source, run = user_run
    out = export(run, tmp_path / "hf").folder
    exported = json.loads((out / "tokenizer.json").read_text())
    assert exported["model"] == json.loads((source / "tokenizer.json").read_text())["model"]
    ids = HFTokenizer(out).encode("In the beginning God created").tolist()
    assert ids == HFTokenizer(source).encode("In the beginning God created").tolist()


def test_an_export_tokenizer_that_disagrees_with_the_data_is_refused(user_run, tmp_path, capsys):
    _, run = user_run
    with pytest.raises(SystemExit) as exit_info:
        cli([str(run), "--out", str(tmp_path / "hf"), "--tokenizer", "byte"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not --tokenizer='byte'" in err, err
    assert not (tmp_path / "hf").exists()


def test_a_moved_tokenizer_folder_is_the_same_tokenizer_an_edited_one_is_not(user_run, tmp_path):
    source, run = user_run
    moved = shutil.copytree(source, tmp_path / "moved")
    assert export(run, tmp_path / "hf", tokenizer=moved).folder.is_dir()
    edited = shutil.copytree(source, tmp_path / "edited")
    config = json.loads((edited / "tokenizer_config.json").read_text())
    (edited / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<s>"}))
    with pytest.raises(ValueError, match=r"not --tokenizer="):
        export(run, tmp_path / "hf2", tokenizer=edited)


def test_a_tokenizer_folder_changed_since_prepare_is_refused(tmp_path):
    source = make_user_tokenizer(tmp_path / "tok")
    run = make_user_run(tmp_path, source, model_overrides(vocab_size=300))
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>"}))
    with pytest.raises(ValueError, match=r"has changed since the data was prepared with it"):
        export(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_data_not_on_this_machine_needs_tokenizer_and_says_it_is_used(tmp_path, capsys):
    source = make_user_tokenizer(tmp_path / "tok")
    run = make_user_run(tmp_path, source, model_overrides(vocab_size=300))
    shutil.rmtree(tmp_path / "user-data")
    with pytest.raises(SystemExit) as exit_info:
        cli([str(run), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert "the run's data, whose tokenizer the export carries, is not readable here" in err
    assert export(run, tmp_path / "hf", tokenizer=source).folder.is_dir()
    assert f"exporting with --tokenizer {source}" in capsys.readouterr().out


def test_a_tokenizer_folder_gone_since_prepare_is_named_and_a_copy_exports(tmp_path):
    source = make_user_tokenizer(tmp_path / "tok")
    run = make_user_run(tmp_path, source, model_overrides(vocab_size=300))
    copy = shutil.copytree(source, tmp_path / "copy")
    shutil.rmtree(source)
    with pytest.raises(FileNotFoundError, match=r"tokenizer folder .*tok, which is gone"):
        export(run, tmp_path / "hf")
    assert export(run, tmp_path / "hf", tokenizer=copy).folder.is_dir()


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"kind": "evil"}, "has unknown kind"),
        ({"kind": "hf"}, "which is gone"),
        ({"kind": "hf", "path": 5}, "which is gone"),
        ({"kind": "byte", "sha256": 5}, "has changed since the data was prepared"),
    ],
)
def test_a_hand_edited_manifest_spec_is_refused_in_one_line(spec, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message) as err:
        tokenizer_source(spec)
    assert len(str(err.value).splitlines()) == 1
