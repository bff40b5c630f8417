"""The capacity planner: terms counted as the code keeps them, scaling, suggestions, dry_run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import FAST, compose

from longctx import planner
from longctx.batch import PackedBatch
from longctx.context_shard import context_shard
from longctx.model import Llama, LlamaConfig
from longctx.model.attention import attention_over_row, build_attention_metadata
from longctx.planner import PlanError, RunLayout
from longctx.planner.memory import ATTENTION_PHASE, ffn_activation_bytes, layer_activation_bytes
from longctx.planner.step_time import step_time
from longctx.train.app import ConfigError, run

TINY = LlamaConfig.from_name("tiny", attn_backend="sdpa", loss_chunk_size=4096)
LLAMA_8B = LlamaConfig.from_name("llama3_8b", attn_backend="flash", activation_checkpointing=False)
CPU = planner.Device("cpu", 24 * 2**30, None, 300 * 2**20, "measured")
H100 = planner.known_device("H100")


def no_gather(x: torch.Tensor) -> torch.Tensor:
    """A simulated rank's all_gather: these tests hand attention the whole rows themselves."""
    raise AssertionError("a simulated context-parallel rank gathered")


def term(plan: planner.CapacityPlan, prefix: str) -> int:
    (found,) = [t.bytes for t in plan.terms if t.name.startswith(prefix)]
    return found


