"""model.init_from: transformers folders (sharded too) and longctx checkpoints initialise the
native Llama, as a new stage; shape mismatches and non-checkpoints are named."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import transformers
from module_fixtures import SMALL, fit, random_batch, small_module

from longctx.batch import PackedBatch
from longctx.hf.weight_source import InitFromError, load_hf, resolve
from longctx.model import Llama, LlamaConfig
from longctx.train.module import load_init_weights

# a transformers Llama with the shapes of module_fixtures.SMALL (the tiny preset's other fields)
HF_SMALL = dict(
    vocab_size=SMALL["vocab_size"],
    hidden_size=SMALL["dim"],
    intermediate_size=SMALL["ffn_dim"],
    num_hidden_layers=SMALL["n_layers"],
    num_attention_heads=SMALL["n_heads"],
    num_key_value_heads=SMALL["n_kv_heads"],
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=256,
    initializer_range=0.1,
)


def save_hf_small(path, dtype=torch.float32, shard: str | None = "20KB", **changes) -> str:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_SMALL, **changes}))
    model.to(dtype).save_pretrained(path, max_shard_size=shard or "10GB")
    return str(path)


def config_for(path, **overrides) -> LlamaConfig:
    return LlamaConfig.from_name("tiny", **{**SMALL, "init_from": str(path), **overrides})


def loaded(config: LlamaConfig) -> Llama:
    with torch.device("meta"):
        model = Llama(config)
    load_init_weights(model, "cpu")
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_transformers_folder_loads_its_weights(tmp_path, dtype):
    path = save_hf_small(tmp_path, dtype)
    assert (
        len(
            set(
                json.loads((tmp_path / "model.safetensors.index.json").read_text())[
                    "weight_map"
                ].values()
            )
        )
        > 1
    )
    ours = loaded(config_for(path))
    reference = load_hf(path, attn_backend="sdpa")
    for name, tensor in reference.state_dict().items():
        assert ours.state_dict()[name].dtype == torch.float32
        assert torch.equal(ours.state_dict()[name], tensor), name
    theirs = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = random_batch(3, [[40]], 40)
    with torch.no_grad():
        expected = theirs(input_ids=batch.tokens, position_ids=batch.position_ids).logits
        got = ours.eval()(batch)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


def test_module_reads_init_from_in_configure_model_as_a_new_stage(tmp_path):
    """LongCtxModule builds on meta and reads the weights in configure_model; the optimizer,
    schedule and step count start fresh, and training moves the weights from there."""
    path = save_hf_small(tmp_path / "hf")
    module = small_module(init_from=path)
    assert all(p.is_meta for p in module.model.parameters())
    trainer = fit(module, [random_batch(i, [[30, 34]], 64) for i in range(2)], max_steps=2)
    assert trainer.global_step == 2
    start = load_hf(path).state_dict()
    moved = [n for n, t in module.model.state_dict().items() if not torch.equal(t, start[n])]
    assert moved, "no weight trained"
    # the step-0 loss is the checkpoint's, i.e. the weights were loaded before training
    reference = small_module(init_from=path)
    load_init_weights(reference.model, "cpu")
    batch = random_batch(0, [[30, 34]], 64)
    first = fit(small_module(init_from=path), [batch], max_steps=1).callback_metrics["loss"]
    loss_sum, count = reference.model.loss(batch)
    assert float(first) == pytest.approx(float(loss_sum) / count, rel=1e-5)


def test_longctx_checkpoint_file_and_run_folder(tmp_path):
    """A run's last.ckpt (or its run folder) initialises a new stage with the same weights."""
    source = small_module(seed=3)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    trainer = fit(source, [random_batch(0, [[64]], 64)], max_steps=1, default_root_dir=tmp_path)
    ckpt.parent.mkdir(parents=True)
    trainer.save_checkpoint(ckpt)
    for path in (ckpt, tmp_path / "run"):
        model = loaded(LlamaConfig.from_name("tiny", **SMALL, init_from=str(path)))
        for name, tensor in source.model.state_dict().items():
            assert torch.equal(model.state_dict()[name], tensor), (path, name)


def test_sharded_longctx_checkpoint_folder(tmp_path):
    """A sharded (torch.distributed.checkpoint) folder in the layout Lightning's FSDP2
    strategy writes: {"state_dict": {"model.<name>": ...}}, read by offsets."""
    import torch.distributed.checkpoint as dcp

    source = small_module(seed=4).model
    state = {"state_dict": {f"model.{k}": v for k, v in source.state_dict().items()}}
    dcp.save(state, checkpoint_id=str(tmp_path / "last.ckpt"))
    assert resolve(tmp_path / "last.ckpt").kind == "longctx-sharded"
    model = loaded(LlamaConfig.from_name("tiny", **SMALL, init_from=str(tmp_path / "last.ckpt")))
    for name, tensor in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_rope_change_is_reported_not_refused(tmp_path):
    path = save_hf_small(tmp_path, shard=None)
    config = config_for(path, rope_theta=8e6)
    source = resolve(path)
    source.check(config)
    assert "rope_theta=500000.0" in source.rope_change(config)
    assert "rope_theta=8000000.0" in source.rope_change(config)
    assert source.rope_change(config_for(path)) is None


