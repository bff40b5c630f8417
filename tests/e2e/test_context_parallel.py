"""Context parallelism on CPU: sharding, attention per rank, and whole models over gloo ranks.

Single-process tests simulate every rank of a group: rank r's queries attend to the true whole-row
keys (what the gather delivers), and the ranks' outputs and gradients together must equal the
unsharded computation. tests/context_parallel_script.py runs the real thing over 2 and 4 gloo
processes, gather and reduce-scatter included.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import (
    FAST,
    SCRIPTS,
    assert_close_scaled,
    compose,
    final_params,
    read_metrics,
    run_train,
    train_losses,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from longctx.batch import PackedBatch
from longctx.distributed.context_parallel import (
    ContextShard,
    context_shard,
    gather_row,
    lower_right_causal_attention,
)
from longctx.distributed.layout import ParallelConfig
from longctx.model import Llama, LlamaConfig
from longctx.model.attention import attention, attention_over_row, build_attention_metadata
from longctx.model.attention.flash import context_key_spans
from longctx.train.app import run
from longctx.train.preflight import ConfigError, check_backend, check_parallel

H, HKV, D = 4, 2, 16
L = 96
# documents straddling chunk edges, one longer than a chunk, tiny ones, a pad-like tail
ROWS = [[5, 30, 1, 17, 40, 3], [96], [11, 12, 13, 14, 15, 16, 15]]
TAIL_PAD = 3  # the batch's last segment: a "pad tail" of TAIL_PAD tokens without labels


def make_batch(rows=ROWS, length=L, reset=False, seed=0) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (len(rows), length), generator=gen)
    batch = PackedBatch.from_lengths(tokens, rows, reset_position_ids=reset)
    batch.labels[-1, -TAIL_PAD:] = -100
    return batch


def make_qkv(b: int, length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, length, H, D, generator=gen)
    k, v = (torch.randn(b, length, HKV, D, generator=gen) for _ in range(2))
    return q, k, v


# --------------------------------------------------------------------------- sharding
def test_shards_cover_every_row_token_once_head_tail():
    batch = make_batch()
    size = 4
    shards = [context_shard(batch, r, size) for r in range(size)]
    seen = torch.cat([s.global_index for s in shards]).sort().values
    assert torch.equal(seen, torch.arange(L))
    c = L // (2 * size)
    assert shards[1].global_index.tolist() == [*range(c, 2 * c), *range(6 * c, 7 * c)]
    for s in shards:
        assert torch.equal(s.tokens, batch.tokens[:, s.global_index])
        assert torch.equal(s.labels, batch.labels[:, s.global_index])
        assert torch.equal(s.position_ids, batch.position_ids[:, s.global_index])
        assert s.row_len == L and s.num_loss_tokens > 0
    assert sum(s.num_loss_tokens for s in shards) == batch.num_loss_tokens


def test_pieces_record_the_keys_before_them_on_other_chunks():
    batch = make_batch(rows=[[5, 30, 61]], length=96)
    shard = context_shard(batch, 1, 2)  # chunks [24, 48) and [48, 72)
    assert shard.seq_lens.tolist() == [[11, 13, 24]]
    # [24, 35) continues the document [5, 35); [35, 48) starts one; [48, 72) continues it
    assert shard.key_prefix_lens.tolist() == [[19, 0, 13]]


def test_rounds_interleave_head_tail_pairs_along_the_row():
    shard = context_shard(make_batch(), 0, 2, rounds=3)  # 12 chunks of 8 tokens
    starts = shard.global_index[::8].tolist()
    assert starts == [0, 24, 32, 56, 64, 88]  # chunks 0, 3 of each segment of 4 chunks
    assert torch.equal(shard.tokens, make_batch().tokens[:, shard.global_index])


@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=12),
    size=st.sampled_from([1, 2, 3, 4]),
    rounds=st.sampled_from([1, 2, 3]),
)
@settings(max_examples=40, deadline=None)
def test_dense_masks_of_all_shards_are_the_rows_mask(lengths, size, rounds):
    chunks = 2 * size * rounds
    length = chunks * (-(-sum(lengths) // chunks))  # round up to a multiple of the chunks
    batch = make_batch(rows=[lengths], length=length)
    full = batch.to_dense_mask()
    covered = []
    for r in range(size):
        shard = context_shard(batch, r, size, rounds=rounds)
        assert torch.equal(shard.to_dense_mask(), full[:, shard.global_index])
        covered += shard.global_index.tolist()
    assert sorted(covered) == list(range(length))


def test_bad_splits_are_named():
    batch = make_batch()
    with pytest.raises(ValueError, match=r"L=96 .* multiple of 2\*size\*rounds=10"):
        context_shard(batch, 0, 5)
    with pytest.raises(ValueError, match=r"multiple of 2\*size\*rounds=20"):
        context_shard(batch, 0, 2, rounds=5)
    with pytest.raises(ValueError, match="rank=2, size=2"):
        context_shard(batch, 2, 2)
    with pytest.raises(ValueError, match="size=0"):
        context_shard(batch, 0, 0)


def test_a_shard_of_size_two_without_group_cannot_gather():
    shard = context_shard(make_batch(), 0, 2)
    with pytest.raises(ValueError, match="needs the process group"):
        build_attention_metadata(shard, "sdpa")


def test_shard_moves_with_its_metadata():
    shard = context_shard(make_batch(), 1, 2, group="g")
    moved = shard.to("cpu")
    assert isinstance(moved, ContextShard)
    assert (moved.cp_rank, moved.cp_size, moved.group) == (1, 2, "g")
    assert torch.equal(moved.key_prefix_lens, shard.key_prefix_lens)


# --------------------------------------------------------------------------- attention
def simulated_ranks(backend, batch: PackedBatch, size: int, q, k, v, rounds=1) -> torch.Tensor:
    """Every rank's output written back to its row positions: [B, L, H, D]."""
    out = torch.zeros_like(q)
    for r in range(size):
        shard = context_shard(batch, r, size, group="simulated", rounds=rounds)
        meta = build_attention_metadata(shard, backend)
        idx = shard.global_index
        out = out.index_copy(
            1, idx, attention_over_row(q[:, idx], k[:, idx], v[:, idx], k, v, meta)
        )
    return out


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex"])
@pytest.mark.parametrize("size, rounds", [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_ranks_together_equal_unsharded_attention(backend, size, rounds):
    length = 1024 if backend == "flex" else L  # flex: chunks of whole 128-token tiles
    rows = ROWS if backend != "flex" else [[100, 300, 7, 600, 17], [1024], [37] * 27 + [25]]
    batch = make_batch(rows=rows, length=length)
    q, k, v = make_qkv(len(rows), length)
    with torch.no_grad():
        expected = attention(q, k, v, build_attention_metadata(batch, "eager"))
        got = simulated_ranks(backend, batch, size, q, k, v, rounds)
    assert_close_scaled(got, expected)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("size, rounds", [(2, 1), (3, 1), (2, 4)])
def test_ranks_together_give_the_unsharded_gradients(backend, size, rounds):
    batch = make_batch()
    q, k, v = make_qkv(len(ROWS), L)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        (fn(*leaves) * weight).sum().backward()
        return [t.grad for t in leaves]

    expected = grads(lambda q, k, v: attention(q, k, v, build_attention_metadata(batch, "eager")))
    got = grads(lambda q, k, v: simulated_ranks(backend, batch, size, q, k, v, rounds))
    for g, e in zip(got, expected, strict=True):
        assert_close_scaled(g, e)


@pytest.mark.parametrize("size, rounds", [(2, 1), (3, 2)])
def test_flash_key_spans_feed_a_varlen_kernel_exactly(size, rounds):
    """The flash path's inputs (query cu_seqlens = the shard's, packed key spans, key
    cu_seqlens) run through a CPU stand-in of a bottom-right causal varlen kernel."""
    batch = make_batch()
    q, k, v = make_qkv(len(ROWS), L)
    with torch.no_grad():
        expected = attention(q, k, v, build_attention_metadata(batch, "eager"))
        for r in range(size):
            shard = context_shard(batch, r, size, group="simulated", rounds=rounds)
            keys = context_key_spans(shard)
            q_flat = q[:, shard.global_index].flatten(0, 1)
            k_packed, v_packed = (x.flatten(0, 1)[keys["key_index"]] for x in (k, v))
            cu_q, cu_k = shard.cu_seqlens.tolist(), keys["cu_seqlens_k"].tolist()
            outs = [
                lower_right_causal_attention(
                    q_flat[cu_q[i] : cu_q[i + 1]],
                    k_packed[cu_k[i] : cu_k[i + 1]],
                    v_packed[cu_k[i] : cu_k[i + 1]],
                )
                for i in range(len(cu_q) - 1)
            ]
            got = torch.cat(outs).view(len(ROWS), -1, H, D)
            assert keys["max_seqlen_k"] == int(keys["cu_seqlens_k"].diff().max())
            assert_close_scaled(got, expected[:, shard.global_index])


def test_lower_right_causal_attention_in_many_blocks(monkeypatch):
    import longctx.distributed.context_parallel as cp

    q, k, v = make_qkv(1, 40)
    q, k, v = q[0, 25:], k[0], v[0]  # 15 queries, the last of 40 keys
    weight = torch.randn(15, H, D)

    def value_and_grads():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = lower_right_causal_attention(*leaves)
        (out * weight).sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    one_call = value_and_grads()
    monkeypatch.setattr(cp, "MASK_BLOCK_ELEMENTS", 40 * 4)  # blocks of 4 queries, checkpointed
    for got, expected in zip(value_and_grads(), one_call, strict=True):
        assert_close_scaled(got, expected)
    mask = torch.ones(15, 40, dtype=torch.bool).tril(25)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).repeat_interleave(2, 0),
        v.transpose(0, 1).repeat_interleave(2, 0),
        attn_mask=mask,
    ).transpose(0, 1)
    assert_close_scaled(one_call[0], ref)


