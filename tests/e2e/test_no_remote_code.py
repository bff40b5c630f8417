"""A transformers folder is data: a folder whose config.json (or tokenizer_config.json) has an
``auto_map`` ships code of its own, and every longctx path that opens a folder (model=hf
training, the probe, eval of a model=hf checkpoint, eval --hf, export, verify) refuses it in one
line before transformers sees it; no loader option (trust_remote_code, revision, token, ...) may
come from a stored record or model.config_overrides. The folder's code never runs.

Also here: ``python -m longctx.eval`` of a model=hf checkpoint works (per-position loss and the
suite) with the checkpoint's weights, not the base folder's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import CACHE_DIR, FAST, compose
from probe_fixtures import save_hf

from longctx.eval import cli as eval_cli
from longctx.eval.ruler.hf import load_hf_folder
from longctx.hf import HFModelSpec
from longctx.hf.export import export
from longctx.hf.folders import LOADER_OPTIONS, RemoteCodeRefused
from longctx.hf.verify import verify
from longctx.probe import cli as probe_cli
from longctx.runs.record import CHECKPOINT_KEY, RecordError
from longctx.train.app import recorded_config, run

SIZES = dict(vocab_size=300, hidden_size=32, intermediate_size=64, max_position_embeddings=512)
CUSTOM_MODULE = """
open({marker!r}, "w").write("the folder's code ran")
from transformers import LlamaConfig, LlamaForCausalLM

class CustomConfig(LlamaConfig):
    model_type = "custom_llama"

class CustomModel(LlamaForCausalLM):
    config_class = CustomConfig