# --------------------------------------------------------------------------- bad input
def test_missing_path_is_named(tmp_path):
    with pytest.raises(InitFromError, match=r"init_from='.*nowhere' does not exist; expected"):
        resolve(tmp_path / "nowhere")


def test_not_a_checkpoint_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(InitFromError, match="is not a checkpoint torch can read"):
        resolve(tmp_path / "notes.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InitFromError, match="is not a checkpoint; expected a transformers"):
        resolve(tmp_path / "empty")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(InitFromError, match="run folder without checkpoints/last.ckpt"):
        resolve(tmp_path / "run")
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(InitFromError, match="has no 'state_dict'"):
        resolve(tmp_path / "other.pt")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(InitFromError, match=r"config.json but no \*.safetensors"):
        resolve(tmp_path / "hf")


def test_wrong_architecture_is_named(tmp_path):
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=97)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(InitFromError, match=r"model_type='gpt2' \(expected 'llama'\)"):
        resolve(tmp_path)
    torch.save(
        {"state_dict": {"model.hf_model.lm_head.weight": torch.zeros(2)}}, tmp_path / "x.ckpt"
    )
    with pytest.raises(InitFromError, match="expected longctx's Llama"):
        resolve(tmp_path / "x.ckpt")


def test_shape_mismatch_names_fields_and_tensors(tmp_path):
    path = save_hf_small(tmp_path / "hf", shard=None)
    with pytest.raises(InitFromError, match=r"dim: model 128 vs checkpoint 64; ffn_dim: model 256"):
        resolve(path).check(config_for(path, dim=128, ffn_dim=256))
    with pytest.raises(InitFromError, match="tie_embeddings: model True vs checkpoint False"):
        resolve(path).check(config_for(path, tie_embeddings=True))
    # a longctx checkpoint carries no config: the tensors are compared, by name and shape
    ckpt = tmp_path / "small.ckpt"
    state = {f"model.{k}": v for k, v in small_module().model.state_dict().items()}
    torch.save({"state_dict": state}, ckpt)
    with pytest.raises(
        InitFromError,
        match=r"feed_forward.w1.weight: model \(256, 64\) vs checkpoint \(128, 64\)",
    ):
        resolve(ckpt).check(LlamaConfig.from_name("tiny", **{**SMALL, "ffn_dim": 256}))
    with pytest.raises(InitFromError, match=r"missing \['layers.2.attention.wk.weight'"):
        resolve(ckpt).check(LlamaConfig.from_name("tiny", **{**SMALL, "n_layers": 3}))


def test_app_preflight_refuses_a_mismatched_init_from(tmp_path):
    from helpers import compose

    from longctx.train.app import ConfigError, run

    path = save_hf_small(tmp_path / "hf", shard=None)
    cfg = compose(["model=tiny", f"model.init_from={path}", "dry_run=true"], output_dir=tmp_path)
    with pytest.raises(
        ConfigError, match=r"vocab_size: model 512 vs checkpoint 97; dim: model 256"
    ):
        run(cfg)


# --------------------------------------------------------------------------- train.py
# the shapes of a tiny "Llama-3.1-8B": model=llama3_8b with its shapes overridden
TINY_8B = [
    "model=llama3_8b",
    "+model.vocab_size=512",
    "+model.dim=64",
    "+model.n_layers=2",
    "+model.n_heads=4",
    "+model.n_kv_heads=2",
    "+model.ffn_dim=128",
]
LLAMA31_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


def save_tiny_llama31(path, vocab_size: int = 512) -> str:
    """A transformers checkpoint shaped like TINY_8B with Llama 3.1's RoPE, sharded + index."""
    return save_hf_small(
        path,
        shard="40KB",
        vocab_size=vocab_size,
        rope_scaling=LLAMA31_ROPE,
        max_position_embeddings=131072,
    )


def first_batch(tmp_path):
    """The first global batch a fresh run of FAST composes (one data-parallel rank)."""
    from helpers import FAST, compose
    from hydra.utils import instantiate

    from longctx.data import LongCtxDataModule

    datamodule = LongCtxDataModule(instantiate(compose(FAST, output_dir=tmp_path).data))
    datamodule.prepare_data()
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def step_loss(model: Llama, batch) -> float:
    with torch.no_grad():
        loss_sum, count = model.loss(batch)
    return float(loss_sum) / count


