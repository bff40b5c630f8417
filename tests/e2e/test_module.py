"""The LightningModule: the loss is the token mean of the whole optimizer step."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import SCRIPTS, assert_close_scaled
from module_fixtures import cat_batches, fit, random_batch, small_module

from longctx.data.packing import collate_rows, make_packer
from longctx.data.streams import StreamBatch
from longctx.train.module import param_groups, warmup_cosine_schedule


def params(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def assert_params_close(a: dict, b: dict, rel: float = 2e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert_close_scaled(a[name], b[name], rel=rel, msg=name)


def test_accumulation_equals_one_big_batch():
    # micro-batches with very different numbers of target tokens: a per-micro-batch mean
    # would weight them unequally
    b1 = random_batch(1, [[3, 5, 7, 9, 40], [2, 2, 60]], 64)
    b2 = random_batch(2, [[64], [63]], 64)
    b3, b4 = random_batch(3, [[10, 54], [64]], 64), random_batch(4, [[1, 1, 62], [64]], 64)
    accumulated = small_module(accumulate=2)
    fit(accumulated, [b1, b2, b3, b4], max_steps=2)
    whole = small_module(accumulate=1)
    fit(whole, [cat_batches([b1, b2]), cat_batches([b3, b4])], max_steps=2)
    assert_params_close(params(accumulated), params(whole))


def test_per_micro_batch_mean_would_differ():
    """The equivalence above is not vacuous: the naive mean of means lands elsewhere."""
    b1 = random_batch(1, [[3, 5, 7, 9, 40], [2, 2, 60]], 64)
    b2 = random_batch(2, [[64], [63]], 64)
    m = small_module()
    token_mean = sum(m.model.loss(b)[0] for b in (b1, b2)) / (
        b1.num_loss_tokens + b2.num_loss_tokens
    )
    mean_of_means = sum(m.model.loss(b)[0] / b.num_loss_tokens for b in (b1, b2)) / 2
    assert abs(float(token_mean - mean_of_means)) > 1e-4


def test_logged_loss_is_step_token_mean():
    b1 = random_batch(5, [[3, 5, 7, 49], [64]], 64)
    b2 = random_batch(6, [[64], [20, 44]], 64)
    module = small_module(accumulate=2, lr=0.0)
    expected = (module.model.loss(b1)[0] + module.model.loss(b2)[0]).item() / (
        b1.num_loss_tokens + b2.num_loss_tokens
    )
    trainer = fit(module, [b1, b2], max_steps=1)
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process(tmp_path):
    out = tmp_path / "ddp_params.pt"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "ddp_equivalence_script.py"), str(out)],
        cwd=SCRIPTS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    import ddp_equivalence_script as script

    batches = script.rank_batches()
    single = small_module()
    steps = [cat_batches(batches[2 * s : 2 * s + 2]) for s in range(script.STEPS)]
    fit(single, steps, max_steps=script.STEPS)
    assert_params_close(torch.load(out, weights_only=True), params(single))


def test_no_weight_decay_on_norms_and_embeddings():
    module = small_module()
    decay, no_decay = param_groups(module.model, 0.1)
    names = {id(p): n for n, p in module.model.named_parameters()}
    assert all(p.ndim == 2 for p in decay["params"])
    assert not any("norm" in names[id(p)] or "embed" in names[id(p)] for p in decay["params"])
    assert any("norm" in names[id(p)] for p in no_decay["params"])
    assert no_decay["weight_decay"] == 0.0


def test_warmup_cosine_schedule():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = warmup_cosine_schedule(opt, total_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    lrs = []
    for _ in range(110):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] < lrs[5] < lrs[9] < 1.0  # linear warm-up
    assert lrs[10] == pytest.approx(1.0)  # the peak right after warm-up
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-6)  # half-way down the cosine
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_cosine_schedule(opt, total_steps=10, warmup_steps=-1, min_lr_ratio=0.1)


def test_compile_trains_like_eager_without_recompiling_for_new_layouts():
    """compile=true compiles every block around the attention call: the same updates as eager,
    and a batch with another document layout (another bucket plan) reuses the graphs."""
    batches = [
        random_batch(1, [[3, 5, 7, 9, 40], [2, 2, 60]], 64),
        random_batch(2, [[64], [30, 34]], 64),
        random_batch(3, [[1] * 16 + [48], [63, 1]], 64),
    ]
    eager = small_module()
    fit(eager, batches, max_steps=3)
    compiled = small_module(compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        fit(compiled, batches, max_steps=3)
    assert_params_close(params(compiled), params(eager), rel=2e-4)


@pytest.mark.parametrize("packer_name", ["concat_chunk", "best_fit"])
def test_packing_stats_are_the_packers_when_pad_is_eos(packer_name):
    """Pad id = EOS (as many tokenizers have it), and a 1-token document that is only its EOS:
    neither tokens nor labels tell pad apart, the packer's counts do."""
    eos = 7
    documents = [np.array(d + [eos]) for d in ([1, 2, 3], [], [4, 5], [], [6] * 9, [8])]
    packer = make_packer(packer_name, 8, pad_id=eos, buffer_size=3)
    rows = list(packer.pack(documents))
    batch = StreamBatch.of_rows(
        collate_rows(rows, reset_position_ids=True, document_mask=True), rows
    )
    assert int((batch.tokens == eos).sum()) > batch.pad_tokens > 0  # EOS tokens are not all pad
    moved = batch.to("cpu")  # the module reads the counts of the batch on its device
    efficiency, docs_per_row = moved.packing_efficiency, moved.docs_per_row
    assert efficiency == pytest.approx(packer.stats.efficiency)
    assert docs_per_row == pytest.approx(packer.stats.docs_per_row)
    assert efficiency == pytest.approx(sum(len(d) for d in documents) / batch.tokens.numel())