def saved_by_one_block(
    config: LlamaConfig, length: int, autocast: bool, ffn_half_only: bool = False
) -> tuple[dict[int, int], int]:
    """{storage: bytes} of the distinct tensors autograd saves in one block's forward (weights
    and the RoPE tables, which every block shares, left out), or in its feed-forward half
    only; and the storage of the block's input."""
    torch.manual_seed(0)
    model = Llama(config)
    batch = PackedBatch.from_lengths(
        torch.randint(0, config.vocab_size, (1, length)),
        [[length // 2, length // 4, length // 4]],
        reset_position_ids=True,
    )
    meta = build_attention_metadata(batch, "sdpa")
    h = model.tok_embeddings(batch.tokens).detach().requires_grad_()
    cos, sin = model._rope(batch.position_ids, h.dtype)
    shared = {t.untyped_storage().data_ptr() for t in [*model.parameters(), cos, sin]}
    # autocast's cached bf16 weights (linear saves them transposed)
    weight_shapes = {s for p in model.parameters() for s in (p.shape, p.shape[::-1])}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in shared and t.shape not in weight_shapes:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    block = model.layers[0]
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        if ffn_half_only:  # the residual add around it saves nothing
            block.feed_forward(block.ffn_norm(h))
        else:
            block(h, cos, sin, meta)
    return saved, h.untyped_storage().data_ptr()


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_block_activations_are_what_autograd_saves(precision):
    length = 384  # no activation shares a weight's shape
    autocast = precision == "bf16-mixed"
    saved, block_input = saved_by_one_block(TINY, length, autocast)
    measured = sum(saved.values())
    layout = RunLayout(seq_len=length, precision=precision)
    predicted = layer_activation_bytes(TINY, layout, length)
    # the per-bucket logsumexp of the three documents is padded to their bucket: a few bytes
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)
    # what checkpointing keeps of a block is among what the block saves: counted once
    assert block_input in saved

    ffn_saved, _ = saved_by_one_block(TINY, length, autocast, ffn_half_only=True)
    ffn_predicted = ffn_activation_bytes(TINY, layout, length)
    assert ffn_predicted == sum(ffn_saved.values())


def test_context_parallel_attention_saves_no_gathered_row():
    """The plan counts the gathered K/V's gradient, in the attention's backward, and no
    gathered K/V kept for it: the rows are read, never saved."""
    lengths = [700, 100, 224]  # the 700-token document crosses into rank 1's chunks
    batch = PackedBatch.from_lengths(
        torch.randint(0, 512, (1, 1024)), [lengths], reset_position_ids=True
    )
    shard = context_shard(batch, 1, 2, no_gather, balance="head_tail")
    meta = build_attention_metadata(shard, "sdpa")
    q = torch.randn(1, 1024, 4, 64, requires_grad=True)
    k_row, v_row = (torch.randn(1, 1024, 2, 64, requires_grad=True) for _ in range(2))
    idx = shard.global_index[0]  # one row
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attention_over_row(q[:, idx], k_row[:, idx], v_row[:, idx], k_row, v_row, meta)
    assert k_row.untyped_storage().data_ptr() not in saved
    assert v_row.untyped_storage().data_ptr() not in saved
    out.sum().backward()
    assert k_row.grad.shape == k_row.shape  # the gradient is a whole row's

    layout = RunLayout(seq_len=1024, devices=2, context_parallel=2, doc_lengths=tuple(lengths))
    plan = planner.plan(TINY, dataclasses.replace(layout, activation_checkpointing=True), CPU)
    (gradient,) = [t for t in plan.terms if t.name.startswith("gathered K/V")]
    assert gradient.bytes == 2 * 1024 * 2 * 64 * 4 and gradient.phases == (ATTENTION_PHASE,)


def test_a_hand_computed_plan():
    """tiny, fp32, sdpa, one 4096-token row on one process."""
    plan = planner.plan(TINY, RunLayout(seq_len=4096), CPU)
    params = 3_410_176
    assert term(plan, "parameters") == 4 * params
    assert term(plan, "optimizer state") == 8 * params
    # per token and block: 2 norm inputs (256 fp32) + 2 x 1/rms + 3 linear inputs (256) +
    # q, k, v, out (256 + 128 + 128 + 256) + 4 heads' logsumexp + 4 SwiGLU tensors (768)
    per_token = 4 * (2 * 256) + 8 + 4 * (3 * 256) + 4 * 768 + 16 + 4 * (4 * 768)
    assert per_token == 20504
    assert term(plan, "activations (3 other blocks saved)") == 3 * 4096 * per_token
    # one fp32 [4096, 512] buffer and the hidden states' gradient (the weight's is the .grad)
    assert term(plan, "chunked loss buffers") == 4096 * 512 * 4 + 4096 * 256 * 4
    # the peak: held terms (3 other blocks, RoPE tables and ids) and the feed-forward's
    # backward: the block in backward, the gradients of silu's and w3's outputs (768) and of
    # the residual and the branch (256)
    held = 16 * params + 3 * 4096 * per_token + 4096 * (64 * 4 + 3 * 8) + CPU.baseline_bytes
    ffn_backward = 4096 * (per_token + 4 * (2 * 768 + 2 * 256))
    assert plan.total_bytes == held + ffn_backward
    assert plan.fits and plan.step is None


def test_the_loss_term_under_bf16_mixed_adds_its_bf16_buffer_and_weight_gradient():
    """bf16 logits beside the fp32 buffer, and the output weight's bf16 gradient, which is cast
    to the fp32 .grad (so it is not the gradients term's)."""
    plan = planner.plan(TINY, RunLayout(seq_len=4096, precision="bf16-mixed"), CPU)
    expected = 4096 * 512 * (4 + 2) + 4096 * 256 * 2 + 512 * 256 * 2
    assert term(plan, "chunked loss buffers") == expected


def test_terms_scale_as_they_must():
    base = RunLayout(seq_len=4096)
    one = planner.plan(TINY, base, CPU)
    double = planner.plan(TINY, dataclasses.replace(base, seq_len=8192), CPU)
    saved = "activations (3 other blocks saved)"
    assert term(double, saved) == 2 * term(one, saved)  # sdpa: linear in L

    for n in (1024, 2048):  # eager: + fp32 [H, L, L] probabilities and K, V repeated per head
        sdpa = layer_activation_bytes(TINY, dataclasses.replace(base, seq_len=n), n)
        eager = dataclasses.replace(base, seq_len=n, attn_backend="eager")
        extra = layer_activation_bytes(TINY, eager, n) - sdpa
        assert extra == 4 * n * n * 4 + 2 * n * (4 * 64) * 4

    cp2 = planner.plan(TINY, dataclasses.replace(base, devices=2, context_parallel=2), CPU)
    assert term(cp2, saved) == term(one, saved) // 2  # CP divides the row
    assert term(cp2, "kept K/V spans") > 0

    fsdp = RunLayout(seq_len=8192, num_nodes=2, devices=8, fsdp=True, precision="bf16")
    sharded = planner.plan(LLAMA_8B, fsdp, H100)
    replicated = planner.plan(LLAMA_8B, dataclasses.replace(fsdp, fsdp=False), H100)
    for name in ("parameters", "gradients", "optimizer state"):
        assert term(sharded, name) == term(replicated, name) // 16

    ckpt = planner.plan(TINY, dataclasses.replace(base, activation_checkpointing=True), CPU)
    assert ckpt.total_bytes < one.total_bytes
    assert term(ckpt, "activations (4 block inputs") == 4 * 4096 * 256 * 4


def test_the_suggestion_fits_when_replanned():
    layout = RunLayout(seq_len=131072, devices=8, fsdp=True, precision="bf16")
    plan = planner.plan(LLAMA_8B, layout, H100)
    assert not plan.fits and plan.largest.name.startswith("activations")
    assert plan.suggestion is not None and plan.suggestion != layout
    assert planner.plan(LLAMA_8B, plan.suggestion, H100).fits
    assert "activation_checkpointing=True" in plan.suggestion_change


def test_step_time_counts_in_document_attention_and_kv_traffic():
    layout = RunLayout(seq_len=32768, devices=8, context_parallel=8, fsdp=True, precision="bf16")
    whole = planner.plan(LLAMA_8B, layout, H100).step
    docs = planner.plan(LLAMA_8B, dataclasses.replace(layout, doc_lengths=(1024,)), H100).step
    assert docs.flops_per_rank < whole.flops_per_rank  # attention only inside documents
    # per block: K and V of the row, 7/8 from the others, 1024 wide, bf16; forward + backward
    per_block = 2 * 32768 * 7 / 8 * 1024 * 2
    assert whole.kv_bytes == pytest.approx(per_block * 2 * 32)
    assert whole.tokens_per_s_per_gpu == pytest.approx(32768 / 8 / whole.step_s)


def test_unknown_device_asks_for_the_keys_by_name():
    with pytest.raises(PlanError, match="planner.device_memory_gb and peak_flops_per_device"):
        planner.known_device("TPU v5")
    no_peak = dataclasses.replace(H100, peak_flops=None)
    with pytest.raises(PlanError, match="peak_flops_per_device"):
        step_time(TINY, RunLayout(seq_len=4096), no_peak, 0.4)


def test_dry_run_prints_the_plan_and_allocates_nothing(tmp_path, capsys):
    """An 8B at 128k on 4 nodes: allocating it would need ~120 GiB on this machine."""
    overrides = [
        *FAST,
        "model=llama3_8b",
        "data.seq_len=131072",
        "data.micro_batch_size=1",
        "trainer=fsdp",
        "trainer.num_nodes=4",
        "trainer.devices=8",
        "parallel.context_parallel=4",
        "planner.device=H100",
        "dry_run=true",
    ]
    report = run(compose(overrides, output_dir=tmp_path))
    out = capsys.readouterr().out
    assert (
        "capacity plan, per rank: H100, 4 node(s) x 8 device(s), FSDP2, context_parallel=4" in out
    )
    assert "largest term:" in out and "tokens/s per GPU" in out
    assert report["plan"]["layout"]["context_parallel"] == 4
    assert report["plan"]["fits"] is True


def test_dry_run_reports_the_data_parallel_balance_both_ways(tmp_path, capsys):
    """Llama 3 8B at 32k on 64 H100s (FSDP2), accumulation 4, a long-tailed lognormal mix:
    the plan predicts the rank-work imbalance and step time with and without data.dp_balance,
    the balanced step faster; one document per row leaves nothing to balance."""
    overrides = [
        *FAST,
        "model=llama3_8b",
        "data.seq_len=32768",
        "data.micro_batch_size=1",
        "trainer=fsdp",
        "trainer.num_nodes=8",
        "trainer.devices=8",
        "optim.accumulate_grad_batches=4",
        "planner.device=H100",
        "planner.doc_length_median=2000",
        "planner.doc_length_sigma=2.0",
        "data.dp_balance=true",
        "dry_run=true",
    ]
    report = run(compose(overrides, output_dir=tmp_path))
    out = capsys.readouterr().out
    assert "data-parallel balance (data.dp_balance=on; 64 ranks x 4 rows per step" in out
    balance = report["plan"]["dp_balance"]
    assert balance["imbalance_before"] > balance["imbalance_after"] >= 1.0
    assert balance["step_s_before"] > balance["step_s_after"] > 0 and balance["speedup"] > 1
    worst_case = [o for o in overrides if "doc_length" not in o and "dp_balance" not in o]
    report = run(compose(worst_case, output_dir=tmp_path / "one"))
    balance = report["plan"]["dp_balance"]
    assert balance["imbalance_before"] == balance["imbalance_after"] == 1.0
    assert "data.dp_balance=off" in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["trainer.accelerator=gpu"], "planner.device_memory_gb"),
        (["trainer.accelerator=gpu", "planner.device_memory_gb=80"], "peak_flops_per_device"),
        (["planner.device=TPU"], "planner.device_memory_gb and peak_flops_per_device"),
        (["trainer.devices=2", "parallel.context_parallel=4"], "must divide the world size"),
        (["trainer.devices=2", "parallel.context_parallel=2", "data.seq_len=251"], "multiple"),
    ],
)
def test_dry_run_bad_input_names_the_key(overrides, names, tmp_path):
    if torch.cuda.is_available() and "trainer.accelerator=gpu" in overrides:
        pytest.skip("a visible GPU supplies the numbers")
    cfg = compose([*FAST, *overrides, "dry_run=true"], output_dir=tmp_path)
    with pytest.raises(ConfigError, match=names):
        run(cfg)
