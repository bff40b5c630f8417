"""The leak probe's checks (longctx.probe.checks) in one process: they pass on correct setups
(sdpa, eager, fp32 and bf16, HF Llama and Qwen2 through longctx's adapter) and fail, naming the
row and document, on every injected bug and on transformers' own attention with its mask on.

Context parallelism over gloo ranks: tests/probe_cp_script.py (run by test_probe_cp.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from hf_features import to_hf_kwargs
from probe_fixtures import VOCAB, make_rows, save_hf

from longctx.context_shard import context_shard
from longctx.hf.adapter import load_hf_causal_lm
from longctx.model import Llama, LlamaConfig
from longctx.probe import inject
from longctx.probe.checks import (
    CONTROL_MARGIN,
    NOISE_FACTOR,
    NothingToProbe,
    Target,
    check_checks,
    check_tolerances,
    packed_lm_forward,
    positions,
    probe,
)


def tiny_llama(backend: str = "sdpa") -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB,
        max_seq_len=256, attn_backend=backend, loss_chunk_size=50,
    )  # fmt: skip
    return Llama(config).eval()


def target_of(model, reset: bool = True, bug: str | None = None, **kwargs) -> Target:
    shard = inject.shard_with_bug(lambda batch: batch, bug)
    return Target(packed_lm_forward(model), VOCAB, reset, shard=shard, **kwargs)


def results(report) -> dict:
    return {r.check: r for r in report.results}


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


# ------------------------------------------------------------------ passing setups
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("reset", [True, False], ids=["reset", "continuous"])
def test_passes_on_a_masked_backend(backend, reset):
    report = probe(target_of(tiny_llama(backend), reset), [make_rows(reset)])
    assert report.passed, report.table()
    got = results(report)
    assert set(got) == {
        "boundary_loss/crossing", "boundary_loss/pad", "positions", "noise_floor/logits",
        "noise_floor/loss", "positive_control", "isolation/logits", "isolation/loss",
        "equivalence/logits", "equivalence/loss",
    }  # fmt: skip
    # a masked backend computes the other documents bitwise alike: nothing moves at all
    assert got["noise_floor/logits"].measured == 0 and got["isolation/logits"].measured == 0
    assert got["isolation/logits"].tolerance == torch.finfo(torch.float32).eps
    assert got["equivalence/logits"].measured < 1e-5 == got["equivalence/logits"].tolerance
    assert got["positive_control"].measured > 0.1  # a changed token moves its document a lot


def test_bf16_tolerances_follow_the_compute_dtype():
    target = target_of(tiny_llama(), context=bf16_autocast)
    report = probe(target, [make_rows()])
    assert report.passed, report.table()
    got = results(report)
    eps = torch.finfo(torch.bfloat16).eps
    assert got["isolation/logits"].tolerance == eps
    assert got["equivalence/logits"].tolerance == 4 * eps
    assert got["positive_control"].tolerance == CONTROL_MARGIN * eps
    assert got["positive_control"].measured > CONTROL_MARGIN * eps


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_passes_on_hf_models_through_the_adapter(family, tmp_path):
    path = save_hf(family, tmp_path, **HF_SIZES)
    model = load_hf_causal_lm(path, attn_backend="sdpa", loss_chunk_size=40).eval()
    for reset in (True, False):
        report = probe(target_of(model, reset), [make_rows(reset)])
        assert report.passed, report.table()


def test_the_noise_floor_is_measured_and_sets_the_tolerance():
    """A forward that wobbles by a fixed amount on every call: the repeats measure it, and the
    isolation tolerance becomes NOISE_FACTOR times it (so the wobble does not fail isolation)."""
    forward = packed_lm_forward(tiny_llama())
    calls = []

    def wobbling(batch):
        logits, loss = forward(batch)
        calls.append(1)
        return logits + 1e-4 * (len(calls) % 2), loss

    report = probe(Target(wobbling, VOCAB, True), [make_rows()])
    got = results(report)
    assert got["noise_floor/logits"].measured > 0
    assert got["isolation/logits"].tolerance == pytest.approx(
        NOISE_FACTOR * got["noise_floor/logits"].measured
    )
    assert got["isolation/logits"].verdict == "pass", report.table()


# ------------------------------------------------------------------ injected bugs
def test_catches_attention_causal_over_the_row():
    report = probe(target_of(tiny_llama(), bug="causal_row"), [make_rows()])
    failure = report.first_failure
    assert failure.check == "isolation/logits"
    assert failure.measured > 1e3 * failure.tolerance  # a leak is far above the noise
    assert failure.where.startswith("row 0, document 1 (tokens 5:35) moved by")
    assert "when document 0 (tokens 0:5)" in failure.where
    assert results(report)["equivalence/logits"].verdict == "fail"
    assert "FAIL isolation/logits [rows] row 0, document 1" in report.summary()


def test_catches_loss_in_the_pad_tail():
    rows = inject.rows_with_bug([make_rows()], "pad_loss")
    report = probe(target_of(tiny_llama()), rows)
    failure = report.first_failure
    assert (failure.check, failure.measured) == ("boundary_loss/pad", 3 + 15)
    assert failure.where.startswith("row 0: 3 target(s) in the pad tail")
    assert "document 5 (tokens 93:96, pad tail)" in failure.where


def test_catches_targets_across_a_document_end():
    rows = inject.rows_with_bug([make_rows()], "crossing_targets")
    failure = probe(target_of(tiny_llama()), rows).first_failure
    assert failure.check == "boundary_loss/crossing"
    # every segment end followed by another segment: 5 + 1 + 6
    assert failure.measured == 12
    assert "the first at token 4 of document 0 (tokens 0:5)" in failure.where


def test_positions_restarting_at_chunk_edges_are_named():
    """The position check on rank 0's context shard (no process group needed: it only reads
    position ids): positions that restart at a chunk edge are caught, the token named."""
    rows = make_rows(reset=True)
    shard = context_shard(rows.batch, 0, 2, balance="head_tail")  # chunks [0, 24) and [72, 96)
    assert positions(rows, shard, reset=True).verdict == "pass"
    broken = positions(rows, inject.restart_at_chunk_edges(shard), reset=True)
    assert broken.verdict == "fail"
    # row 0: the document [53, 93) crosses the edge at 72, restarting there at 0
    assert broken.where.startswith("row 0, document 4 (tokens 53:93)")
    assert "the first, at token 72, is 0, expected 19" in broken.where
    continuous = make_rows(reset=False)
    shard = inject.restart_at_chunk_edges(
        context_shard(continuous.batch, 0, 2, balance="head_tail")
    )
    assert "at token 72, is 0, expected 72" in positions(continuous, shard, reset=False).where


def test_wrong_arm_is_caught_by_positions():
    report = probe(target_of(tiny_llama(), reset=True), [make_rows(reset=False)], ["positions"])
    assert report.first_failure.where.startswith("row 0, document 1 (tokens 5:35)")
    assert "is 5, expected 0" in report.first_failure.where


def test_a_context_blind_model_fails_the_positive_control():
    """Logits from each token's embedding alone: nothing can leak, but nothing could be seen
    either; the probe says it cannot tell a leak from noise instead of passing."""
    model = tiny_llama()

    def blind(batch):
        logits = F.linear(model.tok_embeddings(batch.tokens), model.output_weight)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
        return logits, loss.view(batch.shape)

    report = probe(Target(blind, VOCAB, True), [make_rows()], ["isolation"])
    assert report.first_failure.check == "positive_control"
    assert "cannot tell a leak from noise" in report.first_failure.where


# ------------------------------------------------------------------ transformers' own attention
HF_SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=256)


def stock_forward(hf_model, mask: bool):
    """A stock transformers causal LM fed through to_hf_kwargs; ``mask``: the attention mask
    left on (all ones), as a generic training loop passes it."""

    def forward(batch):
        kwargs = to_hf_kwargs(batch)
        for key in ("labels", "shift_labels"):
            kwargs.pop(key)
        if mask:
            kwargs["attention_mask"] = torch.ones_like(batch.tokens)
        logits = hf_model(**kwargs, use_cache=False).logits
        flat = F.cross_entropy(
            logits.flatten(0, 1).float(), batch.labels.flatten(), reduction="none"
        )
        return logits, flat.view(batch.shape)

    return forward


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_stock_transformers_with_the_mask_on_leaks(family, tmp_path):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        save_hf(family, tmp_path, **HF_SIZES), attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    leaky = probe(Target(stock_forward(hf_model, mask=True), VOCAB, True), [make_rows()])
    assert leaky.first_failure.check == "isolation/logits", leaky.table()
    assert leaky.first_failure.where.startswith("row 0, document 1 (tokens 5:35) moved")
    # transformers' packed-sequence detection (reset positions, no mask, no cache) does mask
    masked = probe(Target(stock_forward(hf_model, mask=False), VOCAB, True), [make_rows()])
    assert results(masked)["isolation/logits"].verdict == "pass", masked.table()


# ------------------------------------------------------------------ bad input, output
def test_rows_of_one_document_each_are_refused():
    rows = make_rows(lengths=[[93], [96], [81]], pads=[3, 0, 15])
    with pytest.raises(NothingToProbe, match=r"nothing to probe: every row holds one document"):
        probe(target_of(tiny_llama()), [rows])


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -1e-6, "abc", True])
def test_bad_tolerances_are_refused(value):
    with pytest.raises(ValueError, match=r"tolerance isolation=.* is not a finite positive"):
        check_tolerances({"isolation": value})


def test_unknown_check_names_are_refused():
    with pytest.raises(ValueError, match=r"unknown check name \(isolatoin\); choose from"):
        check_checks(["isolatoin"])
    with pytest.raises(ValueError, match=r"unknown check name in a tolerance \(positions\)"):
        check_tolerances({"positions": 1e-3})
    assert check_checks(["isolation", "isolation"]) == ("isolation",)


def test_a_tolerance_override_replaces_the_measured_one(tmp_path):
    report = probe(target_of(tiny_llama()), [make_rows()], tolerances={"equivalence": 1e-9})
    got = results(report)
    assert got["equivalence/logits"].tolerance == 1e-9
    assert report.passed == (got["equivalence/logits"].measured <= 1e-9)
    saved = json.loads(report.write_json(tmp_path / "p.json").read_text())
    assert saved["passed"] == report.passed and len(saved["results"]) == len(report.results)
    header, rule, *lines = report.table().splitlines()
    assert [c.strip() for c in header.split("|")[1:-1]] == [
        "check", "rows", "measured", "tolerance", "verdict"
    ]  # fmt: skip
    assert len(lines) == len(report.results) and set(rule) == {"|", "-"}


def test_only_the_asked_checks_run():
    report = probe(target_of(tiny_llama(), bug="causal_row"), [make_rows()], ["positions"])
    assert [r.check for r in report.results] == ["positions"] and report.passed


def test_the_bug_switch_names_its_bugs(monkeypatch):
    monkeypatch.setenv(inject.ENV, "nonsense")
    with pytest.raises(ValueError, match="LONGCTX_PROBE_INJECT='nonsense'; expected one of"):
        inject.injected()
    monkeypatch.setenv(inject.ENV, "causal_row")
    assert inject.injected() == "causal_row"


def test_every_backend_of_the_machine_without_hydra(tmp_path, capsys):
    """What scripts/gpu_check.sh runs on a lent GPU, here on the CPU: flash cannot run and is
    listed as skipped with the reason; flex (forward only on CPU) and sdpa are probed."""
    from longctx.probe import backends

    args = ["--device", "cpu", "--backends", "sdpa,flex,flash", "--dtypes", "float32"]
    assert backends.main([*args, "--seq-len", "512", "--out", str(tmp_path)]) == 0
    saved = {c["backend"]: c for c in json.loads((tmp_path / "backends.json").read_text())}
    assert saved["sdpa"]["passed"] and saved["flex"]["passed"]
    assert saved["flash"]["skipped"].startswith("skipped: attn_backend='flash' needs a CUDA")
    assert "| flex | float32 | PASS |" in capsys.readouterr().out


def test_the_backend_probe_refuses_a_dtype_before_probing(tmp_path, capsys):
    """A wrong --dtypes name is one line and exit 2 before any backend runs (it was a traceback
    after the names before it had been probed)."""
    from longctx.probe import backends

    args = ["--device", "cpu", "--backends", "sdpa", "--dtypes", "float32,fp99"]
    with pytest.raises(SystemExit) as stop:
        backends.main([*args, "--seq-len", "512", "--out", str(tmp_path)])
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert "--dtypes='fp99'" in err and "float32" in err and "== sdpa" not in out
    assert not (tmp_path / "backends.json").exists()