"""


def one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(a plain tiny Llama folder, a copy with auto_map code that writes ``marker``, marker)."""
    root = tmp_path_factory.mktemp("remote")
    plain = save_hf("llama", root / "plain", **SIZES)
    marker = root / "code_ran"
    hostile = save_hf("llama", root / "hostile", **SIZES)
    config = json.loads((root / "hostile" / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "custom_llama.CustomConfig",
                          "AutoModelForCausalLM": "custom_llama.CustomModel"}  # fmt: skip
    (root / "hostile" / "config.json").write_text(json.dumps(config))
    (root / "hostile" / "custom_llama.py").write_text(CUSTOM_MODULE.format(marker=str(marker)))
    return plain, hostile, marker


def test_the_hostile_folder_is_live(folders, tmp_path):
    """Positive control: transformers itself, told to trust it, runs the folder's code."""
    _, hostile, marker = folders
    code = (
        "import transformers, sys; "
        "transformers.AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code, hostile], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert marker.exists()
    marker.unlink()


def stored_hf_run(root, model_node: dict, weights: dict | None = None):
    """A model=hf run's checkpoint: the record's model node as given, the FAST data config."""
    cfg = compose([*FAST, "model=hf", f"model.path={model_node['path']}"], output_dir=root)
    config = recorded_config(cfg)
    config["model"] = model_node
    ckpt = root / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    record = {"identity": {}, "config": json.loads(json.dumps(config))}
    torch.save({"state_dict": weights or {}, CHECKPOINT_KEY: record}, ckpt)
    return ckpt


# --------------------------------------------------------------------------- refused
def test_the_spec_refuses_an_auto_map_folder_naming_it(folders):
    _, hostile, marker = folders
    with pytest.raises(RemoteCodeRefused, match="auto_map") as err:
        HFModelSpec(path=hostile)
    assert str(hostile) in one_line(err)
    assert not marker.exists()


@pytest.mark.parametrize(
    "option",
    ["trust_remote_code", "code_revision", "revision", "token", "cache_dir", "_commit_hash"],
)
def test_no_loader_option_comes_from_config_overrides(folders, option):
    plain, _, _ = folders
    with pytest.raises(ValueError, match=f"config_overrides.{option} is a loader option") as err:
        HFModelSpec(path=plain, config_overrides={option: True})
    one_line(err)


def test_a_nested_loader_option_is_refused(folders):
    plain, _, _ = folders
    nested = {"text_config": {"trust_remote_code": True}}
    with pytest.raises(ValueError, match=r"text_config\.trust_remote_code is a loader option"):
        HFModelSpec(path=plain, config_overrides=nested)


def test_longctx_options_and_unknown_fields_are_named(folders):
    plain, _, _ = folders
    with pytest.raises(ValueError, match="dtype is set by longctx from model.dtype"):
        HFModelSpec(path=plain, config_overrides={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="no_such_field is not a field of LlamaConfig"):
        HFModelSpec(path=plain, config_overrides={"no_such_field": 1})
    spec = HFModelSpec(path=plain, config_overrides={"max_position_embeddings": 1024})
    assert spec.max_seq_len == 1024 and {"trust_remote_code", "revision"} <= LOADER_OPTIONS


def test_a_stored_record_with_trust_remote_code_runs_nothing(folders, tmp_path):
    """eval and export of a checkpoint whose record names the allowed HFModelSpec with
    trust_remote_code and the auto_map folder: refused, nothing runs, nothing written."""
    plain, hostile, marker = folders
    node = {"_target_": "longctx.hf.HFModelSpec", "path": str(hostile),
            "config_overrides": {"trust_remote_code": True}}  # fmt: skip
    ckpt = stored_hf_run(tmp_path / "run", node)
    with pytest.raises((RecordError, ValueError), match="auto_map|loader option") as err:
        eval_cli.main([str(ckpt), "--no-probe", "--cache-dir", str(CACHE_DIR)])
    one_line(err)
    with pytest.raises((RecordError, ValueError), match="auto_map|loader option") as err:
        export(ckpt, tmp_path / "out")
    one_line(err)
    node["path"] = str(plain)  # a clean folder: the loader option alone is refused
    ckpt2 = stored_hf_run(tmp_path / "run2", node)
    with pytest.raises(ValueError, match="trust_remote_code is a loader option"):
        eval_cli.main([str(ckpt2), "--no-probe", "--cache-dir", str(CACHE_DIR)])
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_verify_refuses_an_export_with_auto_map(folders, tmp_path):
    _, hostile, marker = folders
    import shutil

    folder = shutil.copytree(hostile, tmp_path / "export")
    record = {"checkpoint": str(tmp_path / "nowhere.ckpt"), "trained_length": 64,
              "max_position_embeddings": 128}  # fmt: skip
    (folder / "longctx_export.json").write_text(json.dumps(record))
    with pytest.raises(RemoteCodeRefused, match="auto_map") as err:
        verify(folder)
    one_line(err)
    assert not marker.exists()


def test_a_tokenizer_config_with_auto_map_is_refused(folders, tmp_path):
    plain, _, marker = folders
    import shutil

    folder = shutil.copytree(plain, tmp_path / "tok")
    config = {"auto_map": {"AutoTokenizer": ["custom_tok.Tok", None]}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(RemoteCodeRefused, match="tokenizer_config.json has auto_map"):
        load_hf_folder(folder)


@pytest.mark.parametrize(
    "value",
    ["kernels-community/flash-attn", "org/repo@v1:fn", "flash_attention_2",
     {"": "sdpa", "text_config": "org/repo"}],
)  # fmt: skip
def test_a_config_naming_attention_code_from_elsewhere_is_refused(folders, tmp_path, value):
    """attn_implementation "<org>/<repo>" in a folder's config.json reaches transformers' hub
    kernel loader (a download, then its code runs); flash_attention_2 falls back to one. Every
    path that opens a folder refuses it, naming the key; transformers' local ones load."""
    plain, _, _ = folders
    import shutil

    folder = shutil.copytree(plain, tmp_path / "kernel")
    config = json.loads((folder / "config.json").read_text())
    for key in ("attn_implementation", "_attn_implementation"):
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(RemoteCodeRefused, match=f"sets {key}=") as err:
            load_hf_folder(folder)  # python -m longctx.eval --hf DIR
        assert str(folder) in one_line(err)
        with pytest.raises(RemoteCodeRefused, match=f"sets {key}="):
            HFModelSpec(path=folder)  # model=hf, eval and export of its runs, the probe
    (folder / "config.json").write_text(json.dumps({**config, "attn_implementation": "sdpa"}))
    HFModelSpec(path=folder).build()


def test_eval_hf_training_and_the_probe_refuse_it(folders, tmp_path):
    _, hostile, marker = folders
    with pytest.raises(RemoteCodeRefused) as err:
        load_hf_folder(hostile)  # python -m longctx.eval --hf DIR --suite ruler
    one_line(err)
    cfg = compose([*FAST, "model=hf", f"model.path={hostile}"], output_dir=tmp_path / "train")
    with pytest.raises(ValueError, match="auto_map") as err:
        run(cfg)  # python train.py model=hf model.path=DIR
    one_line(err)
    overrides = [*FAST, "model=hf", f"model.path={hostile}", f"paths.root_dir={tmp_path}"]
    with pytest.raises(ValueError, match="auto_map") as err:
        probe_cli.main(overrides)  # python -m longctx.probe model=hf model.path=DIR
    one_line(err)
    assert not marker.exists()


def test_a_json_error_names_the_file(folders, tmp_path):
    plain, _, _ = folders
    import shutil

    folder = shutil.copytree(plain, tmp_path / "broken")
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json cannot be read as JSON") as err:
        HFModelSpec(path=folder)
    one_line(err)


# --------------------------------------------------------------------------- model=hf eval works
def test_eval_of_a_model_hf_checkpoint_uses_its_weights(folders, tmp_path):
    """The per-position loss of a model=hf checkpoint is that of the checkpoint's weights (here
    the base folder's, perturbed), not the base folder's."""
    plain, _, _ = folders
    spec = HFModelSpec(path=plain, attn_backend="sdpa")
    model = spec.build()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    weights = {f"model.{k}": v for k, v in model.state_dict().items()}
    node = {"_target_": "longctx.hf.HFModelSpec", "path": str(plain), "attn_backend": "sdpa"}
    ckpt = stored_hf_run(tmp_path / "run", node, weights)
    args = ["--no-probe", "--long-factor", "1", "--cache-dir", str(CACHE_DIR)]
    ours = eval_cli.main([str(ckpt), "--out", str(tmp_path / "eval"), *args])
    stored_model = eval_cli.load_model(
        eval_cli.read_stored_run(ckpt, eval_cli.CONFIG_TARGETS), spec, "cpu"
    )
    for name, tensor in model.state_dict().items():
        assert torch.equal(stored_model.state_dict()[name], tensor), name
    base = stored_hf_run(tmp_path / "base", node, {f"model.{k}": v for k, v in
                                                  spec.build().state_dict().items()})  # fmt: skip
    theirs = eval_cli.main([str(base), "--out", str(tmp_path / "base_eval"), *args])
    assert ours["val_loss"] != pytest.approx(theirs["val_loss"], rel=1e-3)
    assert (tmp_path / "eval" / "position_loss.csv").is_file()
    suite = eval_cli.main([str(ckpt), "--suite", "ruler", "--tasks", "lc_passkey", "--lengths",
                           "128", "--depths", "0.5", "--samples", "1", "--cache-dir",
                           str(CACHE_DIR), "--out", str(tmp_path / "ruler")])  # fmt: skip
    assert (tmp_path / "ruler" / "ruler_results.csv").is_file() and suite


def test_a_model_hf_record_that_does_not_fit_its_weights_is_refused(folders, tmp_path):
    plain, _, _ = folders
    node = {"_target_": "longctx.hf.HFModelSpec", "path": str(plain)}
    weights = {"model.hf_model.model.embed_tokens.weight": torch.zeros(10, 32)}
    ckpt = stored_hf_run(tmp_path / "run", node, weights)
    args = ["--no-probe", "--long-factor", "1", "--cache-dir", str(CACHE_DIR)]
    with pytest.raises(ValueError, match="not the model's: missing") as err:
        eval_cli.main([str(ckpt), *args])
    assert str(ckpt) in one_line(err)