def test_gather_row_without_a_group_puts_chunks_back_in_row_order():
    x = torch.arange(12).view(1, 12)
    assert torch.equal(gather_row(x, None, 1), x)
    assert torch.equal(gather_row(x, None, 1, rounds=3), x)


# --------------------------------------------------------------------------- models over gloo
SCRIPT = SCRIPTS / "context_parallel_script.py"


@pytest.mark.parametrize(
    "world, context_parallel, rounds", [(2, 2, 1), (2, 2, 3), (4, 4, 1), (4, 2, 2)]
)
def test_model_over_gloo_ranks_equals_one_rank(world, context_parallel, rounds):
    """Logits, loss and every parameter gradient of W gloo ranks equal one process (1e-5);
    (4, 2, _) is a 2 x 2 mesh: two data-parallel replicas, each row split over two ranks."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(world), str(context_parallel), str(rounds)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compared" in proc.stdout


def tiny_config(**overrides) -> LlamaConfig:
    fields = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)
    return LlamaConfig(**(fields | {"max_seq_len": 256, "attn_backend": "sdpa"} | overrides))


def test_model_with_one_rank_shard_equals_the_batch():
    """N=1 runs the context-parallel code path (two chunks, spliced pieces) without a group."""
    torch.manual_seed(0)
    model = Llama(tiny_config())
    batch = make_batch(reset=True)
    shard = context_shard(batch, 0, 1)
    assert_close_scaled(model(shard), model(batch))
    loss, n = model.loss(shard)
    expected_loss, expected_n = model.loss(batch)
    assert n == expected_n
    assert_close_scaled(loss, expected_loss)


# --------------------------------------------------------------------------- train.py
CP_RUN = [
    *FAST,
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.deterministic=true",
    "callbacks.checkpoint.every_n_train_steps=3",
    "callbacks.checkpoint.save_top_k=-1",
]
CP2 = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "parallel.context_parallel=2"]


def assert_same_training(run_dir: Path, reference: Path, first_step: int = 0) -> None:
    """Same train and validation losses and parameters as the reference run (from first_step
    on), to fp32 noise; parameters only from single-file checkpoints (FSDP2 writes folders)."""
    assert train_losses(run_dir) == pytest.approx(train_losses(reference)[first_step:], rel=1e-5)
    val = [val_losses(d) for d in (run_dir, reference)]
    assert val[0] == pytest.approx(val[1][len(val[1]) - len(val[0]) :], rel=1e-5)
    if (run_dir / "checkpoints" / "last.ckpt").is_dir():
        return
    got, expected = final_params(run_dir), final_params(reference)
    for name, value in expected.items():
        # AdamW moves a weight by up to lr (6e-4 here) per step whatever its gradient's size, so
        # reduction-order noise in a near-zero gradient shows at the scale of lr, not of the
        # weight: the bound is 2% of one step's update
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=0, msg=name)


def val_losses(run_dir: Path) -> list[float]:
    return [float(r["val/loss"]) for r in read_metrics(run_dir) if r.get("val/loss")]


def step3_checkpoint(run_dir: Path, tmp_path: Path) -> Path:
    mid = tmp_path / f"{run_dir.name}_step3.ckpt"  # a plain name: Hydra would need '=' quoted
    next((run_dir / "checkpoints").glob("*step=3.ckpt")).rename(mid)
    return mid


@pytest.mark.slow
def test_context_parallel_training_equals_one_rank_and_resumes_across_sizes(tmp_path):
    """6 AdamW steps: 2 ranks splitting every row (no data parallelism) == 1 process; a
    checkpoint of either resumes on the other size and lands on the same parameters."""
    runs = tmp_path / "outputs" / "train"
    run_train([*CP_RUN, "run_name=cp1"], tmp_path)
    run_train([*CP_RUN, *CP2, "run_name=cp2"], tmp_path)
    assert_same_training(runs / "cp2", runs / "cp1")
    cp1_mid, cp2_mid = (
        step3_checkpoint(runs / "cp1", tmp_path),
        step3_checkpoint(runs / "cp2", tmp_path),
    )
    rounds = "parallel.context_parallel_rounds=4"  # and interleaved chunks, for good measure
    run_train([*CP_RUN, *CP2, rounds, "run_name=up", f"ckpt_path={cp1_mid}"], tmp_path)
    run_train([*CP_RUN, "run_name=down", f"ckpt_path={cp2_mid}"], tmp_path)
    assert_same_training(runs / "up", runs / "cp1", first_step=3)
    assert_same_training(runs / "down", runs / "cp1", first_step=3)


@pytest.mark.slow
def test_context_parallel_under_fsdp2_trains_like_one_process(tmp_path):
    runs = tmp_path / "outputs" / "train"
    run_train([*CP_RUN, "run_name=cp1"], tmp_path)
    fsdp = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"]
    run_train([*CP_RUN, *fsdp, "parallel.context_parallel=2", "run_name=fsdp_cp2"], tmp_path)
    assert_same_training(runs / "fsdp_cp2", runs / "cp1")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.context_parallel=2"], "context_parallel=2 must divide the world size 1"),
        ([*CP2, "parallel.context_parallel=3"], "context_parallel=3 must divide the world size 2"),
        ([*CP2, "data.seq_len=250"], "L=250 tokens cannot be split over context parallel size 2"),
        (["parallel.context_parallel=0"], "parallel.context_parallel=0; expected an integer >= 1"),
        (
            [*CP2, "parallel.context_parallel_rounds=3"],
            "parallel.context_parallel_rounds=3: a row of L=256 tokens cannot be split over "
            "context parallel size 2 in 3 round(s): L must be a multiple of 2*size*rounds=12",
        ),
    ],
)
def test_bad_context_parallel_config_stops_before_training(overrides, message, tmp_path):
    cfg = compose([*FAST, *overrides], output_dir=tmp_path)
    with pytest.raises(ConfigError, match=re.escape(message)):
        run(cfg)
    assert not (tmp_path / "checkpoints").exists()


HF_LIKE_SPEC = types.SimpleNamespace(supports_context_parallel=False)


def test_context_parallel_refuses_models_and_flex_shapes_it_cannot_split():
    trainer = OmegaConf.create({"devices": 4, "num_nodes": 1})
    with pytest.raises(ConfigError, match="only longctx's Llama"):
        check_parallel(trainer, HF_LIKE_SPEC, 256, ParallelConfig(context_parallel=2))
    flex = tiny_config(attn_backend="flex", max_seq_len=512)
    cuda = torch.device("cuda")  # nothing runs on it
    with pytest.raises(ConfigError, match=r"L=256 to be a multiple of 4 chunk\(s\) x 128 = 512"):
        check_backend(flex, 256, cuda, context_chunks=4)
    check_backend(flex, 512, cuda, context_chunks=4)  # whole blocks: fine