@pytest.mark.slow
def test_issue_command_fsdp_context_parallel_then_a_next_stage(tmp_path):
    """`train.py model=llama3_8b model.init_from=<Llama 3.1 folder> model.rope_theta=8e6
    data.seq_len=... trainer=fsdp` at tiny scale (2 gloo ranks, context parallel 2): the first
    step's loss is the checkpoint's under theta 8e6. Its sharded last.ckpt (via the run folder)
    then starts a next stage with YaRN: fresh step count and data position, its weights."""
    from helpers import FAST, read_metrics, run_train, train_losses

    hf = save_tiny_llama31(tmp_path / "Llama-3.1-8B")
    runs = tmp_path / "outputs" / "train"
    save = ["trainer.max_steps=2", "callbacks.checkpoint.every_n_train_steps=2"]
    proc = run_train(
        [*FAST, *TINY_8B, f"model.init_from={hf}", "model.rope_theta=8e6", "data.seq_len=256",
         "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2",
         "parallel.context_parallel=2", *save, "run_name=stage1"],
        tmp_path,
    )  # fmt: skip
    assert "trained with rope_theta=500000.0" in proc.stdout, proc.stdout[-2000:]
    batch = first_batch(tmp_path)
    expected = load_hf(hf, attn_backend="sdpa", rope_theta=8e6)
    losses = train_losses(runs / "stage1")
    assert losses[0] == pytest.approx(step_loss(expected, batch), rel=1e-5)
    assert (runs / "stage1" / "checkpoints" / "last.ckpt").is_dir()  # sharded

    yarn = "model.rope_scaling={type: yarn, factor: 4}"
    run_train(
        [*FAST, *TINY_8B, f"model.init_from={runs / 'stage1'}", yarn, *save, "run_name=stage2"],
        tmp_path,
    )
    config = LlamaConfig.from_name(
        "llama3_8b", vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
        rope_scaling={"type": "yarn", "factor": 4}, attn_backend="sdpa",
        init_from=str(runs / "stage1"),
    )  # fmt: skip
    stage2 = train_losses(runs / "stage2")
    assert len(stage2) == 2  # a new stage: steps counted from 0
    assert stage2[0] == pytest.approx(step_loss(loaded(config), batch), rel=1e-5)
    assert abs(stage2[0] - losses[0]) > 1e-3  # stage 1's training moved the weights
    lrs = [float(r["train/lr"]) for r in read_metrics(runs / "stage1") if r.get("train/lr")]
    lrs2 = [float(r["train/lr"]) for r in read_metrics(runs / "stage2") if r.get("train/lr")]
    assert lrs2 == lrs  # the schedule restarts

    # ckpt_path= still resumes the stage (its weights, step and data position), init_from or not
    proc = run_train(
        [*FAST, *TINY_8B, f"model.init_from={runs / 'stage1'}", yarn, "trainer.max_steps=3",
         "run_name=stage2", "ckpt_path=last"],
        tmp_path,
    )  # fmt: skip
    assert "rank 0/1 stopped at step 3" in proc.stdout, proc.stdout[-2000:]
    assert f"model.init_from={runs / 'stage1'} does not apply: this start resumes" in proc.stdout

    # the stage as a transformers folder: YaRN config, same logits, through the CLI
    out = tmp_path / "exported"
    subprocess.run(
        [sys.executable, "-m", "longctx.hf.export", str(runs / "stage2"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert theirs.config.rope_parameters["rope_type"] == "yarn"
    assert theirs.config.rope_parameters["rope_theta"] == 500000.0
    ours = loaded(dataclasses.replace(config, init_from=str(runs / "stage2")))
    row = batch.tokens[:1, :200], torch.arange(200)[None]
    with torch.no_grad():
        expected = theirs(input_ids=row[0], position_ids=row[1]).logits
        got = ours.eval()(PackedBatch.from_lengths(row[0], [[200]], reset_position_ids=False))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


def test_init_from_vocabulary_must_cover_the_data_tokenizer(tmp_path):
    from helpers import FAST, run_train

    hf = save_tiny_llama31(tmp_path / "small_vocab", vocab_size=200)
    shapes = [a.replace("vocab_size=512", "vocab_size=200") for a in TINY_8B]
    proc = run_train(
        [*FAST, *shapes, f"model.init_from={hf}", "trainer.max_steps=1"], tmp_path, check=False
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.vocab_size=200" in proc.stderr and "vocab_size 259" in proc.stderr
