"""What a handed-over transformers folder can do to ``python -m longctx.eval --hf DIR``: its
generation_config.json changes no greedy prediction, a NaN weight is refused, and a broken
tokenizer, truncated weights or a vocabulary that does not fit the tokenizer is one line, never
a traceback."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import CACHE_DIR
from probe_fixtures import save_hf

from longctx.eval import cli as eval_cli
from longctx.hf.export_tokenizer import write_byte_tokenizer

SIZES = dict(vocab_size=300, hidden_size=32, intermediate_size=64, max_position_embeddings=512)
SUITE = ["--suite", "ruler", "--tasks", "lc_passkey", "--lengths", "128",
         "--depths", "0.25", "0.75", "--samples", "2", "--cache-dir", str(CACHE_DIR)]  # fmt: skip


def hf_folder(folder, **sizes) -> str:
    """A seeded tiny Llama with the byte tokenizer (259 ids) beside it: a folder eval --hf scores."""
    save_hf("llama", folder, **{**SIZES, **sizes})
    write_byte_tokenizer(folder, SIZES["max_position_embeddings"])
    return str(folder)


def copy(folder, dest) -> str:
    return str(shutil.copytree(folder, dest))


def predictions(folder, out) -> list[str]:
    summary = eval_cli.main(["--hf", str(folder), *SUITE, "--out", str(out)])
    assert summary["instances"] == 4
    import pandas as pd

    return pd.read_csv(out / "ruler_results.csv")["prediction"].fillna("").tolist()


def one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("hf") / "plain")


# --------------------------------------------------------------------------- greedy is greedy
def test_generation_config_json_changes_no_prediction(plain, tmp_path):
    """A folder's generation_config.json with a repetition penalty, suppressed tokens and a
    minimum length gives the same greedy predictions as the folder without one (transformers
    fills every unset setting from it)."""
    base = predictions(plain, tmp_path / "base")
    hostile = copy(plain, tmp_path / "hostile")
    config = json.loads((tmp_path / "hostile" / "generation_config.json").read_text())
    config.update(repetition_penalty=50.0, suppress_tokens=list(range(0, 256)),
                  min_new_tokens=5, no_repeat_ngram_size=1, temperature=3.0)  # fmt: skip
    (tmp_path / "hostile" / "generation_config.json").write_text(json.dumps(config))
    assert predictions(hostile, tmp_path / "theirs") == base


# --------------------------------------------------------------------------- NaN weights
def test_a_nan_weight_is_refused_by_eval_and_export(tmp_path):
    """init_from refused a checkpoint holding a NaN; eval (both modes), eval --hf and export
    scored or exported it with exit 0. All use init_from's one check now."""
    import torch
    from export_helpers import make_run
    from safetensors.torch import load_file, save_file

    from longctx.hf.export import export

    run = make_run(tmp_path / "nan")
    ckpt = run / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    state["state_dict"]["model.layers.1.feed_forward.w2.weight"][0, 0] = float("nan")
    torch.save(state, ckpt)
    for mode in (["--no-probe"], SUITE):
        with pytest.raises(ValueError, match=r"last\.ckpt holds NaN or infinite values in "
                           r"layers\.1\.feed_forward\.w2\.weight") as err:  # fmt: skip
            eval_cli.main([str(ckpt), *mode, "--out", str(tmp_path / "eval")])
        one_line(err)
    with pytest.raises(ValueError, match="holds NaN or infinite values in layers.1"):
        export(ckpt, tmp_path / "hf")
    assert not (tmp_path / "eval").exists() and not (tmp_path / "hf").exists()
    folder = hf_folder(tmp_path / "nan_hf")
    weights = load_file(f"{folder}/model.safetensors")
    weights["model.norm.weight"][3] = float("inf")
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"--hf folder .*nan_hf holds NaN or infinite values "
                       r"in model\.norm\.weight"):  # fmt: skip
        eval_cli.main(["--hf", folder, *SUITE, "--out", str(tmp_path / "eval")])


# --------------------------------------------------------------------------- one line, no traceback
def _break_tokenizer(folder):
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')


def _truncate_weights(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _sparse_tokenizer_id(folder):
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["zz"] = 5000  # an id past the model's 300 rows
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))


def _drop_a_weight(folder):
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    weights.pop("model.layers.1.mlp.down_proj.weight")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def _deep_config(folder):
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize(
    "damage, sizes, message",
    [
        (_break_tokenizer, {}, r"tokenizer\.json cannot be read as a tokenizers tokenizer\.json"),
        (_truncate_weights, {}, "its weights cannot be read .SafetensorError"),
        (None, {"vocab_size": 100}, "tokenizer has ids up to 258, but config.json's vocab_size "
                                    "is 100"),
        (_sparse_tokenizer_id, {}, "tokenizer has ids up to 5000, but config.json's vocab_size"),
        (_drop_a_weight, {}, r"lack or misshape 1 .* \(model\.layers\.1\.mlp\.down_proj\.weight\)"),
        (_deep_config, {}, r"config\.json cannot be read as JSON \(maximum recursion"),
    ],
    ids=["tokenizer", "truncated", "vocab100", "sparse_id", "missing_weight", "deep_json"],
)  # fmt: skip
def test_a_broken_hf_folder_is_one_line(tmp_path, capsys, damage, sizes, message):
    from pathlib import Path

    folder = Path(hf_folder(tmp_path / "f", **sizes))
    if damage:
        damage(folder)
    with pytest.raises(SystemExit) as exit_:
        eval_cli.cli(["--hf", str(folder), *SUITE, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and err.startswith("error: "), err
    import re

    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_an_attention_backend_the_device_lacks_is_one_line(tmp_path, plain):
    """--backend flash on a CPU: refused before the model loads (was a RuntimeError at the first
    forward); with --hf, --backend is refused (transformers' own attention scores it)."""
    from export_helpers import make_run

    ckpt = make_run(tmp_path / "run") / "checkpoints" / "last.ckpt"
    for mode in (["--no-probe"], SUITE):
        with pytest.raises(ValueError, match="attention backend 'flash' .* cannot run on "
                           "--device cpu") as err:  # fmt: skip
            eval_cli.main([str(ckpt), "--backend", "flash", *mode])
        one_line(err)
    with pytest.raises(ValueError, match="--device bogus is not a device") as err:
        eval_cli.main([str(ckpt), "--device", "bogus", "--no-probe"])
    one_line(err)
    with pytest.raises(ValueError, match="--backend flash chooses longctx's attention"):
        eval_cli.main(["--hf", plain, "--backend", "flash", *SUITE])


# --------------------------------------------------------------------------- the CLI's inputs
def test_hf_without_qa_data_skips_qa_as_a_checkpoint_does(plain, monkeypatch, tmp_path):
    """--hf checked its settings twice, and the second check took the full task list for tasks
    the user named: "qa_1, qa_2 need --qa-data". Both paths now skip them (and say so)."""
    monkeypatch.setattr(eval_cli, "run_suite", lambda model, tok, settings, *a: settings)
    settings = eval_cli.main(["--hf", plain, "--suite", "ruler", "--lengths", "128"])
    assert {"qa_1", "qa_2"} <= set(settings.tasks) and settings.qa_data is None
    with pytest.raises(ValueError, match="qa_1 need --qa-data DIR"):  # named: refused
        eval_cli.main(["--hf", plain, "--suite", "ruler", "--tasks", "qa_1"])


def test_an_out_that_is_a_file_is_refused_before_scoring(plain, tmp_path, monkeypatch):
    from export_helpers import make_run

    def never(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(eval_cli, "load_model", never)
    monkeypatch.setattr(eval_cli, "load_hf_folder", never)
    taken = tmp_path / "taken"
    taken.write_text("the user's")
    ckpt = make_run(tmp_path / "run") / "checkpoints" / "last.ckpt"
    for given in (["--hf", plain, *SUITE], [str(ckpt), *SUITE], [str(ckpt), "--no-probe"]):
        for out in (taken, taken / "sub"):
            with pytest.raises(FileExistsError, match=f"{taken} is a file; expected a folder"):
                eval_cli.main([*given, "--out", str(out)])
    assert taken.read_text() == "the user's"


@pytest.mark.parametrize("option", ["--lengths", "--depths", "--probe-lengths", "--probe-depths"])
def test_an_option_given_no_values_is_refused(plain, option):
    """``--lengths`` with no values silently meant the defaults."""
    with pytest.raises(ValueError, match=f"{option} is given no values"):
        eval_cli.main(["--hf", plain, "--suite", "ruler", option])
